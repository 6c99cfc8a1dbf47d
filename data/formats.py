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
  "value"), where null is said in JSON too: OpenAI's turn that only calls tools. A null in a list stays.
- A compressed file cut short or corrupt is a DataError naming the file, what is wrong and the last whole record,
  raised when reached. A file of several streams (bzip2's, xz's; zstd's frames) is read to its last, zero bytes
  between them skipped; anything else past a stream is corrupt (`_streams`). `check(p, head, flag)` is
  data/jsonl.py's start-up look at a packed file (the zip's directory, the Parquet footer, the package there).
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import functools
import gzip
import json
import lzma
import os
import re
import zipfile
import zlib
from pathlib import Path

from data.jsonl import DataError
from data.tables import delimiter, rows

CHUNK = 1 << 20   # bytes of the file (decompressed) a read takes
ROWS = 1024       # Parquet rows converted to dicts at a time
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
         (b"PK\x03\x04", "zip"), (b"PAR1", "Parquet"))
STREAMS = {"bzip2": bz2.BZ2Decompressor, "xz": lzma.LZMADecompressor}   # (gzip.open: strict past a stream already)
SPACE = re.compile(r"[ \t\n\r]*")   # JSON's whitespace
BROKEN = (EOFError, OSError, zlib.error, lzma.LZMAError, zipfile.BadZipFile)   # (+ zstandard's ZstdError when used)


def kind(head: bytes) -> str | None:
    return next((k for magic, k in MAGIC if head.startswith(magic)), None)


def _need(module: str, pip: str, p: Path, what: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{p} is {what}, which needs the {pip} package to be read: pip install {pip} (make install "
                        "installs it)") from None


def _member(z: zipfile.ZipFile, p: Path) -> zipfile.ZipInfo:
    files = [i for i in z.infolist() if not i.is_dir() and not i.filename.startswith("__MACOSX/")]
    if len(files) != 1:
        names = ", ".join(i.filename for i in files[:8]) + (", ..." if len(files) > 8 else "")
        raise DataError(f"{p} is a zip archive of {len(files)} files ({names or 'none'}): it is read when it holds "
                        f"one; extract it (unzip {p}) and pass its data file (--data takes several)")
    f = files[0]   # (zipfile reads these methods, and no encrypted file: Windows' own zip deflate64s large files)
    if f.flag_bits & 1 or f.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                                                  zipfile.ZIP_LZMA):
        how = "encrypted" if f.flag_bits & 1 else \
            f"compressed by {zipfile.compressor_names.get(f.compress_type, f'method {f.compress_type}')}"
        raise DataError(f"{p}: its file {f.filename} is {how}, which Python's zipfile cannot read: extract it "
                        f"(unzip {p}) and pass that file")
    return f


def check(p: Path, head: bytes, flag: str) -> None:
    """Start-up: a packed file can be read (its package is here; a zip holds one file; a Parquet footer reads)."""
    k = kind(head)
    try:
        if k == "zstd":
            _need("zstandard", "zstandard", p, "zstd-compressed")
        elif k == "zip":
            with zipfile.ZipFile(p) as z:
                _member(z, p)
        elif k == "Parquet":
            _need("pyarrow.parquet", "pyarrow", p, "a Parquet file").ParquetFile(p).close()
    except DataError as e:
        raise DataError(f"{flag} {e}") from None
    except Exception as e:   # (a zip or Parquet file cut short: its directory or footer is at the end)
        raise DataError(f"{flag} {p} is a {k} file that cannot be read ({type(e).__name__}: {e}): cut short or "
                        "corrupt? fetch or write it again") from None


def _zstd(f, p: Path):
    zstd = _need("zstandard", "zstandard", p, "zstd-compressed")
    d = None
    while chunk := f.read(CHUNK):
        while chunk:   # (frames one after another: each ends its decompressor, and what follows starts the next)
            d = zstd.ZstdDecompressor().decompressobj() if d is None or d.eof else d
            yield d.decompress(chunk)
            chunk = d.unused_data if d.eof else b""
    if d is None or not d.eof:
        raise EOFError("the zstd stream ended before its end-of-frame marker")


def _streams(f, new):
    """bzip2's or xz's streams one after another (pbzip2, `cat a.xz b.xz`), each decompressed as read, CHUNK bytes of
    output at most at a time: Python's BZ2File and LZMAFile take the first bytes past a stream that start no stream
    for trailing garbage and stop there, so xz's stream padding (zero bytes) or a corrupt header lost every stream
    after it without a word. Zero bytes between streams are skipped (as gzip's reader does); anything else is the
    decompressor's error, raised."""
    d = new()
    while True:
        if d.eof:
            rest = d.unused_data.lstrip(b"\0")
            while not rest and (c := f.read(CHUNK)):
                rest = c.lstrip(b"\0")
            if not rest:
                return
            d, data = new(), rest
        elif d.needs_input:
            if not (data := f.read(CHUNK)):
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        else:
            data = b""   # (output held back by the CHUNK cap)
        if out := d.decompress(data, CHUNK):
            yield out


def _chunks(p: Path, k: str | None):
    """The file's bytes, decompressed, a chunk at a time."""
    with contextlib.ExitStack() as stack:
        if k == "zip":
            z = stack.enter_context(zipfile.ZipFile(p))
            f = stack.enter_context(z.open(_member(z, p)))
        else:
            f = stack.enter_context(gzip.open(p, "rb") if k == "gzip" else p.open("rb"))
        if k in ("zstd", *STREAMS):
            yield from _zstd(f, p) if k == "zstd" else _streams(f, STREAMS[k])
            return
        first = True
        while chunk := f.read1(CHUNK):   # (read1: what decompressed before a cut is yielded before the error)
            if first and k == "zip" and (inner := kind(chunk)):
                raise DataError(f"{p}: the file it holds is {inner}, not JSONL or a JSON array: extract it "
                                f"(unzip {p}) and pass that file")
            first = False
            yield chunk


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
        while not done and size < max(CHUNK, len(s) - i):
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
    pq = _need("pyarrow.parquet", "pyarrow", p, "a Parquet file")
    n = 0
    with pq.ParquetFile(p) as f:
        for batch in f.iter_batches(batch_size=ROWS):
            for row in batch.to_pylist(maps_as_pydicts="lossy"):   # (a map column: a dict, not a list of pairs)
                n += 1
                yield n, drop_nulls(row)


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
            return delimiter(Path(_member(z, p).filename).name)
    return None if k == "Parquet" else delimiter(p.name)


def _text(p: Path, k: str | None):
    chunks = _chunks(p, k)
    head = _head(chunks)
    first = head.removeprefix(codecs.BOM_UTF8).lstrip()[:1]
    if first not in (b"[", b"{") and (sep := table(p, k)):
        yield from rows(p, _lines(c for part in ([head], chunks) for c in part), sep)
        return
    if first == b"[":
        try:
            yield from _elements(chunks, head.removeprefix(codecs.BOM_UTF8), p)
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: a JSON array that is not UTF-8 ({e.reason}); write it as UTF-8") from None
        return
    from data.jsonl import line_error
    for n, raw in enumerate(_lines(c for part in ([head], chunks) for c in part), start=1):
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
    broken = BROKEN + ((_need("zstandard", "zstandard", p, "zstd-compressed").ZstdError,) if k == "zstd" else
                       (_need("pyarrow", "pyarrow", p, "a Parquet file").ArrowException,) if k == "Parquet" else ())
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
        first = _head(_chunks(Path(path), k)).removeprefix(codecs.BOM_UTF8).lstrip()[:1]
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
