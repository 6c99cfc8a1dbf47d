"""Checkpoints quantized already with bitsandbytes' 4-bit (the "-bnb-4bit" uploads): read as the weights they hold.

transformers saves a bitsandbytes `Linear4bit` weight W as its packed 4-bit codes under W's own name (two codes a byte,
row-major, any storage dtype), beside W.absmax (one scale per block of 64 weights; uint8 codes of the scales when
the scales are themselves quantized, "double quantization"), W.quant_map (the 16 values of the code book), with double
quantization W.nested_absmax and W.nested_quant_map, and W.quant_state.bitsandbytes__nf4 (or __fp4): a small JSON
(shape, dtype, blocksize, quant_type; nested_blocksize, nested_offset) stored as uint8 bytes.

Contract:
- `check_config(q)`: config.json's quantization_config. bitsandbytes 4-bit is read; 8-bit, AWQ, GPTQ, FP8 and
  others are refused naming the fix (their weights are not the float ones, nor these).
- `index(raw, read)`: the packed weights among a checkpoint's tensors ({name: header entry}; `read(name)` -> its
  bytes), {W: Packed}; every companion tensor is named in `Packed.companions`. A packed weight without its companions,
  whose byte count is not its shape's, or a companion of another length than its quant state implies (which
  bitsandbytes' kernels would read past: a segfault, or garbage weights) is a CorruptCheckpointError naming it.
- `check_quant(packed, quant, where)`: --quant nf4 takes a packed weight as stored only if it is NF4 in 64-blocks
  (what model.nf4's layers hold); anything else under nf4 raises naming --quant none (which trains on the weights
  dequantized) before any weight is read (`config`: config.json's bnb_4bit_quant_type, before a Hub id's weights are
  fetched). `describe(packed, ...)` is the start-up note on what the run trains against.
- `dequantized(reader, name, first, count)`: elements [first, first + count) of W, row-major, in float32: each the
  product code × its block's scale, as bitsandbytes' `dequantize_4bit` computes it, bit for bit; only the blocks that
  hold them are read (each rank's rows of a sharded weight).
- `nf4_parts(reader, name, b0, b1, dtype, device)`: for an NF4 layer (model.nf4.NF4Linear) the packed codes of blocks
  [b0, b1), every block's uint8 scale codes and the QuantState without them, as stored. With double quantization
  those are the upload's own, so the layer computes with exactly the weights transformers computes with; without it
  the fp32 scales are nested as for any checkpoint (model.nf4.nested_state), the one step a float checkpoint's
  quantization also takes. `nf4_base(reader, name)` is that weight in float32, the base `python -m model.merge`
  folds an adapter into.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

KINDS = ("nf4", "fp4")
STATE = ".quant_state.bitsandbytes__"


def check_config(q) -> str:
    """quantization_config -> the 4-bit kind ("nf4"/"fp4") of a bitsandbytes 4-bit checkpoint; anything else raises."""
    qm = q.get("quant_method") if isinstance(q, dict) else q
    four = isinstance(q, dict) and (q.get("load_in_4bit") or q.get("_load_in_4bit"))
    if qm == "bitsandbytes" and four:
        kind = q.get("bnb_4bit_quant_type", "fp4")   # (transformers' default)
        if kind in KINDS:
            return kind
    eight = isinstance(q, dict) and (q.get("load_in_8bit") or q.get("_load_in_8bit"))
    what = f"quant_method {qm!r}" + ("" if qm != "bitsandbytes" or four else " 8-bit" if eight else
                                     ", neither load_in_4bit nor load_in_8bit")
    twin = " (an FP8 release's BF16 one: Mistral's Ministral 3 Instruct, its name + -BF16)" if qm == "fp8" else ""
    raise ValueError(f"config.json: the checkpoint is quantized already (quantization_config: {what}), and this "
                     "trainer reads bf16/fp16/fp32 weights, or bitsandbytes 4-bit ones (the -bnb-4bit uploads): pass "
                     f"the unquantized checkpoint it was made from{twin} (with --quant nf4 for QLoRA)")


@dataclass
class Packed:
    """One packed 4-bit weight: what its quant_state JSON says."""
    kind: str                  # "nf4" / "fp4"
    shape: tuple               # the weight's [out, in]
    dtype: torch.dtype         # the dtype it was quantized from
    blocksize: int
    nested: dict | None        # double quantization: {"blocksize", "offset"}; None: fp32 scales
    companions: tuple          # the tensors beside it (W.absmax, ...)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.blocksize)


def index(raw: dict, read) -> dict:
    """{W: Packed} for the packed weights among `raw` ({name: (dtype, shape, begin, end)}); module docstring."""
    from model.stored import CorruptCheckpointError

    out = {}
    for n in raw:
        if STATE not in n:
            continue
        w, kind = n.rsplit(STATE, 1)
        try:
            st = json.loads(bytes(read(n)).decode())
            nested = {"blocksize": int(st["nested_blocksize"]), "offset": float(st["nested_offset"])} \
                if "nested_offset" in st else None
            p = Packed(kind=st["quant_type"], shape=tuple(st["shape"]), dtype=getattr(torch, st["dtype"]),
                       blocksize=int(st["blocksize"]), nested=nested,
                       companions=(n, *(f"{w}.{c}" for c in ("absmax", "quant_map") + (
                           ("nested_absmax", "nested_quant_map") if nested else ()))))
            if min(p.blocksize, nested["blocksize"] if nested else 1, *p.shape) < 1 or len(p.shape) != 2:
                raise ValueError(f"shape {list(p.shape)}, blocksize {p.blocksize}{', nested ' if nested else ''}"
                                 f"{nested['blocksize'] if nested else ''}: not a 2-D weight in blocks of 1 or more")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{n}: not bitsandbytes' quant state ({type(e).__name__}: {e}); "
                                         "re-download the checkpoint") from None
        lacks = [c for c in (w, *p.companions) if c not in raw]
        if lacks or p.kind != kind or p.kind not in KINDS:
            why = f"lacks {', '.join(lacks)}" if lacks else f"is quantized as {p.kind!r}"
            raise CorruptCheckpointError(f"{n}: the 4-bit weight {w!r} {why}; re-download the checkpoint")
        dt, shape, begin, end = raw[w]
        if end - begin != -(-p.numel // 2):
            raise CorruptCheckpointError(f"{w}: {end - begin} bytes of 4-bit codes, its quant state's shape "
                                         f"{list(p.shape)} needs {-(-p.numel // 2)}; re-download the checkpoint")
        # each companion's length, from its header: bitsandbytes' kernels read as far as the quant state says, so a
        # short one would be read past its end (a segfault on CPU, or weights of whatever lies beyond)
        want = {"absmax": p.blocks, "quant_map": 16} | ({"nested_absmax": -(-p.blocks // p.nested["blocksize"]),
                                                         "nested_quant_map": 256} if nested else {})
        for c, count in want.items():
            dt, shape, begin, end = raw[f"{w}.{c}"]
            have = end - begin if c == "absmax" and nested else math.prod(shape)   # (nested: uint8 codes)
            if have != count:
                raise CorruptCheckpointError(f"{w}.{c}: {have} {'bytes' if c == 'absmax' and nested else 'values'}, "
                                             f"where its quant state ({p.blocks} blocks of {p.blocksize}) needs "
                                             f"{count}; re-download the checkpoint")
        out[w] = p
    return out


def companions(packed: dict) -> set:
    """The stored tensors beside the packed weights (their scales, code books, quant states): no weights."""
    return {c for p in packed.values() for c in p.companions}


TRAIN_FIX = "pass --quant none to train LoRA on them dequantized, or the unquantized checkpoint"


def check_quant(packed: dict, quant: str | None, where: str, config=None, fix: str = TRAIN_FIX) -> None:
    """Under --quant nf4 every packed weight must be NF4 in 64-blocks (module docstring); so must the 4-bit type
    `config` (config.json's quantization_config) names, for a Hub id whose weights are not fetched yet. `fix`: what
    the error tells to do (training's; the merge says its own)."""
    if quant != "nf4":
        return
    have = {(p.kind, p.blocksize) for p in packed.values()}
    if config:
        try:
            have.add((check_config(config), 64))   # (transformers' 4-bit blocks: 64)
        except ValueError:   # (not a 4-bit one: read_args says so)
            pass
    bad = sorted(have - {("nf4", 64)})
    if bad:
        what = ", ".join(f"{k} in blocks of {b}" for k, b in bad)
        raise ValueError(f"--quant nf4: {where} holds bitsandbytes 4-bit weights quantized as {what}, and the NF4 "
                         f"layers here hold nf4 in blocks of 64 (quantizing them again would round them twice): {fix}")


def describe(packed: dict, block_weights: list, quant: str | None, where: str) -> str | None:
    """The start-up note on a 4-bit checkpoint: what the run trains against (None for a float checkpoint)."""
    if not packed:
        return None
    kinds = sorted({f"{p.kind}{', double quantization' if p.nested else ''}" for p in packed.values()})
    said = f"note: {where} is a bitsandbytes 4-bit checkpoint ({'; '.join(kinds)}): "
    if quant != "nf4":
        return said + "its weights are dequantized (code × scale, as transformers computes them), LoRA trains on them"
    said += "its NF4 weights are trained against as stored"
    if any(not p.nested for p in packed.values()):
        said += " (its fp32 block scales quantized to 8 bits here, as for any checkpoint)"
    if floats := [n for n in block_weights if n not in packed]:
        said += (f"; {len(floats)} block projections stored unquantized ({floats[0]}"
                 f"{', ...' if len(floats) > 1 else ''}: llm_int8_skip_modules, or Qwen3-MoE's experts, fused 3-D "
                 "parameters in transformers 5, which bitsandbytes leaves in float) are quantized to NF4 here, as "
                 "--quant nf4 does a float checkpoint (--quant none keeps them)")
    return said


def _nested(reader, name: str, device=None):
    """A double-quantized weight's nested statistics as stored: (the QuantState of its scales' codes, the offset)."""
    from model.bnb import QuantState

    p = reader.packed[name]
    return (QuantState(absmax=reader.get_raw(f"{name}.nested_absmax").to(device).float(),
                       code=reader.get_raw(f"{name}.nested_quant_map").to(device).float(),
                       blocksize=p.nested["blocksize"], dtype=torch.float32),
            torch.tensor(p.nested["offset"], dtype=torch.float32, device=device))


def _absmax(reader, name: str, device=None) -> torch.Tensor:
    """Every block's fp32 scale, as bitsandbytes' dequantize_4bit reconstructs it."""
    from model.bnb import dequantize_blockwise

    a = reader.get_raw(f"{name}.absmax").to(device)
    if reader.packed[name].nested:
        st2, offset = _nested(reader, name, device)
        a = dequantize_blockwise(a.view(torch.uint8), st2)
        a += offset
    return a.float()


def dequantized(reader, name: str, first: int, count: int) -> torch.Tensor:
    """Module docstring: [count] float32, from the blocks that hold them (an odd block size, whose blocks do not
    start on bytes: from all of them)."""
    p = reader.packed[name]
    bs = p.blocksize
    b0, b1 = (first // bs, -(-(first + count) // bs)) if bs % 2 == 0 else (0, p.blocks)
    at = first - b0 * bs
    return _dequantize(reader, name, b0, b1, min(b1 * bs, p.numel) - b0 * bs)[at:at + count]


def _dequantize(reader, name: str, b0: int, b1: int, count: int) -> torch.Tensor:
    """The `count` weights of blocks [b0, b1)."""
    from model.bnb import QuantState, dequantize

    p = reader.packed[name]
    if count == 0:
        return torch.empty(0)
    codes = reader.get_bytes(name, b0 * p.blocksize // 2, -(-min(b1 * p.blocksize, p.numel) // 2))
    st = QuantState(absmax=_absmax(reader, name)[b0:b1], shape=torch.Size([count]), blocksize=p.blocksize,
                    code=reader.get_raw(f"{name}.quant_map").float(), quant_type=p.kind, dtype=torch.float32)
    return dequantize(codes, st)


def nf4_parts(reader, name: str, b0: int, b1: int, dtype: torch.dtype, device) -> tuple:
    """(codes of blocks [b0, b1) as uint8, every block's uint8 scale code, QuantState without them): module
    docstring. The state dequantizes to `dtype` (the layer's storage dtype)."""
    from model.bnb import QuantState
    from model.nf4 import nested_state

    p = reader.packed[name]
    check_quant({name: p}, "nf4", reader.path)
    codes = reader.get_bytes(name, b0 * p.blocksize // 2, b1 * p.blocksize // 2).to(device)
    if not p.nested:   # fp32 scales: nested as any checkpoint's are
        qabsmax, st = nested_state(_absmax(reader, name, device), p.shape, dtype)
        return codes, qabsmax, st
    st2, offset = _nested(reader, name, device)
    st = QuantState(absmax=None, shape=torch.Size(p.shape), dtype=dtype, blocksize=p.blocksize, quant_type="nf4",
                    offset=offset, state2=st2, code=reader.get_raw(f"{name}.quant_map").to(device).float())
    return codes, reader.get_raw(f"{name}.absmax").to(device).view(torch.uint8), st


def nf4_base(reader, name: str) -> torch.Tensor:
    """The float32 weight an NF4 layer loaded from this packed weight computes with (module docstring)."""
    from model.bnb import dequantize

    p = reader.packed[name]
    codes, qabsmax, st = nf4_parts(reader, name, 0, p.blocks, torch.float32, "cpu")
    st.absmax = qabsmax
    return dequantize(codes, st)
