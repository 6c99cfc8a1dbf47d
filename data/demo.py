"""Offline demo assets: a real-English corpus, a tokenizer trained on it, and a tiny random Qwen2.

Contract: `make_demo(dir) -> (model_dir, train_jsonl, eval_jsonl)` writes, in a few seconds and
with no network:
- `train.jsonl` / `eval.jsonl`: prose paragraphs from the docstrings of Python standard-library
  modules (present on every machine that runs Python, so a fresh clone needs no download), as
  `{"text": ...}` records plus `{"messages": [...]}` records ("What does `json.dumps` do?" answered
  by the docstring's first paragraph) so both data paths run. Modules and members are visited in
  sorted order, so the output is deterministic for a given Python version.
- `model/`: a byte-level BPE tokenizer trained on the training text (ChatML special tokens and
  a Qwen-style chat template, loadable with `AutoTokenizer.from_pretrained(local_files_only=True)`)
  and a randomly initialised Qwen2 (`torch.manual_seed(0)`, ~3.5M parameters, tied embeddings)
  saved as `config.json` + `model.safetensors`.
- `demo.json`, written last, is the stamp: when it is present with the current version and every
  file exists, nothing is rebuilt. Assets are built in a temporary sibling directory and moved in,
  so an interrupted build never leaves a half-written directory that looks complete. Call it on one
  rank and barrier before the others read.
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

VERSION = 2
STAMP = "demo.json"
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


def build_records(corpus, n_text: int = 220, n_chat: int = 56, eval_every: int = 10):
    """Text records of ~300-1000 characters and chat Q&A records; every `eval_every`-th is held out."""
    texts, chunk = [], ""
    for _, paras in corpus:
        for p in paras:
            if chunk and len(chunk) + len(p) > 1000:
                texts.append(chunk)
                chunk = ""
            chunk = f"{chunk}\n\n{p}" if chunk else p
            if len(chunk) >= 300:
                texts.append(chunk)
                chunk = ""
    # Spread the picks over the whole corpus so that every module contributes.
    texts = [texts[i * len(texts) // n_text] for i in range(min(n_text, len(texts)))]
    answers = [(q, ps[0]) for q, ps in corpus if "." in q and 80 <= len(ps[0]) <= 600]
    answers = [answers[i * len(answers) // (2 * n_chat)] for i in range(min(2 * n_chat, len(answers)))]
    chats = []
    for i in range(0, len(answers) - 1, 2):
        (q1, a1), (q2, a2) = answers[i], answers[i + 1]
        msgs = [{"role": "user", "content": f"What does `{q1}` do?"}, {"role": "assistant", "content": a1}]
        if i % 4 == 0:  # every other conversation has two turns, so later turns are exercised too
            msgs += [{"role": "user", "content": f"And `{q2}`?"}, {"role": "assistant", "content": a2}]
        if i % 6 == 0:
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        chats.append({"messages": msgs})
    records = [{"text": t} for t in texts]
    # Interleave chats so both the train and the eval split get some.
    for j, c in enumerate(chats):
        records.insert(min(len(records), j * len(records) // max(1, len(chats))), c)
    train = [r for i, r in enumerate(records) if i % eval_every != eval_every - 1]
    held_out = [r for i, r in enumerate(records) if i % eval_every == eval_every - 1]
    return train, held_out


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
        # A random base with frozen tied embeddings caps the logit margin LoRA can reach at about
        # init_range · hidden_size (the final norm and lm_head are frozen): 0.02 gives ~5, too
        # little to even learn the corpus' unigram statistics; 0.05 gives ~13.
        initializer_range=0.05,
    )


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _build(out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    train, held_out = build_records(docstring_corpus())
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "eval.jsonl", held_out)
    texts = [r["text"] for r in train if "text" in r]
    texts += [m["content"] for r in train if "messages" in r for m in r["messages"]]
    tokenizer = build_tokenizer(texts, vocab_size=2048)
    tokenizer.save_pretrained(out / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(tokenizer), dtype=torch.float32)
    model.save_pretrained(out / "model")
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
        "chat_records": sum("messages" in r for r in train + held_out),
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }


def _complete(out: Path) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    needed = ["train.jsonl", "eval.jsonl", "model/config.json", "model/model.safetensors",
              "model/tokenizer.json", "model/tokenizer_config.json"]
    return stamp.get("version") == VERSION and all((out / f).is_file() for f in needed)


def make_demo(out_dir: str | Path) -> tuple[Path, Path, Path]:
    """Build (or reuse) the demo assets in `out_dir`; returns (model_dir, train_jsonl, eval_jsonl)."""
    out = Path(out_dir)
    paths = (out / "model", out / "train.jsonl", out / "eval.jsonl")
    if _complete(out):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out))
    try:
        info = _build(tmp)
        (out / STAMP).unlink(missing_ok=True)  # the stamp goes last: no stamp, no trust
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p)
            (tmp / p.name).replace(p)
        (out / STAMP).write_text(json.dumps(info, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths
