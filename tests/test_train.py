"""train.py end to end: the layout never changes the math, resuming never changes it, bad runs fail early.

Pins (gloo on CPU, float32, a tiny Qwen2 checkpoint with 6 query / 2 KV heads made by transformers, its q and k
x 14 so its attention is peaked and a wrong logit on one rank moves the run (tests/fixtures.py), the
fixture tokenizer's chat template, `--global-batch 8`; 3 optimizer steps where a run is resumed from its step-2
checkpoint or is the reference of one that is, else 2 (step 2 already runs after an update: a 3rd repeats its code),
against 1-rank references of the same length):
- the per-step losses and grad norms in OUT/metrics.jsonl and the exported PEFT adapter of a 1-rank run
  equal those of 4-rank runs with `--cp 2 --dp-shard 2` (Ulysses, 1 sample a micro-batch, 3 steps; and ring with 2
  packed documents per row), `--cp 4` (auto: hybrid 2 × 2) and `--cp 4 --cp-impl ring` (packed, 4 documents per row),
  `--dp-shard 4` (with 2 packed samples a micro-batch: the --tiled-attn run below) and HSDP `--dp-replicate 2
  --dp-shard 2`; with
  `--quant nf4` for cp 2 × dp 2 Ulysses (2 documents a row) and dp_shard 4, and on the model saved 4-bit by
  transformers + bitsandbytes (a -bnb-4bit upload) for cp 2 × dp 2 ring (2 a row); and `--tiled-mlp
  --offload-activations` on 1 rank, and on cp 2 × dp_shard 2 with Ulysses (in the dora and tied runs) and with ring
  (the norms, layers and partial_ac runs), each against 1 rank without them, and `--ac-group 2` (both
  blocks recomputed as one group; with the tiled MLP on 1 rank and Ulysses) and `--ac-blocks 1` (block 1 not
  checkpointed; on ring cp 2 × dp 2 with the tiled MLP and offload) and `--ac-keep-attn` (1 rank; Ulysses
  with the tiled MLP; ring with `--ac-blocks 1`; 2 documents per row on 4 ranks) and `--tiled-attn` (1 rank with the
  tiled MLP and offload, with 4 packed samples per micro-batch, with a sliding window; `--dp-shard 4` with 2 documents
  per row) likewise, train as the plain run
  (losses within 1e-4 absolute, grad norms within 1e-4 relative, every adapter tensor within 1e-3
  relative norm of the difference);
- `--pack` and `--no-pack` train the same (1 rank, 4 samples per micro-batch; and --no-pack on cp 2 × dp 2 ring with
  `--ac-group 2`, 2 padded rows a micro-batch, = the plain 1-rank run);
- text records past --max-len split into windows (`--long-text split`, the default) train on cp 2 × dp_shard 2 ring
  with 2 windows a row as on 1 rank;
- resuming from the step-2 checkpoint gives the uninterrupted step-3 loss and adapter: 1 rank from
  1 rank, 4 ranks (another CP layout) from 4 ranks, 1 rank from 4 ranks;
- a step from `--init-adapter` (the Ulysses run's adapter) on cp 2 × dp 2 ring trains as on 1 rank;
- `--lora-layers 1` with `--rslora` and `--rope-scaling yarn:4` on cp 2 × dp 2 ring (tiled MLP, offload) = 1 rank;
- `--fast` on cp 2 × dp 2 ring with a different device budget per rank, rank 2's the smallest: every rank applies
  the choice for rank 2's budget (not what rank 0's or its own would pick), the log names rank 2 (so does the
  start-up memory check's line), and the run trains as on 1 rank; `--offload-activations` with rank 2's free host
  memory below the pinned bytes is refused on all 4 ranks alike, naming rank 2;
- `--train-embeddings` on a tied model (its head the embedding, trained through the loss too) on cp 2 × dp 2 Ulysses
  with the tiled MLP and offload = 1 rank, its checkpoint holding the embedding once, resumed on 1 rank and exported;
- `parallel.checkpoint_export.export` of the 4-rank cp 2 × dp 2 Ulysses run's last checkpoint (FSDP2-sharded) writes the
  adapter that run exported, bit for bit;
- SIGTERM on one of 4 ranks (cp 2 × dp 2 ring, `--save-minutes` tiny: every step saved, all 4 together) in step
  2's second micro-batch stops all 4 at the next micro-batch with step 1 saved (exit status 143 each); resumed
  on 1 rank, the run trains as the uninterrupted one;
- `--keep-best` with an eval every step on cp 2 × dp 2 ring: the same checkpoint folders, best step and
  OUT/adapter_best as on 1 rank, which trains as the plain run;
- `--sft-loss dft` on cp 2 × dp 2 Ulysses and ring (2 packed documents a row) = 1 rank, whose steps' losses are DFT's
  (below the cross-entropy run's) and whose eval loss is the cross-entropy of its weights (a run without the flag
  evaluating its adapter before its first step); refused with --objective dpo and with a LOSS_FN; a resume keeps it;
- every start-up error names its numbers and is raised before any weight is read (`build_model` and
  `CheckpointReader` are replaced by tripwires); data errors name the file and the line.

All 4-rank runs share one spawn (each `train.main` builds its own mesh on the existing group); the
1-rank runs and the error cases run in this process (`train.main` makes its own 1-rank group).

Run: .venv/bin/python -m pytest -q tests/test_train.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import traceback

import pytest
import torch

from tests.dist import run_ranks
from tests.helpers import budget_between_ac_plans, eval_head, no_weights, one_thread, startup_error, train_argv

LOSS_ATOL, NORM_RTOL, ADAPTER_RTOL = 1e-4, 1e-4, 1e-3

# Runs nothing resumes from stop after step 2 (which already runs after an optimizer update: a 3rd step repeats its
# code), against 1-rank references of 2 steps too (fp32_2 for the plain run)
TWO = ["--steps", "2"]
FOUR_RANK = {   # out-dir name -> layout flags
    # the one run of 3 steps here: resumed (test_resume_across_layouts), exported, the --init-adapter runs' start
    "cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--save-every", "2"],
    # --pack is the default everywhere: with 2 samples per micro-batch a row holds 2 documents (4 on cp 4), which ring
    # and hybrid attention must keep apart
    "cp2_dp2_ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2",
                              "--report-to", "tensorboard", *TWO],   # (logs only: rank 0's, checked below)
    "cp4_auto_hybrid_pack_mb4": ["--cp", "4", "--micro-batch", "4", *TWO],
    "cp4_ring_pack_mb4": ["--cp", "4", "--cp-impl", "ring", "--micro-batch", "4", *TWO],
    # (dp_shard 4 with 2 packed samples a micro-batch: tiled_attn_dp4_pack_mb2 below; packed rows without CP attend
    # as on 1 rank, test_pack_changes_nothing)
    "dp4": ["--dp-shard", "4", *TWO],
    "hsdp_rep2_dp2": ["--dp-replicate", "2", "--dp-shard", "2", *TWO],
    # the AC flags below run 2 samples a micro-batch, packed but in the ring group run (2 micro-batches a step on each
    # data rank). The tiled MLP with offload on cp 2 × dp 2 has no run of its own: the dora and tied runs (Ulysses)
    # and the norms, layers and partial_ac runs (ring) hold both, each against 1 rank without them (4 micro-batches
    # of 1 sample a step but in partial_ac and layers)
    "group_cp2_dp2_ulysses_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--tiled-mlp", "--ac-group",
                                  "2", "--micro-batch", "2", *TWO],
    # (--no-pack: 2 rows a micro-batch, each padded to the longer sample and the ring's divisor, sharded as a batch;
    # every packed ring run above and below recomputes the ring's document path under AC already)
    "group_cp2_dp2_ring_no_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--ac-group", "2",
                                       "--no-pack", "--micro-batch", "2", *TWO],
    "partial_ac_cp2_dp2_ring_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--ac-blocks", "1",
                                    "--tiled-mlp", "--offload-activations", "--micro-batch", "2", *TWO],
    "keep_attn_cp2_dp2_ulysses_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--ac-keep-attn",
                                      "--tiled-mlp", "--micro-batch", "2", *TWO],
    "keep_attn_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--ac-keep-attn", "--micro-batch",
                               "2", "--ac-blocks", "1", *TWO],
    # --tiled-attn runs one process's attention (refused under CP): FSDP2 over 4 ranks, 2 documents per row
    "tiled_attn_dp4_pack_mb2": ["--dp-shard", "4", "--micro-batch", "2", "--tiled-attn", "--tiled-mlp", *TWO],
}
FOUR_RANK_NF4 = {
    "nf4_cp2_dp2_ulysses_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--quant", "nf4",
                                "--micro-batch", "2", *TWO],
    "nf4_dp4": ["--dp-shard", "4", "--quant", "nf4", *TWO],
}
# the model saved 4-bit by transformers + bitsandbytes (a -bnb-4bit upload): its NF4 codes and scales as stored, each
# rank reading its own blocks
FOUR_RANK_BNB = {"bnb_cp2_dp2_ring_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--quant", "nf4",
                                         "--micro-batch", "2", *TWO]}
# LoRA+ (each B at 16 x the LR): its two param groups through FSDP2 and DCP (= 1 rank; resumed on 1 rank)
PLUS = ["--lora-plus-ratio", "16", "--save-every", "2"]
FOUR_RANK_PLUS = {"plus_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", *PLUS]}
# DoRA on NF4 (its magnitudes set from all-gathered 4-bit weights), with the tiled MLP and offload on 4 ranks only (the
# tiles share one norm per layer): = 1 rank, the step-2 checkpoint resumed on 1 rank and exported
DORA = ["--dora", "--quant", "nf4", "--save-every", "2"]
FOUR_RANK_DORA = {"dora_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--tiled-mlp",
                                           "--offload-activations", *DORA]}
# LoRA on block 1 alone (block 0 runs no backward), with AC's inputs offloaded and the tiled MLP on 4 ranks only; with
# rsLoRA's scale on both sides (a scale on every rank alike: its layout equivalence costs no run of its own), and
# --rope-scaling yarn:4 (its factor on cos/sin scales every logit by 1.3: a rank without it fails the comparison)
LAYERS = ["--lora-layers", "1", "--rslora", "--rope-scaling", "yarn:4"]
FOUR_RANK_LAYERS = {"layers_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", *LAYERS,
                                            "--offload-activations", "--tiled-mlp", "--micro-batch", "2", *TWO]}
# --train-norms (every RMSNorm weight trained, in a group without weight decay) and --train-embeddings (the input
# embedding, on the FSDP2 root), ring with the tiled MLP (whose tiles run the norm) and offload on 4 ranks only: = 1
# rank, the step-2 checkpoint resumed on 1 rank and exported
NORMS = ["--train-norms", "--train-embeddings", "--weight-decay", "0.1", "--save-every", "2"]
FOUR_RANK_NORMS = {"norms_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--tiled-mlp",
                                          "--offload-activations", *NORMS]}
# --train-embeddings on a tied model (its head is the embedding: trained through the loss too), Ulysses with the tiled
# MLP and offload on 4 ranks only: = 1 rank, the step-2 checkpoint resumed on 1 rank and exported
TIED = ["--train-embeddings", "--save-every", "2"]
FOUR_RANK_TIED = {"tied_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--tiled-mlp",
                                           "--offload-activations", *TIED]}
# a sliding-window checkpoint (16-token window on layer 1, rows up to 64 tokens) under CP
FOUR_RANK_WINDOW = {
    "window_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *TWO],
    "window_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *TWO],
}
# text records past --max-len split into windows (--long-text split, the default), packed 2 samples a row under ring
FOUR_RANK_TEXT = {"text_cp2_dp2_ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch",
                                                 "2", *TWO],
                  # --micro-batch auto: each data rank's 4 samples cut by tokens (rows up to the longest sample's
                  # length); a rank with fewer cuts runs idle all-ignored rows so the collectives stay in step
                  "text_cp2_dp2_ring_mb_auto": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch",
                                                "auto", *TWO]}
# --eval-split: a quarter of the text records (split into windows) held out as the eval set, evaluated every step
EVAL_SPLIT = ["--eval-split", "0.25", "--eval-every", "1"]
FOUR_RANK_SPLIT = {"text_split_cp2_dp2_ulysses_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses",
                                                      "--micro-batch", "2", *EVAL_SPLIT, *TWO]}
# --data as two files (the text records' first 6 lines and the rest) with --data-weights: the first file once and half
# of its records, half of the second's, and 2 records of the two held out (--eval-split), on cp2×dp2 ring (4 packed
# samples a row) against 1 rank; 3 steps of 16 samples run into the second epoch, whose halves are the other records
FILES = ["--data-weights", "1.5", "0.5", "--eval-split", "2", "--eval-every", "1", "--global-batch", "16"]
FOUR_RANK_FILES = {"files_cp2_dp2_ring_pack_mb4": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch",
                                                   "4", *FILES]}
# --sft-loss dft (each target's cross-entropy × its detached probability: loss.py's dft) on Ulysses and on ring with 2
# packed documents a row, against the same on 1 rank
DFT = ["--sft-loss", "dft"]
FOUR_RANK_DFT = {"dft_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *DFT, *TWO],
                 "dft_cp2_dp2_ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch",
                                               "2", *DFT, *TWO]}
# one step from the Ulysses run's adapter (--init-adapter), 2 samples a micro-batch, against the same on 1 rank
INIT4 = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", "--steps", "1", "--init-adapter"]
# stopped by SIGTERM on rank 3 in step 2, then resumed on 1 rank
STOP4 = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--save-minutes", "1e-9"]   # (a save after each step:
# rank 0's clock decides for all 4, or rank 0 would wait alone in the save's collectives)
# --fast on 4 ranks whose device budgets differ (the smallest, rank 2's, decides for every rank)
FAST4 = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", "--fast", *TWO]
# offload with the host memory short on rank 2 only: every rank refuses it, naming rank 2
SHORT4 = ["--cp", "2", "--dp-shard", "2", "--offload-activations"]
# --keep-best with an eval every step (the training file as eval data): the same saves, best and adapter_best
KEEP_BEST = ["--eval-every", "1", "--keep-best", "--keep-ckpts", "1", *TWO]
KEEP4 = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *KEEP_BEST]
# --tiled-attn over several tiles end to end (review, helper 33: at --max-len 64 every row was one tile): packed rows of
# 8 text records, ~400 tokens, against the same rows untiled
TILES = {"tiles_ref": ["--micro-batch", "8", "--max-len", "520", *TWO],
         "tiles": ["--micro-batch", "8", "--max-len", "520", "--tiled-attn", "--tiled-mlp", "--offload-activations",
                   *TWO]}
# --early-stop 1 with a delta no evaluation beats: step 2's evaluation ends the run (of 3 steps) on every rank (on 4
# ranks: 2 samples a micro-batch)
EARLY = ["--eval-every", "1", "--early-stop", "1", "--early-stop-delta", "100"]
# resume the 4-rank Ulysses checkpoint on 4 ranks with ring attention instead (another CP layout)
RESUME4 = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--resume"]


# 4-rank start-up errors: label -> (flags, phrases the message must hold)
FOUR_RANK_ERRORS = {
    "world size": (["--cp", "2", "--dp-shard", "1"], ["--dp-shard 1 × --cp 2 = 2", "world size is 4"]),
    "max-len below cp divisor": (["--cp", "4", "--cp-impl", "ring", "--max-len", "6"],
                                 ["--max-len 6", "CP divisor 8"]),
    "ulysses heads": (["--cp", "4", "--cp-impl", "ulysses"],
                      ["6 attention heads are not divisible by the Ulysses degree 4", "--cp-impl ring"]),
    "tiled attention under cp": (["--cp", "2", "--dp-shard", "2", "--tiled-attn"],
                                 ["--tiled-attn with --cp 2", "drop one of them"]),
}


def _four_ranks(rank, world_size, assets, root):
    """Every 4-rank run of this file, in one spawn; rank 0 returns the start-up error messages."""
    import train

    errors = {}
    for label, (flags, _) in FOUR_RANK_ERRORS.items():
        errors[label] = startup_error(train_argv(assets, os.path.join(root, "err"), *flags))
    for name, flags in {**FOUR_RANK, **FOUR_RANK_NF4, **FOUR_RANK_PLUS, **FOUR_RANK_DORA, **FOUR_RANK_LAYERS,
                        **FOUR_RANK_NORMS, **FOUR_RANK_DFT}.items():
        train.main(train_argv(assets, os.path.join(root, name), *flags))
    for name, flags in FOUR_RANK_WINDOW.items():
        train.main(train_argv({**assets, "model": assets["window"]}, os.path.join(root, name), *flags))
    for name, flags in FOUR_RANK_TIED.items():
        train.main(train_argv({**assets, "model": assets["tied"]}, os.path.join(root, name), *flags))
    for name, flags in FOUR_RANK_BNB.items():
        train.main(train_argv({**assets, "model": _bnb(assets)}, os.path.join(root, name), *flags))
    for name, flags in {**FOUR_RANK_TEXT, **FOUR_RANK_SPLIT}.items():
        train.main(train_argv({**assets, "data": assets["text"]}, os.path.join(root, name), *flags))
    for name, flags in FOUR_RANK_FILES.items():
        train.main(train_argv(assets, os.path.join(root, name), *flags, "--data", *_text_files(assets)[:2]))
    ckpt = os.path.join(root, "cp2_dp2_ulysses", "ckpt", "step_000002")
    resume_error = _try(train.main, train_argv(assets, os.path.join(root, "resume4"), *RESUME4, ckpt))
    stopped = _stop_one_rank(rank, train_argv(assets, os.path.join(root, "stop_cp2_dp2_ring"), *STOP4))
    train.main(train_argv(assets, os.path.join(root, "init_cp2_dp2_ring"), *INIT4,
                          os.path.join(root, "cp2_dp2_ulysses", "adapter")))
    train.main(train_argv(assets, os.path.join(root, "init_norms_cp2_dp2_ring"), *INIT4,   # (its norms into FSDP2's
                          os.path.join(root, "norms_cp2_dp2_ring", "adapter"), "--train-norms",   # shards, the root's)
                          "--train-embeddings"))
    fast = _fast_on_every_rank(rank, train_argv(assets, os.path.join(root, "fast_cp2_dp2_ring"), *FAST4))
    train.main(train_argv(assets, os.path.join(root, "keep_best_cp2_dp2_ring"), *KEEP4, "--eval-data",
                          eval_head(assets)))
    train.main(train_argv(assets, os.path.join(root, "early_cp2_dp2_ring"), "--cp", "2", "--dp-shard", "2",
                          "--cp-impl", "ring", "--micro-batch", "2", *EARLY, "--eval-data",
                          os.path.join(assets["dir"], "short_eval.jsonl")))
    return (errors, resume_error, stopped, fast) if rank == 0 else (None, None, stopped, fast)


def _host_short_on_rank_2(rank, world_size, argv):
    """The start-up error of `argv` (--offload-activations) on this rank, planned for a CUDA device (1 PB) with
    host memory short on rank 2 only."""
    from parallel import budgets, plan_search

    budget, host = plan_search._budget, budgets.host_available
    plan_search._budget = lambda a, world: ("cuda", 1e15, "1 PB per GPU (test)")
    budgets.host_available = lambda: (1e3 if rank == 2 else 1e15, "free (test)")
    try:
        return startup_error(argv)
    finally:
        plan_search._budget, budgets.host_available = budget, host


def _metrics_disk_full_at_step_2(rank, world_size, argv):
    """train.main on this rank with rank 0's metrics.jsonl write failing (a full disk) at step 2: the error raised."""
    import train
    from parallel import metrics

    real = metrics.MetricsLog.write

    def write(self, rec):
        if rec["step"] == 2:
            raise OSError(28, "No space left on device")
        return real(self, rec)

    metrics.MetricsLog.write = write
    try:
        train.main(argv)
    except Exception as e:   # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _ckpt_disk_full_on_rank_1(rank, world_size, argv, at="step_000002"):
    """train.cli on this rank with rank 1's part of checkpoint `at` failing (a full disk, inside DCP's save): its
    exit code and stderr."""
    import contextlib
    import io

    from torch.distributed.checkpoint import filesystem

    import train

    real = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if rank == 1 and at in str(self.path):
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.cli(argv)
    return code, err.getvalue()


def _fast_on_every_rank(rank, argv):
    """Run `argv` (--fast) with a device budget that differs by rank (rank 2: between the plans of AC on one block
    and of no AC; the others: 1 PB, where another set wins); return the flags this rank applied and, on rank 0,
    the --fast log line."""
    import contextlib
    import io
    import sys

    import train
    from parallel import plan_search, plan_speed

    mem = budget_between_ac_plans(argv, 4) if rank == 2 else 1e15
    budget, apply, got, out = plan_search._budget, plan_speed.apply_flags, [], io.StringIO()
    plan_search._budget = lambda a, world: ("cpu", mem, f"{mem:.0f} B (test)")
    plan_speed.apply_flags = lambda args, flags: (got.append(flags), apply(args, flags))[1]
    try:
        with contextlib.redirect_stdout(out):
            train.main(argv)
    finally:
        plan_search._budget, plan_speed.apply_flags = budget, apply
        sys.stdout.write(out.getvalue())   # the run's log, as the other runs print theirs
    return got, [x for x in out.getvalue().splitlines() if x.startswith(("--fast", "memory"))]


def _stop_one_rank(rank, argv):
    """Run `argv` with SIGTERM raised on rank 3 in its 6th micro-batch (step 2, the second of 4); return what
    this rank's train.main raised."""
    import train
    from parallel import phases, signals

    measuring, calls = phases.measuring, [0]

    def signal_in_step_2(*a, **k):   # entered once per micro-batch, after the stop check
        calls[0] += 1
        if rank == 3 and calls[0] == 6:
            signal.raise_signal(signal.SIGTERM)
        return measuring(*a, **k)

    phases.measuring = signal_in_step_2
    try:
        train.main(argv)
    except signals.Stopped as e:
        return str(e), e.code, calls[0]
    except Exception:
        return traceback.format_exc()
    finally:
        phases.measuring = measuring
    return "train.main returned: the signal did not stop it"


def _try(fn, *a):
    """None, or the traceback of fn(*a): a failing resume fails its own test, not every test here
    (loading a checkpoint fails the same way on every rank, so no rank is left in a collective)."""
    try:
        fn(*a)
    except Exception:
        return traceback.format_exc()
    return None


# ----------------------------------------------------------------------------- fixtures





def _short_eval(assets) -> str:
    """30 short text records (a few tokens each): evaluated in packed rows of the longest training sample's length."""
    path = os.path.join(assets["dir"], "short_eval.jsonl")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.writelines(json.dumps({"text": f"the fox {i} ran {'far ' * (i % 4)}"}) + "\n" for i in range(30))
    return path


def _text_files(assets) -> list[str]:
    """The text records as two files (lines 1-6, 7-16), and a file of the first's lines twice, then the second's."""
    lines = open(assets["text"]).read().splitlines(True)
    paths = [os.path.join(assets["dir"], f) for f in ("text_a.jsonl", "text_b.jsonl", "text_aab.jsonl")]
    for path, part in zip(paths, (lines[:6], lines[6:], lines[:6] * 2 + lines[6:])):
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.writelines(part)
    return paths


def _bnb(assets) -> str:
    """The model saved 4-bit (nf4, double quantization) by transformers + bitsandbytes, once."""
    from tests.helpers import bnb_checkpoint

    path = os.path.join(assets["dir"], "bnb")
    if not os.path.exists(path):
        bnb_checkpoint(assets["model"], path, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    return path


@pytest.fixture(scope="module")
def four(assets, tmp_path_factory):
    _text_files(assets), _short_eval(assets), _bnb(assets), eval_head(assets)   # (written once: 4 ranks read them)
    root = str(tmp_path_factory.mktemp("train_4ranks"))
    res = run_ranks(_four_ranks, 4, assets, root, timeout=540, pg_timeout=120)
    return {"root": root, "errors": res[0][0], "resume_error": res[0][1], "stopped": [r[2] for r in res],
            "fast": [r[3] for r in res], "assets": assets}


@pytest.fixture(scope="module")
def one(assets, tmp_path_factory):
    """The 1-rank runs, in this process."""
    import train

    root = str(tmp_path_factory.mktemp("train_1rank"))
    runs = {   # (the 3-step runs: resumed, or the reference of a run that is)
        "fp32": ["--save-every", "2"],
        "fp32_2": TWO,
        "nf4": ["--quant", "nf4", *TWO],
        "plus": PLUS,
        "dora": DORA,
        "norms": NORMS,
        "layers": [*LAYERS, *TWO],
        "pack": ["--micro-batch", "4", "--pack", *TWO],
        "no_pack": ["--micro-batch", "4", "--no-pack", *TWO],
        "window": ["--model", assets["window"], *TWO],
        "tied": ["--model", assets["tied"], *TIED],
        "bnb": ["--model", _bnb(assets), "--quant", "nf4", *TWO],
        "mem": ["--tiled-mlp", "--offload-activations", *TWO],
        "group": ["--tiled-mlp", "--ac-group", "2", *TWO],
        "partial_ac": ["--ac-blocks", "1", *TWO],
        "keep_attn": ["--ac-keep-attn", *TWO],
        "tiled_attn": ["--tiled-attn", "--tiled-mlp", "--offload-activations", *TWO],
        "tiled_attn_pack": ["--micro-batch", "4", "--pack", "--tiled-attn", *TWO],
        "tiled_attn_window": ["--model", assets["window"], "--tiled-attn", *TWO],
        "keep_best": [*KEEP_BEST, "--eval-data", eval_head(assets)],
        "early": [*EARLY, "--eval-data", _short_eval(assets)],
    }
    with one_thread():
        for name, flags in runs.items():
            train.main(train_argv(assets, os.path.join(root, name), *flags))
        train.main(train_argv({**assets, "data": assets["text"]}, os.path.join(root, "text"), *TWO))
        train.main(train_argv({**assets, "data": assets["text"]}, os.path.join(root, "text_mb_auto"), "--micro-batch",
                              "auto", *TWO))
        for name, flags in TILES.items():   # rows of 8 text records, longer than one attention tile (256)
            train.main(train_argv({**assets, "data": assets["text"]}, os.path.join(root, name), *flags))
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            train.main(train_argv({**assets, "data": assets["text"]}, os.path.join(root, "text_split"), *EVAL_SPLIT,
                                  *TWO))
        # the same split as two files (the lines the run names as held out): the run it must equal
        held = [int(x) for x in re.search(r"eval split: .*; lines ([\d, ]+)\)", said.getvalue()).group(1).split(",")]
        lines = open(assets["text"]).read().splitlines()
        for part, keep in (("train", lambda n: n not in held), ("eval", lambda n: n in held)):
            with open(os.path.join(root, f"text_{part}.jsonl"), "w") as f:
                f.writelines(line + "\n" for n, line in enumerate(lines, 1) if keep(n))
        train.main(train_argv({**assets, "data": os.path.join(root, "text_train.jsonl")},
                              os.path.join(root, "text_files"), "--eval-data", os.path.join(root, "text_eval.jsonl"),
                              "--eval-every", "1", *TWO))
        a, b, aab = _text_files(assets)
        for name, flags in (("files", ["--data", a, b, "--data-weights", "2", "1", *TWO]),
                            ("files_aab", ["--data", aab, *TWO]),
                            ("files_frac", [*FILES, "--micro-batch", "2", "--data", a, b]),
                            ("eval_files", ["--eval-data", a, b, "--eval-every", "1", *TWO]),
                            ("eval_a", ["--eval-data", a, "--eval-every", "1", *TWO]),
                            ("eval_b", ["--eval-data", b, "--eval-every", "1", *TWO]),
                            ("eval_ab", ["--eval-data", assets["text"], "--eval-every", "1", *TWO])):   # (a's, b's)
            train.main(train_argv(assets, os.path.join(root, name), *flags))
        resume = os.path.join(root, "fp32", "ckpt", "step_000002")
        resume_error = _try(train.main, train_argv(assets, os.path.join(root, "resume1"), "--resume", resume))
        dft = [io.StringIO(), io.StringIO()]   # (--sft-loss dft's log; then its end weights evaluated by a plain run)
        with contextlib.redirect_stdout(dft[0]):
            train.main(train_argv(assets, os.path.join(root, "dft"), *DFT, "--eval-data", assets["data"], *TWO))
        with contextlib.redirect_stdout(dft[1]):
            train.main(train_argv(assets, os.path.join(root, "at_dft"), "--init-adapter",
                                  os.path.join(root, "dft", "adapter"), "--steps", "1", "--eval-data", assets["data"]))
    return {"root": root, "resume_error": resume_error, "held": held, "said": said.getvalue(), "assets": assets,
            "dft": [x.getvalue() for x in dft]}


# ----------------------------------------------------------------------------- comparisons


def _at(runs, *name):
    return os.path.join(runs["root"], *name)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))


S2, S3 = (1, 2), (1, 2, 3)


def _two(flags) -> bool:
    """Whether the run of `flags` stops after 2 steps (TWO)."""
    return "--steps" in flags and flags[flags.index("--steps") + 1] == "2"


def _compare(label, out, ref, steps=S3, adapter_rtol=ADAPTER_RTOL):
    """Assert `out` trained like `ref`; return (max loss diff, max grad-norm rel diff, max adapter rel diff)."""
    got = {m["step"]: m for m in _metrics(out)}
    want = {m["step"]: m for m in _metrics(ref)}
    assert sorted(got) == list(steps), f"{label}: steps logged {sorted(got)}"
    dl = dn = 0.0
    for s in steps:
        g, w = got[s], want[s]
        assert g["tokens"] == w["tokens"], f"{label} step {s}: tokens {g['tokens']} vs {w['tokens']}"
        dl = max(dl, abs(g["loss"] - w["loss"]))
        dn = max(dn, abs(g["grad_norm"] - w["grad_norm"]) / w["grad_norm"])
        assert abs(g["loss"] - w["loss"]) <= LOSS_ATOL, f"{label} step {s}: loss {g['loss']} vs {w['loss']}"
        assert abs(g["grad_norm"] - w["grad_norm"]) <= NORM_RTOL * w["grad_norm"], \
            f"{label} step {s}: grad_norm {g['grad_norm']} vs {w['grad_norm']}"
    a, b = _adapter(out), _adapter(ref)
    assert sorted(a) == sorted(b), f"{label}: adapter tensor names differ"
    da = 0.0
    for k in b:
        assert a[k].shape == b[k].shape, f"{label}: {k} shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        rel = ((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item()
        da = max(da, rel)
        assert rel <= adapter_rtol, f"{label}: adapter {k} differs by {rel:.2e} (relative norm)"
    print(f"{label}: max |loss diff| {dl:.1e}, max grad-norm rel diff {dn:.1e}, max adapter rel diff {da:.1e}")
    return dl, dn, da


# ----------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
def test_single_rank_run_trains(one):
    """Sanity for everything below: 3 steps logged, the adapter moved (B starts at zero)."""
    ms = _metrics(_at(one, "fp32"))
    assert [m["step"] for m in ms] == [1, 2, 3]
    assert all(m["grad_norm"] > 0 and m["tokens"] > 0 for m in ms)
    ad = _adapter(_at(one, "fp32"))
    assert len(ad) == 2 * 7 * 2, sorted(ad)
    b_norms = [v.norm().item() for k, v in ad.items() if "lora_B" in k]
    assert min(b_norms) > 1e-4, f"LoRA B barely moved: {min(b_norms)}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK))
def test_four_ranks_match_one_rank(one, four, name):
    two = _two(FOUR_RANK[name])
    _compare(f"4 ranks {name}", _at(four, name), _at(one, "fp32_2" if two else "fp32"), steps=S2 if two else S3)


@pytest.mark.timeout(600)
def test_tensorboard_on_four_ranks_draws_rank_0s_metrics_once(four):
    """--report-to tensorboard on cp2 x dp2: one events file, rank 0's (no other rank writes), drawing its metrics."""
    from tests.helpers import as_scalars, tensorboard_scalars

    out = _at(four, "cp2_dp2_ring_pack_mb2")
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1, os.listdir(os.path.join(out, "tensorboard"))
    assert tensorboard_scalars(out) == as_scalars(_metrics(out)) != {}


def test_micro_batch_auto_changes_nothing_and_runs_idle_rows_where_a_rank_has_fewer(one, assets):
    """--micro-batch auto on 1 rank trains as --micro-batch 1 (the same samples, fewer forwards: short text records
    and windows' remainders share rows); and on the 2 data ranks of text_cp2_dp2_ring_mb_auto (compared in
    test_split_long_text_on_four_ranks_matches_one_rank) some step cuts one rank's share into fewer micro-batches than
    the other's, so the idle rows run there (else that test could not fail on them)."""
    from data import GlobalBatches, load_tokenizer
    from data.load import load_samples

    _compare("--micro-batch auto", _at(one, "text_mb_auto"), _at(one, "text"), steps=S2)
    tok = load_tokenizer(assets["model"])
    samples, _ = load_samples(assets["text"], tok, 64, len(tok))
    order, lengths, longest = GlobalBatches(len(samples), 8, 0), samples.lengths, int(samples.lengths.max())
    cuts = [[order.micro_batches(step, d, 2, 0, lengths, longest) for d in (0, 1)] for step in range(2)]
    assert any(len(c) > 1 for step in cuts for c in step), "no two samples shared a row"
    assert any([] in c for step in cuts for c in step), "no rank ran an idle row"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK_TEXT))
def test_split_long_text_on_four_ranks_matches_one_rank(one, four, name):
    """Text records past --max-len become windows (--long-text split) before any sharding: a 4-rank run trains on
    them as 1 rank does, packed 2 windows a row under ring attention."""
    stats = json.load(open(_at(one, "text", "config.json")))["data_stats"]
    assert " split " in stats and "truncated 0" in stats, f"the 1-rank run split nothing: {stats}"
    _compare(f"4 ranks {name}", _at(four, name), _at(one, "text"), steps=S2)


@pytest.mark.timeout(600)
def test_eval_split_holds_out_whole_records_and_trains_as_the_two_files_would(one, four):
    """--eval-split 0.25 of 16 text records (11 split into windows): 4 records held out, their windows all in the eval
    set; the run equals one given the rest as --data and those records as --eval-data (losses, eval losses, adapter),
    and so does cp 2 x dp 2 Ulysses."""
    assert len(one["held"]) == 4 and "never trained on" in one["said"], one["said"]
    records = json.load(open(_at(one, "text_split", "config.json")))["eval_split_records"]
    assert records == {one["assets"]["text"]: one["held"]}, records   # (kept: data.demo_compare reads them back)
    evals = lambda out: [m["eval_loss"] for m in _metrics(out)]
    files = _at(one, "text_files")
    for label, out in (("1 rank", _at(one, "text_split")), ("4 ranks", _at(four, *FOUR_RANK_SPLIT))):
        _compare(f"{label} --eval-split vs two files", out, files, steps=S2)
        assert len(evals(out)) == 2 and max(abs(a - b) for a, b in zip(evals(out), evals(files))) <= LOSS_ATOL, \
            (label, evals(out), evals(files))
    config = lambda out: json.load(open(os.path.join(out, "config.json")))
    n = lambda out: int(config(out)["data_tokens"].split()[0])
    assert n(_at(one, "text_split")) == n(files) < n(_at(one, "text")), "the held-out windows are not trained on"


@pytest.mark.timeout(600)
def test_several_data_files_and_weights_train_as_one_file_and_on_four_ranks_as_one(one, four):
    """--data a b --data-weights 2 1 trains as one file holding a's lines twice, then b's (the same samples in the
    same order, so the same steps); with shares of a and b (1.5 0.5) that take other records in the second epoch, and
    2 records held out (--eval-split 2), cp2×dp2 ring packing 4 samples a row trains and evaluates as 1 rank does."""
    config = lambda out: json.load(open(os.path.join(out, "config.json")))
    samples = lambda out: config(out)["data_tokens"].split()[0]
    assert samples(_at(one, "files")) == samples(_at(one, "files_aab"))
    _compare("--data a b --data-weights 2 1 vs one file a a b", _at(one, "files"), _at(one, "files_aab"), steps=S2)
    ref = _at(one, "files_frac")
    keys = lambda out: sorted({k for m in _metrics(out) for k in m if k.startswith("eval_loss")})
    assert "eval_loss" in keys(ref) and len(keys(ref)) > 1, keys(ref)   # (eval_loss/FILE of a file with held records)
    for name in FOUR_RANK_FILES:
        _compare(f"4 ranks {name}", _at(four, name), ref)
        assert keys(_at(four, name)) == keys(ref), (keys(_at(four, name)), keys(ref))
        for key in keys(ref):
            got, want = ([m[key] for m in _metrics(out)] for out in (_at(four, name), ref))
            assert len(want) == 3 and max(abs(x - y) for x, y in zip(got, want)) <= LOSS_ATOL, (key, got, want)
    n = int(config(ref)["data_tokens"].split()[0])   # (the samples the shares rotate over: a's and b's, less 2 records)
    assert 0 < n < int(config(_at(one, "files"))["data_tokens"].split()[0]) / 1.5, "a's and b's samples once"
    assert config(ref)["data_mix"] == "rotate" and 1 < _metrics(ref)[-1]["epoch"] < 2, "the next halves are trained"


@pytest.mark.timeout(600)
def test_several_eval_files_give_each_files_eval_loss(one):
    """--eval-data a b: eval_loss/text_a.jsonl and eval_loss/text_b.jsonl are the eval losses of runs evaluating a or b
    alone, and eval_loss that of a run evaluating one file of a's lines and b's (the loss over all their targets, not
    the mean of the files' losses), every step; training is the same as without eval data."""
    rows = _metrics(_at(one, "eval_files"))
    alone = {f: [m["eval_loss"] for m in _metrics(_at(one, f"eval_{f}"))] for f in ("a", "b", "ab")}
    for key, want in (("eval_loss/text_a.jsonl", alone["a"]), ("eval_loss/text_b.jsonl", alone["b"]),
                      ("eval_loss", alone["ab"])):
        got = [m[key] for m in rows]
        assert len(got) == 2 and max(abs(x - y) for x, y in zip(got, want)) <= LOSS_ATOL, (key, got, want)
    assert all(abs(z - (x + y) / 2) > 1e-5 for x, y, z in zip(alone["a"], alone["b"], alone["ab"])), \
        "(a test that could not tell the two means apart)"
    _compare("--eval-data a b vs none", _at(one, "eval_files"), _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(600)
def test_keep_best_on_four_ranks_matches_one_rank(one, four):
    """--keep-best on cp 2 x dp 2 ring: every rank takes part in the same saves (the eval loss is reduced over ranks,
    so the same best everywhere; no rank waits alone in a save's collectives), and the run keeps the folders, the best
    step and an adapter_best equal to 1 rank's (which is the plain run's: the flag changes no math)."""
    from safetensors.torch import load_file

    got, want = _at(four, "keep_best_cp2_dp2_ring"), _at(one, "keep_best")
    _compare("4 ranks keep_best", got, want, steps=S2)
    _compare("keep_best vs plain", want, _at(one, "fp32_2"), steps=S2)
    evals = lambda out: [m["eval_loss"] for m in _metrics(out)]
    assert len(evals(got)) == 2 and max(abs(a - b) for a, b in zip(evals(got), evals(want))) <= LOSS_ATOL, \
        (evals(got), evals(want))
    folders = lambda out: sorted(os.listdir(os.path.join(out, "ckpt")))
    b = 1 + min(range(2), key=evals(want).__getitem__)
    assert folders(got) == folders(want) == sorted({"latest", f"step_{b:06d}", "step_000002"}), folders(got)
    a, r = (load_file(os.path.join(out, "adapter_best", "adapter_model.safetensors")) for out in (got, want))
    assert sorted(a) == sorted(r) and all(((a[k] - r[k]).norm() / r[k].norm().clamp(min=1e-12)).item()
                                          <= ADAPTER_RTOL for k in r), "adapter_best differs from 1 rank's"


@pytest.mark.timeout(600)
def test_early_stop_on_four_ranks_stops_where_one_rank_does(one, four):
    """--early-stop on cp 2 x dp 2 ring: the eval loss is reduced over ranks, so every rank stops after the same step
    (none waits alone in a collective) and the run equals 1 rank's, whose steps are the plain run's. Its eval set is 30
    short text records, evaluated in packed rows (several documents a row, zigzag-split over the ring): the same eval
    losses as 1 rank's."""
    got, want = _at(four, "early_cp2_dp2_ring"), _at(one, "early")
    _compare("4 ranks early stop", got, want, steps=(1, 2))
    evals = lambda out: [m["eval_loss"] for m in _metrics(out)]
    assert len(evals(want)) == 2 and max(abs(a - b) for a, b in zip(evals(got), evals(want))) <= LOSS_ATOL, \
        (evals(got), evals(want))
    assert [m["loss"] for m in _metrics(want)] == [m["loss"] for m in _metrics(_at(one, "fp32"))][:2]
    assert sorted(os.listdir(os.path.join(got, "ckpt"))) == ["latest", "step_000002"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK_WINDOW))
def test_four_ranks_match_one_rank_sliding_window(one, four, name):
    _compare(f"4 ranks {name}", _at(four, name), _at(one, "window"), steps=S2)
    _compare_differs_from_full(_at(one, "window"), _at(one, "fp32"))


def _compare_differs_from_full(window, full):
    """The window must change the numbers (else the test above could not fail on a window ignored)."""
    assert _metrics(window)[0]["loss"] != _metrics(full)[0]["loss"]


@pytest.mark.timeout(600)
def test_fast_fits_the_smallest_rank_budget_on_every_rank(one, four):
    """--fast on cp 2 x dp 2 ring: rank 2's budget is the smallest (it allows AC on some blocks, not none); every
    rank applies the flags for it, though rank 0's own budget, which plans, and the others' would have chosen
    another set; the log says whose budget it was; the run trains like 1 rank."""
    import train
    from model.load import read_args
    from parallel import plan_search, plan_speed
    from parallel.mesh import validate

    got, lines = [f[0] for f in four["fast"]], four["fast"][0][1]
    assert len(lines) == 2 and "rank 2's: the smallest of 4" in lines[0], lines
    assert lines[1].startswith("memory: planned") and "(rank 2's, the smallest of 4)" in lines[1], lines   # the check
    assert len(got[0]) == 1 and "--ac-blocks" in got[0][0] and got[0][0] != "--no-ac", got
    assert all(g == got[0] for g in got), f"flags applied per rank: {got}"
    args = train.build_parser().parse_args(train_argv(four["assets"], "unused", *FAST4))
    margs = read_args(args.model)
    dims, pack = validate(args, margs, 4)
    budget = plan_search._budget
    plan_search._budget = lambda a, world: ("cpu", 1e15, "test")
    try:   # what the other ranks' own budgets would have chosen
        theirs = plan_speed.fast_flags(args, margs, dims, pack, 4)[0]
    finally:
        plan_search._budget = budget
    assert theirs != got[0][0], (theirs, got)
    _compare("4 ranks --fast", _at(four, "fast_cp2_dp2_ring"), _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_host_memory_short_on_one_rank_refuses_the_run_on_every_rank(assets, tmp_path):
    """--offload-activations on cp 2 x dp 2, planned for CUDA, rank 2's free host memory below the pinned bytes: all 4
    ranks raise the same refusal before any weight is read (none waits in a collective: its own spawn, a 30 s
    process-group timeout), naming rank 2."""
    msgs = run_ranks(_host_short_on_rank_2, 4, train_argv(assets, str(tmp_path / "out"), *SHORT4), timeout=240,
                     pg_timeout=30)
    assert all(m == msgs[0] for m in msgs), msgs
    assert "pins the checkpointed blocks' inputs" in msgs[0], msgs[0]
    assert "free per rank (rank 2's, the smallest of 4)" in msgs[0], msgs[0]


@pytest.mark.timeout(300)
def test_a_metrics_write_failing_on_rank_0_stops_every_rank_at_that_step(assets, tmp_path):
    """metrics.jsonl is rank 0's disk work: a failing write (a full disk) raises there and, on the other rank, an
    error quoting it at the same step (guard.on_rank0), not a lost connection or, on NCCL, a wait for --timeout (until
    2026-12-03 the per-step write was rank 0's alone)."""
    msgs = run_ranks(_metrics_disk_full_at_step_2, 2, train_argv(assets, str(tmp_path / "out"), "--dp-shard", "2"),
                     timeout=240, pg_timeout=30)
    assert msgs[0] == "OSError: [Errno 28] No space left on device", msgs
    assert msgs[1] == ("RuntimeError: writing metrics.jsonl (step 2) failed on rank 0 (OSError: [Errno 28] No space "
                       "left on device)"), msgs


@pytest.mark.timeout(300)
def test_a_checkpoint_write_failing_on_one_rank_is_one_line_and_keeps_the_last(assets, tmp_path):
    """A full disk under one rank's part of a checkpoint (DCP's write on rank 1) stops every rank with exit 2 and one
    line naming the step, the rank and the way on, not a CheckpointException traceback per rank (until 2026-12-04);
    `latest` still names the step saved before, which the same command with --resume continues."""
    out = tmp_path / "out"
    argv = train_argv(assets, str(out), "--dp-shard", "2", "--save-every", "1")
    got = run_ranks(_ckpt_disk_full_on_rank_1, 2, argv, timeout=240, pg_timeout=30)
    assert [code for code, _ in got] == [2, 2], got
    said = got[0][1]
    assert said.startswith("error: saving checkpoint step 2 failed on rank 1 (OSError: [Errno 28] No space left on "
                           "device); no earlier checkpoint was touched. Free space (or fix the folder), then run the "
                           f"same command with --resume {out / 'ckpt'}") and "Traceback" not in said, said
    assert (out / "ckpt" / "latest").read_text().strip() == "step_000001"
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000001"], "the half-written step's space is freed"
    first = tmp_path / "first"   # nothing saved before: --resume would find nothing, so it is not what is said
    got = run_ranks(_ckpt_disk_full_on_rank_1, 2, train_argv(assets, str(first), "--dp-shard", "2", "--save-every",
                                                             "1"), "step_000001", timeout=240, pg_timeout=30)
    assert [code for code, _ in got] == [2, 2] and got[0][1].rstrip().endswith(
        f"then run the same command with --overwrite ({first} holds no checkpoint)"), got


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK_NF4))
def test_four_ranks_match_one_rank_nf4(one, four, name):
    _compare(f"4 ranks {name}", _at(four, name), _at(one, "nf4"), steps=S2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK_BNB))
def test_four_ranks_match_one_rank_4bit_checkpoint(one, four, name):
    _compare(f"4 ranks {name}", _at(four, name), _at(one, "bnb"), steps=S2)


@pytest.mark.timeout(300)
def test_tiled_mlp_and_offload_change_nothing_one_rank(one):
    _compare("--tiled-mlp --offload-activations vs neither (1 rank)", _at(one, "mem"), _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_ac_group_changes_nothing_one_rank(one):
    _compare("--tiled-mlp --ac-group 2 vs neither (1 rank)", _at(one, "group"), _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_ac_blocks_changes_nothing_one_rank(one):
    _compare("--ac-blocks 1 (block 1 keeps its activations) vs AC on both (1 rank)", _at(one, "partial_ac"),
             _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_ac_keep_attn_changes_nothing_one_rank(one):
    _compare("--ac-keep-attn (the recompute reuses attention outputs) vs plain AC (1 rank)", _at(one, "keep_attn"),
             _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_tiled_attention_changes_nothing_one_rank(one):
    _compare("--tiled-attn --tiled-mlp --offload-activations vs none of them (1 rank)", _at(one, "tiled_attn"),
             _at(one, "fp32_2"), steps=S2)
    _compare("--tiled-attn, 4 packed samples per micro-batch vs untiled", _at(one, "tiled_attn_pack"), _at(one, "pack"),
             steps=S2)
    _compare("--tiled-attn, 16-token window on layer 1 vs untiled", _at(one, "tiled_attn_window"), _at(one, "window"),
             steps=S2)


@pytest.mark.timeout(300)
def test_tiled_attention_over_several_tiles_changes_nothing(one):
    """--tiled-attn with rows longer than one tile (tiles of 256 query rows, kernels.tile_rows): each step's one packed
    row of 8 text records is over 256 tokens, so train.py runs 2 or more tiles, with the untiled run's losses and
    adapter."""
    from parallel.kernels import tile_rows

    assert all(m["tokens"] > tile_rows(m["tokens"]) for m in _metrics(_at(one, "tiles"))), _metrics(_at(one, "tiles"))
    _compare("--tiled-attn over several tiles", _at(one, "tiles"), _at(one, "tiles_ref"), steps=S2)


def test_pack_changes_nothing(one):
    _compare("--pack vs --no-pack", _at(one, "pack"), _at(one, "no_pack"), steps=S2)
    _compare("--pack micro-batch 4 vs micro-batch 1", _at(one, "pack"), _at(one, "fp32_2"), steps=S2)


@pytest.mark.timeout(300)
def test_resume_one_rank(one):
    assert one["resume_error"] is None, one["resume_error"]
    _compare("resume 1 rank from 1 rank", _at(one, "resume1"), _at(one, "fp32"), steps=(3,))


@pytest.mark.timeout(600)
def test_resume_across_layouts(assets, one, four, tmp_path):
    import train

    assert four["resume_error"] is None, four["resume_error"]
    _compare("resume 4 ranks (ring) from 4 ranks (ulysses)", _at(four, "resume4"),
             _at(one, "fp32"), steps=(3,))
    ckpt = _at(four, "cp2_dp2_ulysses", "ckpt", "step_000002")
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "resume1from4"), "--resume", ckpt))
    _compare("resume 1 rank from 4 ranks", str(tmp_path / "resume1from4"), _at(one, "fp32"), steps=(3,))


@pytest.mark.timeout(600)
def test_lora_plus_on_four_ranks_matches_one_rank_and_resumes_on_one(assets, one, four, tmp_path):
    """--lora-plus-ratio 16: cp2 x dp2 ring = 1 rank; the 4-rank step-2 checkpoint (its B group's AdamW state, sharded)
    resumed on 1 rank = the 1-rank run's step 3; and the flag trains otherwise than without it."""
    import train

    _compare("4 ranks LoRA+", _at(four, "plus_cp2_dp2_ring"), _at(one, "plus"))
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "plus1from4"), *PLUS, "--resume",
                              _at(four, "plus_cp2_dp2_ring", "ckpt", "step_000002")))
    _compare("LoRA+ resumed on 1 rank from 4 ranks", str(tmp_path / "plus1from4"), _at(one, "plus"), steps=(3,))
    plain, plus = _adapter(_at(one, "fp32")), _adapter(_at(one, "plus"))
    moved = {k: ((plus[k] - plain[k]).norm() / plain[k].norm()).item() for k in plain}
    assert min(v for k, v in moved.items() if "lora_B" in k) > 0.5, moved   # (B at 16x the LR: far from plain's)


@pytest.mark.timeout(600)
def test_dora_on_four_ranks_matches_one_rank_resumes_and_exports(assets, one, four, tmp_path):
    """--dora (nf4): cp2 x dp2 Ulysses with the tiled MLP and offload = 1 rank untiled; the 4-rank step-2 checkpoint
    (magnitudes and their AdamW state, sharded) resumed on 1 rank = the 1-rank run's step 3; `python -m
    parallel.checkpoint` of it = the run's own adapter (magnitudes under peft's key); the magnitudes trained."""
    import train
    from parallel.checkpoint_export import export

    _compare("4 ranks DoRA", _at(four, "dora_cp2_dp2_ulysses"), _at(one, "dora"))
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "dora1from4"), *DORA, "--resume",
                              _at(four, "dora_cp2_dp2_ulysses", "ckpt", "step_000002")))
    _compare("DoRA resumed on 1 rank from 4 ranks", str(tmp_path / "dora1from4"), _at(one, "dora"), steps=(3,))
    export(_at(four, "dora_cp2_dp2_ulysses", "ckpt"), str(tmp_path / "exported" / "adapter"))
    got, want = _adapter(str(tmp_path / "exported")), _adapter(_at(four, "dora_cp2_dp2_ulysses"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    mags = {k: v for k, v in want.items() if k.endswith(".lora_magnitude_vector")}
    assert len(mags) == 14 and len(want) == 42, sorted(want)[:3]
    from transformers import AutoModelForCausalLM

    from model.nf4 import nf4_round_trip
    hf = dict(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).named_parameters())
    moved = {}   # each against its start, the row norms of the 4-bit weight (B = 0 then): trained, a little
    for k, m in mags.items():
        start = nf4_round_trip(hf[k.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")])
        moved[k] = ((m - start.norm(dim=1)).abs().max() / start.norm(dim=1).max()).item()
    assert 1e-5 < min(moved.values()) and max(moved.values()) < 0.05, moved


@pytest.mark.timeout(600)
def test_train_norms_on_four_ranks_matches_one_rank_resumes_and_exports(assets, one, four, tmp_path):
    """--train-norms --train-embeddings: cp2 x dp2 ring with the tiled MLP and offload = 1 rank untiled; the 4-rank
    step-2 checkpoint (the norms, the embedding and their AdamW state, sharded) resumed on 1 rank = the 1-rank run's
    step 3; `python -m parallel.checkpoint` of it = the run's own adapter, whose norms and embedding (peft's
    modules_to_save, named in its config) moved off the base's."""
    import train
    from parallel.checkpoint_export import export

    _compare("4 ranks --train-norms", _at(four, "norms_cp2_dp2_ring"), _at(one, "norms"))
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "norms1from4"), *NORMS, "--resume",
                              _at(four, "norms_cp2_dp2_ring", "ckpt", "step_000002")))
    _compare("--train-norms resumed on 1 rank from 4 ranks", str(tmp_path / "norms1from4"), _at(one, "norms"),
             steps=(3,))
    export(_at(four, "norms_cp2_dp2_ring", "ckpt"), str(tmp_path / "exported" / "adapter"))
    got, want = _adapter(str(tmp_path / "exported")), _adapter(_at(four, "norms_cp2_dp2_ring"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    got = _export_with_base_gone(_at(four, "norms_cp2_dp2_ring", "ckpt", "step_000003"), tmp_path / "gone")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with open(os.path.join(tmp_path, "exported", "adapter", "adapter_config.json")) as f:
        saved = json.load(f)["modules_to_save"]
    norms = {k: v for k, v in want.items() if k.endswith("norm.weight") or "embed_tokens" in k}
    assert len(norms) == len(saved) == 2 * 2 + 1 + 1 and "model.embed_tokens" in saved, (sorted(norms), saved)
    from transformers import AutoModelForCausalLM
    hf = dict(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).named_parameters())
    moved = {k: ((v - hf[k.removeprefix("base_model.model.")]).abs().max()).item() for k, v in norms.items()}
    assert min(moved.values()) > 1e-4, moved


def _export_with_base_gone(step, root):
    """`python -m parallel.checkpoint` of a copy of checkpoint `step` whose recorded base is gone (meta.json's --model
    renamed): what a trained embedding's adapter needs of the base (a tied head?) comes from the checkpoint."""
    from parallel.checkpoint_export import export

    copy = shutil.copytree(step, os.path.join(root, "ckpt", os.path.basename(step)))
    with open(os.path.join(copy, "meta.json")) as f:
        meta = json.load(f)
    base, meta["args"]["model"] = meta["args"]["model"], os.path.join(root, "moved_away")
    with open(os.path.join(copy, "meta.json"), "w") as f:
        json.dump(meta, f)
    export(copy, os.path.join(root, "adapter"))
    export(copy, os.path.join(root, "given", "adapter"), model=base)   # --model: its shapes fit every trained tensor
    got = _adapter(root)
    assert got.keys() == _adapter(os.path.join(root, "given")).keys()
    return got


@pytest.mark.timeout(600)
def test_tied_embedding_on_four_ranks_matches_one_rank_resumes_and_exports(assets, one, four, tmp_path):
    """--train-embeddings on a tied model (the head is the embedding, so the loss trains it too): cp2 x dp2 Ulysses with
    the tiled MLP and offload = 1 rank; its checkpoint holds the embedding once (no lm_head alias, in the model or the
    optimizer state); resumed on 1 rank = the 1-rank run's step 3; `python -m parallel.checkpoint` of it = the run's
    own adapter, whose head (written for peft's ensure_weight_tying) is its embedding, moved off the base's."""
    import torch.distributed.checkpoint as dcp

    import train
    from parallel.checkpoint_export import export

    _compare("4 ranks tied --train-embeddings", _at(four, "tied_cp2_dp2_ulysses"), _at(one, "tied"))
    ckpt = _at(four, "tied_cp2_dp2_ulysses", "ckpt", "step_000002")
    keys = [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if "embed" in k or "lm_head" in k]
    assert sorted(keys) == ["model.model.embed_tokens.weight", *(f"optim.state.model.embed_tokens.weight.{x}" for x in
                                                                 ("exp_avg", "exp_avg_sq", "step"))], keys
    with one_thread():
        train.main(train_argv({**assets, "model": assets["tied"]}, str(tmp_path / "tied1from4"), *TIED, "--resume",
                              ckpt))
    _compare("tied --train-embeddings resumed on 1 rank from 4 ranks", str(tmp_path / "tied1from4"), _at(one, "tied"),
             steps=(3,))
    export(_at(four, "tied_cp2_dp2_ulysses", "ckpt"), str(tmp_path / "exported" / "adapter"))
    got, want = _adapter(str(tmp_path / "exported")), _adapter(_at(four, "tied_cp2_dp2_ulysses"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    got = _export_with_base_gone(_at(four, "tied_cp2_dp2_ulysses", "ckpt", "step_000003"), tmp_path / "gone")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    head, emb = want["base_model.model.lm_head.weight"], want["base_model.model.model.embed_tokens.weight"]
    assert torch.equal(head, emb)
    with open(os.path.join(tmp_path, "exported", "adapter", "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["modules_to_save"] == ["model.embed_tokens"] and cfg["ensure_weight_tying"] is True, cfg
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(assets["tied"], dtype=torch.float32).model.embed_tokens.weight
    assert (emb - base).abs().max() > 1e-4


@pytest.mark.timeout(600)
def test_lora_layers_on_four_ranks_match_one_rank(one, four, tmp_path):
    """--lora-layers 1 (with --rslora and --rope-scaling yarn:4) on cp2 x dp2 ring with offload and the tiled MLP = 1
    rank without them; its adapter holds block 1's LoRA alone and trained otherwise than every block's (the run's
    function differs); `python -m parallel.checkpoint` of the 4-rank run's checkpoint = its adapter,
    layers_to_transform [1] and use_rslora in both configs, and both hold the YaRN as 1 rank's adapter does."""
    from parallel.checkpoint_export import export

    _compare("4 ranks --lora-layers 1", _at(four, "layers_cp2_dp2_ring"), _at(one, "layers"), steps=S2)
    ad = _adapter(_at(one, "layers"))
    assert {k.split(".")[4] for k in ad} == {"1"} and len(ad) == 2 * 7, sorted(ad)[:3]
    assert _metrics(_at(one, "layers"))[1]["loss"] != _metrics(_at(one, "fp32"))[1]["loss"]
    export(_at(four, "layers_cp2_dp2_ring", "ckpt"), str(tmp_path / "adapter"))
    got, want = _adapter(str(tmp_path)), _adapter(_at(four, "layers_cp2_dp2_ring"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    rope = lambda d: json.load(open(os.path.join(d, "base_config_overrides.json")))["rope_parameters"]
    assert rope(_at(one, "layers", "adapter"))["rope_type"] == "yarn"
    for d in (str(tmp_path / "adapter"), _at(four, "layers_cp2_dp2_ring", "adapter")):
        cfg = json.load(open(os.path.join(d, "adapter_config.json")))
        assert cfg["layers_to_transform"] == [1] and cfg["use_rslora"] is True, (d, cfg)
        assert rope(d) == rope(_at(one, "layers", "adapter")), d


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FOUR_RANK_DFT))
def test_dft_on_four_ranks_matches_one_rank(one, four, name):
    """cp2×dp2 = 1 rank under --sft-loss dft; each step's loss also within 1e-4 relative: DFT's losses here are ~p
    (~1/400 at the start) × the cross-entropy, so _compare's 1e-4 absolute alone would let 1% through."""
    _compare(name, _at(four, name), _at(one, "dft"), steps=S2)
    for got, want in zip(_metrics(_at(four, name)), _metrics(_at(one, "dft"))):
        assert abs(got["loss"] - want["loss"]) <= 1e-4 * want["loss"], (name, got["step"], got["loss"], want["loss"])


def test_dft_trains_its_loss_and_evaluates_the_cross_entropy(one):
    """--sft-loss dft on 1 rank (2 steps): the start-up line names the loss; step 1 (the same weights and tokens as the
    plain run's) logs DFT's loss, below the cross-entropy (sg(p)·(-log p) < -log p), and so does step 2; the eval loss
    after step 2 is the cross-entropy of the weights it ended at: a run without the flag evaluating its adapter before
    its first step logs it, to the digit; `make plot` labels the training curve DFT's."""
    said, at = one["dft"]
    assert "loss: DFT: each target's cross-entropy × its probability, held constant (--sft-loss dft)" in said, said
    dft, ce = _metrics(_at(one, "dft")), _metrics(_at(one, "fp32_2"))
    assert len(dft) == 2 and [m["tokens"] for m in dft] == [m["tokens"] for m in ce]
    assert all(d["loss"] < 0.9 * c["loss"] for d, c in zip(dft, ce)), (dft, ce)
    last = dft[-1]["eval_loss"]
    before = float(re.search(r"eval_loss before training (\S+)", at).group(1))
    assert abs(last - before) <= 1e-6, (last, before)
    assert last > 1.5 * dft[-1]["loss"], "the eval loss is the cross-entropy, not DFT's (~p times it)"
    import matplotlib.pyplot as plt

    from bench import plot

    for run, want in (("dft", "train loss (DFT)"), ("fp32", "train loss")):   # (make plot names the curve)
        plot.main(_at(one, run, "metrics.jsonl"), _at(one, f"{run}.png"))
        labels = [line.get_label() for line in plt.gcf().axes[0].get_lines()]
        plt.close("all")
        assert labels[0] == want, (run, labels)


def test_sft_loss_refused_with_dpo_and_a_loss_fn_and_kept_by_a_resume(assets, tmp_path):
    """--sft-loss dft is refused before any weight with --objective dpo and with train.py's LOSS_FN set (each message
    naming the value and the fix); it defines the run (parallel/resume.py's RUN_DEFINING): a resume with the other
    value is refused naming it, and a checkpoint from before the flag resumes as ce."""
    import torch.nn.functional as F

    import train
    from parallel import resume
    from tests.test_runs import CKPT

    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--objective", "dpo", "--sft-loss", "dft"))
    assert "--sft-loss dft with --objective dpo" in msg and "drop --sft-loss" in msg, msg
    keep = train.LOSS_FN
    train.LOSS_FN = lambda z, y: F.cross_entropy(z, y, ignore_index=-100, reduction="sum", label_smoothing=0.1)
    try:
        msg = startup_error(train_argv(assets, out, *DFT))
    finally:
        train.LOSS_FN = keep
    assert "--sft-loss dft weights the fused cross-entropy" in msg and "set LOSS_FN = None" in msg, msg
    assert not os.path.exists(out)
    for was, now in (("dft", "ce"), ("ce", "dft"), (None, "dft")):
        with pytest.raises(ValueError, match="--sft-loss: the checkpoint has"):
            resume.check_resume(dict(CKPT) if was is None else {**CKPT, "sft_loss": was}, {**CKPT, "sft_loss": now})
    resume.check_resume(dict(CKPT), {**CKPT, "sft_loss": "ce"})   # (recorded before the flag: ce)
    resume.check_resume({**CKPT, "sft_loss": "dft"}, {**CKPT, "sft_loss": "dft"})


def test_init_adapter_four_ranks_match_one_rank(assets, four, tmp_path):
    import train

    out = str(tmp_path / "init1")
    with one_thread():
        train.main(train_argv(assets, out, "--steps", "1", "--init-adapter",
                              _at(four, "cp2_dp2_ulysses", "adapter")))
    _compare("--init-adapter, 4 ranks ring vs 1 rank", _at(four, "init_cp2_dp2_ring"), out, steps=(1,))
    out = str(tmp_path / "init_norms1")   # an adapter with trained norms (test_norms: one process loads them all)
    with one_thread():
        train.main(train_argv(assets, out, "--steps", "1", "--train-norms", "--train-embeddings", "--init-adapter",
                              _at(four, "norms_cp2_dp2_ring", "adapter")))
    _compare("--init-adapter --train-norms, 4 ranks ring vs 1 rank", _at(four, "init_norms_cp2_dp2_ring"), out,
             steps=(1,))


@pytest.mark.timeout(600)
def test_export_of_a_sharded_checkpoint_is_the_runs_adapter(four, tmp_path):
    from parallel.checkpoint_export import export

    run = _at(four, "cp2_dp2_ulysses")
    assert export(os.path.join(run, "ckpt"), str(tmp_path / "adapter")).endswith("step_000003")
    got, want = _adapter(str(tmp_path)), _adapter(run)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a damaged data file, or one a live run's rotation removed while this read it: a ValueError naming the folder
    # (`python -m parallel.checkpoint` prints it as one error line), never DCP's traceback (review, helper 46)
    for how in ("torn", "gone"):
        ckpt = str(tmp_path / how / "ckpt")
        shutil.copytree(os.path.join(run, "ckpt"), ckpt)
        step = os.path.join(ckpt, "step_000003")
        for f in [f for f in os.listdir(step) if f.endswith(".distcp")]:
            if how == "gone":
                os.remove(os.path.join(step, f))
            else:
                os.truncate(os.path.join(step, f), 10)
        with pytest.raises(ValueError, match=f"checkpoint {re.escape(repr(step))} cannot be read"):
            export(step, str(tmp_path / how / "adapter"))
        assert not os.path.exists(tmp_path / how / "adapter" / "adapter_model.safetensors")


@pytest.mark.timeout(600)
def test_a_signal_on_one_rank_stops_all_and_resume_trains_as_uninterrupted(assets, one, four):
    import train

    out = _at(four, "stop_cp2_dp2_ring")
    msg = f"stopped on SIGTERM before step 2's update: step 1 is saved in {os.path.join(out, 'ckpt')}"
    assert four["stopped"] == [(msg, 128 + signal.SIGTERM, 6)] * 4, four["stopped"]   # each rank: 6 micro-batches
    assert open(os.path.join(out, "ckpt", "latest")).read() == "step_000001"
    assert [m["step"] for m in _metrics(out)] == [1] and not os.path.exists(os.path.join(out, "adapter"))
    with one_thread():
        train.main(train_argv(assets, out, "--resume", os.path.join(out, "ckpt")))
    _compare("stopped on 4 ranks at step 2, resumed on 1", out, _at(one, "fp32"), steps=(1, 2, 3))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("label", list(FOUR_RANK_ERRORS))
def test_four_rank_startup_errors(four, label):
    msg = four["errors"][label]
    for phrase in FOUR_RANK_ERRORS[label][1]:
        assert phrase in msg, f"{label}: {phrase!r} not in {msg!r}"


def test_startup_errors_before_weights(assets, tmp_path, capsys):
    import train

    out = str(tmp_path / "out")
    with no_weights(), pytest.raises(SystemExit):   # argparse's: a run's and the planner's --max-len
        train.main(train_argv(assets, out, "--max-len", "0"))
    err = capsys.readouterr().err
    assert "argument --max-len: 0: a sample is truncated to --max-len tokens, so it must be at least 2" in err, err
    cases = {
        "world size": (["--dp-shard", "2"], ["--dp-shard 2", "= 2 but the world size is 1"]),
        "global batch": (["--global-batch", "6", "--micro-batch", "4"],
                         ["--global-batch 6 must be a multiple of --micro-batch 4", "= 4", "--global-batch 4 or 8"]),
        "lr": (["--lr", "0"], ["--lr must be > 0, got 0.0"]),
        # (until 2026-12-04: an overflow traceback in torch, datetime or AdamW, or silently ignored / accepted)
        "lr huge": (["--lr", "1e300"], ["--lr must be <= 1"]),
        "timeout huge": (["--timeout", "1e300"], ["--timeout must be <= 1e6 minutes"]),
        "seed huge": (["--seed", str(2 ** 52)], ["--seed must be between -2**40 and 2**40"]),
        # (until 2026-12-07 a float32 overflow traceback in the first forward, the weights read)
        "lora alpha huge": (["--lora-alpha", "1e308"], ["--lora-alpha must be <= 1e6", "got 1e+308"]),
        # (until 2026-12-07 a step to NaN weights, then "refusing to write checkpoint", the weights read)
        "weight decay past 1 / lr": (["--lr", "1e-3", "--weight-decay", "1e300"], [
            "--weight-decay 1e+300 with --lr 0.001", "below 1 / lr = 1000"]),
        "weight decay past 1 / B's lr": (["--lr", "1e-3", "--lora-plus-ratio", "16", "--weight-decay", "100"], [
            "--weight-decay 100 with --lr 0.001 (B's rate 0.016, × --lora-plus-ratio)", "below 1 / lr = 62.5"]),
        "peak tflops": (["--peak-tflops", "-5"], ["--peak-tflops must be a positive number"]),
        "ulysses degree 0": (["--cp-impl", "hybrid", "--ulysses-degree", "0"], ["--ulysses-degree must be >= 1"]),
        "ulysses degree alone": (["--ulysses-degree", "2"], ["--ulysses-degree 2 applies only with --cp-impl hybrid"]),
        # (these two until 2026-12-04: accepted; 1e11 hung in its first step)
        "global batch huge": (["--global-batch", "100000000000"],
                              ["--global-batch must be <= 10 million samples a step", "got 100000000000"]),
        "out inside the model": (["--out", os.path.join(assets["model"], "run")],
                                 ["lies inside --model", "pass a directory outside it"]),
        "eval split and eval data": (["--eval-split", "0.1", "--eval-data", assets["data"]],
                                     ["--eval-split 0.1 and --eval-data", "both name the eval set: pass one"]),
        "eval split share": (["--eval-split", "1.5"], ["--eval-split must be a share", "or a whole number", "got 1.5"]),
        "eval split zero": (["--eval-split", "0"], ["--eval-split must be a share", "got 0"]),
        "eval split nan": (["--eval-split", "nan"], ["--eval-split must be a share", "got nan"]),
        "eval split inf": (["--eval-split", "inf"], ["--eval-split must be a share", "got inf"]),   # (was a traceback)
        "keep best without eval": (["--keep-best", "--eval-every", "1"], ["pass --eval-data FILE (or --eval-split)"]),
        "data file twice": (["--data", assets["data"], assets["data"]],
                            [f"--data names {assets['data']!r} twice: name each file once; --data-weights 2 trains"]),
        "data weights count": (["--data-weights", "1", "2"], ["--data-weights gives 2 weights for 1 --data file"]),
        "data weight zero": (["--data-weights", "0"], ["--data-weights 0 for", "drop it from --data"]),
        "eval file twice": (["--eval-data", assets["data"], assets["data"]],
                            [f"--eval-data names {assets['data']!r} twice: name each file once; each eval file"]),
    }
    for label, (flags, phrases) in cases.items():
        msg = startup_error(train_argv(assets, out, *flags))
        for phrase in phrases:
            assert phrase in msg, f"{label}: {phrase!r} not in {msg!r}"
    assert not os.path.exists(os.path.join(assets["model"], "run"))
    # (these three until 2026-12-04: said after the data were tokenized, the run directory made, or as an OSError)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    (tmp_path / "afile").write_text("x")
    for where, said in ((tmp_path / "dangling", "which does not exist: create that directory"),
                        (tmp_path / "afile" / "run", f"{str(tmp_path / 'afile')!r} is a file, so no directory")):
        msg = startup_error(train_argv(assets, str(where), "--steps", "1"))
        assert f"--out {str(where)!r}" in msg and said in msg, msg
    bare = tmp_path / "no_weights"
    shutil.copytree(assets["model"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    msg = startup_error(train_argv({**assets, "model": str(bare)}, out))
    assert msg == f"no *.safetensors in {str(bare)!r}; convert the checkpoint with transformers' " \
                  "save_pretrained(safe_serialization=True)", msg
    (broken := tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }\n")
    msg = startup_error(train_argv(assets, out, "--chat-template", str(broken)))   # (was: "fix the record")
    assert msg == "--chat-template: the template is not valid Jinja (line 1: unexpected '}'): fix the template", msg
    missing = str(tmp_path / "nope.jsonl")
    msg = startup_error(train_argv(assets, out, "--data", missing))
    assert "--data" in msg and missing in msg and "does not exist" in msg, msg
    msg = startup_error(train_argv(assets, out, "--data", assets["data"], missing))   # (a second file)
    assert msg.startswith(f"--data {missing} does not exist"), msg
    (tmp_path / "same.jsonl").symlink_to(assets["data"])
    msg = startup_error(train_argv(assets, out, "--data", assets["data"], str(tmp_path / "same.jsonl")))
    assert f"--data names {assets['data']!r} and {str(tmp_path / 'same.jsonl')!r}, the same file: name each" in msg, msg
    for flag, values in (("--data", [assets["data"]]), ("--data-weights", ["1"])):   # a second would replace the first
        with no_weights(), pytest.raises(SystemExit):
            train.main([*train_argv(assets, out, flag, *values), flag, *values])
        err = capsys.readouterr().err
        assert f"argument {flag}: given twice ({' '.join(values)}; then {' '.join(values)}): pass every value after " \
               f"one {flag}" in err, err
    missing = str(tmp_path / "no_model")
    msg = startup_error(train_argv(assets, out, "--model", missing))
    assert missing in msg and "does not exist" in msg, msg
    assert not os.path.exists(out), "a failed start-up must not create the output dir"


def test_data_errors_name_file_and_line(assets, tmp_path):
    import train
    from data import DataError

    good = open(assets["data"]).read().splitlines()
    for label, bad, phrase in (("malformed JSON", '{"messages": [', "not valid JSON"),
                               ("neither field", '{"question": "hi"}',
                                'has none of "text", "prompt"/"completion", "messages"')):
        path = tmp_path / f"{label.replace(' ', '_')}.jsonl"
        path.write_text("\n".join(good[:2] + [bad] + good[2:5]) + "\n")
        with no_weights(), pytest.raises(DataError) as e:
            train.main(train_argv(assets, str(tmp_path / "out"), "--data", str(path)))
        msg = str(e.value)
        assert f"{path}, line 3" in msg and phrase in msg, f"{label}: {msg!r}"


def test_cuda_allocator_default_leaves_a_users_setting():
    """train.py (imported, before torch) sets expandable segments for CUDA's caching allocator only when neither
    PYTORCH_CUDA_ALLOC_CONF nor PYTORCH_ALLOC_CONF (nor ROCm's PYTORCH_HIP_ALLOC_CONF) is set; that it takes effect:
    tests/gpu (reserved bytes). One fresh interpreter per environment, all at once."""
    import subprocess
    import sys

    cases = [({}, ["expandable_segments:True", None]),
             ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, ["max_split_size_mb:512", None]),
             ({"PYTORCH_ALLOC_CONF": "backend:native"}, [None, "backend:native"]),
             ({"PYTORCH_HIP_ALLOC_CONF": "backend:native"}, [None, None])]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")}
    code = ("import json, os, sys; import train; assert 'torch' in sys.modules; print(json.dumps("
            "[os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), os.environ.get('PYTORCH_ALLOC_CONF')]))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**base, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env, _ in cases]
    for (env, want), p in zip(cases, procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (env, err[-2000:])
        assert json.loads(out.strip().splitlines()[-1]) == want, (env, out)


def test_start_up_notes_are_said_before_a_refusal(monkeypatch):
    """parallel/notes.py says each start-up note before a refusal that follows it, as train.py did before the move
    (review, helper 71: the --global-batch, epoch and --warmup notes were dropped when --profile was refused, the
    --max-len and same-tokens notes when a resume of an early-stopped run was; the --global-batch note came before
    total_steps' refusal), and the loss line says `cross-entropy` only for LOSS_FN None (a fork's LOSS_FN recorded as
    "cross-entropy", `recorded_as`, is a LOSS_FN)."""
    from types import SimpleNamespace

    from parallel import checkpoint_folders, keep_best, notes, resume, run_length

    said = []
    order = SimpleNamespace(size=lambda e: 10, samples_in=lambda e: int(10 * e))
    args = SimpleNamespace(global_batch=50, eval_split=None, steps=None, epochs=None, schedule_steps=None, warmup=5,
                           lr=1e-3, lr_schedule="cosine", wsd_decay=None, profile=9, max_len=64, resume_auto=None)
    with pytest.raises(ValueError, match="--profile 9: this run has steps 1..1"):
        notes.length(args, order, False, None, None, lambda s, a, n: 1e-4, said.append)
    assert [x.split(":")[1].split()[0] for x in said] == ["--global-batch", "one", "--warmup"], said
    said.clear()
    monkeypatch.setattr(run_length, "total_steps", lambda *a: (_ for _ in ()).throw(ValueError("below the checkpoint")))
    with pytest.raises(ValueError, match="below the checkpoint"):
        notes.length(args, order, False, "ckpt", None, lambda s, a, n: 1e-4, said.append)
    assert len(said) == 1 and said[0].startswith("note: --global-batch 50"), said
    said.clear()
    monkeypatch.setattr(checkpoint_folders, "read_meta", lambda ckpt: {"args": {}, "step": 3})
    monkeypatch.setattr(resume, "same_tokens", lambda *a, **k: "note: the tokens differ")
    monkeypatch.setattr(keep_best, "exhausted", lambda *a: "it stopped early")
    stats = SimpleNamespace(split=2, truncated=1, longest=99)
    with pytest.raises(ValueError, match="it stopped early"):
        notes.resumed(args, [], False, "ckpt", stats, None, said.append)
    assert len(said) == 2 and said[0].startswith("note: --max-len was not given") and said[1] == \
        "note: the tokens differ", said
    said.clear()
    margs = SimpleNamespace(beyond_context=lambda n: None)
    run = SimpleNamespace(objective="sft", loss="cross-entropy", init_adapter=None, max_len=64,
                          chat_template_text=None, model_sha256=None, quant="none", rope_scaling=None)
    notes.start(run, margs, "dims", None, said.append, default_loss=False)
    notes.start(run, margs, "dims", None, said.append)
    assert said == ["layout: dims\nloss: LOSS_FN: cross-entropy ... (all: config.json's loss)",
                    "layout: dims\nloss: cross-entropy"], said


# 3 ranks, an odd world (3 or 6 GPUs are common): the zigzag ring over 6 chunks with packed rows, and FSDP2 over 3
# shards whose sizes differ (LoRA A's 4 rows, the vocabulary's rows: not multiples of 3)
THREE_RANK = {"cp3_ring_pack_mb2": ["--cp", "3", "--cp-impl", "ring", "--micro-batch", "2", *TWO],
              "dp3_gb6": ["--dp-shard", "3", "--global-batch", "6", *TWO]}


def _three_ranks(rank, world_size, assets, root):
    import train

    for name, flags in THREE_RANK.items():
        train.main(train_argv(assets, os.path.join(root, name), *flags))


@pytest.mark.timeout(600)
def test_three_ranks_match_one_rank(assets, one, tmp_path):
    """An odd world size: cp 3 ring (packed, 2 documents a row) = the 1-rank run; dp_shard 3 with a global batch of 6
    = 1 rank with the same global batch (run here): losses, grad norms and adapter, each of 2 steps."""
    import train

    run_ranks(_three_ranks, 3, assets, str(tmp_path), timeout=540, pg_timeout=120)
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "gb6"), "--global-batch", "6", *TWO))
    _compare("3 ranks cp3_ring_pack_mb2", str(tmp_path / "cp3_ring_pack_mb2"), _at(one, "fp32_2"), steps=S2)
    _compare("3 ranks dp3_gb6", str(tmp_path / "dp3_gb6"), str(tmp_path / "gb6"), steps=S2)
    with pytest.raises(AssertionError, match="tokens"):   # (the references differ: the comparison can tell)
        _compare("gb6 vs gb8", str(tmp_path / "gb6"), _at(one, "fp32_2"), steps=S2)
