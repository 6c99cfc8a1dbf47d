"""Run flags checked on their own: values no run can use, and those that need the model's config.json but no layout.

Contract:
- `check_flags(args)`: values no run can use, whatever the model and world (non-finite or out-of-range numbers, flags
  that act only with another, the AC flags through `parallel.ac.check_ac`, --init-adapter's config through
  `model.adapter_read.check_init_adapter`). Each error is a `ValueError` naming the flag and the fix.
  It reads no weight. A Hub id given to --init-adapter is fetched first (`model.hub.fetch_adapter`): args.init_adapter
  becomes its snapshot folder (or, for org/name/folder, that folder of it), here since every entry point (a run,
  --plan) calls this first.
- `check_model_flags(args, margs, say)`: --lora-targets made this model's list (`model.lora_spec.run_targets`: the
  default on an MoE model whose MLP is its experts, the rest, said through `say`), and the checks that need the
  model's config.json but no layout (--lora-r against the
  projections' rank, --lora-layers against the blocks, --ac-group / --ac-blocks against them, --init-adapter's LoRA
  tensors against this model's shapes: `model.adapter_fit.init_adapter_fits`, from the safetensors header only).
- `parallel.mesh.validate` calls both (the one start-up check of a run's flags); `preflight.check_start` calls
  `check_flags` before the process group, `plan_cli` both before its searches, `plan_speed` `check_flags` on
  each flag set it tries; `ac.apply_ac` and `build_model` call `check_ac`.
"""

from __future__ import annotations

import math
import os

import torch

from data.mix import data_files
from model.adapter_fit import init_adapter_fits
from model.expert_lora import EXPERTS, refusal
from model.gemma4_small import refuse_tiled_attn
from model.lora_spec import NAMED, lora_layers, run_targets
from model.moe import expert_targets
from model.rope_read import rope_scaling_flag
from parallel.ac import check_ac


def check_flags(args) -> None:
    """Values no run can use, whatever the model and world: each error names the flag and the fix."""
    for flag in ("lr", "lora_alpha", "lora_dropout", "weight_decay", "clip", "timeout", "save_minutes"):
        v = getattr(args, flag)
        if not math.isfinite(v):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number, got {v}")
    lower = [("--lr", args.lr, 0, "> 0"), ("--lora-alpha", args.lora_alpha, 0, "> 0 (0 trains nothing: "
             "the LoRA output is scaled by alpha / r, or / sqrt(r))"), ("--lora-r", args.lora_r, 0, ">= 1"),
             ("--timeout", args.timeout, 0.99, ">= 1 minute (a step, a save or the first compile may take that "
                                               "long; the watchdog ends the job past it)"),
             ("--keep-ckpts", args.keep_ckpts, 0, ">= 1"), ("--max-nonfinite", args.max_nonfinite, 0, ">= 1")]
    for flag, v, bound, need in lower:
        if v <= bound:
            raise ValueError(f"{flag} must be {need}, got {v}")
    upper = [("--timeout", args.timeout, 1e6, "<= 1e6 minutes (about two years)"),
             ("--lr", args.lr, 1.0, "<= 1 (a learning rate, e.g. 2e-4)"),
             ("--lora-alpha", args.lora_alpha, 1e6, "<= 1e6 (the LoRA output is scaled by alpha / r: typically r or "
              "2r, e.g. 32; 1e308 overflowed float32 in the first forward)"),
             ("--global-batch", getattr(args, "global_batch", 1), 10 ** 7, "<= 10 million samples a step (each "
              "step lists its samples: 1e11 hung in the first step)"),
             ("--seed", abs(getattr(args, "seed", 0)), 2 ** 40, "between -2**40 and 2**40 (it seeds torch per rank)")]
    for flag, v, bound, need in upper:   # (past these: an overflow deep in torch or datetime, late)
        if v > bound:
            raise ValueError(f"{flag} must be {need}, got {v}")
    if (pt := getattr(args, "peak_tflops", None)) is not None and not (math.isfinite(pt) and pt > 0):
        raise ValueError(f"--peak-tflops must be a positive number (the device's dense bf16 TFLOP/s), got {pt}")
    if (ud := getattr(args, "ulysses_degree", None)) is not None:
        if ud < 1:
            raise ValueError(f"--ulysses-degree must be >= 1, got {ud}")
        if getattr(args, "cp_impl", "auto") != "hybrid":
            raise ValueError(f"--ulysses-degree {ud} applies only with --cp-impl hybrid (got --cp-impl "
                             f"{getattr(args, 'cp_impl', None)}): add --cp-impl hybrid, or drop it")
    rope_scaling_flag(getattr(args, "rope_scaling", None))   # its syntax; the model's numbers come with config.json
    if getattr(args, "data_cache", None) == "":   # (an unset variable: it turned the cache off without a word)
        raise ValueError("--data-cache is empty (an unset variable?): pass a directory, or none to turn the cache off")
    if getattr(args, "init_adapter", None) and (not args.resume or getattr(args, "objective", None) == "dpo"):
        from model.hub import fetch_adapter  # a Hub id: its adapter files now, before anything is written (a DPO
        args.init_adapter = fetch_adapter(args.init_adapter)   # resume's reference too); the snapshot from here on
    if getattr(args, "init_adapter", None) and not args.resume:   # (a resume's LoRA comes from its checkpoint)
        if args.overwrite and args.out and os.path.realpath(args.init_adapter).startswith(
                os.path.realpath(args.out) + os.sep):
            raise ValueError(f"--init-adapter {args.init_adapter!r} lies inside --out {args.out!r}, which --overwrite "
                             "empties: pass a new --out, or copy the adapter out of it")
        _check_init(args, args.lora_targets.split(","))
    for flag, v in (("--weight-decay", args.weight_decay), ("--clip", args.clip), ("--warmup", args.warmup),
                    ("--eval-every", args.eval_every), ("--save-every", args.save_every),
                    ("--save-minutes", args.save_minutes), ("--data-workers", getattr(args, "data_workers", 0))):
        if v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
    ratio = max(1.0, getattr(args, "lora_plus_ratio", None) or 1.0)   # (LoRA+: B's rate is --lr × the ratio)
    if (lr := args.lr * ratio) * args.weight_decay >= 1:   # (a step to NaN or zeroed weights, after the weights' read)
        rate = f"--lr {args.lr:g}" + (f" (B's rate {lr:g}, × --lora-plus-ratio)" if ratio > 1 else "")
        raise ValueError(f"--weight-decay {args.weight_decay:g} with {rate}: AdamW's decoupled decay scales the "
                         f"weights by 1 - lr · weight_decay = {1 - lr * args.weight_decay:.3g} each step (zeroed, "
                         f"flipped or overflowed): pass a weight decay below 1 / lr = {1 / lr:g}, typically 0 to 0.1")
    check_ac(getattr(args, "ac_group", 1), args.ac, getattr(args, "offload_activations", False),
             getattr(args, "ac_blocks", None), getattr(args, "ac_keep_attn", False), getattr(args, "tiled_attn", False))
    if getattr(args, "ac_keep_attn", False) and getattr(args, "compile", False) and not _sac_lets_compile():
        raise ValueError(f"--ac-keep-attn with --compile: torch {torch.__version__}'s selective-checkpoint cache "
                         "stops torch.compile inside it (every block would run eager); use one or the other")
    if (plus := getattr(args, "lora_plus_ratio", None)) is not None and not (math.isfinite(plus) and plus > 0):
        raise ValueError(f"--lora-plus-ratio must be a finite number above 0 (B's LR over A's; 16 in the LoRA+ paper), "
                         f"got {plus:g}")
    if (na := getattr(args, "neftune_alpha", None)) is not None:   # (dpo first: no value passes there)
        if getattr(args, "objective", "sft") == "dpo":
            raise ValueError(f"--neftune-alpha {na:g} with --objective dpo: NEFTune noises the embeddings of SFT's "
                             "training forwards; preference pairs here take none (the policy's and the reference's "
                             "log-probabilities of a pair would read other inputs): drop --neftune-alpha, or train "
                             "with --objective sft")
        if not (math.isfinite(na) and na > 0):
            raise ValueError(f"--neftune-alpha must be a finite number above 0 (the noise's scale: A / sqrt(L·d) per "
                             f"element; 5 in the NEFTune paper), got {na:g}; omit it for no noise")
    if getattr(args, "sft_loss", "ce") != "ce" and getattr(args, "objective", "sft") == "dpo":
        raise ValueError(f"--sft-loss {args.sft_loss} with --objective dpo: it weights SFT's per-token cross-entropy; "
                         "a preference loss is chosen with --dpo-loss: drop --sft-loss, or train with --objective sft")
    schedule, ratio, decay = (getattr(args, k, None) for k in ("lr_schedule", "min_lr_ratio", "wsd_decay"))
    if ratio is not None and (schedule == "constant" or not 0 <= ratio <= 1):   # (nan too)
        raise ValueError(f"--min-lr-ratio {ratio:g}: " + ("--lr-schedule constant has no decay to end at; drop it"
                         if schedule == "constant" else "the LR the decay ends at, as a share of --lr, in [0, 1]"))
    if decay is not None and (schedule != "wsd" or not 0 <= decay <= 1):
        raise ValueError(f"--wsd-decay {decay:g}: " + ("the share of the steps --lr-schedule wsd decays over, in [0, "
                         "1]" if schedule == "wsd" else f"acts only with --lr-schedule wsd (this run's is {schedule}): "
                         "pass that too, or drop it"))
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if getattr(args, "profile", None) is not None and args.profile < 1:
        raise ValueError(f"--profile must be a step number >= 1 (1-based), got {args.profile}")
    if getattr(args, "profile", None) is not None and getattr(args, "steps", None) and args.profile > args.steps:
        raise ValueError(f"--profile {args.profile}: this run has steps 1..{args.steps}; pick one of them (not step 1 "
                         "for timings: it also pays the kernels' first-call setup)")   # (--epochs: once the data are
        # counted; this one before they are read: review, helper 54)
    if getattr(args, "early_stop_delta", 0) and getattr(args, "early_stop", None) is None:
        raise ValueError(f"--early-stop-delta {args.early_stop_delta:g} acts only with --early-stop N (the evaluations "
                         "in a row without such an improvement that end the run): pass that too, or drop it")
    if isinstance(getattr(args, "max_len", None), int) and args.max_len < 2:
        raise ValueError(f"--max-len must be >= 2 (one input and one target), got {args.max_len}")
    if (split := getattr(args, "eval_split", None)) is not None:
        if getattr(args, "eval_data", None):
            raise ValueError(f"--eval-split {split:g} and --eval-data {' '.join(data_files(args.eval_data))} both "
                             "name the eval set: pass one (--eval-split holds out records of --data)")
        if not (0 < split < 1 or (math.isfinite(split) and split >= 1 and split == int(split))):   # (nan too)
            raise ValueError(f"--eval-split must be a share of --data's records above 0 and below 1 (0.05), or a "
                             f"whole number of them (500), got {split:g}")
    if (at := getattr(args, "eval_positions", None)) is not None:   # (rising, each a position a target can hold)
        top = args.max_len - 1 if isinstance(getattr(args, "max_len", None), int) else None
        if any(p < 1 for p in at) or any(b <= a for a, b in zip(at, at[1:])) or (top and at[-1] > top):
            upto = f" to {top} (--max-len {args.max_len})" if top else ""
            raise ValueError(f"--eval-positions {' '.join(map(str, at))}: the positions where the eval loss's "
                             f"buckets after 0 start, rising, each from 1{upto}, e.g. --eval-positions 1024 4096 16384")
        if getattr(args, "objective", None) == "dpo":   # (first: said before the eval set it would also need)
            raise ValueError("--eval-positions splits the cross-entropy over the eval targets by position, which "
                             "--objective dpo's eval (a loss per pair) does not have; drop --eval-positions")
        if hasattr(args, "eval_data") and not (getattr(args, "eval_data", None) or getattr(args, "eval_split", None)):
            raise ValueError(f"--eval-positions {' '.join(map(str, at))} splits the eval loss, but there is no eval "
                             "set: pass --eval-data FILE (or --eval-split), or drop --eval-positions")
    if getattr(args, "eval_every", 0) and not getattr(args, "eval_data", None) and hasattr(args, "eval_data") and \
            not getattr(args, "eval_split", None):
        raise ValueError(f"--eval-every {args.eval_every} evaluates on --eval-data, which is not given: pass "
                         "--eval-data FILE (or --eval-split), or drop --eval-every")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}; omit --steps to train one epoch")
    if (epochs := getattr(args, "epochs", None)) is not None:
        if not 0 < epochs <= 1e6:   # (nan fails too)
            raise ValueError(f"--epochs must be above 0 and at most 1e6, got {epochs:g}; omit it to train one epoch")
        if args.steps is not None:
            raise ValueError(f"--steps {args.steps} and --epochs {epochs:g} both set the run's length: pass one")
    bad = [t for t in args.lora_targets.split(",") if t not in NAMED]
    if bad or not args.lora_targets:
        raise ValueError(f"--lora-targets {args.lora_targets!r}: unknown {bad}; choose from {','.join(NAMED)} "
                         "(or all-linear, attn, mlp)")


def _check_init(args, targets) -> None:
    from model.adapter_read import check_init_adapter
    check_init_adapter(args.init_adapter, args.lora_r, args.lora_alpha, targets, getattr(args, "rslora", False),
                       getattr(args, "chat_template_text", None), getattr(args, "dora", False),
                       getattr(args, "train_norms", False), getattr(args, "train_embeddings", False))


def _sac_lets_compile() -> bool:
    """torch's selective-checkpoint dispatch modes tell dynamo to trace through them (newer torch does)."""
    from torch.utils import checkpoint as c
    return all(getattr(getattr(c, m, None), "ignore_compile_internals", lambda: False)()
               for m in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"))


def check_model_flags(args, margs, say=None) -> None:
    """The flag checks that need the model's config.json but no layout. --lora-targets becomes the list this model
    runs (`run_targets`: as recorded, compared on a resume, exported); `say` gets the line of a default it narrowed."""
    targets, why = run_targets(args.lora_targets, margs)
    args.lora_targets = ",".join(targets)   # (a plain str from here: a second call keeps it and says nothing)
    if why and say:
        say(why)
    if why and getattr(args, "init_adapter", None) and not getattr(args, "resume", None):   # (check_flags took the
        _check_init(args, targets)   # default's names: an adapter of the experts' would pass there)
    if getattr(args, "dpo_share_prompt", False) and margs.linear is not None:   # (before any weight is read)
        raise ValueError("--dpo-share-prompt makes a pair's answers branches of one prompt in a row, and this model's "
                         "linear-attention (Gated DeltaNet) layers carry one recurrent state along the row, which "
                         "cannot fork at a branch: drop --dpo-share-prompt (each pair then holds its prompt twice)")
    shapes = {t: min((margs.projections(i)[t] for i in range(margs.n_layers) if margs.has(i, t)), key=min, default=s)
              for t, s in margs.projections().items()}   # (each projection's lowest rank over the blocks: Gemma 4's)
    over = [f"{t} ({shapes[t][0]} -> {shapes[t][1]})" for t in args.lora_targets.split(",")
            if t in shapes and args.lora_r > min(shapes[t])]
    if over:   # B @ A cannot have a higher rank than the projection: the extra rank is parameters and time, no more
        raise ValueError(f"--lora-r {args.lora_r} is more than the rank of {', '.join(over)}: use --lora-r "
                         f"{min(min(shapes[t]) for t in args.lora_targets.split(',') if t in shapes)} or less, or "
                         "leave those projections out of --lora-targets")
    if getattr(args, "tiled_attn", False):   # (Gemma 4 E2B / E4B's KV-shared layers)
        refuse_tiled_attn(margs)
    layers = lora_layers(getattr(args, "lora_layers", None))
    if layers is not None and max(layers) >= margs.n_layers:
        raise ValueError(f"--lora-layers {args.lora_layers}: the model has blocks 0-{margs.n_layers - 1}; pass "
                         f"indices below {margs.n_layers}")
    if why := expert_targets(margs, args.lora_targets.split(",")):   # (Qwen3-MoE: model/moe.py)
        raise ValueError(why)
    named = args.lora_targets.split(",")   # (the experts': what peft's LoRA there cannot load, model/expert_lora.py)
    if EXPERTS in named and (why := refusal(margs, named, args.lora_dropout, getattr(args, "dora", False), layers)):
        raise ValueError(why)
    if getattr(args, "train_embeddings", False) and margs.tie_embeddings and \
            getattr(args, "objective", "sft") == "dpo":
        raise ValueError("--train-embeddings with --objective dpo: this model ties its output head to the input "
                         "embedding (config.json's tie_word_embeddings), so the embedding would train through the head "
                         "too, and DPO's per-token losses take a frozen head (each token's share of the head's "
                         "gradient is known only once its pair's sums are): drop --train-embeddings (--train-norms "
                         "trains the norms), or train it with --objective sft")
    if getattr(args, "train_embeddings", False) and layers is not None and min(layers) > 0:
        raise ValueError(f"--train-embeddings with --lora-layers {args.lora_layers}: the embedding lies below every "
                         "block, so every block would run backward, which --lora-layers skips below its lowest block: "
                         "include block 0 in --lora-layers, or drop one of them")
    if getattr(args, "init_adapter", None) and not getattr(args, "resume", None):
        init_adapter_fits(args.init_adapter, shapes, args.lora_r, margs.n_layers, layers, margs.tie_embeddings,
                          margs.has)
    blocks, group = getattr(args, "ac_blocks", None), getattr(args, "ac_group", 1)
    if group > margs.n_layers:
        raise ValueError(f"--ac-group {group} is more than the model's {margs.n_layers} blocks (one checkpoint would "
                         f"span them all, its recompute holding every block's activations): use at most "
                         f"--ac-group {margs.n_layers}")
    if blocks is not None and blocks > margs.n_layers:
        raise ValueError(f"--ac-blocks {blocks} is more than the model's {margs.n_layers} blocks; omit it to "
                         "checkpoint them all")
