"""The attention-core interface the decoder calls, the rule for document boundaries, and the default core.

Contract:
- An `AttentionCore` has `divisor` (a padded sequence length must be a multiple of it),
  `prepare(position_ids)`, called once per model forward with the (local) global-position ids
  [B, S] and returning whatever the core needs per layer (here: document boundaries), and
  `__call__(q, k, v, meta, scale, window=None)` per layer: q [B, S, H, Hd], k/v [B, S, K, Hd] (RoPE
  applied), causal, returns [B, S, H, Hd] in q's dtype, differentiable w.r.t. q, k, v. `window` is the
  layer's sliding window: query i sees keys j with i - window < j <= i (transformers' rule).
  The decoder hands the core its own q, k, v and reads them no more, and reads the core's output only
  through o_proj: a core may reuse their storage in backward (parallel.kernels' `spare_q`; under AC nothing
  checks this). A decoder that keeps any of them for something else must drop `spare_q` in its core.
- Documents (packed rows): a document starts at t == 0 and wherever pos[t] != pos[t-1] + 1, so a row
  with contiguous positions, even far from 0, is one document; padding continues the positions of
  the last document. Tokens attend only inside their own document. This module is the one place that
  rule is written; `data/` and `parallel/` import it.
- `SDPAAttention` (the model's default, one process, whole sequence) is torch's
  `F.scaled_dot_product_attention` per document. The trainer replaces it from outside
  (`parallel.cp.local_attention()` / `cp_attention(...)`): the model holds no parallelism switches.
"""

from __future__ import annotations

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


class AttentionCore:
    """What the decoder calls for the attention itself; see the module docstring."""
    divisor: int = 1

    def prepare(self, position_ids: torch.Tensor) -> object:
        return document_bounds(position_ids)

    def __call__(self, q, k, v, meta, scale: float, window: int | None = None) -> torch.Tensor:
        raise NotImplementedError


class SDPAAttention(AttentionCore):
    """torch SDPA over each document of each row (the whole row when it holds one document); a window
    becomes an explicit [S, S] boolean mask (fine for a reference, not for long rows)."""

    def __call__(self, q, k, v, meta, scale, window=None):
        def sdpa(q, k, v):   # [B, S, H, Hd] in and out; SDPA wants [B, H, S, Hd]
            mask = None
            if window is not None:
                d = torch.arange(q.shape[1], device=q.device)
                d = d[:, None] - d[None, :]
                mask = (d >= 0) & (d < window)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, is_causal=mask is None, scale=scale,
                                                 enable_gqa=True)
            return out.transpose(1, 2)

        if meta is None:
            return sdpa(q, k, v)
        rows = [torch.cat([sdpa(q[i:i + 1, x:y], k[i:i + 1, x:y], v[i:i + 1, x:y])
                           for x, y in zip(row[:-1], row[1:])], 1) for i, row in enumerate(meta)]
        return torch.cat(rows, 0)
