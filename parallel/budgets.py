"""Each rank's memory budget for the start-up check (parallel/preflight_memory.py) and `--fast`
(parallel/plan_speed.py): its device memory, the host memory free on its machine, gathered from every rank at once.

Contract:
- `gather_budgets(args, world, rank)` -> a `Budget` per rank, from every rank in one collective (all_gather_object):
  the device memory (`device_budget`), the host memory free on its machine now (`host_available()`) and the
  machine's name. A rank that cannot say its device memory is named in its entry, one that cannot say its host
  memory gets none counted: every rank reaches the gather, nothing is raised there.
- `device_budget(args, world)` -> (target, bytes, where): parallel.plan_search._budget (this rank's CUDA device's
  total, else this machine's RAM over its local ranks) less, on CUDA without --gpu-mem, what other processes hold on
  the device now: the device's used memory (cudaMemGetInfo) beyond this process's allocator cache and the plan's
  RUNTIME (this process's context and communicators, counted in every plan's total), from 0.5 GB on. A GPU another
  job still holds is then refused or warned about by the same rules as a small one, naming how much is held and the
  device (cuda index and PCI bus, which nvidia-smi shows). Without cudaMemGetInfo: the total.
- `host_available()` -> (bytes, where): psutil's available memory, or the least room any memory cgroup above this
  process leaves (its limit less its usage net of page cache; v2 and v1, the process's cgroup and every parent up to
  the mount: Slurm and container limits sit on a parent) when that is lower. `cgroup_headroom(limit=True)`, their
  least limit, bounds a CPU run's memory (`cpu_memory(world)`, plan_search._budget's CPU branch).
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import NamedTuple


class Budget(NamedTuple):
    rank: int
    target: str | None   # "cuda" or "cpu"; None: this rank could not say (`where` says why)
    device: float        # bytes of device memory per rank (CUDA: the device's total; CPU: RAM over local ranks)
    where: str
    host: float          # bytes of host memory free on this rank's machine (inf: unknown, not checked)
    host_where: str
    machine: str


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _room(d: str, limit: str, usage: str, cache: tuple[str, str]) -> tuple[int, int] | None:
    """(limit, room) of a cgroup directory `d`: its limit, and the bytes it still allows (limit less usage net of page
    cache, at least 0); None: no limit there."""
    lim, use = _read(os.path.join(d, limit)), _read(os.path.join(d, usage))
    if lim is None or use is None or not lim.isdigit() or not use.isdigit() or int(lim) >= 1 << 60:
        return None   # no such file, "max", v1's huge "no limit"
    stat = {}
    for line in (_read(os.path.join(d, "memory.stat")) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stat[parts[0]] = int(parts[1])
    file = max(0, stat.get(cache[0], 0) - stat.get(cache[1], 0))   # page cache the kernel can drop (not shmem)
    return int(lim), max(0, int(lim) - max(0, int(use) - file))


def cgroup_headroom(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup", limit: bool = False) -> float | None:
    """The least room of the memory cgroups (v2, v1's memory controller) from this process's own up to the mount's
    root (a limit on any of them binds), or with `limit` their least limit; None when none has a limit."""
    own2 = own1 = ""
    for line in (_read(proc) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1] == "":
            own2 = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            own1 = parts[2]
    rooms = []
    for base, own, files in ((root, own2, ("memory.max", "memory.current", ("file", "shmem"))),
                             (os.path.join(root, "memory"), own1,
                              ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_cache", "total_shmem")))):
        parts = [p for p in own.split("/") if p and p != ".."]
        for n in range(len(parts), -1, -1):   # the own cgroup, its parents, the root
            if (got := _room(os.path.join(base, *parts[:n]), *files)) is not None:
                rooms.append(got[0] if limit else got[1])
    return min(rooms) if rooms else None


def host_available() -> tuple[float, str]:
    """(bytes, where) of host memory this machine can still give this job (module docstring)."""
    import psutil
    avail, where = float(psutil.virtual_memory().available), "available (psutil)"
    room = cgroup_headroom()
    if room is not None and room < avail:
        avail, where = float(room), "left under this job's memory cgroup limit"
    return avail, where


def cpu_memory(world: int) -> tuple[float, str]:
    """(bytes per rank, what they are) of a CPU run: this machine's RAM, or its job's memory cgroup limit when lower,
    over its local ranks (LOCAL_WORLD_SIZE, else `world`)."""
    import psutil
    ram, n = psutil.virtual_memory().total, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    what = f"this machine's RAM ({ram / 1e9:.1f} GB, psutil)"
    if (cap := cgroup_headroom(limit=True)) is not None and cap < ram:   # a container's or a batch job's limit
        ram, what = cap, f"this job's memory cgroup limit ({cap / 1e9:.1f} GB; the machine has {ram / 1e9:.1f} GB)"
    return ram / n, (f"{ram / n / 1e9:.1f} GB per rank: no CUDA device and no --gpu-mem, so {what} shared by {n} CPU "
                     f"rank{'s' * (n > 1)}")


def device_budget(args, world: int) -> tuple[str, float, str]:
    """(target, bytes, where) of this rank's device for a run starting now (module docstring)."""
    import torch

    from parallel import plan_search
    from parallel.plan_totals import GB, RUNTIME
    target, mem, where = plan_search._budget(argparse.Namespace(**{"gpu_mem": None, **vars(args)}), world)
    if target != "cuda" or getattr(args, "gpu_mem", None) or not torch.cuda.is_available():
        return target, mem, where
    dev = torch.cuda.current_device()
    try:
        free, total = torch.cuda.mem_get_info(dev)
    except RuntimeError:   # (no such query here: the device's total, as --plan has it)
        return target, mem, where
    others = total - free - torch.cuda.memory_reserved(dev) - RUNTIME["cuda"]
    if others < 0.5 * GB:   # a context and communicators larger than planned, not another job
        return target, mem, where
    bus = getattr(torch.cuda.get_device_properties(dev), "pci_bus_id", None)
    return target, mem - others, (f"{where}, less {others / GB:.1f} GB in use outside this process's allocator now "
                                  f"on cuda:{dev}" + (f" (PCI bus {bus:02X})" if isinstance(bus, int) else "")
                                  + f", {free / GB:.1f} GB free: other processes (nvidia-smi names them) or more "
                                  "than the planned runtime of this one's own")


def gather_budgets(args, world: int, rank: int) -> list[Budget]:
    import torch.distributed as dist

    try:
        host, host_where = host_available()
    except Exception as e:   # noqa: BLE001 (no host check then, said in the memory line)
        host, host_where = float("inf"), f"unknown ({type(e).__name__}: {e})"
    try:
        target, mem, where = device_budget(args, world)
    except Exception as e:   # noqa: BLE001 (said by whoever reads the budgets, on every rank)
        target, mem, where = None, 0.0, f"rank {rank}: {type(e).__name__}: {e}"
    budgets = [None] * world
    dist.all_gather_object(budgets, Budget(rank, target, mem, where, host, host_where, socket.gethostname()))
    return budgets


def host_per_rank(budgets: list[Budget]) -> list[float]:
    """Each rank's share of its machine's free host memory: the ranks on one machine share it."""
    on = {}
    for b in budgets:
        on[b.machine] = on.get(b.machine, 0) + 1
    return [b.host / on[b.machine] for b in budgets]
