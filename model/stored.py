"""A checkpoint directory's files read without reading a weight: config.json, and the safetensors files the loader
reads with their headers (what model/load.py's `read_args` and `CheckpointReader` stand on).

Contract:
- `weight_files(path)`: the safetensors files the loader reads (the index's, else every *.safetensors) and the
  index's weight_map; `present_weight_files` the same, each there (FileNotFoundError naming the fix).
- `read_header(fn)`: one file's {name: (dtype, shape, begin, end)} and its size; a header that is cut short, a
  tensor running past the end of the file, a Git LFS pointer or a dtype this loader does not read raise
  `CorruptCheckpointError` naming the file and the fix (re-download, `git lfs pull`, the unquantized checkpoint).
- `stored_tensors(path)`: every stored tensor's header entry and file, headers only; `stored_weights(path)` adds the
  packed 4-bit weights and the weights' logical entries (what CheckpointReader indexes). A multimodal wrapper's
  (model/wrapper.py): its language model's tensors only, by the text-only model's names. `_stores_head(path)`:
  whether a wrapper's weight files store its output head (read_args unties it then).
- `_check_dir(path)`: the directory's config.json, or the error naming what --model was given instead (no
  directory, a PEFT adapter, no config.json); `_read_json(fn)` one JSON file's object, errors naming file, line and
  column (or what it holds in place of an object).
"""

from __future__ import annotations

import json
import os

import torch

from model import prequant
from model.wrapper import WRAPPERS, internal_names

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class CorruptCheckpointError(ValueError):
    """A checkpoint file that cannot be what it claims: the message names the file and the fix."""


INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> tuple[list[str], dict | None]:
    """The safetensors files the loader reads (CheckpointReader): the ones model.safetensors.index.json names, else
    every *.safetensors; and that index's weight_map, or None. Other files beside them (a consolidated.safetensors left
    as a Git LFS pointer, pytorch_model.bin copies, training_args.bin) are never read."""
    if os.path.isfile(index := os.path.join(path, INDEX)):
        wmap = _read_json(index)["weight_map"]
        return sorted(set(wmap.values())), wmap
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors")), None


def present_weight_files(path: str) -> tuple[list[str], dict | None]:
    """`weight_files`, each there: a FileNotFoundError naming the fix for none at all or a shard the index names
    that is missing."""
    files, wmap = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}; convert the checkpoint with transformers' "
                                "save_pretrained(safe_serialization=True)")
    for fn in files:
        if not os.path.isfile(os.path.join(path, fn)):
            raise FileNotFoundError(f"{os.path.join(path, fn)!r}, named in {os.path.join(path, INDEX)}, is missing; "
                                    "re-download the checkpoint")
    return files, wmap


def stored_tensors(path: str) -> dict:
    """{name: ((dtype, shape, begin, end), file)} of every tensor in the safetensors files the loader reads (the
    index's map is authoritative if present), from their headers alone. A multimodal wrapper's (model/wrapper.py): its
    language model's tensors only, by the text-only model's names (the header entries locate the stored ones)."""
    wrapper = _wrapper(_check_dir(path))
    files, wmap = present_weight_files(path)
    index, out = os.path.join(path, INDEX), {}
    for f in files:
        fn = os.path.join(path, f)
        header, _ = read_header(fn)
        names = header if wmap is None else [n for n, v in wmap.items() if v == f]
        for ours, n in internal_names(names, wrapper).items():
            if n not in header:
                raise CorruptCheckpointError(f"{index} places {n!r} in {fn}, which does not hold it; "
                                             "re-download the checkpoint")
            out[ours] = (header[n], fn)
    return out


def _wrapper(cfg_file: str) -> str | None:
    """The multimodal wrapper's model_type a config.json names (model/wrapper.py), else None."""
    return mt if (mt := _read_json(cfg_file).get("model_type")) in WRAPPERS else None


def stored_weights(path: str) -> tuple[dict, dict, dict]:
    """(raw, packed, meta) of a checkpoint, from its headers and its 4-bit weights' quant states (a few hundred bytes
    each) alone: every stored tensor (`stored_tensors`); the packed 4-bit weights (prequant.index); and the weights
    {name: header entry}, a packed one's with the dtype and shape it stands for, its companion tensors left out."""
    raw = stored_tensors(path)

    def small(n):   # (a quant state)
        (_, _, begin, end), fn = raw[n]
        with open(fn, "rb") as f:
            f.seek(begin)
            return f.read(end - begin)
    packed = prequant.index({n: h for n, (h, _) in raw.items()}, small)
    aside = prequant.companions(packed)
    meta = {n: (p.dtype, p.shape, None, None) if (p := packed.get(n)) else h
            for n, (h, _) in raw.items() if n not in aside}
    return raw, packed, meta


def _check_dir(path: str):
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist; pass --model a directory "
                                "with config.json and *.safetensors")
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(cfg):
        raise ValueError(f"--model {path!r} is a PEFT adapter, not a model: pass its base as --model (its "
                         "adapter_config.json names it: base_model_name_or_path) and the adapter as --init-adapter")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"{cfg!r} is missing: --model must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    return cfg


def _read_json(fn: str) -> dict:
    try:
        f = open(fn, encoding="utf-8")
    except (PermissionError, IsADirectoryError) as e:   # (a missing one: the caller names it)
        raise ValueError(f"{fn} cannot be read ({type(e).__name__}): fix its permissions, or copy the checkpoint "
                         "somewhere readable") from None
    with f:
        try:
            d = json.load(f)
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{fn}: not UTF-8 text ({e.reason} at byte {e.start}); fix it or re-download "
                                         "it") from None
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{fn}: line {e.lineno}, column {e.colno}: {e.msg}; the file is "
                                         "not valid JSON: fix it or re-download it") from None
    if not isinstance(d, dict):   # (a list or a string: an AttributeError traceback until 2026-12-07)
        raise CorruptCheckpointError(f"{fn} holds no JSON object ({{...}}) but {json.dumps(d)[:60]}: fix it or "
                                     "re-download it")
    return d



def _stores_head(path: str) -> bool:
    """Whether a wrapper's weight files store its output head (the index's map, else the headers); False when they are
    not here (a Hub id's config.json alone, for --plan) or unreadable (the start-up checks say why)."""
    try:
        files, wmap = weight_files(path)
        names = wmap or {n for f in files for n in read_header(os.path.join(path, f))[0]}
    except (OSError, ValueError):
        return False
    return "lm_head.weight" in internal_names(names, _wrapper(os.path.join(path, "config.json")))




def read_header(fn: str) -> tuple[dict, int]:
    """{name: (dtype, shape, begin, end)} with absolute byte offsets, and the file size."""
    bad = f"{fn} is truncated or corrupt; re-download it"
    size = os.path.getsize(fn)
    with open(fn, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if (head + f.read(24)).startswith(b"version https://git-lfs"):   # (then back to the header, below)
            raise CorruptCheckpointError(f"{fn} is a Git LFS pointer, not the weights (cloned without git-lfs): run "
                                         f"`git lfs pull` in {os.path.dirname(fn) or '.'}, or download the files")
        if n < 2 or 8 + n > size:
            raise CorruptCheckpointError(f"{bad} (its {size}-byte file cannot hold the header it announces)")
        f.seek(8)
        try:
            meta = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise CorruptCheckpointError(f"{bad} (its safetensors header is not valid JSON)") from None
    out = {}
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        if t.get("dtype") not in DTYPES:
            raise CorruptCheckpointError(f"{fn}: tensor {name!r} has dtype {t.get('dtype')!r}, which this "
                                         f"loader does not read ({', '.join(DTYPES)}); a quantized checkpoint (FP8?): "
                                         "pass the unquantized one it was made from")
        begin, end = (8 + n + o for o in t["data_offsets"])
        if end > size:
            raise CorruptCheckpointError(f"{bad} (tensor {name!r} ends at byte {end}, the file has {size})")
        out[name] = (DTYPES[t["dtype"]], tuple(t["shape"]), begin, end)
    return out, size
