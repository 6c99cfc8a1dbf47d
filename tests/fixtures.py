"""Small, fast test assets shared by the test files (no network, well under a second each).

- `make_tokenizer(dir)`: a byte-level BPE tokenizer (~400 tokens) with the ChatML special tokens and
  the Qwen-style chat template of the demo, saved with `save_pretrained(dir)`; returns the loaded
  tokenizer. `<|endoftext|>` is EOS and pad; there is no BOS (Qwen's convention).
- `make_text_jsonl(path, n, seed)` / `make_chat_jsonl(path, n, seed)`: `n` records of varied length
  (text: 3-80 words; chat: an optional system message and 1-3 user/assistant turns), deterministic
  in `seed`. Both return the records they wrote; so does `make_pairs_jsonl` (preference pairs, TRL's forms).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEXT = """The tokenizer turns text into numbers and the model learns to predict the next one.
Long documents are split across ranks, and every rank computes attention over its own part.
A fox ran over the hill at dawn, while the river kept its slow and steady course to the sea.
Please explain what this function returns when the list is empty, and why it does so.
Sure: it returns zero, because the sum of no numbers is zero by convention.
Training is stable when the learning rate warms up slowly and the gradients are clipped.
What is the capital of France? Paris is the capital, and it lies on the river Seine.
Numbers such as 3, 14, 159 and 2653 appear in text too, with commas, colons; and quotes "like these".
"""
WORDS = sorted(set(TEXT.replace("\n", " ").split()))


def make_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    from data.demo import build_tokenizer

    tok = build_tokenizer([TEXT] * 4, vocab_size=400)
    tok.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _write(path: str | Path, records: list[dict]) -> list[dict]:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


def make_text_jsonl(path: str | Path, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return _write(path, [{"text": _sentence(rng, 3, 80)} for _ in range(n)])


def make_chat_jsonl(path: str | Path, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _sentence(rng, 2, 8)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": _sentence(rng, 2, 20)})
            msgs.append({"role": "assistant", "content": _sentence(rng, 1, 30)})
        records.append({"messages": msgs})
    return _write(path, records)


def make_pairs_jsonl(path: str | Path, n: int, seed: int = 0) -> list[dict]:
    """`n` preference pairs (--objective dpo), TRL's forms in turn: prompt/chosen/rejected strings, the same as lists of
    messages (with a system message at times), and whole texts with no "prompt" (their shared start is the prompt)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        q, a, b = _sentence(rng, 2, 24), _sentence(rng, 1, 16), _sentence(rng, 1, 16)
        if i % 3 == 0:
            records.append({"prompt": q + "?", "chosen": " " + a, "rejected": " " + b})
        elif i % 3 == 1:
            head = [{"role": "system", "content": _sentence(rng, 2, 6)}] if rng.random() < 0.5 else []
            records.append({"prompt": head + [{"role": "user", "content": q}],
                            "chosen": [{"role": "assistant", "content": a}], "rejected": b})
        else:
            records.append({"chosen": f"{q}. {a}", "rejected": f"{q}. {b}"})
    return _write(path, records)
