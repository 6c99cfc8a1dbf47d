"""Loading training data: the Python lists every rank built before, against data.store's compact samples and cache.

Three ways to the same samples of one JSONL file of long texts, each in a fresh process (so resident memory is its
own), side by side:
- lists: `tokenize_records` over all records at once, samples as Python lists of ints (train.py until 2026-12-01);
- tokenize: `load_samples` with an empty cache directory: chunked tokenization into int32 tensors, then the cache
  file written (a first run);
- cached: `load_samples` again (a rerun or resume): the file memory-mapped.
Time = wall time of the load; memory = the rise of resident memory (VmRSS) from before the load to after it (what
the samples hold once loaded), and of the peak (VmHWM, reset through /proc/self/clear_refs) during it. The tokenizer
is the demo's byte-level BPE (data.demo.build_tokenizer, 8,000 tokens) trained on the docstring corpus.

Run: .venv/bin/python bench/data.py [--records 400 --chars 100000]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mem(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1e6   # GB


def _one(mode, path, tok_dir, cache):   # in a fresh process
    from data import load_jsonl, load_tokenizer, tokenize_records
    from data.load import load_samples

    tok = load_tokenizer(tok_dir)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0, t0 = _mem("VmRSS:"), time.time()
    if mode == "lists":
        samples, stats = tokenize_records(load_jsonl(path), tok, 1 << 30, path)
    else:
        samples, stats = load_samples(path, tok, 1 << 30, len(tok), cache=cache)
    dt = time.time() - t0
    print(json.dumps(dict(mode=mode, s=dt, rss_gb=_mem("VmRSS:") - rss0, peak_gb=_mem("VmHWM:") - rss0,
                          tokens=stats.tokens, samples=len(samples))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--chars", type=int, default=100_000, help="characters per record (about 1/4 as many tokens)")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        return _one(*a.one)
    from data.demo import build_tokenizer, docstring_corpus

    d = tempfile.mkdtemp()
    texts = [" ".join(doc) for _, doc in docstring_corpus()]
    build_tokenizer(texts, 8000).save_pretrained(os.path.join(d, "tok"))
    words, rng = " ".join(texts).split(), random.Random(0)   # records: words drawn from the corpus
    path = os.path.join(d, "data.jsonl")
    with open(path, "w") as f:
        for _ in range(a.records):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=a.chars // 4))[:a.chars]}) + "\n")
    print(f"{a.records} records of {a.chars:,} characters ({os.path.getsize(path) / 1e6:.0f} MB)", flush=True)
    rows = {}
    for mode in ("lists", "tokenize", "cached"):
        out = subprocess.run([sys.executable, __file__, "--one", mode, path, os.path.join(d, "tok"),
                              os.path.join(d, "cache")], capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
        r = rows[mode]
        print(f"{mode:9s} {r['s']:7.2f} s  resident +{r['rss_gb']:.3f} GB  peak +{r['peak_gb']:.3f} GB  "
              f"{r['tokens']:,} tokens", flush=True)
    assert rows["lists"]["tokens"] == rows["tokenize"]["tokens"] == rows["cached"]["tokens"]
    lists = rows["lists"]
    for mode in ("tokenize", "cached"):
        r = rows[mode]
        print(f"{mode} / lists: time {r['s'] / lists['s']:.3f}x, resident {r['rss_gb'] / lists['rss_gb']:.3f}x, "
              f"peak {r['peak_gb'] / lists['peak_gb']:.3f}x")


if __name__ == "__main__":
    main()
