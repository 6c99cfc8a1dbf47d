"""`--objective dpo`: a micro-batch of preference pairs -> its DPO losses, on any layout.

Contract: `DPO(model, Preference(...), cp_group)(ids, pos, labels, sides, n_pairs)` -> (losses [n_pairs] float64,
rewards [n_pairs, 2]: chosen, rejected) for this rank's shard of a collated micro-batch of `data.pairs.Pairs`
(`sides` from `data.collate`).
- The reference model is the policy's start, computed under no_grad (it keeps no activation and no second copy of
  the base): the base with every LoRA layer off (`model.qlora.adapters_off`), since LoRA starts at B = 0 (TRL's
  default with a peft model); or, for a run from `--init-adapter` (DPO after SFT, no merge), the base plus that
  adapter held fixed (`model.qlora.reference_adapter`, TRL's `ref_adapter_name`). Then the policy's forward, which
  backward goes through. Each gives every target token's -log p (`per_token`); `dpo_loss` sums them per sequence,
  over the cp group too, and takes the DPO loss of each pair.
- The caller scales the losses' sum by the step's global pair count, as cross-entropy's is by its target count, and
  counts each pair once per cp group when reporting (every cp rank returns the same losses).
- The step runs two forwards and one backward (one more forward than cross-entropy: ~4/3 of its model FLOPs);
  SimPO and ORPO, which have no reference, one of each.
- `Preference` is the loss (--dpo-loss and its flags), each from its paper, as TRL computes it where it is the
  reference implementation: sigmoid (DPO; with --dpo-label-smoothing ε, conservative DPO, Mitchell 2023), ipo (Azar
  et al., 2023; log-probabilities averaged over each sequence's targets, as TRL does), hinge (SLiC, Zhao et al.,
  2023), simpo (Meng et al., 2024: reference-free, averaged log-probabilities, margin --simpo-gamma), orpo (Hong et
  al., 2024: reference-free, the chosen side's mean NLL plus beta (its λ) times the odds ratio's loss); --rpo-alpha
  adds α times the chosen side's mean negative log-likelihood per pair (RPO, Pang et al., 2024).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from loss import IGNORE_INDEX
from parallel.plan_totals import REFERENCE_FREE

if TYPE_CHECKING:
    from parallel.ref_cache import RefCache

NAMES = {"sigmoid": "DPO", "ipo": "IPO", "hinge": "SLiC (hinge)", "simpo": "SimPO", "orpo": "ORPO"}   # --dpo-loss's


@dataclass(frozen=True)
class Preference:
    """The preference loss of one pair from its sequences' log-probabilities (module docstring)."""
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    gamma: float = 0.5

    @classmethod
    def from_args(cls, args) -> Preference:
        return cls(args.dpo_loss, args.dpo_beta, args.dpo_label_smoothing, args.rpo_alpha, args.simpo_gamma)

    def __str__(self) -> str:   # (the run's `loss:` line)
        return ", ".join([f"{NAMES[self.loss]} (--dpo-loss {self.loss})", f"beta {self.beta:g}"] +
                         [f"{k} {v:g}" for k, v, on in (
                             ("label smoothing", self.label_smoothing, self.label_smoothing),
                             ("RPO alpha", self.rpo_alpha, self.rpo_alpha),
                             ("gamma", self.gamma, self.loss == "simpo")) if on])

    def note(self, lora_dropout: float = 0.0) -> str | None:
        """The run's `note:` lines about its loss (allowed, but likely a slip), or None."""
        said = [f"note: --lora-dropout {lora_dropout:g} drops LoRA inputs in the policy's forward, not in the "
                "reference's: the losses and rewards carry that noise (TRL turns dropout off for DPO)"] * bool(
            lora_dropout and self.reference)
        if self.loss == "simpo" and self.beta < 1:   # (0.1, DPO's, is the default)
            said.append(f"note: --dpo-beta {self.beta:g} with SimPO, whose beta scales mean log-probabilities: its "
                        "paper and TRL use 2 to 2.5 (--dpo-beta 2)")
        return "\n".join(said) or None

    @property
    def reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    def at_start(self) -> float | None:
        """The loss of every pair while the policy is its reference (no RPO term): known without a pass."""
        if not self.reference or self.rpo_alpha:
            return None
        return {"sigmoid": math.log(2), "ipo": 1 / (2 * self.beta) ** 2, "hinge": 1.0}[self.loss]

    def __call__(self, pi, ref, n) -> tuple[torch.Tensor, torch.Tensor]:
        """(each pair's loss [pairs], its sides' rewards [pairs, 2] detached: chosen, rejected) from float64
        [2 × pairs] sums of log-probabilities (`ref` None without a reference) and target counts `n`, the chosen at
        even indices."""
        f, b = torch.nn.functional, self.beta
        mean = pi / n
        if not self.reference:
            rewards = b * mean
            h = mean[0::2] - mean[1::2]
        else:
            d = (pi - ref) / n if self.loss == "ipo" else pi - ref
            rewards = b * d   # (TRL's: of the log-ratios the loss takes, IPO's averaged)
            h = d[0::2] - d[1::2]
        if self.loss == "sigmoid":
            losses = -(1 - self.label_smoothing) * f.logsigmoid(b * h) - self.label_smoothing * f.logsigmoid(-b * h)
        elif self.loss == "ipo":
            losses = (h - 1 / (2 * b)) ** 2
        elif self.loss == "hinge":
            losses = torch.relu(1 - b * h)
        elif self.loss == "simpo":
            losses = -f.logsigmoid(b * h - self.gamma)
        else:   # log odds p / (1 - p) of the mean likelihoods p; log(1 - p) = log(-expm1(log p)), exact near p = 1.
            # A mean of exactly 0 (float32 rounds -log p to 0 past a logit gap of ~28) would make it -inf and the
            # gradient NaN: capped just below 0, where the term is finite (-27.6)
            m = mean.clamp(max=-1e-12)
            odds = h - (torch.log(-torch.expm1(m[0::2])) - torch.log(-torch.expm1(m[1::2])))
            losses = -mean[0::2] - b * f.logsigmoid(odds)
        if self.rpo_alpha:
            losses = losses - self.rpo_alpha * mean[0::2]
        return losses, rewards.detach().view(-1, 2)


def per_sequence(x: torch.Tensor, sides: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Each sequence's sum of `x` [N] (per token), float64 [n_seqs]: `sides` [N] each token's sequence (-1: none;
    `data.collate`'s `sides`). Of per_token losses (0 off target): minus its summed log-probability."""
    keep = sides.reshape(-1) >= 0
    out = torch.zeros(n_seqs, dtype=torch.float64, device=x.device)
    return out.index_add(0, sides.reshape(-1)[keep], x.reshape(-1)[keep].double())


def dpo_loss(policy_nll: torch.Tensor, ref_nll: torch.Tensor | None, labels: torch.Tensor, sides: torch.Tensor,
             n_pairs: int, pref: Preference, group=None, ref_logps: torch.Tensor | None = None,
             whole_ref: bool = False) -> tuple[torch.Tensor, ...]:
    """`pref`'s loss of `n_pairs` pairs: (losses [n_pairs] float64, rewards [n_pairs, 2] detached), sequence 2k the
    chosen and 2k + 1 the rejected of pair k; `ref_nll` None for a loss without a reference, or for one whose
    whole sequences' reference log-probabilities are given (`ref_logps` float64 [2 × n_pairs], cached). The
    reward of a sequence is beta · (log pi - log ref) (without a reference: beta · its mean log pi); a pair's margin
    is the chosen's less the rejected's. `whole_ref`: a third value, the whole sequences' reference log-probabilities
    [2 × n_pairs] (summed over the cp group), which `RefCache` keeps.

    Under context parallelism each rank holds part of every sequence: the sums (and target counts) are all-reduced
    over `group` (the cp group), and the loss is differentiable through this rank's own part only, so the ranks'
    gradients add up to the whole sequence's. Every cp rank returns the same losses: count them once (cp rank 0)
    when reporting."""
    pi = -per_sequence(policy_nll, sides, 2 * n_pairs)
    ref = -per_sequence(ref_nll.detach(), sides, 2 * n_pairs) if ref_nll is not None else torch.zeros_like(pi)
    n = per_sequence(labels != IGNORE_INDEX, sides, 2 * n_pairs)   # targets per sequence
    if group is not None and dist.get_world_size(group) > 1 and n_pairs:
        whole = torch.stack([pi.detach(), ref, n])
        dist.all_reduce(whole, group=group)
        pi, ref, n = pi + (whole[0] - pi.detach()), whole[1], whole[2]   # the gradient of this rank's part
    if ref_logps is not None:   # (already the whole sequences')
        ref = ref_logps.to(pi.device, torch.float64)
    out = pref(pi, None if ref_nll is None and ref_logps is None else ref, n.clamp(min=1))
    return (*out, ref) if whole_ref else out


class DPO:
    def __init__(self, model, pref: Preference, cp_group=None, reference: dict | None = None, device=None,
                 dtype=None, base: str | None = None):
        """`reference`: the --init-adapter's tensors (`model.adapter_read.read_init_adapter`), or None for the base;
        `dtype` the one LoRA computes in; `base`: the base checkpoint, whose norm weights the reference computes with
        (and embedding) where the model trains them (--train-norms, --train-embeddings) and the reference adapter has
        none (model.norms)."""
        # (imported here: train.py imports Preference for --plan and its start-up lines, without peft or bitsandbytes)
        from model.norms import is_saved_weight, reference_trained
        from model.qlora import adapters_off, reference_adapter
        self.model, self.pref, self.cp_group = model, pref, cp_group
        lora = {k: v for k, v in (reference or {}).items() if not is_saved_weight(k)}
        self.off = None if not pref.reference else adapters_off(model) if reference is None else \
            reference_adapter(model, lora, device, dtype)
        if self.off is not None and any(p.requires_grad and is_saved_weight(n) for n, p in model.named_parameters()):
            self.off = _Both(self.off, reference_trained(model, base, reference, dtype, device))
        self.once = float(cp_group is None or dist.get_rank(cp_group) == 0)   # 1 on one rank of each cp group
        self.ref = float(pref.reference)   # (a forward of the reference a step: MFU counts it)
        self.cache: dict[str, RefCache] = {}   # --dpo-cache-ref's, "train" and "eval" (parallel/ref_cache.py)

    @classmethod
    def of_run(cls, model, args, cp_group, device, dtype) -> DPO:
        """train.py's: the reference is --init-adapter's adapter held fixed (`args.dpo_reference` "adapter...") or the
        base; LoRA computes in `dtype` on CUDA (FSDP2's), in float32 on CPU; the base checkpoint's norms and
        embedding are --train-norms' and --train-embeddings' reference."""
        from model.adapter_read import read_init_adapter
        ref = read_init_adapter(args.init_adapter) if args.dpo_reference.startswith("adapter") else None
        return cls(model, Preference.from_args(args), cp_group, ref, device,
                   dtype if device.type == "cuda" else torch.float32, args.model)

    @staticmethod
    def step_metrics(sums, n_pairs) -> dict:
        """A step's reward metrics from its sums over every rank [loss, pairs preferred, chosen, rejected rewards]:
        reward_acc, the share of pairs the policy prefers; the rewards' and their margin's means."""
        from parallel.metrics import rounded
        return {k: rounded((v / n_pairs).item()) for k, v in (("reward_acc", sums[1]), ("reward_margin", sums[2] -
                sums[3]), ("reward_chosen", sums[2]), ("reward_rejected", sums[3]))}   # (the columns' order before)

    def reference(self, ids, pos, labels) -> torch.Tensor:
        """The reference model's -log p of every target token of this rank's shard (0 off target), no graph."""
        with torch.no_grad(), self.off:
            return self.model(ids, position_ids=pos, labels=labels, per_token=True)[0]

    def known(self, split: str, pairs) -> bool:
        """Every one of `pairs` (a step's or an eval's, all ranks': the same answer on every rank) has its reference
        log-probabilities in `split`'s cache: the forwards over them read it instead of running the reference."""
        return split in self.cache and self.cache[split].known(pairs)

    def __call__(self, ids, pos, labels, sides, n_pairs: int, pairs: list[int] | None = None, split: str = "train",
                 known: bool = False):
        """`pairs`: the micro-batch's pairs (indices into `split`'s samples; a dummy row: None). `known`
        (`self.known`, decided for the whole step or eval): they read the reference from the cache; else the
        reference runs, and with a cache its whole sequences' log-probabilities are kept for `sync`."""
        ref = ref_logps = None
        if self.off is not None and known:
            ref_logps = self.cache[split].values[pairs or []].reshape(-1)
        elif self.off is not None:
            ref = self.reference(ids, pos, labels)
        pol, _ = self.model(ids, position_ids=pos, labels=labels, per_token=True)
        out = dpo_loss(pol, ref, labels, sides, n_pairs, self.pref, self.cp_group, ref_logps, whole_ref=True)
        if ref is not None and pairs and split in self.cache:
            self.cache[split].add(pairs, out[2], self.once)
        return out[:2]

    def sync(self, split: str, group, pairs=None) -> None:
        """After a step or evaluation that ran the reference (not `known`), on every rank: `split`'s cache takes
        every rank's new values (`RefCache.sync`; `pairs`: the step's, every rank's); nothing without a cache."""
        if split in self.cache:
            self.cache[split].sync(group, pairs)


class _Both:
    """Two context managers entered as one, each time (DPO's reference: LoRA off or the reference adapter's, and the
    trained norms' and embedding's reference weights)."""

    def __init__(self, *cms):
        self.cms = cms

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for cm in self.cms:
            self.stack.enter_context(cm)

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)
