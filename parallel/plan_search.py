"""The planner's searches over parallel/plan.py's plans: the single changes that make a plan fit (`_fixes`), the
layouts of a world (`_layouts`, least communication first; those the run refuses, with why), the longest --max-len
that fits (`longest`), the fewest --ac-blocks (`fewest_ac_blocks`) and whether --ac-keep-attn fits (`keep_attn_fits`),
and the device and host budgets they plan against (`_budget`, `_host_budget`). The command line that prints them,
`train.py --plan`: parallel/plan_cli.py.

`longest`: the planned total and host bytes grow with --max-len, except where the attention backward's block shrinks
(past 4 blocks a row: kernels.backward_block), where the plan falls; each side is searched on its own. A length the
run's validation refuses does not fit.
`best_ac_group(L)`: the smallest G with the fewest inputs alive, ceil(L/G) + G - 1 (4 for 28 layers: 10, not 28).
"""

from __future__ import annotations

import argparse
import functools
import os

from parallel import kernels
from parallel.mesh import validate
from parallel.plan import memory_plan
from parallel.plan_totals import GB

MAX_LEN_STEP = 1024
SAFETY = 0.95   # --ac-blocks suggestions keep 5% of the device free


def best_ac_group(n_layers: int) -> int:
    return min(range(1, n_layers + 1), key=lambda g: (-(-n_layers // g) + g - 1, g))


def _with(args, **kw):
    return argparse.Namespace(**{**vars(args), **kw})


def _layouts(args, margs, world, refused: list | None = None):
    """Every (cp, impl, ulysses degree) for this world, validated; least communication first. `refused` collects
    (flags, the run's error) of those validation refuses (a --global-batch the data ranks do not divide, heads a
    Ulysses degree does not split)."""
    out = []
    for cp in (c for c in range(1, world + 1) if world % (c * args.dp_replicate) == 0):
        impls = [("ulysses", None), ("ring", None)] + [("hybrid", u) for u in range(2, cp) if cp % u == 0]
        for rank, (impl, u) in enumerate(impls[:1] if cp == 1 else impls):
            a = _with(args, cp=cp, dp_shard=-1, cp_impl=impl, ulysses_degree=u)
            if cp > 1 and args.tiled_attn:   # one process's attention: a CP layout runs without it (and says so)
                a = _with(a, tiled_attn=False, dropped_tiled_attn=True)
            try:
                dims, pack = validate(a, margs, world)
            except ValueError as e:
                if refused is not None:
                    refused.append((f"--cp {cp} --dp-shard {world // (cp * args.dp_replicate)}" + (
                        f" --cp-impl {impl}" if cp > 1 else "") + (f" --ulysses-degree {u}" if u else ""), str(e)))
                continue
            out.append((cp, dims.ring, rank, a, dims, pack))
    return [x[3:] for x in sorted(out, key=lambda x: x[:3])]


def _flags(a, dims) -> str:
    return f"--cp {a.cp} --dp-shard {dims.dp_shard}" + (f" --cp-impl {a.cp_impl}" if a.cp > 1 else "") + (
        f" --ulysses-degree {a.ulysses_degree}" if a.ulysses_degree else "") + (
        " (no --tiled-attn)" if getattr(a, "dropped_tiled_attn", False) else "")


_fits = lambda p, mem, host: p.total <= mem and p.host <= host
def _groups(args, margs):
    """--ac-group values worth trying: 2 (least recompute), then the one keeping fewest inputs."""
    free = args.ac and not args.offload_activations and args.ac_group == 1 and args.ac_blocks is None
    return sorted({2, best_ac_group(margs.n_layers)} - {1}) if free and margs.n_layers > 2 else []


def _fixes(args, margs, world, target, mem, host):
    """Single changes that make the plan fit, as flag strings with their totals."""
    gs, off = _groups(args, margs), " (no --ac-keep-attn)" * args.ac_keep_attn
    nk = dict(ac_keep_attn=False)   # --ac-group, offload, --tiled-attn refuse --ac-keep-attn: their fixes drop it
    tm, ta = dict(tiled_mlp=True), dict(tiled_mlp=True, tiled_attn=True)
    sets = [("", {}, True), ("--tiled-mlp ", tm, not args.tiled_mlp),
            ("--tiled-mlp --tiled-attn ", ta, not args.tiled_attn)]
    tries = [(f, _with(args, **kw), world) for f, kw, ok in (
        ("--ac", dict(ac=True), not args.ac), ("--quant nf4", dict(quant="nf4"), args.quant != "nf4"),
        ("--tiled-mlp", tm, not args.tiled_mlp), (f"--tiled-mlp --tiled-attn{off}", dict(ta, **nk), sets[2][2]),
        *[(f"{m}--ac-group {g}{off}", dict(kw, ac_group=g, **nk), ok) for m, kw, ok in sets[:2] for g in gs],
        *[(f"{m}--offload-activations{off}", dict(kw, offload_activations=True, **nk),
           ok and args.ac and not args.offload_activations) for m, kw, ok in sets],
        ("--ple-on-device", dict(ple_on_device=True), margs.small is not None and margs.small.ple > 0
         and not getattr(args, "ple_on_device", False)),   # (host memory short: Gemma 4 E2B / E4B's table on the GPU)
        ("--micro-batch 1", dict(micro_batch=1), args.micro_batch > 1),
        ("no --ac-blocks (AC on every block)", dict(ac_blocks=None), args.ac_blocks is not None),
        ("no --ac-keep-attn", dict(ac_keep_attn=False), args.ac_keep_attn)) if ok]
    tries += [(_flags(a, dims), a, world) for a, dims, _ in _layouts(args, margs, world) if a.cp > args.cp]
    no_ta = " (no --tiled-attn)" * args.tiled_attn   # CP splits the sequence instead
    for k in (2, 4, 8):
        tries.append((f"more ranks: --world-size {world * k} --cp {args.cp * k} (--cp-impl auto){no_ta}",
                      _with(args, cp=args.cp * k, cp_impl="auto", ulysses_degree=None, tiled_attn=False), world * k))
    out, seen = [], set()
    for flags, a, w in tries:
        kind = " ".join(f for f in flags.split() if f.startswith("--")) if flags.startswith("--") else flags[:10]
        try:
            dims, pack = validate(a, margs, w)
        except ValueError:
            continue
        p = memory_plan(margs, dims, a, target, pack)
        if _fits(p, mem, host) and kind not in seen:   # the first (least communication) of each kind
            seen.add(kind)
            out.append(f"{flags} ({p.total / GB:.1f} GB)")
    return out


def _not_tried(args) -> str:
    """When no single change fits: the memory flags this run does not use yet (to combine), then the rest."""
    off = [f for f, on in (("--ac", args.ac), ("--quant nf4", args.quant == "nf4"), ("--tiled-mlp", args.tiled_mlp),
                           ("--tiled-attn", args.tiled_attn or args.cp > 1),
                           ("--offload-activations", args.offload_activations)) if not on]
    drop = [f for f, on in (("--ac-blocks", args.ac_blocks is not None), ("--ac-keep-attn", args.ac_keep_attn)) if on]
    if "--ac-keep-attn" in drop:   # --tiled-attn and offload refuse it
        off = [f + " (without --ac-keep-attn)" if f in ("--tiled-attn", "--offload-activations") else f for f in off]
    first = f"combine {', '.join(off)}" if len(off) > 1 else f"add {off[0]}" if off else "every memory flag is on"
    first += f", and drop {' and '.join(drop)}" if drop else ""
    return f"{first}; lower --max-len, or use more ranks (a larger --cp) or devices with more memory"


def _budget(args, world):
    """(target, bytes per rank, what they are): --gpu-mem, else this process's CUDA device, else this machine's RAM
    over its local ranks (LOCAL_WORLD_SIZE, else `world`)."""
    import torch
    if torch.cuda.is_available():
        dev = torch.cuda.current_device()   # this rank's device (train.py --fast gathers every rank's)
        mem = args.gpu_mem * GB if args.gpu_mem else torch.cuda.get_device_properties(dev).total_memory
        src = "--gpu-mem" if args.gpu_mem else torch.cuda.get_device_name()
        return "cuda", mem, f"{mem / GB:.1f} GB per GPU ({src})"
    if args.gpu_mem:
        return "cuda", args.gpu_mem * GB, f"{args.gpu_mem:.1f} GB per GPU (--gpu-mem: planning CUDA from a CPU machine)"
    from parallel.budgets import cpu_memory
    return ("cpu", *cpu_memory(world))


def _host_budget(args, world) -> float:
    import psutil
    return args.host_mem * GB if args.host_mem is not None else \
        psutil.virtual_memory().total / int(os.environ.get("LOCAL_WORLD_SIZE", world))


def longest(args, margs, world, target, mem, host) -> int:
    """The longest --max-len (a multiple of MAX_LEN_STEP) that fits; 0 if none does. The plan grows with the length
    except where the attention backward's block shrinks (kernels.backward_block: past 4 blocks a row), where it
    falls: each side of that point is searched on its own (review, helper 81: the one search stopped below it)."""
    @functools.cache
    def plan(k):
        a = _with(args, max_len=k * MAX_LEN_STEP)
        try:
            dims, pack = validate(a, margs, world)
            return memory_plan(margs, dims, a, target, pack)
        except ValueError:
            return None
    ok = lambda k: (q := plan(k)) is not None and _fits(q, mem, host)
    block = lambda k: (q := plan(k)) is not None and q.attn_block   # (0: a length the run refuses)

    def last(lo, cap=1 << 20):   # the last k from `lo` (which fits) on that fits, while fitting only shrinks
        hi = lo + 1
        while hi <= cap and ok(hi):
            lo, hi = hi, hi + 2 * (hi - lo)
        hi = min(hi, cap + 1)   # (a billion tokens: the search stops there)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo
    best = last(1) if ok(1) else 0
    q = plan(max(best, 1))   # the first length past `best` whose attention block is smaller: the row grows with the
    if q is None or q.attn_row > 4 * kernels.BACKWARD_BLOCK:   # length (about in proportion), so from the row's
        return best * MAX_LEN_STEP   # length at `best`, then a step at a time (padding: a few at most)
    k = max(max(best, 1) + 1, max(best, 1) * (4 * kernels.BACKWARD_BLOCK + 1) // max(q.attn_row, 1) - 2)
    while k < 1 << 20 and (b := block(k)) == q.attn_block:
        k += 1
    if k < 1 << 20 and b and b != q.attn_block and ok(k):
        best = max(best, last(k))
    return best * MAX_LEN_STEP


def fewest_ac_blocks(args, margs, dims, target, mem, host, pack):
    """(N, plan): the fewest checkpointed blocks that fit with SAFETY headroom (a run near the limit should not
    hinge on the planner's ~2%), when fewer than all do."""
    if not args.ac or args.ac_group > 1 or args.ac_blocks is not None:
        return None
    for n in range(1 if args.offload_activations or args.ac_keep_attn else 0, margs.n_layers):
        p = memory_plan(margs, dims, _with(args, ac_blocks=n), target, pack)
        if _fits(p, SAFETY * mem, host):
            return n, p
    return None


def _memory_flags(args, margs):
    tiles = [("--tiled-mlp", dict(tiled_mlp=True))] if not args.tiled_mlp else []
    if not args.tiled_attn and not args.ac_keep_attn:   # (--cp > 1 layouts refuse it: validate drops those)
        tiles += [(f"{'--tiled-mlp ' * (not args.tiled_mlp)}--tiled-attn", dict(tiled_mlp=True, tiled_attn=True))]
    g = max(_groups(args, margs), default=0)   # the fewest inputs: what reaches the longest
    more = [(f"--ac-group {g}", dict(ac_group=g))] * bool(g) + [("--offload-activations", dict(
        offload_activations=True))] * (args.ac and not args.offload_activations and args.ac_group == 1)
    base = [("", {})] + tiles
    return base + [(f"{f} {m}".strip(), dict(kw, **mk)) for m, mk in more for f, kw in base]


def keep_attn_fits(args, margs, dims, target, mem, host, pack):
    """(flags, plan): --ac-keep-attn, else with --tiled-mlp, when it fits with SAFETY headroom and is not set."""
    if (not args.ac or args.ac_keep_attn or args.ac_group > 1 or args.offload_activations or args.ac_blocks == 0
            or args.tiled_attn):   # (the two refuse each other: parallel.flags.check_flags)
        return None
    for flags, kw in (("--ac-keep-attn", {}), ("--tiled-mlp --ac-keep-attn", {"tiled_mlp": True}))[:2 - args.tiled_mlp]:
        p = memory_plan(margs, dims, _with(args, ac_keep_attn=True, **kw), target, pack)
        if _fits(p, SAFETY * mem, host):
            return flags, p
    return None
