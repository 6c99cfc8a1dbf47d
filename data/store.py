"""Token samples held compactly, and a disk cache of them keyed by everything that decides the tokens.

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
- `build(records, tokenize, log, what, workers, job)` tokenizes chunks of about `CHUNK_CHARS` characters, so only
  one chunk's Python lists exist at a time, and says its progress every `LOG_SECONDS`. With `workers` > 1 (train.py's
  --data-workers, `data_workers`), when the first chunk's pace says the rest would take `POOL_SECONDS` or more, the
  rest go to a pool of that many spawned processes (a chat template renders in Python: 2-7 ms a record), taken back
  in order: the same samples, stats and first error as one process.
- `cache_key(data_sha256, tokenizer, max_len, day, long_text, all_targets)`: a sha256 over the data file's
  (`file_sha256`), the tokenizer's directory (every file but weights), its effective chat template and class, max_len,
  long_text (what a text record longer than it becomes: --long-text), --train-on-prompt when set (`all_targets`), the
  source of the modules that turn records into tokens (data/jsonl.py, tokens.py, chat.py, templates.py, this file),
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
- `load_run_data(args, tokenizer, vocab_size, log)`: train.py's --data and --eval-data, each (Samples, TokenStats)
  (--eval-data's (None, None) without one), and the --data-weights shares' `Rotation` (data/mix.py; None when every
  epoch trains the same samples, the first Samples), through `once_per_machine`,
  rendered on `args.template_date` (rank 0's today when None: a resume passes its run's); when the template writes
  the date, it sets that to the day used, which the run's config and checkpoints keep, and says it (else None). A
  cache that cannot be read or written is said by rank 0, and on every other machine by its first rank (naming the
  host). It logs --data's stats (`data: ...`), --eval-split's records held out of them (`eval split: ...`), and
  the --eval-data stats (`eval data: ...`) and a note when eval samples are also training samples
  (`also_in`: the same input ids), and every rank must end with the same tokens
  (`same_on_every_rank`, a sha256 `fingerprint` of ids, labels and boundaries): machines that read different
  bytes behind one path, or tokenize them differently, stop with one error naming the ranks and hosts. It sets
  `args.data_tokens` ("N samples, T tokens, sha256 <fingerprint>": the mixture's, or with rotating shares the whole
  set's, each sample once), which checkpoints keep: a resume must train on
  the same tokens, not only on the same file bytes (parallel/resume.py's `same_tokens`).
- `once_per_machine(load, first, day)`: with several ranks, each machine's first rank runs `load(True, day)`
  (tokenize, write the cache) while the others wait, then the others run `load(False, day)`: they read that file
  back memory-mapped, so a machine holds one copy of the tokens, not one per rank, and tokenizes once (they tokenize
  themselves only when it could not be written). `day` is rank 0's (`today()` if None), one for every rank, so a
  dated template renders the same date, under the same key, on every machine even when midnight passes while they
  wait. Returns (`load`'s result, day). An error on any rank is raised on
  every rank. The day goes out on the default group, under --timeout's limit: a rank that failed before this call
  stops the others there. The waits are collectives of a gloo group of their own whose timeout, `WAIT`, is not
  --timeout's: a large file may take longer than that to tokenize.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import hashlib
import itertools
import json
import os
import pickle
import re
import secrets
import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch

from data.jsonl import DataError
from data.mix import data_files, join, mix, record_name, total, weight_text
from data.templates import dated

DATA_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "long-context-lora",
                          "tokens")   # --data-cache's default
CHUNK_CHARS = 1 << 24   # ~16M characters of records per tokenizer call (~4M tokens of lists at a time)
LOG_SECONDS = 10.0
WAIT = datetime.timedelta(hours=24)   # the longest the other ranks wait for a machine's first rank to tokenize
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")
MANY_FILES = 8   # more --data files than this (a data set in shards): one `data:` line for all, not one each
SOURCES = ("jsonl.py", "tokens.py", "chat.py", "templates.py", "store.py")   # the code that decides a record's tokens


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
    from data.tokens import DROPPED_LINES, TokenStats

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
              long_text: str | None = None, all_targets: bool = False) -> str | None:
    """The sha256 a cached file is named by (see the module docstring), or None without a tokenizer directory."""
    import jinja2
    import tokenizers
    import transformers

    from data.tokens import LONG_TEXT
    from loss import IGNORE_INDEX

    tok_dir = Path(getattr(tokenizer, "name_or_path", "") or "")
    if not tok_dir.is_dir():
        return None
    h = hashlib.sha256()
    template = tokenizer.chat_template   # a dict when the checkpoint ships several (additional_chat_templates/)
    for part in (f"max_len={max_len}", f"long_text={long_text or LONG_TEXT[0]}", type(tokenizer).__name__,
                 json.dumps(template, sort_keys=True), transformers.__version__, tokenizers.__version__,
                 jinja2.__version__, f"ignore={IGNORE_INDEX}", (day or today()) if dated(template) else "",
                 *(["targets=all"] if all_targets else [])):   # (--train-on-prompt; off: no part)
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


def load_run_data(args, tokenizer, vocab_size: int, log):
    """train.py's data: ((samples, stats) of --data, (samples, stats) of --eval-data or (None, None)), every rank's
    the same, tokenized once per machine when there is a --data-cache (once_per_machine)."""
    import torch.distributed as dist

    from data.tokens import load_samples

    cache = None if args.data_cache == "none" else args.data_cache
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = os.environ.get("LOCAL_RANK", str(rank))
    warn = log   # it speaks on rank 0 only: another machine's cache trouble is said by that machine's first rank
    if rank != 0 and local_rank == "0":
        warn = lambda m: print(f"[{socket.gethostname()} rank {rank}] {m}", flush=True)
    first = not cache or local_rank == "0"   # (this rank tokenizes; with a cache, the machine's others wait for it)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = data_workers(getattr(args, "data_workers", 1), 1 if cache and first else local)
    files, eval_files = data_files(args.data), data_files(args.eval_data)
    hits = []   # many files: their "tokens from the cache" lines, said as one count
    said = lambda m: hits.append(m) if ": tokens from the cache " in m and (
        (len(files) > MANY_FILES and m.startswith("--data ")) or
        (len(eval_files) > MANY_FILES and m.startswith("--eval-data "))) else log(m)
    load = lambda path, flag, write, day, sha=None: load_samples(path, tokenizer, args.max_len, vocab_size, flag, cache,
                                                                 write, said, sha, day, warn, args.long_text, workers,
                                                                 getattr(args, "objective", None),
                                                                 getattr(args, "train_on_prompt", False))
    given = getattr(args, "template_date", None)
    if given is not None and not dated(tokenizer.chat_template):   # allowed (one script for every model), but said
        log(f"note: --template-date {given} changes nothing: the chat template writes no date (no strftime_now)")
    shas = data_files(getattr(args, "data_sha256", None)) or [None] * len(files)   # (one file's: a string)
    (parts, eval_parts), day = once_per_machine(
        lambda write, day: ([load(f, "--data", write, day, sha) for f, sha in zip(files, shas)],
                            [load(f, "--eval-data", write, day) for f in eval_files]),
        first=first, day=given)
    for flag, these in (("--data", files), ("--eval-data", eval_files)):
        if n := sum(m.startswith(flag + " ") for m in hits):
            log(f"data: {n} of the {len(these)} {flag} files' tokens from the cache {cache}")
    train = _joined("data", files, parts, log)
    log(f"data: {f'{len(files)} files: ' * (len(files) > 1)}{train[1]}")
    ev = _joined("eval data", eval_files, eval_parts, lambda m: None) if eval_parts else None   # (said below)
    if split := getattr(args, "eval_split", None):   # whole records of --data held out as the eval set
        kept, held, lines = hold_out(train[0], split, args.seed)
        shown = ", ".join(record_name(x, files) for x in lines[:8]) + (", ..." if len(lines) > 8 else "")
        log(f"eval split: {len(lines)} record{'s' * (len(lines) > 1)} of --data held out (--eval-split "
            f"{split_arg(split)}, --seed {args.seed}; line{'s' * (len(lines) > 1)} {shown}), never trained on: "
            f"{len(held)} samples, {int(held.lengths.sum())} tokens; training on {len(kept)} samples")
        train, ev = (kept, train[1]), (held, None)
    rows = None   # (with shares that rotate: which samples each epoch takes, data.mix.Rotation)
    if weights := getattr(args, "data_weights", None):   # (after the split: a held-out record is never trained on,
        mixed, said, rows = mix(train[0], files, weights, args.seed,   # whatever its file's weight)
                                rotate=getattr(args, "data_mix", "rotate") != "fixed")
        if said:
            log(f"data mix: --data-weights {' '.join(map(weight_text, weights))}: {said}")
            train = (mixed, train[1])
    digest = fingerprint(train[0])
    same_on_every_rank(train[0], ev and ev[0], digest)
    # what the run trains on, as tokens: a resume compares it (parallel/resume.same_tokens), since the same bytes
    # tokenize otherwise under an edited tokenizer or chat template file, or another transformers/tokenizers
    args.data_tokens = f"{len(train[0])} samples, {int(train[0].lengths.sum())} tokens, sha256 {digest}"
    args.eval_tokens = ev and f"{len(ev[0])} samples, {int(ev[0].lengths.sum())} tokens, sha256 {fingerprint(ev[0])}"
    if ev and ev[1]:   # its truncated and dropped records too: eval_loss covers what is left
        for f, (_, st) in zip(eval_files, eval_parts) if 1 < len(eval_files) <= MANY_FILES else ():
            log(f"eval data: {f}: {st}")
        log(f"eval data: {f'{len(eval_files)} files: ' * (len(eval_files) > 1)}{ev[1]}")
    if ev:   # (also a split's: the same text on two lines of --data, one held out, one trained on)
        if shared := also_in(ev[0], train[0]):
            what = ("held-out samples are also training samples (the same tokens: the same text on two lines of "
                    "--data)") if split else "--eval-data samples are also --data samples (the same tokens)"
            log(f"note: {shared} of the {len(ev[0])} {what}: eval_loss measures how well the run learned them, not "
                "how it does on unseen data")
    args.template_date = day if dated(tokenizer.chat_template) else None   # what config.json and checkpoints keep
    if args.template_date:
        log(f"chat template: writes the date; rendered as {day} (--template-date; a resume keeps it)")
        if given is None and getattr(args, "resume", None):
            log(f"note: the checkpoint records no template date (a run from before --template-date): the data are "
                f"rendered with {day}; pass --template-date with the day the run started to keep its tokens")
    return train, ev or (None, None), rows   # (--eval-split's eval stats: None, its records are counted in --data's)


def _joined(what: str, files: list[str], parts: list, log) -> tuple[Samples, object]:
    """Several files' (Samples, TokenStats) as one, each file's stats said (`what: FILE: ...`) before their sum."""
    if 1 < len(parts) <= MANY_FILES:   # (more: their sum only; each file's warnings are said as it loads)
        for f, (_, st) in zip(files, parts):
            log(f"{what}: {f}: {st}")
    return join([p[0] for p in parts], files), total([p[1] for p in parts])


def also_in(these: Samples, those: Samples) -> int:
    """How many samples of `these` (the eval data) have the same input ids as one of `those` (compared only where
    the lengths match)."""
    key = lambda s, i: hashlib.sha256(s[i]["input_ids"].numpy().tobytes()).digest()
    maybe = torch.isin(those.lengths, these.lengths).nonzero().flatten().tolist()
    seen = {key(those, i) for i in maybe}   # (digests: all samples may be --max-len long, hence candidates)
    return sum(key(these, i) in seen for i in range(len(these)))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().data).hexdigest()


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


def same_on_every_rank(samples, eval_samples=None, digest: str | None = None) -> None:
    """Raise on every rank, naming the hosts, when the ranks do not hold the same tokens: machines that read
    different copies of --data (another file behind the same path, a local edit) or tokenize differently (another
    tokenizer file, transformers or tokenizers version) would each index their own sample list by the same order,
    training on a mixture nobody chose, or fail later on a step count they do not share."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = (socket.gethostname(), digest or fingerprint(samples), len(samples), fingerprint(eval_samples))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for what, k in (("--data", 1), ("--eval-data", 3)):
        if len({e[k] for e in every}) > 1:
            groups = {}
            for r, e in enumerate(every):
                groups.setdefault(e[k], []).append(f"rank {r} ({e[0]}{f', {e[2]} samples' if k == 1 else ''})")
            said = "; ".join(f"{', '.join(g)}: tokens {d[:12]}" for d, g in groups.items())
            raise DataError(f"the ranks hold different {what} tokens ({said}); every machine must read the same file "
                            "bytes with the same tokenizer files and transformers/tokenizers versions: copy them "
                            "alike or put them on a shared filesystem")


def once_per_machine(load, first: bool, day: str | None = None):
    """(`load(write, day)`'s result, day) on every rank, computed first by the ranks where `first` (each machine's
    first rank; every rank when there is no cache to share), then by the others (module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return load(True, day := day or today()), day
    day = [day or today()]
    dist.broadcast_object_list(day, src=0)   # every rank is here (else --timeout ends the job) before the long wait
    group = dist.new_group(backend="gloo", timeout=WAIT)   # every rank, in order
    try:
        out = None
        for turn in (True, False):   # the first ranks, then the others
            err = None
            if first == turn:
                try:
                    out = load(turn, day[0])
                except BaseException as e:   # noqa: BLE001 - said on every rank, then raised here too
                    err = e
            errs = [None] * dist.get_world_size()
            dist.all_gather_object(errs, _portable(err), group=group)
            if err is not None:
                raise err
            if (other := next((e for e in errs if e is not None), None)) is not None:
                raise other
        return out, day[0]
    finally:
        dist.destroy_process_group(group)


def _portable(err: BaseException | None) -> BaseException | None:
    """`err` as the other ranks can rebuild it (the same type and message), or a RuntimeError saying it."""
    try:
        return pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
