"""Runs that go wrong stop loudly: non-finite steps never reach the weights, a stuck rank ends the job.

Contract:
- `NonFiniteSteps(max_in_row).check(step, loss, grad_norm)` -> True: apply the update; False: skip
  it (the loss or the global grad norm is NaN/Inf), counted in `.skipped`. The `max_in_row`-th
  non-finite step in a row raises NonFiniteError naming the steps and values. Every rank must pass
  the same (all-reduced) loss and the global norm, so every rank decides the same.
- `pg_timeout(minutes)` is the process-group timeout: `--timeout` plus one minute, so that the
  watchdog below, armed with `--timeout`, speaks first and the process group's own error is the backstop.
- `Watchdog(timeout_s, rank)` is a daemon thread. The loop calls `.phase(name, step)` at each phase
  boundary (cheap: one tuple assignment). When no phase has begun for `timeout_s` seconds, the
  rank is waiting on a stuck or dead peer (a collective never completes): it prints which step and
  phase it waited in, dumps every thread's stack, and exits with EXIT_STUCK via `os._exit` (no
  clean-up can run while the main thread is blocked inside a collective), so torchrun ends the job.
  Arm it after the model is built; `.stop()` it before the final export, or use it as a context manager.
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
