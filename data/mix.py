"""Several --data files as one training set, and --data-weights.

Contract:
- `data_files(value)`: --data as a list of paths (one path as a string: the demo's, and what runs from before
  --data took several files recorded).
- A sample's record in a set of several files is `(file index << FILE_SHIFT) | line` in `Samples.lines`, so file 0's
  records are their lines: one file's identities, its `--eval-split` records held out and its cached tokens are
  those of a single-file run. `record_name(ident, files)` spells one for a log ("b.jsonl:17", or "17" for one file).
- `join(parts)`: the files' Samples, in the order given, as one whose tokens are the files' own tensors as pieces,
  not a copy (with a token cache: each file's memory-mapped pages, which a machine's ranks share), hashed
  (`samples.fingerprint`) as one file of their lines would be. `total(stats)`: their TokenStats summed (`longest`:
  the longest of all).
- `mix(samples, files, weights, seed, rotate)`: --data-weights. A file of weight W gives floor(W) copies of its
  samples and, for the fraction left, that share of its records (rounded; at least one when W < 1), whole (a split
  text record's windows together). The share is read from the file's records in one seeded order (the sha256 of
  f"{seed}:mix:{ident}", smallest first, as `hold_out` chooses): epoch 0 takes its first records, epoch 1 the next
  ones, and so on, wrapping round at the end (`rotate`; 0.5: each record once in two epochs, so no record goes
  unseen while others repeat; an odd count's half rounds up, so one record repeats); the same on every rank and
  resume. It runs after `--eval-split` has held records out,
  so a held-out record is never trained on, whatever its file's weight. Returns (samples, a line saying what each
  file gave, rows): without a share to rotate (whole weights, or `rotate=False`: every epoch takes epoch 0's
  records, as runs before 2026-12-04 did, which their resumes keep), `samples` are the mixture itself and `rows` is
  None; else `samples` are all of the set's samples and `rows` a `Rotation`: `rows(epoch)` the indices into them
  of that epoch's mixture, which `data.batches.GlobalBatches` permutes.
- `held_records(samples, files)`: {file: [lines]} of the records `samples` hold (--eval-split's, for config.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from fractions import Fraction

import torch

FILE_SHIFT = 32   # a line number below 2**32 (4 billion lines a file)
MAX_WEIGHT = 1000.0


class Once(argparse.Action):
    """A list flag given once: a second `--data` would replace the first (argparse's rule for every flag), which for
    a flag that takes several files reads as adding one, so it is refused, naming both."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(getattr(namespace, self.dest, None), list):   # (a default, as the demo's path, is not a list)
            said = lambda vs: " ".join(weight_text(v) if isinstance(v, float) else str(v) for v in vs)
            raise argparse.ArgumentError(self, f"given twice ({said(getattr(namespace, self.dest))}; then "
                                               f"{said(values)}): pass every value after one {option_string}")
        setattr(namespace, self.dest, values)


def names(files: list[str]) -> list[str]:
    """How logs and metrics name the files: their basenames, or where two are the same, as many of their paths' last
    parts as tell them apart (d1/train.jsonl, d2/train.jsonl)."""
    parts = [os.path.abspath(f).split(os.sep) for f in files]
    for k in range(1, max(map(len, parts), default=0) + 1):
        got = ["/".join(p[-k:]) for p in parts]
        if len(set(got)) == len(got):
            return got
    return list(files)


def weight_text(w: float) -> str:
    """A weight as typed (1.0000001 is not 1)."""
    return f"{w:g}" if float(f"{w:g}") == w else repr(w)


def data_files(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def file_and_line(ident: int) -> tuple[int, int]:
    """A record identity's (file index, line)."""
    return ident >> FILE_SHIFT, ident & ((1 << FILE_SHIFT) - 1)


def record_name(ident: int, files: list[str]) -> str:
    k, line = file_and_line(ident)
    return str(line) if len(files) == 1 else f"{names(files)[k]}:{line}"


def held_records(samples, files: list[str]) -> dict[str, list[int]]:
    """The records of `samples` as {file, as given: [its lines]}: --eval-split's held-out records, which the run's
    config.json keeps (`eval_split_records`) and `python -m data.demo_compare` prompts with."""
    out = {}
    for k, line in map(file_and_line, sorted(set(samples.sample_lines().tolist()))):
        out.setdefault(files[k], []).append(line)
    return out


def join(parts: list, files: list[str]):
    """Samples of several files as one, their records' identities carrying the file's index, `files` their names."""
    from data.samples import Samples

    if len(parts) == 1:
        return parts[0]
    lines = [torch.where(p.lines >= 0, p.lines + (k << FILE_SHIFT), p.lines) for k, p in enumerate(parts)]
    ends = torch.cat([torch.zeros(1, dtype=torch.int64)] + [p.lengths for p in parts]).cumsum(0)
    out = Samples([p.ids for p in parts], [p.labels for p in parts], ends, torch.cat(lines))
    out.files = names(files)
    return out


def total(stats: list):
    """Several files' TokenStats as one (the dropped and tied lines stay with each file's own warning)."""
    if len(stats) == 1:
        return stats[0]
    out = dataclasses.replace(stats[0], dropped_lines=[], no_target_lines=[], tied_lines=[])
    for f in dataclasses.fields(out):
        if not f.name.endswith("_lines"):
            vals = [getattr(s, f.name) for s in stats]
            setattr(out, f.name, max(vals) if f.name == "longest" else sum(vals))
    return out


def check_weights(weights, files: list[str], demo: bool = False) -> None:
    """--data-weights: one weight per --data file, each above 0 and at most MAX_WEIGHT (a ValueError naming it)."""
    if weights is None:
        return
    if not files:
        raise ValueError("--data-weights weighs --data files: pass --data FILE [FILE ...] with it")
    if len(weights) != len(files):
        raise ValueError(f"--data-weights gives {len(weights)} weight{'s' * (len(weights) != 1)} for {len(files)} "
                         f"--data file{'s' * (len(files) != 1)}" + " (the embedded demo's data)" * demo +
                         ": give one per file, in --data's order")
    for f, w in zip(files, weights):
        if not (math.isfinite(w) and 0 < w <= MAX_WEIGHT):
            raise ValueError(f"--data-weights {weight_text(w)} for {f}: a weight must be above 0 (0.5: half of its "
                             f"records) and at most {MAX_WEIGHT:g} (2: each sample twice); to leave a file out, drop "
                             "it from --data")


class Rotation:
    """The samples epoch e trains on, as indices into the whole set (module docstring): each file's whole copies, then
    the next `k` of its records in their seeded order."""

    def __init__(self, lines: torch.Tensor, parts: list):
        self.lines, self.parts, self.counts = lines, parts, []   # parts: (its samples, copies, records in order, k)
        for mine, _, order, _ in parts:   # samples a record gives (windows), in the seeded order, summed up
            ids, n = torch.unique(lines[mine], return_counts=True)
            self.counts.append(torch.cat([n.new_zeros(1), n[torch.searchsorted(ids, order)].cumsum(0)]).tolist()
                               if len(order) else [0])

    def of_files(self, epoch: int) -> list[torch.Tensor]:
        """Each file's samples in epoch `epoch`, its copies then its share."""
        out = []
        for mine, whole, order, k in self.parts:
            rows = [mine] * whole
            if k:
                chosen = order[(epoch * k + torch.arange(k)) % len(order)]
                rows.append(mine[torch.isin(self.lines[mine], chosen)])
            out.append(torch.cat(rows) if rows else mine[:0])
        return out

    def __call__(self, epoch: int) -> torch.Tensor:
        return torch.cat(self.of_files(epoch))

    def size(self, epoch: int) -> int:
        """len(self(epoch)), from each file's running sample counts (no tensor built)."""
        n = 0
        for (mine, whole, order, k), cum in zip(self.parts, self.counts):
            n += whole * len(mine)
            if k:
                at, r = epoch * k % len(order), len(order)
                n += cum[at + k] - cum[at] if at + k <= r else cum[r] - cum[at] + cum[at + k - r]
        return n

    def rotates(self) -> bool:
        """Whether epochs differ: a file's share is some of its records, not all."""
        return any(0 < k < len(order) for _, _, order, k in self.parts)

    def repeats(self) -> int:
        """Epochs until every record of the rotating shares has been trained once (the most over the files)."""
        return max((-(-len(order) // k) for _, _, order, k in self.parts if 0 < k < len(order)), default=1)


def mix(samples, files: list[str], weights: list[float] | None, seed: int, rotate: bool = True):
    """(samples, what each file gave, a Rotation or None) (module docstring); (samples, None, None) without weights."""
    from data.samples import smallest_hashes

    if weights is None or all(w == 1 for w in weights):
        return samples, None, None
    lines = samples.sample_lines()
    if len(lines) and int(lines.min()) < 0:
        raise ValueError("--data-weights needs each sample's record line (samples tokenized from a file)")
    of_file = lines >> FILE_SHIFT
    parts = []
    for k, w in enumerate(weights):
        mine = (of_file == k).nonzero().flatten()
        whole = int(w)
        part = Fraction(weight_text(w)) - whole   # (1.15 - 1 in floats is 0.1499..., which would round 1.5 down)
        order, n = torch.zeros(0, dtype=lines.dtype), 0
        if part > 0 and len(mine):
            records = torch.unique(lines[mine]).tolist()
            n = min(len(records), max(1 if whole == 0 else 0, math.floor(part * len(records) + Fraction(1, 2))))
            order = torch.tensor(smallest_hashes(records, len(records), f"{seed}:mix:"), dtype=lines.dtype)
        parts.append((mine, whole, order, n))
    rows = Rotation(lines, parts)
    first = rows.of_files(0)
    if not sum(map(len, first)):
        raise ValueError(f"--data-weights {' '.join(map(weight_text, weights))} leave no sample to train on")
    turns = rotate and rows.rotates()
    said = "; ".join(f"{name} × {weight_text(w)}: {_count(len(got))} of its {len(mine)}" + (
        f" ({k} of its {len(order)} records, the next ones each epoch)" if turns and 0 < k < len(order) else "")
        for name, w, got, (mine, _, order, k) in zip(names(files), weights, first, parts))
    turn = f" (the first; every record of the shares is trained at least once in {rows.repeats()} passes)"
    said += f"; {_count(sum(map(len, first)))} a pass" + turn * turns
    if not turns:
        return samples.subset(torch.cat(first)), said, None
    return samples, said, rows


def _count(n: int) -> str:
    return f"{n} sample{'s' * (n != 1)}"
