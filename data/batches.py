"""Global batch order: which samples form optimizer step k, independent of the parallel layout.

Contract:
- The order depends only on `seed`, `n_samples` and `global_batch` (samples per optimizer step).
  Epoch e is the permutation `torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + e))`.
  The epochs are concatenated into one stream and step k takes stream positions
  `[k*G, (k+1)*G)`. The tail of an epoch that does not fill a step is CARRIED into the next step
  (nothing is ever dropped; a step that straddles an epoch boundary may hold a sample twice, once
  from each epoch, and so may any step when `n_samples < G`).
- Step k is split among the D = dp_replicate × dp_shard data ranks: data rank d takes the contiguous
  share `[d*G/D, (d+1)*G/D)` of the step's samples; the cp ranks of one group share a data rank and
  so see the same samples. Micro-step m of a rank takes the next `micro_batch` samples of its share.
  Concatenating all micro-batches rank by rank gives back the step's samples in order, so
  `--dp-*` and `--micro-batch` never change what step k trains on; `--cp` never enters here.
- With `rows` (`data.mix.Rotation`, a callable with a `size(e)`: --data-weights whose shares take other records each
  epoch), epoch e is instead `rows(e)` permuted by that generator over `len(rows(e))`: sample indices, possibly
  repeated (a file's copies), and epochs may differ in length (a record split into several windows); the stream is
  their concatenation as before.
  `size(e)` is epoch e's length, `samples_in(E)` the samples of E epochs (a fraction of the last rounded up).
- `micro_batch` 0 (`--micro-batch auto`): a rank's share is cut into micro-batches by tokens instead, consecutive
  samples while their lengths sum to at most `budget` (train.py: the longest sample's, the memory plan's row; a
  sample is never split), so short samples share a packed row and a forward. Every rank computes every rank's cuts
  (the same step samples and lengths) and pads its list with empty micro-batches to the most any rank has, so all
  ranks run the same number of forwards (FSDP's and cp's collectives); train.py runs an empty one as an
  all-ignored row of 2 tokens a cp rank. The step's samples, and so the math, are those of any other micro-batch size.
- Steps are random access, so resuming is "continue at step k": the whole data state is the
  step index.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import torch


def micro_batch_arg(text: str) -> int:
    """--micro-batch: a positive number of samples, or auto (0: by tokens, the module docstring)."""
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        import argparse
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number of samples nor auto")
    return n


def check_batch_sizes(global_batch: int, micro_batch: int, data_ranks: int) -> None:
    """Raise ValueError unless every data rank runs the same whole number of micro-batches."""
    for name, v in (("--global-batch", global_batch), ("--micro-batch", micro_batch), ("data ranks", data_ranks)):
        if not isinstance(v, int) or v < (0 if name == "--micro-batch" else 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if micro_batch == 0:   # auto: each data rank's share of samples is cut by tokens
        if global_batch % data_ranks:
            lower = global_batch // data_ranks * data_ranks
            options = " or ".join(str(g) for g in (lower, lower + data_ranks) if g > 0)
            raise ValueError(f"--global-batch {global_batch} must be a multiple of the {data_ranks} data ranks "
                             f"(dp_replicate × dp_shard), so that each takes the same number of samples; use "
                             f"--global-batch {options}")
        return
    per_step = micro_batch * data_ranks
    if global_batch % per_step:
        lower = global_batch // per_step * per_step
        options = " or ".join(str(g) for g in (lower, lower + per_step) if g > 0)
        raise ValueError(
            f"--global-batch {global_batch} must be a multiple of --micro-batch {micro_batch} × "
            f"{data_ranks} data ranks (dp_replicate × dp_shard) = {per_step}, so that every data rank "
            f"runs the same whole number of micro-batches per step; use --global-batch {options} "
            "(or change --micro-batch)"
        )


class GlobalBatches:
    """The sample indices of every optimizer step (see the module docstring)."""

    def __init__(self, n_samples: int, global_batch: int, seed: int, rows=None):
        if n_samples < 1:
            raise ValueError(f"need at least one sample, got n_samples={n_samples}")
        if global_batch < 1:
            raise ValueError(f"--global-batch must be positive, got {global_batch}")
        self.n_samples, self.global_batch, self.seed, self.rows = n_samples, global_batch, seed, rows
        self._perms: dict[int, list[int]] = {}
        self._starts = [0]   # with rows: where each epoch starts in the stream (epochs 0.. as far as asked)

    def permutation(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) > 4:  # a run moves forward; keep memory flat on huge data sets
                self._perms.clear()
            g = torch.Generator().manual_seed(self.seed + epoch)
            if self.rows is None:
                self._perms[epoch] = torch.randperm(self.n_samples, generator=g).tolist()
            else:
                rows = self.rows(epoch)
                self._perms[epoch] = rows[torch.randperm(len(rows), generator=g)].tolist()
        return self._perms[epoch]

    def size(self, epoch: int) -> int:
        """Samples in epoch `epoch`."""
        if self.rows is None:
            return self.n_samples
        while len(self._starts) <= epoch + 1:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + self.rows.size(e))
        return self._starts[epoch + 1] - self._starts[epoch]

    def _at(self, p: int) -> tuple[int, int]:
        """(epoch, index in it) of stream position `p`."""
        if self.rows is None:
            return divmod(p, self.n_samples)
        while self._starts[-1] <= p:
            self.size(len(self._starts) - 1)
        e = bisect.bisect_right(self._starts, p) - 1
        return e, p - self._starts[e]

    def samples_in(self, epochs: float) -> int:
        """Samples in `epochs` passes, a part of the last rounded up: exact for the decimal typed (1.1 × 100 is 110,
        not the float's 110.00000000000001, which made 12 steps of 10)."""
        whole = math.floor(e := Fraction(str(epochs)))
        if self.rows is None:
            return math.ceil(e * self.n_samples)
        self.size(whole)
        return self._starts[whole] + math.ceil((e - whole) * self.size(whole))

    def step_samples(self, step: int) -> list[int]:
        """All `global_batch` sample indices of optimizer step `step` (0-based), in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        out = []
        for p in range(step * self.global_batch, (step + 1) * self.global_batch):
            e, i = self._at(p)
            out.append(self.permutation(e)[i])
        return out

    def micro_batches(self, step: int, data_rank: int, data_ranks: int, micro_batch: int, lengths=None,
                      budget: int | None = None) -> list[list[int]]:
        """Sample indices of each micro-step of `data_rank` (of `data_ranks`) in step `step`; with `micro_batch` 0,
        cut by `lengths` (every sample's) into at most `budget` tokens, padded with [] (module docstring)."""
        check_batch_sizes(self.global_batch, micro_batch, data_ranks)
        if not 0 <= data_rank < data_ranks:
            raise ValueError(f"data_rank {data_rank} is outside [0, {data_ranks})")
        share = self.global_batch // data_ranks
        every = self.step_samples(step)
        if micro_batch == 0:
            if lengths is None or budget is None:
                raise ValueError("--micro-batch auto cuts micro-batches by tokens: pass lengths and budget")
            cuts = [by_tokens(every[d * share:(d + 1) * share], lengths, budget) for d in range(data_ranks)]
            return cuts[data_rank] + [[]] * (max(map(len, cuts)) - len(cuts[data_rank]))
        mine = every[data_rank * share : (data_rank + 1) * share]
        return [mine[m : m + micro_batch] for m in range(0, share, micro_batch)]

    def epoch(self, step: int) -> float:
        """Epochs completed before step `step` (for logging)."""
        e, i = self._at(step * self.global_batch)
        return e + i / self.size(e)


def by_tokens(samples: list[int], lengths, budget: int, group=None) -> list[list[int]]:
    """`samples` (indices) in runs of consecutive ones whose `lengths` sum to at most `budget` (a longer sample: a run
    alone); with `group` (per index), a run also ends where the group changes (evaluation: one file a row)."""
    out, used = [], 0
    for i in samples:
        n = int(lengths[i])
        if out and used + n <= budget and (group is None or group[i] == group[out[-1][-1]]):
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out
