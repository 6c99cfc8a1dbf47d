"""Peak memory per phase of one training step (`train.py --mem-phases`): which part of the step sets the peak.

Contract:
- `PhaseMeter(model, device, out_dir=None, log=print)` hooks the model once; `with measuring(meter, on):`
  around one micro-batch's forward and backward records, when `on`, each phase's peak in GB into
  `meter.phases` [(name, GB)], in order:
    forward                   the blocks' forward, up to the final norm's output
    loss                      to the gradient of the final norm's output (the chunked loss, forward and backward)
    last block: MLP           to the gradient of the last block's attention output (the final norm's backward,
                              the block's recompute under AC, the MLP's backward, the residual's gradient sum)
    last block: o_proj        to the gradient of o_proj's input
    last block: attention     to the first of q/k/v's projection-output gradients (the kernel's backward, RoPE's)
    last block: q/k/v, norm   to the gradient of the block's input (the three projections' backward, the norm's)
    rest of backward          to the end of the backward (the other blocks)
  The planner's block phase (parallel/plan_block.py: recompute + MLP, then the larger of attention and o_proj's
  backward) is the largest of those rows; q/k/v is not a planner term (its docstring argues it stays under
  attention). A phase whose boundary never fires (a one-layer model: the block input needs no gradient;
  --tiled-attn, whose tiles run o_proj, the kernels and q's projection together) merges into the next.
- `trace=True` (train.py --mem-trace, CUDA): torch's allocation history is recorded over that micro-batch, and
  `peak_sites` replays it: at the micro-batch's allocated peak, what was allocated since it began and is still
  alive, summed by the project line that allocated it (innermost frame in this repository, and its caller), to
  OUT/mem_trace.rank<r>.txt, rank 0's top lines logged. What a plan term misses shows up as a site.
- The boundaries are hooks registered in that micro-batch's forward (tensor hooks on its tensors; a checkpoint's
  recompute registers none), so they mark the backward of the graph being run.
- A peak: CUDA `max_memory_allocated` after `reset_peak_memory_stats` at each boundary (allocated bytes / 1e9,
  what the planner plans and the metrics' peak_mem_gb report); CPU: the RSS high-water mark (VmHWM, kB / 1e6
  as peak_mem_gb's ru_maxrss), reset through /proc/self/clear_refs (where that is not writable there are no
  phases: the file and the log line say why). Both resets also reset the
  step's own peak: `peak_gb()` is the step's peak over the whole run, phases included (`reserved_gb()` the
  allocator's reserved peak, likewise). With `out_dir`, the
  measured micro-batch ends with `report()` (a collective, every rank): OUT/mem_phases.json {"unit": "GB",
  "device", "why", "ranks": [each rank's phases]}, and rank 0's phases logged.
- `step_peaks(meter, device)`: train.py's peak_mem_gb and peak_reserved_gb of this rank, with or without a meter.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist

CLEAR_REFS = "/proc/self/clear_refs"   # writing "5" resets this process's VmHWM (Linux)


def _vm_gb(key: str) -> float:   # kB / 1e6, the unit of parallel.mesh.peak_memory_gb's ru_maxrss on CPU
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1e6


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository: whose lines are sites
MAX_EVENTS = 4_000_000   # --mem-trace's history (a 524,288-token step of 8 layers makes far fewer)


def _site(frames: list) -> str:
    """The innermost frame of this repository (torch's frames run innermost first) and its caller's; without one
    (autograd's own backward nodes run on a device thread with no Python stack), the autograd node's C++ frame."""
    own = [f for f in frames if f.get("filename", "").startswith(ROOT) and "site-packages" not in f["filename"]
           and not f["filename"].endswith("phases.py")]   # (a virtual environment may sit inside the repository)
    where = [f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} ({f['name']})" for f in own[:2]]
    node = next((f["name"] for f in frames if "Backward" in f.get("name", "") or "CopySlices" in f.get("name", "")),
                None)
    return " < ".join(where) or (f"(autograd: {node})" if node else "(no frame in this repository)")


def peak_sites(trace: list, base: int, top: int = 12) -> tuple[int, list]:
    """(peak allocated bytes, [(bytes, allocations, site)] largest first) of a CUDA allocation history (the
    `device_traces` entries of torch.cuda.memory._snapshot(), recorded from an allocated total `base`): allocated
    rises at "alloc" and falls at "free_requested"; at its highest point, what the history allocated and had not
    freed, by `_site`."""
    cur = peak = 0
    at = -1
    for i, e in enumerate(trace):
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_requested" else 0
        if cur > peak:
            peak, at = cur, i
    live = {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    sites: dict = {}
    for e in live.values():
        n, c = sites.get(k := _site(e.get("frames") or []), (0, 0))
        sites[k] = (n + e["size"], c + 1)
    return base + peak, sorted(((n, c, k) for k, (n, c) in sites.items()), reverse=True)[:top]


class PhaseMeter:
    def __init__(self, model, device: torch.device, out_dir: str | None = None, log=print, trace: bool = False):
        self.device, self.phases, self.best, self.best_reserved, self.on = device, [], 0.0, 0.0, False
        self.out_dir, self.log = out_dir, log
        self.trace = trace and device.type == "cuda"
        if trace and not self.trace:
            log("--mem-trace: CUDA only (torch records no CPU allocation history); the phases alone")
        self.cuda = device.type == "cuda"
        self.why = None if self.cuda or os.access(CLEAR_REFS, os.W_OK) else \
            f"no per-phase peaks on CPU here: {CLEAR_REFS} is not writable (VmHWM cannot be reset)"
        core, last = model.model, model.model.layers[-1]
        core.norm.register_forward_hook(self._forward_done)
        # h, the MLP's input (o_proj's output takes the residual in place: a hook on that output never fires)
        if last.pre_norms:   # (the norm in front of the MLP; OLMo's block has none: the MLP is handed h itself)
            last.get_submodule(last.pre_norms[1]).register_forward_pre_hook(
                lambda m, a: self._watch(a[0], "last block: MLP"))
        last.mlp.register_forward_pre_hook(   # the tiled MLP runs that norm itself: handed a stand-in tagged with h
            lambda m, a: self._watch(a[0]._norm_output[1], "last block: MLP")
            if hasattr(a[0], "_norm_output") else None if last.pre_norms else self._watch(a[0], "last block: MLP"))
        if "feed_forward" in vars(last):   # the tiled feed-forward unit (parallel.memory._tiled_unit): its norm and
            unit = last.feed_forward   # MLP run in its tiles only; it is handed h itself
            last.feed_forward = lambda h: self._watch(h, "last block: MLP") or unit(h)
        mixer = getattr(last, "self_attn", None)   # (a Qwen3.5 linear block's: its linear_attn's projections)
        names = ("o_proj", ("q_proj", "k_proj", "v_proj", "qkv_proj")) if mixer else ("out_proj", ("in_proj_qkv",))
        mixer = mixer or last.linear_attn
        getattr(mixer, names[0]).register_forward_pre_hook(lambda m, a: self._watch(a[0], "last block: o_proj"))
        for proj in names[1]:   # the first of the three gradients to arrive ends attention (Gemma 4's k_eq_v layer,
            if getattr(mixer, proj) is not None:   # always the last: no v_proj, k_proj's output is v too)
                getattr(mixer, proj).register_forward_hook(lambda m, a, out: self._watch(out, "last block: attention"))
        last.register_forward_pre_hook(lambda m, a: self._watch(a[0], "last block: q/k/v, norm"))

    def _peak(self) -> float:   # GB since the last reset, then reset
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 1e9
            self.best_reserved = max(self.best_reserved, torch.cuda.max_memory_reserved(self.device) / 1e9)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = _vm_gb("VmHWM")
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        self.best = max(self.best, peak)
        return peak

    def _mark(self, name: str) -> None:
        if all(n != name for n, _ in self.phases):   # a boundary with several hooks: the first one to fire
            self.phases.append((name, round(self._peak(), 3)))

    def _watch(self, t, name):   # returns None: a forward (pre-)hook that returns something replaces args/output
        if self.on and torch.is_tensor(t) and t.requires_grad:   # off once the forward's last block has run
            t.register_hook(lambda g: self._mark(name))

    def _forward_done(self, m, a, out):
        if self.on:
            self._mark("forward")
            self._watch(out, "loss")
            self.on = False   # the rest of the forward and the backward's recomputes register nothing

    @contextlib.contextmanager
    def measuring(self, on: bool):
        if not on:
            yield
            return
        self.phases = []
        trace = None
        if self.trace:   # a diagnostic: where torch's private API fails, the run goes on without it, saying why
            # requested bytes: the history's sizes are the requests (allocated ones are rounded to blocks)
            base = torch.cuda.memory_stats(self.device).get("requested_bytes.all.current") or \
                torch.cuda.memory_allocated(self.device)
            # C++ frames too: autograd's own nodes run on a device thread with no Python stack. They are named by
            # dladdr (exported symbols: the autograd nodes' names), not torch's default addr2line, which can take
            # minutes inside the step (torchtitan#3628); read once, at the first snapshot: the user's choice stands
            os.environ.setdefault("TORCH_SYMBOLIZE_MODE", "dladdr")
            try:
                torch.cuda.memory._record_memory_history("all", context="alloc", stacks="all", max_entries=MAX_EVENTS)
            except Exception as e:   # noqa: BLE001
                self.log(f"--mem-trace: no allocation history on this torch ({type(e).__name__}: {e})")
                self.trace = False
        if not self.why:
            self._peak()   # the step so far (optimizer state, data) is in `best`; the phases start here
            self.on = True
        try:
            yield
        finally:
            self.on = False
            if self.trace:
                try:
                    trace = torch.cuda.memory._snapshot()["device_traces"][self.device.index or 0]
                except Exception as e:   # noqa: BLE001
                    self.log(f"--mem-trace: no snapshot ({type(e).__name__}: {e})")
                with contextlib.suppress(Exception):
                    torch.cuda.memory._record_memory_history(None)
        if not self.why:
            self._mark("rest of backward")
        if trace is not None:
            try:   # never the run's end: the other ranks would wait in report()'s all_gather
                if len(trace) >= MAX_EVENTS:
                    self.log(f"--mem-trace: the history filled its {MAX_EVENTS} events and lost the oldest: "
                             "the sites below are partial")
                self.report_sites(*peak_sites(trace, base))
            except Exception as e:   # noqa: BLE001
                self.log(f"--mem-trace: no report ({type(e).__name__}: {e})")
        if self.out_dir:   # with `why` too: the file says why it holds no phases
            self.report()

    def report_sites(self, peak: int, rows: list) -> None:
        lines = [f"peak {peak / 1e9:.3f} GB allocated; alive then, allocated in this micro-batch, by site (GB, count):"]
        lines += [f"  {n / 1e9:8.3f} {c:6d}  {k}" for n, c, k in rows]
        if self.out_dir:
            with open(os.path.join(self.out_dir, f"mem_trace.rank{dist.get_rank()}.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
        if dist.get_rank() == 0:
            self.log("mem trace (rank 0): " + "\n".join(lines[:9]))

    def report(self) -> None:
        """Every rank's phases to OUT/mem_phases.json, rank 0's logged (a collective: every rank calls it)."""
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, self.phases)
        if dist.get_rank() == 0:
            with open(os.path.join(self.out_dir, "mem_phases.json"), "w") as f:
                json.dump({"unit": "GB", "device": self.device.type, "why": self.why, "ranks": got}, f, indent=1)
            self.log(self.why or "mem phases (rank 0, peak GB): " + ", ".join(f"{n} {gb}" for n, gb in got[0]))

    def peak_gb(self) -> float:
        """The run's peak so far, across the resets made here."""
        if self.cuda:
            return max(self.best, torch.cuda.max_memory_allocated(self.device) / 1e9)
        return max(self.best, _vm_gb("VmHWM"))

    def reserved_gb(self) -> float:
        """CUDA: the caching allocator's reserved peak so far, across the resets made here."""
        return max(self.best_reserved, torch.cuda.max_memory_reserved(self.device) / 1e9) if self.cuda else 0.0


def measuring(meter: PhaseMeter | None, on: bool):
    """`meter.measuring(on)`, or nothing without a meter."""
    return meter.measuring(on) if meter else contextlib.nullcontext()


def step_peaks(meter: PhaseMeter | None, device: torch.device) -> tuple[float, float]:
    """This rank's peaks so far in GB, a meter's resets counted in: allocated (CPU: the RSS high-water mark, as
    parallel.mesh.peak_memory_gb) and, on CUDA, the caching allocator's reserved (its cached slack included)."""
    from parallel.mesh import peak_memory_gb

    peak = max(peak_memory_gb(device), meter.peak_gb() if meter else 0.0)
    if device.type != "cuda":
        return peak, 0.0
    return peak, meter.reserved_gb() if meter else torch.cuda.max_memory_reserved(device) / 1e9
