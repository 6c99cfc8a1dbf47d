"""Ulysses all-to-all: sequence-sharded <-> head-sharded activations (DeepSpeed-Ulysses, Jacobs et al. 2023).

Contract:
- `seq_to_heads(x, group)`: [B, S/P, H, D] on each of the P ranks -> [B, S, H/P, D], rank p keeping
  heads [p·H/P, (p+1)·H/P) of the whole sequence (the shards concatenated in group-rank order).
  `heads_to_seq` is its inverse. Both are autograd Functions whose backward is the other one.
- `kv_to_heads(x, n_heads, group)` does the same for K or V with Hkv heads so that every rank ends
  up with exactly the KV heads of its query heads (query head h reads KV head h // (H / Hkv)):
  split when P divides Hkv, replicated P / Hkv times first when P is a multiple of Hkv. Replication
  is a differentiable expand, so autograd sums the gradient of every copy back into its KV head.
- The degree must satisfy `parallel.mesh.ulysses_ok`; violations raise ValueError here too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.mesh import ulysses_ok


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [P, ...] contiguous; block p goes to rank p, and block p of the result came from rank p."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x, group):
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    x = x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, s, H/P, D]
    return _all_to_all(x, group).transpose(0, 1).reshape(b, p * s, h // p, d)  # [B, S, H/P, D]


def _heads_to_seq(x, group):
    p = dist.get_world_size(group)
    b, n, h, d = x.shape
    x = x.reshape(b, p, n // p, h, d).transpose(0, 1).contiguous()  # [P, B, s, H/P, D]
    return _all_to_all(x, group).permute(1, 2, 0, 3, 4).reshape(b, n // p, p * h, d)  # [B, s, H, D]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] -> [B, S, H/P, D] (differentiable)."""
    p = dist.get_world_size(group)
    if x.shape[2] % p:
        raise ValueError(f"{x.shape[2]} heads are not divisible by the Ulysses degree {p}")
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D] (differentiable)."""
    return _HeadsToSeq.apply(x, group)


def kv_to_heads(x: torch.Tensor, n_heads: int, group) -> torch.Tensor:
    """K or V [B, S/P, Hkv, D] -> [B, S, max(Hkv/P, 1), D], matching `seq_to_heads` of the queries."""
    p = dist.get_world_size(group)
    b, s, hkv, d = x.shape
    why = ulysses_ok(p, n_heads, hkv)
    if why:
        raise ValueError(f"Ulysses attention: {why}")
    if hkv < p:
        # Rank r holds query heads that all read KV head r // (P / Hkv): give each rank its own copy.
        x = x[:, :, :, None].expand(b, s, hkv, p // hkv, d).reshape(b, s, p, d)
    return _SeqToHeads.apply(x, group)
