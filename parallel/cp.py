"""The attention core the model calls (one process or context-parallel) and the sequence layouts.

Contract:
- The cores here implement `model.attention.AttentionCore` (q, k, v are the LOCAL shard [B, S_local,
  ...], `prepare` gets the local global-position ids, `__call__(q, k, v, meta, scale, window=None)`
  takes the layer's sliding window, see `parallel.kernels`). Any layout gives the same numbers as
  `local_attention()` on the whole sequence. They pass `spare_q` (the core contract: q, k, v are the
  decoder's own, out is read by o_proj only), so a long row's blocked backward puts dq, dk, dv and its float32
  sums into q's, k's, v's and out's storage.
- `cp_attention(meshes, dims)` picks Ulysses (dims.ring == 1), zigzag ring (dims.ulysses == 1) or
  their hybrid (all-to-all inside each Ulysses group, ring across the groups).
- Layout of the sequence padded to `dims.cp_divisor` (cp rank = ring_rank · ulysses + ulysses_rank):
  ring == 1: contiguous, cp rank r holds the r-th of cp equal slices. ring R > 1: 2R chunks, each
  cut into U = ulysses pieces; cp rank (i, u) holds piece u of chunk i, then piece u of chunk 2R-1-i
  (U = 1 is the plain zigzag). `shard_sequence` / `unshard_sequence` move between the two views.
- `LocalBatches`: samples -> this rank's (input_ids, position_ids, labels[, sides]), train.py's and `evaluate`'s.
- Documents (packed rows): the rule is `model.attention.document_bounds`. Every core keeps every
  token inside its document: `local_attention` and Ulysses (which see whole rows) through
  `kernels.attention(docs=...)`, ring and hybrid by cutting each ring block at the documents of the
  whole (gathered) row (`parallel.masks.Documents`: calls planned from the bounds, pieces masked by id).
  Rows with branches (`model.attention`: shared-prompt pairs) take the ring's planned calls on every layout
  (`ring_attention` without a group where a process holds whole rows: one process, Ulysses; several such rows as
  one); no sliding window: one that cuts no document of real tokens is dropped (none is longer than
  `cp_attention(..., longest)`, train.py's --max-len, or the positions show it), any other refused.
- Attention sinks (`sinks` [H], GPT-OSS): handed to the kernels or the ring, which merge them into each row's final
  (out, lse) (`kernels.with_sinks`); under Ulysses each rank passes its own heads' sinks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loss import IGNORE_INDEX
from model.attention import AttentionCore, document_spans
from parallel import kernels, masks
from parallel.ring import ring_attention
from parallel.ulysses import heads_to_seq, kv_to_heads, seq_to_heads

# --- layouts -----------------------------------------------------------------------------------


def layout_index(seq_len: int, dims) -> torch.Tensor:
    """[S]: the global token index of every local position, shards concatenated in cp-rank order."""
    if seq_len % dims.cp_divisor:
        raise ValueError(f"sequence length {seq_len} is not a multiple of the CP divisor {dims.cp_divisor}")
    idx = torch.arange(seq_len)
    if dims.ring == 1:
        return idx
    idx = idx.view(2 * dims.ring, dims.ulysses, -1)                  # [chunk, piece, token]
    return torch.stack([idx[:dims.ring], idx.flip(0)[:dims.ring]], 2).flatten()  # [i, u, 2, token]


def pad_sequence(x: torch.Tensor, multiple: int, pad_value) -> torch.Tensor:
    """Pad dim 1 at the end to a multiple; pad_value None continues the positions (last + 1, ...)."""
    n = -x.shape[1] % multiple
    if n == 0:
        return x
    if pad_value is None:
        step = torch.arange(1, n + 1, device=x.device, dtype=x.dtype)
        tail = x[:, -1:] + step.view(1, n, *([1] * (x.dim() - 2)))
    else:
        tail = torch.full((x.shape[0], n, *x.shape[2:]), pad_value, dtype=x.dtype, device=x.device)
    return torch.cat([x, tail], 1)


def shard_sequence(x: torch.Tensor, dims, cp_rank: int, pad_value) -> torch.Tensor:
    """[B, S, ...] full -> this cp rank's [B, S_padded / cp, ...]; S is padded to dims.cp_divisor first.

    pad_value: what padding holds (-100 for labels, the pad id for tokens, None for position ids:
    they continue counting so padding joins the last document and never precedes a real token)."""
    x = pad_sequence(x, dims.cp_divisor, pad_value)
    n = x.shape[1] // dims.cp
    idx = layout_index(x.shape[1], dims)[cp_rank * n:(cp_rank + 1) * n].to(x.device)
    return x.index_select(1, idx)


def shard_batch(batch: dict, dims, cp_rank: int, pad_id: int, device) -> tuple:
    """A collated batch (`data.collate`) -> this cp rank's (input_ids, position_ids, labels) on `device`
    (padding, if the batch still needs any: `pad_id`, IGNORE_INDEX, positions continued), and its `sides` (-1 on
    padding) after them when the batch has them."""
    return (shard_sequence(batch["input_ids"], dims, cp_rank, pad_id).to(device),
            shard_sequence(batch["position_ids"], dims, cp_rank, None).to(device),
            shard_sequence(batch["labels"], dims, cp_rank, IGNORE_INDEX).to(device),
            *([shard_sequence(batch["sides"], dims, cp_rank, -1).to(device)] if "sides" in batch else []))


class LocalBatches:
    """train.py's samples -> this rank's tensors: `self(samples)` collates them (`data.collate`: packed in one row
    or padded, a pair's sides) and keeps this cp rank's part (`shard_batch`). `idle` is a sample with no target
    (2 tokens a cp rank: --compile's 0/1 specialization would compile every function again for a row of 1), which a
    data rank runs while another has one more micro-batch, so the collectives stay in step."""

    def __init__(self, samples, tok, dims, cp_rank: int, pack: bool, pairs: bool, device, margs=None):
        from data.collate import collate
        from model.phi3 import pad_restart
        pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)   # (never a target)
        restart = pad_restart(margs) if margs is not None else None   # (LongRoPE: padding never switches factors)
        self.collate = lambda ss: collate(ss, pack, dims.cp_divisor, pad_id, pairs, restart)
        self.pad_id, self.dims, self.cp_rank, self.device = pad_id, dims, cp_rank, device
        n = 2 * dims.cp_divisor
        self.idle = {"input_ids": samples[0]["input_ids"][:1].repeat(n),
                     "labels": torch.full((n,), IGNORE_INDEX, dtype=torch.int32)}

    def __call__(self, samples: list) -> tuple:
        return shard_batch(self.collate(samples), self.dims, self.cp_rank, self.pad_id, self.device)


def unshard_sequence(shards, dims, seq_len: int | None = None) -> torch.Tensor:
    """Inverse of `shard_sequence`: the cp ranks' shards (a list in cp-rank order, or one tensor with
    them concatenated along dim 1, as an all-gather gives) -> [B, S, ...], cut to `seq_len` if given."""
    cat = torch.cat(list(shards), 1) if isinstance(shards, (list, tuple)) else shards
    idx = layout_index(cat.shape[1], dims).to(cat.device)
    full = torch.empty_like(cat)
    full[:, idx] = cat
    return full if seq_len is None else full[:, :seq_len]


def gather_sequence(x: torch.Tensor, group, dims, seq_len: int | None = None) -> torch.Tensor:
    """All-gather a local shard over the cp group and unshard it: [B, S, ...] (not differentiable)."""
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return unshard_sequence(parts, dims, seq_len)


# --- attention cores ---------------------------------------------------------------------------


def _unbound(window, meta):
    """A sliding window beside branches (shared-prompt pairs): none where it cuts no document (`masks.binding`, by
    the positions), else refused (the branched paths measure it by the row; train.py refuses a window below
    --max-len at start, so no side reaches past one it lets through)."""
    if masks.binding(window, meta) is not None:
        raise ValueError(f"a sliding window of {window} tokens, shorter than a document with shared-prompt pairs' "
                         "branches, is not supported: drop --dpo-share-prompt")


def _branched(q, k, v, meta, scale, window, sinks=None):
    """Whole rows with branches (`masks.Documents`, shared-prompt pairs): the ring's planned calls on one process.
    Several rows (an unpacked micro-batch) run as one row of them side by side, which takes the exact calls: planned
    together they took tiles, each computing all its pairs (~3.5x the kept outputs, review helper 47)."""
    _unbound(window, meta)
    b, s = q.shape[:2]
    if b == 1:
        return ring_attention(q, k, v, scale, None, docs=meta, sinks=sinks)
    flat = lambda x: x.reshape(1, b * s, *x.shape[2:])   # [B, S, H, D] -> [1, B*S, H, D]
    return ring_attention(flat(q), flat(k), flat(v), scale, None, docs=_one_row(meta, s), sinks=sinks
                          ).reshape(q.shape)


def _one_row(docs: masks.Documents, s: int) -> masks.Documents:
    """`docs` of B rows of `s` tokens as those of one row holding them in order: each row's documents and branches
    shifted by its start (a row's bounds run from 0 to s, so no document spans two rows)."""
    bounds = [0] + [r * s + x for r, row in enumerate(docs.bounds) for x in row[1:]]
    branches = [(a + r * s, e + r * s, parent + r * s, p) for r, row in enumerate(docs.branches) for a, e, parent, p
                in row]
    ids = (docs.ids + (docs.ids.amax() + 1) * torch.arange(len(docs.bounds), device=docs.ids.device)[:, None])
    return masks.Documents(ids.reshape(1, -1), [bounds], [branches], masks.prefixes([branches], 1, ids.numel(),
                                                                                    ids.device))


class KernelAttention(AttentionCore):
    """One process holds the whole sequence; `parallel.kernels` picks the fastest backend."""

    def prepare(self, position_ids):
        docs = masks.documents(position_ids)
        return docs if docs is not None and docs.branches is not None else docs and docs.bounds

    def __call__(self, q, k, v, meta, scale, window=None, sinks=None):
        if isinstance(meta, masks.Documents):
            return _branched(q, k, v, meta, scale, window, sinks)
        return kernels.attention(q, k, v, True, scale, docs=meta, window=window, spare_q=True, sinks=sinks)


class ContextParallelAttention(AttentionCore):
    """Ulysses all-to-all inside `ulysses_group`, zigzag ring across `ring_group` (either may be trivial)."""

    def __init__(self, dims, cp_group, ulysses_group, ring_group, longest: int | None = None):
        self.dims, self.divisor = dims, dims.cp_divisor
        self.cp_group, self.ulysses_group, self.ring_group = cp_group, ulysses_group, ring_group
        self.longest = longest   # the longest document of real tokens the caller gives (train.py: --max-len), if known

    def _branch_window(self, window, meta):
        """The window rows with branches take: none, as they cannot apply one. That is exact when it cuts no document
        of real tokens: none is longer than `longest`; else as the positions show (`masks.binding` with no padding:
        CP's continues the last document's positions, so its count is not in them), or refused. (Until 2026-12-05
        any padding a row might hold was taken off its last document: a row without padding whose last document was
        1..divisor - 1 tokens past the window had it dropped; review, helper 55.)"""
        if window is not None and self.longest is not None and window >= self.longest:
            return None
        _unbound(window, meta)
        return None

    def prepare(self, position_ids):
        full = gather_sequence(position_ids, self.cp_group, self.dims)  # [B, S]: tiny, once per forward
        docs = masks.documents(full)   # ring blocks (and branches): the ids mask pieces, the bounds plan calls of
        if docs is not None and (self.dims.ring > 1 or docs.branches is not None):   # the padded, unsharded row
            return docs
        return docs and docs.bounds

    def spans(self, position_ids):
        full = gather_sequence(position_ids, self.cp_group, self.dims)   # [B, S]: the whole (padded) rows
        n = position_ids.shape[1]   # (a document crossing ranks: its span is the whole document's on each of them)
        idx = layout_index(full.shape[1], self.dims)[dist.get_rank(self.cp_group) * n:][:n].to(full.device)
        return document_spans(full).index_select(1, idx)                 # [B, S_local]

    def __call__(self, q, k, v, meta, scale, window=None, sinks=None):
        u, r = self.dims.ulysses, self.dims.ring
        if u > 1:  # [B, S/cp, H, D] -> [B, S/r, H/u, D]
            n_heads = q.shape[2]
            k = kv_to_heads(k, n_heads, self.ulysses_group)  # validates the head counts before any traffic
            v = kv_to_heads(v, n_heads, self.ulysses_group)
            q = seq_to_heads(q, self.ulysses_group)
            if sinks is not None:   # this rank's heads: seq_to_heads keeps [rank·H/u, (rank+1)·H/u)
                n = q.shape[2]
                sinks = sinks[dist.get_rank(self.ulysses_group) * n:][:n]
        if r == 1 and isinstance(meta, masks.Documents):   # (Ulysses: whole rows, a share of the heads)
            out = _branched(q, k, v, meta, scale, self._branch_window(window, meta), sinks)
        elif r == 1:
            out = kernels.attention(q, k, v, True, scale, docs=meta, window=window, spare_q=True, sinks=sinks)
        else:
            if u > 1:  # the gathered pieces alternate between the ring rank's two chunks: regroup them
                q, k, v = (_pieces_to_chunks(x, u) for x in (q, k, v))
            if isinstance(meta, masks.Documents) and meta.branches is not None:
                window = self._branch_window(window, meta)
            out = ring_attention(q, k, v, scale, self.ring_group, docs=meta, window=window, sinks=sinks)
            if u > 1:
                out = _chunks_to_pieces(out, u)
        return heads_to_seq(out, self.ulysses_group) if u > 1 else out


def _pieces_to_chunks(x, u):
    """[B, (u, 2, p), ...] -> [B, (2, u, p), ...]: piece-major order to [chunk i | chunk 2R-1-i]."""
    b, n = x.shape[:2]
    return x.reshape(b, u, 2, n // (2 * u), *x.shape[2:]).transpose(1, 2).reshape(x.shape)


def _chunks_to_pieces(x, u):
    b, n = x.shape[:2]
    return x.reshape(b, 2, u, n // (2 * u), *x.shape[2:]).transpose(1, 2).reshape(x.shape)


def local_attention() -> AttentionCore:
    """Single process; honours document boundaries; uses parallel.kernels."""
    return KernelAttention()


def cp_attention(meshes, dims, longest: int | None = None) -> AttentionCore:
    """The CP attention for `dims` (a ParallelDims) over `meshes` (its `build_mesh` result); `longest`: no document
    of real tokens is longer (train.py: --max-len)."""
    if dims.cp == 1:
        return KernelAttention()
    return ContextParallelAttention(dims, meshes.cp.get_group(), meshes.ulysses.get_group(),
                                    meshes.ring.get_group(), longest)

