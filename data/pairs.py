"""Preference pairs (`--objective dpo`) as samples: one sample a pair, so batching, packing, --eval-split, the
--data-weights mixture and the memory plan treat a pair as one unit and never part its two sides.

Contract:
- `data.tokens` gives a pair record's sides as two samples side by side, the chosen then the rejected, both or
  neither (`TokenStats.pairs` counts them). `Pairs(samples)` is the view with pair k = {"input_ids": chosen ++
  rejected, "labels": likewise, "split": the chosen's length}; `Pairs(samples, share=True)` (--dpo-share-prompt)
  holds the tokens both sides share before either's first target once: chosen ++ the rejected's rest, "shared"
  their count (positions then make the rejected's rest a branch of the chosen: `model.attention`); `data.collate`
  makes it two documents (positions restart at the split) and marks each token's side (`sides`). `lengths` are
  the pairs' token counts (what a row, and so the memory plan, holds), `sides(k)` its two sequences' lengths,
  `sample_lines()` their records' lines, `files` the files of several.
- `check_first(path, flag, objective)`: the first record of a file against the objective, at start-up;
  `check_records(records, path, flag, objective)` all of them, once read (`data.load.load_samples`, before any is
  tokenized).
- `for_run(objective, train, ev, rows)` checks that the data fits the objective (`--objective dpo`: every record a
  pair; sft: none), naming the file's counts and the fix, and returns the run's (train, ev, rows) as pairs for dpo
  (`rows`, the rotating --data-weights epochs, as pair indices) or unchanged for sft.
"""

from __future__ import annotations

import torch

from loss import IGNORE_INDEX


def shared_start(a: dict, b: dict) -> int:
    """The tokens two sides share before either's first target: a shared-prompt row holds them once."""
    ids_a, ids_b = a["input_ids"], b["input_ids"]
    n = min(len(ids_a), len(ids_b))
    first = [int(x.nonzero()[0]) if bool(x.any()) else len(x) for x in (ids_a[:n] != ids_b[:n],
                                                                        a["labels"] != IGNORE_INDEX,
                                                                        b["labels"] != IGNORE_INDEX)]
    return min(first + [n])


class Pairs:
    def __init__(self, samples, share: bool = False):
        lines = samples.sample_lines()
        if len(samples) % 2 or not torch.equal(lines[0::2], lines[1::2]):   # (data.tokens keeps both or neither)
            raise RuntimeError("preference pairs out of step: a pair's two samples are not side by side")
        self.samples, self.files = samples, getattr(samples, "files", None)
        self.shared = torch.tensor([shared_start(samples[2 * k], samples[2 * k + 1]) for k in
                                    range(len(samples) // 2)], dtype=torch.int64) if share else \
            torch.zeros(len(samples) // 2, dtype=torch.int64)
        self.lengths = samples.lengths[0::2] + samples.lengths[1::2] - self.shared

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, k: int) -> dict:
        k = range(len(self))[k]
        a, b, f = self.samples[2 * k], self.samples[2 * k + 1], int(self.shared[k])
        return {"input_ids": torch.cat([a["input_ids"], b["input_ids"][f:]]),
                "labels": torch.cat([a["labels"], b["labels"][f:]]), "split": len(a["input_ids"]),
                **({"shared": f} if f else {})}

    def sample_lines(self) -> torch.Tensor:
        return self.samples.sample_lines()[0::2]

    def sides(self, k: int) -> tuple[int, ...]:
        """Pair k's two sequences' lengths (the FLOPs count attention per sequence). With a shared prompt of f tokens
        a third, -f: the rejected answer's r - f tokens attend to the prompt's f too, so its FLOPs are r's less f's,
        and its tokens r - f (train.py: n tokens, n · flops_per_token(|n|) each)."""
        f = int(self.shared[k])
        return (int(self.samples.lengths[2 * k]), int(self.samples.lengths[2 * k + 1])) + ((-f,) if f else ())


class PairRows:
    """A `data.mix.Rotation` over samples as one over pairs (its epochs keep a record's samples together, in order)."""

    def __init__(self, rows):
        self.rows = rows

    def __call__(self, epoch: int) -> torch.Tensor:
        r = self.rows(epoch)
        if len(r) % 2 or bool((r[0::2] % 2).any()) or not torch.equal(r[1::2], r[0::2] + 1):
            raise RuntimeError(f"epoch {epoch}'s --data-weights rows part a preference pair")
        return r[0::2] // 2

    def size(self, epoch: int) -> int:
        return self.rows.size(epoch) // 2


def check_first(path: str, flag: str, objective: str) -> None:
    """Start-up: the file's first record is of the objective's kind (a pair for dpo, no pair else), read from its first
    line before anything is tokenized (a 30 s tokenizing pass, then the refusal, otherwise); `check_records` checks
    every record once the file is read, before it is tokenized, and `for_run` the counts (a file from the cache)."""
    from data.jsonl import iter_jsonl

    if (first := next(iter_jsonl(path), None)) is not None:   # (no record: the loader says so)
        check_records([first], path, flag, objective)


def check_records(records: list[dict], path, flag: str, objective: str) -> None:
    """Every record is of the objective's kind: else refused, naming the first line that is not and how many."""
    wrong = [r for r in records if ("pair" in r) != (objective == "dpo")]
    if not wrong:
        return
    from data.formats import unit
    n, k = wrong[0]["line"], len(wrong)
    many = f" (and {k - 1} more of its {len(records)} records)" if k > 1 else ""
    if objective == "dpo":
        raise ValueError(f"--objective dpo: {flag} {path} {unit(path)} {n} is not a preference pair{many}: DPO "
                         "trains on {\"prompt\", \"chosen\", \"rejected\"} records only; " + (
                             "give an eval file of pairs, or --eval-split" if flag == "--eval-data" else
                             "give the others in a file of their own, trained with --objective sft (the default)"
                             if k < len(records) else "train this file with --objective sft (the default)"))
    raise ValueError(f"{flag} {path} {unit(path)} {n} is a preference pair (\"chosen\"/\"rejected\"){many}: pass "
                     "--objective dpo to train on pairs (every record a pair), or write it as a {\"prompt\", "
                     "\"completion\"} record for supervised fine-tuning")


def _not_pairs(stats) -> int:
    return stats.records - stats.dropped - stats.no_target - stats.tied - stats.pairs


def for_run(objective: str, train: tuple, ev: tuple, rows, share: bool = False):
    """(train (samples, stats), eval (samples, stats) or (None, None), rows) checked against `objective`; for dpo the
    samples as `Pairs` (`share`: each pair's shared prompt once, --dpo-share-prompt) and `rows` as `PairRows` (module
    docstring)."""
    named = [("--data", train[1])] + ([("--eval-data", ev[1])] if ev[1] is not None else [])
    for flag, stats in named:
        n = stats.pairs + stats.tied   # (the pair records: kept, and tied ones; a dropped one is not told apart)
        if objective == "dpo" and (k := _not_pairs(stats)):
            these = f"{k} records that are" if k != 1 else "1 record that is"
            fix = "give an eval file of pairs, or --eval-split" if flag == "--eval-data" else \
                "give the others in a file of their own, trained with --objective sft (the default)"
            raise ValueError(f"--objective dpo: {flag} holds {these} not a preference pair (of {stats.records}; "
                             f"{n} pairs): DPO trains on {{\"prompt\", \"chosen\", \"rejected\"}} records only; {fix}")
        if objective != "dpo" and n:
            raise ValueError(f"{flag} holds {n} preference pair{'s' * (n != 1)} (\"chosen\"/\"rejected\" records): "
                             "pass --objective dpo to train on them (every record a pair), or write them as "
                             "{\"prompt\", \"completion\"} records for supervised fine-tuning")
    if objective != "dpo":
        return train, ev, rows
    return ((Pairs(train[0], share), train[1]), (Pairs(ev[0], share) if ev[0] is not None else None, ev[1]),
            None if rows is None else PairRows(rows))
