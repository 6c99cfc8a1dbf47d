"""Attention masks from global token indices, document ids and sliding windows.

Contract:
- `document_ids(position_ids)` -> [B, S] long: the document of every token of a row. A document
  starts where `model.attention.document_starts` says (the one place that rule is written).
- `keep(qi, ki, q_doc=None, k_doc=None, window=None)` -> bool [B or 1, Sq, Sk]: the query at GLOBAL
  index qi[a] sees the key at ki[b] iff ki[b] <= qi[a], both lie in the same document (q_doc [B, Sq]
  vs k_doc [B, Sk], when given) and qi[a] - ki[b] < window (transformers' sliding window: a query
  sees `window` keys, itself included).
- `Documents(ids, bounds)`: a packed batch as ring attention takes it, `ids` from `document_ids` (on the
  device, for `keep`) and `bounds` [0, s1, ..., S] per row (host lists, for `calls`).
- `calls(q_spans, k_spans, bounds, window, tile)` -> the kernel calls that cover exactly the visible
  (query, key) pairs of a block whose query and key positions are runs of consecutive global indices
  (`Span`): [(qa, qe, ka, ke, kind, qg, kg)], local rows qa:qe against local keys ka:ke, kind "full"
  (every pair visible), "causal" (a diagonal block, exactly causal) or "masked" (`keep` of the global
  indices from qg and kg); blocks nothing sees get no call. Decided on the host from the documents'
  bounds and the window, no mask built: a block cut by a boundary or a window edge is split into
  tile × tile pieces (MASK_TILE), each classified the same way, runs of full pieces merged. So a
  masked call's mask and bias are at most tile × tile per row whatever the block's size (a whole
  128k × 64k ring block was an 8 GB mask and a 16 GB bias, and torch's CUDA memory-efficient kernel
  indexes its bias in 32 bits: wrong rows past 2^32 elements, pytorch#187227; a failing backward past
  2^31, pytorch#147585), and only the pieces a boundary crosses pay for a mask; the rest take the plain
  kernels.
- `band_rows(window)`: query rows per call of a sliding window over one document (a call sees
  rows + window - 1 keys): the window (at least 64), fewer where that call's bias would pass
  BAND_ELEMS elements.
- `kernel_bias(keep, q, k, causal)` -> (additive 0/-inf bias [B, H, Sq, Sk] in q's dtype, dead rows
  [B, Sq]): rows with no visible key are unmasked in the bias so kernels never see an empty softmax;
  `parallel.kernels` then overwrites them (out 0, lse -inf) and gives them no gradient.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

import torch

from model.attention import document_bounds, document_branches, document_starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    return document_starts(position_ids).cumsum(1)


def keep(qi, ki, q_doc=None, k_doc=None, window=None, q_pre=None) -> torch.Tensor:
    d = qi[:, None] - ki[None, :]                                  # [Sq, Sk]: distance back to the key
    mask = (d >= 0) if window is None else (d >= 0) & (d < window)
    mask = mask[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])   # [B, Sq, Sk]
    if q_pre is not None:   # a branch's queries see its parent's prefix too: keys lo <= j < hi ([2, B, Sq])
        mask = mask | ((ki[None, None, :] >= q_pre[0][:, :, None]) & (ki[None, None, :] < q_pre[1][:, :, None]))
    return mask


def prefixes(branches, b: int, s: int, device) -> torch.Tensor:
    """[2, B, S] long: the parent keys [lo, hi) each token also sees (lo = hi = 0 off a branch)."""
    pre = torch.zeros(2, b, s, dtype=torch.long)
    for r, row in enumerate(branches):
        for start, end, parent, p in row:
            pre[0, r, start:end], pre[1, r, start:end] = parent, parent + p
    return pre.to(device)


MASK_TILE = 4096        # a masked piece's side: its bool mask and bias are ~50 MB per row in bf16
BAND_ELEMS = 1 << 28    # a sliding-window call's bias: at most this many elements per row and head (512 MB bf16)


class Documents(NamedTuple):
    ids: torch.Tensor     # [B, S] document id of every global token (`document_ids`)
    bounds: list          # per row, its boundaries [0, s1, ..., S] (host ints)
    branches: list | None = None    # per row [(start, end, parent, p)] (`model.attention.document_branches`)
    pre: torch.Tensor | None = None   # `prefixes(branches)`, on the device, for `keep`


def documents(full_positions: torch.Tensor) -> Documents | None:
    """The `Documents` of whole (gathered, padded) rows, None for rows of one document each."""
    bounds = document_bounds(full_positions)
    if bounds is None:
        return None
    branches = document_branches(full_positions, bounds)
    b, s = full_positions.shape
    return Documents(document_ids(full_positions), bounds, branches,
                     None if branches is None else prefixes(branches, b, s, full_positions.device))


def binding(window: int | None, docs: Documents | None, pad: int = 0) -> int | None:
    """`window`, or None where no document of `docs` is longer (a branch counted with its parent's prefix, as its
    positions run) than it and `pad` more tokens (CP's padding, fewer than its divisor, joins a row's last document:
    a window cuts only padding there): such a window cuts no real token's keys. The branched paths place a branch
    away from its prefix in the row, where a window measured by the row would cut what the positions say it does
    not: they take only None."""
    if window is None or docs is None:
        return window
    last = lambda e, row: pad * (e == row[-1])   # (only a row's last document holds padding)
    longest = max([e - s - last(e, row) for row in docs.bounds for s, e in zip(row, row[1:])] +
                  [end - start + p - last(end, docs.bounds[r]) for r, row in enumerate(docs.branches or ())
                   for start, end, _, p in row])
    return None if window >= longest else window


def exact_calls(bounds: list, branches: list) -> list:
    """One process's calls for one whole row (`calls`' form): a causal call per document and a full call of each
    branch's queries against its parent's prefix, exactly the visible pairs and no mask (`calls` would cut the row
    into tiles, and a tile a boundary crosses computes all its pairs: ~50x the visible ones for rows of short
    pairs)."""
    return [(s, e, s, e, "causal", s, s) for s, e in zip(bounds, bounds[1:])] + [
        (start, end, parent, parent + p, "full", start, parent) for start, end, parent, p in branches]


class Span(NamedTuple):
    at: int       # first local position
    start: int    # its global index; the next n - 1 positions follow it
    n: int


def _kind(a, b, c, d, bounds, window, branches=None) -> str:
    """Queries a..b against keys c..d (global, inclusive): "skip", "full", "causal" or "masked"."""
    if c > b or (window is not None and a - d >= window):
        return "skip"
    one_doc, seen, prefix = True, bounds is None, bool(branches)
    for r, row in enumerate(bounds or ()):   # documents are runs of indices: ids at the ends decide
        da, db, dc, dd = (bisect_right(row, x) for x in (a, b, c, d))
        seen = seen or max(da, dc) <= min(db, dd)
        one_doc = one_doc and da == db == dc == dd
        inside = False   # a branch's queries against its parent's prefix: seen; every pair, when the block is in both
        for start, end, parent, p in branches[r] if branches else ():
            if a < end and b >= start and c < parent + p and d >= parent:
                seen = True
                inside = inside or (start <= a and b < end and parent <= c and d < parent + p)
        prefix = prefix and inside
    if not seen:
        return "skip"
    if prefix:
        return "full"
    if one_doc and (window is None or b - c < window):
        if (a, b) == (c, d):   # (a single pair is causal too)
            return "causal"
        if d <= a:
            return "full"
    return "masked"


def _merge_full(calls, row: bool) -> list:
    """Join neighbouring full calls: along keys (row=True: the same rows) or along rows (the same keys)."""
    out = []
    for x in calls:
        y = out[-1] if out else None
        if y and x[4] == y[4] == "full" and row and x[:2] == y[:2] and x[2] == y[3]:
            out[-1] = (*y[:3], x[3], *y[4:])
        elif y and x[4] == y[4] == "full" and not row and x[2:4] == y[2:4] and x[0] == y[1]:
            out[-1] = (y[0], x[1], *y[2:])
        else:
            out.append(x)
    return out


def calls(q_spans, k_spans, bounds=None, window=None, tile: int | None = None, branches=None) -> list:
    """The kernel calls of one block (module docstring). Spans are in increasing local and global order."""
    tile = tile or MASK_TILE
    kinds = {(i, j): _kind(q.start, q.start + q.n - 1, k.start, k.start + k.n - 1, bounds, window, branches)
             for i, q in enumerate(q_spans) for j, k in enumerate(k_spans)}
    if q_spans == k_spans and all(kinds[i, j] == ("causal" if i == j else "full" if i > j else "skip")
                                  for i, j in kinds):   # the zigzag diagonal: one causal call
        end = q_spans[-1].at + q_spans[-1].n
        return [(q_spans[0].at, end, q_spans[0].at, end, "causal", q_spans[0].start, q_spans[0].start)]
    out = []
    for (i, j), kind in sorted(kinds.items()):
        q, k = q_spans[i], k_spans[j]
        if kind != "masked":
            if kind != "skip":
                out.append((q.at, q.at + q.n, k.at, k.at + k.n, kind, q.start, k.start))
            continue
        for x in range(0, q.n, tile):   # cut the block into pieces; classify each the same way
            xe = min(x + tile, q.n)
            row = []
            for y in range(0, k.n, tile):
                ye = min(y + tile, k.n)
                sub = _kind(q.start + x, q.start + xe - 1, k.start + y, k.start + ye - 1, bounds, window, branches)
                if sub != "skip":
                    row.append((q.at + x, q.at + xe, k.at + y, k.at + ye, sub, q.start + x, k.start + y))
            out += row
    while True:   # along keys, then rows, until nothing joins (a join along rows can line up one along keys)
        n = len(out)
        out = _merge_full(sorted(out), row=True)
        out = _merge_full(sorted(out, key=lambda x: (x[2], x[3], x[0])), row=False)
        if len(out) == n:
            return out


def piece_keep(call, ids, window, device, pre=None) -> torch.Tensor:
    """`keep` of a masked call from `calls`: bool [B or 1, rows, keys] from its global indices (and document ids,
    and `Documents.pre` with branches)."""
    qa, qe, ka, ke, _, qg, kg = call
    qi, ki = torch.arange(qg, qg + qe - qa, device=device), torch.arange(kg, kg + ke - ka, device=device)
    return keep(qi, ki, *((ids[:, qi], ids[:, ki]) if ids is not None else (None, None)), window,
                None if pre is None else pre[:, :, qi])


def band_rows(window: int) -> int:
    return max(64, min(window, BAND_ELEMS // (2 * window)))


def kernel_bias(mask, q, k, causal: bool):
    b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    if mask.dim() != 3 or tuple(mask.shape[1:]) != (sq, sk) or mask.shape[0] not in (1, b):
        raise ValueError(f"mask must be bool [B or 1, Sq, Sk] = [{b}, {sq}, {sk}], got {list(mask.shape)}")
    if causal:
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril()
    dead = ~mask.any(-1)                                           # [B or 1, Sq]
    mask = mask | dead[..., None]
    # Rows padded to 16 keys: CUDA's efficient kernel wants aligned bias strides.
    bias = torch.zeros(mask.shape[0], sq, -(-sk // 16) * 16, dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(~mask, float("-inf"))
    return bias[:, None].expand(b, h, sq, sk), dead.expand(b, sq)
