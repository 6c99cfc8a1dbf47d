"""A data file's bytes as they are stored: gzip, bzip2, xz, zstd or a zip of one file, decompressed a chunk at a time,
and told by their first bytes (data/formats.py reads the records in them; moved out of it on 2026-12-06).

Contract:
- `kind(head)`: the form the first bytes say (gzip, zstd, bzip2, xz, zip, Parquet), None for plain text.
- `chunks(p, k)`: the file's bytes, decompressed, CHUNK at a time (output capped per read too); a zip's one file
  (`member`: directories and `__MACOSX/` left out; several files, an encrypted one or a method zipfile cannot read is a
  DataError naming them and the unzip that reads it). A file of several streams (bzip2's, xz's; zstd's frames) is read
  to its last, zero bytes between them skipped; anything else past a stream is corrupt (`_streams`). A file cut short
  or corrupt raises one of BROKEN (data/formats.py names the file and the last whole record).
- `check(p, head, flag)`: data/jsonl.py's start-up look at a packed file (the zip's directory, the Parquet footer, the
  package there). `need(module, pip, p, what)`: an optional package, or a DataError naming the `pip install`.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import zipfile
import zlib
from pathlib import Path

from data.jsonl import DataError

CHUNK = 1 << 20   # bytes of the file (decompressed) a read takes
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
         (b"PK\x03\x04", "zip"), (b"PAR1", "Parquet"))
STREAMS = {"bzip2": bz2.BZ2Decompressor, "xz": lzma.LZMADecompressor}   # (gzip.open: strict past a stream already)
BROKEN = (EOFError, OSError, zlib.error, lzma.LZMAError, zipfile.BadZipFile)   # (+ zstandard's ZstdError when used)


def kind(head: bytes) -> str | None:
    return next((k for magic, k in MAGIC if head.startswith(magic)), None)


def need(module: str, pip: str, p: Path, what: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{p} is {what}, which needs the {pip} package to be read: pip install {pip} (make install "
                        "installs it)") from None


def member(z: zipfile.ZipFile, p: Path) -> zipfile.ZipInfo:
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
            need("zstandard", "zstandard", p, "zstd-compressed")
        elif k == "zip":
            with zipfile.ZipFile(p) as z:
                member(z, p)
        elif k == "Parquet":
            need("pyarrow.parquet", "pyarrow", p, "a Parquet file").ParquetFile(p).close()
    except DataError as e:
        raise DataError(f"{flag} {e}") from None
    except Exception as e:   # (a zip or Parquet file cut short: its directory or footer is at the end)
        raise DataError(f"{flag} {p} is a {k} file that cannot be read ({type(e).__name__}: {e}): cut short or "
                        "corrupt? fetch or write it again") from None


def _zstd(f, p: Path):
    zstd = need("zstandard", "zstandard", p, "zstd-compressed")
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


def chunks(p: Path, k: str | None):
    """The file's bytes, decompressed, a chunk at a time."""
    with contextlib.ExitStack() as stack:
        if k == "zip":
            z = stack.enter_context(zipfile.ZipFile(p))
            f = stack.enter_context(z.open(member(z, p)))
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
