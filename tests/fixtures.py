"""Small, fast test assets shared by the test files (no network, well under a second each).

- `make_tokenizer(dir)`: a byte-level BPE tokenizer (~400 tokens) with the ChatML special tokens and
  the Qwen-style chat template of the demo, saved with `save_pretrained(dir)`; returns the loaded
  tokenizer. `<|endoftext|>` is EOS and pad; there is no BOS (Qwen's convention).
- `make_text_jsonl(path, n, seed)` / `make_chat_jsonl(path, n, seed)`: `n` records of varied length
  (text: 3-80 words; chat: an optional system message and 1-3 user/assistant turns), deterministic
  in `seed`. Both return the records they wrote; so does `make_pairs_jsonl` (preference pairs, TRL's forms).
- `save_sharp_model(config, directory)`: transformers' model of `config` from its own init (torch seed 0), float32,
  with every q_proj and k_proj (weight and bias) times `QK_SCALE`, saved with `save_pretrained(directory)`: the
  train.py tests' checkpoints (conftest's `assets`), whose attention must be peaked for a wrong logit to show.
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


# transformers' init (std 0.02) gives q.k logits near 0: the assets model's attention was uniform (entropy 1.000 of
# log(keys), mean max probability 0.038 over 64-token chat rows), so a bug that moves only the logits barely moved a
# run: a softmax scale x 1.02 on cp rank 1 (2026-12-07, helper 5) changed no loss by 1e-5 and the cp 2 x dp 2
# Ulysses runs passed test_train.py (their adapters within 9.3e-4); RoPE positions + 1 or a scale x 1.5 there moved
# the losses by under 1e-4 (the grad norms and adapters failed). q and k x 14 (logits x 196) peak it (entropy 0.36-0.37
# of uniform, mean max probability 0.59-0.60 in both layers) and keep it well conditioned (loss 5.99 as before;
# transformers' grad norm on one row 2.7 for 1.5): the x 1.02 scale now moves the losses by up to 3.7e-4 and the grad
# norms by 3e-3 to 8e-3, failing every CP comparison. A layout's own round-off: losses and grad norms within 1e-6 as
# before, adapters within about 1e-4 (tolerance 1e-3; before, 5e-7: a logit's absolute round-off grows with the logit).
QK_SCALE = 14.0


def save_sharp_model(config, directory: str | Path):
    """transformers' model of `config` (torch seed 0), float32, q_proj and k_proj x QK_SCALE, saved to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                n += 1
                for p in mod.parameters(recurse=False):
                    p.mul_(QK_SCALE)
    assert n == 2 * config.num_hidden_layers, f"{n} q/k projections in {config.num_hidden_layers} layers"
    model.save_pretrained(directory)


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
