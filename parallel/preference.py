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
import hashlib
import math
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from loss import IGNORE_INDEX
from parallel.plan import REFERENCE_FREE

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
        self.cache: dict[str, RefCache] = {}   # --dpo-cache-ref's, "train" and "eval"

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


class RefCache:
    """--dpo-cache-ref: each pair's reference log-probabilities (chosen, rejected) in float64, from the first forward
    that computes them: the first epoch's steps (a step whose pairs all are known reads them: a later epoch's), the
    first evaluation. `add` keeps this rank's new ones (once per cp group) and `sync` adds every rank's (an all-reduce
    over dp × cp of the step's [pairs, 3]: sums and counts, a pair twice in a step averaged), the same on every rank
    after it. It holds 49 bytes a pair on the device (1M pairs: 49 MB).
    The reference is held fixed, so a value kept is exact for the rest of the run: the first epoch trains as without
    the cache (the same forwards), a later one reads each pair's value from the rows it had then."""

    def __init__(self, n: int, device, path: str, ident: dict, log=print):
        self.values = torch.zeros(n, 2, dtype=torch.float64, device=device)
        self.have = torch.zeros(n, dtype=torch.bool, device=device)
        self.new = torch.zeros(n, 3, dtype=torch.float64, device=device)
        self.path, self.ident, self.written, self.log = path, ident, 0, log

    def known(self, pairs) -> bool:
        pairs = torch.as_tensor(list(pairs), dtype=torch.long, device=self.have.device)
        return bool(self.have[pairs].all())

    def add(self, pairs: list[int], ref: torch.Tensor, once: float) -> None:
        i = torch.as_tensor(pairs, dtype=torch.long, device=self.new.device)
        self.new.index_add_(0, i, once * torch.cat([ref.detach().view(-1, 2), torch.ones(len(pairs), 1,
                                                                                         device=ref.device,
                                                                                         dtype=ref.dtype)], 1))

    def sync(self, group, pairs=None) -> None:
        """Every rank's new values into the cache (collective: call it after each step or evaluation that ran the
        reference, on every rank, with the same `pairs`: those any rank may have added, all when None; only their
        rows travel); written to `path` (rank 0, whole then renamed) once a tenth of the pairs more is known than
        the file holds, and when all are: a resume reads it (`load`)."""
        idx = torch.arange(len(self.have), device=self.new.device) if pairs is None else torch.as_tensor(
            sorted(set(pairs)), dtype=torch.long, device=self.new.device)
        part = self.new[idx]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(part, group=group)
        got = part[:, 2] > 0
        self.values[idx[got]] = part[got, :2] / part[got, 2:]
        self.have[idx[got]] = True
        self.new[idx] = 0
        n, have = len(self.have), int(self.have.sum())
        if have - self.written >= max(n // 10, 1) or have == n > self.written:
            from parallel import guard
            guard.on_rank0(self._write, f"writing {self.path}")
            if have == n:   # (once: a run's log says from when its steps or evals read them)
                self.log(f"reference: all {n} pairs' log-probabilities of {os.path.basename(self.path)} are kept: "
                         "the steps or evaluations of those pairs run no reference forward from here")
            self.written = have

    def _write(self) -> None:
        try:
            values, have = self.values.cpu(), self.have.cpu()
            torch.save({"identity": self.ident, "values": values, "have": have, "sha256": _digest(values, have)},
                       self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        except (OSError, RuntimeError) as e:   # (a cache: the run goes on without its file; a resume computes them
            # again. torch.save says a refused write as a RuntimeError: review, helper 47)
            self.log(f"warning: {self.path} could not be written ({type(e).__name__}: {str(e).strip()[:200]}): a "
                     "resume computes those reference log-probabilities again")
            with contextlib.suppress(OSError):
                os.remove(self.path + ".tmp")

    def load(self) -> None:
        """A resume's: the file's values when it was kept for the same model, reference and pairs (rank 0 reads and
        decides, then broadcasts); else none, said."""
        from parallel import guard
        got = guard.on_rank0(partial(_read, self.path, self.ident, len(self.have), self.log), f"reading {self.path}")
        box = [None if got is None else int(got[1].sum())]
        many = dist.is_initialized() and dist.get_world_size() > 1
        if many:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        both = torch.cat([got[0], got[1][:, None].double()], 1) if got is not None else torch.empty(
            len(self.have), 3, dtype=torch.float64)
        both = both.to(self.values.device)
        if many:
            dist.broadcast(both, src=0)
        self.values, self.have, self.written = both[:, :2].contiguous(), both[:, 2] > 0, box[0]
        self.log(f"reference: {box[0]} of {len(self.have)} pairs' log-probabilities read from {self.path}")


IDENTITY = ("model_sha256", "quant", "dtype", "rope_scaling", "max_len", "dpo_reference")   # (and the split's tokens)


def ref_caches(dpo: DPO, args, splits: dict, device, log) -> None:
    """--dpo-cache-ref: `dpo.cache` for each of `splits` ({"train": Pairs, "eval": Pairs or None}), kept in
    OUT/reference_logps[_eval].pt with what they were computed for (the split's tokens, the model's fingerprint and
    numerics, the reference, the code: `code_digest`): a resume in the run's folder reads those of the same."""
    # --rope-scaling as it means ("yarn:2" = "yarn:2.0"), as a resume compares it (review, helper 51)
    from parallel.resume import _norm
    for split, samples in splits.items():
        if samples:
            ident = {"format": 3, "tokens": getattr(args, f"{'data' if split == 'train' else 'eval'}_tokens"),
                     **{k: str(_norm(k, getattr(args, k, None))) for k in IDENTITY}, "code": code_digest()}
            path = os.path.join(args.out, f"reference_logps{'_eval' * (split == 'eval')}.pt")
            dpo.cache[split] = RefCache(len(samples), device, path, ident, log)
            dpo.cache[split].load()


def code_digest(root: str | None = None) -> str:
    """The sha256 of the code a reference log-probability comes from (model/, parallel/, loss.py) and torch's version:
    a resume after an edit there (a fork's fix to attention, say) computes the values again rather than read ones an
    older forward gave (until 2026-12-05 the cache kept them across any edit)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256(torch.__version__.encode() + b"\0")
    for d in ("model", "parallel"):
        for name in sorted(f for f in os.listdir(os.path.join(root, d)) if f.endswith(".py")):
            with open(os.path.join(root, d, name), "rb") as f:
                h.update(f"{d}/{name}\0".encode() + f.read() + b"\0")
    with open(os.path.join(root, "loss.py"), "rb") as f:
        h.update(b"loss.py\0" + f.read())
    return h.hexdigest()


def _digest(values: torch.Tensor, have: torch.Tensor) -> str:
    """The sha256 of a cache's values (float64) and which pairs it has."""
    return hashlib.sha256(values.double().contiguous().numpy().tobytes() + have.bool().numpy().tobytes()).hexdigest()


def _read(path: str, ident: dict, n: int, log) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`path`'s (values, have) when it was kept for `ident` and holds `n` pairs, else None (said, unless absent)."""
    if not os.path.exists(path):
        return None
    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
        if (kept := got["identity"]) != ident or got["values"].shape != (n, 2) or got["have"].shape != (n,):
            code = isinstance(kept, dict) and {**kept, "code": None, "format": None} == {**ident, "code": None,
                                                                                           "format": None}
            log(f"note: {path} was kept " + ("by other code (model/, parallel/ or loss.py edited since, or another "
                                             "torch)" if code else "for another model, reference or data")
                + ": its values are computed again")
            return None
        if got["sha256"] != _digest(got["values"], got["have"]):   # (a disk's or a hand's change: never trusted)
            log(f"note: {path}'s values do not match the sha256 written with them: they are computed again")
            return None
        return got["values"].double(), got["have"].bool()
    except Exception as e:   # noqa: BLE001 - a torn or foreign file is computed again, never trusted
        log(f"note: {path} cannot be read ({type(e).__name__}: {e}): its values are computed again")
        return None
