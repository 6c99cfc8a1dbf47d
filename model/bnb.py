"""bitsandbytes (and peft, which imports it), imported without the torch.compile wrappers bitsandbytes builds.

bitsandbytes 0.45+ wraps its generic fallback kernels (backends/default/ops.py) in `torch.compile` when it is
imported. Building those wrappers imports torch's compiler stack (dynamo's tracer, inductor's lowering): 4 s of
one CPU core per process on the 2-core CI machine, paid by every rank of every run, though the fallbacks never run
here: CUDA and CPU have kernels of their own for the NF4 ops we call. While bitsandbytes is imported,
`torch.compile` is the identity, so those fallbacks stay eager, which is also what bitsandbytes does itself when
compiling fails. Nothing else changes: `torch.compile` is restored at once; dynamo, imported before the swap,
keeps the real one in its rules; a process that imported bitsandbytes before this module keeps its compiled
wrappers. model/nf4.py and model/qlora.py take both packages from here.
"""

from __future__ import annotations

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
    from peft import LoraConfig, get_peft_model
finally:
    torch.compile = _compile

__all__ = ["bnb", "LoraConfig", "get_peft_model", "QuantState", "dequantize_4bit", "dequantize_blockwise",
           "get_4bit_type", "quantize_4bit", "quantize_blockwise"]
