"""JSONL input: read and validate training records, failing early with the line that is wrong.

Contract:
- One JSON object per line; blank lines are skipped. What a line may hold (the record kinds), and how it is checked
  and normalised, is data/records.py's `parse_record`; ShareGPT's conversations are read as messages
  (data/sharegpt.py). The same records may come compressed (gzip, bzip2, xz, zstd), in a zip of one file, as one
  JSON array, as Parquet rows, or as CSV or TSV rows (told by the name: data/tables.py): data/formats.py reads them,
  told by the file's bytes.
- `load_jsonl(path)` returns the records in file order, each normalised to
  `{"line": n, "text": str}`, `{"line": n, "prompt": str, "completion": str}` or
  `{"line": n, "messages": [...]}` (plus `"tools": [...]` when given) (`n` is 1-based, kept so that later stages can
  still name the record: its line, or a JSON array's element or a Parquet row, said "record n" and "row n" there:
  `where(path, n)`); a pair to `{"line": n, "pair": [chosen, rejected]}`, each side one of the records above.
  `iter_jsonl(path)` yields them one record read at a time (the start-up check of a file's first record reads one).
- `check_file(path, flag)`: a cheap start-up check that `path` is a readable file (not a directory or a pipe), and
  that a packed one can be read (data/packed.py's `check`: its package installed, a zip of one file).
- Any malformed line raises `DataError` (a `ValueError`) naming the file, the line number, what is
  wrong and what a valid line looks like. A missing file raises `DataError` naming the path.
  Nothing is skipped silently: a typo in one line of a 100k-line file should stop the run before
  the first step, not quietly shrink the data set.
"""

from __future__ import annotations

import os
from pathlib import Path

VALID_LINES = (
    'a valid line is {"text": "some document"}, {"prompt": "a question or a long document", "completion": '
    '"the answer"} or {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]} '
    '(--objective dpo: {"prompt": "...", "chosen": "...", "rejected": "..."} pairs)'
)
PAIR_LINES = ('a valid pair (--objective dpo) is {"prompt": "a question", "chosen": "the better answer", "rejected": '
              '"the worse one"}, or the same with lists of messages')


class DataError(ValueError):
    """A data file or record that cannot be used; the message says where and how to fix it."""


def where(path: str | Path, n: int) -> str:
    """"FILE, line N" (a JSON array's "record N", Parquet's "row N": data/formats.py's `unit`)."""
    from data.formats import unit
    return f"{path}, {unit(path)} {n}"


def line_error(path: str | Path, line: int, problem: str, valid: str = VALID_LINES) -> DataError:
    return DataError(f"{where(path, line)}: {problem}; {valid}")


def check_file(path: str | Path, flag: str = "data file") -> Path:
    """A cheap start-up check: `path` is a readable file, else a DataError naming `flag` and the fix; a compressed
    file, a zip or a Parquet file is looked into as far as data/packed.py's `check` says."""
    from data.packed import check

    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else \
            "is not a regular file (a pipe or a device)" if p.exists() else "does not exist"
        raise DataError(f"{flag} {p} {what}; pass a JSONL file with one record per line ({VALID_LINES})")
    try:
        with p.open("rb") as f:
            head = f.read(8)
    except OSError as e:   # (permissions: a traceback deep in the loader otherwise)
        raise DataError(f"{flag} {p} cannot be read ({type(e).__name__}: {e.strerror}); fix its permissions") from None
    check(p, head, flag)   # (until 2026-12-06 a compressed file, zip or Parquet was refused here, with the command
    return p               # that makes JSONL of it)


def iter_jsonl(path: str | Path):
    """A data file's validated records, one record read at a time (blank lines skipped): JSONL, or any form
    data/formats.py reads."""
    # (imported here: data/records.py imports this file's DataError and line_error)
    from data.formats import units
    from data.records import parse_record

    p = check_file(path)
    for n, raw in units(p):
        if not isinstance(raw, str) or raw.strip():
            yield parse_record(raw, p, n)


def load_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file into validated records (see the module docstring)."""
    records = list(iter_jsonl(path))
    if not records:
        what = "an empty file" if os.path.getsize(path) == 0 else "only blank lines"   # (a copy that wrote nothing?)
        raise DataError(f"data file {Path(path)} has no records ({what}); {VALID_LINES}")
    return records
