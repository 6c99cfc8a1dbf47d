"""What a run owns on disk: its output directory and its lock (what resume keeps: resume.py; its metrics: metrics.py;
which directory it may write into: outdir.py).

Contract:
1. `check_free(out, resume)` on every rank, early: an OUT whose run.lock a live run holds is refused.
2. `claim(out, resume=, overwrite=)` runs on every rank after the process group, before any weight
   is read. Rank 0 alone touches the disk: it creates the directory (`runs/<YYYYmmdd-HHMMSS>`, with a
   `-2`, `-3`.. suffix when that second is taken: `mkdir` is atomic, so two runs never share one),
   takes an exclusive `flock` on `OUT/run.lock` for the run's life (the kernel drops it when the
   process dies, so a stale lock file never blocks), and only then, for `--overwrite`, lists what it will delete:
   exactly `OWNED` (nothing else, nothing outside OUT), deleted by `open_files` once the model is built, so a start
   that fails or is stopped before (a weight file, Ctrl-C) leaves the old run. Under the lock, --resume must resolve
   to the step it resolved to at start-up (a run live then may have saved since: resuming the older step would drop
   newer ones).
   One broadcast hands every rank the same path, or the same error to raise, so no rank is left waiting in a
   collective. A refusal changes nothing.
3. `auto_resume(out, overwrite)`: what `--resume auto` does with --out (continue, start, start again).
4. `open_files(run, ...)`: rank 0's writes before the first step (--overwrite's deletion, config.json:
   parallel/run_config.py, metrics.jsonl); `close_files(run, ...)`: its last ones, then OUT's lock let go.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import shutil
import socket
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from parallel.outdir import LOCK, MARKERS, OWNED, _entries, check_out, run_of
from parallel.run_config import write_config


def fresh_dir(root: str = "runs", now: float | None = None) -> str:
    """Create `root/<YYYYmmdd-HHMMSS>` (or `-2`, `-3`.. if taken) and return it. Rank 0 only."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    os.makedirs(root, exist_ok=True)
    for n in range(1, 10_000):
        path = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)   # atomic: exactly one of two racing runs gets each name
            return path
        except FileExistsError:
            continue
    raise ValueError(f"{root!r}: 10000 runs started in {stamp}; pass --out")


def _lock(out: str) -> int:
    """Take OUT/run.lock for this process's life; refuse, changing nothing, if a live run holds it."""
    path = os.path.join(out, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)   # no O_TRUNC: the holder's note stays intact
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
        os.close(fd)
        raise ValueError(f"--out {out!r} is in use by a live run ({holder}); wait for it to end, "
                         "or pass another --out") from None
    return fd


def _note(fd: int) -> None:
    """Say who holds the lock, once the claim is accepted: a refused one leaves the last holder's note as it was."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              .encode(), 0)


def check_free(out: str | None, resume: str | None = None) -> None:
    """Refuse, early and changing nothing, an OUT whose run.lock a live run holds (every rank may call it: a shared
    lock, let go at once; rank 0 takes it for good in claim()). Before it, a --resume of a run still saving read a
    step folder that run then rotated away: "No such file ... meta.json", or ranks seeming to see other files."""
    path = os.path.join(out, LOCK) if out else None
    if not path or not os.path.isfile(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return   # (unreadable: claim() says what is wrong)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
        if resume:   # (into another --out: the step it resolved was rotated away after the data were read)
            raise ValueError(f"--resume {resume!r}: its run {out!r} is live ({holder}) and still saves, removing older "
                             "steps as it goes; wait for it to end (or copy a step folder elsewhere and --resume "
                             "that)") from None
        raise ValueError(f"--out {out!r} is in use by a live run ({holder}); wait for it to end, or pass another "
                         "--out") from None
    except OSError:
        pass   # (a filesystem without flock: claim() says so)
    finally:
        os.close(fd)


def _same_auto(out: str, auto: str) -> None:
    if (now := _auto(out)[2]) != auto:
        raise ValueError(f"--resume auto found {out!r} {AUTO_SAID[auto]} at start-up, and now {AUTO_SAID[now]}: "
                         "another instance of this job wrote there meanwhile. Run the same command again")


AUTO_SAID = {"resumed": "holding a whole step", "fresh": "absent or empty",
             "restarted": "holding a run that saved no whole step"}


def auto_resume(out: str | None, overwrite: bool) -> tuple[str | None, bool, str]:
    """`--resume auto` (one command for every requeue of a preemptible job): (resume, overwrite, what) for --out:
    its ckpt when it holds a whole step ("resumed"); nothing, when --out is absent or empty ("fresh"); its run
    started again, as --overwrite would, when it saved no whole step yet (a job killed before its first save:
    "restarted"; check_out then refuses a folder that is not train.py's). Every rank decides alike."""
    if overwrite:
        raise ValueError("--resume auto chooses between continuing --out's run and starting it: drop --overwrite")
    if not out:
        raise ValueError("--resume auto continues the run in --out when it saved a step, else starts it there: pass "
                         "--out DIR (the same on every requeue)")
    check_free(out)   # a live run's folder (a job requeued while its last instance still runs): said as such
    return _auto(out)


def _auto(out: str) -> tuple[str | None, bool, str]:
    from parallel.checkpoint_folders import has_step
    if has_step(os.path.join(out, "ckpt")):
        return os.path.join(out, "ckpt"), False, "resumed"
    used = _entries(os.path.realpath(out))
    if done := [e for e in ("adapter", "adapter_best") if e in used]:   # a finished run whose steps are gone: its
        # adapter is kept, never taken for a killed start's
        raise ValueError(f"--resume auto: --out {out!r} holds a run's {' and '.join(done)} but no whole checkpoint "
                         "to continue from, and starting it again would delete them: pass a new --out (or, in "
                         "place of --resume auto, --overwrite to replace that run)")
    if used and any(e in MARKERS for e in used):
        return None, True, "restarted"
    return None, False, "fresh"   # (files of someone else's: check_out refuses the folder)


@dataclass
class RunDir:
    """The claimed output directory. Rank 0 holds the lock until `release()` (or the process ends)."""
    path: str
    pending: tuple[str, ...] = ()   # what --overwrite deletes in `clear` (rank 0's names; the others' say only that)
    _fd: int | None = field(default=None, repr=False)

    @property
    def ours(self) -> str | None:
        """The folder, once it holds this run's files alone: None while --overwrite's deletion waits (its checkpoints
        are the old run's, so a failure's way on is the same command, not a --resume of them)."""
        return None if self.pending else self.path

    def clear(self) -> None:
        """--overwrite's deletion (rank 0, under the lock; the others forget it), config.json, metrics and ckpt last:
        a kill mid-way leaves a folder --overwrite takes again (until 2026-12-04 adapters were left, as no run's)."""
        from parallel.guard import disk_error

        for name in self.pending if self._fd is not None else ():
            p = os.path.join(self.path, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                elif os.path.lexists(p):
                    os.remove(p)   # a symlink is removed, never followed out of OUT
            except OSError as e:   # (a disk error is said as one, with the way on: notes.exit_code)
                if disk_error(e):
                    raise
                raise ValueError(f"--overwrite could not delete {p!r} ({type(e).__name__}: {e}); the old run there is "
                                 "partly deleted (its config.json, metrics.jsonl and ckpt go last, so --overwrite "
                                 "takes it again): free that path (a process holding files open in it, a mount), then "
                                 "run the same command again") from e
        self.pending = ()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing drops the flock; the file stays, harmlessly
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _claim_here(out, resume, overwrite, root, resolved, auto=None) -> RunDir:
    check_free(out)   # a run live there since start-up is said as such, not as a used --out to --resume or
    # --overwrite (the same command started twice at once; with --resume auto, another instance of the job: helper 57)
    try:
        check_out(out, resume=resume, overwrite=overwrite, root=root)
    except ValueError:
        if auto:   # (written there since start-up: said as that, not with check_out's --overwrite advice)
            _same_auto(out, auto)
        raise
    if out is None:
        out = (run_of(resume) if resume else None) or fresh_dir(root)
    os.makedirs(out, exist_ok=True)
    fd = _lock(out)
    if auto:
        try:
            _same_auto(out, auto)   # under the lock: nothing changes it from here
        except ValueError:
            os.close(fd)
            raise
    if resume and resolved:   # the step resolved at start-up, before this lock: a run live then may have saved since
        from parallel.checkpoint_folders import problem, resolve
        from parallel.resume import own_checkpoint

        if not own_checkpoint(resolved, out):   # another run's step, into this --out: its newer steps are not dropped,
            now = resolved if problem(resolved) is None else ValueError("gone: the run writing there removed it")
        else:
            try:
                now = resolve(resume, warn=lambda m: None)
            except (ValueError, FileNotFoundError) as e:
                now = e
        if isinstance(now, Exception) or os.path.realpath(now) != os.path.realpath(resolved):
            os.close(fd)
            raise ValueError(f"--resume {resume!r} resolved to {os.path.basename(resolved)} at start-up, but "
                             + (f"now to {os.path.basename(now)}" if isinstance(now, str) else f"now: {now}")
                             + ": a run that was still writing there saved since. Start this run again"
                             + (" once it has ended (resuming the older step would drop the newer steps)"
                                if isinstance(now, str) else "")) from None
    _note(fd)
    pending = ()
    if overwrite:   # listed under the lock (never a live run's), deleted by clear() once the model is built
        there, last = sorted(os.listdir(out)), ("ckpt", "metrics.jsonl", "config.json")   # the MARKERS last (clear)
        order = [pat for pat in OWNED[:-1] if pat not in last] + list(last)
        pending = tuple(dict.fromkeys(e for pat in order for e in fnmatch.filter(there, pat)))
    return RunDir(out, pending, fd)


def claim(out: str | None, *, resume: str | None = None, overwrite: bool = False, root: str = "runs",
          group=None, resolved: str | None = None, auto: str | None = None) -> RunDir:
    """Rank 0 creates, locks and (with --overwrite) empties the run directory; all ranks get its path. `resolved`: the
    step folder --resume resolved to at start-up, which must still be the one it resolves to under the lock; `auto`:
    what --resume auto decided then (`auto_resume`), which must still be what it decides under the lock.

    Collective over `group` when a process group is up: call it on every rank, before any weight."""
    me = dist.get_rank(group) if dist.is_initialized() else 0
    run, err, box = None, None, [None]
    if me == 0:
        try:
            run = _claim_here(out, resume, overwrite, root, resolved, auto)
        except (ValueError, FileNotFoundError) as e:
            err = e
        except OSError as e:   # permissions, a full disk: still a start-up error that names the flag
            err = ValueError(f"--out {out!r}: {type(e).__name__}: {e}")
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            if err is not None:
                raise err
            return run
        box = [("FileNotFoundError" if isinstance(err, FileNotFoundError) else "ValueError", str(err))
               if err else ("ok", run.path, run.pending)]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    kind, text, *pending = box[0]
    if err is not None:
        raise err
    if kind != "ok":   # the same error rank 0 raises, so every rank stops at the same place
        raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(text)
    return run if me == 0 else RunDir(text, *pending)


def open_files(run: RunDir, args, layout, stats, eval_samples, *, branch: str | None, resume_step: int | None,
               log=print):
    """Rank 0's writes before the first step (guard.on_rank0: a failure, a full disk, stops every rank, naming them):
    --overwrite's deletion of the old run (`run.clear`), then as one: a resume from this run's own checkpoint below
    its newest makes that the newest (`branch`: checkpoint.branch, so a crash comes back there), config.json
    (parallel/run_config.py), then metrics.jsonl and --report-to's sinks opened (parallel/metrics.py). Returns (the
    Metrics on rank 0, None elsewhere; the logs' names, for later errors)."""
    from parallel import checkpoint, guard
    from parallel.metrics import Metrics

    def files():
        if branch:
            checkpoint.branch(branch, log)
        write_config(args, layout, stats, eval_samples)
        return Metrics(args.out, args.report_to, resume_step=resume_step)
    logs = ", ".join(["metrics.jsonl", *(args.report_to or ())])
    if run.pending:   # (every rank knows it: claim's broadcast)
        guard.on_rank0(run.clear, f"--overwrite deleting the old run's files in {run.path}")
    opened = guard.on_rank0(files, f"writing config.json and opening {logs}")
    run.pending = ()   # (the other ranks': rank 0 deleted them)
    return opened, logs


def close_files(run: RunDir, args, metrics, best, ckpt_dir: str, log=print) -> None:
    """Rank 0's last writes, as one (guard.on_rank0, as `open_files`), then OUT's lock let go before any rank returns
    (a next run in this job takes OUT at once): --keep-best's adapter_best from its checkpoint in `ckpt_dir`, the
    metrics and sinks closed, --push-to-hub's upload. Collective: every rank calls it after the adapter's export."""
    from parallel import guard, hub_push, keep_best

    def finish():
        if args.keep_best and best.step:
            keep_best.export_best(ckpt_dir, best, os.path.join(args.out, "adapter_best"), log)
        metrics.close()   # its sinks' last writes too (W&B's finish, run.json), while OUT is still this run's
        hub_push.push(args, best, log)   # --push-to-hub: the run's adapter (adapter_best's, if exported), on disk
        run.release()
    guard.on_rank0(finish, f"finishing {args.out}")
