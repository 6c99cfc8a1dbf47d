"""Gated DeltaNet: the linear-attention sublayer of Qwen3.5 (3 of every 4 layers), with transformers' parameter names.

Contract:
- `GatedDeltaNet(dim, n_k_heads, n_v_heads, k_head_dim, v_head_dim, conv_kernel, eps)` holds transformers'
  `Qwen3_5GatedDeltaNet` parameters under the same names (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d.weight
  [C, 1, K], dt_bias, A_log, norm.weight, out_proj), so its state_dict loads strictly and peft adapters map.
  `forward(x, meta, core=None)`: x [B, S, D], the normed block input; returns [B, S, D] in x's dtype.
- `meta = prepare_linear(position_ids)`, once per model forward from the WHOLE rows' position ids [B, S]: None when
  every row is one document, else `Docs`. Documents follow `model.attention.document_starts` (a document starts where
  positions do not continue; padding continues the last one); the recurrent state AND the convolution restart at
  every document start, exactly as if each document ran alone. Branched rows (shared-prompt pairs) are refused.
- The core: everything that mixes tokens goes through `core(q, k, v, g, beta, conv_w, meta) -> [B, S, Hv, dv]`
  (`local_linear_core` by default): q, k [B, S, Hk, dk] and v [B, S, Hv, dv] straight from in_proj_qkv (before the
  convolution), g (log decay, float32, <= 0) and beta [B, S, Hv], conv_w = (w_q [Hk, dk, K], w_k [Hk, dk, K],
  w_v [Hv, dv, K]). It does the causal depthwise conv + silu, the l2 norm of q and k, and the gated delta rule.
  Projections, gates, the gated norm and out_proj act per token and stay in the module. The gated norm
  (`GatedRMSNorm`, transformers' Qwen3_5RMSNormGated, its outputs bitwise) keeps only its inputs x, z and a float32
  rsqrt a token and value head, recomputing the rest in backward in chunks (`_GatedNormFn`).
  A context-parallel core (all-to-all by heads, as Ulysses) hands the local core the whole sequence for a head range:
  value heads j are served by key head j // (Hv / Hk), so a rank holding value heads [a, b) (a, b multiples of
  Hv / Hk) takes key heads [a·Hk/Hv, b·Hk/Hv) of q, k, w_q, w_k, and v, g, beta, w_v sliced to [a, b); meta is the
  whole rows' `prepare_linear`, unchanged. Outputs of the head ranges concatenate along dim 2.
- The core's own contract (the rule in float32 chunks, fla's kernel on CUDA, its segments recomputed in backward):
  model/deltanet_core.py, which holds it (`local_linear_core`, `causal_conv`, `gated_delta_rule`, `l2norm`, `Docs`,
  CHUNK, SEGMENT, all re-exported here; FLA, the switch off fla's kernel, is model.deltanet_core.FLA).
- The decoder's side (LinearSpec, LinearBlock, the model's default core LocalLinear): model/linear_layers.py.

Notation: B batch, S sequence, D model dim, Hk / Hv key / value heads, dk / dv their head dims, K conv kernel,
C = 2·Hk·dk + Hv·dv conv channels, N chunks. Algorithm: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (2024),
chunkwise form with the WY / UT transform.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import deltanet_core
from model.attention import document_bounds, document_branches, document_starts
from model.deltanet_core import CHUNK, SEGMENT, Docs, causal_conv, gated_delta_rule, l2norm
from model.norms import cast_weight

# the core's names re-exported from their old home (tests, parallel/cp_linear.py, model/linear_layers.py import here);
# local_linear_core too, by __getattr__ below
__all__ = ["CHUNK", "SEGMENT", "Docs", "GatedDeltaNet", "GatedRMSNorm", "causal_conv", "gated_delta_rule", "l2norm",
           "prepare_linear"]


def __getattr__(name: str):   # local_linear_core, made at its first use (model/deltanet_core.py's __getattr__)
    if name != "local_linear_core":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return deltanet_core.local_linear_core


# elements a chunk of the gated norm: its float32 temporaries (~6 at once in backward) 32 MB each, ~200 MB in all, at
# any length (at Qwen3.5-9B's 32 value heads of 128: 2,048 tokens a chunk, 16 chunks at 32k tokens)
GATED_CHUNK = 2**23


def prepare_linear(position_ids: torch.Tensor) -> Docs | None:
    """The linear layers' meta for whole rows' position ids [B, S]: None when every row is one document."""
    starts = document_starts(position_ids)
    if not bool(starts[:, 1:].any()):
        return None
    if document_branches(position_ids, document_bounds(position_ids)) is not None:
        raise ValueError("rows with branched documents (shared-prompt preference pairs, --dpo-share-prompt) reach a "
                         "linear-attention layer, whose state cannot fork at a branch: run without "
                         "--dpo-share-prompt")
    seg = starts.long().cumsum(1)
    return Docs(starts, seg, int(seg[:, -1].max()))


def _gated_norm(x, z, w, eps):
    """transformers' Qwen3_5RMSNormGated on x, z [..., dv]: (out in x's dtype, rsqrt [..., 1] in float32; float64
    stays: references). Its order: normalized in float32, cast to x's dtype, · w, then · silu(z) in float32."""
    f = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(f)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w * (xf * r).to(x.dtype) * F.silu(z.to(f))).to(x.dtype), r


class _GatedNormFn(torch.autograd.Function):
    """The gated norm saving x, z (compute dtype, [T, Hv, dv]; z a view of in_proj_z's output) and rsqrt [T·Hv], not
    autograd's float32 x, z and silu(z) and w·normed (3.5 of x's size at bf16), and running both ways over row chunks
    of GATED_CHUNK elements: its float32 temporaries (~6 at once in backward) never exceed a chunk's. Forward is the
    formula per chunk (bitwise); backward derives it by hand, rounding to the compute dtype where autograd's casts do
    (the gradients of w·normed and of normed), w's gradient summed in float32; in place where that rounds the same."""

    @staticmethod
    def forward(ctx, x, z, w, eps):
        dv = x.shape[-1]
        xs, zs = x.reshape(-1, dv), z.reshape(-1, dv)
        rows = max(1, min(xs.shape[0], GATED_CHUNK // dv))
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        r = xs.new_empty(xs.shape[0], 1, dtype=torch.promote_types(x.dtype, torch.float32))
        for i in range(0, xs.shape[0], rows):
            out.view(-1, dv)[i:i + rows], r[i:i + rows] = _gated_norm(xs[i:i + rows], zs[i:i + rows], w, eps)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(x, z, w, r)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, g):
        x, z, w, r = ctx.saved_tensors
        dv, rows, f = x.shape[-1], ctx.rows, r.dtype
        xs, zs, gs = x.reshape(-1, dv), z.reshape(-1, dv), g.reshape(-1, dv)
        need_x, need_z, need_w = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else None
        dz = torch.empty_like(z, memory_format=torch.contiguous_format) if need_z else None
        dw = torch.zeros(dv, dtype=f, device=x.device) if need_w else None
        for i in range(0, xs.shape[0], rows):
            at = slice(i, i + rows)
            zf, rc, gf = zs[at].to(f), r[at], gs[at].to(f)
            n = (xs[at].to(f) * rc).to(x.dtype)          # out = (w·n) · silu(z) in float32, cast to x's dtype
            if need_z:   # silu'(z) = s·(1 + z·(1 - s)), s = sigmoid(z): silu_backward's order
                t, s = gf * (w * n), torch.sigmoid(zf)
                t.mul_(s)
                dz.view(-1, dv)[at] = t.mul_(s.neg_().add_(1).mul_(zf).add_(1))
                del t, s
            if need_x or need_w:
                dwn = (gf * F.silu(zf)).to(torch.promote_types(w.dtype, n.dtype))   # (the promotion's cast back)
                del zf, gf
                if need_w:
                    dw += (dwn * n).sum(0, dtype=f)
                del n
                if need_x:   # n = x·r, r = (mean(x²) + eps)^-1/2:  dx = r·dn - r³·x·mean(dn·x)
                    dn, xf = (dwn * w).to(x.dtype).to(f), xs[at].to(f)
                    del dwn
                    m = (dn * xf).mean(-1, keepdim=True)
                    dx.view(-1, dv)[at] = dn.mul_(rc).sub_(xf * rc.pow(3).mul_(m))
                    del dn, xf   # (not held into the next chunk's)
        return dx, dz, None if dw is None else dw.to(w.dtype), None


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's dv, then weight (plain, not 1 + w), then · silu(z): transformers' RMSNormGated.
    Eager: `_GatedNormFn` (its inputs and rsqrt saved, chunked); compiled: the formula, which the compiler fuses and
    differentiates, keeping the same x, z and rsqrt (tests/test_gated_norm.py; torch 2.13's dynamo traces the Function
    too, checked by hand; the formula keeps its chunk loop out of a graph)."""

    reference = None   # DPO's reference weight while set (model.norms.reference_trained), as model.rmsnorm.RMSNorm's

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        w = cast_weight(self.weight, x) if self.reference is None else self.reference.to(x.dtype)   # (--train-norms'
        # float32 master where no mixed precision cast it, as transformers' weight is the model's dtype)
        if torch.compiler.is_compiling():
            return _gated_norm(x, z, w, self.eps)[0]
        return _GatedNormFn.apply(x, z, w, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear attention: {n_v_heads} value heads are not a multiple of {n_k_heads} key heads "
                             "(each key head serves a whole group of value heads); check the checkpoint's config")
        self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim = n_k_heads, n_v_heads, k_head_dim, v_head_dim
        kd, vd = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.in_proj_qkv = nn.Linear(dim, 2 * kd + vd, bias=False)
        self.in_proj_z = nn.Linear(dim, vd, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(2 * kd + vd, 2 * kd + vd, conv_kernel, groups=2 * kd + vd, bias=False)  # read only
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))    # as weights: conv_w in the core
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = nn.Linear(vd, dim, bias=False)

    def forward(self, x, meta, core=None):
        B, S, _ = x.shape
        Hk, Hv, dk, dv = self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim
        q, k, v = self.in_proj_qkv(x).split([Hk * dk, Hk * dk, Hv * dv], -1)
        q, k, v = q.view(B, S, Hk, dk), k.view(B, S, Hk, dk), v.view(B, S, Hv, dv)
        beta = self.in_proj_b(x).sigmoid()                                       # [B, S, Hv]
        # log decay <= 0, in float32 (exp(A_log) overflows half precision; float64 stays: references)
        f = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(f).exp() * F.softplus(self.in_proj_a(x).to(f) + self.dt_bias.to(f))
        w = self.conv1d.weight[:, 0]                                             # [C, K]
        conv_w = w.split([Hk * dk, Hk * dk, Hv * dv])
        conv_w = (conv_w[0].view(Hk, dk, -1), conv_w[1].view(Hk, dk, -1), conv_w[2].view(Hv, dv, -1))
        out = (core or deltanet_core.local_linear_core)(q, k, v, g, beta, conv_w, meta)   # [B, S, Hv, dv]
        out = self.norm(out, self.in_proj_z(x).view(B, S, Hv, dv))
        return self.out_proj(out.reshape(B, S, Hv * dv))
