"""`--objective dpo`: a micro-batch of preference pairs -> its DPO losses, on any layout.

Contract: `DPO(model, beta, cp_group)(ids, pos, labels, sides, n_pairs)` -> (losses [n_pairs] float64, margins
[n_pairs]) for this rank's shard of a collated micro-batch of `data.pairs.Pairs` (`sides` from `data.collate`).
- The reference model is the policy's start, computed under no_grad (it keeps no activation and no second copy of
  the base): the base with every LoRA layer off (`model.qlora.adapters_off`), since LoRA starts at B = 0 (TRL's
  default with a peft model); or, for a run from `--init-adapter` (DPO after SFT, no merge), the base plus that
  adapter held fixed (`model.qlora.reference_adapter`, TRL's `ref_adapter_name`). Then the policy's forward, which
  backward goes through. Each gives every target token's -log p (`per_token`); `dpo_loss` sums them per sequence,
  over the cp group too, and takes the DPO loss of each pair.
- The caller scales the losses' sum by the step's global pair count, as cross-entropy's is by its target count, and
  counts each pair once per cp group when reporting (every cp rank returns the same losses).
- The step runs two forwards and one backward (one more forward than cross-entropy: ~4/3 of its model FLOPs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.qlora import adapters_off, reference_adapter


def sequence_logps(token_nll: torch.Tensor, sides: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Each sequence's summed log-probability of its targets, float64 [n_seqs]: `token_nll` [N] (per_token losses,
    0 off target), `sides` [N] each token's sequence (-1: none; `data.collate`'s `sides`)."""
    keep = sides.reshape(-1) >= 0
    out = torch.zeros(n_seqs, dtype=torch.float64, device=token_nll.device)
    return out.index_add(0, sides.reshape(-1)[keep], -token_nll.reshape(-1)[keep].double())


def dpo_loss(policy_nll: torch.Tensor, ref_nll: torch.Tensor, sides: torch.Tensor, n_pairs: int, beta: float,
             group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al., 2023) of `n_pairs` pairs: (-log sigmoid(margin) [n_pairs] float64, margin [n_pairs]
    detached), margin = beta · ((log pi - log ref)(chosen) - (log pi - log ref)(rejected)), sequence 2k the chosen
    and 2k + 1 the rejected of pair k.

    Under context parallelism each rank holds part of every sequence: the sums are all-reduced over `group` (the cp
    group), and the loss is differentiable through this rank's own part only, so the ranks' gradients add up to the
    whole sequence's. Every cp rank returns the same losses: count them once (cp rank 0) when reporting."""
    pi = sequence_logps(policy_nll, sides, 2 * n_pairs)
    ref = sequence_logps(ref_nll.detach(), sides, 2 * n_pairs)
    if group is not None and dist.get_world_size(group) > 1 and n_pairs:
        both = torch.stack([pi.detach(), ref])
        dist.all_reduce(both, group=group)
        pi, ref = pi + (both[0] - pi.detach()), both[1]   # the whole sums; the gradient of this rank's part
    rewards = beta * (pi - ref)
    margin = rewards[0::2] - rewards[1::2]
    return -torch.nn.functional.logsigmoid(margin), margin.detach()


class DPO:
    def __init__(self, model, beta: float, cp_group=None, reference: dict | None = None, device=None):
        """`reference`: the --init-adapter's tensors (`model.export.read_init_adapter`), or None for the base."""
        self.model, self.beta, self.cp_group = model, beta, cp_group
        self.off = adapters_off(model) if reference is None else reference_adapter(model, reference, device)
        self.once = float(cp_group is None or dist.get_rank(cp_group) == 0)   # 1 on one rank of each cp group

    def __call__(self, ids, pos, labels, sides, n_pairs: int):
        with torch.no_grad(), self.off:
            ref, _ = self.model(ids, position_ids=pos, labels=labels, per_token=True)
        pol, _ = self.model(ids, position_ids=pos, labels=labels, per_token=True)
        return dpo_loss(pol, ref, sides, n_pairs, self.beta, self.cp_group)
