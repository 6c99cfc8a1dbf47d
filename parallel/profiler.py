"""`train.py --profile N`: where optimizer step N spends its time, from torch.profiler.

Contract: `StepProfiler(n, device, out_dir, rank, log)`; in the loop `begin(step)` before step `step`
(1-based) and `end(step, seconds)` after it; both do nothing for every other step. Step N runs under
torch.profiler (CPU ops, and on CUDA the kernels). `end` writes OUT/profile.txt (rank 0; other ranks
profile-rankR.txt): the step's wall time, its busy time by category (communication, matmul GEMMs,
attention kernels, NF4 dequantization, copies and casts, the rest: norms, RoPE, SwiGLU, LoRA adds, the
loss's softmax...) and the top ops by self time (CUDA: kernel time on the device; CPU: op time). The
profiled step is slower than the others (the profiler's bookkeeping): metrics.jsonl marks it
`"profiled": true`. Not written: a chrome trace (a 28-layer step's is hundreds of MB); fork this module
for one.
"""

from __future__ import annotations

import os
import re

import torch

# first match wins; names are CUDA kernel names on a GPU and aten op names on CPU
CATEGORIES = [
    ("communication", re.compile(r"nccl|all_gather|reduce_scatter|all_reduce|alltoall|c10d::|gloo", re.I)),
    ("attention", re.compile(r"cudnn|flash|fmha|attention|_efficient_attention|sdpa", re.I)),
    ("NF4 dequantize", re.compile(r"dequant|kQuantize", re.I)),
    ("matmul", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|aten::(mm|addmm|bmm|baddbmm|_addmm_activation)$",
                          re.I)),
    ("copies", re.compile(r"memcpy|memset|copy_kernel|aten::copy_$|aten::_to_copy$", re.I)),   # casts too
]
TOP = 40


def categorize(name: str) -> str:
    return next((cat for cat, pat in CATEGORIES if pat.search(name)), "other")


def _self_time_us(evt, cuda: bool) -> float:
    if not cuda:
        return evt.self_cpu_time_total
    t = getattr(evt, "self_device_time_total", None)   # torch >= 2.4; older: the cuda name
    return t if t is not None else evt.self_cuda_time_total


class StepProfiler:
    def __init__(self, step: int | None, device: torch.device, out_dir: str, rank: int, log=print):
        self.step, self.device, self.rank, self.log = step, device, rank, log
        self.path = os.path.join(out_dir, "profile.txt" if rank == 0 else f"profile-rank{rank}.txt")
        self.prof = None

    def begin(self, step: int) -> None:
        if step != self.step:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def end(self, step: int, seconds: float) -> bool:
        """True when `step` was the profiled one (its report is written)."""
        if step != self.step or self.prof is None:
            return False
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        events = self.prof.key_averages()
        self.prof = None
        rows = []
        for evt in events:
            # on a GPU: kernels (and copies) only; no CPU ops, no record_function ranges (their GPU span covers
            # the kernels inside them: counted twice)
            if cuda and (evt.device_type.name != "CUDA" or getattr(evt, "is_user_annotation", False)):
                continue
            us = _self_time_us(evt, cuda)
            if us > 0:
                rows.append((us, evt.count, evt.key))
        rows.sort(reverse=True)
        busy = sum(us for us, _, _ in rows)
        cats = {}
        for us, _, name in rows:
            cats[categorize(name)] = cats.get(categorize(name), 0.0) + us
        unit = "kernel time on the device" if cuda else "self CPU time of the ops"
        lines = [f"step {step}: {seconds:.3f} s wall (profiled: slower than the others); {busy / 1e6:.3f} s of {unit}",
                 "", "by category (s, share of the busy time):"]
        lines += [f"  {cat:16s} {us / 1e6:9.3f}  {us / max(busy, 1e-9):6.1%}"
                  for cat, us in sorted(cats.items(), key=lambda kv: -kv[1])]
        lines += ["", f"top {TOP} by self time:", f"  {'s':>9s} {'calls':>7s}  {'category':16s} name"]
        lines += [f"  {us / 1e6:9.4f} {n:7d}  {categorize(name):16s} {name[:160]}" for us, n, name in rows[:TOP]]
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")
        if self.rank == 0:
            self.log(f"profile of step {step}: {self.path} ("
                     + ", ".join(f"{cat} {us / max(busy, 1e-9):.0%}" for cat, us in
                                 sorted(cats.items(), key=lambda kv: -kv[1])) + ")")
        return True
