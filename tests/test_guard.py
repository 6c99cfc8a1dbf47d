"""parallel/guard.py: a non-finite step never reaches the weights, and a stuck rank ends the job.

Pins:
- NonFiniteSteps applies finite steps, skips and counts NaN/Inf ones, and raises on the N-th in a row,
  naming the steps, the values and the flag to change; a finite step resets the streak;
- pg_timeout refuses NaN/0/negative `--timeout` and stays longer than the watchdog's limit;
- on 2 gloo ranks, with the watchdog at 1.5 s: collectives that keep making progress for longer than
  that do not trip it; when rank 0 stops taking part (it sleeps, as a SIGSTOPped or dead rank would),
  rank 1 ends itself within seconds with EXIT_STUCK and a message naming the rank, step and phase it
  waited in, long before the 60 s process-group timeout; the test itself is bounded by pytest-timeout;
- StopSignals: a signal on one of 2 gloo ranks is seen by both at the same `requested()` call, the handlers
  before it are back after close(); a second signal a second later quits as if no handler were there, one
  within the second does not; a rank blocked in a collective (its peer asleep) stays up after one SIGTERM (a
  long phase is no reason to die) and ends itself with 128 + 15 on a second one 1.5 s later, seconds before the
  peer wakes.

Run: .venv/bin/python -m pytest -q tests/test_guard.py
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time

import pytest
import torch.distributed as dist

from parallel.guard import EXIT_STUCK, NonFiniteError, NonFiniteSteps, Watchdog, pg_timeout
from parallel.signals import StopSignals
from tests.dist import RankError, run_ranks


def test_nonfinite_steps_skip_count_and_stop():
    g = NonFiniteSteps(max_in_row=3)
    nan, inf = float("nan"), float("inf")
    got = [g.check(s, lo, gn) for s, lo, gn in ((1, 2.0, 1.0), (2, nan, 1.0), (3, 1.9, inf), (4, 1.8, 0.9),
                                                 (5, nan, nan), (6, 1.0, inf))]
    assert got == [True, False, False, True, False, False], got
    assert g.skipped == 4, g.skipped
    with pytest.raises(NonFiniteError) as e:
        g.check(7, -inf, 1.0)
    msg = str(e.value)
    for phrase in ("3 non-finite steps in a row", "step 5: loss nan", "step 6: loss 1.0, grad norm inf",
                   "step 7: loss -inf", "before step 5", "--lr", "--max-nonfinite"):
        assert phrase in msg, f"{phrase!r} not in {msg!r}"
    assert isinstance(e.value, ValueError), "train.py reports ValueError as `error: ...`, exit 2"
    with pytest.raises(ValueError, match="--max-nonfinite must be >= 1, got 0"):
        NonFiniteSteps(0)


def test_pg_timeout():
    assert pg_timeout(30).total_seconds() > 30 * 60, "the watchdog (--timeout) must speak before the PG timeout"
    for bad in (float("nan"), 0, -1, math.inf):
        with pytest.raises(ValueError, match="--timeout must be a positive number of minutes"):
            pg_timeout(bad)


def _stderr_to_file(tmp):
    """Everything this rank prints to stderr lands in tmp/rank1.err, which the test reads."""
    os.dup2(os.open(os.path.join(tmp, "rank1.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)


def _enter_a_collective_nobody_joins(tmp):
    """Note the time in tmp/rank1.t, then wait in a barrier the other rank never enters."""
    with open(os.path.join(tmp, "rank1.t"), "w") as f:
        f.write(repr(time.time()))
    dist.barrier()
    return "rank 1 got past a collective rank 0 never entered"


def _stuck(rank, world_size, tmp):
    if rank == 1:
        _stderr_to_file(tmp)
        wd = Watchdog(1.5, rank).start()
    for i in range(4):   # 4 × 0.6 s of steady progress: longer than 1.5 s, but never 1.5 s without a phase
        if rank == 1:
            wd.phase("forward", i)
        dist.barrier()
        time.sleep(0.6)
    if rank == 0:
        time.sleep(6)    # rank 0 stops taking part in collectives
        return "rank 0 slept"
    wd.phase("backward", 3)
    return _enter_a_collective_nobody_joins(tmp)


@pytest.mark.timeout(90)
def test_stuck_rank_ends_the_job(tmp_path):
    with pytest.raises(RankError) as e:
        run_ranks(_stuck, 2, str(tmp_path), timeout=60, pg_timeout=60)
    assert f"rank 1 exited with code {EXIT_STUCK}" in str(e.value), str(e.value)
    err = (tmp_path / "rank1.err").read_text()
    line = err.splitlines()[0]
    assert re.fullmatch(r'rank 1: no progress for \d+s in step 3, phase "backward"; a rank is stuck or dead '
                        r"\(limit: --timeout 0.025 min\) — ending the job", line), line
    assert "forward" not in err, f"the watchdog tripped while collectives made progress: {err!r}"
    assert "in barrier" in err or "Thread" in err, "no stack dump after the message"
    waited = os.path.getmtime(tmp_path / "rank1.err") - float((tmp_path / "rank1.t").read_text())
    assert waited < 1.5 + 6, f"rank 1 ended {waited:.1f}s after entering the stuck collective"


def _rank0_work(rank, world_size):
    """guard.on_rank0 on 2 ranks: a result on rank 0 (None on rank 1), then rank 0's disk-full error, then its
    configuration error, each as it is raised on every rank; then a collective both still reach (nobody hangs)."""
    from parallel.guard import on_rank0

    got = [on_rank0(lambda: "written", "writing")]
    for err in (OSError(28, "No space left on device"), ValueError("--out is read-only")):
        def fail(err=err):
            raise err
        try:
            on_rank0(fail, "saving checkpoint step 3")
        except Exception as e:   # noqa: BLE001 - what each rank raised is the result
            got.append((type(e).__name__, str(e)))
    dist.barrier()
    return got


def test_rank0_work_failing_is_raised_on_every_rank():
    r0, r1 = run_ranks(_rank0_work, 2, timeout=60)
    assert r0 == ["written", ("OSError", "[Errno 28] No space left on device"), ("ValueError", "--out is read-only")]
    assert r1 == [None, ("RuntimeError", "saving checkpoint step 3 failed on rank 0 (OSError: [Errno 28] No space "
                                         "left on device)"),
                  ("ValueError", "saving checkpoint step 3 failed on rank 0 (ValueError: --out is read-only)")], r1


def _resume_on(rank, world_size):
    from parallel.preflight import same_resume

    same_resume("/runs/x/ckpt/step_000004")   # alike: nothing said
    try:
        same_resume(f"/runs/x/ckpt/step_00000{2 + 2 * rank}")   # rank 1's node still sees an older step
    except ValueError as e:
        return str(e)


def test_every_rank_resumes_the_same_step():
    """preflight.same_resume: ranks that resolved --resume to different step folders all stop with one error naming
    them (else their collectives would pair up across different steps)."""
    import socket

    got = run_ranks(_resume_on, 2, timeout=60)
    host = socket.gethostname()
    assert got[0] == got[1] and got[0].startswith(f"--resume: the ranks resolved different checkpoints (rank 0 "
                                                  f"({host}): step_000002; rank 1 ({host}): step_000004)"), got


def _agree(rank, world_size):
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals(rank, log=lambda *a: None).start()
    seen = []
    for i in range(5):
        if rank == 1 and i == 2:
            signal.raise_signal(signal.SIGUSR1)   # to this thread: its handler runs before the next call
        seen.append(stop.requested())
    stop.close()
    return seen, signal.getsignal(signal.SIGUSR1) == before


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_boundary():
    got = run_ranks(_agree, 2, timeout=60)
    want = [0, 0, signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR1]
    assert [g[0] for g in got] == [want, want], got
    assert all(g[1] for g in got), "close() did not put the earlier SIGUSR1 handler back"


def test_a_second_signal_a_second_later_quits_at_once():
    # Python's own SIGINT handler to begin with: a shell's background job inherits SIGINT ignored, and then the
    # quit "as if never installed" would ignore it too
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    before, said = signal.getsignal(signal.SIGINT), []
    stop = StopSignals(log=said.append).start()
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)   # within the second (e.g. delivered twice): still a graceful stop
        assert stop.requested() == signal.SIGINT
        time.sleep(1.05)
        with pytest.raises(KeyboardInterrupt):   # Python's own SIGINT behaviour, as if never installed
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before, "the handlers were not restored before quitting"
    finally:
        stop.close()
        restored = signal.signal(signal.SIGINT, outer)
    assert restored is before
    assert len(said) == 1 and said[0].startswith("SIGINT: stopping before the next micro-batch"), said
    late = StopSignals(log=said.append).start()   # a signal no check saw: said at close, not swallowed
    signal.raise_signal(signal.SIGUSR1)
    late.close()
    assert said[-1] == "SIGUSR1 came after the last stop check and was not acted on", said


def _blocked(rank, world_size, tmp):
    if rank == 1:
        _stderr_to_file(tmp)
        StopSignals(rank, log=lambda *a: None).start()
    dist.barrier()
    if rank == 0:
        time.sleep(7)    # rank 0 stops taking part in collectives, as a dead or stopped peer would
        return "rank 0 slept"
    for delay in (0.3, 1.8):   # torchrun's SIGTERM, then the user's second one (after the barrier is entered)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return _enter_a_collective_nobody_joins(tmp)   # blocked: no Python handler can run in there


@pytest.mark.timeout(90)
def test_a_rank_blocked_in_a_collective_quits_on_a_second_signal(tmp_path):
    with pytest.raises(RankError) as e:
        run_ranks(_blocked, 2, str(tmp_path), timeout=60, pg_timeout=60)
    assert f"rank 1 exited with code {128 + signal.SIGTERM}" in str(e.value), str(e.value)
    line = (tmp_path / "rank1.err").read_text().splitlines()[0]
    assert line == "rank 1: SIGTERM again while blocked (a collective whose peer is gone?): ending now", line
    waited = os.path.getmtime(tmp_path / "rank1.err") - float((tmp_path / "rank1.t").read_text())
    assert 1.8 <= waited < 1.8 + 0.5 + 4, f"rank 1 ended {waited:.1f}s after entering the collective (the second " \
        "signal came at 1.8 s; the peer woke at 7 s)"


def _abort_rank_1(rank, world_size):
    if rank == 1:
        os.abort()   # (a native crash: no Python exception, no report)
    return rank


def test_a_rank_that_dies_of_a_signal_shows_its_python_stack():
    """A rank killed by a native fault (gloo's heap abort once, `munmap_chunk(): invalid pointer`, 2026-12-05) is
    named with the Python stack it died in (faulthandler), not only its exit code."""
    from tests.dist import RankError, run_ranks

    with pytest.raises(RankError) as e:
        run_ranks(_abort_rank_1, 2, timeout=60, pg_timeout=5)
    said = str(e.value)
    assert "rank 1 exited with code -6 without a report; its Python stacks as it died:" in said, said
    assert "in _abort_rank_1" in said, said


def test_disk_errors_include_a_folder_made_unwritable():
    """A permission refused mid-run is said as a disk error (one line, the way on), on rank 0 (its own error) and on
    the others (on_rank0's RuntimeError quoting it); an unrelated RuntimeError is not (it keeps its traceback)."""
    from parallel.guard import disk_error

    assert disk_error(PermissionError(13, "Permission denied", "/run/ckpt"))
    assert disk_error(RuntimeError("saving checkpoint step 3 failed on rank 0 (PermissionError: [Errno 13] "
                                   "Permission denied: '/run/ckpt')"))
    assert disk_error(OSError(28, "No space left on device"))
    assert not disk_error(RuntimeError("Permission denied by the launcher"))
    assert not disk_error(ValueError("--out 'x': this user cannot write in 'x'"))
