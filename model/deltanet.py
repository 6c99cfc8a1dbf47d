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
  Projections, gates, the gated norm and out_proj act per token and stay in the module.
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

from model.attention import document_bounds, document_branches, document_starts
from model.deltanet_core import CHUNK, SEGMENT, Docs, causal_conv, gated_delta_rule, l2norm, local_linear_core

# the core's names re-exported from their old home (tests, parallel/cp_linear.py, model/linear_layers.py import here)
__all__ = ["CHUNK", "SEGMENT", "Docs", "GatedDeltaNet", "GatedRMSNorm", "causal_conv", "gated_delta_rule", "l2norm",
           "local_linear_core", "prepare_linear"]


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


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's dv, then weight (plain, not 1 + w), then · silu(z): transformers' RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        f = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(f)
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * n * F.silu(z.to(f))).to(x.dtype)


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
        out = (core or local_linear_core)(q, k, v, g, beta, conv_w, meta)        # [B, S, Hv, dv]
        out = self.norm(out, self.in_proj_z(x).view(B, S, Hv, dv))
        return self.out_proj(out.reshape(B, S, Hv * dv))
