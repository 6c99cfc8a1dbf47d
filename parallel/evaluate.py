"""The eval loss: the mean loss over every target of the eval samples, the same number on every layout.

Contract: `evaluate(model, samples, to_local, data_rank, data_ranks, group, device, loss_fn, row_tokens, positions,
beat)` -> {"eval_loss": loss, "eval_token_acc": the share of targets whose logit is their row's largest (argmax =
target; a tie counts)}, and "eval_loss/FILE" and "eval_token_acc/FILE" for each file of several (several --eval-data
files, or --eval-split's records of several --data files: data/mix.py's `Samples.files`) that has a target.
- The samples go in rows (`rows`): consecutive samples of one file, as many as fit `row_tokens` tokens (train.py:
  the longest training sample's length, the memory plan's, when it packs; 1, one sample a row, when it does not),
  packed as training packs a micro-batch (documents kept apart: the same loss as each alone). Short eval samples
  then take one forward per row, not one each (200 chat records of ~100 tokens under a 4,096-token plan: 5
  forwards instead of 200).
- Each data rank takes a strided share of the rows (`rows[data_rank::data_ranks]`); the ranks of one cp group
  take the same share and `to_local` gives each its slice of the sequence.
- A rank with fewer rows than the most loaded one runs all-ignored dummies (the first sample, every label
  IGNORE_INDEX), so every rank makes the same collective calls (FSDP's gathers, cp's exchanges) and none waits.
- The loss is the sum over targets divided by their count, both reduced over `group` (dp × cp) in float64: the
  mean over all targets, not a mean of per-rank means, so it does not depend on how samples fall on ranks. A
  file's is the same over its own samples' targets; the loss over all is not the mean of the files' losses but
  their targets' mean, so a file of long answers weighs more than one of short ones.
- `loss_fn` is train.py's LOSS_FN (None: the fused cross-entropy), so the eval loss, and --keep-best's choice,
  measure what is trained.
- `dpo` (--objective dpo, `parallel.preference.DPO`; `samples` are `data.pairs.Pairs`): the DPO loss in place of
  cross-entropy, its mean over the pairs, "eval_reward_acc", the share of pairs whose reward margin is above 0
  (the policy prefers the chosen answer more than the reference does; a tie counts as not, as TRL's), and
  "eval_reward_margin", the margins' mean.
- `positions` (--eval-positions P1 P2 ...): also "eval_loss@0-{P1-1}", "eval_loss@{P1}-{P2-1}", ..., "eval_loss@{Pn}+",
  the mean loss over the targets whose token sits at those positions of its sample (of its document, packed; the
  first token, never a target, is position 0), each where the eval set has such targets: does the loss fall with
  more context before a token, and does training at long context keep it falling? The fused cross-entropy's
  per-token losses (no LOSS_FN, no DPO: refused at start-up); each cp rank buckets its own shard's targets by their
  position ids, so every layout gives the numbers of one process. And "eval_token_acc@..." for the same buckets: the
  share of their targets predicted right, by eval_token_acc's rule (the loss's per-row `hits`), so the buckets'
  shares weighted by their targets give eval_token_acc back. One all-reduce carries it all.
- `beat()` runs before each row: the watchdog's progress (an eval longer than --timeout is not a stuck rank).
- `baseline(model, eval_args, dpo, beat, log)`: the "eval_loss before training" line.
- The model is in eval mode while evaluating (LoRA dropout off) and back in train mode after.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from data.batches import by_tokens
from data.mix import FILE_SHIFT
from loss import IGNORE_INDEX


def rows(samples, of_file: list[int], row_tokens: int) -> list[list[int]]:
    """The samples' indices in rows: consecutive samples of one file while their tokens fit `row_tokens` (a longer
    sample: a row alone)."""
    return by_tokens(range(len(samples)), samples.lengths.tolist(), row_tokens, of_file)


def share(samples, of_file: list[int], row_tokens: int, data_rank: int, data_ranks: int) -> list[list[int] | None]:
    """This data rank's rows (`rows`), strided, then None for each row the most loaded rank has more: a dummy."""
    every = rows(samples, of_file, row_tokens)
    return every[data_rank::data_ranks] + [None] * (math.ceil(len(every) / data_ranks) -
                                                    len(every[data_rank::data_ranks]))


def dummy(samples) -> dict:
    """A row that trains nothing: the first sample's tokens, every label IGNORE_INDEX (no "split": a pair's dummy is
    one all-ignored document, whose -1 sides make its counts 0)."""
    return {"input_ids": samples[0]["input_ids"], "labels": torch.full_like(samples[0]["labels"], IGNORE_INDEX)}


@torch.no_grad()
def evaluate(model, samples, to_local, data_rank, data_ranks, group, device, loss_fn=None, row_tokens: int = 1,
             positions=None, beat=lambda: None, dpo=None) -> dict[str, float]:
    """{"eval_loss": the mean loss over every target of `samples`, and "eval_loss/FILE" for each file of several},
    reduced over `group` (module docstring)."""
    files = getattr(samples, "files", None) or [None]
    of_file = (samples.sample_lines() >> FILE_SHIFT).tolist() if files[0] else [0] * len(samples)
    tot = torch.zeros(len(files), 4, dtype=torch.float64, device=device)   # (each file's loss sum, targets or pairs,
    hit = torch.zeros(len(files), dtype=torch.int64, device=device)   # targets predicted right or pairs preferred,
    model.eval()   # margins' sum; hit: integers, which FSDP2's mixed precision does not cast into a copy)
    known = dpo is not None and dpo.known("eval", range(len(samples)))   # (--dpo-cache-ref: no reference forward)
    edges = positions and torch.tensor(positions, device=device)   # (--eval-positions': where buckets after 0 start)
    at = torch.zeros(len(positions or ()) + 1, 3, dtype=torch.float64, device=device)   # (a bucket's sum, n, right)
    for row in share(samples, of_file, row_tokens, data_rank, data_ranks):
        beat()
        k = of_file[row[0]] if row else 0
        ids, pos, lab, *sides = to_local([samples[i] for i in row] if row else [dummy(samples)])
        if dpo is None and positions:   # each target's loss, into the bucket of its position (its input's + 1)
            right = torch.zeros(lab.numel(), dtype=torch.int64, device=device)   # (each target's 1 if predicted right)
            losses, cnt = model(ids, position_ids=pos, labels=lab, per_token=True, hits=right)
            tot[k, :2] += torch.stack([losses.double().sum(), cnt.double()])
            hit[k] += right.sum()
            where = torch.bucketize(pos.reshape(-1) + 1, edges, right=True)   # (0: below the first edge)
            at.index_add_(0, where, torch.stack([losses.double(), (lab.reshape(-1) != IGNORE_INDEX).double(),
                                                 right.double()], 1))
        elif dpo is None:
            lsum, cnt = model(ids, position_ids=pos, labels=lab, loss_fn=loss_fn, hits=hit[k])
            tot[k, :2] += torch.stack([lsum.double(), cnt.double()])
        else:   # (a dummy row holds no pair: its -1 sides make n 0)
            losses, rewards = dpo(ids, pos, lab, sides[0], len(row or ()), row, "eval", known)
            margins = (rewards[:, 0] - rewards[:, 1]).double()
            tot[k] += dpo.once * torch.stack([losses.sum(), torch.tensor(len(losses), dtype=torch.float64,
                                              device=device), (margins > 0).sum().double(), margins.sum()])
    model.train()
    if dpo is not None and not known:
        dpo.sync("eval", group)
    tot[:, 2] += hit
    both = torch.cat([tot.flatten(), at.flatten()])   # (one collective for the files' sums and the buckets')
    dist.all_reduce(both, group=group)
    tot, at = both[:tot.numel()].view_as(tot), both[tot.numel():].view_as(at)
    mean = lambda t: (t[0] / t[1].clamp(min=1)).item()
    spans = [f"{a}-{b - 1}" for a, b in zip([0, *positions], positions)] + [f"{positions[-1]}+"] if positions else []
    return {"eval_loss": mean(tot.sum(0)), **{f"eval_loss/{f}": mean(t) for f, t in zip(files, tot) if f and t[1]},
            **{f"eval_loss@{span}": mean(t) for span, t in zip(spans, at) if t[1]},
            **({"eval_reward_acc": mean(tot.sum(0)[[2, 1]]), "eval_reward_margin": mean(tot.sum(0)[[3, 1]])}
               if dpo is not None else {"eval_token_acc": mean(tot.sum(0)[[2, 1]]), **{
                   f"eval_token_acc/{f}": mean(t[[2, 1]]) for f, t in zip(files, tot) if f and t[1]},
                   **{f"eval_token_acc@{span}": mean(t[[2, 1]]) for span, t in zip(spans, at) if t[1]}})}


def baseline(model, eval_args: tuple, dpo, beat, log) -> None:
    """train.py's eval loss before training, which the later ones are compared with (`evaluate(model, *eval_args)`;
    DPO's where the policy is its reference is known without a pass, `Preference.at_start`)."""
    if dpo and dpo.pref.at_start() is not None:
        return log(f"eval_loss before training {dpo.pref.at_start():.6f} (each pair's: the policy is its reference)")
    got = evaluate(model, *eval_args, beat=beat, dpo=dpo or None)
    ev, files = got["eval_loss"], [(k, v) for k, v in got.items()   # (no accuracy but by position: the line is short)
                                   if k != "eval_loss" and k.split("/")[0] != "eval_token_acc"]
    each = ", ".join(f"{k} {v:.6f}" for k, v in files)   # (each file's loss, of several; each --eval-positions bucket's
    # loss and accuracy; DPO's reward accuracy and margin)
    log(f"eval_loss before training {ev:.6f}" + f" ({each})" * bool(files))
