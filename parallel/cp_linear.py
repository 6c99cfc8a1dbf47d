"""Context parallelism for the linear-attention layers (Gated DeltaNet, model/deltanet.py): the counterpart of
parallel/cp.py's `ContextParallelAttention` for `GatedDeltaNet.forward(x, meta, core)`.

Contract:
- `cp_linear(meshes, dims)` -> a core with `prepare(position_ids)` and `__call__(q, k, v, g, beta, conv_w, meta)`
  (model/deltanet.py's core signature, on this rank's shard [B, S/cp, ...]). dims.cp == 1: model/linear_layers.py's
  `LocalLinear`, the whole-sequence `local_linear_core` with `prepare_linear`. Else `ContextParallelLinear` over the
  WHOLE cp group, whatever split attention takes (Ulysses, zigzag ring, hybrid): a recurrence needs each head's
  whole sequence in order, which no ring of blocks gives.
- `prepare(local position_ids)` gathers the whole rows' position ids (tiny, once per forward) and returns
  `prepare_linear` of them (the padded rows `shard_sequence` made: padding continues the last document).
- `__call__`: all-to-all by heads (parallel/ulysses.py: rank p gets value heads [p·Hv/P, (p+1)·Hv/P) of the whole
  sequence, and the key heads that serve them: split when P divides Hk, a replicated copy when P is a multiple of Hk,
  as `kv_to_heads` does for GQA), the gathered shards (cp-rank order) put into global order with `layout_index`
  (ring and hybrid layouts are permuted), `local_linear_core` on that head range with its conv weight slices and the
  whole rows' meta, the permutation undone, all-to-all back. Differentiable: the all-to-alls' backward is the reverse
  all-to-all, the permutation an index_select, the weight slices views (each rank's parameter gradients hold its
  head range's share: FSDP's reduce over the cp ranks sums them).
- Head counts the cp degree cannot split are refused before any traffic: cp must divide the key heads or be a
  multiple of them, and divide the value heads. `check_linear_heads` says so with the fix (parallel.mesh.validate
  calls it beside the attention heads' check); the core refuses the same at its first call.
- Cost per layer: three all-to-alls each way (q|k, v, g|beta: about the bytes of Ulysses' q, k, v) and the core's
  memory for Hv/cp heads of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model import deltanet_core
from model.deltanet import prepare_linear
from model.linear_layers import LocalLinear
from parallel.cp import gather_sequence, layout_index
from parallel.ulysses import heads_to_seq, kv_to_heads, seq_to_heads


def linear_cp_ok(n_k_heads: int, n_v_heads: int, cp: int) -> str | None:
    """Why `cp` cannot split these linear-attention heads, or None when it can."""
    if n_k_heads % cp and cp % n_k_heads:
        return (f"the {n_k_heads} linear-attention key heads are not divisible by --cp {cp}, nor is it a multiple "
                f"of them (each rank's value heads read whole key heads)")
    if n_v_heads % cp:
        return f"the {n_v_heads} linear-attention value heads are not divisible by --cp {cp}"
    return None


def check_linear_heads(n_k_heads: int, n_v_heads: int, cp: int) -> None:
    """Refuse a --cp the linear layers' heads cannot take, naming the degrees they can (every cp layout splits the
    linear layers by heads over the whole cp group, unlike attention's ring)."""
    why = linear_cp_ok(n_k_heads, n_v_heads, cp)
    if why:
        fits = ", ".join(str(c) for c in range(1, n_v_heads + 1) if linear_cp_ok(n_k_heads, n_v_heads, c) is None)
        raise ValueError(f"context parallelism: {why} (model: {n_k_heads} key heads, {n_v_heads} value heads in its "
                         f"linear-attention layers, which every --cp-impl splits by heads across all cp ranks). "
                         f"Use a --cp of {fits}.")


class ContextParallelLinear(LocalLinear):
    """All-to-all by heads over the whole cp group (module docstring)."""

    def __init__(self, dims, cp_group):
        self.dims, self.cp_group, self._orders = dims, cp_group, {}

    def prepare(self, position_ids):
        return prepare_linear(gather_sequence(position_ids, self.cp_group, self.dims))   # [B, S]: tiny

    def _order(self, n: int, device):
        """(layout_index of n tokens, its inverse) on `device`, made once per length (not per layer call: a host
        arange and a copy to the device each time); (None, None) for the contiguous layout."""
        if self.dims.ring == 1:
            return None, None
        key = (n, str(device))
        if key not in self._orders:
            idx = layout_index(n, self.dims).to(device)
            inv = torch.empty_like(idx)
            inv[idx] = torch.arange(n, device=device)
            self._orders = {key: (idx, inv)}   # (the latest length only: rows of one run share it)
        return self._orders[key]

    def __call__(self, q, k, v, g, beta, conv_w, meta):
        group, P = self.cp_group, self.dims.cp
        hk, hv, dk = q.shape[2], v.shape[2], q.shape[3]
        why = linear_cp_ok(hk, hv, P)   # before any traffic
        if why:
            raise ValueError(f"context-parallel linear attention: {why}")
        p = dist.get_rank(group)
        # [B, S/P, H, d] -> [B, S, H/P, d], shards in cp-rank order; q and k travel together, as do g and beta
        qk = kv_to_heads(torch.cat([q, k], -1), hv, group)                       # [B, S, max(Hk/P, 1), 2·dk]
        v = seq_to_heads(v, group)                                               # [B, S, Hv/P, dv]
        f = g.dtype   # (float32 or float64: beta's dtype goes there and back exactly)
        gb = seq_to_heads(torch.stack([g, beta.to(f)], -1), group)               # [B, S, Hv/P, 2]
        idx, inv = self._order(v.shape[1], v.device)
        if idx is not None:   # zigzag / hybrid: position j of the gathered shards holds global token idx[j]
            qk, v, gb = (x.index_select(1, inv) for x in (qk, v, gb))              # global order
        q, k = qk.split(dk, -1)
        g, b = gb.unbind(-1)
        # this rank's heads: value heads [a, a + Hv/P); key heads [a·Hk/Hv, ...) or the one serving them (replicated)
        a, n = p * (hv // P), hv // P
        ka, kn = (p * (hk // P), hk // P) if hk >= P else (p // (P // hk), 1)
        wq, wk, wv = conv_w
        # (looked up here: made at first use, model/deltanet_core.py)
        out = deltanet_core.local_linear_core(q, k, v, g, b.to(beta.dtype),
                                              (wq[ka:ka + kn], wk[ka:ka + kn], wv[a:a + n]), meta)   # [B, S, Hv/P, dv]
        if idx is not None:
            out = out.index_select(1, idx)                                       # back to the shards' order
        return heads_to_seq(out, group)                                          # [B, S/P, Hv, dv]


def cp_linear(meshes, dims) -> LocalLinear:
    """The linear layers' core for `dims` (a ParallelDims) over `meshes` (its `build_mesh` result), beside
    `parallel.cp.cp_attention`."""
    if dims.cp == 1:
        return LocalLinear()
    return ContextParallelLinear(dims, meshes.cp.get_group())
