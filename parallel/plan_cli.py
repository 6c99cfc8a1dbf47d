"""`train.py --plan` on the command line: the verdict, the fixes, the layouts that fit, the longest --max-len.

Contract (the terms are parallel/plan.py's):
- `main(argv, run_parser, demo)` (train.py's `--plan`: config.json only, no process group, no weight read) parses the
  run's flags plus the planner's own: --suggest, --gpu-mem, --world-size, --host-mem (GB of pinned host memory per
  rank for --offload-activations; default this machine's RAM divided by its local ranks: LOCAL_WORLD_SIZE, else the
  planned world size), validates with the run's checks (`parallel.mesh.validate`'s failure raises the run's
  ValueError) and prints the plan's terms against the device memory.
- A plan fits when its device total <= the device memory and its host bytes <= --host-mem. When it does not, the
  SystemExit names single changes that fit (--ac, --quant nf4, --tiled-mlp [--tiled-attn], --ac-group,
  --offload-activations, --micro-batch 1, larger layouts, more ranks). --tiled-attn runs one process's attention: a
  CP layout is tried without it and named "(no --tiled-attn)", here and in --suggest.
- `--max-len auto`: the longest --max-len, a multiple of 1,024, that fits the world size, layout, flags and memory
  (parallel/plan_search.py's `longest`). Prints that plan; the last line is `max_len N`.
- A plan that fits with AC on every block also names the fewest blocks `--ac-blocks` may checkpoint and still fit in
  95% of the device, and `--ac-keep-attn` (else with `--tiled-mlp`) when it fits there (less recompute: faster).
- `--suggest`: every valid (cp, dp_shard, cp-impl) layout that fits, least communication first (then those the run's
  checks refuse, with why). With `--max-len
  auto`: for every layout and memory-flag set (the given flags, + --tiled-mlp, + --tiled-mlp --tiled-attn, each also
  with --ac-group best_ac_group(L) and with --offload-activations when AC is on) its longest --max-len, longest
  first; the last lines name the flags that reach the longest (pasteable) and `max_len N`.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from parallel.flags import check_flags, check_model_flags
from parallel.mesh import validate
from parallel.plan import memory_plan
from parallel.plan_search import (
    MAX_LEN_STEP,
    _budget,
    _fits,
    _fixes,
    _flags,
    _host_budget,
    _layouts,
    _memory_flags,
    _not_tried,
    _with,
    fewest_ac_blocks,
    keep_attn_fits,
    longest,
)
from parallel.plan_speed import apply_flags, cached_reference_line, fast_flags, fastest_line
from parallel.plan_totals import FRAGMENTATION, GB, RUNTIME


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
        k = re.fullmatch(r"(\d+)\s*([kKmM])", text.strip())   # (32k, 1M: how context lengths are said, not typed)
        n = k and int(k.group(1)) * 1024 ** (1 + (k.group(2) in "mM"))
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens" + (
            f": write it out, --max-len {n} ({text.strip()} as context lengths count, in 1024s)" if k else "")) \
            from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: a sample is truncated to --max-len tokens, so it must be at least 2, "
                                         "one input and one target (e.g. --max-len 4096)")
    return n


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


_on = lambda flag: "on" if flag else "off"


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
    from model.load_checks import check_config_quant

    args = parse_args(argv, run_parser, demo)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    margs = read_args(path := fetch_checkpoint(args.model, config_only=True))   # a Hub id: its config.json only
    check_config_quant(path, args.quant, args.model)   # (an fp4 upload under --quant nf4: the run refuses it too)
    check_flags(args)   # the layout-free checks first: the searches below skip what `validate` refuses
    check_model_flags(args, margs, say=print)
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
    print(f"plan: {margs.named} {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'} params, {dims}\n"
          f"      --max-len {args.max_len} --micro-batch {args.micro_batch or 'auto'}, quant {args.quant}, {e}, "
          f"AC {ac}, tiled MLP {_on(args.tiled_mlp)}, tiled attention {_on(args.tiled_attn)}, offload "
          f"{_on(args.offload_activations)}, LoRA r {args.lora_r}{' DoRA' * getattr(args, 'dora', False)}"
          f"{f' on blocks {args.lora_layers}' if getattr(args, 'lora_layers', None) else ''}; "
          f"{p.notes[0]}")
    if beyond := margs.beyond_context(args.max_len):   # (the run says it too, at start-up: review, helper 81)
        print(beyond)
    print(f"  {'per-rank memory':<72}{un:>8}")
    for k, v in p.terms.items():
        print(f"  {k:<72}{v / u:8.2f}")
    print(f"  {'peak of live tensors (the | lines: the larger of block vs loss, or the end)':<72}{p.peak / u:8.2f}")
    print(f"  {f'x {FRAGMENTATION:.2f} fragmentation + {RUNTIME[target] / GB:.1f} GB runtime ({target})':<72}"
          f"{p.total / u:8.2f}")
    print(f"  ({'without' if args.ac else 'with'} AC the activations would be {p.alt_activations / u:.2f} {un})")
    held = [(w, b) for w, b in (("offloaded checkpoints, pinned", p.host - p.host_ple),
                                ("per-layer embedding table, its rows pinned", p.host_ple)) if b]
    budget = f" (--host-mem {host / GB:.3g} GB)"
    for what, b in held:
        print(f"  {f'host: {what}' + budget * (len(held) == 1):<72}{b / u:8.2f}")
    if len(held) > 1:
        print(f"  {'host in all' + budget:<72}{p.host / u:8.2f}")
    if not _fits(p, mem, host):
        fixes = _fixes(args, margs, world, target, mem, host)
        why = (f"{p.total / GB:.1f} GB planned > {where}" if p.total > mem else
               f"{p.host / GB:.3g} GB of {' and '.join(w.split(',')[0] for w, _ in held)} > --host-mem "
               f"{host / GB:.3g} GB per rank")
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
