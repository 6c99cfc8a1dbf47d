"""train.py's checks at start-up: flags, files and the resume before the process group, then the plan of the run's
flags against every rank's memory, once the data are tokenized and before any weight is read (a 72B checkpoint takes
minutes to load; a run that cannot fit should not wait for them to say so).

Contract:
- `parse(parser, argv, demo_defaults)` -> (args, demo): no --model and no --data is the demo, its defaults under the
  flags given; a --data/--eval-data of one file is its path (as runs before several files recorded it).
- `check_start(args, demo)` -> (the --model given, the checkpoint to resume or None): every check that needs no
  process group, before anything is written, so a refusal leaves every file as it was: the flags (`check_flags`),
  --model with --data, the data files, --out against --resume/--overwrite, a resume's run-defining flags and data
  bytes (`args.data_sha256`). It fills `args.chat_template_text` and `args.model` (a Hub id: its config.json only),
  and on a resume without --template-date the checkpoint's (the date its dated template rendered).
- `same_resume(ckpt)`: collective, every rank resolved --resume to the same step folder.
- `check(args, margs, dims, budgets, log, tokens, eval_tokens)` -> the plan (parallel/plan.py; None when skipped) of
  the run's flags for its longest sample (`tokens`; --max-len only caps the samples, a row is as long as its data),
  checked against the smallest of the ranks' budgets (parallel/budgets.py's `gather_budgets`), the host memory free
  on a machine shared by the ranks on it. The same decision on every rank: same budgets, same arithmetic, no file
  read (the planner's copies of the flags carry no --init-adapter) and no collective. train.py sizes the offload's
  host buffers from it (`host_each`).
  1. --offload-activations on CUDA whose pinned host bytes ((L - 1) block inputs; parallel/offload.py pins exactly
     those, in its own buffers) exceed the host memory free per rank: ValueError naming both and the fixes. Pinned
     memory cannot be paged out, and past the host's memory the kernel's OOM killer ends the job with no message.
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
"""

from __future__ import annotations

import math
import os
import re
import socket

from parallel.budgets import Budget, host_per_rank

LIVE_FLOOR = 0.95   # measured/planned live peak: the lowest of bench/plan.py's rows (0.95-1.14; H200 0.97-1.02)


def parse(parser, argv: list[str], demo_defaults: dict):
    """(args, demo): argv parsed, with `demo_defaults` under the flags when neither --model nor --data is given."""
    args = parser.parse_args(argv)
    demo = args.model is None and args.data is None
    if demo:
        parser.set_defaults(**demo_defaults)
        args = parser.parse_args(argv)
        if args.eval_split is not None and not any(x.startswith("--eval-d") for x in argv):
            args.eval_data = None   # (the demo's eval file gives way to the records it holds out of its data)
    for k in ("data", "eval_data"):   # one file: a path, as runs before several recorded it
        if isinstance(getattr(args, k), list) and len(getattr(args, k)) == 1:
            setattr(args, k, getattr(args, k)[0])
    return args, demo


def check_start(args, demo: bool):
    """Module docstring. Imports here: `--plan` imports this module and must stay fast."""
    from data import check_file
    from data.mix import check_weights, data_files
    from data.pairs import check_first
    from data.store import file_sha256
    from data.templates import chat_template
    from model.hub import fetch_checkpoint, hub_snapshot, model_fingerprint, same_model
    from model.load import check_weight_headers
    from parallel import checkpoint_folders, outdir, resume, runs
    from parallel.flags import check_flags
    from parallel.mesh import device_type
    from parallel.metrics import check_sinks
    from parallel.plan_totals import REFERENCE_FREE

    args.resume_auto = None   # (recorded: what --resume auto decided)
    if args.resume == "auto":   # first: every check below sees the resume or the fresh run it is
        args.resume, args.overwrite, args.resume_auto = runs.auto_resume(args.out, args.overwrite)
    check_sinks(args.report_to)
    args.chat_template_text = chat_template(args.chat_template)   # the text itself: what config and checkpoints keep
    args.dtype = args.dtype or ("bf16" if device_type() == "cuda" else "fp32")   # as run, so a resume compares it
    if args.objective == "dpo":
        if demo:
            raise ValueError("--objective dpo trains on preference pairs: pass --model and --data (a JSONL of "
                             "{\"prompt\", \"chosen\", \"rejected\"} records); the embedded demo is supervised")
        if args.loss != "cross-entropy":
            raise ValueError("--objective dpo computes its own loss from each sequence's log-probabilities, so "
                             "train.py's LOSS_FN (a per-token loss) cannot apply: set LOSS_FN = None, or train with "
                             "--objective sft")
        if not (math.isfinite(args.dpo_beta) and args.dpo_beta > 0):
            raise ValueError(f"--dpo-beta must be a finite number above 0 (typical: 0.1), got {args.dpo_beta:g}")
        if not 0 <= args.dpo_label_smoothing < 0.5:
            raise ValueError(f"--dpo-label-smoothing must be in [0, 0.5) (the share of pairs taken as mislabeled; "
                             f"typical: 0.1), got {args.dpo_label_smoothing:g}")
        if args.dpo_label_smoothing and args.dpo_loss != "sigmoid":
            raise ValueError(f"--dpo-label-smoothing applies to --dpo-loss sigmoid only, not {args.dpo_loss}: drop it")
        if not (math.isfinite(args.rpo_alpha) and args.rpo_alpha >= 0):
            raise ValueError(f"--rpo-alpha must be a finite number of 0 or more (typical: 1), got {args.rpo_alpha:g}")
        if args.rpo_alpha and args.dpo_loss == "orpo":
            raise ValueError("--rpo-alpha adds the chosen side's NLL, which --dpo-loss orpo has already: drop it")
        if not (math.isfinite(args.simpo_gamma) and args.simpo_gamma >= 0) or args.simpo_gamma != 0.5 and \
                args.dpo_loss != "simpo":
            raise ValueError(f"--simpo-gamma {args.simpo_gamma:g}: SimPO's target margin, a finite number of 0 or more "
                             "(typical: 0.5 to 1.6), with --dpo-loss simpo only")
        if args.dpo_cache_ref and args.dpo_loss in REFERENCE_FREE:
            raise ValueError(f"--dpo-cache-ref keeps the reference model's log-probabilities, and --dpo-loss "
                             f"{args.dpo_loss} has no reference model: drop it")
        if args.train_on_prompt:
            raise ValueError("--train-on-prompt makes a prompt's tokens targets, and a preference loss compares the "
                             "answers (TRL's: each side's completion): drop it, or train it first with --objective sft")
        args.loss = "dpo"   # (recorded as run-defining: what the run minimizes; LOSS_FN is refused beside it)
    else:   # DPO's flags do nothing here, yet would be compared on a resume
        for flag, v, default in (("--dpo-beta", args.dpo_beta, 0.1), ("--dpo-loss", args.dpo_loss, "sigmoid"),
                                 ("--dpo-label-smoothing", args.dpo_label_smoothing, 0.0),
                                 ("--rpo-alpha", args.rpo_alpha, 0.0), ("--simpo-gamma", args.simpo_gamma, 0.5)):
            if v != default:
                raise ValueError(f"{flag} {v} sets a preference loss (--objective dpo), and this run is supervised: "
                                 f"pass --objective dpo to train on preference pairs, or drop {flag}")
        for flag, v in (("--dpo-share-prompt", "holds a preference pair's prompt once"),
                        ("--dpo-cache-ref", "keeps a preference loss's reference log-probabilities")):
            if getattr(args, flag[2:].replace("-", "_")):
                raise ValueError(f"{flag} {v}, and this run is supervised: pass --objective dpo to train on "
                                 "preference pairs, or drop it")
    check_flags(args)
    if args.lr_schedule != "constant" and args.min_lr_ratio is None:   # resolved, as run: a resume compares them
        args.min_lr_ratio = 0.1
    if args.lr_schedule == "wsd" and args.wsd_decay is None:
        args.wsd_decay = 0.1
    args.dpo_reference = None   # DPO's reference: a resume must find the same one (an adapter's bytes, as --data's)
    if args.objective == "dpo" and args.dpo_loss in REFERENCE_FREE:
        args.dpo_reference = "none"
    elif args.objective == "dpo":   # (from --init-adapter: that adapter, held fixed; the policy starts from it)
        ref = os.path.join(args.init_adapter or "", "adapter_model.safetensors")
        if args.init_adapter and not os.path.isfile(ref):   # (a fresh run's check_init_adapter said it already)
            raise ValueError(f"--init-adapter {args.init_adapter!r}: no adapter_model.safetensors there, and a DPO "
                             "run from an adapter needs it on a resume too (its reference model): pass the adapter's "
                             "folder")
        args.dpo_reference = f"adapter sha256 {file_sha256(ref)}" if args.init_adapter else "base"
    check_weights(args.data_weights, data_files(args.data), demo)
    args.data_mix = resume.data_mix(args.data_weights)   # "rotate" with a share of a file's records, else None
    # what keeps these two flags from ever acting, each said on its own (until 2026-12-05 one text listed all three)
    never = [w for w, bad in (("it has no evaluation data: pass --eval-data FILE (or --eval-split)",
                               not (args.eval_data or args.eval_split)),
                              ("--eval-every 0 evaluates only at the end: pass --eval-every N", not args.eval_every))
             if bad]
    if args.keep_best and never:
        raise ValueError("--keep-best keeps the checkpoint of the lowest eval loss, saved at each evaluation, but "
                         + "; ".join(never))
    if args.early_stop is not None and args.early_stop < 1:
        raise ValueError(f"--early-stop {args.early_stop}: N, the evaluations in a row without improvement that end "
                         "the run, must be 1 or more")
    if args.early_stop is not None and never:
        raise ValueError(f"--early-stop {args.early_stop} ends the run after {args.early_stop} evaluations in a row "
                         "without improvement, but " + "; ".join(never))
    if not (math.isfinite(args.early_stop_delta) and args.early_stop_delta >= 0):
        raise ValueError(f"--early-stop-delta must be 0 or more (an improvement is a fall larger than it), got "
                         f"{args.early_stop_delta:g}")
    if (args.model is None) != (args.data is None):
        raise ValueError("pass both --model and --data (or neither, for the embedded demo)")
    files = data_files(args.data)
    for flag, paths, fix in (("--data", files, "--data-weights 2 trains a file's samples twice"),
                             ("--eval-data", data_files(args.eval_data), "each eval file counts once")):
        seen = {}   # (device, inode) -> where it was named (a file twice: trained twice, maybe unmeant)
        for i, f in enumerate(paths if not demo else ()):   # (the demo's files are built once the group is up)
            st = os.stat(check_file(f, flag))
            check_first(f, flag, args.objective)   # (a DPO run given supervised records, or the other way round)
            if (at := seen.setdefault((st.st_dev, st.st_ino), i)) != i:
                twice = paths[at]
                raise ValueError(f"{flag} names {twice!r}" + (f" and {f!r}, the same file" if twice != f else " twice")
                                 + f": name each file once; {fix}")
    runs.check_free(args.out or (args.resume and outdir.run_of(args.resume)))   # a live run's: said as such, first
    if args.out and args.resume and (theirs := outdir.run_of(args.resume)):   # its checkpoints' live run, into another
        runs.check_free(theirs, args.resume)   # --out: a step it rotates away failed after the data (helper 54)
    outdir.check_out(args.out, resume=args.resume, overwrite=args.overwrite)
    # a resume must find the same bytes (one file's: its sha256, as runs from before several files recorded it)
    args.data_sha256 = None if demo else file_sha256(files[0]) if len(files) == 1 else [file_sha256(f) for f in files]
    name = args.model   # a Hub id ("org/name"): its config.json now, its cache directory from here on
    args.model = fetch_checkpoint(name, config_only=True) if not demo else name
    if not demo and os.path.isdir(args.model):   # recorded absolute: an export from another directory names this base
        args.model = os.path.abspath(args.model)
        real = os.path.realpath(args.model)
        if args.out and (os.path.realpath(args.out) + os.sep).startswith(real + os.sep):
            raise ValueError(f"--out {args.out!r} lies inside --model {args.model!r}: the run's files would mix with "
                             "the model's (and travel with every copy of it); pass a directory outside it")
    # what its files hold (a resume must find the same base, not only the same path); a Hub model's commit is compared
    local = not demo and not hub_snapshot(args.model)
    args.model_sha256 = model_fingerprint(args.model) if local else None
    if local:   # its weight files are there and whole (not a Git LFS pointer, a cut download): said before anything
        check_weight_headers(args.model)
    ckpt = checkpoint_folders.resolve(args.resume) if args.resume else None
    if ckpt:
        meta = checkpoint_folders.read_meta(ckpt)
        if args.template_date is None:   # the date its dated template rendered, whatever today is
            args.template_date = meta.get("args", {}).get("template_date")
        if args.data_mix:   # the checkpoint's way of taking shares ("fixed": a run from before they rotated)
            had = meta.get("args", {})
            args.data_mix = (had["data_mix"] if "data_mix" in had else
                             resume.data_mix(had.get("data_weights"), before=True)) or args.data_mix
        was = meta.get("args", {}).get("model_sha256")
        if was and was != args.model_sha256 and same_model(args.model, was):   # recorded by the rule of 2026-12-03
            args.model_sha256 = was   # (every weight-like file): the same files, kept as recorded
        resume.check_resume(meta.get("args", {}), vars(args), ckpt_step=meta["step"])
        if args.profile is not None and args.profile <= meta["step"]:
            raise ValueError(f"--profile {args.profile}: this run resumes after step {meta['step']}; profile a "
                             "later step")
    return name, ckpt


def same_resume(ckpt: str | None) -> None:
    """Collective: every rank resolved --resume to the same step folder (each resolves it alone, before the process
    group: a filesystem that nodes see differently, or a save still syncing, could give them different steps, whose
    collectives would then pair up wrongly), else every rank raises one error naming them."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), ckpt and os.path.basename(os.path.normpath(ckpt))))
    if len({step for _, step in every}) > 1:
        said = "; ".join(f"rank {r} ({host}): {step or 'no checkpoint'}" for r, (host, step) in enumerate(every))
        raise ValueError(f"--resume: the ranks resolved different checkpoints ({said}); every node must see the same "
                         "OUT/ckpt (a shared filesystem, done syncing): pass the step folder itself to pin one")


def planning_copy(args, **kw):
    """The run's flags for the planner's checks on every rank alike: no --init-adapter (its files are read by the run's
    own check once; read again per candidate, one rank's failure would leave the others waiting)."""
    from parallel.plan_search import _with
    return _with(args, init_adapter=None, **kw)


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
        said = (f"--offload-activations pins the checkpointed blocks' inputs (all but the first) in host memory, "
                f"{gb(p.host)} per rank for {span}, more than the {gb(host)} free per rank{on_host}: {gb(hb.host)} "
                f"{hb.host_where} on {hb.machine}, shared by {on} rank{'s' * (on > 1)}. Pinned memory cannot be paged "
                "out. Lower --max-len, run fewer ranks per machine, or drop --offload-activations; `train.py --plan "
                "--max-len auto --host-mem GB` gives the longest that fits")
        if args.mem_check:
            raise ValueError(f"{said} (--no-mem-check runs it anyway)")
        log(f"warning: {said}")
    if p.total <= dev.device:
        log(f"memory: planned {gb(p.total)} per rank" + (f" and {gb(p.host)} pinned host" if p.host else "")
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
