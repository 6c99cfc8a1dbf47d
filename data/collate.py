"""Collation of one micro-batch into model inputs: padding or packing, never changing the math.

Contract: `collate(samples, pack, divisor, pad_id)` takes samples `{"input_ids", "labels"}` (lists or 1-D
tensors; labels already shifted by `data.tokens`) and returns LongTensors `input_ids`, `labels`, `position_ids`,
all `[B, S]` with `S` a multiple of `divisor` (the CP divisor: cp for Ulysses, 2·cp for ring).
- `pack=False`: B = len(samples). Each row is one sample padded at the END to the longest sample,
  rounded up to `divisor`.
- `pack=True`: B = 1. The samples are concatenated in order into one row, position ids restart at
  0 for each sample, then the row is padded at the end up to `divisor`.
- Padding: input `pad_id`, label -100, and position ids that CONTINUE the preceding sample
  (L, L+1, ...). Attention derives document boundaries from position-id resets (a document starts
  where `pos[t] != pos[t-1] + 1`), so padding joins the last document instead of forming a new
  one: it only ever sits after the real tokens (causal), and its outputs carry no target.
  `restart` (LongRoPE's original length, `model.phi3.pad_restart`): padding that would carry the last document's
  largest position + 1 from at most `restart` past it restarts at 0 instead, a document of its own, so the document
  keeps the factors it takes alone (a CP divisor's padding must not switch it to the long ones).
- A preference pair (`data.pairs.Pairs`: the chosen then the rejected, `"split"` the chosen's length) is two
  documents: position ids restart at the split too; with `"shared"` f (the shared prompt held once) they restart
  at f, which makes the rejected's rest a branch that sees the prompt (`model.attention`). `sides=True` adds
  `sides` [B, S]: 2k on the chosen's tokens of the micro-batch's k-th sample, 2k + 1 on its rejected's, -1 on
  padding and on samples without a split (the DPO loss sums each sequence's log-probabilities by it,
  `parallel.preference.dpo_loss`; a shared prompt's tokens, the chosen's, hold no target).
- Packing keeps the math: each sample's last label is already -100 (shifted per sample before
  concatenation), so no target crosses a document, and position ids restart per document, so RoPE
  and the boundary-aware attention see each document exactly as when it is alone in a row.
"""

from __future__ import annotations

import torch

from loss import IGNORE_INDEX


def _round_up(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _positions(s: dict, n: int) -> torch.Tensor:
    k, f = s.get("split"), s.get("shared", 0)
    return torch.arange(n) if k is None else torch.cat([torch.arange(k), torch.arange(f, f + n - k)])


def _sides(s: dict, n: int, k: int) -> torch.Tensor:
    if s.get("split") is None:
        return torch.full((n,), -1)
    return torch.cat([torch.full((s["split"],), 2 * k), torch.full((n - s["split"],), 2 * k + 1)])


def _row(samples: list[dict], length: int, pad_id: int, first: int = 0, restart=None) -> tuple[torch.Tensor, ...]:
    ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]   # lists, or data.samples' int32
    labels = [torch.as_tensor(s["labels"], dtype=torch.long) for s in samples]
    pos = [_positions(s, len(x)) for s, x in zip(samples, ids)]
    sides = [_sides(s, len(x), first + k) for k, (s, x) in enumerate(zip(samples, ids))]
    n_pad, last = length - sum(len(x) for x in ids), int(pos[-1][-1]) + 1
    start = 0 if restart is not None and last <= restart < last + n_pad else last   # (module docstring)
    return (torch.cat(ids + [torch.full((n_pad,), pad_id)]), torch.cat(labels + [torch.full((n_pad,), IGNORE_INDEX)]),
            torch.cat(pos + [torch.arange(start, start + n_pad)]), torch.cat(sides + [torch.full((n_pad,), -1)]))


def collate(samples: list[dict], pack: bool, divisor: int, pad_id: int, sides: bool = False,
            restart: int | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch -> {"input_ids", "labels", "position_ids"} (and "sides" with `sides`): LongTensors [B, S]."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    for s in samples:
        if len(s["input_ids"]) != len(s["labels"]) or not len(s["input_ids"]):
            raise ValueError("each sample needs non-empty input_ids and labels of the same length")
    if pack:
        rows = [_row(samples, _round_up(sum(len(s["input_ids"]) for s in samples), divisor), pad_id, restart=restart)]
    else:
        length = _round_up(max(len(s["input_ids"]) for s in samples), divisor)
        rows = [_row([s], length, pad_id, k, restart) for k, s in enumerate(samples)]
    ids, labels, pos, side = (torch.stack(x) for x in zip(*rows))
    return {"input_ids": ids, "labels": labels, "position_ids": pos, **({"sides": side} if sides else {})}


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Label positions that enter the loss (the denominator is their sum over the whole step)."""
    return int((batch["labels"] != IGNORE_INDEX).sum())
