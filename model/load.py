"""Reading Hugging Face checkpoints: `config.json` plus single-file or sharded safetensors (Hub ids: model/hub.py).

Contract:
- `read_args(path, rope_scaling=None)` reads only `config.json` (cheap: safe before any weight is touched; with
  `--rope-scaling`'s value in place of its RoPE scaling) and raises
  `FileNotFoundError` / `ValueError` naming the path or the unsupported architecture; a file that is
  not valid JSON names the file, line and column.
- `CheckpointReader(path)` indexes the safetensors files (`model.safetensors.index.json` or
  `model.safetensors`, or every `*.safetensors`) by reading only their headers; a header that is cut
  short or whose tensors run past the end of the file raises `CorruptCheckpointError` naming the file
  (truncated or corrupt: re-download). `check(names)` raises naming every missing tensor;
  `check_shapes({name: shape})` compares against the headers, naming tensor, file and both shapes.
  `get(name)` reads one tensor, `get_rows(name, a, b)` only its dim-0 rows [a, b), and
  `get_flat(name, a, b)` only its row-major elements [a, b): safetensors stores tensors row-major and
  contiguous, so each is one pread(2) of a byte range into process memory (no mmap view stays mapped).
  A bitsandbytes 4-bit checkpoint's packed weights are read as the float32 weights they hold (model/prequant.py:
  `packed` {name: Packed}; `get_raw`/`get_bytes` read any stored tensor as stored); their companion tensors
  (absmax, quant maps, quant state) are not among its tensors (`where`, `meta`). Gemma 4's fused experts are, expert
  by expert under our names (`views`: model/gemma4_moe.py's expert_views), each read from its byte range.
- A multimodal wrapper (Mistral 3, Gemma 3: model/wrapper.py) is indexed as its language model, by the text-only
  model's names (`model.layers.N...`, `lm_head.weight`), read from its stored keys; its vision tower and projector are
  never read; its `tie_embeddings` is False when its weight files store the head (transformers unties a head stored
  apart).
- `stored_tensors(path)`: every stored tensor's header entry and file, headers only; `stored_weights(path)` adds the
  packed 4-bit weights and the weights' logical entries (what CheckpointReader indexes). The start-up checks on the
  weight files (headers against config.json, before any weight is read): model/load_checks.py.
- `from_pretrained(path, dtype, device)` builds the model on the meta device (no random init of a
  70B model), materialises it on `device` and fills it with `model.weights.load_weights`, the
  trainer's own loading path (so the transformers comparisons in tests/test_model.py pin it too).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

from model import prequant
from model.config import ModelArgs
from model.gemma4_moe import expert_views
from model.llama import Transformer
from model.wrapper import WRAPPERS, internal_names, looked_for

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
            return json.load(f)
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{fn}: not UTF-8 text ({e.reason} at byte {e.start}); fix it or re-download "
                                         "it") from None
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{fn}: line {e.lineno}, column {e.colno}: {e.msg}; the file is "
                                         "not valid JSON: fix it or re-download it") from None


def read_args(path: str, rope_scaling: str | None = None) -> ModelArgs:
    """config.json's ModelArgs, with `--rope-scaling` in place of its RoPE scaling when given."""
    fn = _check_dir(path)
    cfg = _read_json(fn)
    if "model_type" not in cfg and "global_batch" in cfg:   # OUT/config.json, train.py's own
        raise ValueError(f"--model {path!r} is a train.py run directory, not a model: its base was --model "
                         f"{cfg.get('model')!r}; its adapter is {os.path.join(path, 'adapter')!r} (--init-adapter)")
    try:
        args = ModelArgs.from_config_dict(cfg)
    except KeyError as e:
        raise CorruptCheckpointError(f"{fn} lacks {e.args[0]!r}{' in its text_config' if _wrapper(fn) else ''}, "
                                     "which a Llama-family config.json has; fix it or re-download it") from None
    if args.wrapper and args.tie_embeddings and _stores_head(path):   # transformers unties a head stored apart
        args = replace(args, tie_embeddings=False)   # (an outer tie key left out reads as True)
    return args.with_rope_scaling(rope_scaling)


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


class CheckpointReader:
    def __init__(self, path: str):
        # a bitsandbytes 4-bit checkpoint: each packed weight stands for its float self; its companions are no weights
        self.path, self._fds = path, {}
        self.raw, self.packed, self.meta = stored_weights(path)   # raw: {name: (header entry, file)}
        self.where = {n: self.raw[n][1] for n in self.meta}
        self.wrapper = _wrapper(os.path.join(path, "config.json"))
        # Gemma 4's fused experts, read expert by expert under our names in their place (model/gemma4_moe.py)
        self.views = expert_views(self.meta)
        for v, (src, _, shape) in self.views.items():
            self.meta[v], self.where[v] = (self.meta[src][0], shape, None, None), self.where[src]
        for src in {s for s, _, _ in self.views.values()}:
            del self.meta[src], self.where[src]

    def check(self, names):
        missing = sorted(n for n in names if n not in self.where)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs: "
                             f"{missing[:10]}{' ...' if len(missing) > 10 else ''}" + (
                                 f" (a {w} wrapper's language model: looked for them under {looked_for(w)})"
                                 if (w := self.wrapper) else ""))

    def check_shapes(self, shapes: dict):
        """Raise naming every tensor whose header shape differs from the model's (from config.json)."""
        bad = [f"{n} in {self.where[n]}: checkpoint {list(self.meta[n][1])}, config.json implies {list(s)}"
               for n, s in shapes.items() if n in self.meta and tuple(self.meta[n][1]) != tuple(s)]
        if bad:
            raise ValueError(f"{len(bad)} tensor shapes disagree with config.json (wrong config.json for "
                             "these weights?):\n  " + "\n  ".join(bad[:10]) + (" ..." if len(bad) > 10 else ""))

    def shape(self, name: str) -> tuple:
        return self.meta[name][1]

    def get_bytes(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of a stored tensor, as uint8: one pread into fresh memory."""
        (_, _, begin, _), fn = self.raw[name]
        if fn not in self._fds:
            self._fds[fn] = os.open(fn, os.O_RDONLY)
        buf = torch.empty(stop - start, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            got = os.preadv(self._fds[fn], [view[done:]], begin + start + done)
            if got == 0:
                raise CorruptCheckpointError(f"{fn} is truncated or corrupt (reading {name!r}); re-download it")
            done += got
        return buf

    def _read(self, name: str, first: int, count: int) -> torch.Tensor:
        """Elements [first, first + count) of the flattened tensor (a packed 4-bit one's: dequantized, float32)."""
        if name in self.views:   # (an expert's range of a fused tensor)
            src, start, _ = self.views[name]
            return self._read(src, start + first, count)
        if name in self.packed:
            from model.prequant import dequantized

            return dequantized(self, name, first, count)
        dtype = self.raw[name][0][0]
        isz = torch.empty((), dtype=dtype).element_size()
        return self.get_bytes(name, first * isz, (first + count) * isz).view(dtype)

    def get_raw(self, name: str) -> torch.Tensor:
        """A stored tensor as stored (a packed weight's codes, its companions)."""
        (dtype, shape, begin, end), _ = self.raw[name]
        return self.get_bytes(name, 0, end - begin).view(dtype).view(shape)

    def get(self, name: str) -> torch.Tensor:
        shape = self.meta[name][1]
        return self._read(name, 0, torch.Size(shape).numel()).view(shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        shape = self.meta[name][1]
        row = torch.Size(shape[1:]).numel()
        return self._read(name, start * row, (stop - start) * row).view(stop - start, *shape[1:])

    def get_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, start, stop - start)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def from_pretrained(path: str, *, dtype: torch.dtype = torch.float32, device="cpu", attention=None,
                    rope_scaling: str | None = None):
    """The plain decoder (no LoRA, no sharding), filled by the trainer's own `model.weights.load_weights`."""
    from model.weights import load_weights  # imports bitsandbytes: not on read_args' fast path

    args = read_args(path, rope_scaling)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = Transformer(args, attention=attention).to(dtype)
    model = model.to_empty(device=torch.device(device))
    if args.tie_embeddings:    # to_empty keeps the tie only if re-pointed after materialisation
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, reader, torch.device(device))
    reader.close()
    return model
