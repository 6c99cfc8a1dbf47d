"""A data file's records in the forms it may come in: JSONL text, compressed JSONL, a zip of one file, one JSON array,
Parquet, CSV and TSV (data/jsonl.py reads what this yields; until 2026-12-06 all but JSONL text were refused with a
command, and CSV read as JSONL: "line 1: not valid JSON").

Contract:
- The form is told by the file's bytes, never its name (but CSV's, which has no bytes of its own): gzip, bzip2, xz
  (the standard library) and zstd (the `zstandard` package) are decompressed as they are read; a zip is read when it
  holds one file (directories and `__MACOSX/` left out), itself JSONL or a JSON array, and else refused at start-up
  naming its files (so is one zipfile cannot read: deflate64, encrypted); Parquet (`pyarrow`) is read a batch of rows
  at a time. Text whose first non-blank character is `[` is one JSON array, its elements the records, read element by
  element (a large file is not parsed whole). CSV has no magic bytes: text (compressed or zipped too) named *.csv or
  *.tsv (`table`) whose first non-blank character is neither `[` nor `{` is rows under a header (data/tables.py says
  how). A missing package is a DataError naming the file and the `pip install` that fixes it.
- `units(path)` yields `(n, raw)`: `n` the record's 1-based position, which errors and `samples.lines` carry: a
  JSONL line's number (blank lines counted, and yielded as they are), an array element's index, a Parquet row's; and
  `raw` the line's text, the element's JSON text, or the row as a dict (data/records.py's `parse_record` reads each).
  `unit(path)` names `n` for messages: "line", "record" (a JSON array) or "row" (Parquet, CSV and TSV: under the
  header, from 1).
- Parquet has no missing key, only null, and a struct column holds every key any row has (a row whose message lacks
  "weight" reads `"weight": None` because another row's has one; a tool schema gets another tool's properties as
  nulls). So a row's null values are dropped at every depth (`drop_nulls`), but for a message's "content" (ShareGPT's
  "value"), where null is said in JSON too: OpenAI's turn that only calls tools. A null in a list stays. A map
  column is read as a dict; one holding a key twice is refused naming the row (a dict keeps one of the values).
- A compressed file cut short or corrupt is a DataError naming the file, what is wrong and the last whole record,
  raised when reached. The bytes themselves, decompressed, come from data/packed.py (several streams, a zip's one
  file, the start-up `check` of a packed file).
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
import zipfile
from pathlib import Path

from data import packed
from data.jsonl import DataError
from data.packed import BROKEN, chunks, kind, member, need
from data.tables import delimiter, rows

ROWS = 1024       # Parquet rows converted to dicts at a time
SPACE = re.compile(r"[ \t\n\r]*")   # JSON's whitespace


def _lines(chunks):
    pieces = []
    for c in chunks:
        *whole, last = c.split(b"\n")
        for w in whole:
            yield b"".join(pieces) + w + b"\n"
            pieces = []
        pieces.append(last)
    if tail := b"".join(pieces):
        yield tail


def _elements(chunks, head: bytes, p: Path):
    """A JSON array's elements as their JSON text, parsed one at a time from a buffer that grows only as far as one
    element needs (`head`: the file's start, from its "[")."""
    utf8, dec = codecs.getincrementaldecoder("utf-8")(), json.JSONDecoder()
    s, done, n = utf8.decode(head), False, 0
    i = s.index("[") + 1

    def more():   # at least as much again as is left (a huge element is parsed a few times, not once a chunk)
        nonlocal s, i, done
        got, size = [], 0
        while not done and size < max(packed.CHUNK, len(s) - i):
            c = next(chunks, None)
            done = c is None
            got.append(utf8.decode(c or b"", final=done))
            size += len(got[-1])
        s, i = s[i:] + "".join(got), 0

    def skip() -> bool:   # past JSON's whitespace: is there more?
        nonlocal i
        while (i := SPACE.match(s, i).end()) == len(s) and not done:
            more()
        return i < len(s)

    cut = lambda: DataError(f"{p}, record {n + 1}: the JSON array ends without its closing ]: cut short?")
    while True:
        if not skip():
            raise cut()
        if s[i] == "]":
            break
        if n:
            if s[i] != ",":
                raise DataError(f"{p}, record {n + 1}: expected , or ] after record {n}, got {s[i:i + 20]!r}")
            i += 1
            if not skip():
                raise cut()
        while True:
            try:
                end = dec.raw_decode(s, i)[1]
                if end + 2 < len(s) or done:   # (a number at the buffer's end may go on: "1" or "1e+" of "1e+5")
                    break
            except json.JSONDecodeError as e:   # (at the buffer's end, or in a string it ends: maybe just unread)
                if done or e.pos < len(s) - 16 and not e.msg.startswith("Unterminated"):
                    end = "; the file ends inside it: cut short?" if e.pos >= len(s) else ""
                    raise DataError(f"{p}, record {n + 1}: not valid JSON ({e.msg} at character {e.pos - i + 1} "
                                    f"of the record{end})") from None
            more()
        n += 1
        yield n, s[i:end]
        i = end
    i += 1
    if skip():
        raise DataError(f"{p}: the JSON array ends after record {n}, and {s[i:i + 20]!r} follows it: one array a file")


def drop_nulls(x):
    """A Parquet row's values with every null value of a mapping left out, at every depth (module docstring)."""
    if isinstance(x, list):
        return [drop_nulls(v) for v in x]
    if not isinstance(x, dict):
        return x
    keep = ("content",) if "role" in x else ("value",) if "from" in x else ()
    return {k: drop_nulls(v) for k, v in x.items() if v is not None or k in keep}


def _rows(p: Path):
    pq = need("pyarrow.parquet", "pyarrow", p, "a Parquet file")
    n = 0
    with pq.ParquetFile(p) as f:
        for batch in f.iter_batches(batch_size=ROWS):
            try:   # (a map column: a dict, not a list of pairs; "lossy" kept one value of a key held twice, warned)
                got = batch.to_pylist(maps_as_pydicts="strict")
            except KeyError as e:   # (said for the batch: the row found one at a time)
                i = next(i for i in range(batch.num_rows) if _twice(batch.slice(i, 1)))
                raise DataError(f"{p}, row {n + i + 1}: a map column holds a key twice ({e.args[0]}); a dict "
                                "keeps one value: write the row's map without the repeated key") from None
            for row in got:
                n += 1
                yield n, drop_nulls(row)


def _twice(row) -> bool:
    try:
        row.to_pylist(maps_as_pydicts="strict")
    except KeyError:
        return True
    return False


def _head(chunks) -> bytes:
    """The text's start, read up to its first character past whitespace and a byte-order mark (which a short first
    read may cut: b"\xef" then b"\xbb\xbf[")."""
    head = b""
    while (not head.removeprefix(codecs.BOM_UTF8).strip() or codecs.BOM_UTF8.startswith(head)) and \
            (c := next(chunks, None)) is not None:
        head += c
    return head


def table(p: Path, k: str | None = None) -> str | None:
    """The delimiter a CSV or TSV file is read with, told by its name or a zip's one file's (data/tables.py), else
    None (`k`: the file's kind, read when not given). Its text starting with `{` or `[` is JSON all the same."""
    if k is None:
        with p.open("rb") as f:
            k = kind(f.read(8))
    if k == "zip" and not delimiter(p.name):
        with zipfile.ZipFile(p) as z:
            return delimiter(Path(member(z, p).filename).name)
    return None if k == "Parquet" else delimiter(p.name)


def _text(p: Path, k: str | None):
    parts = chunks(p, k)
    head = _head(parts)
    first = head.removeprefix(codecs.BOM_UTF8).lstrip()[:1]
    if first not in (b"[", b"{") and (sep := table(p, k)):
        yield from rows(p, _lines(c for part in ([head], parts) for c in part), sep)
        return
    if first == b"[":
        try:
            yield from _elements(parts, head.removeprefix(codecs.BOM_UTF8), p)
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: a JSON array that is not UTF-8 ({e.reason}); write it as UTF-8") from None
        return
    from data.jsonl import line_error
    for n, raw in enumerate(_lines(c for part in ([head], parts) for c in part), start=1):
        try:
            yield n, raw.decode("utf-8-sig" if n == 1 else "utf-8")   # a byte-order mark (Windows editors)
        except UnicodeDecodeError as e:
            raise line_error(p, n, f"not UTF-8 ({e.reason} at byte {e.start})") from None


def units(path: str | Path):
    """(n, raw) for each record of the file (module docstring); a compressed file's read error is a DataError naming
    the file, what is wrong and the last record read whole."""
    p = Path(path)
    with p.open("rb") as f:
        k = kind(f.read(8))
    broken = BROKEN + ((need("zstandard", "zstandard", p, "zstd-compressed").ZstdError,) if k == "zstd" else
                       (need("pyarrow", "pyarrow", p, "a Parquet file").ArrowException,) if k == "Parquet" else ())
    it, n = _rows(p) if k == "Parquet" else _text(p, k), 0
    while True:
        try:
            n, raw = next(it)
        except StopIteration:
            return
        except broken as e:
            if not k:   # (a plain file's read error is the machine's, not the data's)
                raise
            last = f"after {unit(p)} {n}" if n else "before its first record"
            raise DataError(f"{p}: the {k} data is cut short or corrupt ({type(e).__name__}: {e}), {last}; fetch "
                            "or write it again") from None
        yield n, raw


@functools.lru_cache(maxsize=64)
def _unit(path: str, _stamp: tuple) -> str:
    try:
        with open(path, "rb") as f:
            k = kind(f.read(8))
        if k == "Parquet":
            return "row"
        first = _head(chunks(Path(path), k)).removeprefix(codecs.BOM_UTF8).lstrip()[:1]
        return "record" if first == b"[" else "line" if first == b"{" or not table(Path(path), k) else "row"
    except Exception:
        pass
    return "line"


def unit(path) -> str:
    """What a record's number counts in `path`: "line" (JSONL), "record" (a JSON array) or "row" (Parquet, CSV)."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return "line"
    return _unit(str(path), (st.st_size, st.st_mtime_ns, st.st_ino))
