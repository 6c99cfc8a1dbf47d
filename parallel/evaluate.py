"""The eval loss: the mean loss over every target of the eval samples, the same number on every layout.

Contract: `evaluate(model, samples, to_local, data_rank, data_ranks, group, device, loss_fn, beat)`.
- Each data rank takes a strided share of `samples` (`samples[data_rank::data_ranks]`); the ranks of one cp group
  take the same share and `to_local` gives each its slice of the sequence.
- A rank with fewer samples than the most loaded one runs all-ignored dummies (the first sample, every label
  IGNORE_INDEX), so every rank makes the same collective calls (FSDP's gathers, cp's exchanges) and none waits.
- The loss is the sum over targets divided by their count, both reduced over `group` (dp × cp) in float64: the
  mean over all targets, not a mean of per-rank means, so it does not depend on how samples fall on ranks.
- `loss_fn` is train.py's LOSS_FN (None: the fused cross-entropy), so the eval loss, and --keep-best's choice,
  measure what is trained.
- `beat()` runs before each sample: the watchdog's progress (an eval longer than --timeout is not a stuck rank).
- The model is in eval mode while evaluating (LoRA dropout off) and back in train mode after.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from loss import IGNORE_INDEX


@torch.no_grad()
def evaluate(model, samples, to_local, data_rank, data_ranks, group, device, loss_fn=None, beat=lambda: None):
    """Mean loss over every target of `samples`, reduced over `group` (module docstring)."""
    share = samples[data_rank::data_ranks]
    dummy = {"input_ids": samples[0]["input_ids"], "labels": torch.full_like(samples[0]["labels"], IGNORE_INDEX)}
    share += [dummy] * (math.ceil(len(samples) / data_ranks) - len(share))
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    for s in share:
        beat()
        ids, pos, lab = to_local([s])
        lsum, cnt = model(ids, position_ids=pos, labels=lab, loss_fn=loss_fn)
        tot += torch.stack([lsum.double(), cnt.double()])
    model.train()
    dist.all_reduce(tot, group=group)
    return (tot[0] / tot[1].clamp(min=1)).item()
