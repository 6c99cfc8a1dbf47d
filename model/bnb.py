"""bitsandbytes, imported without the torch.compile wrappers it builds (peft, which imports it, comes after this).

bitsandbytes 0.45+ wraps its generic fallback kernels (backends/default/ops.py) in `torch.compile` when it is
imported. Building those wrappers imports torch's compiler stack (dynamo's tracer, inductor's lowering): 4 s of
one CPU core per process on the 2-core CI machine, paid by every rank of every run, though the fallbacks never run
here: CUDA and CPU have kernels of their own for the NF4 ops we call. While bitsandbytes is imported,
`torch.compile` is the identity, so those fallbacks stay eager, which is also what bitsandbytes does itself when
compiling fails. Nothing else changes: `torch.compile` is restored at once; dynamo, imported before the swap,
keeps the real one in its rules; a process that imported bitsandbytes before this module keeps its compiled
wrappers. model/nf4.py and model/qlora.py take bitsandbytes from here; peft is model/qlora.py's own import (after
this one): its ~2.4 s (transformers) would otherwise be paid by every process that only quantizes or dequantizes
(python -m model.merge --quant nf4, the tiled attention), and it calls no torch.compile as it is imported.

`dequantize(packed, state)` is the only 4-bit dequantization we call (bitsandbytes' own `dequantize_4bit` is not
exported here): bitsandbytes 0.50.2's CPU kernel reads a 2-D state [rows, cols] as blocks that never cross a row
(block = row·(cols // blocksize) + col // blocksize) when cols is a multiple of 16 but not of the block size, so a
[16, 48] weight takes the wrong 64-block scales (4x NF4's own error); a flat state, or an odd width, takes its
generic path, and CUDA's kernel, right. So it dequantizes the codes with the state made flat, viewed back to its
shape: the same bits wherever the 2-D state was right (CUDA; widths a multiple of 64).
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo  # noqa: F401 - before the swap: dynamo caches torch's callables (torch.compile among them) at import


def _identity(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


_compile, torch.compile = torch.compile, _identity
try:
    import bitsandbytes as bnb
    from bitsandbytes.functional import (
        QuantState,
        dequantize_4bit,
        dequantize_blockwise,
        get_4bit_type,
        quantize_4bit,
        quantize_blockwise,
    )
finally:
    torch.compile = _compile


def dequantize(packed: torch.Tensor, state: QuantState, dtype: torch.dtype | None = None) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of `packed` (any view of the codes) under `state` (module docstring), in
    `dtype` (default: the state's)."""
    flat = copy.copy(state)   # shallow: the state's tensors are shared, not copied
    flat.shape, flat.dtype = torch.Size([torch.Size(state.shape).numel()]), dtype or state.dtype
    return dequantize_4bit(packed.view(-1, 1), flat).view(state.shape)


__all__ = ["bnb", "QuantState", "dequantize", "dequantize_blockwise", "get_4bit_type", "quantize_4bit",
           "quantize_blockwise"]
