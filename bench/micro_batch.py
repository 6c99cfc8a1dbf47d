"""Short samples at a long --max-len: --micro-batch auto (rows cut by tokens) against --micro-batch 1, side by side.

One random-init checkpoint (bench/gpu.py's `write_checkpoint`: on CUDA the Qwen2.5-7B shape of bench/configs cut to
--layers, NF4; on CPU its smoke dims, fp32) and one data file of random-token texts: of every --period samples one is
--max-len long, the others between --short-lo and --short-hi tokens (a chat set with a few long documents). The same
train.py run twice in processes of their own (fresh interpreters on CUDA; on CPU children of one forkserver that
imported train once, bench/gpu.py's run_train), `--micro-batch 1` and `--micro-batch auto`, one warm-up step then
the median step of the rest: tokens/s of each, their ratio, and the largest difference of the per-step losses (the
same samples, so the same losses to float rounding). Timings are printed, never asserted (tests/test_bench_smoke.py
runs the CPU smoke case).

    python bench/micro_batch.py                          # CPU smoke: ~1 minute on 2 cores
    python3 bench/micro_batch.py --layers 8 --max-len 32768 --short-lo 512 --short-hi 4096 --global-batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_data(ckpt: str, path: str, n: int, max_len: int, lo: int, hi: int, period: int) -> list[int]:
    """`n` texts of random tokens: every `period`-th `max_len` tokens long, the others lo..hi; returns the lengths."""
    import torch

    from data import load_tokenizer

    tok = load_tokenizer(ckpt)
    g = torch.Generator().manual_seed(1)
    first, last = len(tok.all_special_ids) + 1, len(tok)
    lengths = []
    with open(path, "w") as f:
        for i in range(n):
            want = max_len if i % period == 0 else int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(first, last, (want,), generator=g).tolist()
            f.write(json.dumps({"text": tok.decode(ids)}) + "\n")
            lengths.append(want)
    return lengths


def run(ckpt: str, data: str, out: str, args, micro: str) -> list[dict]:
    import torch

    cuda = torch.cuda.is_available()
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--model", ckpt, "--data", data, "--max-len",
            str(args.max_len), "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--micro-batch",
            micro, "--quant", "nf4" if cuda else "none", "--dtype", "bf16" if cuda else "fp32", "--long-text",
            "truncate", "--warmup", "1", "--out", out, "--no-progress", "--save-minutes", "0", "--data-cache", "none"]
    if cuda:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"--micro-batch {micro} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    else:   # the CPU smoke: forked from one forkserver that imported train once (bench/gpu.py's run_train)
        from bench.gpu import run_train

        os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")   # (the forkserver's torch reads it)
        log = out + ".log"
        try:
            run_train(argv[2:], None, fork=True, log=log)
        except subprocess.CalledProcessError:
            sys.exit(f"--micro-batch {micro} failed:\n{open(log).read()[-4000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--short-lo", type=int, default=32)
    p.add_argument("--short-hi", type=int, default=160)
    p.add_argument("--period", type=int, default=16, help="one sample in this many is --max-len long")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", default=None, help="folder for the checkpoint, data and runs (default: a temporary one)")
    args = p.parse_args(argv)
    import torch

    from bench.gpu import write_checkpoint

    work = args.work or tempfile.mkdtemp(prefix="bench-mb-")
    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "qwen2.5-7b", "config.json")))
    ckpt = write_checkpoint(cfg, args.layers, args.max_len, work, smoke=not torch.cuda.is_available())
    data = os.path.join(work, "mixed.jsonl")
    lengths = write_data(ckpt, data, args.samples, args.max_len, args.short_lo, args.short_hi, args.period)
    print(f"{args.samples} samples: one in {args.period} of {args.max_len} tokens, the others {args.short_lo}-"
          f"{args.short_hi} (mean {statistics.mean(lengths):.0f}); --global-batch {args.global_batch}, "
          f"{args.steps} steps, {args.layers} layers, {'cuda' if torch.cuda.is_available() else 'cpu'}")
    rows = {m: run(ckpt, data, os.path.join(work, f"run-{m}"), args, m) for m in ("1", "auto")}
    speed = {m: statistics.median(r["tokens_per_s"] for r in rs[1:]) for m, rs in rows.items()}
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows["1"], rows["auto"]))
    for m in rows:
        print(f"--micro-batch {m:>4}: {speed[m]:,.0f} tokens/s (median of steps 2..{args.steps})")
    print(f"auto / 1: {speed['auto'] / speed['1']:.2f}x; largest loss difference {diff:.2e}")


if __name__ == "__main__":
    main()
