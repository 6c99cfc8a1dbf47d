"""train.py's memory check at start-up: the plan of the run's flags against every rank's memory, before any weight
is read (a 72B checkpoint takes minutes to load; a run that cannot fit should not wait for them to say so).

Contract:
- `gather_budgets(args, world, rank)` -> a `Budget` per rank, from every rank in one collective (all_gather_object):
  the device memory (parallel.plan_search._budget: this rank's CUDA device's total, else this machine's RAM over its
  local ranks) and the host memory available to this rank now (`host_available()` over LOCAL_WORLD_SIZE, else
  `world`). A rank that cannot say its memory is named in its entry, not raised there: every rank reaches the gather.
- `check(args, margs, dims, budgets, log)`, the same decision on every rank (same budgets, same arithmetic; no
  collective, so none waits), for the smallest budget of any rank:
  1. --offload-activations on CUDA whose pinned host bytes ((L - 1) block inputs of --max-len tokens) exceed the host
     memory available to a rank: ValueError naming both and the fixes. These are bytes, not a prediction; pinned
     memory cannot be paged out, and past the host's memory the kernel's OOM killer ends the job with no message.
     (With --no-mem-check, 1 and 2 are warnings.)
  2. A planned device total over MARGIN x the device memory: ValueError naming the plan, the memory and the single
     changes that fit (`train.py --plan`'s list). The margin covers the planner's error where it overestimates (the
     lowest measured/planned peak in bench/plan.py is 0.95), so only runs that cannot fit are refused;
     `--no-mem-check` runs anyway.
  3. A planned total between the memory and the margin: a warning line with the same fixes. Otherwise one line:
     the planned peak of the smallest budget's rank, to read beside the metrics' peak_mem_gb.
  A budget missing on some rank: the check is skipped, said in one line (`--fast` raises then, `apply_fast`).
- `host_available()` -> (bytes, where): psutil's available memory, or the memory cgroup's limit less its working set
  (usage less inactive file pages) when that is lower: containers and batch schedulers bound a job that way.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

MARGIN = 1.10   # refuse a planned device total above this share of the device's memory


class Budget(NamedTuple):
    rank: int
    target: str | None   # "cuda" or "cpu"; None: this rank could not say (`where` says why)
    device: float        # bytes of device memory per rank (CUDA: the device's total; CPU: RAM over local ranks)
    where: str
    host: float          # bytes of host memory available to this rank
    host_where: str


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_headroom(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> float | None:
    """Bytes the memory cgroup of this process (v2, or v1's memory controller) still allows: its limit less its
    working set, the smallest over the process's own cgroup directory and the mount's root; None with no limit."""
    own2 = own1 = ""
    for line in (_read(proc) or "").splitlines():
        if line.count(":") < 2:
            continue
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":
            own2 = path
        elif "memory" in ctrl.split(","):
            own1 = path
    best = None
    for base, limit, usage, inactive in ((root, "memory.max", "memory.current", "inactive_file"),
                                         (os.path.join(root, "memory"), "memory.limit_in_bytes",
                                          "memory.usage_in_bytes", "total_inactive_file")):
        own = own2 if limit == "memory.max" else own1
        for d in {os.path.join(base, own.lstrip("/")), base}:
            lim, use = _read(os.path.join(d, limit)), _read(os.path.join(d, usage))
            if lim is None or use is None or not lim.isdigit() or int(lim) >= 1 << 60:   # "max", v1's huge "none"
                continue
            stat = dict(x.split() for x in (_read(os.path.join(d, "memory.stat")) or "").splitlines() if " " in x)
            room = int(lim) - max(0, int(use) - int(stat.get(inactive, 0)))
            best = room if best is None else min(best, room)
    return best


def host_available() -> tuple[float, str]:
    """(bytes, where) of host memory this machine can still give this job (module docstring)."""
    import psutil
    avail, where = float(psutil.virtual_memory().available), "available (psutil)"
    room = cgroup_headroom()
    if room is not None and room < avail:
        avail, where = float(room), "left under this job's memory cgroup limit"
    return avail, where


def gather_budgets(args, world: int, rank: int) -> list[Budget]:
    import torch.distributed as dist

    from parallel import plan_search
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        target, mem, where = plan_search._budget(argparse.Namespace(**{"gpu_mem": None, **vars(args)}), world)
        host, host_where = host_available()
        mine = Budget(rank, target, mem, where, host / local,
                      f"{host / 1e9:.3g} GB {host_where} over {local} local ranks" if local > 1 else host_where)
    except Exception as e:   # noqa: BLE001 (said by whoever reads the budgets, on every rank)
        mine = Budget(rank, None, 0.0, f"rank {rank}: {type(e).__name__}: {e}", 0.0, "")
    budgets = [None] * world
    dist.all_gather_object(budgets, mine)
    return budgets


def check(args, margs, dims, budgets: list[Budget], log) -> None:
    from parallel.plan import GB, memory_plan
    from parallel.plan_search import _fixes
    _gb = lambda b: f"{b / GB:.3g} GB"   # 3 figures: 141 GB, 26.3 GB, a test model's 0.0201 GB
    if bad := next((b for b in budgets if b.target is None), None):
        log(f"memory check skipped: no memory budget on {bad.where}")
        return
    dev = min(budgets, key=lambda b: b.device)
    host = min(budgets, key=lambda b: b.host)
    whose = lambda b: f" (rank {b.rank}'s, the smallest of {len(budgets)})" if len(budgets) > 1 else ""
    p = memory_plan(margs, dims, args, dev.target, args.pack)
    if p.host > host.host:
        said = (
            f"--offload-activations at --max-len {args.max_len} keeps the checkpointed blocks' inputs (all but the "
            f"first) in pinned host memory, {_gb(p.host)} per rank, more than the {_gb(host.host)} free per rank"
            f"{whose(host)}: {host.host_where}. Pinned memory cannot be paged out. Lower --max-len, run fewer ranks "
            "per machine, or drop --offload-activations; `train.py --plan --max-len auto --host-mem GB` gives the "
            "longest that fits")
        if args.mem_check:
            raise ValueError(f"{said} (--no-mem-check runs it anyway: shorter samples than --max-len pin less)")
        log(f"warning: {said}")
    if p.total <= dev.device:
        log(f"memory: planned {_gb(p.total)} per rank" + (f" and {_gb(p.host)} pinned host" if p.host
            else "") + f", of {dev.where}{whose(dev)} (parallel/plan.py; peak_mem_gb in the step lines is measured)")
        return
    fixes = _fixes(args, margs, len(budgets), dev.target, dev.device, host.host)
    said = (f"planned {_gb(p.total)} per rank (parallel/plan.py) is more than {dev.where}{whose(dev)}; "
            + (f"single changes that fit: {'; '.join(fixes[:4])}" if fixes else "no single change fits: "
               "`train.py --plan --suggest` with these flags lists the layouts that do"))
    if p.total > MARGIN * dev.device and args.mem_check:
        raise ValueError(f"{said}. Over {MARGIN:.2f}x the memory this cannot fit (the lowest measured/planned peak "
                         "in bench/plan.py is 0.95); --no-mem-check runs it anyway")
    log(f"warning: {said}. Step 1 may run out of memory")
