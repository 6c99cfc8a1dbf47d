"""`train.py --plan` on the command line: the verdict, the fixes, the layouts that fit, the longest --max-len.

Contract (the terms are parallel/plan.py's):
- `main(argv, run_parser, demo)` parses the run's flags plus the planner's own: --suggest, --gpu-mem, --world-size,
  --host-mem (GB of pinned host memory per rank for --offload-activations; default this machine's RAM divided by its
  local ranks: LOCAL_WORLD_SIZE, else the planned world size).
- A plan fits when its device total <= the device memory and its host bytes <= --host-mem. When it does not, the
  SystemExit names single changes that fit (--ac, --quant nf4, --tiled-mlp [--tiled-attn], --ac-group,
  --offload-activations, --micro-batch 1, larger layouts, more ranks). --tiled-attn runs one process's attention: a
  CP layout is tried without it and named "(no --tiled-attn)", here and in --suggest.
- `--max-len auto`: the longest --max-len, a multiple of 1,024, that fits the world size, layout, flags and memory
  (binary search: the planned total and host bytes grow with --max-len; a length the run's validation refuses does
  not fit). Prints that plan; the last line is `max_len N`.
- A plan that fits with AC on every block also names the fewest blocks `--ac-blocks` may checkpoint and still fit in
  95% of the device, and `--ac-keep-attn` (else with `--tiled-mlp`) when it fits there (less recompute: faster).
- `--suggest`: every valid (cp, dp_shard, cp-impl) layout that fits, least communication first. With `--max-len
  auto`: for every layout and memory-flag set (the given flags, + --tiled-mlp, + --tiled-mlp --tiled-attn, each also
  with --ac-group best_ac_group(L) and with --offload-activations when AC is on) its longest --max-len, longest
  first; the last lines name the flags that reach the longest (pasteable) and `max_len N`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os

from parallel import kernels
from parallel.flags import check_flags, check_model_flags
from parallel.mesh import validate
from parallel.plan import FRAGMENTATION, GB, RUNTIME, best_ac_group, memory_plan
from parallel.plan_speed import apply_flags, cached_reference_line, fast_flags, fastest_line

MAX_LEN_STEP = 1024
SAFETY = 0.95   # --ac-blocks suggestions keep 5% of the device free


def max_len_arg(text: str) -> int:
    """A run's --max-len: an int; `auto` is this module's search, which a run does not do (it would pick the data's
    truncation from a memory estimate), so the error says how to get the number."""
    if text == "auto":
        raise argparse.ArgumentTypeError("'auto' is the planner's search, not a run's length: `python train.py --plan "
                                         "--max-len auto` with this run's other flags prints `max_len N` last; pass "
                                         "--max-len N")
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: a sample is truncated to --max-len tokens, so it must be at least 2, "
                                         "one input and one target (e.g. --max-len 4096)")
    return n


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
_on = lambda flag: "on" if flag else "off"


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


PLAN_FLAGS = ("--suggest", "--gpu-mem", "--world-size", "--host-mem")   # the planner's own (parse_args); a run
# given one is told so (train.py), not argparse's "unrecognized arguments"


def parse_args(argv, run_parser, demo: dict):
    """The run's flags (`run_parser`, built with add_help=False) plus the planner's own; with neither
    --model nor --data, the run's demo defaults (its assets are built if missing), as a run would."""
    p = argparse.ArgumentParser(prog="train.py --plan", parents=[run_parser], description="Per-rank memory plan of a "
                                "run, from config.json only.", formatter_class=run_parser.formatter_class)
    a = p.add_argument
    a("--suggest", action="store_true", help="list the layouts that fit, best first")
    a("--gpu-mem", type=float, default=None, help="GB (1e9 B, torch's total_memory; '80 GB' H100s have ~85) per device")
    a("--world-size", type=int, default=None, help="ranks to plan for (default: launched, else 1)")
    a("--host-mem", type=float, default=None, help="GB of pinned host memory per rank for --offload-activations "
      "(default: this machine's RAM / local ranks)")
    # `--max-len auto` (the run's flag is an int): search for the longest that fits
    auto = "--max-len=auto" in argv or any(x == "--max-len" and y == "auto" for x, y in zip(argv, argv[1:]))
    argv = [str(MAX_LEN_STEP) if x == "auto" and i and argv[i - 1] == "--max-len" else
            (f"--max-len={MAX_LEN_STEP}" if x == "--max-len=auto" else x) for i, x in enumerate(argv)]
    args = p.parse_args(argv)
    for flag, v in (("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem)):
        if v is not None and not (math.isfinite(v) and v > 0):   # (0 read as "not given", NaN as nothing fitting)
            p.error(f"{flag} must be a positive number of GB, got {v}")
    if args.world_size is not None and args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.model is None and args.data is None:
        from data import make_demo
        make_demo(os.path.dirname(demo["model"]))
        p.set_defaults(**demo)
        args = p.parse_args(argv)
    elif args.model is None:   # (--data alone: the plan reads config.json, so it needs the model, not the data)
        p.error("--plan needs --model DIR (or a Hub id): it plans from the model's config.json; --data is not read")
    args.auto = auto
    return args


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


def _said_refused(refused: list) -> str:
    """--suggest's last lines: the layouts it left out because the run would refuse them, and why (review, helper 81:
    --cp 1 --dp-shard 16, refused for --global-batch 8, was left out of 16 ranks' list without a word)."""
    if not refused:
        return ""
    lines = [f"  {flags}: {why}" for flags, why in refused[:4]] + [f"  ... and {len(refused) - 4} more"] * (
        len(refused) > 4)
    return "\nnot listed, the run's checks refuse them:\n" + "\n".join(lines)


def suggest_longest(args, margs, world, target, mem, host, where):
    """--suggest --max-len auto: each layout and memory-flag set with its longest --max-len."""
    rows, refused = [], []
    for a, dims, _ in _layouts(args, margs, world, refused):
        for extra, kw in _memory_flags(args, margs):
            n = longest(_with(a, **kw), margs, world, target, mem, host)
            if n:
                rows.append((n, f"{_flags(a, dims)} {extra}".strip()))
    rows.sort(key=lambda r: -r[0])
    print(f"longest --max-len per layout and memory flags in {where}, host {host / GB:.3g} GB per rank:\n"
          + "\n".join(f"  {flags:<80} {n:>10}" for n, flags in rows or [(0, "none")]) + _said_refused(refused))
    if not rows:
        raise SystemExit(f"no layout of {world} ranks fits {MAX_LEN_STEP} tokens")
    dropped = " (no --tiled-attn)" in rows[0][1]   # the line stays pasteable: the note goes after a '#'
    base = " ".join(f for f, on in (
        ("--tiled-mlp", args.tiled_mlp), ("--tiled-attn", args.tiled_attn and not dropped),
        (f"--ac-group {args.ac_group}", args.ac_group > 1),
        (f"--ac-blocks {args.ac_blocks}", args.ac_blocks is not None), ("--ac-keep-attn", args.ac_keep_attn),
        ("--offload-activations", args.offload_activations)) if on)
    print(f"flags: {rows[0][1].replace(' (no --tiled-attn)', '')} {base}".rstrip()
          + ("  # without --tiled-attn: CP splits the sequence" if dropped else ""))
    print(f"max_len {rows[0][0]}")
    return rows


def main(argv, run_parser, demo: dict):
    from model.hub import fetch_checkpoint
    from model.load import read_args

    args = parse_args(argv, run_parser, demo)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    margs = read_args(fetch_checkpoint(args.model, config_only=True))   # a Hub id: its config.json only
    check_flags(args)   # the layout-free checks first: the searches below skip what `validate` refuses
    check_model_flags(args, margs)
    target, mem, where = _budget(args, world)
    host = _host_budget(args, world)
    if args.suggest and args.auto:
        return suggest_longest(args, margs, world, target, mem, host, where)
    if args.auto:
        validate(_with(args, max_len=MAX_LEN_STEP), margs, world)   # what no length fixes: the run's own error
        args.max_len = longest(args, margs, world, target, mem, host)
        if not args.max_len:
            raise SystemExit(f"not even --max-len {MAX_LEN_STEP} fits in {where}; what to change: "
                             + "; ".join(_fixes(_with(args, max_len=MAX_LEN_STEP), margs, world, target, mem, host)
                                         or ["more ranks or larger devices"]))
    if args.suggest:   # every valid layout, best first; only those that fit are printed
        refused = []
        plans = [(a, dims, memory_plan(margs, dims, a, target, pack))
                 for a, dims, pack in _layouts(args, margs, world, refused)]
        rows = [f"  {_flags(a, d):<58} {p.total / GB:7.1f} GB  {d}" for a, d, p in plans if _fits(p, mem, host)]
        print(f"layouts that fit in {where}, least communication first:\n" + "\n".join(rows or ["  none"])
              + _said_refused(refused))
        if not rows:
            raise SystemExit(f"no layout of {world} ranks fits: {_not_tried(args)}")
        return rows
    dims, pack = validate(args, margs, world)   # a ValueError, as in the run: train.py prints "error: <fix>"
    if args.fast:   # the plan of the flags the run would add (train.py --fast)
        flags, line = fast_flags(args, margs, dims, pack, world)
        apply_flags(args, flags)
        print(line)
        dims, pack = validate(args, margs, world)
    p = memory_plan(margs, dims, args, target, pack)
    e = args.dtype or ("bf16" if target == "cuda" else "fp32")
    ac = ("on" + (f" (groups of {args.ac_group})" if args.ac_group > 1 else "")
          + (f" (first {args.ac_blocks} of {margs.n_layers} blocks)" if args.ac_blocks is not None else "")
          + (" (attention outputs kept)" if args.ac_keep_attn else "")) if args.ac else "off"
    n, (u, un) = margs.n_params, ((GB, "GB") if p.total >= 10 * GB else (1e6, "MB"))
    print(f"plan: {margs.model_type} {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'} params, {dims}\n"
          f"      --max-len {args.max_len} --micro-batch {args.micro_batch or 'auto'}, quant {args.quant}, {e}, "
          f"AC {ac}, tiled MLP {_on(args.tiled_mlp)}, tiled attention {_on(args.tiled_attn)}, offload "
          f"{_on(args.offload_activations)}, LoRA r {args.lora_r}{' DoRA' * getattr(args, 'dora', False)}"
          f"{f' on blocks {args.lora_layers}' if getattr(args, 'lora_layers', None) else ''}; "
          f"{p.notes[0]}")
    print(f"  {'per-rank memory':<72}{un:>8}")
    for k, v in p.terms.items():
        print(f"  {k:<72}{v / u:8.2f}")
    print(f"  {'peak of live tensors (the | lines: the larger of block vs loss, or the end)':<72}{p.peak / u:8.2f}")
    print(f"  {f'x {FRAGMENTATION:.2f} fragmentation + {RUNTIME[target] / GB:.1f} GB runtime ({target})':<72}"
          f"{p.total / u:8.2f}")
    print(f"  ({'without' if args.ac else 'with'} AC the activations would be {p.alt_activations / u:.2f} {un})")
    if p.host:
        print(f"  {f'host: offloaded block checkpoints, pinned (--host-mem {host / GB:.3g} GB)':<72}"
              f"{p.host / u:8.2f}")
    if not _fits(p, mem, host):
        fixes = _fixes(args, margs, world, target, mem, host)
        why = (f"{p.total / GB:.1f} GB planned > {where}" if p.total > mem else
               f"{p.host / GB:.3g} GB of offloaded checkpoints > --host-mem {host / GB:.3g} GB per rank")
        raise SystemExit(f"does not fit: {why}.\nWhat to change: "
                         + ("; ".join(fixes) if fixes else f"no single change fits: {_not_tried(args)}"))
    print(f"fits: {p.total / GB:.1f} GB of {where}" + (f"; host {p.host / GB:.1f} GB" if p.host else ""))
    if (fewer := fewest_ac_blocks(args, margs, dims, target, mem, host, pack)) is not None:
        n, q = fewer
        print(f"faster: --ac-blocks {n} also fits ({q.total / GB:.1f} GB): {n} of {margs.n_layers} blocks "
              "recomputed in backward, the rest keep their activations" if n else
              f"faster: --no-ac also fits ({q.total / GB:.1f} GB): no block recomputed in backward, every one keeps "
              "its activations")
    if (keep := keep_attn_fits(args, margs, dims, target, mem, host, pack)) is not None:
        print(f"faster: {keep[0]} also fits ({keep[1].total / GB:.1f} GB): the recompute reuses each block's "
              "attention output instead of running attention again")
    for line in (fastest_line(args, margs, dims, target, mem, host, pack),
                 cached_reference_line(args, margs, dims, target, pack)):
        if line is not None:
            print(line)
    if args.auto:
        print(f"max_len {args.max_len}")
    return p


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
