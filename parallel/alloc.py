"""CUDA caching-allocator default: expandable segments, unless the user configured the allocator.

A long-context step allocates and frees multi-GB tensors of changing sizes, which strand memory in fixed-size
segments. `default_allocator()` sets PYTORCH_CUDA_ALLOC_CONF when neither it nor PYTORCH_ALLOC_CONF is set. torch
reads it when CUDA first initialises, so train.py and bench/gpu.py call this before importing torch (imports only
`os`). tests/gpu checks that it takes effect.
"""

import os

ALLOC_CONF = "expandable_segments:True"


def default_allocator() -> None:
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
