"""Stopping on signals with the finished steps saved, every rank at the same boundary (train.py's `stop`).

Contract:
- `StopSignals(rank, log, timeout)`: SIGTERM (schedulers, torchrun, Kubernetes), SIGINT (Ctrl-C) and SIGUSR1
  (e.g. SLURM's `--signal=USR1@600`) ask the run to stop with its finished steps saved. Made right after the process
  group (NCCL runs: it makes a gloo group of all ranks then, before any weight, so a gloo network problem shows
  early). `.start()` installs the handlers (main thread only); `.requested()` is a collective that every rank calls
  at the same points (train.py: before each micro-batch) and that returns the same signal number (0: none) on every
  rank, so all ranks stop at one boundary: the step in flight is dropped (its update never happened; it reruns on
  resume, the data order being a function of the step). `.stopped(signum, step, where)` is the `Stopped` exception
  to raise (exit status 128 + the signal). A second signal a second or more after the first quits at once, as if
  no handler were there (Ctrl-C twice); for a rank blocked in C (a collective whose peer is gone), where no Python
  handler can run, a thread woken through `signal.set_wakeup_fd` ends the process with 128 + the signal.
  `.close()` restores the previous handlers and destroys the gloo group it made.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Stopped(Exception):
    """The run stopped on a signal, its finished steps saved; `code` is the exit status (128 + the signal)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.code = signum, 128 + signum


class StopSignals:
    """Stop requests from signals, acted on by every rank together at the boundaries that call `requested()`."""

    def __init__(self, rank: int = 0, log=print, timeout: datetime.timedelta | None = None, signals=STOP_SIGNALS):
        import torch.distributed as dist
        self.rank, self.log, self.signals = rank, log, tuple(signals)
        self.group, self._own = None, False
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self.group, self._own = dist.new_group(backend="gloo", timeout=timeout), True   # every rank, in order
        self.got, self.first, self._saved, self._pipe, self._thread, self.acted = 0, None, None, None, None, False

    def start(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():   # handlers are the main thread's alone
            return self
        self._saved = {s: signal.signal(s, self._handle) for s in self.signals}
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
        self._thread = threading.Thread(target=self._watch, args=(r,), name="stop-signals", daemon=True)
        self._thread.start()
        return self

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.got and now - self.first >= 1.0:   # asked twice: quit now, as without this handler
            self.acted = True
            self.close()
            signal.raise_signal(signum)
            return
        if not self.got:
            self.got, self.first = signum, now
            if self.rank == 0:
                self.log(f"{signal.Signals(signum).name}: stopping before the next micro-batch, the finished steps "
                         "saved (send it again a second later to quit at once)")

    def _watch(self, r: int) -> None:
        """Woken by the C-level handler even while the main thread is blocked in C: a second signal a second or more
        after the first ends the process when the main thread's own handler has not (it would have closed us)."""
        first = None
        while True:
            b = os.read(r, 1)
            if not b:   # closed
                return
            if b[0] not in self.signals:
                continue
            if first is None:
                first = time.monotonic()
            elif time.monotonic() - first >= 1.0:
                time.sleep(0.5)   # the main thread's handler, if it can run, quits more cleanly (and closes us)
                if self._pipe is None:
                    return
                sys.stderr.write(f"rank {self.rank}: {signal.Signals(b[0]).name} again while blocked (a collective "
                                 "whose peer is gone?): ending now\n")
                sys.stderr.flush()
                os._exit(128 + b[0])

    def requested(self) -> int:
        """The signal number any rank got (0: none), the same on every rank: call it on every rank together."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([self.got], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def stopped(self, signum: int, step: int, where: str | None, afresh: str = "run again with --overwrite",
                auto: bool = False) -> Stopped:
        name = signal.Signals(signum).name
        saved = (f"steps 1..{step} are saved" if step > 1 else "step 1 is saved") + f" in {where}" if where else \
            f"no step had finished: nothing to save; {afresh}"
        msg = f"stopped on {name} before step {step + 1}'s update: {saved}"
        self.acted = True
        if self.rank == 0:
            self.log(msg + ((" — continue with the same command" + ("" if auto else " plus --resume " + where))
                            if where else ""))
        return Stopped(msg, signum)

    def close(self) -> None:
        if self.got and not self.acted and self._saved is not None and self.rank == 0:
            self.log(f"{signal.Signals(self.got).name} came after the last stop check and was not acted on")
        if self._saved is not None:
            for s, h in self._saved.items():
                signal.signal(s, h)
            self._saved = None
        if self._pipe is not None:
            r, w, old = self._pipe
            self._pipe = None
            signal.set_wakeup_fd(old)
            os.close(w)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=1.0)
            os.close(r)
        if self._own:
            import torch.distributed as dist
            self._own = False
            if dist.is_initialized():
                dist.destroy_process_group(self.group)
