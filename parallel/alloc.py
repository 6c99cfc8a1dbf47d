"""CUDA caching-allocator default: expandable segments, unless the user configured the allocator.

A long-context step allocates and frees multi-GB tensors of changing sizes, which strand memory in fixed-size
segments. `default_allocator()` sets PYTORCH_CUDA_ALLOC_CONF when none of it, PYTORCH_ALLOC_CONF and
PYTORCH_HIP_ALLOC_CONF is set and torch is not a ROCm build. torch reads it when CUDA first initialises (some keys
when its library loads), so train.py and bench/gpu.py call this before importing torch (this module imports only
the standard library). tests/gpu checks that it takes effect.
"""

import os

ALLOC_CONF = "expandable_segments:True"


def default_allocator() -> None:
    """Also left alone: a ROCm torch (expandable segments are unsupported or fragile there) and a user's HIP setting."""
    if any(k in os.environ for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")):
        return
    try:
        from importlib.metadata import version
        if "rocm" in version("torch"):
            return
    except Exception:   # no distribution metadata (a source build): assume CUDA
        pass
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
