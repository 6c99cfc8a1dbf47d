"""transformers' RMSNorm (LlamaRMSNorm: normalised in float32, cast back to the input's dtype, then the weight) as an
autograd Function that keeps the input and rsqrt, not the float32 upcast.

Contract:
- `RMSNorm(dim, eps)(x)` = transformers' LlamaRMSNorm in value and gradient (x's and, under --train-norms, the
  weight's; tests/test_model.py), x any [..., dim]; `reference` (DPO's reference weight, model/norms.py) replaces the
  weight while set.
- Memory: autograd keeps x and rsqrt [..., 1]; eager float32 temporaries never exceed NORM_CHUNK elements (rows
  chunked both ways); on CUDA aten's fused kernels (`_fused_rms_norm` and its backward) when present (FUSED_NORM).
  Under torch.compile the plain formula, which the compiler fuses and differentiates itself.
Gemma's and OLMo's norms (the weight applied before the cast, an offset) are model/gemma.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from model.norms import cast_weight

NORM_CHUNK = 2**26   # elements per chunk in eager RMSNorm (float32 temporaries of at most 256 MB; RoPE's: rope.py)


def _norm_rows(x: torch.Tensor) -> int:
    """Rows per chunk: all of them when they fit one chunk."""
    d, n = x.shape[-1], x.numel() // max(1, x.shape[-1])
    return max(1, min(n, NORM_CHUNK // d))


def _normalize(x, weight, eps):
    """(weight · x / rms(x), rsqrt): normalised in float32 like transformers, cast back before the weight."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * r).to(x.dtype), r


FUSED_NORM = True   # CUDA eager: aten's fused RMSNorm kernels where this torch has them (False: the formula below)
_FUSED: dict = {}   # device -> whether aten's fused forward and backward run there (probed once)


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this norm takes aten's fused kernels (`_fused_rms_norm` and its backward: one pass over x each
    way instead of ~6 float32 passes): CUDA, eager, weight in x's dtype, and both ops present (probed once per
    device; torch builds without them fall back to the formula, said once)."""
    if not FUSED_NORM or x.device.type != "cuda" or weight.dtype != x.dtype:
        return False
    if x.device not in _FUSED:
        try:
            t = torch.ones(2, 8, device=x.device, dtype=x.dtype)
            n, r = torch.ops.aten._fused_rms_norm(t, [8], None, 1e-6)
            torch.ops.aten._fused_rms_norm_backward(t, t, [8], r, t[0], [True, False])
            _FUSED[x.device] = True
        except (AttributeError, NotImplementedError, RuntimeError, TypeError, ValueError) as e:
            import warnings
            warnings.warn(f"RMSNorm: aten's fused kernels are not usable on {x.device} with torch "
                          f"{torch.__version__} ({type(e).__name__}); using the float32 formula", stacklevel=2)
            _FUSED[x.device] = False
    return _FUSED[x.device]


class _RMSNormFn(torch.autograd.Function):
    """transformers' RMSNorm, saving its input (compute dtype) and rsqrt [..., 1] instead of the float32
    upcast autograd would keep (2x the input at bf16); backward re-derives the upcast from the input.
    Eager mode runs both directions over row chunks of NORM_CHUNK elements: per row the same float32 math,
    but the float32 temporaries (x upcast, its square, the products: ~5 of x's size in float32 in backward)
    never exceed a chunk's, which at 512k tokens x 3584 would be 7.5 GB each. On CUDA (`_fused`) aten's fused
    kernels replace the formula both ways, with no float32 temporaries and no [T, D] one beside the output: in
    forward the weight is applied in place after the cast back, in the compute dtype, as transformers does;
    backward hands the kernel the weight (g·weight in float32 there, not rounded to the compute dtype first)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        flat, rows = x.reshape(-1, x.shape[-1]), _norm_rows(x)
        ctx.fused = _fused(x, weight)
        if ctx.fused:   # the normalized x in float32, cast back (transformers' rounding), then the weight, in place
            n, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)
            out = n.mul_(weight)
        elif rows >= flat.shape[0]:   # one chunk: the whole tensor at once, no output buffer to copy into
            out, rstd = _normalize(x, weight, eps)
            rstd = rstd.view(-1, 1)
        else:
            rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
            out = None
            for i in range(0, flat.shape[0], rows):
                y, rstd[i:i + rows] = _normalize(flat[i:i + rows], weight, eps)
                if out is None:   # x's shape, not a view of a [N, D] buffer: autograd treats a returned view apart
                    out = y.new_empty(x.shape)
                out.view(-1, out.shape[-1])[i:i + rows] = y
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        flat, gflat, rows = x.reshape(-1, x.shape[-1]), g.reshape(-1, x.shape[-1]), _norm_rows(x)
        out = dx = None
        if ctx.fused and ctx.needs_input_grad[0]:   # aten's kernel forms g·weight itself (in float32: no [T, D]
            out, dw = torch.ops.aten._fused_rms_norm_backward(   # temporary; within bf16 rounding of the cast's
                g, x, [x.shape[-1]], rstd, weight, [True, ctx.needs_input_grad[1]])   # g·weight), in x's shape
            if ctx.needs_input_grad[1]:   # --train-norms: its weight's gradient too (float32 sums inside, from the
                return out, dw.to(weight.dtype), None   # unrounded x·rstd; no chunk's float32 temporaries)
        elif ctx.needs_input_grad[0]:
            # dx in x's shape, filled through a flat view and returned as is: autograd can then sum a second
            # gradient of x into it in place (a returned view would make it allocate a third [T, D] for the sum)
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            dx = out.view(-1, x.shape[-1])
        dw = torch.zeros(flat.shape[-1], dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        rstd = rstd.view(-1, 1)
        for i in range(0, flat.shape[0] if dx is not None or dw is not None else 0, rows):
            xf, r, gc = flat[i:i + rows].float(), rstd[i:i + rows], gflat[i:i + rows]
            if dw is not None:
                dw += (gc * (xf * r).to(x.dtype)).sum(0, dtype=torch.float32)
            if dx is not None:
                dn = (gc * weight).float()                         # d(normalized), as the cast passes it
                # n = x·r, r = (mean(x²) + eps)^-1/2:  dx = r·dn - r³·x·mean(dn·x)
                dx[i:i + rows] = r * dn - r.pow(3) * xf * (dn * xf).mean(-1, keepdim=True)
        return out, (None if dw is None else dw.to(weight.dtype)), None


class RMSNorm(nn.Module):
    reference = None   # while set (model.norms.reference_trained: DPO's reference model), the weight computed with

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        w = cast_weight(self.weight, x) if self.reference is None else self.reference.to(x.dtype)   # (--train-norms'
        # float32 weight where no mixed precision cast it; DPO's reference: the base's or a reference adapter's)
        if torch.compiler.is_compiling():   # the formula, fused and differentiated by the compiler, which saves x and
            return _normalize(x, w, self.eps)[0]   # recomputes the upcast (torch 2.11's dynamo fails on the Function)
        return _RMSNormFn.apply(x, w, self.eps)
