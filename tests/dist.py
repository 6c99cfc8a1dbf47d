"""Multi-rank harness: spawn N ranks (gloo on CPU, or NCCL one GPU each) for the tests and bench/.

Contract:
- `run_ranks(fn, world_size, *args)` starts `world_size` processes with torch.multiprocessing,
  rendezvous through a `file://` store in a fresh temp dir (never a fixed TCP port), one thread
  per rank, and a process-group timeout so a mismatched collective raises instead of hanging.
- gloo ranks fork from a forkserver that imported torch, transformers, peft and this project once
  (`PRELOAD`): a spawned rank spends 4-8 s of one core importing them, and the suite starts a
  hundred or so. The server starts at the first gloo call, in the repository root (it imports from
  its working directory), and a rank refuses to run project modules preloaded from elsewhere. Each
  rank gets the caller's environment as it is at the call, as spawn gives, before `fn` and its
  arguments are unpickled; the preloaded modules keep what they read at the server's start (after
  conftest set the environment every run shares), and the ranks write to the stdout and stderr the
  server started with (a `capfd` test would see none of it). `start="spawn"` gives fresh
  interpreters (bench/ measures RSS and paged-in code from a clean start). Ranks always spawn where
  CUDA is available: bitsandbytes may touch the GPU as it is imported, and a CUDA context cannot
  cross a fork.
- `fn(rank, world_size, *args)` runs inside the initialised process group; it must be a module-level
  function (picklable). Its return value is sent back; `run_ranks` returns the list by rank.
- If any rank raises, the test fails with that rank's full traceback in the pytest report. Ranks
  still blocked in a collective are killed after `timeout` seconds.

Use it with `@pytest.mark.timeout(...)` on the test as a second guard. `backend="nccl"` pins rank r to
CUDA device r (bench/attention.py on GPUs).
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import traceback
from multiprocessing import forkserver

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    pass


# What the forkserver imports once, before it forks any rank. It never touches a device or a thread
# pool, so forking from it is safe. An import that fails there is skipped (the rank imports it itself).
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "transformers", "peft",
           "model.qlora", "parallel.parallelize", "train", "tests.helpers", "tests.fixtures"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("model", "parallel", "data", "tests", "train", "loss")   # the project's top-level names


def _context(start: str):
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
        here = os.getcwd()
        os.chdir(ROOT)   # the server's sys.path starts with '': its working directory at its start
        try:
            forkserver.ensure_running()   # (once: a running server is kept)
        finally:
            os.chdir(here)
    return ctx


def _worker(rank, world_size, init_file, payload, queue, pg_timeout, backend, env, root):
    # the caller's environment, as a spawned rank gets it (a forkserver's is that of its own start), before
    # `fn`'s module is imported by unpickling it
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    crash = open(os.path.join(os.path.dirname(init_file), f"crash-{rank}"), "w")   # a native abort's Python stacks
    faulthandler.enable(crash, all_threads=True)   # (a rank that dies without a report: run_ranks shows them)
    try:
        stray = [f"{n} ({m.__file__})" for n, m in list(sys.modules.items()) if n.split(".")[0] in OURS
                 and getattr(m, "__file__", None) and not os.path.realpath(m.__file__).startswith(root + os.sep)]
        if stray:   # the server imported another checkout's code: the test would run what it does not test
            raise RuntimeError(f"modules imported from outside {root}: {', '.join(stray[:5])}")
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        # as bytes: a tensor put on the queue is shared by reference, and rebuilding it fails ("connection
        # refused") once this process has exited, so a rank's result would be lost
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure, including asserts
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:   # the ranks leave together: one that closed its connections while a peer was still finishing their
                # last collective broke it there (gloo: "Connection closed by peer"; test_hub flaked so, 2026-12-04)
                if backend == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(pg_timeout, 30)),
                                           wait_all_ranks=True)
                else:
                    dist.barrier()
            except Exception:   # (a peer that failed or died: nothing left to wait for; the result is queued)
                pass
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _stacks(tmp: str, rank: int) -> str:
    """What faulthandler wrote as rank `rank` died of a signal (SIGSEGV, SIGABRT...): its threads' Python stacks."""
    try:
        with open(os.path.join(tmp, f"crash-{rank}")) as f:
            said = f.read().strip()
    except OSError:
        return ""
    return f"; its Python stacks as it died:\n{said}" if said else ""


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0, backend="gloo",
              start="forkserver"):
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return results by rank."""
    ctx = _context("spawn" if backend == "nccl" or torch.cuda.is_available() else start)
    payload = pickle.dumps((fn, args))
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, payload, queue, pg_timeout, backend, dict(os.environ),
                      os.path.realpath(ROOT)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) + len(errors) < world_size:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    break
                try:
                    rank, ok, payload = queue.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    # A rank that died without reporting (segfault, OOM kill) shows here.
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode not in (None, 0) and r not in results and r not in errors]
                    for r in dead:
                        errors[r] = f"rank {r} exited with code {procs[r].exitcode} without a report" + _stacks(tmp, r)
                    continue
                if not ok:
                    errors[rank] = payload
                    continue
                try:   # CUDA tensors come back on the CPU: this process may hold no CUDA context
                    results[rank] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
                except Exception:  # noqa: BLE001 - an unreadable result is that rank's failure
                    errors[rank] = f"rank {rank}'s result could not be read back:\n{traceback.format_exc()}"
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        first = min(errors)
        others = sorted(set(errors) - {first})
        raise RankError(
            f"rank {first} failed (also failing: {others}):\n{errors[first]}"
            + "".join(f"\n--- rank {r} ---\n{errors[r]}" for r in others)
        )
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s (hung collective?)")
    return [results[r] for r in range(world_size)]
