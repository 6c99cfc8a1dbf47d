"""Runs that go wrong stop loudly: non-finite steps never reach the weights, a stuck rank ends the job.
Stopping on a signal: parallel/signals.py.

Contract:
- `NonFiniteSteps(max_in_row).check(step, loss, grad_norm)` -> True: apply the update; False: skip
  it (the loss or the global grad norm is NaN/Inf), counted in `.skipped`. The `max_in_row`-th
  non-finite step in a row raises NonFiniteError naming the steps and values. Every rank must pass
  the same (all-reduced) loss and the global norm, so every rank decides the same. `.state()` goes into each
  checkpoint and `.restore(state)` takes it back on resume: the count and the streak go on across a restart.
- `pg_timeout(minutes)` is the process-group timeout: `--timeout` plus one minute, so that the
  watchdog below, armed with `--timeout`, speaks first and the process group's own error is the backstop.
- `Watchdog(timeout_s, rank)` is a daemon thread. The loop calls `.phase(name, step)` at each phase
  boundary (cheap: one tuple assignment). When no phase has begun for `timeout_s` seconds, the
  rank is waiting on a stuck or dead peer (a collective never completes): it prints which step and
  phase it waited in, dumps every thread's stack, and exits with EXIT_STUCK via `os._exit` (no
  clean-up can run while the main thread is blocked inside a collective), so torchrun ends the job.
  Arm it after the model is built; `.stop()` it before the final export, or use it as a context manager.
- `on_rank0(fn, what)`: rank 0's own work (config.json, metrics.jsonl, a checkpoint's renames) as a collective: a
  failure there is raised on every rank, not left for the others to wait on in their next collective.
- `say_error(e)`: train.py's start-up error line, once per machine when every rank raised it, and from the rank
  that alone raised it otherwise (prefixed with the rank).
"""

from __future__ import annotations

import datetime
import faulthandler
import math
import os
import sys
import threading
import time

DEFAULT_TIMEOUT_MIN = 30.0   # a long-context step plus a save can take minutes; a stuck one never ends
EXIT_STUCK = 3


class NonFiniteError(ValueError):
    """NaN or Inf where training needs finite numbers; the message names where and the fix."""


class NonFiniteSteps:
    """Skip-or-apply decision per step, and the limit on non-finite steps in a row."""

    def __init__(self, max_in_row: int = 3):
        if max_in_row < 1:
            raise ValueError(f"--max-nonfinite must be >= 1, got {max_in_row}")
        self.max_in_row, self.skipped, self.streak = max_in_row, 0, []

    def check(self, step: int, loss, grad_norm) -> bool:
        loss, grad_norm = float(loss), float(grad_norm)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = []
            return True
        self.skipped += 1
        self.streak.append((step, loss, grad_norm))
        if len(self.streak) >= self.max_in_row:
            seen = "; ".join(f"step {s}: loss {lo}, grad norm {g}" for s, lo, g in self.streak)
            raise NonFiniteError(f"{len(self.streak)} non-finite steps in a row ({seen}); the weights are those "
                                 f"from before step {self.streak[0][0]} (those updates were skipped). Lower --lr, "
                                 "check the data, or raise --max-nonfinite")
        return False

    def state(self) -> dict:
        """What a checkpoint keeps (meta.json), so that a resume goes on counting: the skipped steps and the streak."""
        return {"skipped": self.skipped, "streak": [[s, repr(lo), repr(g)] for s, lo, g in self.streak]}

    @classmethod
    def of_run(cls, args, ckpt: str | None) -> NonFiniteSteps:
        """--max-nonfinite's count; a resume goes on counting from its checkpoint's."""
        from parallel.checkpoint_folders import read_meta
        return cls(args.max_nonfinite).restore(ckpt and read_meta(ckpt).get("nonfinite"))

    def restore(self, state: dict | None) -> NonFiniteSteps:
        if state:   # (a checkpoint from before this was kept: none)
            self.skipped = int(state["skipped"])
            self.streak = [(int(s), float(lo), float(g)) for s, lo, g in state["streak"]]
        return self


def pg_timeout(minutes: float) -> datetime.timedelta:
    """The process-group timeout for `--timeout minutes`: one minute longer than the watchdog's."""
    if not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"--timeout must be a positive number of minutes, got {minutes}")
    return datetime.timedelta(minutes=minutes + 1)


class Watchdog:
    """Ends this process when no phase boundary is crossed for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, rank: int):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"--timeout must be a positive number of minutes, got {timeout_s / 60}")
        self.timeout_s, self.rank = timeout_s, rank
        self._state = (None, "start", time.monotonic())   # (step, phase, when it began): replaced whole
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def phase(self, name: str, step: int | None = None) -> None:
        self._state = (step, name, time.monotonic())

    def start(self) -> Watchdog:
        self.phase("start")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _watch(self) -> None:
        poll = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            step, name, since = self._state
            idle = time.monotonic() - since
            if idle > self.timeout_s:
                where = f'step {step}, phase "{name}"' if step is not None else f'phase "{name}"'
                sys.stderr.write(f"rank {self.rank}: no progress for {idle:.0f}s in {where}; a rank is stuck "
                                 f"or dead (limit: --timeout {self.timeout_s / 60:g} min) — ending the job\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(EXIT_STUCK)


def on_rank0(fn, what: str, group=None):
    """`fn()` on rank 0 of `group` (the default group: rank 0) and its result there (None elsewhere); collective. If
    it raises, every rank raises: rank 0 its own error, the others a ValueError (OSError: RuntimeError) quoting it, so
    no rank goes on into a collective that rank 0 never reaches, where on NCCL they would wait for the launcher."""
    import torch.distributed as dist

    many = dist.is_initialized() and dist.get_world_size(group) > 1
    me = dist.get_rank(group) if dist.is_initialized() else 0
    out, err = None, None
    if me == 0:
        try:
            out = fn()
        except Exception as e:   # noqa: BLE001 - said on every rank, raised as it is here
            err = e
    if many:
        box = [None if err is None else (isinstance(err, (ValueError, FileNotFoundError)), f"{type(err).__name__}: "
                                         f"{err}")]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if me != 0 and box[0] is not None:
            raise (ValueError if box[0][0] else RuntimeError)(f"{what} failed on rank 0 ({box[0][1]})")
    if err is not None:
        err.during = what   # (rank 0's own error: train.cli says what it was doing, as the others' message does)
        raise err
    return out


DISK_ERRORS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied",
               "Operation not permitted")


def disk_error(e: BaseException) -> bool:
    """A write the disk refused (full, over quota, read-only, a folder made unwritable mid-run): an OSError of that
    errno, or an error that quotes one (on_rank0's RuntimeError on the other ranks, a save's OSError naming its rank,
    safetensors' own error)."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        return True
    quoted = isinstance(e, OSError) or any(f" failed on rank 0 ({k}: " in str(e) for k in ("OSError",
                                                                                          "PermissionError"))
    return quoted and any(s in str(e) for s in DISK_ERRORS)   # (not any RuntimeError: NCCL's own about a small
    # /dev/shm keeps its traceback)


def say_error(e: BaseException | str, wait_s: float = 1.0) -> None:
    """train.py's start-up and data error on stderr, as `error: ...`: always on each machine's first rank (prefixed
    with the rank but on rank 0); on another rank unless its machine's first rank said the same words within the last
    minute. So an error every rank raised (most are) reads once per machine, and one only some rank hit (a file
    missing on one node) is not lost. A machine's ranks meet at a marker file named by their launcher's pid and the
    message; the others wait `wait_s` for it."""
    import hashlib
    import tempfile

    rank, text = os.environ.get("RANK", "0"), f"error: {e}"
    first = os.environ.get("LOCAL_RANK", rank) == "0"
    folder = os.path.join(tempfile.gettempdir(), "long-context-lora-errors")
    mark = os.path.join(folder, f"{os.getppid()}-{hashlib.sha256(text.encode()).hexdigest()[:16]}")
    try:
        os.makedirs(folder, exist_ok=True)
        if first:
            open(mark, "w").close()   # (a marker older than a minute is another job's)
        else:
            time.sleep(wait_s)
            if os.path.isfile(mark) and time.time() - os.path.getmtime(mark) < 60:
                return
    except OSError:
        pass   # no marker: say it (twice rather than never)
    print(text if rank == "0" else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
