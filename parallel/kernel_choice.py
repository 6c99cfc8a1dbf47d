"""Which attention backend runs a call (the backends: parallel/backends.py; the contract: parallel/kernels.py).

Contract:
- `backend_order(device_type, dtype, head_dim, sq, sk, capability, cudnn, flash_attn, varlen)`: the backends
  that accept this case, fastest first, a pure function of the facts it is given (the tests and bench/gpu.py
  pass them); `candidates(q, k, varlen)` reads them from the tensors and this machine (`_capability`,
  `_cudnn_usable`, `_fa`: flash-attn installed), and `pick_backend` is its first.
- Choice: `backend=` names one (no fallback, what the tests pin); otherwise `backend_order` ranks
  the backends that accept this device, dtype, head dim and shape, and a backend that raises at
  run time for a shape is skipped for that shape from then on (logged once, rank 0): `_dispatch(phase, table,
  q, k, causal, args, backend)` runs `table[name](*args)` down the candidates (kernels.py's `_FORWARD` and
  `_BACKWARD`); out-of-memory and the last backend's error propagate. `_log_once` warns once per key, rank 0.
- Imports nothing from the project: the kernels, the tiled attention and bench/gpu.py read the same choice.
- kernels.py binds `pick_backend`, `_dispatch` and `_log_once` at import: a test or fork that changes the choice
  patches this module's `candidates` or device facts (which those read here), not names in kernels.
"""

from __future__ import annotations

import warnings

import torch

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_interface as _fa
except ImportError:  # pragma: no cover - depends on the install
    _fa = None

BACKENDS = ("cudnn", "flash_attn", "sdpa_cuda", "cpu", "reference")


def backend_order(device_type: str, dtype, head_dim: int, sq: int, sk: int, capability=(0, 0),
                  cudnn: bool = False, flash_attn: bool = False, varlen: bool = False) -> list[str]:
    """Backends that accept this case, fastest first (a pure function: the facts are arguments). cuDNN: sm90+
    (H200, 32k tokens, 28/4 heads, head_dim 128, bf16: fwd+bwd 49.5 ms vs 82.6 ms for torch's flash op),
    head_dim a multiple of 8 up to 128, no length = 64 mod 128 (there the SM90 backward leaves the K/V tail
    tile unmasked: NaN gradients where lse < -88.7; pytorch#196678, cudnn-frontend#628). flash-attn 2 next
    (first for packed rows: a varlen entry), up to head_dim 256, torch's op last (past 256, Gemma 4's full layers'
    512: the only one, its memory-efficient op: backends.cuda_op)."""
    if device_type == "cpu":
        return ["cpu"]
    if device_type != "cuda":
        return ["reference"]
    half = dtype in (torch.float16, torch.bfloat16)
    order = []
    if (cudnn and half and tuple(capability) >= (9, 0) and head_dim % 8 == 0 and head_dim <= 128
            and sq % 128 != 64 and sk % 128 != 64):
        order.append("cudnn")
    if flash_attn and half and head_dim % 8 == 0 and head_dim <= 256:
        order.insert(0 if varlen else len(order), "flash_attn")
    return order + ["sdpa_cuda"]


def _capability(device):
    return torch.cuda.get_device_capability(device)


def _cudnn_usable() -> bool:
    """The op exists in this torch, cuDNN 9+ is loaded and nobody switched cuDNN SDPA off."""
    return (hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
            and torch.backends.cuda.cudnn_sdp_enabled())


def candidates(q, k=None, varlen: bool = False) -> list[str]:
    k = q if k is None else k
    cuda = q.device.type == "cuda"
    return backend_order(q.device.type, q.dtype, q.shape[-1], q.shape[1], k.shape[1],
                         _capability(q.device) if cuda else (0, 0), cuda and _cudnn_usable(),
                         _fa is not None, varlen)


def pick_backend(q: torch.Tensor, k: torch.Tensor | None = None, varlen: bool = False) -> str:
    return candidates(q, k, varlen)[0]


_refused: set = set()   # (phase, backend, case) that raised once: not tried again for that case
_logged: set = set()


def _log_once(key, msg):
    if key in _logged:
        return
    _logged.add(key)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_rank() != 0):
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

def _dispatch(phase, table, q, k, causal, args, backend):
    if backend is not None:
        return table[backend](*args)
    names = candidates(q, k)
    case = (q.device, q.dtype, tuple(q.shape), tuple(k.shape), causal)
    for i, name in enumerate(names):
        if (phase, name, case) in _refused and i + 1 < len(names):
            continue
        try:
            return table[name](*args)
        except torch.OutOfMemoryError:
            raise   # another kernel would not fit either; the fix is elsewhere
        except RuntimeError as e:   # a backend refusing a shape: try the next one
            if i + 1 == len(names):
                raise
            _refused.add((phase, name, case))
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _log_once((phase, name), f"attention {phase}: backend {name!r} failed for q {tuple(q.shape)}, "
                      f"k {tuple(k.shape)}, {q.dtype} ({first}); using {names[i + 1]!r} for this shape")
    raise AssertionError("unreachable")
