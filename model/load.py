"""Reading Hugging Face checkpoints: `config.json` plus single-file or sharded safetensors.

Contract:
- `read_args(path)` reads only `config.json` (cheap: safe before any weight is touched) and raises
  `FileNotFoundError` / `ValueError` naming the path or the unsupported architecture.
- `CheckpointReader(path)` indexes the safetensors files (`model.safetensors.index.json` or
  `model.safetensors`, or every `*.safetensors`) without reading tensor data; `check(names)` raises
  naming every missing tensor; `get(name)` returns one tensor, read lazily from its file into
  process memory (pread, not an mmap view), so a caller streaming tensor by tensor never holds
  more than one.
- `from_pretrained(path, dtype, device)` builds the model on the meta device (no random init of a
  70B model), materialises it on `device` and copies every tensor in.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open

from model.config import ModelArgs
from model.llama import Transformer


def _check_dir(path: str):
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist; pass --model a directory "
                                "with config.json and *.safetensors")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"{cfg!r} is missing: --model must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    return cfg


def read_args(path: str) -> ModelArgs:
    with open(_check_dir(path)) as f:
        return ModelArgs.from_config_dict(json.load(f))


def _open_unmapped(fn: str):
    """safe_open that copies each tensor out with pread(2) instead of handing out mmap views.

    With the default mmap backend every page a rank reads stays mapped, so counted in its RSS, until
    the file is closed: each rank showed the whole checkpoint (every rank reads every full tensor to
    quantize it). pread keeps one tensor at a time in private memory. safetensors < 0.8 has no
    backend choice and falls back to mmap.
    """
    try:
        return safe_open(fn, "pt", backend="pread")
    except TypeError:
        return safe_open(fn, "pt")


class CheckpointReader:
    def __init__(self, path: str):
        _check_dir(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path!r}; convert the checkpoint with "
                                        "transformers' save_pretrained(safe_serialization=True)")
            self.where = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), "pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), os.path.join(path, fn)))
        self._stack = ExitStack()
        self._open = {}

    def check(self, names):
        missing = sorted(n for n in names if n not in self.where)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs: "
                             f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")

    def get(self, name: str) -> torch.Tensor:
        fn = self.where[name]
        if fn not in self._open:
            self._open[fn] = self._stack.enter_context(_open_unmapped(fn))
        return self._open[fn].get_tensor(name)

    def close(self):
        self._stack.close()
        self._open.clear()


def needed_names(model: torch.nn.Module) -> list[str]:
    """Parameter and persistent-buffer names the checkpoint must provide (tied lm_head excluded)."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=True)]
    names += [n for n, _ in model.named_buffers()]
    return names


def from_pretrained(path: str, *, dtype: torch.dtype = torch.float32, device="cpu", attention=None):
    args = read_args(path)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = Transformer(args, attention=attention)
    names = needed_names(model)
    reader.check(names)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_embeddings:    # to_empty keeps the tie only if re-pointed after materialisation
        model.lm_head.weight = model.model.embed_tokens.weight
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    with torch.no_grad():
        for n in names:
            state[n].copy_(reader.get(n))
    reader.close()
    return model
