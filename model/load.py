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
  by expert under our names (`views`: model/gemma4_moe.py's expert_views), each read from its byte range; GPT-OSS's
  (model/gpt_oss.py) too, each expert's slab read whole and its part de-interleaved and transposed (`slabs`); an MXFP4
  release's experts as their BF16 form, dequantized from their blocks and scales (`mxfp4`).
- A multimodal wrapper (Mistral 3, Gemma 3: model/wrapper.py) is indexed as its language model, by the text-only
  model's names (`model.layers.N...`, `lm_head.weight`), read from its stored keys; its vision tower and projector are
  never read; its `tie_embeddings` is False when its weight files store the head (transformers unties a head stored
  apart).
- The files under these (`weight_files`, `read_header`, `stored_tensors`, `stored_weights`, `CorruptCheckpointError`):
  model/stored.py. The start-up checks on the weight files (headers against config.json, before any weight
  is read): model/load_checks.py.
- `from_pretrained(path, dtype, device)` builds the model on the meta device (no random init of a
  70B model), materialises it on `device` and fills it with `model.weights.load_weights`, the
  trainer's own loading path (so the transformers comparisons in tests/test_model.py pin it too).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from model import gpt_oss
from model.config import ModelArgs
from model.gemma4_moe import expert_views
from model.llama import Transformer
from model.stored import CorruptCheckpointError, _check_dir, _read_json, _stores_head, _wrapper, stored_weights
from model.wrapper import looked_for


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


class CheckpointReader:
    def __init__(self, path: str):
        # a bitsandbytes 4-bit checkpoint: each packed weight stands for its float self; its companions are no weights
        self.path, self._fds = path, {}
        self.raw, self.packed, self.meta = stored_weights(path)   # raw: {name: (header entry, file)}
        self.where = {n: self.raw[n][1] for n in self.meta}
        self.wrapper = _wrapper(os.path.join(path, "config.json"))
        # Gemma 4's fused experts, read expert by expert under our names in their place (model/gemma4_moe.py)
        # GPT-OSS's (model/gpt_oss.py): `slabs` {our name: (slab shape, take, put)}, an expert's whole slab read, then
        # de-interleaved and transposed by take (the last slab kept: gate and up share theirs)
        # (an MXFP4 release's experts: W_blocks and W_scales read as W's BF16 form, dequantized, model/gpt_oss.py)
        self.mxfp4 = gpt_oss.mxfp4_tensors(self.meta)
        for w, (blocks, scales, shape) in self.mxfp4.items():
            self.meta[w], self.where[w] = (torch.bfloat16, shape, None, None), self.where[blocks]
            self.raw[w] = (self.meta[w], self.where[w])
            for n in (blocks, scales):
                del self.meta[n], self.where[n]
        self.views, self.slabs, self._slab = expert_views(self.meta), {}, None
        for name, (src, first, shape, *slab) in gpt_oss.expert_views(self.meta).items():
            self.views[name], self.slabs[name] = (src, first, shape), tuple(slab)
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
        if name in self.slabs:   # (GPT-OSS: the expert's slab, its part taken out)
            src, start, _ = self.views[name]
            shape, take, _ = self.slabs[name]
            if self._slab is None or self._slab[0] != (src, start):
                self._slab = ((src, start), self._read(src, start, torch.Size(shape).numel()).view(shape))
            return take(self._slab[1]).reshape(-1)[first:first + count]
        if name in self.views:   # (an expert's range of a fused tensor)
            src, start, _ = self.views[name]
            return self._read(src, start + first, count)
        if name in self.mxfp4:
            return gpt_oss.read_mxfp4(self, name, first, count)
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
