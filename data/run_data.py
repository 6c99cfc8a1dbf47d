"""train.py's data: --data and --eval-data tokenized once per machine, and the same tokens on every rank.

Contract:
- `load_run_data(args, tokenizer, vocab_size, log)`: train.py's --data and --eval-data, each (Samples, TokenStats)
  (--eval-data's (None, None) without one), and the --data-weights shares' `Rotation` (data/mix.py; None when every
  epoch trains the same samples, the first Samples), through `once_per_machine`,
  rendered on `args.template_date` (rank 0's today when None: a resume passes its run's); when the template writes
  the date, it sets that to the day used, which the run's config and checkpoints keep, and says it (else None). A
  cache that cannot be read or written is said by rank 0, and on every other machine by its first rank (naming the
  host). It logs --data's stats (`data: ...`), --eval-split's records held out of them (`eval split: ...`; a warning
  for a --data file it held out whole, whose weight then trains nothing), and
  the --eval-data stats (`eval data: ...`) and a note when eval samples are also training samples
  (`also_in`: the same input ids), and every rank must end with the same tokens
  (`same_on_every_rank`, data/samples.py's sha256 `fingerprint` of ids, labels and boundaries): machines that read
  different bytes behind one path, or tokenize them differently, stop with one error naming the ranks and hosts. It sets
  `args.data_tokens` ("N samples, T tokens, sha256 <fingerprint>": the mixture's, or with rotating shares the whole
  set's, each sample once), which checkpoints keep: a resume must train on
  the same tokens, not only on the same file bytes (parallel/resume.py's `same_tokens`).
- `once_per_machine(load, first, day)`: with several ranks, each machine's first rank runs `load(True, day)`
  (tokenize, write the cache) while the others wait, then the others run `load(False, day)`: they read that file
  back memory-mapped, so a machine holds one copy of the tokens, not one per rank, and tokenizes once (they tokenize
  themselves only when it could not be written). `day` is rank 0's (data/store.py's `today()` if None), one for every
  rank, so a dated template renders the same date, under the same key, on every machine even when midnight passes
  while they wait. Returns (`load`'s result, day). An error on any rank is raised on
  every rank. The day goes out on the default group, under --timeout's limit: a rank that failed before this call
  stops the others there. The waits are collectives of a gloo group of their own whose timeout, `WAIT`
  (data/store.py), is not --timeout's: a large file may take longer than that to tokenize.
"""

from __future__ import annotations

import os
import pickle
import socket

from data import store  # (store.today() looked up when called: one clock for the key, the rendering and the day)
from data.formats import unit
from data.jsonl import DataError
from data.mix import FILE_SHIFT, data_files, join, mix, record_name, total, weight_text
from data.samples import Samples, also_in, fingerprint, hold_out, split_arg
from data.store import WAIT, data_workers
from data.templates import dated

MANY_FILES = 8   # more --data files than this (a data set in shards): one `data:` line for all, not one each


def load_run_data(args, tokenizer, vocab_size: int, log):
    """train.py's data: ((samples, stats) of --data, (samples, stats) of --eval-data or (None, None)), every rank's
    the same, tokenized once per machine when there is a --data-cache (once_per_machine)."""
    import torch.distributed as dist

    from data.load import load_samples

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
        words = {unit(f) for f in files}   # line, record or row (data/formats.py)
        word = words.pop() if len(words) == 1 else "record"
        log(f"eval split: {len(lines)} record{'s' * (len(lines) > 1)} of --data held out (--eval-split "
            f"{split_arg(split)}, --seed {args.seed}; {word}{'s' * (len(lines) > 1)} {shown}), never trained on: "
            f"{len(held)} samples, {int(held.lengths.sum())} tokens; training on {len(kept)} samples")
        train, ev = (kept, train[1]), (held, None)
        left = set((kept.sample_lines() >> FILE_SHIFT).tolist())   # the files with a record to train
        ws = getattr(args, "data_weights", None)   # (a file held out whole: its weight trains nothing, and the mix
        for k, f in enumerate(files if len(files) > 1 else ()):   # line's "0 samples of its 0" is easy to miss)
            if k not in left:
                w = f"--data-weights {weight_text(ws[k])}" if ws else "1, no --data-weights"
                log(f"warning: --eval-split {split_arg(split)} held out every record of --data {f}, so its weight "
                    f"({w}) trains nothing: pass a smaller --eval-split, or give the eval set as --eval-data FILE")
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
        return load(True, day := day or store.today()), day
    day = [day or store.today()]
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
