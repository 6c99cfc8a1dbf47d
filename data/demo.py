"""Offline demo assets: a real-English corpus, a base model pretrained on it, and a task to teach.

Contract: `make_demo(dir) -> (model_dir, train_jsonl, eval_jsonl)` writes, with no network:
- `corpus.jsonl`: prose paragraphs from the docstrings of Python standard-library modules (present
  on every machine that runs Python, so a fresh clone needs no download) as `{"text": ...}` records,
  plus `{"messages": [...]}` records ("What does `json.dumps` do?" answered by the docstring's first
  paragraph). Modules and members are visited in sorted order: deterministic per Python version.
- `model/`: a byte-level BPE tokenizer trained on the corpus (ChatML special tokens and a Qwen-style
  chat template, loadable with `AutoTokenizer.from_pretrained(local_files_only=True)`) and a 3.5M
  parameter Qwen2 (4 layers, 4 query / 2 KV heads, tied embeddings) pretrained in full on the
  corpus by `data/demo_pretrain.py` (seeded, float32, CPU), so it writes corpus-like English and
  answers in the chat format before any LoRA. No shipped package holds a small pretrained
  checkpoint of a supported family (the smallest real Qwen2 has 0.5B parameters, far too slow for
  a CPU demo, and would need a download), so the base is made here.
- `train.jsonl` / `eval.jsonl`: the fine-tuning task (`data/demo_task.py`), which the base does not
  know: "Which topic are these words about: week timeout seconds" answered "Topic: time." (3-5 corpus
  words of one of three topics). A person checks an answer at a glance; no held-out word list occurs
  in training.
- `demo.json`, written last, is the stamp: when it is present with the current version and
  pretraining length and every file exists, nothing is rebuilt (an older cache is rebuilt). Assets
  are built in a temporary sibling directory and moved in, so an interrupted build never leaves a
  half-written directory that looks complete; a file lock lets one process build while others (pytest
  workers) wait and reuse. Call it on one rank and barrier before the others read.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import tempfile
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:   # not POSIX: no lock, as before
    fcntl = None

VERSION = 3   # 3: pretrained base + topic task (2: random base, docstring Q&A)
STAMP = "demo.json"
PRETRAIN_STEPS = 150   # about 60 s on 2 idle cores, loss 7.67 -> 4.0 (100 steps: corpus loss 5.3, too weak)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2-style ChatML, including its default system prompt when the conversation has none.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODULES = """abc argparse array ast base64 bisect calendar cmath codecs collections configparser contextlib
copy csv dataclasses datetime decimal difflib enum fnmatch fractions functools glob gzip hashlib heapq
hmac html inspect io itertools json locale logging math numbers operator os pathlib pickle platform
pprint queue random re sched secrets shlex shutil signal socket statistics string struct subprocess
tarfile tempfile textwrap threading time timeit traceback types unittest uuid warnings weakref zipfile
zlib""".split()
SYSTEM = "You answer questions about the Python standard library in plain English."


def _prose(doc: str) -> list[str]:
    """Paragraphs of a docstring that read like English sentences (no code, lists or signatures)."""
    out = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = [ln.strip() for ln in para.splitlines()]
        text = " ".join(" ".join(lines).split())
        if len(text) < 60 or not text[0].isupper() or not text.endswith("."):
            continue
        if any(m in text for m in (">>>", "::", "{", "}", "==", "->", "\\", "`")):
            continue
        if any(ln.startswith(("-", "*", "+", "|")) or ln.endswith(":") for ln in lines):
            continue
        words = text.split()
        if sum(w.strip(".,;:()'\"").isalpha() for w in words) < 0.8 * len(words):
            continue
        out.append(text)
    return out


def docstring_corpus() -> list[tuple[str, list[str]]]:
    """[(qualified name, prose paragraphs)] for public stdlib modules, classes and functions."""
    seen, out = set(), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some attributes warn on access (deprecated aliases)
        for name in sorted(MODULES):
            try:
                mod = importlib.import_module(name)
            except ImportError:  # a stripped-down Python: use what is there
                continue
            objs = [(name, mod)]
            for attr in sorted(a for a in dir(mod) if not a.startswith("_")):
                obj = getattr(mod, attr, None)
                if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj):
                    objs.append((f"{name}.{attr}", obj))
                if inspect.isclass(obj) and getattr(obj, "__module__", "") == name:
                    for m in sorted(k for k in vars(obj) if not k.startswith("_")):
                        f = vars(obj)[m]
                        if inspect.isfunction(f) or inspect.ismethoddescriptor(f):
                            objs.append((f"{name}.{attr}.{m}", f))
            for qual, obj in objs:
                doc = getattr(obj, "__doc__", None)
                # Re-exported objects repeat a docstring: keep each paragraph once.
                paras = [p for p in _prose(doc) if p not in seen] if isinstance(doc, str) else []
                seen.update(paras)
                if paras:
                    out.append((qual, paras))
    return out


def pretrain_texts(corpus, lo: int = 300, hi: int = 1000) -> list[str]:
    """The whole docstring corpus as text documents of about `lo`-`hi` characters."""
    texts, chunk = [], ""
    for _, paras in corpus:
        for p in paras:
            if chunk and len(chunk) + len(p) > hi:
                texts.append(chunk)
                chunk = ""
            chunk = f"{chunk}\n\n{p}" if chunk else p
            if len(chunk) >= lo:
                texts.append(chunk)
                chunk = ""
    return texts + ([chunk] if chunk else [])


def pretrain_chats(corpus) -> list[list[dict]]:
    """"What does `json.dumps` do?" answered by the docstring's first paragraph, so the base knows
    the chat template's turn structure and when to stop, as real base checkpoints do."""
    out = []
    for i, (q, paras) in enumerate(corpus):
        if "." in q and 60 <= len(paras[0]) <= 600:
            msgs = [{"role": "user", "content": f"What does `{q}` do?"}, {"role": "assistant", "content": paras[0]}]
            out.append(([{"role": "system", "content": SYSTEM}] if i % 3 == 0 else []) + msgs)
    return out


def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, wrapped for transformers, with ChatML specials + template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Qwen's convention: no BOS, <|endoftext|> ends documents and pads.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def model_config(tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, dtype="float32", architectures=["Qwen2ForCausalLM"],
    )


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _corpus_and_tokenizer():
    """The pretraining texts and chats of the docstring corpus, and the BPE trained on them."""
    corpus = docstring_corpus()
    texts, chats = pretrain_texts(corpus), pretrain_chats(corpus)
    return texts, chats, build_tokenizer(texts + [m["content"] for c in chats for m in c], vocab_size=2048)


def demo_tokenizer(out_dir: str | Path) -> Path:
    """The demo's tokenizer alone, for bench/: `out_dir` once it holds one, else built there from the corpus (~2 s of a
    core; the same BPE as the assets', without the pretraining that make_demo's model costs)."""
    out = Path(out_dir)
    if not (out / "tokenizer.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out.parent))
        _corpus_and_tokenizer()[2].save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)   # (whole or not at all)
    return out


def _build(out: Path, pretrain_steps: int, log) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from data.demo_pretrain import pretrain
    from data.demo_task import task_records

    hf_logging.disable_progress_bar()   # "Writing model shards" bars for a 14 MB file
    if log:
        log("building: docstring corpus, tokenizer, then pretraining the base (once; cached)")

    texts, chats, tokenizer = _corpus_and_tokenizer()
    tokenizer.save_pretrained(out / "model")
    train, held_out = task_records()
    _write_jsonl(out / "corpus.jsonl", [{"text": t} for t in texts] + [{"messages": c} for c in chats])
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "eval.jsonl", held_out)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(tokenizer), dtype=torch.float32)
    model.save_pretrained(out / "model")
    # Text documents end with <|endoftext|>; a rendered chat ends with its own <|im_end|>.
    docs = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    rendered = [tokenizer.apply_chat_template(c, tokenize=False).rstrip("\n") for c in chats]
    docs += tokenizer(rendered, add_special_tokens=False)["input_ids"]
    losses = pretrain(out / "model", docs, pretrain_steps, pad_id=tokenizer.pad_token_id, log=log)
    # transformers 5 writes `rope_parameters` and `dtype`; add the classic top-level keys too, so
    # older readers (transformers 4.x, other loaders) get rope_theta 1e6 rather than a default.
    cfg_path = out / "model" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 1e6))
    cfg.setdefault("torch_dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {
        "version": VERSION,
        "train_records": len(train),
        "eval_records": len(held_out),
        "pretrain_documents": len(docs),
        "pretrain_tokens": sum(map(len, docs)),
        "pretrain_steps": pretrain_steps,
        "pretrain_loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }


def _complete(out: Path, pretrain_steps: int) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    needed = ["train.jsonl", "eval.jsonl", "corpus.jsonl", "model/config.json", "model/model.safetensors",
              "model/tokenizer.json", "model/tokenizer_config.json"]
    same = (stamp.get("version"), stamp.get("pretrain_steps")) == (VERSION, pretrain_steps)
    return same and all((out / f).is_file() for f in needed)


def make_demo(out_dir: str | Path, pretrain_steps: int = PRETRAIN_STEPS, log=None) -> tuple[Path, Path, Path]:
    """Build (or reuse) the demo assets in `out_dir`; returns (model_dir, train_jsonl, eval_jsonl)."""
    out = Path(out_dir)
    paths = (out / "model", out / "train.jsonl", out / "eval.jsonl", out / "corpus.jsonl")
    if _complete(out, pretrain_steps):
        return paths[:3]
    out.mkdir(parents=True, exist_ok=True)
    # One builder at a time (parallel test workers, `make demo` beside `make test`): the others wait on the
    # lock, then find the stamp and reuse the assets instead of swapping files under a reader.
    with open(out / ".build.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(out, pretrain_steps):
            return paths[:3]
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out))
        try:
            info = _build(tmp, pretrain_steps, log)
            (out / STAMP).unlink(missing_ok=True)  # the stamp goes last: no stamp, no trust
            for p in paths:
                if p.is_dir():
                    shutil.rmtree(p)
                (tmp / p.name).replace(p)
            (out / STAMP).write_text(json.dumps(info, indent=1) + "\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return paths[:3]


def main(argv: list[str]) -> None:
    """`make demo` builds the assets here, with every core, before torchrun (whose ranks get 1 thread)."""
    import time

    t0 = time.time()
    make_demo(argv[0] if argv else "runs/demo_assets",
              log=lambda m: print(f"demo assets: {m} ({time.time() - t0:.0f}s)", flush=True))


if __name__ == "__main__":   # (the Makefile calls main() via -c: `-m data.demo` warns, data/ imports it)
    import sys

    main(sys.argv[1:])
