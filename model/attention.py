"""The attention-core interface the decoder calls, the rule for document boundaries, and the default core.

Contract:
- An `AttentionCore` has `divisor` (a padded sequence length must be a multiple of it),
  `prepare(position_ids)`, called once per model forward with the (local) global-position ids
  [B, S] and returning whatever the core needs per layer (here: document boundaries), and
  `__call__(q, k, v, meta, scale, window=None)` per layer: q [B, S, H, Hd], k/v [B, S, K, Hd] (RoPE
  applied), causal, returns [B, S, H, Hd] in q's dtype, differentiable w.r.t. q, k, v. `window` is the
  layer's sliding window: query i sees keys j with i - window < j <= i (transformers' rule). A decoder with attention
  sinks (GPT-OSS) passes `sinks=` [H] too (a core that takes none is then a TypeError, never a silent drop): each
  head's logit joins every row's softmax denominator as a key of value 0 (`sdpa`, parallel/kernels.py's with_sinks).
  The decoder hands the core its own q, k, v and reads them no more, and reads the core's output only
  through o_proj: a core may reuse their storage in backward (parallel.kernels' `spare_q`; under AC nothing
  checks this). A decoder that keeps any of them for something else must drop `spare_q` in its core.
  `spans(position_ids)` -> [B, S]: each local token's document's largest position + 1 in the whole row
  (`document_spans`: LongRoPE's choice; a context-parallel core gathers the row), once per forward for such a model.
- Documents (packed rows): a document starts at t == 0 and wherever pos[t] != pos[t-1] + 1, so a row
  with contiguous positions, even far from 0, is one document; padding continues the positions of
  the last document. Tokens attend only inside their own document. This module is the one place that
  rule is written; `data/` and `parallel/` import it.
- Branches: a document that starts at position p > 0 right after a document that starts at position 0 and holds
  more than p tokens continues that document's first p tokens (their positions are 0..p-1): it also sees them.
  That is a preference pair whose sides share their prompt, stored once (`data.pairs`): prompt ++ chosen answer
  is one document, the rejected answer a branch after it. `prepare` then gives `Packed(bounds, branches)` in
  place of the bounds; a core that cannot take branches refuses it. No sliding window with branches (its
  distance would be the positions', not the row's).
- `SDPAAttention` (the model's default, one process, whole sequence) is torch's
  `F.scaled_dot_product_attention` per document. The trainer replaces it from outside
  (`parallel.cp.local_attention()` / `cp_attention(...)`): the model holds no parallelism switches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: True where a document starts (t == 0, or pos[t] != pos[t-1] + 1)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def document_bounds(position_ids: torch.Tensor):
    """Per row, the document boundaries [0, s1, ..., S]; None when every row is a single document."""
    starts = document_starts(position_ids)
    if not bool(starts[:, 1:].any()):
        return None
    s = position_ids.shape[1]
    return [row.nonzero().flatten().tolist() + [s] for row in starts.cpu()]


def document_spans(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: each token's document's largest position + 1 (the length transformers sees running that document
    alone: LongRoPE's choice of factors, model/rope.py). Padding continues the last document, so counts in it
    (data.collate restarts a LongRoPE row's padding where it would switch that document's factors)."""
    doc = document_starts(position_ids).cumsum(1) - 1                      # [B, S]: the document index in its row
    top = torch.full_like(position_ids, -1).scatter_reduce(1, doc, position_ids, "amax")   # [B, S]: per document
    return top.gather(1, doc) + 1


class Packed(NamedTuple):
    """A packed row's documents with branches (module docstring)."""
    bounds: list     # per row [0, s1, ..., S]
    branches: list   # per row [(start, end, parent start, p)]: tokens start..end-1 also see parent..parent+p-1


def document_branches(position_ids: torch.Tensor, bounds: list | None) -> list | None:
    """Per row, its branches [(start, end, parent start, p)] (module docstring); None when no row has one."""
    if bounds is None:
        return None
    out = []
    for r, cuts in enumerate(bounds):   # (the positions at the documents' starts only: one small copy a row)
        at = dict(zip(cuts[:-1], position_ids[r, torch.tensor(cuts[:-1], device=position_ids.device)].tolist()))
        docs = list(zip(cuts[:-1], cuts[1:]))
        out.append([(s, e, ps, at[s]) for (ps, pe), (s, e) in zip(docs, docs[1:])
                    if at[s] > 0 and at[ps] == 0 and at[s] < pe - ps])
    return out if any(out) else None


def packed_mask(bounds: list, branches: list | None, s: int, device=None) -> torch.Tensor:
    """Bool [B, S, S]: query i sees key j (causal, its document, a branch's prefix), from a row's bounds and
    branches: the rule written as a mask, O(S^2), for references and tests."""
    keep = torch.zeros(len(bounds), s, s, dtype=torch.bool, device=device)
    for r, cuts in enumerate(bounds):
        for x, y in zip(cuts[:-1], cuts[1:]):
            keep[r, x:y, x:y] = True
        for start, end, parent, p in branches[r] if branches else ():
            keep[r, start:end, parent:parent + p] = True
    return keep & torch.ones(s, s, dtype=torch.bool, device=device).tril()


def visible(position_ids: torch.Tensor) -> torch.Tensor:
    """`packed_mask` of rows given by their position ids."""
    b, s = position_ids.shape
    bounds = document_bounds(position_ids) or [[0, s]] * b
    return packed_mask(bounds, document_branches(position_ids, bounds), s, position_ids.device)


class AttentionCore:
    """What the decoder calls for the attention itself; see the module docstring."""
    divisor: int = 1

    def prepare(self, position_ids: torch.Tensor) -> object:
        bounds = document_bounds(position_ids)
        branches = document_branches(position_ids, bounds)
        return bounds if branches is None else Packed(bounds, branches)

    def __call__(self, q, k, v, meta, scale: float, window: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def spans(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, S]: `document_spans` of the WHOLE rows at this core's (local) tokens (LongRoPE's choice of factors,
        model/rope.py); a core holding a shard of each row (context parallelism) computes them on the gathered row."""
        return document_spans(position_ids)


def sdpa(q, k, v, scale, keep=None, sinks=None):
    """torch SDPA on [B, S, H, Hd] tensors, causal or where `keep` [B or 1, S, S] says; `sinks` [H]: one more key
    per head of logit s_h and value 0 (a zero key, its score s_h added by the float mask): the GPT-OSS softmax."""
    t = lambda x: x.transpose(1, 2)   # SDPA wants [B, H, S, Hd]
    if sinks is None:
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=None if keep is None else keep[:, None],
                                                is_causal=keep is None, scale=scale, enable_gqa=True))
    b, n, h = q.shape[:3]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None] if keep is None else keep
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    bias = torch.cat([bias[:, None].expand(-1, h, -1, -1),
                      sinks.to(q.dtype).view(1, h, 1, 1).expand(bias.shape[0], h, n, 1)], -1)   # [B|1, H, S, S+1]
    zero = lambda x: torch.cat([x, x.new_zeros(b, 1, *x.shape[2:])], 1)
    return t(F.scaled_dot_product_attention(t(q), t(zero(k)), t(zero(v)), attn_mask=bias, scale=scale,
                                            enable_gqa=True))


class SDPAAttention(AttentionCore):
    """torch SDPA over each document of each row (the whole row when it holds one document); a window
    becomes an explicit [S, S] boolean mask (fine for a reference, not for long rows); sinks an [H, S, S+1] float
    one (`sdpa`)."""

    def __call__(self, q, k, v, meta, scale, window=None, sinks=None):
        def one(q, k, v):   # [B, S, H, Hd] in and out
            mask = None
            if window is not None:
                d = torch.arange(q.shape[1], device=q.device)
                d = d[:, None] - d[None, :]
                mask = ((d >= 0) & (d < window))[None]
            return sdpa(q, k, v, scale, mask, sinks)

        if meta is None:
            return one(q, k, v)
        if isinstance(meta, Packed):   # branches: the whole rows, the rule as a mask
            if window is not None:
                raise ValueError("a sliding window with branched documents (shared-prompt pairs) is not supported")
            return sdpa(q, k, v, scale, packed_mask(meta.bounds, meta.branches, q.shape[1], q.device), sinks)
        rows = [torch.cat([one(q[i:i + 1, x:y], k[i:i + 1, x:y], v[i:i + 1, x:y])
                           for x, y in zip(row[:-1], row[1:])], 1) for i, row in enumerate(meta)]
        return torch.cat(rows, 0)
