"""`--objective dpo`: a micro-batch of preference pairs -> its DPO losses, on any layout.

Contract: `DPO(model, beta, cp_group)(ids, pos, labels, sides, n_pairs)` -> (losses [n_pairs] float64, margins
[n_pairs]) for this rank's shard of a collated micro-batch of `data.pairs.Pairs` (`sides` from `data.collate`).
- The reference model is the base: one forward with every LoRA layer off (`model.qlora.adapters_off`), under
  no_grad, so it keeps no activation and no second copy of any weight; then the policy's forward, which backward
  goes through. Each gives every target token's -log p (`per_token`); `loss.dpo_loss` sums them per sequence, over
  the cp group too, and takes the DPO loss of each pair.
- Since LoRA starts at B = 0 the reference is the policy at step 0 (TRL's default with a peft model). A run from
  `--init-adapter` would need that adapter as the reference: refused at start-up (merge it into the base first).
- The caller scales the losses' sum by the step's global pair count, as cross-entropy's is by its target count, and
  counts each pair once per cp group when reporting (every cp rank returns the same losses).
- The step runs two forwards and one backward (one more forward than cross-entropy: ~4/3 of its model FLOPs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loss import dpo_loss
from model.qlora import adapters_off


class DPO:
    def __init__(self, model, beta: float, cp_group=None):
        self.model, self.beta, self.cp_group, self.off = model, beta, cp_group, adapters_off(model)
        self.once = float(cp_group is None or dist.get_rank(cp_group) == 0)   # 1 on one rank of each cp group

    def __call__(self, ids, pos, labels, sides, n_pairs: int):
        with torch.no_grad(), self.off:
            ref, _ = self.model(ids, position_ids=pos, labels=labels, per_token=True)
        pol, _ = self.model(ids, position_ids=pos, labels=labels, per_token=True)
        return dpo_loss(pol, ref, sides, n_pairs, self.beta, self.cp_group)
