"""What train.py says to the person running it, as text: its start-up lines, the way on after a stop, and the one
`error:` line a failure ends with. Kept here so train.py's sections read in one sitting (STYLE.md's budget).

Contract:
- `log0(*a)`: print on rank 0 only (flushed): every line a run says goes through it.
- `ShowDefaults`: --help adds each flag's default where its text does not say it.
- `start`, `resumed`, `length`: the start-up lines, each passed to `log` (rank 0's print) where there is something
  to say. They tell what a run
  allows but a user should know (a context past the model's, another --init-adapter, a --global-batch past the data,
  a warmup longer than the run); train.py logs them on rank 0. They read flags, counts and (`resumed`) the checkpoint's
  metadata only, so every rank decides alike; `resumed` and `length` raise ValueError for what a run refuses (a resume
  of a run that stopped early under the same --early-stop, a --profile step the run does not have), each after the
  lines before it are said; `length` returns the run's steps (`run_length.total_steps`, or where an early stop ended
  it).
- `model_line`, `out_line`: the `model:` and `out:` lines.
- `way_on(out, auto, resumed)`: how a run stopped before its end goes on; never advice the run would refuse.
- `exit_code(main, argv)`: main's exit code, one `error:` line for the errors whose message is the fix (flags, data,
  a full disk with the way on), Stopped's code for a signal, 130 for Ctrl-C before the stop handlers.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from parallel import guard, signals
from parallel.preference import Preference


def log0(*a) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


class ShowDefaults(argparse.HelpFormatter):
    """--help adds each flag's default where its text does not say it (none and off: nothing to say)."""

    def _get_help_string(self, action):
        h = action.help or ""
        quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS or \
            "%(default)" in h or "default" in h   # (0 and 0.0 are said: `in (None, False)` took them for off)
        return h if quiet else h + " (default: %(default)s)"


def _say(log, lines) -> None:
    for line in lines:
        if line:
            log(line)


def start(args, margs, dims, ckpt: str | None, log, default_loss: bool = True) -> None:
    """The layout and loss line, then the notes about the model and --init-adapter (past the checks, before data).
    `default_loss`: train.py's LOSS_FN is None (a fork's LOSS_FN may be recorded as "cross-entropy": `recorded_as`)."""
    from model.adapter_read import init_adapter_note  # (peft: seconds to import; only a run gets here)

    dpo = args.objective == "dpo"
    if dpo:
        ref = ("none" if args.dpo_reference == "none" else f"--init-adapter {args.init_adapter}, held fixed"
               if args.init_adapter else "the base model (LoRA off)") + " (each pair's kept: --dpo-cache-ref)" * bool(
            args.dpo_cache_ref)
        loss = f"{Preference.from_args(args)}, reference: {ref}"
    elif default_loss and getattr(args, "sft_loss", "ce") == "dft":   # (the steps' `loss` is not a cross-entropy)
        loss = ("DFT: each target's cross-entropy × its probability, held constant (--sft-loss dft); the steps' loss "
                "is DFT's, eval_loss the cross-entropy")
    elif default_loss:   # (LOSS_FN None: the fused default)
        loss = "cross-entropy"
    else:   # a fork's LOSS_FN: its first line of code
        body = [x.strip() for x in args.loss.splitlines()[1:] if x.strip() and not x.strip().startswith(("#", '"'))]
        loss = f"LOSS_FN: {(body or [args.loss])[0][:120]} ... (all: config.json's loss)"
    resumed_with_init = ckpt and args.init_adapter and (   # (the same command plus --resume: allowed, and said)
        f"note: --init-adapter {args.init_adapter} is " + ("read as DPO's reference only" if dpo and
                                                            args.dpo_reference != "none" else "not read") +
        f": the run resumes {ckpt}, whose LoRA weights (trained on from wherever the run started) it continues")
    _say(log, [f"layout: {dims}\nloss: {loss}",
               margs.beyond_context(args.max_len),   # allowed (that is how a context is extended), but said
               dpo and Preference.from_args(args).note(args.lora_dropout),
               init_adapter_note(args.init_adapter if not ckpt else None, args.chat_template_text, args.model_sha256,
                                 args.quant, margs.rope_overrides() if args.rope_scaling is not None else None),
               resumed_with_init])


def resumed(args, argv: list[str], demo: bool, ckpt: str | None, stats, eval_stats, log) -> int | None:
    """Once the data are tokenized, the notes; returns the step a run that stopped early ended at, or None. A --max-len
    that was not given but cut records; a resume whose bytes tokenize otherwise now (an edited tokenizer or template
    file); a resume of a run that stopped early (--early-stop): refused, but for a requeue (--resume auto)."""
    notes, ended = [], None
    if not demo and (stats.split or stats.truncated) and not any(   # (argparse takes --max-l for --max-len)
            x.split("=")[0] in ("--max-l", "--max-le", "--max-len") for x in argv):
        notes.append(f"note: --max-len was not given, so it is {args.max_len}: {stats.split + stats.truncated} "
                     f"records were split or cut to it (the longest has {stats.longest} tokens); pass --max-len N")
    if ckpt:
        from parallel import checkpoint_folders, keep_best, resume

        meta = checkpoint_folders.read_meta(ckpt)
        notes.append(resume.same_tokens(meta.get("args", {}), vars(args),
                                        split=stats.split + (eval_stats.split if eval_stats else 0)))
        _say(log, notes)   # (said before a refusal below, as they were)
        notes = []
        if why := keep_best.exhausted(meta, args, ckpt):   # it would stop again at once (once the eval samples
            if not args.resume_auto:   # are known: other ones count anew)
                raise ValueError(why)
            ended = meta["step"]   # a requeue of it: it had ended there
            notes.append(f"note: --resume auto: the run stopped early at step {ended} (--early-stop)")
    _say(log, notes)
    return ended


def length(args, order, dpo: bool, ckpt: str | None, ended: int | None, lr_at, log) -> int:
    """The run's steps (`run_length.total_steps`, or `ended`: where a run that stopped early ended), and its length
    against its data and its LR schedule: what it allows but a user should know, each said before a refusal."""
    from parallel import run_length

    n, what = order.size(0), ("sample", "pair")[dpo]   # (n: a pass; with rotating --data-weights shares, the first's)
    if args.global_batch > n:   # allowed (a quick run on a few records), but said (before total_steps' refusal)
        log(f"note: --global-batch {args.global_batch} is more {what}s than --data holds ({n}" +
            (", past --eval-split's" if args.eval_split else "") + f"): each step takes each {what} about "
            f"{args.global_batch / n:.3g} times (repeats add compute, not data)")
    steps = run_length.total_steps(args, ckpt, order)   # --steps, --epochs or one epoch (as a resume's run)
    steps = ended if ended is not None else steps   # (a run that stopped early ended there)
    notes, epochs, sched = [], args.epochs or 1, args.schedule_steps or steps
    if not args.steps and (extra := steps * args.global_batch - order.samples_in(epochs)) > 0:
        notes.append(f"note: {'one epoch' if epochs == 1 else f'{epochs:g} epochs'}, {n} {what}s in {steps} "
                     f"step{'s' * (steps != 1)} of "
                     f"{args.global_batch}: the last step also trains {extra} " + (
                         "of the next epoch's order" if epochs == int(epochs) else "more of the data order") +
                     " (--steps sets the length)")
    notes.append(run_length.schedule_note(ckpt, sched, "--epochs" if args.epochs else "--steps"))
    if steps < args.warmup:   # a short run that never leaves warmup
        notes.append(f"note: --warmup {args.warmup} is longer than the run's {steps} steps: the LR peaks at "
                     f"{lr_at(steps - 1, args, sched):.3g}, not --lr {args.lr:g}")
    if args.lr_schedule == "wsd" and round(args.wsd_decay * sched) == 0:
        notes.append(f"note: --wsd-decay {args.wsd_decay:g} of {sched} steps is no step: the LR stays at --lr to the "
                     "end (a larger --wsd-decay, or more steps, decays it)")
    _say(log, notes)   # (before the refusal: a user sees them with it, as before)
    if args.profile is not None and not 1 <= args.profile <= steps:
        raise ValueError(f"--profile {args.profile}: this run has steps 1..{steps}; pick one of them "
                         "(not step 1 for timings: it also pays the kernels' first-call setup)")
    return steps


def model_line(model, margs, args, ckpt: str | None, dtype, built_s: float) -> str:
    """The `model:` line: its size, what trains (LoRA; --train-norms' and --train-embeddings' weights apart), from
    which --init-adapter, its numerics and how long the build took."""
    from model.norms import is_embed_weight, is_norm_weight
    trained = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    more = {k: sum(c for n, c in trained if of(n)) for k, of in (("norms", is_norm_weight),
                                                                 ("embedding", is_embed_weight))}
    return (f"model: {margs.named} {margs.n_params / 1e6:.1f}M params, LoRA "   # (exact counts, as peft's
            f"{sum(c for _, c in trained) - sum(more.values()):,} trainable"   # print_trainable_parameters)
            + "".join(f" + {k} {v:,}" for k, v in more.items() if v)
            + f"{' from ' + args.init_adapter if args.init_adapter and not ckpt else ''}, "
            f"quant {args.quant}, {dtype}, built in {built_s:.1f}s")


def out_line(run, args, ckpt: str | None) -> str:
    """The `out:` line: the run's folder, with what --resume auto chose and what --overwrite deletes (runs.RunDir)."""
    said = ["--resume auto: " + {"resumed": f"continuing from {ckpt}", "fresh": "no run there yet, a fresh one",
                                  "restarted": "its run saved no whole step, so it starts again"}[args.resume_auto]
            ] if args.resume_auto else []
    if run.pending:
        said.append(("" if args.resume_auto else "--overwrite: ") + ", ".join(run.pending)
                    + " are deleted once the model is built")
    return f"out: {run.path}" + "".join(f" ({x})" for x in said)


def way_on(out: str | None, auto: bool = False, resumed: bool = False) -> str:
    """How a run stopped before its end goes on: from its newest whole step, else started again (so its advice is
    never refused: --overwrite beside --resume is)."""
    from parallel import checkpoint_folders, outdir

    ckpt = out and os.path.join(out, "ckpt")   # a whole step folder there to resume (as save() names them)
    has = ckpt and checkpoint_folders.has_step(ckpt)
    if auto:
        return "run the same command again (--resume auto " + (f"continues from {ckpt})" if has else "starts it again)")
    if has:
        return f"run the same command with --resume {ckpt}"
    if out and resumed:   # (this --out now holds the start's files: the same command is refused, --overwrite too)
        return f"run it with a new --out ({out} holds this start's files but no checkpoint)"
    if out and not outdir._entries(out):   # (a stop before anything but the lock: the same command takes it)
        return f"run the same command again ({out} holds nothing of it yet)"
    return f"run the same command with --overwrite ({out} holds no checkpoint)" if out else "run the same command again"


def exit_code(main, argv=None) -> int:
    """main(argv)'s exit code, and one `error:` line for the errors whose message is the fix."""
    try:
        main(argv)
    except (ValueError, FileNotFoundError) as e:   # configuration and data errors: the message is the fix
        guard.say_error(e)   # once per job when every rank raised it; a rank's own (a file one node lacks) too
        return 2
    except (OSError, RuntimeError) as e:   # a full disk or read-only folder while saving: said so, with the way on
        if not guard.disk_error(e):
            raise
        said = f"{e.during} failed ({type(e).__name__}: {e})" if getattr(e, "during", None) else str(e)
        guard.say_error(f"{said}. Free space (or fix the folder), then " + way_on(*getattr(e, "way_on", (None,))))
        return 2
    except signals.Stopped as e:   # a signal: the finished steps are saved, rank 0 said where
        return e.code
    except KeyboardInterrupt as e:   # Ctrl-C before the stop handlers (start-up, tokenizing, the model build), or a
        guard.say_error("interrupted (SIGINT): " + way_on(*getattr(e, "way_on", (None,))))   # second one: one line,
        return 130   # (128 + SIGINT)                                                           # not a traceback
    return 0


def done_line(args) -> str:
    """The run's last line: where its adapter and metrics are (and TensorBoard's folder, when it writes one)."""
    from parallel.metrics import TB_DIR
    tb = f" and {args.out}/{TB_DIR} (tensorboard --logdir {args.out}/{TB_DIR})"
    return (f"done: adapter in {args.out}/adapter, metrics in {args.out}/metrics.jsonl"
            + (tb if "tensorboard" in (args.report_to or ()) else ""))
