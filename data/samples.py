"""Token samples held compactly, the --eval-split hold-out of whole records, and the tokens' digest.

Contract:
- `Samples`: every sample's input ids and shifted labels in two flat int32 tensors cut by int64 offsets, 8 bytes a
  token where Python lists of ints take about 48 (a 128M-token long-context set: 1 GB per rank, not 6).
  `len(s)`, `s.lengths` (int64 [n]), `s.max_id()`; `s[i]` is `{"input_ids", "labels"}` as int32 views and
  `s[a:b:c]` a list of them. Same samples, same order, as `data.tokens.tokenize_records`' list. `s.lines`: each
  sample's record's line; `s.subset(rows)`: those samples, sharing the tensors (the page cache's one copy). Several
  files' samples (data/mix.py's `join`) keep each file's tensors as a piece (`s.pieces()`), not one copy of all.
- `hold_out(samples, spec, seed)`: --eval-split's (training, eval, held-out lines): whole records (a split text
  record's windows together), `spec` of them (a share below 1, else a count), chosen by a sha256 of the seed and the
  line, so every rank, and a resume, holds out the same ones; a split leaving no record to train on is refused.
- `fingerprint(samples)`: a sha256 of the token ids, labels and sample boundaries (a subset's: of the whole tensors'
  and its rows), kept in `s.digest`: what every rank must agree on (data/run_data.py's `same_on_every_rank`), what a
  cached file's tokens are checked against (data/store.py) and what a run records of its tokens (`args.data_tokens`).
  `also_in(these, those)`: how many samples of `these` (the eval data) have the input ids of one of `those`.
- `smallest_hashes(records, k, salt)`: the seeded choice of records that --eval-split and --data-weights' shares make.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools

import torch

from data.jsonl import DataError


class Samples:
    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor,
                 lines: torch.Tensor | None = None, rows: torch.Tensor | None = None, base: str | None = None):
        # int32 [N], int32 [N], int64 [n + 1]; ids and labels may be lists of pieces laid end to end (several files'
        # tokens, data/mix.py's `join`: each its cache's memory-mapped pages, not copied), no sample across two
        self.ids, self.labels, self.offsets = ids, labels, offsets
        self.starts = [0, *itertools.accumulate(len(p) for p in ids)] if isinstance(ids, list) else None
        every = offsets[1:] - offsets[:-1]
        # each sample's record's line in its file (-1: not known), and which samples of the tensors this holds, in
        # order (None: all; `subset`, which keeps the tensors, and so the page cache's one copy, shared)
        self.lines = lines if lines is not None else torch.full_like(every, -1)
        self.rows, self.base = rows, base   # (base: the whole tensors' `fingerprint`, for a subset's)
        self.files = None   # several files' samples: how logs name the files their records' identities index
        self.lengths = every if rows is None else every[rows]
        self.digest = None   # `fingerprint`'s, once computed (or verified by `read`)

    @classmethod
    def from_lists(cls, samples: list[dict]) -> Samples:
        flat = lambda k: torch.tensor([t for s in samples for t in s[k]], dtype=torch.int32)
        lengths = torch.tensor([0] + [len(s["input_ids"]) for s in samples], dtype=torch.int64)
        lines = torch.tensor([s.get("line", -1) for s in samples], dtype=torch.int64)
        return cls(flat("input_ids"), flat("labels"), lengths.cumsum(0), lines)

    @classmethod
    def cat(cls, parts: list[Samples]) -> Samples:
        assert all(p.rows is None for p in parts), "cat takes whole Samples"
        ends = torch.cat([torch.zeros(1, dtype=torch.int64)] + [p.lengths for p in parts]).cumsum(0)
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.labels for p in parts]), ends,
                   torch.cat([p.lines for p in parts]))

    def subset(self, rows: torch.Tensor) -> Samples:
        """Samples `rows` (int64 indices into this one), in that order, sharing these tensors."""
        out = Samples(self.ids, self.labels, self.offsets, self.lines,
                      rows if self.rows is None else self.rows[rows], self.base or fingerprint(self))
        out.files = self.files
        return out

    def sample_lines(self) -> torch.Tensor:
        """Each sample's record's line (int64 [len(self)])."""
        return self.lines if self.rows is None else self.lines[self.rows]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = range(len(self))[i]   # (a negative index counts from the end)
        j = i if self.rows is None else int(self.rows[i])
        a, b = self.offsets[j].item(), self.offsets[j + 1].item()
        if self.starts is None:
            return {"input_ids": self.ids[a:b], "labels": self.labels[a:b]}
        k = bisect.bisect_right(self.starts, a) - 1   # (the piece that holds token a)
        a, b = a - self.starts[k], b - self.starts[k]
        return {"input_ids": self.ids[k][a:b], "labels": self.labels[k][a:b]}

    def pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ids, labels) as lists of the pieces laid end to end (one piece: the whole tensors)."""
        return (self.ids, self.labels) if self.starts is not None else ([self.ids], [self.labels])

    def max_id(self) -> int:
        return max((int(p.max()) for p in self.pieces()[0] if len(p)), default=-1)


def split_arg(spec: float) -> str:
    """--eval-split's value as typed: a share (0.05) or a count (1234567, not 1.23457e+06)."""
    return f"{spec:g}" if spec < 1 else str(int(spec))


def smallest_hashes(records: list[int], k: int, salt: str) -> list[int]:
    """The k records whose sha256 of f"{salt}{record}" is smallest: a choice that depends on the salt (the seed) and
    the records alone, the same on every rank and resume (--eval-split's, --data-weights' shares)."""
    return sorted(records, key=lambda r: hashlib.sha256(f"{salt}{r}".encode()).digest())[:k]


def hold_out(samples: Samples, spec: float, seed: int) -> tuple[Samples, Samples, list[int]]:
    """--eval-split: (training samples, eval samples, the held-out records' lines). `spec` records of those with a
    sample (0 < spec < 1: that share of them, rounded, at least one; else that many), each record whole (a split
    text record's windows stay together): the ones whose sha256 of f"{seed}:{line}" is smallest, so the choice
    depends on the seed and the records' lines only (not on torch's generator, nor on the order of anything), and a
    resume holds out the same ones. Both keep the file's order."""
    lines = samples.sample_lines()
    if len(lines) and int(lines.min()) < 0:
        raise ValueError("hold_out needs each sample's record line (samples tokenized from a file)")
    records = torch.unique(lines).tolist()
    k = max(1, int(spec * len(records) + 0.5)) if spec < 1 else int(spec)
    if not 1 <= k < len(records):
        raise DataError(f"--eval-split {split_arg(spec)} holds out {k} of the {len(records)} records of --data that "
                        "have a target, leaving none to train on: pass a smaller --eval-split (a share below 1, or a "
                        "count below the records), or give the eval set as --eval-data FILE")
    held = sorted(smallest_hashes(records, k, f"{seed}:"))
    is_held = torch.isin(lines, torch.tensor(held, dtype=lines.dtype))
    return samples.subset((~is_held).nonzero().flatten()), samples.subset(is_held.nonzero().flatten()), held


def also_in(these: Samples, those: Samples) -> int:
    """How many samples of `these` (the eval data) have the same input ids as one of `those` (compared only where
    the lengths match)."""
    key = lambda s, i: hashlib.sha256(s[i]["input_ids"].numpy().tobytes()).digest()
    maybe = torch.isin(those.lengths, these.lengths).nonzero().flatten().tolist()
    seen = {key(those, i) for i in maybe}   # (digests: all samples may be --max-len long, hence candidates)
    return sum(key(these, i) in seen for i in range(len(these)))


def fingerprint(samples: Samples | None) -> str:
    """A digest of the token ids, labels and sample boundaries (sha256: 0.6 s per 128M tokens on the 2-core CPU
    machine, 2026-12-02)."""
    if samples is None:
        return "-"
    if samples.digest is None and samples.rows is not None:   # a subset: which samples of the whole tensors
        rows = samples.rows.to(torch.int64).contiguous().numpy().data
        samples.digest = hashlib.sha256(samples.base.encode() + b" rows " + rows).hexdigest()
    if samples.digest is None:
        h = hashlib.sha256()
        ids, labels = samples.pieces()   # (pieces hash as their tokens laid end to end in one tensor would)
        for t in (samples.offsets, *ids, *labels):
            h.update(t.contiguous().numpy().data)
        samples.digest = h.hexdigest()
    return samples.digest
