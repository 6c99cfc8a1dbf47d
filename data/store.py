"""Records tokenized into compact `Samples` (data/samples.py), and a disk cache of them keyed by everything that
decides the tokens.

Contract:
- `build(records, tokenize, log, what, workers, job)` tokenizes chunks of about `CHUNK_CHARS` characters, so only
  one chunk's Python lists exist at a time, and says its progress every `LOG_SECONDS`. With `workers` > 1 (train.py's
  --data-workers, `data_workers`), when the first chunk's pace says the rest would take `POOL_SECONDS` or more, the
  rest go to a pool of that many spawned processes (a chat template renders in Python: 2-7 ms a record), taken back
  in order: the same samples, stats and first error as one process.
- `cache_key(data_sha256, tokenizer, max_len, day, long_text, all_targets, read_as)`: a sha256 over the data file's
  (`file_sha256`) and how its name says to read it (`read_as`: "," or a tab for a CSV or TSV file, data/tables.py;
  the same bytes named .tsv are other records), the tokenizer's directory (every file but weights), its effective
  chat template and class, max_len, long_text (what a text record longer than it becomes: --long-text),
  --train-on-prompt when set (`all_targets`), the source of the modules that turn records into tokens (`SOURCES`:
  data/jsonl.py and its formats.py (a file's forms), packed.py (its bytes, decompressed) and tables.py (CSV and TSV
  rows), records.py, sharegpt.py and alpaca.py (a line's record), tokens.py and its token_stats.py (the stats kept
  beside the tokens) and load.py (a file's tokens through this cache), chat.py and its chat_render.py, chat_turn.py
  and chat_spans.py, templates.py, samples.py, this file),
  the transformers, tokenizers and jinja2 (it renders the templates) versions and the labels' IGNORE_INDEX; and the
  day (`today()` unless given) for a template that writes it (`strftime_now`: Llama 3.2's and 3.3's "Today Date"
  line), the date such a template renders (data/templates.py's `on_day`).
  Any change is a miss, never a stale hit. None when the tokenizer has no directory to hash.
- `read(path)` memory-maps a cached file (ranks on one machine share one copy in the page cache) and returns
  None, with a line saying why, for a file that is absent, unreadable (also a folder this user cannot enter), written
  under another key, or whose tokens do not match the sha256 written with them; `write` goes
  through a temporary file and a rename, so an interrupted write leaves no half file under the key (a killed
  writer's temporary file is removed by a later write, a day on). A cache that
  cannot be read or written costs a re-tokenization, never the run.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import asdict
from pathlib import Path

import torch

from data.jsonl import DataError
from data.samples import Samples, fingerprint
from data.templates import dated

DATA_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "long-context-lora",
                          "tokens")   # --data-cache's default
CHUNK_CHARS = 1 << 24   # ~16M characters of records per tokenizer call (~4M tokens of lists at a time)
LOG_SECONDS = 10.0
WAIT = datetime.timedelta(hours=24)   # the longest the other ranks wait for a machine's first rank to tokenize
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")
# the code that decides a record's tokens
SOURCES = ("jsonl.py", "formats.py", "packed.py", "tables.py", "records.py", "sharegpt.py", "alpaca.py", "tokens.py",
           "token_stats.py", "load.py", "chat.py", "chat_render.py", "chat_turn.py", "chat_spans.py", "templates.py",
           "store.py", "samples.py")


def _chars(r: dict) -> int:
    if "pair" in r:
        return sum(map(_chars, r["pair"]))
    return len(r.get("text", "")) + len(r.get("prompt", "")) + len(r.get("completion", "")) + \
        sum(len(m.get("content") or "") for m in r.get("messages", ()))


def build(records: list[dict], tokenize, log=None, what: str = "data", workers: int = 1, job: tuple | None = None):
    """records -> (Samples, TokenStats) through `tokenize(chunk) -> (list samples, TokenStats)`, chunk by chunk. With
    `workers` > 1 and `job` (`tokenize_records`' arguments after the records: tokenizer, max_len, path, day, long_text,
    all_targets),
    the chunks after the first go to a pool of that many processes when the first one's pace says the rest would take
    POOL_SECONDS or more here; the results are taken in order, so the samples, stats and first error are the same."""
    from data.token_stats import DROPPED_LINES, TokenStats

    total_chars = sum(map(_chars, records))
    size = max(1, min(CHUNK_CHARS, total_chars // (4 * workers))) if workers > 1 else CHUNK_CHARS
    bounds, i = [], 0
    while i < len(records):
        j, n = i, 0
        while j < len(records) and (j == i or n < size):
            n, j = n + _chars(records[j]), j + 1
        bounds.append((i, j, n))
        i = j
    parts, total, t0, t_log = [], TokenStats(), time.time(), time.time()

    def take(samples, stats, j):
        nonlocal t_log
        parts.append(Samples.from_lists(samples))
        for k, v in asdict(stats).items():
            setattr(total, k, max(v, total.longest) if k == "longest" else
                    (getattr(total, k) + v)[:DROPPED_LINES] if k.endswith("_lines") else getattr(total, k) + v)
        if log and time.time() - t_log > LOG_SECONDS:
            t_log = time.time()
            log(f"tokenizing {what}: {j:,} / {len(records):,} records, {total.tokens:,} tokens, {t_log - t0:.0f} s")

    done = 0
    for n, (i, j, chars) in enumerate(bounds):
        take(*tokenize(records[i:j]), j)
        done += chars
        if workers > 1 and job is not None and n + 1 < len(bounds) and \
                (time.time() - t0) * (total_chars - done) / max(1, done) >= POOL_SECONDS:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            from concurrent.futures.process import BrokenProcessPool

            if log:
                log(f"tokenizing {what}: {workers} processes for the remaining {len(records) - j:,} records")
            # spawn: a fresh interpreter (this process holds torch's and the process group's threads; fork copies
            # them half-done); each imports the tokenizer once (~3 s), then takes chunks. An executor, not a Pool:
            # a process that dies (the OOM killer) fails the wait instead of leaving it waiting for ever
            later = bounds[n + 1:]
            pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _pool_start, (job,))
            try:
                for (_, b, _), got in zip(later, pool.map(_pool_chunk, (records[a:b] for a, b, _ in later))):
                    take(*got, b)
            except BrokenProcessPool as e:
                raise DataError(f"tokenizing {what}: a tokenizing process died ({e}; out of memory?): pass "
                                "--data-workers 1 to tokenize in this process, or fewer") from None
            finally:   # (after an error: the chunks not started are dropped, not tokenized first)
                pool.shutdown(wait=True, cancel_futures=True)
            break
    return Samples.cat(parts), total


POOL_SECONDS = 20.0   # tokenizing estimated to take this long or more on one process goes to `workers` processes
_JOB = None   # a pool process's `tokenize_records` arguments after the records


def _pool_start(job: tuple) -> None:
    import signal

    global _JOB
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # (one thread a process: the processes are the parallelism)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the run's (train.py's StopSignals), not a traceback each
    _JOB = job


def _pool_chunk(records: list[dict]):
    from data.tokens import tokenize_records

    return tokenize_records(records, *_JOB)


def data_workers(given: int, tokenizing_ranks: int) -> int:
    """--data-workers: `given`, or (0) this machine's usable cores shared by the ranks that tokenize at once, at most
    32."""
    if given:
        return given
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # (not Linux)
        cores = os.cpu_count() or 1
    return max(1, min(32, cores // max(1, tokenizing_ranks)))


def _update(h, path: Path):
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h


def file_sha256(path: str | Path) -> str:
    """A data file's identity: its bytes' sha256 (a resume compares it; the cache key holds it)."""
    return _update(hashlib.sha256(), Path(path)).hexdigest()


def today() -> str:
    """The local date, as a dated chat template's cache key holds it."""
    return time.strftime("%Y-%m-%d")


def cache_key(data_sha256: str, tokenizer, max_len: int, day: str | None = None,
              long_text: str | None = None, all_targets: bool = False, read_as: str | None = None) -> str | None:
    """The sha256 a cached file is named by (see the module docstring), or None without a tokenizer directory."""
    import jinja2
    import tokenizers
    import transformers

    from data.token_stats import LONG_TEXT
    from loss import IGNORE_INDEX

    tok_dir = Path(getattr(tokenizer, "name_or_path", "") or "")
    if not tok_dir.is_dir():
        return None
    h = hashlib.sha256()
    template = tokenizer.chat_template   # a dict when the checkpoint ships several (additional_chat_templates/)
    for part in (f"max_len={max_len}", f"long_text={long_text or LONG_TEXT[0]}", type(tokenizer).__name__,
                 json.dumps(template, sort_keys=True), transformers.__version__, tokenizers.__version__,
                 jinja2.__version__, f"ignore={IGNORE_INDEX}", (day or today()) if dated(template) else "",
                 *(["targets=all"] if all_targets else []),   # (--train-on-prompt; off: no part)
                 *([f"read_as={read_as!r}"] if read_as else [])):   # (a CSV's or TSV's delimiter; JSON: no part)
        h.update(part.encode() + b"\0")
    for name in SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    for f in sorted(p for p in tok_dir.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        _update(h, f).update(f.name.encode() + b"\0")
    h.update(f"data={data_sha256}".encode())
    return h.hexdigest()


def read(path: Path, key: str, log=None):
    """(Samples, stats dict) from a cached file, or None (a line through `log` says why, unless it is absent). The
    tokens must match the sha256 written with them: torch.load checks no checksum, and a file damaged inside its
    tensors (a bad disk, a copy cut and patched) would read back as other token ids, most of them still valid."""
    try:
        if not path.is_file():   # (a folder this user cannot enter raises here: said, then tokenized again)
            return None
        d = torch.load(path, mmap=True, weights_only=True)
        if d.get("key") != key:
            raise ValueError(f"it was written under key {d.get('key')}")
        samples = Samples(d["ids"], d["labels"], d["offsets"], d["lines"])
        if fingerprint(samples) != d.get("sha256") or _digest(samples.lines) != d.get("lines_sha256"):
            raise ValueError("its tokens do not match the sha256 written with them (a damaged file)")
        return samples, d["stats"]
    except Exception as e:   # a damaged or foreign file, or no access: tokenize again (and replace it if we may)
        if log:
            log(f"data cache {path} unreadable ({type(e).__name__}: {e}); tokenizing again")
        return None


TMP_RE = re.compile(r"\.[0-9a-f]{64}\.pt\.[0-9a-f]{16}\.tmp")   # write's temporary names (a key's .pt)


def write(path: Path, key: str, samples: Samples, stats: dict, log=None) -> bool:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")   # unique across machines sharing the folder
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        assert samples.rows is None and samples.starts is None, "the cache keeps a file's whole tokens"
        torch.save({"key": key, "ids": samples.ids, "labels": samples.labels, "offsets": samples.offsets,
                    "lines": samples.lines, "lines_sha256": _digest(samples.lines), "stats": stats,
                    "sha256": fingerprint(samples)}, tmp)
        os.replace(tmp, path)
        for old in path.parent.glob(".*.tmp"):   # a killed writer's, a day old: nobody still writes it (WAIT)
            with contextlib.suppress(OSError):   # (only this function's names: a user's own .x.tmp stays)
                if TMP_RE.fullmatch(old.name) and time.time() - old.stat().st_mtime > WAIT.total_seconds():
                    old.unlink()
        return True
    except (OSError, RuntimeError) as e:   # a full or read-only disk (torch.save's own error): no cache this time
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if log:
            log(f"data cache {path} not written ({e}); the next run tokenizes again")
        return False


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().data).hexdigest()
