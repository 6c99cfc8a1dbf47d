"""train.py's checks at start-up before the process group: flags, files and the resume. Then, once the data are
tokenized and before any weight is read, the plan of the run's flags against every rank's memory:
parallel/preflight_memory.py.

Contract:
- `parse(parser, argv, demo_defaults)` -> (args, demo): a planner's flag without --plan is refused by name, and so is
  --plan abbreviated (train.py routes the whole word only: `--pla` started a run until 2026-12-06); no
  --model and no --data is the demo, its defaults under the flags given; a --data/--eval-data of one file is its path
  (as runs before several files recorded it).
- `check_start(args, demo, code)` -> (the --model given, the checkpoint to resume or None): train.py's `code`
  (LOSS_FN, lr_at, make_optimizer) recorded into `args` (parallel/recorded.py; a LOSS_FN that is not a sum, and
  flags make_optimizer refuses, are refused), then every check that needs no process group, before anything is
  written, so a refusal leaves every file as it was: the flags (`check_flags`), --model with --data, the data files,
  --out against --resume/--overwrite, a resume's run-defining flags and data bytes (`args.data_sha256`). It fills
  `args.chat_template_text` and `args.model` (a Hub id: its config.json only), and on a resume without
  --template-date the checkpoint's (the date its dated template rendered).
- `same_everywhere(name, args, ckpt)`: collective, every rank read the same Hub commits (--model, --init-adapter,
  hf:// --data: data/hub_data.py, whose files check_start fetched after the flag checks) and
  `same_resume(ckpt)`: resolved --resume to the same step folder. `model_files(name, args, margs, log)`: collective,
  once the layout passed its checks: --model's weights fetched, their shapes against config.json said.
"""

from __future__ import annotations

import math
import os
import socket

from parallel.plan_cli import PLAN_FLAGS

F32_MAX = 3.4028234663852886e38   # torch.finfo(torch.float32).max (torch is not imported here: --plan stays fast)


def parse(parser, argv: list[str], demo_defaults: dict):
    """(args, demo): argv parsed, with `demo_defaults` under the flags when neither --model nor --data is given."""
    if given := [f for f in PLAN_FLAGS if any(x == f or x.startswith(f + "=") for x in argv)]:
        raise ValueError(f"{', '.join(given)}: the planner's flag{'s' * (len(given) > 1)}, not a run's: add --plan "
                         "(`train.py --plan --help` lists them)")
    args = parser.parse_args(argv)
    if getattr(args, "plan", False):   # (argparse took an abbreviation; train.py hands the whole word to the planner)
        short = [x for x in argv if x.startswith("--") and len(x) > 2 and "--plan".startswith(x.partition("=")[0])]
        raise ValueError(f"{', '.join(short) or '--plan'}: write --plan in full (an abbreviation of it would start "
                         "a run, not print the plan)")
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


def check_start(args, demo: bool, code: tuple | None = None):
    """Module docstring. Imports here: `--plan` imports this module and must stay fast."""
    from data import check_file
    from data.hub_data import resolve as resolve_hub_data
    from data.mix import check_weights, data_files
    from data.pairs import check_first
    from data.store import file_sha256
    from data.templates import chat_template
    from model.config import ModelArgs
    from model.hub import fetch_checkpoint, hub_snapshot, model_fingerprint, same_model
    from model.load import read_args
    from model.load_checks import check_config_quant, check_weight_headers
    from model.lora_spec import run_targets
    from parallel import checkpoint_folders, hub_push, outdir, recorded, resume, runs
    from parallel.flags import check_flags
    from parallel.mesh import device_type
    from parallel.metrics import check_sinks
    from parallel.plan_totals import REFERENCE_FREE

    refused = code and recorded.record(args, *code)   # train.py's code, as flags: a resume must keep it
    if code and args.objective != "dpo" and (why := recorded.not_a_sum(code[0])):   # (a mean trained on: the wrong
        raise ValueError(why)   # loss on every layout but one; dpo refuses any LOSS_FN below)
    if code and code[0] is not None and getattr(args, "sft_loss", "ce") != "ce":   # (it weights the fused loss)
        raise ValueError(f"--sft-loss {args.sft_loss} weights the fused cross-entropy, and train.py's LOSS_FN replaces "
                         "it: set LOSS_FN = None, or drop --sft-loss (weight the tokens in LOSS_FN itself)")
    args.resume_auto = None   # (recorded: what --resume auto decided)
    if args.resume == "auto":   # first: every check below sees the resume or the fresh run it is
        args.resume, args.overwrite, args.resume_auto = runs.auto_resume(args.out, args.overwrite)
    check_sinks(args.report_to)
    hub_push.check(args)   # --push-to-hub's id, and a token: a run that cannot upload at its end is refused now
    args.chat_template_text = chat_template(args.chat_template)   # the text itself: what config and checkpoints keep
    args.dtype = args.dtype or ("bf16" if device_type() == "cuda" else "fp32")   # as run, so a resume compares it
    if args.eval_positions and args.loss != "cross-entropy":   # (it reads the fused cross-entropy's per-token losses)
        raise ValueError("--eval-positions splits the cross-entropy over the eval targets by position, which "
                         "train.py's LOSS_FN (a sum over each chunk) does not give: set LOSS_FN = None; or drop "
                         "--eval-positions")
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
        if args.dpo_loss == "ipo" and args.dpo_beta < 0.5 / math.sqrt(F32_MAX):   # (2.7e-20; until 2026-12-06 a
            raise ValueError(f"--dpo-beta {args.dpo_beta:g} with --dpo-loss ipo: IPO's loss starts at 1 / (2·beta)², "
                             "past float32's range, where its gradients overflow; IPO's beta (TRL's tau) is "   # beta
                             "typically 0.01 to 1")   # of 1e-200 was a ZeroDivisionError after the weights were read)
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
    if (args.model is None) != (args.data is None):
        raise ValueError("pass both --model and --data (or neither, for the embedded demo)")
    resolve_hub_data(args)   # hf:// --data/--eval-data: matched, then fetched; every check below reads local files
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
        check_weight_headers(args.model, args.quant)
    elif not demo:   # a Hub id: its config.json's 4-bit type, before gigabytes of weights are fetched
        check_config_quant(args.model, args.quant, name)
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
        # the targets as the checkpoint's run recorded them: its model's (model.lora_spec.run_targets: the linear-layer
        # names dropped on a model without them, the experts' when not given; parallel.flags.check_model_flags sets
        # them, and says why, for every run)
        margs = ModelArgs() if demo else read_args(args.model)   # (the demo's: a Llama, built later)
        targets = ",".join(run_targets(args.lora_targets, margs)[0])
        resume.check_resume(meta.get("args", {}), vars(args) | {"lora_targets": targets}, ckpt_step=meta["step"])
        if args.profile is not None and args.profile <= meta["step"]:
            raise ValueError(f"--profile {args.profile}: this run resumes after step {meta['step']}; profile a "
                             "later step")
    if refused:   # (after the flag checks, which name a flag it refuses, as --lr nan, better)
        raise ValueError(f"make_optimizer refuses this run's flags: {refused}")
    return name, ckpt


def same_everywhere(name: str, args, ckpt: str | None) -> None:
    """Collective: every rank read one Hub commit of --model (`name` as given), of --init-adapter (fetched in
    check_flags: the ranks' snapshot paths differ, their commits are compared) and of hf:// --data/--eval-data, and
    resumes the same step."""
    from data.hub_data import same_commits
    from model.hub import same_snapshot

    same_snapshot(name, args.model)
    same_commits(args)   # (--data's and --eval-data's hf:// entries)
    if args.init_adapter:
        same_snapshot("", args.init_adapter, flag="--init-adapter")
    same_resume(ckpt)


def model_files(name: str, args, margs, log) -> None:
    """Collective, once the layout passed its checks: a Hub --model's weights and tokenizer fetched on every rank (its
    config.json only until now; a failure on one raises on all: model.hub.same_snapshot), then its weight headers
    against config.json's sizes (model.load_checks), what differs said before the data are tokenized."""
    from model.hub import same_snapshot
    from model.load_checks import check_config_shapes

    same_snapshot(name, args.model, fetch=True)
    if note := check_config_shapes(args.model, margs, args.quant):
        log(note)


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
