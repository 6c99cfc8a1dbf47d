"""What a resume must keep, and what it may change.

Contract:
- `check_resume(ckpt_args, args, ckpt_step=)` (preflight, before the process group) compares the flags in
  `RUN_DEFINING`, and any other value both record that is not in `LAYOUT` or `FREE` (a fork's new flag defines the run
  until listed there), and names each difference; `LAYOUT` and `FREE` flags may change. train.py's code is compared
  as parallel/recorded.py records it: the loss, the optimizer, the LR schedule. The same files under other paths
  (relative from elsewhere, a symlink) are the same `--model`/`--data`, and so are copies at other paths whose
  recorded fingerprints (`data_sha256`: the files' bytes, in order; `model_sha256`: config, headers, first and last
  MB of each weight file) are the checkpoint's; a
  checkpoint from before `--dtype` was resolved is not compared on it. `--steps` below the checkpoint's step, or none
  where the run had one, is refused.
- `same_tokens(ckpt_args, args, split)` (train.py, once the data are tokenized): the checkpoint's run trained on the
  same tokens (`data_tokens`: samples, tokens and their sha256). The same --data bytes tokenize otherwise under an
  edited tokenizer or chat template file in the model's folder, or another transformers/tokenizers version; the step's
  samples would then be other ones, in another order. A checkpoint from before the record is not compared. One from
  before --long-text (`split`: this run's split records) resumes as long as nothing is split (it truncated them).
- How long a run trains (`total_steps`) and the note when a resume changes it (`schedule_note`): parallel/run_length.py.
- `own_checkpoint(ckpt, out)`: the resumed step folder is in OUT/ckpt itself (train.py may then `checkpoint.branch`
  it), not another run's.
"""

from __future__ import annotations

import hashlib
import json
import os

from data.hub_data import moved as hub_moved
from data.mix import data_files
from model.hub import hub_snapshot
from parallel.recorded import NO_SOURCE, first_difference, same_optimizer

# flags that change the math of the steps still to come: a resume must keep them. Any other recorded value not in
# LAYOUT or FREE is compared too, so a fork's new flag is run-defining until it is listed in FREE
RUN_DEFINING = ("model", "quant", "dtype", "data", "max_len", "seed", "global_batch", "lora_r", "lora_alpha",
                "rslora", "dora", "lora_layers", "train_norms", "train_embeddings",
                "lora_dropout", "lora_targets", "lr", "warmup", "weight_decay", "clip", "rope_scaling",
                "chat_template_text", "data_sha256", "template_date", "loss", "optimizer", "optimizer_code",
                "schedule", "data_tokens", "long_text", "model_sha256", "eval_split", "data_weights", "data_mix",
                "objective", "dpo_beta", "dpo_reference", "dpo_loss", "dpo_label_smoothing", "rpo_alpha", "simpo_gamma",
                "lr_schedule", "min_lr_ratio", "wsd_decay", "lora_plus_ratio", "train_on_prompt",
                "neftune_alpha", "sft_loss")
# flags that only say how the same math is spread over ranks: a resume may change them
LAYOUT = ("cp", "dp_shard", "dp_replicate", "cp_impl", "ulysses_degree", "micro_batch", "pack", "ac", "ac_group",
          "ac_blocks", "ac_keep_attn", "tiled_mlp", "tiled_attn", "offload_activations", "ple_on_device", "compile",
          "dpo_share_prompt", "dpo_cache_ref")
# flags about the run's files, logs, checks and evaluation, not its training math (steps, epochs, schedule_steps:
# checked below; chat_template: its text is; init_adapter: a resume's LoRA comes from the checkpoint; hub_data: the
# hf:// entries' commits, whose files and bytes are compared, and named when they differ): a resume may change them
FREE = ("out", "resume", "overwrite", "save_every", "save_minutes", "keep_ckpts", "keep_best", "eval_data",
        "eval_every", "no_progress", "timeout", "profile", "mem_phases", "mem_trace", "mem_check", "data_cache",
        "peak_tflops", "max_nonfinite", "plan", "fast", "fast_flags", "init_adapter", "steps", "epochs",
        "schedule_steps", "chat_template", "data_workers", "early_stop", "early_stop_delta", "eval_tokens",
        "resume_auto", "report_to", "eval_positions", "hub_data", "push_to_hub", "hub_private")
# train.py's lr_at until 2026-12-05 (before --lr-schedule), as recorded: the math today's (its sha256 below) computes
# with --lr-schedule cosine --min-lr-ratio 0.1, the values a run from before is compared with, so it resumes
# (test_train_runs -k lr_schedule; an edited lr_at, another sha256: refused, as any other change of its code)
LR_AT_BEFORE = ("lr_at: def lr_at(step, args, total):\n    if step < args.warmup:\n        return args.lr * (step + 1) "
                "/ args.warmup\n    t = (step - args.warmup) / max(1, total - args.warmup)\n    return args.lr * "
                "(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))")
LR_AT_SINCE = "ef35e1372ab8dcbee108957daa36c25d29aa60eaf84275d81740e0a01d63db5d"
CODE = {"loss": "the loss (train.py's LOSS_FN)", "schedule": "the LR schedule (train.py's lr_at)",
        "optimizer_code": "the optimizer's code (train.py's make_optimizer)"}


def data_mix(weights, before: bool = False) -> str | None:
    """How a run's --data-weights take a share of a file's records (data/mix.py): "rotate", the next share each epoch;
    "fixed", the same share every epoch, as runs from before 2026-12-04 (`before`: recorded no data_mix) took it,
    which their resumes keep; None without a share (no weights, or whole ones)."""
    if not weights or all(float(w).is_integer() for w in weights):
        return None
    return "fixed" if before else "rotate"


def own_checkpoint(ckpt: str | None, out: str) -> bool:
    """`ckpt` (a step folder) is in OUT/ckpt itself, not in another run's below OUT or elsewhere."""
    try:
        return bool(ckpt) and os.path.samefile(os.path.dirname(os.path.normpath(ckpt)), os.path.join(out, "ckpt"))
    except OSError:   # no OUT/ckpt
        return False


def _norm(flag: str, v):
    if flag in ("rslora", "dora", "train_norms", "train_embeddings"):   # absent (runs from before the flag): off
        return bool(v)
    if flag == "lora_layers":   # None: every block, as runs from before the flag adapted
        return v or "all"
    if flag == "lora_targets" and isinstance(v, str):
        return sorted({t.strip() for t in v.split(",") if t.strip()})   # (a name typed twice: once, as now)
    if flag == "model" and isinstance(v, str):   # a Hub cache directory: its commit, wherever the cache lives
        return hub_snapshot(v) or os.path.normpath(v)
    if flag == "data" and v is not None:   # one file: a string (runs from before several files) or a list of one
        return [os.path.normpath(f) for f in ([v] if isinstance(v, str) else v)]
    if flag == "data_sha256" and isinstance(v, str):   # one file's (a list of several)
        return [v]
    if flag == "data_weights" and v is not None and all(w == 1 for w in v):   # all 1: no weights
        return None
    if flag == "rope_scaling":   # the scaling it means: "yarn:4" = "yarn:4.0" = its JSON spelling
        from model.rope_read import rope_scaling_flag
        try:
            return json.dumps(rope_scaling_flag(v), sort_keys=True)
        except ValueError:
            return v
    return v


def _same_path(a, b) -> bool:
    """Two spellings of one existing file or directory (a relative path from elsewhere, a symlink); lists of them
    (--data's files), one by one."""
    if isinstance(a, (list, str)) and isinstance(b, (list, str)) and (isinstance(a, list) or isinstance(b, list)):
        a, b = ([x] if isinstance(x, str) else x for x in (a, b))
        return len(a) == len(b) and all(_same_path(x, y) for x, y in zip(a, b))
    try:
        return isinstance(a, str) and isinstance(b, str) and os.path.samefile(a, b)
    except OSError:
        return False


def _template_diff(ckpt_args: dict, args: dict) -> str:
    """The --chat-template difference as the flag to pass (runs keep the template's text, not its name)."""
    from data.templates import TEMPLATES

    def said(text, spec):
        if text is None:
            return "the model's own template (no --chat-template)"
        name = next((n for n, t in TEMPLATES.items() if t == text), None)
        return f"--chat-template {name}" if name else f"--chat-template {spec!r} ({len(text)} characters)"
    had = ckpt_args["chat_template_text"]
    name = next((n for n, t in TEMPLATES.items() if t == had), None)
    fix = ("drop --chat-template" if had is None else f"pass --chat-template {name}" if name else
           f"pass --chat-template with a file holding the text of args.chat_template_text in the checkpoint's "
           f"meta.json (its run read {ckpt_args.get('chat_template')!r})")
    return (f"--chat-template: the checkpoint's run rendered its chats with {said(had, ckpt_args.get('chat_template'))}"
            f", this run with {said(args.get('chat_template_text'), args.get('chat_template'))}: {fix}")


def _reference_diff(ckpt_args: dict, args: dict) -> str:
    """A DPO run's reference that is not its checkpoint's: the base (LoRA off) or an --init-adapter's bytes."""
    said = lambda ref, path: ("the base model (LoRA off)" if ref == "base" else "none" if ref == "none" else
                              f"the adapter {path!r} (adapter_model.safetensors sha256 {ref.split()[-1][:12]}...)")
    had, now = ckpt_args["dpo_reference"], args.get("dpo_reference")
    fix = ("drop --init-adapter" if had == "base" else f"pass --init-adapter with that adapter's files (the "
           f"checkpoint's run read {ckpt_args.get('init_adapter')!r}; the same bytes anywhere will do)")
    return (f"DPO's reference: the checkpoint's run's was {said(had, ckpt_args.get('init_adapter'))}, this run's "
            f"{said(now, args.get('init_adapter'))}: {fix}")


def check_resume(ckpt_args: dict, args: dict, *, ckpt_step: int | None = None) -> None:
    """Refuse a resume whose run-defining flags differ from the checkpoint's; name each difference.

    `args` are this run's flags with defaults resolved, as train.py saves them. Flags the
    checkpoint does not record (or this run lacks) are not compared."""
    diffs = []
    ckpt_args = {"rope_scaling": None, "rslora": False, "dora": False, "lora_layers": None, "train_norms": False,
                 "train_embeddings": False, "chat_template_text": None,
                 "eval_split": None,
                 "data_weights": None, "data_mix": data_mix(ckpt_args.get("data_weights"), before=True),
                 "dpo_reference": "base" if ckpt_args.get("objective") == "dpo" else None, "dpo_loss": "sigmoid",
                 "dpo_label_smoothing": 0.0, "rpo_alpha": 0.0, "simpo_gamma": 0.5, "lr_schedule": "cosine",
                 "min_lr_ratio": 0.1, "wsd_decay": None, "lora_plus_ratio": None, "neftune_alpha": None,
                 "train_on_prompt": False, "sft_loss": "ce", **ckpt_args}   # runs from before these flags: without them
    was, objective = ckpt_args.get("objective", "sft"), args.get("objective")
    if objective is not None and was != objective:   # (said alone: every other difference follows from it)
        out = ckpt_args.get("out") or "OUT"
        raise ValueError(f"--resume: the checkpoint's run trained --objective {was}, this one --objective {objective}: "
                         f"a resume continues the same run. To train {objective} from where it got to, start a fresh "
                         f"run from its adapter: --objective {objective} --init-adapter {out}/adapter (or a step's: "
                         "`python -m "
                         "parallel.checkpoint`) and another --out, without --resume")
    forks = sorted(set(ckpt_args) & set(args) - set(RUN_DEFINING) - set(LAYOUT) - set(FREE))   # a fork's new flags
    other_files = "data" in ckpt_args and "data" in args and not _same_path(ckpt_args["data"], args["data"]) and \
        _norm("data", ckpt_args["data"]) != _norm("data", args["data"])   # (said as such, not as changed bytes)
    # files moved or copied elsewhere (a new scratch disk): the same bytes, in the same order, are the same run
    moved = {k for k, sha in (("data", "data_sha256"), ("model", "model_sha256")) if ckpt_args.get(sha) is not None
             and _norm(sha, ckpt_args[sha]) == _norm(sha, args.get(sha))}
    other_files = other_files and "data" not in moved
    if "data" not in moved and (pin := hub_moved(ckpt_args, args)):   # an hf:// --data now at another commit
        raise ValueError(f"--resume: {pin}")
    for k in [*RUN_DEFINING, *forks]:
        if k not in args:   # (a caller that records less, as tests do: train.py records every one)
            continue
        if k == "template_date" and ckpt_args.get(k) is None:   # its template wrote no date: any renders the same
            continue
        if k == "long_text" and (k not in ckpt_args or objective == "dpo"):   # a run from before --long-text
            continue   # (same_tokens checks its data), or of pairs (their sides are never split: the same run)
        if k == "dtype" and ckpt_args.get(k) is None:   # a run from before the dtype was resolved: not known
            continue
        # a demo run's (it builds its files: not known, so a resume naming the demo's files is the same run, as one
        # without them is), or other --data files (refused as such)
        if k == "data_sha256" and (ckpt_args.get(k) is None or other_files):
            continue
        if k == "model_sha256" and None in (ckpt_args.get(k), args.get(k)):   # a run from before it, the demo's, or
            continue   # a Hub model's (its commit is compared)
        if k in ("model", "data") and (_same_path(ckpt_args.get(k), args.get(k)) or k in moved):   # spelled
            continue   # another way, or moved
        if k == "dpo_reference":   # (with another --objective or --dpo-loss: said as that, not as this)
            same = args.get("objective") == ckpt_args.get("objective") and args.get("dpo_loss") == ckpt_args["dpo_loss"]
            diffs += [_reference_diff(ckpt_args, args)] if same and ckpt_args[k] != args.get(k) else []
            continue
        if k == "chat_template_text" and ckpt_args[k] != args.get(k):
            diffs.append(_template_diff(ckpt_args, args))
            continue
        if k in CODE and NO_SOURCE in f"{ckpt_args.get(k)}{args.get(k)}":   # code without source: not comparable
            continue
        if k == "schedule" and ckpt_args.get(k) == LR_AT_BEFORE and \
                hashlib.sha256(str(args.get(k)).encode()).hexdigest() == LR_AT_SINCE:   # a run from before
            continue   # --lr-schedule: the same math as its defaults, which are compared as its flags
        if k in CODE and k in ckpt_args and ckpt_args[k] != args.get(k):
            diffs.append(f"{CODE[k]} differs from the checkpoint's run at {first_difference(ckpt_args[k], args.get(k))}"
                         f" (the whole text: args.{k} in the checkpoint's meta.json; the same math in other code: give "
                         "the function a recorded_as attribute holding that text)")
            continue
        if k == "optimizer" and k in ckpt_args:
            if not same_optimizer(ckpt_args[k], args.get(k) or {}):
                diffs.append(f"the optimizer (train.py's make_optimizer): the checkpoint's run used {ckpt_args[k]}, "
                             f"this run {args.get(k)}; to train on with another, start a fresh run from its adapter "
                             "(--init-adapter OUT/adapter, or `python -m parallel.checkpoint` for a step's)")
            continue
        if k == "data_sha256" and k in ckpt_args and len(had := _norm(k, ckpt_args[k])) == len(
                now := _norm(k, args.get(k))) == len(files := data_files(args.get("data"))) > 1 and had != now:
            changed = [f"{f} (sha256 {a[:12]} then, {b[:12]} now)" for f, a, b in zip(files, had, now) if a != b]
            diffs.append(f"--data's bytes: {', '.join(changed)} changed since the checkpoint's run; restore "
                         f"{'it' if len(changed) == 1 else 'them'}, or train the new data from the old run's adapter "
                         "with --init-adapter")
            continue
        if k in ckpt_args and _norm(k, ckpt_args[k]) != _norm(k, args.get(k)):
            flag = {"data_sha256": "--data's bytes (sha256: the "
                    "file changed; restore it, or train the new data from the old run's adapter with --init-adapter)",
                    "model_sha256": "--model's files (config.json, the weight files' sizes, headers and first and "
                    "last MB: the base at that path changed; restore it, or train on the new base from the old run's "
                    "adapter with --init-adapter)",
                    "data_mix": "--data-weights' shares (fixed: the same records every epoch, as runs before "
                    "2026-12-04 took them; rotate: the next records each epoch)"}.get(k, "--" + k.replace("_", "-"))
            show = lambda v, k=k: "all" if k == "lora_layers" and v is None else repr(v) if len(repr(v)) <= 80 else \
                repr(v)[:60] + f"... ({len(repr(v))} characters)"   # (--lora-layers' None: every block)
            diffs.append(f"{flag}: the checkpoint has {show(ckpt_args[k])}, this run {show(args.get(k))}"
                         + " (a flag not listed in parallel/resume.py's LAYOUT or FREE defines the run)" * (k in forks))
    if diffs:
        raise ValueError("--resume: flags that define the run differ from the checkpoint's:\n  " + "\n  ".join(diffs)
                         + "\nPass the checkpoint's values to continue it, or start a fresh run (no --resume). "
                         f"Layout flags may change: {', '.join('--' + f.replace('_', '-') for f in LAYOUT)}")
    steps, had = args.get("steps"), ckpt_args.get("steps")
    if steps is None and args.get("epochs") is None:   # one epoch would be another schedule, maybe no step at all
        for flag, v in (("steps", had), ("epochs", ckpt_args.get("epochs"))):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                raise ValueError(f"--resume: the checkpoint's run has --{flag} {v:g} and this one neither --steps nor "
                                 f"--epochs (one epoch): pass --{flag} {v:g} to continue it (or more, to train on)")
    if ckpt_step is not None and isinstance(steps, int) and steps < ckpt_step:
        raise ValueError(f"--steps {steps} is below the checkpoint's step {ckpt_step}: nothing would train. "
                         f"Pass --steps above {ckpt_step} to train on, or use the adapter that run exported")


def same_tokens(ckpt_args: dict, args: dict, split: int = 0) -> str | None:
    """Refuse a resume whose --data tokenized to other tokens than its checkpoint's run (module docstring). `split`:
    how many text records of --data and --eval-data this run split into windows (--long-text split); a run from
    before the flag truncated them (its eval loss, and --keep-best's best, would be measured on other samples too).
    Returns a note when only the eval samples differ (another --eval-data is allowed; its losses are then said not to
    compare with the earlier ones), else None."""
    if split and "long_text" not in ckpt_args and args.get("long_text") == "split":
        raise ValueError(f"--resume: the checkpoint's run is from before --long-text, when a text record longer than "
                         f"--max-len was truncated; this run would split {split} such records of --data/--eval-data "
                         "into windows (other samples). Pass --long-text truncate to continue it")
    had, now = ckpt_args.get("data_tokens"), args.get("data_tokens")
    if had is None or now is None or had == now:   # (the eval samples may change: --eval-data is free; said)
        was, ev = ckpt_args.get("eval_tokens"), args.get("eval_tokens")
        return None if None in (was, ev) or was == ev else (
            f"note: the eval samples are not the checkpoint's run's ({ev.rsplit(' ', 1)[0]} {ev[-64:][:12]}, then "
            f"{was.rsplit(' ', 1)[0]} {was[-64:][:12]}: another --eval-data, or the same one tokenized otherwise): "
            "eval losses from here on do not compare with the earlier ones (--keep-best's best and --early-stop's "
            "count start again)")
    short = lambda v: v.rsplit(" ", 1)[0] + " " + v.rsplit(" ", 1)[-1][:12]   # (the digest's first 12 digits)
    dated = (", or the date a dated chat template writes (pass --template-date with the day the checkpoint's run "
             "started)") if args.get("template_date") else ""
    pairs = "" if args.get("objective") != "dpo" else (
        " (a DPO run: or this trainer's preference-pair targets, TRL's since 2026-12-05, the answers' shared start "
        "trained: a run from before resumes with a commit of then)")
    raise ValueError(f"--resume: the checkpoint's run trained on other tokens ({short(had)}) than this run's --data "
                     f"gives ({short(now)}), though the file's bytes are the same: the tokenizer or chat template "
                     f"files in --model's folder, or the transformers/tokenizers version, changed since{dated}{pairs}. "
                     "Restore them to continue the run, or train on from its adapter in a fresh run (--init-adapter "
                     "OUT/adapter, or `python -m parallel.checkpoint` for a step's)")
