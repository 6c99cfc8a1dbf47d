"""JSONL input: read and validate training records, failing early with the line that is wrong.

Contract:
- One JSON object per line; blank lines are skipped. What a line may hold (the record kinds), and how it is checked
  and normalised, is data/records.py's `parse_record`; ShareGPT's conversations are read as messages
  (data/sharegpt.py).
- `load_jsonl(path)` returns the records in file order, each normalised to
  `{"line": n, "text": str}`, `{"line": n, "prompt": str, "completion": str}` or
  `{"line": n, "messages": [...]}` (plus `"tools": [...]` when given) (`n` is 1-based, kept so that later stages can
  still name the line); a pair to `{"line": n, "pair": [chosen, rejected]}`, each side one of the records above.
  `iter_jsonl(path)` yields them one line read at a time (the start-up check of a file's first record reads one).
- `check_file(path, flag)`: a cheap start-up check that `path` is a readable file of JSONL text (not a directory, a
  pipe, or a compressed file or archive: PACKED, named with the command that makes JSONL of it).
- Any malformed line raises `DataError` (a `ValueError`) naming the file, the line number, what is
  wrong and what a valid line looks like. A missing file raises `DataError` naming the path.
  Nothing is skipped silently: a typo in one line of a 100k-line file should stop the run before
  the first step, not quietly shrink the data set.
"""

from __future__ import annotations

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


def line_error(path: str | Path, line: int, problem: str, valid: str = VALID_LINES) -> DataError:
    return DataError(f"{path}, line {line}: {problem}; {valid}")


def check_file(path: str | Path, flag: str = "data file") -> Path:
    """A cheap start-up check: `path` is a readable file, else a DataError naming `flag` and the fix."""
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
    for magic, kind, fix in PACKED:   # (said at line 1 as "not UTF-8" until 2026-12-05)
        if head.startswith(magic):
            raise DataError(f"{flag} {p} is {kind}, not JSONL text: {fix.format(p)}, and pass that file")
    return p


# what a data file may be in place of JSONL text: its first bytes, its name, how to make JSONL of it
PACKED = ((b"\x1f\x8b", "gzip-compressed", "decompress it (gzip -dc {} > data.jsonl)"),   # (-c: any file name; -d
          (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (zstd -dc {} > data.jsonl)"),   # alone wants .gz)
          (b"BZh", "bzip2-compressed", "decompress it (bzip2 -dc {} > data.jsonl)"),
          (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (xz -dc {} > data.jsonl)"),
          (b"PK\x03\x04", "a zip archive", "extract its JSONL file (unzip {})"),
          (b"PAR1", "a Parquet file", "write its rows as JSONL (pandas: read_parquet('{}').to_json(OUT, "
           "orient='records', lines=True, force_ascii=False))"))


def iter_jsonl(path: str | Path):
    """A JSONL file's validated records, one line read at a time (blank lines skipped)."""
    # (imported here: data/records.py imports this file's DataError and line_error)
    from data.records import parse_record

    p = check_file(path)
    with p.open("rb") as f:
        for n, raw_bytes in enumerate(f, start=1):
            try:
                raw = raw_bytes.decode("utf-8-sig" if n == 1 else "utf-8")   # a byte-order mark (Windows editors)
            except UnicodeDecodeError as e:
                raise line_error(p, n, f"not UTF-8 ({e.reason} at byte {e.start})") from None
            if raw.strip():
                yield parse_record(raw, p, n)


def load_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file into validated records (see the module docstring)."""
    records = list(iter_jsonl(path))
    if not records:
        raise DataError(f"data file {Path(path)} has no records (only blank lines); {VALID_LINES}")
    return records
