"""train.py's memory check at start-up: the plan of the run's flags against every rank's memory, once the data are
tokenized and before any weight is read (a 72B checkpoint takes minutes to load; a run that cannot fit should not wait
for them to say so). The checks before the process group: parallel/preflight.py.

Contract:
- `check(args, margs, dims, budgets, log, tokens, eval_tokens)` -> the plan (parallel/plan.py; None when skipped) of
  the run's flags for its longest sample (`tokens`; --max-len only caps the samples, a row is as long as its data),
  checked against the smallest of the ranks' budgets (parallel/budgets.py's `gather_budgets`), the host memory free
  on a machine shared by the ranks on it. The same decision on every rank: same budgets, same arithmetic, no file
  read (the planner's copies of the flags carry no --init-adapter) and no collective. train.py sizes the offload's
  host buffers from it (`host_each`).
  1. --offload-activations on CUDA whose pinned host bytes ((L - 1) block inputs; parallel/offload.py pins exactly
     those, in its own buffers), with Gemma 4 E2B / E4B's per-layer table in host memory (parallel/host_table.py),
     exceed the host memory free per rank: ValueError naming both and the fixes. Pinned memory cannot be paged out,
     and past the host's memory the kernel's OOM killer ends the job with no message.
  2. The plan's live tensors, at LIVE_FLOOR of their planned size (the lowest measured/planned ratio in bench/plan.py),
     over the device memory: the run cannot fit. ValueError naming the plan, the memory and the single changes that
     fit (`train.py --plan`'s list).
  3. A planned total (live tensors x FRAGMENTATION + runtime) over the device memory: a warning line with the same
     fixes. Otherwise one line: the planned peak of the smallest budget's rank, to read beside peak_mem_gb.
  4. `eval_tokens`, the longest eval sample, longer than `tokens`: evaluation gives it a row of its own, so training
     is planned at its length too, an upper bound (evaluation saves no activations). Over the device memory: one
     warning line naming both lengths and the fixes; never a refusal. Within it: nothing more is said.
  With --no-mem-check, 1 and 2 are warnings. A device budget missing on some rank: the check is skipped, said in one
  line (`--fast`, `plan_speed.apply_fast`, raises then).
- `fit(args, margs, dims, world, rank, log, tokens, eval_samples)` -> (dims, plan): train.py's call, collective:
  every rank's budgets gathered, --fast's flags applied for them (the layout validated anew), then `check`.
"""

from __future__ import annotations

import re

from parallel.budgets import Budget, host_per_rank

LIVE_FLOOR = 0.95   # measured/planned live peak: the lowest of bench/plan.py's rows (0.95-1.14; H200 0.97-1.02)


def planning_copy(args, **kw):
    """The run's flags for the planner's checks on every rank alike: no --init-adapter (its files are read by the run's
    own check once; read again per candidate, one rank's failure would leave the others waiting)."""
    from parallel.plan_search import _with
    return _with(args, init_adapter=None, **kw)


def fit(args, margs, dims, world: int, rank: int, log, tokens: int, eval_samples):
    """train.py's memory step, collective (every rank's budgets gathered at once: parallel/budgets.py): with --fast,
    the memory flags the planner ranks fastest for them set in `args` (plan_speed.apply_fast) and the layout
    validated anew (args.pack too); then `check` at the longest sample and eval sample. Returns (dims, the plan)."""
    from parallel.budgets import gather_budgets
    from parallel.mesh import validate
    from parallel.plan_speed import apply_fast

    budgets = gather_budgets(args, world, rank)
    if args.fast:   # the same math with those flags, for every rank
        apply_fast(args, margs, dims, budgets, log, tokens=tokens)
        dims, args.pack = validate(args, margs, world)
    return dims, check(args, margs, dims, budgets, log, tokens=tokens,
                       eval_tokens=eval_samples and int(eval_samples.lengths.max()))


def check(args, margs, dims, budgets: list[Budget], log, tokens: int | None = None, eval_tokens: int | None = None):
    from parallel.plan import memory_plan
    from parallel.plan_search import _fixes
    from parallel.plan_totals import GB, sample_tokens
    gb = lambda b: f"{b / GB:.3g} GB"   # 3 figures: 141 GB, 26.3 GB, a test model's 0.0201 GB
    if bad := next((b for b in budgets if b.target is None), None):
        log(f"memory check skipped: no memory budget on {bad.where}")
        return None
    shares = host_per_rank(budgets)
    dev = min(budgets, key=lambda b: b.device)
    low = min(range(len(budgets)), key=lambda r: shares[r])
    host, hb = shares[low], budgets[low]
    whose = lambda b, differ: f" (rank {b.rank}'s, the smallest of {len(budgets)})" if differ else ""   # when ranks
    on_dev, on_host = whose(dev, len({b.device for b in budgets}) > 1), whose(hb, len(set(shares)) > 1)   # differ
    two = sample_tokens(args) // args.max_len   # (2: a DPO pair, two sequences of up to --max-len; planned as 2n)
    n = min(args.max_len, -(-tokens // two) if tokens else args.max_len)
    a = planning_copy(args, max_len=n)
    p = memory_plan(margs, dims, a, dev.target, args.pack)
    span = (f"the longest sample, {n:,} tokens" if two == 1 else f"the longest pair's row, {tokens:,} tokens (its "
            "prompt once)" if getattr(args, "dpo_share_prompt", False) and tokens else
            f"the longest pair, 2 × {n:,} tokens") + (
        f" (--max-len {args.max_len:,})" if n < args.max_len else "")
    if p.host and p.host > host:
        on = sum(b.machine == hb.machine for b in budgets)
        off, ple = p.host - p.host_ple, p.host_ple   # (Gemma 4 E2B / E4B's table: parallel/host_table.py)
        held = [f"--offload-activations pins the checkpointed blocks' inputs (all but the first), {gb(off)}"] * bool(
            off) + [f"Gemma 4's per-layer embedding table and a micro-batch's pinned rows take {gb(ple)}"] * bool(ple)
        drop = ["drop --offload-activations"] * bool(off) + ["keep the table on the GPU (--ple-on-device)"] * bool(ple)
        said = (f"{'; '.join(held)}: {gb(p.host)} of host memory per rank for {span}, more than the {gb(host)} free "
                f"per rank{on_host}: {gb(hb.host)} {hb.host_where} on {hb.machine}, shared by {on} "
                f"rank{'s' * (on > 1)}. Pinned memory cannot be paged out. Lower --max-len, run fewer ranks per "
                f"machine, or {' or '.join(drop)}; `train.py --plan --max-len auto --host-mem GB` gives the longest "
                "that fits")
        if args.mem_check:
            raise ValueError(f"{said} (--no-mem-check runs it anyway)")
        log(f"warning: {said}")
    if p.total <= dev.device:
        log(f"memory: planned {gb(p.total)} per rank"
            + (f" and {gb(p.host)} {'pinned ' * (not p.host_ple)}host" if p.host else "")
            + f" for {span}, of {dev.where}{on_dev} (parallel/plan.py; peak_mem_gb in the step lines is measured)"
            + ("" if host != float("inf") else f"; free host memory {hb.host_where}, not checked"))
        _eval_bound(args, margs, dims, dev, on_dev, n, two, eval_tokens, log)
        return p
    fixes = [re.sub(r"more ranks: --world-size (\d+) ", r"\1 ranks: ", f)   # (--world-size is --plan's flag)
             for f in _fixes(a, margs, len(budgets), dev.target, dev.device, host)]
    said = (f"planned {gb(p.total)} per rank for {span} (parallel/plan.py: {gb(p.peak)} of live tensors) is more "
            f"than {dev.where}{on_dev}; " + (f"single changes that fit: {'; '.join(fixes[:4])}" if fixes else
                                                 "no single change fits: `train.py --plan --suggest` with these flags "
                                                 "lists the layouts that do"))
    if LIVE_FLOOR * p.peak > dev.device and args.mem_check:
        raise ValueError(f"{said}. It cannot fit: even {LIVE_FLOOR} of the planned live tensors, the least measured "
                         "against the plan (bench/plan.py), is more than the device holds; --no-mem-check runs it "
                         "anyway")
    log(f"warning: {said}. Step 1 may run out of memory")
    _eval_bound(args, margs, dims, dev, on_dev, n, two, eval_tokens, log)
    return p


def _eval_bound(args, margs, dims, dev: Budget, on_dev: str, n: int, two: int, eval_tokens: int | None, log):
    """An eval sample longer than every training one takes a row of its own (parallel/evaluate.py), a length the
    training plan never saw. Evaluation saves no activations, so planning training at that length only bounds it from
    above: a bound that fits says nothing, one that does not is a warning, never a refusal (the real need is lower).
    Same arithmetic on every rank as `check`, no collective."""
    from parallel.plan import memory_plan
    from parallel.plan_totals import GB
    e = min(args.max_len, -(-eval_tokens // two)) if eval_tokens else 0
    if e <= n:
        return
    p = memory_plan(margs, dims, planning_copy(args, max_len=e), dev.target, args.pack)
    if p.total <= dev.device:
        return
    cut = f"--max-len {n:,} cuts no training sample" if two == 1 else "it cuts the eval records too"
    log(f"warning: the longest eval sample, {e:,} tokens{' a side' * (two > 1)}, is longer than the longest training "
        f"sample, {n:,} tokens, and is evaluated in a row of its own; training planned at {e:,} tokens needs "
        f"{p.total / GB:.3g} GB per rank, more than {dev.where}{on_dev}. Evaluation runs forward only (no saved "
        "activations), so it needs less than this bound, but the first evaluation may run out of memory: a shorter "
        f"--max-len for the eval data ({cut}), or --eval-split to hold out --data records of training's lengths")
