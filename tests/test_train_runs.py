"""train.py keeps what a user has and never goes silently wrong (DESIGN.md "Runs and outputs").

Pins, on 1 CPU rank with the tiny Qwen2 checkpoint of tests/conftest.py (each refusal exits before any
weight is read, checked with tripwires, and leaves every earlier file byte-identical):
- a used --out is refused unless --resume or --overwrite; --overwrite replaces the run; no --out gives a
  fresh runs/<date-time> directory; a live run's lock refuses a second run in its directory;
- resume refuses a changed run-defining flag (naming flag, checkpoint value and new value) and a
  --steps below the checkpoint's step; after a resume, metrics.jsonl holds each step once; a chat template that
  writes today's date renders the run's day (--template-date) again on a resume days later;
- a non-finite step is skipped, counted and logged as strict JSON; N in a row stop the run with no
  checkpoint or adapter written (also on 2 gloo ranks, cp 2 ring, with the NaN or inf on one rank alone: both skip
  and train on as 1 rank, or both stop with one error); non-finite and out-of-range flags are refused up front;
- token ids beyond the model's vocabulary, a directory as --data, an eval file with no target,
  --out naming a file and a missing --resume are refused up front, naming the value and the fix;
- --keep-ckpts bounds the checkpoints kept; the CLI prints a start-up error once per torchrun job;
- `--init-adapter A/adapter` (A trained q/v only; this run all seven projections): the eval loss before training
  equals A's final eval loss (the function A learned; the other projections start with B = 0); an adapter with
  another r or alpha, targets beyond --lora-targets, DoRA, a trained bias, saved modules, an alpha_pattern (adapters
  made elsewhere), a missing folder, and one inside an --out that --overwrite would empty are refused before any
  weight is read; tensors that are not LoRA A/B weights or do not fit the model when they load; a resume needs
  neither the adapter nor its folder (LoRA comes from the checkpoint);
- `python -m parallel.checkpoint OUT/ckpt --out DIR` writes the adapter the run exported (same tensors bit for
  bit, same adapter_config.json); a step folder gives that step's; a non-empty DIR is refused (exit 2, naming it);
- SIGTERM in step 3's third micro-batch stops the run at the next one: steps 1..2 saved (the checkpoint holds
  the RNG as step 2 left it, so LoRA dropout replays), no adapter, the handlers restored; resumed, it logs
  each step once and trains bit for bit as the uninterrupted run; a run with dropout repeats itself exactly
  (the RNG is seeded from --seed); `torchrun` on 2 ranks, sent SIGTERM mid-run, forwards it and the workers
  exit 143 with the log lines and the newest checkpoint at the same step, and a resume finishes the run;
  importing the model prints no bitsandbytes kernels-community line (those runs' processes);
- the start-up memory check plans the data's longest sample against every rank's memory: a plan that cannot fit
  (0.95 of its live tensors over the device) is refused before any weight is read, naming single changes that fit
  (the first, typed, passes); --no-mem-check and a plan just over the device warn; an eval sample longer than every
  training one is planned as a bound that warns, never refuses; offload pinning more than the free host memory is
  refused; the host memory of a machine is shared by its ranks; the free host memory is the
  least of psutil's and every memory cgroup's above the process (v1, v2, Slurm's job-level limit); a CPU run's
  memory is the RAM, or the job's cgroup limit when lower, over the local ranks.

Cost (2026-12-07): runs take --micro-batch 2 (quick_argv: MB = 4 micro-batches a step of 8, still accumulated) where
their flags set no other; those that count micro-batches (a signal, a crash or NaN in one) count in MB; a run equal
to one already made is a copy of its folder or a module fixture (`done`, `dropout_ref`); eval sets are 10 records
where the claim holds on any (eval_head); a note said before the model build is read at the build's tripwire; and
only the CLI's own behaviour (signals, exit codes, torchrun, two processes of a job) runs in subprocesses (the
bitsandbytes import check reads the torchrun test's logs).

Run: .venv/bin/python -m pytest -q tests/test_train_runs.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from parallel import notes
from tests.helpers import budget_between_ac_plans, eval_head, no_weights, one_thread, startup_error, train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_hash(path) -> dict:
    """Every file under `path` with its sha256: 'byte-identical' made checkable."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def run(argv):
    import train

    with one_thread():
        train.main(argv)


def quick_argv(assets, out, *extra):
    """train_argv with --micro-batch 2: 4 micro-batches a step of 8 samples, not 8 (still accumulated over several),
    about half a step's cost; for runs whose claims count no micro-batch (micro_batch is a layout flag: a resume may
    change it, so every run of a test that compares losses takes the same)."""
    return train_argv(assets, out, "--micro-batch", "2", *extra)


MB = 4   # quick_argv's micro-batches a step on 1 rank (--global-batch 8 in micro-batches of 2)


def metrics(out) -> list[dict]:
    def no_nan(name):
        raise AssertionError(f"metrics.jsonl holds the non-JSON literal {name}")

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=no_nan) for line in f]


DROPOUT = ("--steps", "4", "--lora-dropout", "0.1")


@pytest.fixture(scope="module")
def dropout_ref(assets, tmp_path_factory):
    """The uninterrupted 4-step run with LoRA dropout (quick_argv) that the stopped and requeued runs must end as."""
    out = str(tmp_path_factory.mktemp("dropout") / "ref")
    run(quick_argv(assets, out, *DROPOUT))
    return out


@pytest.fixture(scope="module")
def done(assets, tmp_path_factory):
    """One finished 4-step run (checkpoints at 2 and 4; --micro-batch 2): the 'earlier results' the refusals must
    keep, and a run the tests that resume it copy."""
    out = str(tmp_path_factory.mktemp("done") / "out")
    run(quick_argv(assets, out, "--steps", "4", "--save-every", "2"))
    return out


def test_used_out_is_refused_and_untouched(assets, done, tmp_path):
    before = tree_hash(done)
    msg = startup_error(train_argv(assets, done, "--steps", "4"))
    assert done in msg and "--resume" in msg and "--overwrite" in msg, msg
    target = tmp_path / "a_file"
    target.write_text("keep me")
    msg = startup_error(train_argv(assets, str(target), "--steps", "1"))
    assert str(target) in msg and "file" in msg, msg
    assert target.read_text() == "keep me" and tree_hash(done) == before


def test_overwrite_replaces_the_run(assets, done, tmp_path):
    """(The run overwritten is a copy of the module's `done`.)"""
    out = str(tmp_path / "out")
    shutil.copytree(done, out)
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["latest", "step_000002", "step_000004"]
    run(quick_argv(assets, out, "--steps", "1", "--overwrite"))
    assert [r["step"] for r in metrics(out)] == [1], "the old metrics are gone, not appended to"
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["latest", "step_000001"], "old checkpoints removed"
    run_files = ("mem_phases.json", "mem_trace.rank0.txt", "mem_trace.rank1.txt", "profile.txt", "profile-rank1.txt",
                 "loss.png", "metrics.abandoned.jsonl")
    for name in run_files + ("notes.txt",):   # the old run's other outputs, and the user's own file
        open(os.path.join(out, name), "w").close()
    run(quick_argv(assets, out, "--steps", "1", "--overwrite"))
    assert not any(os.path.exists(os.path.join(out, n)) for n in run_files), os.listdir(out)
    assert os.path.isfile(os.path.join(out, "notes.txt")), "--overwrite removed a file the run did not write"


def test_overwrite_keeps_the_old_run_until_the_new_one_has_its_model(assets, done, tmp_path, monkeypatch, capsys):
    """--overwrite deletes the old run only once the new one has its model built, as it writes its first file: one that
    fails or is stopped before (a weight file it cannot read, Ctrl-C in a model build of minutes) leaves the old run
    byte for byte, and its way on is the same command, not a --resume of the old run's checkpoint (until 2026-12-07
    the claim deleted it first, and such a start lost it). (The run overwritten is a copy of the module's `done`.)"""
    import parallel.parallelize
    import train

    out = str(tmp_path / "out")
    shutil.copytree(done, out)
    before = {p: h for p, h in tree_hash(out).items() if p != "run.lock"}   # (the lock's note names its holder)

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    argv = quick_argv(assets, out, "--steps", "1", "--overwrite")
    with monkeypatch.context() as m, one_thread():
        m.setattr(parallel.parallelize, "build_model", ctrl_c)
        code = train.cli(argv)
    said = capsys.readouterr()
    assert code == 130 and said.err.strip() == "error: interrupted (SIGINT): run the same command again", said.err
    assert {p: h for p, h in tree_hash(out).items() if p != "run.lock"} == before, "the old run was deleted"
    said_out = f"out: {out} (--overwrite: adapter, ckpt, metrics.jsonl, config.json are deleted once the model is " \
        "built)"
    assert said_out in said.out, said.out
    run(argv)   # the same command, and it replaces the run
    assert [r["step"] for r in metrics(out)] == [1]
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["latest", "step_000001"]


def test_overwrite_refuses_a_model_directory(assets, tmp_path):
    """A checkpoint folder has a config.json too: --overwrite (also with --out equal to --model) refuses it, naming
    why, and leaves it byte for byte, rather than deleting its config.json as a run's."""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    before = tree_hash(model)
    msg = startup_error(train_argv(assets, str(model), "--steps", "1", "--overwrite"))
    assert f"--overwrite refuses {str(model)!r}: it holds model weights (model.safetensors)" in msg, msg
    os.remove(model / "model.safetensors")   # the weights elsewhere: its config.json still says what it is
    before = tree_hash(model)
    msg = startup_error(train_argv(assets, str(model), "--steps", "1", "--overwrite"))
    assert "its config.json is a model's (model_type 'qwen2')" in msg, msg
    assert tree_hash(model) == before


def test_default_out_is_fresh_and_lock_refuses_a_live_run(assets, tmp_path, monkeypatch):
    from parallel import runs

    monkeypatch.chdir(tmp_path)
    argv = [a for a in quick_argv(assets, "x", "--steps", "1") if a not in ("--out", "x")]
    run(argv)
    run(argv)
    made = sorted(os.listdir(tmp_path / "runs"))
    assert len(made) == 2 and all(len(metrics(tmp_path / "runs" / d)) == 1 for d in made), made
    live = runs.claim(str(tmp_path / "live"))   # another run holds this directory
    try:
        msg = startup_error(train_argv(assets, str(tmp_path / "live"), "--steps", "1", "--overwrite"))
    finally:
        live.release()
    assert "in use by a live run" in msg and f"pid {os.getpid()}" in msg, msg


def test_a_resume_of_a_live_run_is_refused_before_its_steps_are_read(assets, done, monkeypatch):
    """--resume OUT/ckpt while the run in OUT is alive (still saving) is refused as such before the step folder is
    resolved, into its own --out or another: until 2026-12-04 it was resolved first, and the live run's rotation then
    removed it ("No such file ... meta.json", or "the ranks resolved different checkpoints" on 2 ranks)."""
    from parallel import checkpoint_folders, runs

    fd = runs._lock(done)   # the live run
    try:
        monkeypatch.setattr(checkpoint_folders, "resolve",
                            lambda *a, **k: pytest.fail("resolved before the lock was seen"))
        for out in (["--out", done], []):   # (without --out: the checkpoint's own run)
            argv = train_argv(assets, done, "--steps", "4", "--resume", os.path.join(done, "ckpt"))
            if not out:
                argv = argv[:argv.index("--out")] + argv[argv.index("--out") + 2:]
            msg = startup_error(argv)
            assert "is in use by a live run" in msg and f"pid {os.getpid()}" in msg, msg
        # into another --out too (review, helper 54: refused only by the step's absence, after tokenizing)
        other = os.path.join(os.path.dirname(done), "other_out")
        for resume in (os.path.join(done, "ckpt"), os.path.join(done, "ckpt", "step_000002")):
            msg = startup_error(train_argv(assets, other, "--steps", "4", "--resume", resume))
            assert f"--resume {resume!r}: its run {done!r} is live (pid {os.getpid()}" in msg and \
                "wait for it to end (or copy a step folder elsewhere and --resume that)" in msg, msg
        assert not os.path.exists(other)
    finally:
        os.close(fd)


def test_dense_default_targets_recorded_as_before(assets, done):
    """No --lora-targets on a dense model: DEFAULT_TARGETS less the linear layers' names a model without them drops
    (model.lora_spec.model_targets), as before the MoE models' default (test_qwen3_moe.py): the seven, recorded in
    config.json and every checkpoint, the adapter's target_modules."""
    from model.lora_spec import DEFAULT_TARGETS, LORA_TARGETS

    assert DEFAULT_TARGETS[:7] == LORA_TARGETS
    for f in ("config.json", "ckpt/step_000002/meta.json"):
        with open(os.path.join(done, f)) as fh:
            got = json.load(fh)
        assert got.get("args", got)["lora_targets"] == ",".join(LORA_TARGETS), (f, got.get("args", got))
    with open(os.path.join(done, "adapter", "adapter_config.json")) as fh:
        assert sorted(json.load(fh)["target_modules"]) == sorted(LORA_TARGETS)


def test_resume_refuses_changed_run_flags(assets, done, monkeypatch):
    """...and another loss: train.py's LOSS_FN is recorded in config.json and every checkpoint as a flag is."""
    import train

    ckpt = os.path.join(done, "ckpt")
    before = tree_hash(done)
    assert json.load(open(os.path.join(done, "config.json")))["loss"] == "cross-entropy"
    with monkeypatch.context() as m:
        m.setattr(train, "LOSS_FN", lambda z, y: F.cross_entropy(z, y, reduction="sum", label_smoothing=0.1))
        msg = startup_error(train_argv(assets, done, "--steps", "4", "--resume", ckpt))
    assert "the loss (train.py's LOSS_FN) differs from the checkpoint's run at line 1: 'cross-entropy' there, " \
           "\"test_resume_refuses_changed_run_flags.<locals>.<lambda>: m.setattr(train, 'LOSS_FN', lambda z, y: " \
           "F.cross_entropy(z, y, reduction='sum', label_smoothing=0.1))\" here (the whole text: args.loss in the " \
           "checkpoint's meta.json" in msg, msg
    with monkeypatch.context() as m:   # the optimizer and the LR schedule: train.py's code, recorded too
        m.setattr(train, "make_optimizer", lambda params, args: torch.optim.AdamW(
            params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)))
        m.setattr(train, "lr_at", lambda step, args, total: args.lr)
        msg = startup_error(train_argv(assets, done, "--steps", "4", "--resume", ckpt))
    assert "the optimizer (train.py's make_optimizer): the checkpoint's run used {'class': 'AdamW', 'betas': [0.9, " \
           "0.999]" in msg and "this run {'class': 'AdamW', 'betas': [0.9, 0.95]" in msg, msg
    assert "the LR schedule (train.py's lr_at) differs from the checkpoint's run at line 1: 'lr_at: def lr_at(step, " \
           "args, total):' there" in msg, msg
    msg = startup_error(train_argv(assets, done, "--steps", "4", "--resume", ckpt, "--lora-r", "8"))
    assert "--lora-r" in msg and "4" in msg and "8" in msg, msg
    msg = startup_error(train_argv(assets, done, "--steps", "4", "--resume", ckpt, "--seed", "7"))
    assert "--seed" in msg and "7" in msg, msg
    msg = startup_error(train_argv(assets, done, "--steps", "3", "--resume", ckpt))
    assert "--steps 3" in msg and "4" in msg, msg
    msg = startup_error(train_argv(assets, done, "--resume", os.path.join(done, "nope")))
    assert "nope" in msg and "does not exist" in msg, msg
    argv = train_argv(assets, done, "--resume", ckpt)   # no --steps: one epoch (here 2 steps) would be another run
    i = argv.index("--steps")
    msg = startup_error(argv[:i] + argv[i + 2:])
    assert "the checkpoint's run has --steps 4 and this one neither --steps nor --epochs" in msg and \
        "pass --steps 4" in msg, msg
    assert tree_hash(done) == before


def test_resume_refuses_the_same_bytes_tokenized_otherwise(assets, tmp_path):
    """The same --data bytes under an edited chat template file in --model's folder: other tokens (a resume would
    take other samples for its steps), refused once the data are tokenized, before any weight is read; with the
    template restored the resume goes on. (Until 2026-12-02 only the file's sha256 was compared.)"""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    out = str(tmp_path / "out")
    base = [str(model) if x == assets["model"] else x for x in quick_argv(assets, out, "--data-cache", "none")]
    argv = lambda *extra: [*base, *extra]
    run(argv("--steps", "2"))
    (jinja,) = [p for p in (model / "chat_template.jinja",) if p.exists()] or [None]
    assert jinja is not None, sorted(os.listdir(model))
    kept = jinja.read_text()
    jinja.write_text("{{ 'Be brief.\\n' }}" + kept)   # every chat renders one line more
    before = tree_hash(out)
    msg = startup_error(argv("--steps", "3", "--resume", os.path.join(out, "ckpt")))   # (no weight read)
    assert "--resume: the checkpoint's run trained on other tokens (" in msg and " samples, " in msg, msg
    assert "though the file's bytes are the same: the tokenizer or chat template files in --model's folder" in msg, msg
    assert tree_hash(out) == before, "a refused resume wrote into the run"
    jinja.write_text(kept)
    run(argv("--steps", "3", "--resume", os.path.join(out, "ckpt")))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_resume_accepts_the_same_run_spelled_otherwise(assets, done, tmp_path, monkeypatch):
    """What a resume must not refuse: --dtype left to its default where that default is the checkpoint's (fp32 on
    CPU), and --model/--data given as other paths to the same files (relative from another directory, a symlink), or
    to copies of them elsewhere (the same bytes). The relative --model is recorded as an absolute path."""
    import train
    from parallel import preflight

    link = tmp_path / "model_link"
    link.symlink_to(assets["model"])
    monkeypatch.chdir(tmp_path)
    argv = train_argv(assets, done, "--steps", "4", "--resume", os.path.join(done, "ckpt"), "--model", "model_link",
                      "--data", os.path.relpath(assets["data"], tmp_path))
    i = argv.index("--dtype")
    args = train.build_parser().parse_args(argv[:i] + argv[i + 2:])
    with no_weights():
        _, ckpt = preflight.check_start(args, demo=False)
    assert ckpt.endswith("step_000004") and args.dtype == "fp32"
    assert args.model == str(link), "a relative --model is recorded absolute (what an export from elsewhere names)"
    # the model and the data copied to another disk: the same bytes, so the same run (until 2026-12-04 refused)
    shutil.copytree(assets["model"], tmp_path / "moved_model")
    shutil.copy(assets["data"], tmp_path / "moved.jsonl")
    argv = train_argv(assets, done, "--steps", "4", "--resume", os.path.join(done, "ckpt"), "--model", "moved_model",
                      "--data", "moved.jsonl")
    with no_weights():
        _, ckpt = preflight.check_start(train.build_parser().parse_args(argv), demo=False)
    assert ckpt.endswith("step_000004")
    with open(tmp_path / "moved.jsonl", "a") as f:   # other bytes at the new path: other data
        f.write(open(assets["data"]).readline())
    with no_weights(), pytest.raises(ValueError, match=r"--data: the checkpoint has .*, this run \['moved.jsonl'\]"):
        preflight.check_start(train.build_parser().parse_args(argv), demo=False)


def test_data_is_read_back_from_the_cache_and_a_resume_refuses_changed_bytes(assets, tmp_path, capsys):
    """A rerun reads the tokens back from --data-cache (the same losses); a resume whose --data file changed
    since the checkpoint (same path, other bytes) is refused, naming the fix, before anything is written."""
    data, out = tmp_path / "d.jsonl", str(tmp_path / "out")
    shutil.copy(assets["data"], data)
    argv = lambda out, *x: [*quick_argv(assets, out, "--steps", "2", *x, "--data", str(data)), "--data-cache",
                            str(tmp_path / "cache")]
    run(argv(out, "--save-every", "1"))
    assert "tokens from the cache" not in capsys.readouterr().out
    run(argv(str(tmp_path / "again")))
    assert "tokens from the cache" in capsys.readouterr().out
    assert [r["loss"] for r in metrics(tmp_path / "again")] == [r["loss"] for r in metrics(out)], "the same math"
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more record"}) + "\n")
    before = tree_hash(out)
    msg = startup_error(argv(out, "--resume", os.path.join(out, "ckpt", "step_000001")))
    assert "--data's bytes" in msg and "--init-adapter" in msg, msg
    assert tree_hash(out) == before


def test_no_steps_is_one_epoch_that_trains_every_sample(assets, tmp_path, capsys):
    """Without --steps a run trains ceil(samples / --global-batch) steps, so every sample is trained at least once:
    12 samples in steps of 8 make 2 steps, the second filled from the next epoch (until 2026-12-02: 1 step, and 4 of
    the 12 samples never seen). A resume counts the epoch as its run did, also one from before the change."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of twelve."}) + "\n" for i in range(12)))
    out = tmp_path / "out"
    argv = quick_argv(assets, str(out), "--data", str(data), "--save-every", "1")
    i = argv.index("--steps")
    argv = argv[:i] + argv[i + 2:]
    run(argv)
    assert [(r["step"], r["epoch"]) for r in metrics(out)] == [(1, 0.667), (2, 1.333)]
    assert "note: one epoch, 12 samples in 2 steps of 8: the last step also trains 4 of the next epoch's order " \
           "(--steps sets the length)" in capsys.readouterr().out
    losses = [r["loss"] for r in metrics(out)]
    first = out / "ckpt" / "step_000001"
    run(argv + ["--resume", str(first)])   # a resume counts the epoch as its run did
    assert [r["loss"] for r in metrics(out)] == losses
    meta = json.loads((first / "meta.json").read_text())
    del meta["steps_total"]   # a checkpoint from before: its run's epoch was 1 step (rounded down), and stays so
    (first / "meta.json").write_text(json.dumps(meta))
    run(argv + ["--resume", str(first)])
    assert [r["step"] for r in metrics(out)] == [1], "a resume of an old one-epoch run trained a step it never had"


def test_epochs_set_the_length_and_a_resume_keeps_them(assets, tmp_path, capsys):
    """--epochs E trains ceil(E × samples / --global-batch) steps of the same data order as --steps: 2 epochs of 12
    samples in steps of 8 are 3 steps, each sample twice; 2.5 are 4 steps (a note says the last takes 2 samples past
    them). A resume needs --steps or --epochs again (one epoch would be another schedule), refuses fewer epochs than
    its step, and trains on with more, saying that the LR schedule changed length."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of twelve."}) + "\n" for i in range(12)))

    def argv(out, *extra):   # train_argv without its --steps 3
        base = quick_argv(assets, str(out), "--data", str(data), *extra)
        i = base.index("--steps")
        return base[:i] + base[i + 2:]

    by_steps = tmp_path / "by_steps"
    run(argv(by_steps) + ["--steps", "3"])
    out = tmp_path / "out"
    run(argv(out, "--epochs", "2", "--save-every", "1"))
    assert [(r["step"], r["epoch"]) for r in metrics(out)] == [(1, 0.667), (2, 1.333), (3, 2.0)]
    losses = [r["loss"] for r in metrics(out)]
    assert losses == [r["loss"] for r in metrics(by_steps)], "--epochs 2 is the order --steps 3 trains"
    assert "the last step also trains" not in capsys.readouterr().out, "2 epochs fill 3 steps exactly"
    run(argv(out, "--epochs", "2", "--resume", str(out / "ckpt" / "step_000002")))
    assert [r["loss"] for r in metrics(out)] == losses
    with pytest.raises(ValueError, match=r"has --epochs 2 and this one neither --steps nor --epochs \(one epoch\): "
                                         r"pass --epochs 2 to continue it"):
        run(argv(out, "--resume", str(out / "ckpt")))
    with pytest.raises(ValueError, match=r"--epochs 0.5 is 1 steps of 8 over 12 samples, below the checkpoint's "
                                         r"step 3: nothing would train"):
        run(argv(out, "--epochs", "0.5", "--resume", str(out / "ckpt")))
    capsys.readouterr()
    run(argv(out, "--epochs", "2.5", "--resume", str(out / "ckpt")))
    said = capsys.readouterr().out
    assert "note: 2.5 epochs, 12 samples in 4 steps of 8: the last step also trains 2 more of the data order" in said
    assert "note: the checkpoint's run scheduled the LR over 3 steps, this one over 4 (--epochs)" in said
    assert [(r["step"], r["epoch"]) for r in metrics(out)] == [(1, 0.667), (2, 1.333), (3, 2.0), (4, 2.667)]
    from parallel.run_length import epoch_samples  # the decimal typed, not its float: 1.1 × 100 samples is 110
    assert [epoch_samples(e, n) for e, n in ((1.1, 100), (2.5, 12), (0.3, 10), (1e-6, 5))] == [110, 30, 3, 1]


def test_data_weight_shares_rotate_and_a_run_from_before_resumes_with_its_fixed_share(assets, tmp_path, monkeypatch,
                                                                                      capsys):
    """--data-weights 1 0.5: each epoch takes the next half of b's records (data/mix.py), so the second epoch trains
    the other half; a run from before 2026-12-04 (its checkpoint records no data_mix) took the same half every epoch,
    and its resume keeps that: it trains the steps after the checkpoint as that run did (here: a run made "fixed" as
    the old code was), not the rotation, which trains other samples from the epoch's end on."""
    import parallel.resume as resume

    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for f, word in zip(files, ("alpha", "beta")):
        f.write_text("".join(json.dumps({"text": f"{word} record {i} here."}) + "\n" for i in range(6)))
    argv = lambda out, *extra: quick_argv(assets, str(out), "--data", *map(str, files), "--data-weights", "1", "0.5",
                                          "--steps", "4", *extra)
    run(argv(tmp_path / "rotate"))
    said = capsys.readouterr().out
    assert "b.jsonl × 0.5: 3 samples of its 6 (3 of its 6 records, the next ones each epoch); 9 samples a pass (the " \
           "first; every record of the shares is trained at least once in 2 passes)" in said, said
    assert json.loads((tmp_path / "rotate" / "config.json").read_text())["data_mix"] == "rotate"
    real = resume.data_mix
    monkeypatch.setattr(resume, "data_mix", lambda w, before=False: real(w, before=True))   # the old code's share
    run(argv(tmp_path / "fixed", "--save-every", "1", "--keep-ckpts", "4"))
    monkeypatch.setattr(resume, "data_mix", real)
    fixed, rotate = ([r["loss"] for r in metrics(tmp_path / out)] for out in ("fixed", "rotate"))
    assert fixed[0] == rotate[0] and fixed[1:] != rotate[1:], "step 2 runs past the first pass of 9 samples"
    step2 = tmp_path / "fixed" / "ckpt" / "step_000002"
    meta = json.loads((step2 / "meta.json").read_text())
    assert meta["args"].pop("data_mix") == "fixed"   # as a checkpoint from before the record
    (step2 / "meta.json").write_text(json.dumps(meta))
    run(argv(tmp_path / "fixed", "--resume", str(step2), "--save-every", "1", "--keep-ckpts", "4"))
    assert [r["loss"] for r in metrics(tmp_path / "fixed")] == fixed
    assert json.loads((tmp_path / "fixed" / "config.json").read_text())["data_mix"] == "fixed"
    # and so does every resume after it, from the checkpoints that resume wrote (review: the second was refused)
    run(argv(tmp_path / "fixed", "--resume", str(tmp_path / "fixed" / "ckpt" / "step_000003")))
    assert [r["loss"] for r in metrics(tmp_path / "fixed")] == fixed


def test_early_stop_ends_the_run_where_the_eval_loss_stopped_improving_and_a_resume_counts_on(assets, tmp_path,
                                                                                               capsys, monkeypatch):
    """--early-stop 2 --early-stop-delta 100 --eval-every 1 (no evaluation falls 100 below the first): step 1 sets the
    best, steps 2 and 3 do not improve on it, so the run ends at step 3 of 4, saving and exporting that step: its
    losses and eval losses are the 4-step run's first 3 (the LR schedule is the whole run's), its adapter that run's
    step-3 checkpoint's, bit for bit. A resume with the same flags is refused (it would stop at its next evaluation),
    files untouched; with --early-stop 3 it trains on, counting from 2, as the uninterrupted run, whose last step's
    evaluation, the third, ends it unannounced (the run ends there anyway). Refused: no
    evaluation to count, N below 1, a negative delta."""
    from safetensors.torch import load_file

    from parallel.checkpoint_export import export

    ev = ["--eval-data", eval_head(assets), "--eval-every", "1", "--steps", "4"]
    full, out = tmp_path / "full", tmp_path / "early"
    run(quick_argv(assets, str(full), *ev, "--save-every", "1", "--keep-ckpts", "4"))
    capsys.readouterr()
    run(quick_argv(assets, str(out), *ev, "--early-stop", "2", "--early-stop-delta", "100"))
    said = capsys.readouterr().out
    first = metrics(full)[0]["eval_loss"]
    assert f"early stop: eval_loss has not gone below step 1's {first:.6f} by more than 100 in the 2 evaluations " \
           "since (--early-stop 2): the run ends at step 3 of 4" in said, said
    keys = ("step", "loss", "grad_norm", "lr", "eval_loss")
    assert [[r[k] for k in keys] for r in metrics(out)] == [[r[k] for k in keys] for r in metrics(full)[:3]]
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000003"]
    export(str(full / "ckpt" / "step_000003"), str(tmp_path / "three"))
    got, want = (load_file(str(d / "adapter_model.safetensors")) for d in (out / "adapter", tmp_path / "three"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), "not step 3's adapter"
    before = tree_hash(out)
    with pytest.raises(ValueError, match=r"--resume: at the checkpoint's step 3 it had counted 2 evaluations since "
                                         r"step 1's eval_loss .*, which --early-stop 2 stops at .* it would stop at "
                                         r"its next evaluation. To train on, pass --early-stop above 2, or drop it"):
        run(quick_argv(assets, str(out), *ev, "--early-stop", "2", "--early-stop-delta", "100", "--resume",
                       str(out / "ckpt")))
    assert tree_hash(out) == before
    run(quick_argv(assets, str(out), *ev, "--early-stop", "3", "--early-stop-delta", "100", "--resume",
                   str(out / "ckpt")))   # (step 4's evaluation, the last step's, is the third since step 1's: the
    assert "early stop: " not in capsys.readouterr().out   # run ends there anyway, and no early stop is announced)
    assert [[r[k] for k in keys] for r in metrics(out)] == [[r[k] for k in keys] for r in metrics(full)]
    # no evaluation finite (review: the message named step None's inf, and the count was not kept for a resume)
    import train
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: {"eval_loss": float("nan")})
    nan = tmp_path / "nan"
    run(quick_argv(assets, str(nan), *ev, "--early-stop", "2"))
    assert "early stop: no evaluation gave a finite eval_loss (2 of them) (--early-stop 2): the run ends at step 2 " \
           "of 4" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"it had counted 2 evaluations none of them with a finite eval_loss"):
        run(quick_argv(assets, str(nan), *ev, "--early-stop", "2", "--resume", str(nan / "ckpt")))
    monkeypatch.undo()
    for flags, says in ((["--early-stop", "2"], "--early-stop 2 ends the run after 2 evaluations in a row without "
                         "improvement, but it has no evaluation data: pass --eval-data FILE (or --eval-split); "
                         "--eval-every 0 evaluates only at the end: pass --eval-every N"),
                        (["--early-stop", "2", "--eval-data", assets["data"]], "without improvement, but --eval-every "
                         "0 evaluates only at the end: pass --eval-every N"),
                        ([*ev, "--early-stop", "0"], "--early-stop 0: N, the evaluations in a row without "
                         "improvement that end the run, must be 1 or more"),
                        ([*ev, "--early-stop", "1", "--early-stop-delta", "-1"], "--early-stop-delta must be 0 or "
                         "more"), ([*ev, "--early-stop-delta", "0.01"], "--early-stop-delta 0.01 acts only with "
                                   "--early-stop N")):
        with pytest.raises(ValueError, match=re.escape(says)):
            run(quick_argv(assets, str(tmp_path / "refused"), *flags))


def test_the_default_max_len_is_said_when_it_splits_records(assets, tmp_path, capsys):
    """--max-len omitted is 256 (a long-context run that forgot it trains 256-token windows): said in a note when it
    splits or cuts a record, naming the longest; a given --max-len that splits is the user's choice, not said. (Said
    once the data are tokenized, before any weight is read: the runs here end at the tripwire of the model build.)"""
    import train

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": ("word " * 400 if i < 2 else "short.") + f" {i}"}) + "\n"
                            for i in range(6)))

    def said(argv):
        with no_weights(), pytest.raises(AssertionError, match="a weight was about to be read"):
            train.main(argv)
        return capsys.readouterr().out

    argv = train_argv(assets, str(tmp_path / "a"), "--data", str(data), "--steps", "1")
    i = argv.index("--max-len")
    out = said(argv[:i] + argv[i + 2:])
    assert "note: --max-len was not given, so it is 256: 2 records were split or cut to it (the longest has " in out \
        and "tokens); pass --max-len N" in out, out
    out = said(train_argv(assets, str(tmp_path / "b"), "--data", str(data), "--steps", "1"))   # --max-len 64: given
    assert "data: " in out and "--max-len was not given" not in out, out


def nan_in_step_one():
    """A LOSS_FN (F.cross_entropy's sum) that is NaN in step 1's MB micro-batches (quick_argv, 1 rank): its calls
    under no_grad, train.py's start-up check of LOSS_FN (recorded.not_a_sum), are not a step's and not counted."""
    calls = {"n": 0}

    def loss_fn(z, y):
        loss = F.cross_entropy(z, y, ignore_index=-100, reduction="sum")
        if torch.is_grad_enabled():
            calls["n"] += 1
        return loss * math.nan if torch.is_grad_enabled() and calls["n"] <= MB else loss

    return loss_fn


def _crash_at(monkeypatch, call: int, nan_calls=()):
    """train.LOSS_FN that raises (a kill, as far as the disk is concerned) at its `call`-th call, NaN at `nan_calls`:
    1 rank runs MB micro-batches per step under quick_argv, so the calls of step k (counted from the run's first) are
    MB(k-1)+1..MBk."""
    import train

    n = {"calls": 0}

    def loss_fn(z, y):
        if not torch.is_grad_enabled():   # train.py's start-up check of LOSS_FN (recorded.not_a_sum): not a step's
            return F.cross_entropy(z, y, ignore_index=-100, reduction="sum")
        n["calls"] += 1
        if n["calls"] == call:
            raise RuntimeError("killed")
        loss = F.cross_entropy(z, y, ignore_index=-100, reduction="sum")
        return loss * math.nan if n["calls"] in nan_calls else loss

    loss_fn.recorded_as = "cross-entropy"   # the default's loss, instrumented: it may resume a default run's checkpoint
    monkeypatch.setattr(train, "LOSS_FN", loss_fn)


def test_a_crash_after_resuming_from_an_older_step_comes_back_to_it(assets, tmp_path, monkeypatch, capsys):
    """Resumed from step 2 of a run that saved steps 1..4, the run drops metrics 3..4 (they are trained again):
    the newer step folders become step_N.abandoned (kept, never resumed) and `latest` names step 2, so a crash before
    the next save resumes from step 2 again, not from step 4 past the metrics kept (which lost metrics 3..4 for good
    until 2026-12-02). The steps then rerun to the uninterrupted run's losses, and their saves remove the abandoned
    folders they supersede."""
    out = str(tmp_path / "out")
    flags = ("--steps", "4", "--save-every", "1", "--keep-ckpts", "4")
    run(quick_argv(assets, out, *flags))
    want = [r["loss"] for r in metrics(out)]
    ckpt = os.path.join(out, "ckpt")
    with monkeypatch.context() as m:
        _crash_at(m, 1)   # the resumed run's first step, step 3
        with pytest.raises(RuntimeError, match="killed"):
            run(quick_argv(assets, out, *flags, "--resume", os.path.join(ckpt, "step_000002")))
    said = capsys.readouterr().out
    assert "step_000003.abandoned, step_000004.abandoned" in said
    assert open(os.path.join(ckpt, "latest")).read() == "step_000002"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001", "step_000002", "step_000003.abandoned",
                                        "step_000004.abandoned"]
    assert [r["step"] for r in metrics(out)] == [1, 2]
    # metrics 3..4, dropped, are kept beside it as the abandoned checkpoints are (until 2026-12-07 gone), and said
    assert [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.abandoned.jsonl"))] == want[2:]
    assert "metrics.jsonl: 2 lines past step 2 (steps this run trains again) moved to metrics.abandoned.jsonl" \
        in said, said
    # the adapter exported at step 4 is not left as OUT/adapter, describing a step the run no longer has (until
    # 2026-12-03 it was, for model.merge to take); an abandoned step is never resumed, even named
    assert not os.path.exists(os.path.join(out, "adapter")) and os.path.isdir(os.path.join(out, "adapter.abandoned"))
    assert "the adapters exported past step_000002 are now adapter.abandoned" in said
    with pytest.raises(ValueError, match=r"step_000003.abandoned' is an abandoned step .* never resumed"):
        run(quick_argv(assets, out, *flags, "--resume", os.path.join(ckpt, "step_000003.abandoned")))
    run(quick_argv(assets, out, *flags, "--resume", ckpt))
    assert "resumed from " + os.path.join(ckpt, "step_000002") in capsys.readouterr().out
    assert [r["loss"] for r in metrics(out)] == want and [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001", "step_000002", "step_000003", "step_000004"], \
        "the abandoned folders outlived the saves that superseded them"


def test_non_finite_steps_in_a_row_count_across_a_resume(assets, tmp_path, monkeypatch):
    """--max-nonfinite 2 with NaN losses in steps 2 and 3 stops the run in step 3, also when the run crashed in step
    3 and resumed from step 2's checkpoint: the skipped count and the streak travel in meta.json (until 2026-12-02 the
    resume started a new streak and trained on)."""
    from parallel.guard import NonFiniteError

    flags = ("--steps", "5", "--save-every", "1", "--max-nonfinite", "2")
    with monkeypatch.context() as m:
        _crash_at(m, 0, nan_calls=range(MB + 1, 3 * MB + 1))   # steps 2 and 3
        with pytest.raises(NonFiniteError, match="2 non-finite steps in a row \\(step 2: .*; step 3: "):
            run(quick_argv(assets, str(tmp_path / "ref"), *flags))
    out = str(tmp_path / "out")
    with monkeypatch.context() as m:
        _crash_at(m, 2 * MB + 1, nan_calls=range(MB + 1, 2 * MB + 1))   # NaN in step 2, killed in step 3
        with pytest.raises(RuntimeError, match="killed"):
            run(quick_argv(assets, out, *flags))
    assert [(r["step"], r["skipped"]) for r in metrics(out)] == [(1, 0), (2, 1)]
    with monkeypatch.context() as m:
        _crash_at(m, 0, nan_calls=range(1, MB + 1))   # step 3 (the resumed run's first) is NaN again
        with pytest.raises(NonFiniteError, match="2 non-finite steps in a row \\(step 2: .*; step 3: "):
            run(quick_argv(assets, out, *flags, "--resume", os.path.join(out, "ckpt")))


def test_an_eval_longer_than_the_timeout_is_progress(assets, tmp_path, monkeypatch):
    """Each eval sample is a watchdog beat: an evaluation that takes longer than --timeout as a whole is not a stuck
    rank (until 2026-12-02 the watchdog saw one "eval" phase per evaluation and ended a healthy job, losing the step's
    save that comes after it). The final export is a phase of its own (it shared the last save's --timeout window), and
    so are rank 0's last writes before OUT's lock is let go (helper 91)."""
    from parallel import guard

    with open(tmp_path / "eval.jsonl", "w") as f:   # 5 short chats: 5 eval samples
        for i in range(5):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                             {"role": "assistant", "content": "fine"}]}) + "\n")
    beats, real = [], guard.Watchdog.phase
    monkeypatch.setattr(guard.Watchdog, "phase", lambda self, name, step=None: (beats.append((name, step)),
                                                                                 real(self, name, step))[1])
    run(quick_argv(assets, str(tmp_path / "out"), "--steps", "2", "--eval-every", "1", "--eval-data",
                   str(tmp_path / "eval.jsonl"), "--no-pack"))   # (one eval sample a row: packed, they share one)
    evals = [step for name, step in beats if name == "eval"]
    assert evals == [0] * 5 + [1] * 5 + [2] * 5, evals
    assert beats[-3:] == [("save", 2), ("export", 2), ("finish", 2)], "the final export and rank 0's last writes " \
        "(adapter_best, the lock let go) are timed as phases of their own"


def test_eval_samples_packed_in_rows_give_each_ones_loss(assets, tmp_path, monkeypatch):
    """With packing (the default) the eval samples go in rows of the plan's length (the longest training sample),
    consecutive samples of one file together: 16 short chats in a few forwards instead of 16, with the eval losses (over
    all, and each file's) of one sample a forward (--no-pack) to float rounding; training too (2026-12-07: 5.992409 vs
    5.99241 on an Intel AVX-512 machine, equal on the AMD ones before)."""
    from parallel import guard

    for name, n in (("a", 10), ("b", 6)):   # short chats, several to a row of the longest training sample's length
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": [{"role": "user", "content": f"{name} q {i}"},
                                                  {"role": "assistant", "content": f"fine {i % 7}"}]}) + "\n"
                         for i in range(n))
    beats, real = [], guard.Watchdog.phase
    monkeypatch.setattr(guard.Watchdog, "phase", lambda self, name, step=None: (beats.append((name, step)),
                                                                                 real(self, name, step))[1])
    ev = ["--steps", "2", "--eval-every", "1", "--eval-data", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
          "--max-len", "256"]   # (the training chats' longest: ~200 tokens; an eval chat: ~35)
    run(quick_argv(assets, str(tmp_path / "rows"), *ev))
    rows = sum(name == "eval" for name, _ in beats)
    beats.clear()
    run(quick_argv(assets, str(tmp_path / "one"), *ev, "--no-pack"))
    assert sum(name == "eval" for name, _ in beats) == 3 * 16 and 3 <= rows <= 3 * 16 // 3, rows   # (3 evaluations)
    got, want = metrics(tmp_path / "rows"), metrics(tmp_path / "one")
    for g, w in zip(got, want):   # (the training rows pack too: sums in another order, the same to float rounding)
        assert abs(g["loss"] - w["loss"]) <= 1e-6 * abs(w["loss"]) and sorted(g) == sorted(w), (g["loss"], w["loss"])
        for k in (k for k in w if k.startswith("eval_loss")):
            assert abs(g[k] - w[k]) <= 1e-6 * abs(w[k]), (k, g[k], w[k])
    assert {"eval_loss", "eval_loss/a.jsonl", "eval_loss/b.jsonl"} <= set(got[-1])


def test_loss_fn_is_the_loss_trained_and_evaluated(assets, tmp_path, capsys):
    """train.py's LOSS_FN reaches the step's loss and both evaluations (before training and at the end: what
    --keep-best chooses by). Reference: F.cross_entropy summed, doubled; every logged loss doubles with it."""
    import train

    def losses(name):
        out = str(tmp_path / name)
        capsys.readouterr()
        run(quick_argv(assets, out, "--steps", "1", "--eval-data", eval_head(assets)))
        said.append(capsys.readouterr().out)
        before = [float(line.split()[-1]) for line in said[-1].splitlines()
                  if line.startswith("eval_loss before training")]
        (rec,) = metrics(out)
        return before, rec["loss"], rec["eval_loss"]

    def twice(z, y):
        """Twice the summed cross-entropy."""
        return 2 * F.cross_entropy(z, y, ignore_index=-100, reduction="sum")

    said = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train, "LOSS_FN", twice)
        doubled = losses("doubled")
    # its first line of code, not its def line twice (until 2026-12-04: "loss: LOSS_FN twice: def twice(z, y):")
    assert "\nloss: LOSS_FN: return 2 * F.cross_entropy(z, y, ignore_index=-100, reduction='sum') ... (all: " \
           "config.json's loss)\n" in said[0], said[0]
    plain = losses("plain")
    assert len(plain[0]) == len(doubled[0]) == 1, (plain, doubled)
    assert doubled[0][0] == pytest.approx(2 * plain[0][0], rel=1e-5), ("eval before training", plain, doubled)
    assert doubled[1] == pytest.approx(2 * plain[1], rel=1e-5), ("step 1's loss", plain, doubled)
    assert doubled[2] > 1.5 * plain[2], ("the final eval (after another update, so not exactly 2x)", plain, doubled)
    with pytest.MonkeyPatch.context() as m:   # (--eval-positions reads the fused loss's per-token losses)
        m.setattr(train, "LOSS_FN", twice)
        msg = startup_error(train_argv(assets, str(tmp_path / "pos"), "--eval-split", "0.1", "--eval-positions", "8"))
    assert "train.py's LOSS_FN (a sum over each chunk) does not give: set LOSS_FN = None" in msg, msg
    assert not os.path.exists(tmp_path / "pos")


def test_resume_rewrites_metrics_once_per_step(assets, done, tmp_path, capsys):
    """A resume logs each step once, with the uninterrupted losses; one that trains on past the run's --steps says
    that the LR schedule changed length (the same flags: no note). (The run resumed is a copy of `done`'s folder:
    that run, with these flags, again.)"""
    out = str(tmp_path / "out")
    shutil.copytree(done, out)
    first = metrics(out)
    run(quick_argv(assets, out, "--steps", "4", "--resume", os.path.join(out, "ckpt", "step_000002")))
    again = metrics(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4], "each step logged once"
    assert [r["loss"] for r in again] == [r["loss"] for r in first], "resume never changes the math"
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["latest", "step_000002", "step_000004"]
    assert "note: the checkpoint's run scheduled" not in capsys.readouterr().out
    run(quick_argv(assets, out, "--steps", "5", "--resume", os.path.join(out, "ckpt")))
    assert "note: the checkpoint's run scheduled the LR over 4 steps, this one over 5 (--steps): the steps after 4 " \
        "follow the schedule over the new length" in capsys.readouterr().out
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]


def test_tensorboard_draws_each_step_once_as_metrics_jsonl_holds_it_across_resumes(assets, tmp_path, monkeypatch,
                                                                                     capsys):
    """--report-to tensorboard: TensorBoard (its own reader) draws what metrics.jsonl holds, each step once, after a
    run; after a resume from its older step that ends there (metrics.jsonl drops the later steps, TensorBoard must
    hide them: without purge_step it drew the dead steps on); after a resume that trains them again (the
    uninterrupted losses). Without the package the flag is refused before any weight is read, nothing written."""
    from parallel import metrics as sinks
    from tests.helpers import as_scalars, tensorboard_scalars

    out, tb = str(tmp_path / "out"), ["--report-to", "tensorboard", "--eval-every", "2", "--save-every", "2",
                                      "--eval-data", eval_head(assets)]
    run(quick_argv(assets, out, "--steps", "4", *tb))
    assert f"metrics in {out}/metrics.jsonl and {out}/tensorboard (tensorboard --logdir {out}/tensorboard)" in \
        capsys.readouterr().out
    first = metrics(out)
    drawn = tensorboard_scalars(out)
    assert drawn == as_scalars(first) and [s for s, _ in drawn["eval_loss"]] == [2, 4], drawn
    run(quick_argv(assets, out, "--steps", "2", *tb, "--resume", os.path.join(out, "ckpt", "step_000002")))
    assert "nothing to train" in capsys.readouterr().out and [r["step"] for r in metrics(out)] == [1, 2]
    assert tensorboard_scalars(out) == as_scalars(first[:2]), "TensorBoard draws steps metrics.jsonl dropped"
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1, "the older events files are removed"
    run(quick_argv(assets, out, "--steps", "4", *tb, "--resume", os.path.join(out, "ckpt")))
    again = metrics(out)
    assert tensorboard_scalars(out) == as_scalars(again) and [r["step"] for r in again] == [1, 2, 3, 4]
    math_of = lambda rs: [(r["loss"], r["grad_norm"], r["lr"], r.get("eval_loss")) for r in rs]   # noqa: E731
    assert math_of(again) == math_of(first), "resume never changes the math"
    # resumed from step 2 without the flag: the folder is rewritten all the same (a later resume with the flag would
    # find steps 3 and 4 of a run metrics.jsonl no longer holds)
    run(quick_argv(assets, out, "--steps", "2", *tb[2:], "--resume", os.path.join(out, "ckpt", "step_000002")))
    assert [r["step"] for r in metrics(out)] == [1, 2] and tensorboard_scalars(out) == as_scalars(first[:2])
    # a fresh run never adds to another run's events (claim refuses the folder first; this is the sink's own guard)
    before = tree_hash(out)
    with pytest.raises(ValueError, match="already holds TensorBoard events; a fresh run never adds to another's"):
        sinks.TensorBoard(out)
    assert tree_hash(out) == before
    # the package missing: refused at start-up, naming the fix
    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    bare = str(tmp_path / "bare")
    said = startup_error(quick_argv(assets, bare, "--report-to", "tensorboard"))
    assert said == "--report-to tensorboard needs the tensorboard package, which this python lacks: pip install " \
        "tensorboard (make install installs it), or drop --report-to tensorboard", said
    assert not os.path.exists(bare)


def test_wandb_rows_are_metrics_jsonl_across_a_resume(assets, tmp_path, monkeypatch, capsys):
    """--report-to wandb (offline; read back from wandb's own record log): its run's rows are metrics.jsonl's numbers
    at their steps, config OUT's; a resume from step 2 of 4 logs steps 3 and 4 to a new run in the group (W&B ignores
    a row at a step it holds), after metrics.jsonl's steps 1 and 2: its rows = metrics.jsonl (review, helper 88).
    Online with no API key: refused at start-up, before any weight is read, nothing written."""
    from tests.helpers import wandb_runs
    from tests.test_runs import _wandb_env

    _wandb_env(monkeypatch, tmp_path)
    out, wb = str(tmp_path / "out"), ["--report-to", "wandb", "--eval-every", "2", "--save-every", "2",
                                      "--eval-data", eval_head(assets)]
    rows = lambda rs: [(r["step"], {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float))  # noqa
                                    and not isinstance(v, bool)}) for r in rs]
    run(quick_argv(assets, out, "--steps", "4", *wb))
    (first, held), = wandb_runs(out).items()
    assert held["name"] == "out" and held["rows"] == rows(metrics(out)) and "eval_loss" in held["rows"][1][1], held
    run(quick_argv(assets, out, "--steps", "4", *wb, "--resume", os.path.join(out, "ckpt", "step_000002")))
    assert "go to a new W&B run, out@2, in group out, after metrics.jsonl's steps up to 2" in capsys.readouterr().out
    (second, held), = [(k, v) for k, v in wandb_runs(out).items() if k != first]
    assert held["rows"] == rows(metrics(out)) and [k for k, _ in held["rows"]] == [1, 2, 3, 4], held
    assert held["config"] == {k: v for k, v in json.load(open(os.path.join(out, "config.json"))).items()
                              if not k.startswith("_")}, "the run's config is not config.json's"
    _wandb_env(monkeypatch, tmp_path, mode=None)
    bare = str(tmp_path / "bare")
    assert startup_error(quick_argv(assets, bare, "--report-to", "wandb")).startswith(
        "--report-to wandb: no W&B API key for api.wandb.ai here")
    assert not os.path.exists(bare)


def test_tensorboard_resume_killed_before_removing_the_older_files_keeps_each_step_once(tmp_path, monkeypatch):
    """A resume killed between its new events file and the older files' removal: the next resume's rewrite draws each
    step once (the killed one's copies beside the originals are not both kept), as TensorBoard's reader then shows."""
    from parallel import metrics as sinks
    from tests.helpers import tensorboard_scalars

    out = str(tmp_path)
    tb = sinks.TensorBoard(out)
    for s in range(1, 11):
        tb.write({"step": s, "loss": float(s)})
    tb.close()

    def killed(path):
        raise KeyboardInterrupt("killed")
    with monkeypatch.context() as m:
        m.setattr(sinks.os, "remove", killed)
        with pytest.raises(KeyboardInterrupt):
            sinks.TensorBoard(out, resume_step=5)
    tb = sinks.TensorBoard(out, resume_step=5)
    for s in range(6, 9):
        tb.write({"step": s, "loss": 100.0 + s})
    tb.close()
    assert tensorboard_scalars(out) == {"loss": [(s, float(s)) for s in range(1, 6)] +
                                        [(s, 100.0 + s) for s in range(6, 9)]}


def test_tensorboard_resume_refuses_to_drop_events_other_than_scalars(tmp_path):
    """A fork's histogram or text beside the scalars: a resume's rewrite (scalars only) is refused, nothing touched."""
    from parallel import metrics as sinks

    out = str(tmp_path)
    tb = sinks.TensorBoard(out)
    for s in range(1, 4):
        tb.write({"step": s, "loss": float(s)})
        tb.writer.add_histogram("lora_B", torch.arange(4.0), s)
        tb.writer.add_text("sample", "text", s)
    tb.close()
    before = tree_hash(out)
    with pytest.raises(ValueError, match=r"holds TensorBoard data other than scalars \(histograms: lora_B; "
                                         r"distributions: lora_B; tensors: sample/text_summary\)"):
        sinks.TensorBoard(out, resume_step=2)
    assert tree_hash(out) == before


def test_train_on_prompt_trains_every_token_and_a_resume_keeps_it(assets, tmp_path, capsys):
    """--train-on-prompt: every token of each sample after its first is a target (the data: line's count), the flag
    recorded; a resume without it is refused, naming it (the other targets would be another run)."""
    out = str(tmp_path / "all")
    run(quick_argv(assets, out, "--train-on-prompt", "--steps", "2", "--save-every", "1"))
    said = capsys.readouterr().out
    m = re.search(r"data: (\d+) samples from \d+ records, (\d+) tokens \((\d+) targets\)", said)
    assert m and int(m.group(3)) == int(m.group(2)) - int(m.group(1)), said
    assert json.load(open(os.path.join(out, "config.json")))["train_on_prompt"] is True
    msg = startup_error(train_argv(assets, out, "--steps", "3", "--resume", os.path.join(out, "ckpt")))
    assert "--train-on-prompt: the checkpoint has True, this run False" in msg, msg


LR_AT_BEFORE = '''import math


def lr_at(step, args, total):
    """Linear warmup, then cosine decay to 10% of --lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
'''


def test_lr_schedule_is_the_lr_trained_and_a_run_from_before_it_resumes(assets, tmp_path, monkeypatch, capsys):
    """--lr-schedule wsd: metrics.jsonl's lr column is transformers' get_wsd_schedule; a resume with another schedule
    is refused naming it. A checkpoint of train.py's lr_at from before --lr-schedule (its text recorded, no schedule
    flags) resumes with today's default, cosine to 0.1, to the uninterrupted run's losses and adapter bit for bit;
    with another --min-lr-ratio it is refused."""
    import transformers.optimization as hf
    from safetensors.torch import load_file

    import train
    from parallel import recorded, resume

    out = str(tmp_path / "wsd")
    run(quick_argv(assets, out, "--lr-schedule", "wsd", "--wsd-decay", "0.5", "--warmup", "0", "--steps", "4",
                   "--save-every", "2"))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)   # (train_argv's --lr)
    sched, theirs = hf.get_wsd_schedule(opt, 0, 2, 4, min_lr_ratio=0.1), []   # (--min-lr-ratio's default)
    for _ in range(4):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [r["lr"] for r in metrics(out)] == pytest.approx(theirs, rel=1e-12) and theirs[-1] < theirs[0], theirs
    said = startup_error(quick_argv(assets, out, "--warmup", "0", "--steps", "4", "--resume",
                                    os.path.join(out, "ckpt")))
    assert "--lr-schedule: the checkpoint has 'wsd', this run 'cosine'" in said, said
    flat = str(tmp_path / "flat")   # --wsd-decay's share of a short run is no step: it never decays, and says so
    run(quick_argv(assets, flat, "--lr-schedule", "wsd", "--warmup", "0", "--steps", "2"))
    assert "note: --wsd-decay 0.1 of 2 steps is no step: the LR stays at --lr to the end" in capsys.readouterr().out
    assert [r["lr"] for r in metrics(flat)] == [1e-3, 1e-3]
    # a run from before the flags: its lr_at's text, no lr_schedule / min_lr_ratio / wsd_decay in its checkpoint
    (tmp_path / "lr_before.py").write_text(LR_AT_BEFORE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import lr_before
    assert recorded.describe_code(lr_before.lr_at) == resume.LR_AT_BEFORE
    ref, then = str(tmp_path / "ref"), str(tmp_path / "then")
    run(quick_argv(assets, ref, "--steps", "3", "--save-every", "2"))
    with monkeypatch.context() as m:
        m.setattr(train, "lr_at", lr_before.lr_at)
        run(quick_argv(assets, then, "--steps", "2", "--save-every", "2"))
    meta = os.path.join(then, "ckpt", "step_000002", "meta.json")
    with open(meta) as f:
        kept = json.load(f)
    for k in ("lr_schedule", "min_lr_ratio", "wsd_decay"):
        del kept["args"][k]
    with open(meta, "w") as f:
        json.dump(kept, f)
    said = startup_error(quick_argv(assets, then, "--steps", "3", "--min-lr-ratio", "0.2", "--resume",
                                    os.path.join(then, "ckpt")))
    assert "--min-lr-ratio: the checkpoint has 0.1, this run 0.2" in said and "lr_at" not in said, said
    run(quick_argv(assets, then, "--steps", "3", "--resume", os.path.join(then, "ckpt")))
    same = lambda d: [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(d)]   # noqa: E731
    assert same(then) == same(ref)
    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (then, ref))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_full_disk_under_tensorboard_is_the_one_error_said(assets, tmp_path, monkeypatch, capsys):
    """The disk fills while TensorBoard writes step 2: the one error line names that write and the way on (its
    buffered writer failed again in close(), from train.py's finally, and that second error was said in its place,
    advising a command check_out refuses; review, helper 61)."""
    from tensorboard.summary.writer import record_writer

    import train
    from parallel import metrics as sinks

    full = [False]

    def refuse(real):
        def f(self, *a):
            if full[0]:
                raise OSError(28, "No space left on device")
            return real(self, *a)
        return f

    monkeypatch.setattr(record_writer.RecordWriter, "write", refuse(record_writer.RecordWriter.write))
    monkeypatch.setattr(record_writer.RecordWriter, "flush", refuse(record_writer.RecordWriter.flush))
    tb_write = sinks.TensorBoard.write
    monkeypatch.setattr(sinks.TensorBoard, "write", lambda self, rec: (full.__setitem__(0, rec["step"] == 2),
                                                                       tb_write(self, rec))[1])
    out = str(tmp_path / "out")
    capsys.readouterr()
    died = []   # TensorBoard's writer thread meets the full disk too: its exception, kept here (pytest's hook said it
    monkeypatch.setattr(threading, "excepthook", died.append)   # as a warning, in whichever test ran next)
    with one_thread():
        code = train.cli(quick_argv(assets, out, "--report-to", "tensorboard", "--save-every", "1"))
    for t in threading.enumerate():   # (a daemon: done once the writer was closed, or soon after)
        if type(t).__name__ == "_AsyncWriterThread":
            t.join(10)
    assert all("No space left on device" in str(a.exc_value) for a in died), died
    said = capsys.readouterr().err
    assert code == 2 and said.startswith("error: writing metrics.jsonl, tensorboard (step 2) failed") and \
        f"--resume {out}/ckpt" in said, said


def _nonfinite_on_rank_1(rank, world_size, skip_argv, stop_argv, demo_out):
    """train.main(skip_argv) with rank 1's first training micro-batch's loss NaN (the other rank's finite), then
    train.main(stop_argv) with rank 1's every training loss inf: what the second raised on this rank; then (one spawn
    for both) what a demo run whose asset build fails on rank 0 raised here."""
    import train
    from parallel.guard import NonFiniteError

    calls = {"n": 0}

    def nan_once(z, y):   # (no_grad calls: train.py's start-up check of LOSS_FN, not a step's)
        loss = F.cross_entropy(z, y, ignore_index=-100, reduction="sum")
        calls["n"] += torch.is_grad_enabled()
        return loss * math.nan if rank == 1 and torch.is_grad_enabled() and calls["n"] == 1 else loss

    def inf_always(z, y):
        loss = F.cross_entropy(z, y, ignore_index=-100, reduction="sum")
        return loss * math.inf if rank == 1 and torch.is_grad_enabled() else loss

    real = train.LOSS_FN
    try:
        train.LOSS_FN = nan_once
        train.main(skip_argv)
        train.LOSS_FN = inf_always
        try:
            train.main(stop_argv)
        except NonFiniteError as e:
            return str(e), _demo_build_fails_on_rank_0(rank, demo_out)
        return "train.main returned", None
    finally:
        train.LOSS_FN = real


def _demo_build_fails_on_rank_0(rank, out):
    """train.main in demo mode (no --model, --data) whose asset build, rank 0's alone, fails: what this rank raised."""
    import train

    def broken(argv):
        raise OSError(28, "No space left on device", argv[0])

    real, train.build_demo = train.build_demo, broken
    try:
        train.main(["--out", out, "--steps", "1"])
    except Exception as e:   # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e}"
    finally:
        train.build_demo = real
    return "train.main returned"


def test_nonfinite_steps_are_skipped_then_stop_the_run(assets, tmp_path, monkeypatch):
    """1 rank: a NaN step is skipped, counted and logged as null; --max-nonfinite 2 in a row stop the run, nothing
    written. On 2 gloo ranks (cp 2 ring) a NaN in one micro-batch of rank 1 alone skips step 1 on both (the loss is
    all-reduced, the grad norm global: one choice), and the run trains on as the 1-rank one whose step 1 was all NaN
    (steps 2 and 3, the adapter: test_train's tolerances); inf on rank 1 alone stops both ranks in step 2 with the
    same error (no rank left in a collective)."""
    import train
    from parallel.guard import NonFiniteError
    from tests.dist import run_ranks
    from tests.test_train import ADAPTER_RTOL, LOSS_ATOL, NORM_RTOL, _adapter

    out = str(tmp_path / "skip")
    monkeypatch.setattr(train, "LOSS_FN", nan_in_step_one())
    run(quick_argv(assets, out, "--steps", "3"))
    recs = metrics(out)
    assert recs[0]["loss"] is None and recs[0]["nonfinite"]["loss"] == "nan" and recs[0]["skipped"] == 1, recs[0]
    assert all(math.isfinite(r["loss"]) for r in recs[1:]) and recs[-1]["skipped"] == 1
    from safetensors.torch import load_file
    adapter = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in adapter.values())

    stop = str(tmp_path / "stop")
    monkeypatch.setattr(train, "LOSS_FN", lambda z, y: z.sum() * math.inf)
    with pytest.raises(NonFiniteError, match="--max-nonfinite"):
        run(quick_argv(assets, stop, "--steps", "5", "--max-nonfinite", "2"))
    assert [r["step"] for r in metrics(stop)] == [1], "step 2 raises before it is logged"
    assert not os.path.exists(os.path.join(stop, "adapter")) and not os.path.exists(os.path.join(stop, "ckpt"))

    # 2 ranks, the NaN (then the inf) on rank 1 only; cp 2 and --micro-batch 2: 4 micro-batches a step, as 1 rank's
    two, stop2 = str(tmp_path / "skip_cp2"), str(tmp_path / "stop_cp2")
    cp2 = ("--cp", "2", "--cp-impl", "ring")
    said = run_ranks(_nonfinite_on_rank_1, 2, quick_argv(assets, two, "--steps", "3", *cp2),
                     quick_argv(assets, stop2, "--steps", "5", "--max-nonfinite", "2", *cp2),
                     str(tmp_path / "demo"), timeout=240, pg_timeout=60)
    said, demo_said = [s[0] for s in said], [s[1] for s in said]
    # the demo's asset build (rank 0's alone) failing: rank 0 raises it, rank 1 says it failed there (until 2026-12-07
    # rank 1 waited in a barrier rank 0 never reached: gloo's connection error here, NCCL's wait until --timeout)
    assert demo_said[0] == "OSError: [Errno 28] No space left on device: '" + os.path.dirname(train.DEMO["model"]) + \
        "'", demo_said
    assert demo_said[1].startswith("RuntimeError: building the demo's assets failed on rank 0 (OSError: [Errno 28]"), \
        demo_said
    got = metrics(two)
    assert [r["step"] for r in got] == [1, 2, 3], got
    assert got[0]["loss"] is None and got[0]["nonfinite"] == recs[0]["nonfinite"] and got[0]["skipped"] == 1, got[0]
    for g, w in zip(got[1:], recs[1:]):
        assert g["tokens"] == w["tokens"] and g["skipped"] == w["skipped"] == 1, (g, w)
        assert abs(g["loss"] - w["loss"]) <= LOSS_ATOL and abs(g["grad_norm"] - w["grad_norm"]) <= \
            NORM_RTOL * w["grad_norm"], (g, w)
    mine = _adapter(two)
    assert sorted(mine) == sorted(adapter) and all(
        ((mine[k] - adapter[k]).norm() / adapter[k].norm()).item() <= ADAPTER_RTOL for k in adapter), "adapter"
    assert said[0] == said[1] and "2 non-finite steps in a row (step 1: " in said[0], said
    assert [r["step"] for r in metrics(stop2)] == [1], "step 2 raises before it is logged"
    assert not os.path.exists(os.path.join(stop2, "adapter")) and not os.path.exists(os.path.join(stop2, "ckpt"))


FLAG_ERRORS = {   # label -> (flags, phrases the message must hold)
    "steps 0": (["--steps", "0"], ["--steps must be >= 1, got 0", "omit --steps"]),
    "steps negative": (["--steps", "-3"], ["--steps must be >= 1, got -3"]),
    "epochs 0": (["--epochs", "0"], ["--epochs must be above 0 and at most 1e6, got 0"]),
    "epochs nan": (["--epochs", "nan"], ["--epochs must be above 0 and at most 1e6, got nan"]),
    "epochs with steps": (["--epochs", "2"], ["--steps 3 and --epochs 2 both set the run's length: pass one"]),
    "lora-alpha 0": (["--lora-alpha", "0"], ["--lora-alpha must be > 0", "trains nothing"]),
    "lr nan": (["--lr", "nan"], ["--lr must be a finite number, got nan"]),
    "lr inf": (["--lr", "inf"], ["--lr must be a finite number, got inf"]),
    "clip nan": (["--clip", "nan"], ["--clip must be a finite number"]),
    "keep-ckpts 0": (["--keep-ckpts", "0"], ["--keep-ckpts must be >= 1"]),
    "timeout 0": (["--timeout", "0"], ["--timeout must be >= 1 minute"]),
    # (until 2026-12-04: the watchdog ended the job in its first step, a stack dump and exit 3)
    "timeout tiny": (["--timeout", "0.0001"], ["--timeout must be >= 1 minute", "got 0.0001"]),
    # (these five until 2026-12-04: refused after the data were tokenized, or accepted and ignored or run)
    "offload without ac": (["--offload-activations", "--no-ac"], ["--offload-activations moves the checkpoints",
                                                                  "drop --no-ac"]),
    "ac-group beyond the layers": (["--ac-group", "9"], ["--ac-group 9 is more than the model's 2 blocks",
                                                         "use at most --ac-group 2"]),
    "eval-every without eval-data": (["--eval-every", "2"], ["--eval-every 2 evaluates on --eval-data, which is "
                                                             "not given"]),
    "max-len 1": (["--max-len", "1"], ["--max-len must be >= 2 (one input and one target), got 1"]),
    "eval-positions without eval-data": (["--eval-positions", "8"], ["--eval-positions 8 splits the eval loss, but "
                                         "there is no eval set: pass --eval-data FILE (or --eval-split)"]),
    "eval-positions not rising": (["--eval-split", "0.1", "--eval-positions", "16", "16"], ["--eval-positions 16 16: "
                                  "the positions where the eval loss's buckets after 0 start, rising"]),
    "eval-positions past max-len": (["--eval-split", "0.1", "--eval-positions", "8", "64"],
                                    ["--eval-positions 8 64", "each from 1 to 63 (--max-len 64)"]),
    "eval-positions with dpo": (["--objective", "dpo", "--eval-positions", "8"],   # (said before the eval set)
                                ["--objective dpo's eval (a loss per pair) does not have", "drop --eval-positions"]),
    "lora-r beyond a projection's rank": (["--lora-r", "17"], ["--lora-r 17 is more than the rank of k_proj (48 -> "
                                                               "16), v_proj (48 -> 16)", "use --lora-r 16 or less"]),
    "save-minutes negative": (["--save-minutes", "-1"], ["--save-minutes must be >= 0, got -1"]),
    "micro-batch auto without packing": (["--micro-batch", "auto", "--no-pack"], ["--micro-batch auto packs the "
                                         "samples that fit the longest one's length into one row: drop --no-pack"]),
    "save-minutes nan": (["--save-minutes", "nan"], ["--save-minutes must be a finite number, got nan"]),
    "ac-group 0": (["--ac-group", "0"], ["--ac-group must be >= 1", "got 0"]),
    "ac-group with offload": (["--ac-group", "2", "--offload-activations"],
                              ["--ac-group 2 with --offload-activations", "use one or the other"]),
    "ac-group without ac": (["--ac-group", "2", "--no-ac"], ["--ac-group 2 groups the checkpoints of --ac",
                                                             "--ac-group 1"]),
    "ac-blocks negative": (["--ac-blocks", "-1"], ["--ac-blocks must be >= 0", "got -1"]),
    "ac-blocks without ac": (["--ac-blocks", "1", "--no-ac"], ["--ac-blocks 1 picks the blocks", "drop --no-ac"]),
    "ac-blocks with ac-group": (["--ac-blocks", "1", "--ac-group", "2"], ["use one or the other"]),
    "ac-blocks beyond the layers": (["--ac-blocks", "9"], ["--ac-blocks 9 is more than the model's 2 blocks"]),
    "ac-blocks 0 with offload": (["--ac-blocks", "0", "--offload-activations"],
                                 ["no block is checkpointed", "drop --offload-activations"]),
    "lora-plus-ratio 0": (["--lora-plus-ratio", "0"], ["--lora-plus-ratio must be a finite number above 0 (B's LR "
                                                       "over A's; 16 in the LoRA+ paper), got 0"]),
    "lora-plus-ratio inf": (["--lora-plus-ratio", "inf"], ["--lora-plus-ratio must be a finite number", "got inf"]),
    "train-on-prompt with dpo": (["--objective", "dpo", "--train-on-prompt"], ["--train-on-prompt makes a prompt's "
                                 "tokens targets, and a preference loss compares the answers"]),
    "min-lr-ratio with constant": (["--lr-schedule", "constant", "--min-lr-ratio", "0.1"],
                                   ["--min-lr-ratio 0.1: --lr-schedule constant has no decay to end at; drop it"]),
    "min-lr-ratio above 1": (["--min-lr-ratio", "2"], ["--min-lr-ratio 2: the LR the decay ends at, as a share of "
                                                       "--lr, in [0, 1]"]),
    "min-lr-ratio nan": (["--min-lr-ratio", "nan"], ["--min-lr-ratio nan: the LR the decay ends at"]),
    "wsd-decay without wsd": (["--wsd-decay", "0.2"], ["--wsd-decay 0.2: acts only with --lr-schedule wsd (this "
                                                       "run's is cosine): pass that too, or drop it"]),
    "wsd-decay above 1": (["--lr-schedule", "wsd", "--wsd-decay", "1.5"], ["--wsd-decay 1.5: the share of the "
                                                                          "steps --lr-schedule wsd decays over"]),
}


@pytest.mark.parametrize("label", FLAG_ERRORS)
def test_bad_flags_refused_before_anything(assets, tmp_path, label):
    flags, phrases = FLAG_ERRORS[label]
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, *flags))
    assert all(p in msg for p in phrases), f"{label}: {msg!r}"
    assert not os.path.exists(out)


def test_a_global_batch_above_the_data_trains_and_says_so(assets, tmp_path, capsys):
    """--global-batch 50 over 40 samples (a quick run on a few records): it trains, each step taking samples more
    than once, and a note says so (until 2026-12-04 silent; one huge hung: test_train's start-up errors)."""
    out = str(tmp_path / "out")
    run(train_argv(assets, out, "--steps", "1", "--global-batch", "50", "--micro-batch", "10"))
    assert "note: --global-batch 50 is more samples than --data holds (40): each step takes each sample about 1.25 " \
           "times" in capsys.readouterr().out
    assert metrics(out)[0]["epoch"] == 1.25, metrics(out)


def test_a_forks_optimizer_refusing_the_flags_stops_before_anything(assets, tmp_path, monkeypatch):
    """make_optimizer runs once at start-up (its settings are recorded): a value it refuses that the flag checks let
    through stops the run there, in a sentence, not after the model is built."""
    import train

    def picky(params, args):
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 1.5))
    monkeypatch.setattr(train, "make_optimizer", picky)
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out))
    assert msg == "make_optimizer refuses this run's flags: Invalid beta parameter at index 1: 1.5", msg
    assert not os.path.exists(out)


def test_bad_data_refused_before_weights(assets, tmp_path):
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", str(tmp_path)))
    assert "--data" in msg and "is a directory" in msg, msg
    no_target = tmp_path / "eval.jsonl"
    long_prompt = [{"role": "system", "content": "hello " * 100}, {"role": "user", "content": "hello there " * 200},
                   {"role": "assistant", "content": "hi"}]   # the system turn alone is past --max-len 64: no target
    no_target.write_text(json.dumps({"messages": long_prompt}) + "\n")
    msg = startup_error(train_argv(assets, out, "--eval-data", str(no_target)))
    assert "--eval-data" in msg and "no sample has a target" in msg, msg
    assert not os.path.exists(out)


def test_token_ids_beyond_the_vocabulary(assets, tmp_path):
    import shutil

    from tests.helpers import tiny_checkpoint

    n_tok = json.load(open(os.path.join(assets["model"], "config.json")))["vocab_size"]
    small = tiny_checkpoint(tmp_path / "small", vocab=n_tok - 8)   # 8 embedding rows short of the tokenizer
    for f in os.listdir(assets["model"]):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(assets["model"], f), small)
    msg = startup_error(train_argv({**assets, "model": small}, str(tmp_path / "out")))
    assert f"vocab_size is {n_tok - 8}" in msg and f"tokenizer has {n_tok}" in msg and "bigger" in msg, msg


def test_cli_prints_a_startup_error_once_per_job(assets, tmp_path, monkeypatch, capsys):
    """Two processes of one job (RANK 0 and 1) that raise the same start-up error: exit 2 each, said by rank 0 only.
    An error only rank 1 hit is said by rank 1 (train.cli in this process as rank 1: saying it needs no marker from
    another process)."""
    import train

    argv = [sys.executable, os.path.join(ROOT, "train.py"), *train_argv(assets, str(tmp_path / "o"), "--lr", "0")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r0 = subprocess.run(argv, capture_output=True, text=True, env={**env, "RANK": "0"}, cwd=ROOT)
    r1 = subprocess.run(argv, capture_output=True, text=True, env={**env, "RANK": "1"}, cwd=ROOT)
    assert r0.returncode == r1.returncode == 2, (r0.stderr, r1.stderr)
    assert "error: --lr must be > 0" in r0.stderr and "error" not in r1.stderr, (r0.stderr, r1.stderr)
    # an error only rank 1 hit (a data file its node lacks): said by rank 1, not lost
    for k in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    code = train.cli(train_argv(assets, str(tmp_path / "o"), "--data", str(tmp_path / "not_on_this_node.jsonl")))
    own = capsys.readouterr().err
    assert code == 2 and own.startswith("error (rank 1): --data ") and "not_on_this_node.jsonl does not exist" in own, \
        own


def test_no_weights_tripwire_sees_the_model(assets, tmp_path):
    # Positive control for every 'before weights' claim above: a valid run trips the wire.
    import train

    with no_weights(), pytest.raises(AssertionError, match="weight was about to be read"):
        train.main(train_argv(assets, str(tmp_path / "out"), "--steps", "1"))


def _sigterm_at(monkeypatch, n):
    """SIGTERM in the n-th micro-batch (MB per step under quick_argv; entered after each stop check); count the
    saves."""
    from parallel import checkpoint, phases

    measuring, save, seen = phases.measuring, checkpoint.save, {"calls": 0, "saves": []}

    def signal_there(*a, **k):
        seen["calls"] += 1
        if seen["calls"] == n:
            signal.raise_signal(signal.SIGTERM)
        return measuring(*a, **k)

    def counted(ckpt_dir, model, opt, step, *a, **k):
        seen["saves"].append(step)
        return save(ckpt_dir, model, opt, step, *a, **k)

    monkeypatch.setattr(phases, "measuring", signal_there)
    monkeypatch.setattr(checkpoint, "save", counted)
    return seen


def test_a_signal_stops_with_the_finished_steps_saved_and_resume_replays_dropout(assets, dropout_ref, tmp_path,
                                                                                  monkeypatch):
    """(quick_argv: MB = 4 micro-batches a step; the uninterrupted run is the module's dropout_ref.)"""
    from parallel import signals

    flags, ref = DROPOUT, dropout_ref
    again, out = (str(tmp_path / n) for n in ("again", "out"))
    run(quick_argv(assets, again, *flags))
    same = lambda d: [(r["loss"], r["grad_norm"]) for r in metrics(d)]   # noqa: E731
    assert same(again) == same(ref), "a run with dropout does not repeat itself"
    with monkeypatch.context() as m:
        seen = _sigterm_at(m, MB * 2 + 3)   # step 3's third micro-batch
        with pytest.raises(signals.Stopped) as e:
            run(quick_argv(assets, out, *flags))
    assert str(e.value) == f"stopped on SIGTERM before step 3's update: steps 1..2 are saved in {out}/ckpt", e.value
    assert e.value.code == 143 and seen == {"calls": MB * 2 + 3, "saves": [2]}, (e.value.code, seen)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the SIGTERM handler outlived the run"
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["latest", "step_000002"]
    assert [r["step"] for r in metrics(out)] == [1, 2] and not os.path.exists(os.path.join(out, "adapter"))
    run(quick_argv(assets, out, *flags, "--resume", os.path.join(out, "ckpt")))
    got, want = metrics(out), metrics(ref)
    assert [r["step"] for r in got] == [1, 2, 3, 4], "each step logged once"
    assert same(out) == same(ref), (got, want)
    from safetensors.torch import load_file
    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (out, ref))
    assert all(torch.equal(a[k], b[k]) for k in b), "the resumed adapter is not the uninterrupted one"


@pytest.fixture
def default_sigint():
    """SIGINT at Python's default for the test, whatever this process inherited (a job a shell started in the
    background, `cmd &`, inherits SIGINT ignored, and Python keeps it so: the handler the run restores is that one);
    the inherited one again after."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, outer)


def test_a_signal_in_the_baseline_evaluation_stops_there_and_ctrl_c_before_it_is_one_line(assets, done, tmp_path,
                                                                                           monkeypatch, capsys,
                                                                                           default_sigint):
    """The stop handlers start before the evaluation before training (minutes on a large eval set): a SIGINT there
    stops the run once it ends, as in a step, not with a KeyboardInterrupt traceback (review, helper 54). Ctrl-C
    before the handlers (the model build) is one line with the way on, exit 130. (quick_argv; the eval set is 10
    records; the other run's checkpoint is the module's `done`.)"""
    import train
    from parallel import evaluate, signals

    real = evaluate.evaluate   # (the evaluation before training: evaluate.baseline's)

    def interrupted(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    out, ev = str(tmp_path / "out"), eval_head(assets)
    with monkeypatch.context() as m:
        m.setattr(evaluate, "evaluate", interrupted)
        with pytest.raises(signals.Stopped) as e:
            run(quick_argv(assets, out, "--eval-data", ev))
    assert e.value.code == 130 and str(e.value) == "stopped on SIGINT before step 1's update: no step had " \
        f"finished: nothing to save; run the same command with --overwrite ({out} holds no checkpoint)", e.value
    assert "eval_loss before training" in capsys.readouterr().out and metrics(out) == []
    # the advice is one the next command takes: with --resume auto the same command; from another run's checkpoint
    # into this --out, a new --out (--overwrite beside --resume is refused; review, helper 56)
    again = str(tmp_path / "again")
    with monkeypatch.context() as m:
        m.setattr(evaluate, "evaluate", interrupted)
        with pytest.raises(signals.Stopped) as e:
            run(quick_argv(assets, again, "--eval-data", ev, "--resume", "auto"))
    assert str(e.value).endswith("nothing to save; run the same command again (--resume auto starts it again)")
    with one_thread():   # and it does (exit 0: cli's code on success)
        assert train.cli(quick_argv(assets, again, "--eval-data", ev, "--resume", "auto")) == 0
    assert len(metrics(again)) == 3
    assert notes.way_on(again, False, True) == f"run the same command with --resume {again}/ckpt"
    assert notes.way_on(out, False, True) == f"run it with a new --out ({out} holds this start's files but no " \
        "checkpoint)"
    for argv, says in ((quick_argv(assets, out, "--steps", "4", "--resume", os.path.join(done, "ckpt")),
                        f"--out {out!r} already holds files"),   # (as said: refused)
                       (quick_argv(assets, out, "--steps", "4", "--resume", os.path.join(done, "ckpt"), "--overwrite"),
                        "--resume continues a run and --overwrite deletes one")):
        assert says in startup_error(argv), argv
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the SIGINT handler outlived the run"

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        import parallel.parallelize
        m.setattr(parallel.parallelize, "build_model", ctrl_c)
        with one_thread():
            code = train.cli(train_argv(assets, str(tmp_path / "early")))
    said = capsys.readouterr().err
    assert code == 130 and said.strip() == f"error: interrupted (SIGINT): run the same command again " \
        f"({tmp_path / 'early'} holds nothing of it yet)", said   # (its lock alone: no --overwrite needed, helper 111)
    with one_thread():   # and it does
        assert train.cli(quick_argv(assets, str(tmp_path / "early"), "--steps", "1")) == 0


def test_resume_auto_is_one_command_for_every_requeue(assets, dropout_ref, tmp_path, monkeypatch, capsys):
    """--resume auto: a fresh run where --out is absent; the same command after a stop continues from OUT/ckpt and
    ends as the uninterrupted run (losses, grad norms, adapter bit for bit); a run killed before its first save starts
    again. Refused: without --out, with --overwrite, a live run's folder, a finished run's adapter with no checkpoint
    (it would be deleted), a folder that is not a run's. (quick_argv; the uninterrupted run is the module's
    dropout_ref.)"""
    from safetensors.torch import load_file

    from parallel import runs, signals

    flags, ref, out = DROPOUT, dropout_ref, str(tmp_path / "out")
    auto = quick_argv(assets, out, *flags, "--resume", "auto")
    capsys.readouterr()
    with monkeypatch.context() as m:
        _sigterm_at(m, MB * 2 + 3)   # step 3's third micro-batch: steps 1..2 saved
        with pytest.raises(signals.Stopped):
            run(auto)
    said = capsys.readouterr().out
    assert f"out: {out} (--resume auto: no run there yet, a fresh one)" in said and "steps 1..2 are saved in " \
        f"{out}/ckpt — continue with the same command\n" in said, said
    run(auto)
    said = capsys.readouterr().out
    assert f"(--resume auto: continuing from {out}/ckpt/step_000002)" in said and \
        f"resumed from {out}/ckpt/step_000002 at step 2" in said, said
    same = lambda d: [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(d)]   # noqa: E731
    assert same(out) == same(ref)
    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (out, ref))
    assert all(torch.equal(a[k], b[k]) for k in b), "the requeued run's adapter is not the uninterrupted one"
    # another instance of the job ran there between this one's start-up and its claim (review, helper 57): what it
    # decided is decided again under the lock, and a change refused, nothing removed, the last holder's note included
    # (it was rewritten before the refusal until 2026-12-05: CI failed when the clock's second turned in between)
    with open(os.path.join(out, runs.LOCK), "w") as f:
        f.write("pid 1 on another-node since 2026-01-01 00:00:00\n")
    before = tree_hash(out)
    for was, now in (("restarted", "holding a whole step"), ("fresh", "holding a whole step")):
        with pytest.raises(ValueError) as e:
            runs.claim(out, overwrite=was == "restarted", auto=was)
        assert f"--resume auto found {out!r} {runs.AUTO_SAID[was]} at start-up, and now {now}: another instance of " \
            "this job wrote there meanwhile. Run the same command again" in str(e.value), str(e.value)
    assert tree_hash(out) == before, "a refused claim changed the run"
    # ... also when the other instance writes between those checks and the lock (helper 59: the lock's own check was
    # untested): a whole step appears in a folder this one found killed before its first save
    raced = str(tmp_path / "raced")
    shutil.copytree(out, raced, ignore=shutil.ignore_patterns("ckpt", "adapter", "run.lock"))
    lock = runs._lock

    def other_instance_first(path):
        shutil.copytree(os.path.join(out, "ckpt"), os.path.join(raced, "ckpt"))
        return lock(path)
    with monkeypatch.context() as m:
        m.setattr(runs, "_lock", other_instance_first)
        with pytest.raises(ValueError, match="holding a run that saved no whole step at start-up, and now holding a "
                                             "whole step: another instance"):
            runs.claim(raced, overwrite=True, auto="restarted")
    assert sorted(os.listdir(os.path.join(raced, "ckpt"))) == sorted(os.listdir(os.path.join(out, "ckpt")))
    assert os.path.isfile(os.path.join(raced, "config.json")), "the refused claim removed files"
    run(auto)   # once more, the run ended: nothing trained, said; the same adapter and metrics
    assert "note: step 4 is this run's last: nothing to train" in capsys.readouterr().out and same(out) == same(ref)
    a = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    # killed before its first save: config.json and metrics.jsonl, no step; the same command starts it again
    killed = str(tmp_path / "killed")
    shutil.copytree(out, killed, ignore=shutil.ignore_patterns("ckpt", "adapter", "run.lock"))
    run(quick_argv(assets, killed, *flags, "--resume", "auto"))
    said = capsys.readouterr().out
    assert f"out: {killed} (--resume auto: its run saved no whole step, so it starts again) (metrics.jsonl, " \
        "config.json are deleted once the model is built)" in said, said
    assert same(killed) == same(ref)
    finished = str(tmp_path / "finished")   # its steps deleted by hand, its adapter there: never taken for a kill
    shutil.copytree(out, finished, ignore=shutil.ignore_patterns("ckpt", "run.lock"))
    for argv, says in ((train_argv(assets, finished, *flags, "--resume", "auto"),
                        "holds a run's adapter but no whole checkpoint to continue from, and starting it again would "
                        "delete them: pass a new --out (or, in place of --resume auto, --overwrite to replace that "
                        "run)"),
                       ([a for a in auto if a not in ("--out", out)], "--resume auto continues the run in --out when "
                        "it saved a step, else starts it there: pass --out DIR"),
                       ([*auto, "--overwrite"], "--resume auto chooses between continuing --out's run and starting "
                        "it: drop --overwrite")):
        assert says in startup_error(argv)
    assert os.path.isfile(os.path.join(finished, "adapter", "adapter_model.safetensors"))
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert "it holds notes.txt but none of config.json" in startup_error(train_argv(assets, str(user), *flags,
                                                                                    "--resume", "auto"))
    live = runs.claim(str(tmp_path / "live"))
    try:
        assert "in use by a live run" in startup_error(train_argv(assets, str(tmp_path / "live"), *flags, "--resume",
                                                                  "auto"))
    finally:
        live.release()


def test_a_mean_as_loss_fn_is_refused_before_anything_is_read(assets, tmp_path, monkeypatch):
    import train

    monkeypatch.setattr(train, "LOSS_FN", lambda z, y: F.cross_entropy(z, y, ignore_index=-100))
    said = startup_error(train_argv(assets, str(tmp_path / "mean")))
    assert said.startswith("LOSS_FN must return the SUM") and not os.path.exists(tmp_path / "mean"), said


def test_resume_auto_of_a_run_that_stopped_early_writes_its_adapter(assets, tmp_path, capsys):
    """A requeue (--resume auto) of a run --early-stop ended, killed in its final export (no adapter/): the same
    command writes that step's adapter, exit 0 (review, helper 57: every requeue was refused, as a resume that would
    stop at once, and its advice was refused too); the adapter is the one the run ended with."""
    from safetensors.torch import load_file

    import train

    out = str(tmp_path / "es")
    argv = quick_argv(assets, out, "--steps", "6", "--eval-data", eval_head(assets), "--eval-every", "1",
                      "--early-stop", "1", "--early-stop-delta", "100", "--resume", "auto")
    run(argv)
    assert [r["step"] for r in metrics(out)] == [1, 2], "--early-stop 1 with a delta of 100 ends at step 2"
    want = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    shutil.rmtree(os.path.join(out, "adapter"))   # the kill in the export
    capsys.readouterr()
    with one_thread():
        assert train.cli(argv) == 0
    said = capsys.readouterr().out
    assert "note: --resume auto: the run stopped early at step 2 (--early-stop)" in said and \
        "note: step 2 is this run's last: nothing to train" in said, said
    got = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_a_run_saves_every_30_minutes_unless_told_otherwise(assets, tmp_path, monkeypatch):
    """--save-minutes is 30 unless given: a run whose steps each take over half an hour (the save clock's time made so)
    saves after every step, not only at its end, so a crash without a signal loses one step; 0 turns it off."""
    import types

    from parallel import saves

    real, calls = time.time, [0]

    def slow():   # 31 minutes more at each reading of the save clock
        calls[0] += 1
        return real() + 31 * 60 * calls[0]
    monkeypatch.setattr(saves, "time", types.SimpleNamespace(time=slow))
    run(quick_argv(assets, str(tmp_path / "a"), "--keep-ckpts", "5", "--steps", "2"))
    assert sorted(os.listdir(tmp_path / "a" / "ckpt")) == ["latest", "step_000001", "step_000002"]
    run(quick_argv(assets, str(tmp_path / "b"), "--keep-ckpts", "5", "--save-minutes", "0", "--steps", "2"))
    assert sorted(os.listdir(tmp_path / "b" / "ckpt")) == ["latest", "step_000002"]


def test_a_stop_saves_only_what_is_not_on_disk_and_every_save_resumes(assets, done, tmp_path, monkeypatch):
    """(quick_argv: MB = 4 micro-batches a step; the run resumed from an older step is a copy of the module's `done`,
    the same 4-step run with --save-every 2.)"""
    import train
    from parallel import signals

    def stop(out, n, *flags):
        with monkeypatch.context() as m:
            seen = _sigterm_at(m, n)
            with pytest.raises(signals.Stopped):
                run(quick_argv(assets, out, "--steps", "4", *flags))
        return seen["saves"], open(os.path.join(out, "ckpt", "latest")).read(), [r["step"] for r in metrics(out)]

    # right after a --save-every save: nothing more to write
    a = str(tmp_path / "a")
    assert stop(a, MB * 2 + 3, "--save-every", "2") == ([2], "step_000002", [1, 2])
    # --save-minutes: a save once that much time passed since the last (tiny: after every step; 10: none before the
    # stop's own)
    assert stop(str(tmp_path / "m"), MB * 2 + 3, "--save-minutes", "1e-9", "--keep-ckpts", "5") == \
        ([1, 2], "step_000002", [1, 2])
    assert stop(str(tmp_path / "n"), MB * 2 + 3, "--save-minutes", "10") == ([2], "step_000002", [1, 2])
    # resumed from an older step of the same run (latest named step 4): `latest` names step 2 from the start
    # (checkpoint.branch), so the stop writes nothing: step 2 is on disk, and the printed --resume OUT/ckpt
    # continues from it
    b = str(tmp_path / "b")
    shutil.copytree(done, b)   # (that run: --steps 4 --save-every 2)
    assert stop(b, 3, "--save-every", "2", "--resume", os.path.join(b, "ckpt", "step_000002")) == \
        ([], "step_000002", [1, 2])
    # step 1 skipped as non-finite (AdamW never ran: no optimizer state), then stopped in step 2: its save resumes
    c = str(tmp_path / "c")
    monkeypatch.setattr(train, "LOSS_FN", nan_in_step_one())
    assert stop(c, MB + 2) == ([1], "step_000001", [1]) and metrics(c)[0]["skipped"] == 1
    run(quick_argv(assets, c, "--steps", "3", "--resume", os.path.join(c, "ckpt")))
    assert [r["step"] for r in metrics(c)] == [1, 2, 3]


def _stop_cli(argv, env, sig):
    """Start `argv`, send `sig` once it logged its first step, return (exit status, output, seconds it took)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    for line in p.stdout:   # the first logged step: the loop is running
        lines.append(line)
        if line.startswith("step "):
            break
    p.send_signal(sig)
    t0 = time.monotonic()
    lines += p.stdout.readlines()
    p.wait(timeout=120)
    return p.returncode, "".join(lines), time.monotonic() - t0


def _saved_step(out) -> int:
    step = int(open(os.path.join(out, "ckpt", "latest")).read().removeprefix("step_"))
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 1)), (step, metrics(out))
    return step


@pytest.mark.timeout(240)
def test_torchrun_forwards_sigterm_and_a_second_stop_by_ctrl_c(assets, tmp_path):
    """(Also: no process that imports the model, the two workers and the 1-process run, says bitsandbytes'
    "Failed to load CPU gemm_4bit_forward from kernels-community", which it logs on CPUs with AVX512-BF16, this
    project's CI machines among them; model/__init__ filters exactly that record. Until 2026-12-07 a process of its
    own, importing model.qlora, model.export and parallel.parallelize: ~4 s of imports.)"""
    out = str(tmp_path / "out")
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "OMP_NUM_THREADS": "1"}
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train.py"), *train_argv(assets, out, "--steps", "100", "--dp-shard", "2")]
    rc, log, took = _stop_cli(two, env, signal.SIGTERM)   # torchrun sends it on to both workers
    assert "kernels-community" not in log, log[:3000]
    step = _saved_step(out)
    assert rc != 0 and rc != -9 and took < 29, (rc, took, log[-3000:])   # before torchrun's 30 s grace: SIGKILL
    saved = f"steps 1..{step} are saved" if step > 1 else "step 1 is saved"
    assert 1 <= step < 100 and f"stopped on SIGTERM before step {step + 1}'s update: {saved} in " \
        f"{out}/ckpt — continue with the same command plus --resume {out}/ckpt" in log, log[-3000:]
    one = [sys.executable, os.path.join(ROOT, "train.py"), *train_argv(assets, out, "--steps", "100", "--resume",
                                                                        os.path.join(out, "ckpt"))]
    rc, log, took = _stop_cli(one, env, signal.SIGINT)   # Ctrl-C on a 1-process run (another layout)
    assert "kernels-community" not in log, log[:3000]
    assert rc == 128 + signal.SIGINT and f"stopped on SIGINT before step {_saved_step(out) + 1}'s update" in log, \
        (rc, log[-3000:])
    assert _saved_step(out) > step, "the resumed run saved no later step"


def test_export_the_adapter_of_a_checkpoint(assets, done, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from parallel.checkpoint import main as export_cli
    from parallel.checkpoint_export import export

    def cli(*argv, cwd=ROOT):   # the command line in this process: (exit code, stderr)
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.chdir(cwd)
            code = export_cli([os.path.join(done, "ckpt"), *argv])
        return code, capsys.readouterr().err

    def adapter(d):
        cfg = json.load(open(os.path.join(d, "adapter_config.json")))
        cfg["target_modules"] = sorted(cfg["target_modules"])   # peft keeps them as a set: any order
        return load_file(os.path.join(d, "adapter_model.safetensors")), cfg

    out = str(tmp_path / "final")   # `python -m parallel.checkpoint`'s main, in this process (test_readme.py runs the
    capsys.readouterr()   # module as __main__; an interpreter more would cost ~5 s of imports)
    code = export_cli([os.path.join(done, "ckpt"), "--out", out])
    said = capsys.readouterr()
    assert code == 0 and "step_000004" in said.out, said
    (got, gcfg), (want, wcfg) = adapter(out), adapter(os.path.join(done, "adapter"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert gcfg == wcfg, {k: (gcfg.get(k), wcfg.get(k)) for k in set(gcfg) | set(wcfg) if gcfg.get(k) != wcfg.get(k)}
    export(os.path.join(done, "ckpt", "step_000002"), str(tmp_path / "two"))
    two = adapter(str(tmp_path / "two"))[0]
    assert any(not torch.equal(two[k], want[k]) for k in want), "step 2's adapter is step 4's"
    code, err = cli("--out", out)
    assert code == 2 and f"--out {out!r} exists and is not empty" in err, err
    with monkeypatch.context() as m:   # a full disk: said with its fix (free space; a new directory on it would fail
        # alike), and no half-written folder left on that disk (until 2026-12-07 `full.tmp-export` stayed)
        m.setattr("model.export._save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on "
                                                                                          "device")))
        there = sorted(os.listdir(tmp_path))
        code, err = cli("--out", str(tmp_path / "full"))
    assert code == 2 and err.strip().endswith("No space left on device); nothing is left there: free space (or fix "
                                              "the folder), then run the same command again"), err
    assert sorted(os.listdir(tmp_path)) == there, sorted(os.listdir(tmp_path))
    half = tmp_path / "mount"   # an export into an empty directory killed between its renames: written again
    (half / ".adapter.tmp").mkdir(parents=True)   # (until 2026-12-03 refused as "not empty", for good)
    (half / "adapter_model.safetensors").write_bytes(b"partial")
    export(os.path.join(done, "ckpt"), str(half))
    assert adapter(str(half))[0].keys() == want.keys() and sorted(os.listdir(half)) == sorted(os.listdir(out))
    from model.hub import model_fingerprint
    base = {"quant": "none", "model_sha256": model_fingerprint(assets["model"])}
    for d in (out, os.path.join(done, "adapter")):   # the base it was trained on, for model.merge (a --quant none run)
        assert json.load(open(os.path.join(d, "trained_on.json"))) == base, d
    mine = tmp_path / "v2.old"   # a user's folder that happens to be named like a swap leftover
    mine.mkdir()
    (mine / "keep").write_text("mine")
    elsewhere = tmp_path / "elsewhere"   # from another directory: the base is named by its absolute path
    elsewhere.mkdir()
    code, err = cli("--out", "../v2", cwd=elsewhere)
    assert code == 0, err
    assert (mine / "keep").read_text() == "mine", "the export removed a folder it did not make"
    assert adapter(str(tmp_path / "v2"))[1]["base_model_name_or_path"] == wcfg["base_model_name_or_path"]
    assert os.path.isabs(wcfg["base_model_name_or_path"]) and os.path.isdir(wcfg["base_model_name_or_path"])
    inside = os.path.join(done, "ckpt", "step_1", "adapter")   # a folder there would be a step for rotation
    code, err = cli("--out", inside)
    assert code == 2 and f"--out {inside!r} is inside the checkpoint folder" in err, err
    assert not os.path.exists(os.path.dirname(inside)), "the refused export made a folder in the ckpt folder"
    # --out as the directory it names on disk (found by review, 2026-12-04): "" (an unset variable: the current
    # directory) and 'DIR/typo/..' (DIR) passed the not-empty check, and the swap deleted all DIR held
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("mine")
    for bad, said in (("", "--out is empty"), (str(user / "typo" / ".."), "exists and is not empty")):
        code, err = cli("--out", bad, cwd=user)
        assert code == 2 and said in err, err
        assert os.listdir(user) == ["thesis.txt"] and (user / "thesis.txt").read_text() == "mine"
    # --model of another shape, for a run that recorded no fingerprint of its base (the demo's): refused by the
    # shapes of the trained tensors (review, helper 81: any base was taken, the adapter then named it)
    blind = shutil.copytree(os.path.join(done, "ckpt", "step_000004"), tmp_path / "blind" / "ckpt" / "step_000004")
    meta = json.load(open(blind / "meta.json"))
    meta["args"]["model_sha256"] = None
    json.dump(meta, open(blind / "meta.json", "w"))
    from tests.helpers import tiny_checkpoint
    for kw in (dict(head_dim=4), dict(layers=1), dict(inter=32)):
        wrong = tiny_checkpoint(tmp_path / f"wrong_{'_'.join(map(str, kw.values()))}", **kw)
        with pytest.raises(ValueError, match=f"--model {wrong!r} is not the base this run trained on: model.layers"):
            export(str(blind), str(tmp_path / "never"), model=wrong)
    assert not (tmp_path / "never").exists()
    export(str(blind), str(tmp_path / "fits"), model=assets["model"])   # (its own base: every shape fits)
    other = tmp_path / "other_run"   # another run's export folder: replaced at its next export (review, helper 80)
    (other / "adapter").mkdir(parents=True)
    (other / "config.json").write_text('{"global_batch": 8}')
    code, err = cli("--out", str(other / "adapter" / "mine"))
    assert code == 2 and f"is inside {str(other / 'adapter')!r}, which the train.py run {str(other)!r} owns" in err, err
    link = tmp_path / "laststep"   # a link to a step folder: the ckpt folder is the one it is in
    os.symlink(os.path.join(done, "ckpt", "step_000004"), link)
    inside = os.path.join(done, "ckpt", "manual")
    with pytest.raises(ValueError, match=f"is inside the checkpoint folder '{os.path.realpath(done)}/ckpt'"):
        export(str(link), inside)
    assert export(str(link), str(tmp_path / "beside")).endswith("laststep")
    scratch, run = tmp_path / "scratch", tmp_path / "run2" / "ckpt"   # a ckpt folder whose step is a link elsewhere:
    shutil.copytree(os.path.join(done, "ckpt", "step_000004"), scratch / "step_000004")   # --out in the folder the
    run.mkdir(parents=True)   # link is in is refused too
    os.symlink(scratch / "step_000004", run / "step_000004")
    with pytest.raises(ValueError, match=f"is inside the checkpoint folder '{run}'"):
        export(str(run / "step_000004"), str(run / "adapter_4"))
    from model.export import write_adapter
    with pytest.raises(ValueError, match="holds files that are not an adapter"):   # the last line before a swap
        write_adapter({}, None, str(user), assets["model"])
    assert os.listdir(user) == ["thesis.txt"]


def test_a_tied_models_checkpoint_exports_the_runs_adapter_which_merges(assets, tmp_path, capsys, monkeypatch):
    """A tied-embedding model's checkpoint holds no copy of the embedding (lm_head.weight, its tied name), and one
    written before that change (holding it) still resumes: both resumes train bit for bit as the uninterrupted run.
    The adapter exported from either is the run's own, bit for bit (LoRA A and B only), so model.merge takes it and
    --init-adapter starts from it; merge refuses an adapter holding other tensors, naming them, before writing
    anything. (And a run shorter than its --warmup says where its LR peaks.)"""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import train
    from model import merge
    from parallel import checkpoint
    from parallel.checkpoint_export import export
    from tests.fixtures import make_tokenizer
    from tests.helpers import tiny_checkpoint

    def keys(step_dir):
        return set(dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata)

    base = tmp_path / "tied"
    tiny_checkpoint(base, vocab=len(make_tokenizer(base)), tie=True)
    argv = lambda out, *a: quick_argv({**assets, "model": str(base)}, out, "--steps", "2", "--save-every", "1", *a)
    out, old = str(tmp_path / "run"), str(tmp_path / "old")
    with one_thread():
        train.main(argv(out))
        want = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))   # uninterrupted
        with monkeypatch.context() as m:   # the checkpoints as written before: get_state_dict's whole model dict
            m.setattr(checkpoint, "_state", lambda model, opt: dict(zip(("model", "optim"), get_state_dict(
                model, opt, options=checkpoint.OPTS))))
            train.main(argv(old))
        assert "model.lm_head.weight" in keys(os.path.join(old, "ckpt", "step_000001")), "the old format, simulated"
        for run_dir in (out, old):
            train.main(argv(run_dir, "--resume", os.path.join(run_dir, "ckpt", "step_000001")))
    for d in (out, old):
        got = load_file(os.path.join(d, "adapter", "adapter_model.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), \
            f"{d}: the resumed run trained another adapter"
    saved = keys(os.path.join(out, "ckpt", "step_000002"))
    assert not [k for k in saved if k.startswith("model.") and ".lora_" not in k], sorted(saved)[:4]
    export(os.path.join(old, "ckpt", "step_000001"), str(tmp_path / "exp1"))   # an old-format step: LoRA only
    assert load_file(str(tmp_path / "exp1" / "adapter_model.safetensors")).keys() == want.keys()
    export(os.path.join(out, "ckpt"), str(tmp_path / "exp"))
    got = load_file(str(tmp_path / "exp" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), sorted(set(got) ^ set(want))
    assert merge.main(["--adapter", str(tmp_path / "exp"), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    with one_thread():
        train.main(quick_argv({**assets, "model": str(base)}, str(tmp_path / "init"), "--steps", "1",
                              "--init-adapter", str(tmp_path / "exp"), "--warmup", "4"))
    assert "note: --warmup 4 is longer than the run's 1 steps: the LR peaks at 0.00025, not --lr 0.001" in \
        capsys.readouterr().out
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "exp", bad)
    save_file({**got, "base_model.model.lm_head.weight": torch.zeros(3, 3)}, str(bad / "adapter_model.safetensors"))
    capsys.readouterr()
    assert merge.main(["--adapter", str(bad), "--out", str(tmp_path / "merged2"), "--dtype", "fp32"]) == 2
    assert "holds a trained output head (lm_head.weight), which this trainer does not train" in \
        capsys.readouterr().err
    assert not os.path.exists(tmp_path / "merged2"), "a refused merge wrote its --out"


def test_init_adapter_starts_from_the_function_the_adapter_learned(assets, tmp_path, capsys):
    import re

    from safetensors.torch import load_file, save_file

    a, b, ev = str(tmp_path / "a"), str(tmp_path / "b"), eval_head(assets)   # (10 eval records: the same claims)
    run(quick_argv(assets, a, "--steps", "2", "--eval-data", ev, "--lora-targets", "q_proj,v_proj"))
    capsys.readouterr()
    run(quick_argv(assets, b, "--steps", "1", "--eval-data", ev, "--init-adapter", a + "/adapter"))
    before = float(re.search(r"eval_loss before training (\S+)", (log := capsys.readouterr().out)).group(1))
    assert before == metrics(a)[-1]["eval_loss"], (before, metrics(a)[-1])
    assert "was trained on another base" not in log and "was trained against the" not in log, log
    from model.adapter_read import init_adapter_note
    from model.export import TRAINED_ON
    sha = json.load(open(os.path.join(a, "adapter", TRAINED_ON)))["model_sha256"]   # (the run's own base)
    assert init_adapter_note(a + "/adapter", None, sha, "none") is None
    note = init_adapter_note(a + "/adapter", None, "f" * 64, "nf4")   # said, not refused: a choice
    assert f"records model_sha256 {sha[:12]}..., --model gives ffffffffffff" in note, note
    assert "trained against the unquantized base, this run's --quant is nf4" in note, note
    # the RoPE a --rope-scaling run learned under (its base_config_overrides.json), other than this run's: said, with
    # the fix (review, helper 50: silent); the same RoPE, or an adapter without the file (the staged recipe), is not
    from model.export import OVERRIDES
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    rope = str(tmp_path / "rope")
    shutil.copytree(a + "/adapter", rope)
    json.dump({"rope_parameters": yarn}, open(os.path.join(rope, OVERRIDES), "w"))
    note = init_adapter_note(rope, None, sha, "none")
    assert f"learned under RoPE {json.dumps(yarn)} ({OVERRIDES}), this run runs its base config.json's: it starts " \
           "from another function than it learned (to keep that one, pass the --rope-scaling its run had" in note, note
    assert "learned under RoPE" in init_adapter_note(rope, None, sha, "none", {**yarn, "factor": 8.0})
    assert init_adapter_note(rope, None, sha, "none", yarn) is None
    assert init_adapter_note(a + "/adapter", None, sha, "none", yarn) is None
    base = train_argv(assets, str(tmp_path / "x"), "--init-adapter", a + "/adapter")
    for flags, phrase in ((["--lora-r", "8"], "r 4 and lora_alpha 32.0, this run --lora-r 8 --lora-alpha 32"),
                          (["--lora-alpha", "16"], "this run --lora-r 4 --lora-alpha 16"),
                          (["--lora-targets", "q_proj,k_proj"], "beyond this run's --lora-targets q_proj,k_proj"),
                          (["--rslora"], "use_rslora False, this run --rslora (drop --rslora)"),
                          (["--dora"], "use_dora False, this run --dora (drop --dora)")):
        msg = startup_error(base + flags)
        assert phrase in msg and a + "/adapter" in msg, msg
    msg = startup_error(train_argv(assets, str(tmp_path / "x"), "--init-adapter", str(tmp_path / "nope")))
    assert f"--init-adapter {str(tmp_path / 'nope')!r}: no such directory" in msg, msg
    cfg = json.load(open(os.path.join(a, "adapter", "adapter_config.json")))
    for extra, phrase in (({"use_dora": True}, "use_dora True, this run no --dora (pass --dora)"),
                          ({"bias": "all"}, "bias 'all'"),
                          ({"use_rslora": True}, "use_rslora True, this run no --rslora (pass --rslora)"),
                          ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
                          ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern {'q_proj': 8}")):   # made elsewhere
        odd = str(tmp_path / "odd")
        shutil.rmtree(odd, ignore_errors=True)
        shutil.copytree(a + "/adapter", odd)
        json.dump({**cfg, **extra}, open(os.path.join(odd, "adapter_config.json"), "w"))
        msg = startup_error(train_argv(assets, str(tmp_path / "x"), "--init-adapter", odd))
        assert phrase in msg, msg
    # the same tensors as an rsLoRA adapter, with --rslora: scale alpha / sqrt(r) = 16, not alpha / r = 8, so the
    # function it starts from is another one (eval loss), and the run's own adapter is rsLoRA again
    json.dump({**cfg, "use_rslora": True}, open(os.path.join(odd, "adapter_config.json"), "w"))
    rs = str(tmp_path / "rs")
    run(quick_argv(assets, rs, "--steps", "1", "--eval-data", ev, "--init-adapter", odd, "--rslora",
                   "--lora-targets", "q_proj,v_proj"))
    loss = float(re.search(r"eval_loss before training (\S+)", capsys.readouterr().out).group(1))
    assert abs(loss - before) > 1e-4, (loss, before)
    assert json.load(open(os.path.join(rs, "adapter", "adapter_config.json")))["use_rslora"] is True
    msg = startup_error(train_argv(assets, a, "--overwrite", "--init-adapter", a + "/adapter"))
    assert "lies inside --out" in msg and os.path.exists(a + "/adapter/adapter_model.safetensors"), msg
    other = str(tmp_path / "other")   # an adapter of another base: a tensor of another shape
    shutil.copytree(a + "/adapter", other)
    sd = load_file(os.path.join(other, "adapter_model.safetensors"))
    k = next(k for k in sd if k.endswith("q_proj.lora_A.weight"))
    save_file({**sd, k: torch.zeros(4, 7)}, os.path.join(other, "adapter_model.safetensors"))
    msg = startup_error(train_argv(assets, str(tmp_path / "y"), "--init-adapter", other))   # (before the data since
    assert "does not fit this --model: 1 LoRA tensors differ" in msg and f"{k} [4, 7], this model's [4, 48]" in msg, \
        msg   # 2026-12-04; was said once the model was built)
    half = str(tmp_path / "half")   # one half of a LoRA pair: the other would keep this run's init (helper 50)
    shutil.copytree(a + "/adapter", half)
    save_file({x: v for x, v in sd.items() if x != k}, os.path.join(half, "adapter_model.safetensors"))
    msg = startup_error(train_argv(assets, str(tmp_path / "y"), "--init-adapter", half))
    assert "holds one half of a LoRA pair for 1 projections (layer 0 q_proj (only lora_B))" in msg, msg
    # a projection its config names with no tensors at all in one layer: it would start at B = 0, not the adapter's
    # (a cut file); under peft's layers_to_transform, the layers it leaves out are its choice and start so
    gone = str(tmp_path / "gone")
    shutil.copytree(a + "/adapter", gone)
    save_file({x: v for x, v in sd.items() if ".layers.1.self_attn.q_proj." not in x},
              os.path.join(gone, "adapter_model.safetensors"))
    msg = startup_error(train_argv(assets, str(tmp_path / "y"), "--init-adapter", gone))
    assert "adapter_model.safetensors holds no tensors for 1 of those projections (layer 1 q_proj): a damaged" in msg, \
        msg
    save_file({x: v for x, v in sd.items() if ".layers.1." not in x}, os.path.join(gone, "adapter_model.safetensors"))
    json.dump({**cfg, "layers_to_transform": [0]}, open(os.path.join(gone, "adapter_config.json"), "w"))
    extra = str(tmp_path / "extra")   # tensors beyond layers_to_transform: peft would not load them
    shutil.copytree(gone, extra)
    shutil.copy(os.path.join(a, "adapter", "adapter_model.safetensors"), extra)
    msg = startup_error(train_argv(assets, str(tmp_path / "y"), "--init-adapter", extra))
    assert "has layers_to_transform [0], but adapter_model.safetensors holds tensors for 2 projections outside them " \
           "(layer 1 q_proj; layer 1 v_proj)" in msg, msg
    zero = str(tmp_path / "zero")   # the same function written out: layer 1's q and v with B = 0
    shutil.copytree(a + "/adapter", zero)
    save_file({x: v if ".layers.1." not in x or "lora_A" in x else torch.zeros_like(v) for x, v in sd.items()},
              os.path.join(zero, "adapter_model.safetensors"))
    capsys.readouterr()
    losses = []
    for d in (gone, zero):
        run(quick_argv(assets, str(tmp_path / ("from_" + os.path.basename(d))), "--steps", "1", "--eval-data",
                       ev, "--init-adapter", d))
        losses.append(float(re.search(r"eval_loss before training (\S+)", capsys.readouterr().out).group(1)))
    assert losses[0] == losses[1] != before, losses
    # peft, too, puts no LoRA in layer 1: the function both start from
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        got = [PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), d).eval()(ids).logits
               for d in (gone, zero)]
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-6)
    bias = str(tmp_path / "bias")   # a trained bias among the tensors: it would land in a frozen weight
    shutil.copytree(a + "/adapter", bias)
    save_file({**sd, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias": torch.zeros(48)},
              os.path.join(bias, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj.base_layer.bias is not a LoRA A/B weight"):
        run(quick_argv(assets, str(tmp_path / "z"), "--init-adapter", bias))
    # a resume takes LoRA from its checkpoint: the start adapter is neither read nor needed any more
    shutil.rmtree(a + "/adapter")
    run(quick_argv(assets, b, "--steps", "2", "--eval-data", ev, "--init-adapter", a + "/adapter",
                   "--resume", os.path.join(b, "ckpt")))
    assert [r["step"] for r in metrics(b)] == [1, 2]


def test_fast_adds_the_planners_fastest_flags(assets, tmp_path, monkeypatch, capsys):
    """--fast: the run adds the memory flags parallel.plan_speed ranks fastest among those whose plan fits 95% of
    the device (here a budget set between the plans of AC on one block and of no AC, so neither the default nor
    --no-ac is the answer), logs them, records them in OUT/config.json, and trains exactly as the same flags typed
    by hand; `--plan --fast` names the same flags. Memory flags only: the losses equal the plain run's. With --max-len
    far above the data, the flags are those for the data's longest sample (not those for --max-len)."""
    import argparse

    import train
    from model.load import read_args
    from parallel import plan_search, plan_speed
    from parallel.mesh import validate

    argv = lambda out, *x: quick_argv(assets, str(tmp_path / out), "--steps", "2", *x)
    mem = budget_between_ac_plans(argv("x"))
    monkeypatch.setattr(plan_search, "_budget", lambda a, world: ("cpu", mem, f"{mem:.0f} B (test)"))

    run(argv("fast", "--fast"))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("--fast: "))
    flags = line.split(" (planned")[0].removeprefix("--fast: ")
    assert flags and flags != "--no-ac" and "--ac-blocks" in flags, line
    cfg = json.load(open(tmp_path / "fast" / "config.json"))
    typed = train.build_parser().parse_args(argv("y", *flags.split()))
    for k in ("ac", "ac_blocks", "ac_keep_attn", "tiled_mlp", "tiled_attn"):
        assert cfg[k] == getattr(typed, k), (k, cfg[k], flags)
    assert cfg["fast_flags"] == flags, cfg   # (bench/gpu.py's ours+fast row reads them there)
    run(argv("typed", *flags.split()))
    run(argv("plain"))
    fast, by_hand, plain = (metrics(tmp_path / d) for d in ("fast", "typed", "plain"))
    assert [m["loss"] for m in fast] == [m["loss"] for m in by_hand], (fast, by_hand)
    assert [m["grad_norm"] for m in fast] == [m["grad_norm"] for m in by_hand]
    for a, b in zip(fast, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (fast, plain)

    capsys.readouterr()
    train.main(["--plan", *argv("p", "--fast")])
    assert f"--fast: {flags} (planned" in capsys.readouterr().out

    # --max-len far above the data: --fast plans the longest sample (from the data line), not --max-len
    T = 2 ** 18

    def fast_line():   # (the run stops at the model build's tripwire)
        with no_weights(), pytest.raises(AssertionError, match="a weight was about to be read"):
            train.main(argv("long", "--fast", "--max-len", str(T)))
        out = capsys.readouterr().out.splitlines()
        n = int(next(x for x in out if x.startswith("data: ")).split("longest record ")[1].split(",")[0].split()[0])
        return n, next(x for x in out if x.startswith("--fast: "))
    n = fast_line()[0]
    mem = budget_between_ac_plans(argv("x", "--max-len", str(n)))   # (read by the _budget above) --ac-blocks at n
    n, line = fast_line()
    assert line.endswith(f" for the longest sample, {n:,} tokens"), line
    args = train.build_parser().parse_args(argv("long", "--fast", "--max-len", str(T)))
    margs = read_args(args.model)
    dims, pack = validate(args, margs, 1)
    at = lambda k: plan_speed.fast_flags(argparse.Namespace(**{**vars(args), "max_len": k}), margs, dims, pack, 1)[0]
    assert "--ac-blocks" in at(n) and at(T) != at(n), (at(n), at(T))   # at --max-len: another answer
    assert line.startswith(f"--fast: {at(n)} (planned"), (line, at(n))

    # a failure in the planning is raised (the same on every rank: no one waits on another)
    monkeypatch.setattr(plan_speed, "fast_flags", lambda *a, **k: 1 / 0)
    with pytest.raises(RuntimeError, match="--fast failed: ZeroDivisionError"):
        run(argv("err", "--fast"))
    # a rank that cannot say its memory: named, raised on every rank after the gather (none waits)
    monkeypatch.setattr(plan_search, "_budget", lambda a, world: 1 / 0)
    with pytest.raises(RuntimeError, match="no device budget on rank 0: ZeroDivisionError"):
        run(argv("err2", "--fast"))


def test_a_run_whose_plan_cannot_fit_is_refused_before_the_weights(assets, tmp_path, monkeypatch, capsys):
    """The start-up memory check (preflight_memory.py) on one sample of 2^18 tokens, no AC, the device memory set
    around the planner's numbers for it: below LIVE_FLOOR x the planned live tensors the run is refused before any
    weight is read (tripwires; --out not made), naming the plan, the memory and single changes that fit; the first of
    them, typed, passes the check (the tripwire at the model build fires, the log says it fits); --no-mem-check and a
    device between that floor and the planned total pass with a warning; room enough logs the planned total. The plan
    is for the data's longest sample, not --max-len: the chat data (a few dozen tokens) at --max-len 2^18 train in the
    memory that refused the long sample. --offload-activations on a CUDA budget whose pinned bytes, (L - 1) block
    inputs of T x D at 4 bytes (computed here from config.json), exceed the free host memory: refused, naming both;
    --no-mem-check: a warning; a free host memory that cannot be read: not checked, and the memory line says so; the
    offload's host buffers are sized from the plan (one block input of the longest sample)."""
    import train
    from model.load import read_args
    from parallel import budgets, plan_search, preflight_memory
    from parallel.mesh import validate
    from parallel.plan import memory_plan
    from parallel.plan_totals import GB

    T = 2 ** 18
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": "hello there " * 45000}) + "\n")   # ~270k tokens, cut to --max-len
    argv = lambda out, *x, data=str(long): train_argv(assets, str(tmp_path / out), "--steps", "1", "--max-len",
                                                      str(T), "--no-ac", "--global-batch", "1", *x, "--data", data)
    args = train.build_parser().parse_args(argv("x"))
    margs = read_args(args.model)
    plan = memory_plan(margs, *validate(args, margs, 1)[:1], args, "cpu", True)
    budget = lambda mem: monkeypatch.setattr(plan_search, "_budget",
                                             lambda a, world: ("cpu", mem, f"{mem:.0f} B (test)"))
    lines = lambda: [x for x in capsys.readouterr().out.splitlines()
                     if x.startswith(("memory", "warning: planned", "warning: --offload"))]   # the check's lines

    def passes(argv):   # past the check: the model build's tripwire fires
        with no_weights(), pytest.raises(AssertionError, match="a weight was about to be read"):
            train.main(argv)
        return lines()

    small = 0.97 * preflight_memory.LIVE_FLOOR * plan.peak
    budget(small)
    msg = startup_error(argv("small"))
    assert not os.path.exists(tmp_path / "small")
    assert f"planned {plan.total / GB:.3g} GB per rank for the longest sample, {T:,} tokens" in msg, msg
    assert f"{plan.peak / GB:.3g} GB of live tensors) is more than {small:.0f} B (test)" in msg, msg
    assert "It cannot fit" in msg and "--no-mem-check" in msg and "single changes that fit: " in msg, msg
    fix = msg.split("single changes that fit: ")[1].split(" (")[0]
    assert fix.startswith("--") and "world-size" not in fix, msg
    got = passes(argv("fixed", *fix.split()))   # the advice, typed
    assert len(got) == 1 and got[0].startswith("memory: planned "), (fix, got)
    got = passes(argv("forced", "--no-mem-check"))
    assert len(got) == 1 and got[0].startswith(f"warning: planned {plan.total / GB:.3g} GB"), got
    budget(1.01 * preflight_memory.LIVE_FLOOR * plan.peak)   # may fit, by the planner's own error: a warning
    got = passes(argv("tight"))
    assert len(got) == 1 and got[0].startswith("warning: planned") and "may run out of memory" in got[0], got
    budget(plan.total * 2)
    assert passes(argv("room")) == [f"memory: planned {plan.total / GB:.3g} GB per rank for the longest sample, "
                                    f"{T:,} tokens, of {plan.total * 2:.0f} B (test) (parallel/plan.py; peak_mem_gb in "
                                    "the step lines is measured)"]
    budget(small)   # the chat data's rows are short: they fit where the long sample did not, and train
    run(argv("short", data=assets["data"]))
    got = lines()
    assert len(got) == 1 and "for the longest sample, " in got[0] and f"tokens (--max-len {T:,})" in got[0], got
    assert len(metrics(tmp_path / "short")) == 1

    # offload on a CUDA budget: the pinned bytes against the host memory free
    off = argv("off", "--offload-activations", "--ac")
    cfg = json.load(open(os.path.join(assets["model"], "config.json")))
    pinned = (cfg["num_hidden_layers"] - 1) * T * cfg["hidden_size"] * 4   # fp32 block inputs of T tokens
    a = train.build_parser().parse_args(off)
    assert memory_plan(margs, *validate(a, margs, 1)[:1], a, "cuda", True).host == pinned
    monkeypatch.setattr(plan_search, "_budget", lambda a, world: ("cuda", 1e15, "1 PB per GPU (test)"))
    monkeypatch.setattr(budgets, "host_available", lambda: (pinned - 1.0, "free (test)"))
    msg = startup_error(off)
    assert f"{pinned / GB:.3g} GB of host memory per rank for the longest sample, {T:,} tokens, more than the " \
           f"{(pinned - 1) / GB:.3g} GB free per rank" in msg, msg
    assert "free (test)" in msg and "Lower --max-len" in msg and not os.path.exists(tmp_path / "off"), msg
    got = passes(off + ["--no-mem-check"])
    assert got[0].startswith("warning: --offload-activations pins") and got[1].startswith("memory: planned"), got
    monkeypatch.setattr(budgets, "host_available", lambda: 1 / 0)   # the free host memory cannot be read: unchecked
    got = passes(off)
    assert len(got) == 1 and got[0].endswith("; free host memory unknown (ZeroDivisionError: division by zero), not "
                                             "checked"), got
    # the run sizes the offload's host buffers from that plan: one block input of the longest sample each
    import parallel.parallelize
    seen = []

    def build(opts, **kw):
        seen.append(opts.offload_reserve)
        raise AssertionError("a weight was about to be read")
    monkeypatch.setattr(parallel.parallelize, "build_model", build)
    with pytest.raises(AssertionError, match="a weight was about to be read"):
        train.main(off)
    assert seen == [T * cfg["hidden_size"] * 4], seen


def test_memory_check_shares_a_machine_and_says_what_it_skips(monkeypatch):
    """preflight_memory.check on made-up budgets: a machine's free host memory is shared by the ranks on it (2 ranks on
    one machine with 30 B each have 15 B per rank: refused at 20 B pinned; each alone on its machine with 30 B: it
    fits); a rank without a device budget skips the check, said in one line; a host memory nobody could read is not
    checked, and the memory line says so."""
    import types

    import parallel.plan
    from parallel import budgets, preflight_memory
    from parallel.plan_totals import GB

    plan = types.SimpleNamespace(host=20.0, host_ple=0.0, peak=1.0, total=2.0)   # bytes (a Plan's fields)
    monkeypatch.setattr(parallel.plan, "memory_plan", lambda *a, **k: plan)
    mem = []
    args = types.SimpleNamespace(max_len=8, pack=True, mem_check=True, init_adapter=None)
    B = lambda r, machine, host=30.0, target="cuda": budgets.Budget(r, target, 10.0, "10 B (test)", host,
                                                                      "free (test)", machine)
    with pytest.raises(ValueError, match=r"more than the 1.5e-08 GB free per rank: 3e-08 GB free \(test\) on m1, "
                                         r"shared by 2 ranks"):   # (equal shares: no rank named)
        preflight_memory.check(args, None, None, [B(0, "m1"), B(1, "m1")], mem.append, tokens=8)
    preflight_memory.check(args, None, None, [B(0, "m1"), B(1, "m2")], mem.append, tokens=8)
    assert len(mem) == 1 and mem[0].startswith(f"memory: planned {2 / GB:.3g} GB per rank and {20 / GB:.3g} GB "
                                               "pinned host for the longest sample, 8 tokens, of 10 B (test)"), mem
    preflight_memory.check(args, None, None,
                           [B(0, "m1"), budgets.Budget(1, None, 0, "rank 1: OSError: x", 0, "", "m2")], mem.append)
    assert mem[1] == "memory check skipped: no memory budget on rank 1: OSError: x", mem
    preflight_memory.check(args, None, None, [B(0, "m1", host=float("inf"), target="cuda")], mem.append)
    assert mem[2].endswith("; free host memory free (test), not checked"), mem


def test_an_eval_sample_longer_than_training_is_planned_as_a_bound_that_only_warns(monkeypatch):
    """preflight_memory.check on made-up budgets and a plan of 2 B/token: an eval sample longer than every training one
    (evaluate.py gives it a row of its own) is planned at its length as training, an upper bound. Within the smallest
    rank's device memory nothing more is said; over it one warning line names both lengths, the forward-only
    evaluation and the fixes, and the run is never refused (not even where that plan's live tensors could not fit);
    the eval length is capped by --max-len as the samples are; no eval data, or a shorter one, plans nothing more."""
    import types

    import parallel.plan
    from parallel import budgets, preflight_memory

    planned = []
    def plan(margs, dims, a, *rest, **kw):
        planned.append(a.max_len)
        return types.SimpleNamespace(host=0, peak=2.0 * a.max_len, total=2.0 * a.max_len)   # bytes
    monkeypatch.setattr(parallel.plan, "memory_plan", plan)
    args = types.SimpleNamespace(max_len=8, pack=True, mem_check=True, init_adapter=None)
    B = lambda r, dev: budgets.Budget(r, "cuda", dev, f"{dev:g} B (test)", float("inf"), "free (test)", f"m{r}")
    ranks = [B(0, 20.0), B(1, 10.0)]   # (the smaller device decides, the same on every rank)

    def said(tokens, eval_tokens):
        mem = []
        preflight_memory.check(args, None, None, ranks, mem.append, tokens=tokens, eval_tokens=eval_tokens)
        return mem
    for ev in (None, 3, 4):   # no eval data, or none longer than training's: the training plan alone
        planned.clear()
        assert len(said(4, ev)) == 1 and planned == [4], (ev, planned)
    planned.clear()
    assert len(said(4, 5)) == 1 and planned == [4, 5], "5 tokens: 10 B, within the 10 B device: nothing said"
    got = said(4, 6)   # 12 B: over the device, whose live tensors alone are too (training's check would refuse)
    assert len(got) == 2 and got[0].startswith("memory: planned"), got
    assert got[1] == ("warning: the longest eval sample, 6 tokens, is longer than the longest training sample, 4 "
                      "tokens, and is evaluated in a row of its own; training planned at 6 tokens needs 1.2e-08 GB "
                      "per rank, more than 10 B (test) (rank 1's, the smallest of 2). Evaluation runs forward only "
                      "(no saved activations), so it needs less than this bound, but the first evaluation may run "
                      "out of memory: a shorter --max-len for the eval data (--max-len 4 cuts no training sample), "
                      "or --eval-split to hold out --data records of training's lengths"), got
    planned.clear()
    got = said(4, 100)   # cut to --max-len 8, as the eval samples are
    assert planned == [4, 8] and "the longest eval sample, 8 tokens," in got[1], (planned, got)


def test_chat_template_flag_travels_with_the_adapter_to_the_merge(assets, done, tmp_path, capsys):
    """--chat-template chatml in place of the checkpoint's template (which adds a default system prompt): the data are
    rendered with it (the run's data line is that of the chatml tokenizer's samples), the adapter folder carries it
    (chat_template.jinja), so does the adapter exported from the run's checkpoint, and the merge makes it the merged
    tokenizer's (AutoTokenizer reads it back) with its end-of-turn token among generation_config's eos ids; a run
    without the flag writes none. Refused before any weight is read: a resume without the template (runs keep its
    text: the same text from a file passes), --init-adapter from that adapter without it. An adapter that records no
    template under a --chat-template is said in a note line, not refused. (The run without the flag: the module's
    `done`.)"""
    from transformers import AutoTokenizer

    from data import load_jsonl, load_tokenizer, tokenize_records
    from data.templates import TEMPLATES
    from model.merged import merge
    from parallel import checkpoint_export

    a, b = done, str(tmp_path / "b")
    run(quick_argv(assets, b, "--steps", "1", "--chat-template", "chatml"))
    data = lambda out: json.load(open(os.path.join(out, "config.json")))["data_stats"]
    tok = load_tokenizer(assets["model"], TEMPLATES["chatml"])
    want = str(tokenize_records(load_jsonl(assets["data"]), tok, 64)[1])
    assert data(b) == want != data(a), (data(b), want, data(a))
    assert not os.path.exists(os.path.join(a, "adapter", "chat_template.jinja"))
    assert open(os.path.join(b, "adapter", "chat_template.jinja")).read() == TEMPLATES["chatml"]
    checkpoint_export.export(os.path.join(b, "ckpt"), str(tmp_path / "exported"))
    assert open(tmp_path / "exported" / "chat_template.jinja").read() == TEMPLATES["chatml"]
    merge(assets["model"], os.path.join(b, "adapter"), str(tmp_path / "merged"), quant="none", dtype=torch.float32)
    assert json.load(open(tmp_path / "merged" / "tokenizer_config.json"))["chat_template"] == TEMPLATES["chatml"]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "merged")).chat_template == TEMPLATES["chatml"]
    eos = json.load(open(tmp_path / "merged" / "generation_config.json"))["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos and tok.eos_token_id in eos, eos
    msg = startup_error(quick_argv(assets, b, "--steps", "2", "--resume", os.path.join(b, "ckpt")))
    assert "--chat-template: the checkpoint's run rendered its chats with --chat-template chatml, this run with the " \
        "model's own template (no --chat-template): pass --chat-template chatml" in msg, msg
    msg = startup_error(quick_argv(assets, a, "--steps", "4", "--resume", os.path.join(a, "ckpt"), "--chat-template",
                                   "chatml"))
    assert "rendered its chats with the model's own template (no --chat-template), this run with --chat-template " \
        "chatml: drop --chat-template" in msg, msg
    (tmp_path / "mine.jinja").write_text(TEMPLATES["chatml"] + " ")
    run(quick_argv(assets, str(tmp_path / "f"), "--steps", "1", "--chat-template", str(tmp_path / "mine.jinja")))
    msg = startup_error(quick_argv(assets, str(tmp_path / "f"), "--steps", "2", "--resume",
                                   str(tmp_path / "f" / "ckpt"), "--chat-template", "chatml"))
    assert f"rendered its chats with --chat-template {str(tmp_path / 'mine.jinja')!r} (" in msg and "pass " \
        "--chat-template with a file holding the text of args.chat_template_text in the checkpoint's meta.json" in msg
    (tmp_path / "same.jinja").write_text(TEMPLATES["chatml"])   # the same text under another name: the same run
    run(quick_argv(assets, b, "--steps", "2", "--resume", os.path.join(b, "ckpt"), "--chat-template",
                   str(tmp_path / "same.jinja")))
    msg = startup_error(quick_argv(assets, str(tmp_path / "c"), "--init-adapter", os.path.join(b, "adapter")))
    assert "the chat template in " in msg and "pass --chat-template " + os.path.join(b, "adapter") in msg, msg
    capsys.readouterr()   # the other way round, an adapter that records no template: said, not refused
    run(quick_argv(assets, str(tmp_path / "d"), "--steps", "1", "--chat-template", "chatml", "--init-adapter",
                   os.path.join(a, "adapter")))
    out = capsys.readouterr().out
    assert f"note: --init-adapter {os.path.join(a, 'adapter')} records no chat template" in out, out
    run(quick_argv(assets, str(tmp_path / "e"), "--steps", "1", "--init-adapter", os.path.join(a, "adapter")))
    assert "records no chat template" not in capsys.readouterr().out, "said without a --chat-template"


def test_a_dated_template_renders_the_runs_day_and_a_resume_on_a_later_day_keeps_it(assets, tmp_path, monkeypatch,
                                                                                      capsys):
    """A --chat-template that writes today's date (Llama 3.2/3.3's "Today Date" line): a run renders rank 0's day at
    its start, which config.json and the checkpoints keep (template_date); resumed two days later it renders that day
    again: the same key (its tokens come from the cache) and the same losses as the uninterrupted run (the same run's
    own, read before the resume). --template-date renders the date given (the data line of that date spelled out in
    the template); a resume with another date is refused before any weight is read, naming both. (--micro-batch 2.)"""
    import datetime

    from data import load_jsonl, load_tokenizer, store, tokenize_records
    from data.templates import TEMPLATES

    line = '{{ strftime_now("%A %d %B %Y") }}\n'
    (tmp_path / "dated.jinja").write_text(line + TEMPLATES["chatml"])
    argv = lambda out, *x: [*quick_argv(assets, out, "--chat-template", str(tmp_path / "dated.jinja"), *x),
                            "--data-cache", str(tmp_path / "cache")]
    spelled = lambda day: str(tokenize_records(load_jsonl(assets["data"]), load_tokenizer(assets["model"], line.replace(
        '{{ strftime_now("%A %d %B %Y") }}', datetime.date.fromisoformat(day).strftime("%A %d %B %Y"))
        + TEMPLATES["chatml"]), 64)[1])
    config = lambda out: json.load(open(os.path.join(out, "config.json")))
    monkeypatch.setattr(store, "today", lambda: "2026-12-01")
    part = str(tmp_path / "part")
    run(argv(part, "--steps", "3", "--save-every", "1", "--keep-ckpts", "3"))
    out = capsys.readouterr().out
    assert "rendered as 2026-12-01 (--template-date" in out
    full = config(part)   # the uninterrupted run's (before the resume below rewrites it)
    logged = json.loads(next(ln for ln in out.splitlines() if ln.startswith("config: "))[len("config: "):])
    assert logged == {k: v for k, v in full.items() if k not in ("layout", "data_stats", "cwd")}, "not it"
    assert full["template_date"] == "2026-12-01" and full["data_stats"] == spelled("2026-12-01")
    uninterrupted = [r["loss"] for r in metrics(part)]
    monkeypatch.setattr(store, "today", lambda: "2026-12-03")   # two days later
    capsys.readouterr()
    run(argv(part, "--steps", "3", "--resume", os.path.join(part, "ckpt", "step_000002")))
    out = capsys.readouterr().out
    assert "rendered as 2026-12-01" in out and "tokens from the cache" in out, out
    assert [r["loss"] for r in metrics(part)] == uninterrupted, "the resume changed the math"
    run(argv(str(tmp_path / "given"), "--steps", "1", "--template-date", "2024-07-26"))
    (tmp_path / "spelled.jinja").write_text(line.replace('{{ strftime_now("%A %d %B %Y") }}', "Friday 26 July 2024")
                                            + TEMPLATES["chatml"])   # the same date, written into the template
    run([*quick_argv(assets, str(tmp_path / "spelled"), "--steps", "1", "--chat-template",
                     str(tmp_path / "spelled.jinja")), "--data-cache", "none"])
    losses = lambda out: [r["loss"] for r in metrics(out)]
    assert losses(tmp_path / "given") == losses(tmp_path / "spelled") != uninterrupted[:1], "not the date given"
    assert config(tmp_path / "given")["data_stats"] == spelled("2024-07-26")
    before = tree_hash(part)
    msg = startup_error(argv(part, "--steps", "3", "--resume", os.path.join(part, "ckpt"), "--template-date",
                             "2024-07-26"))
    assert "--template-date: the checkpoint has '2026-12-01', this run '2024-07-26'" in msg, msg
    assert tree_hash(part) == before
    undated = str(tmp_path / "undated")   # a template that writes no date keeps none, and a resume takes any
    run(quick_argv(assets, undated, "--steps", "2", "--save-every", "1", "--data-cache", "none"))
    assert config(undated)["template_date"] is None
    capsys.readouterr()
    run(quick_argv(assets, undated, "--steps", "2", "--resume", os.path.join(undated, "ckpt", "step_000001"),
                   "--template-date", "2024-07-26", "--data-cache", "none"))
    assert "note: --template-date 2024-07-26 changes nothing: the chat template writes no date" in \
        capsys.readouterr().out   # (until 2026-12-04 silent)
    meta = json.load(open(os.path.join(part, "ckpt", "step_000003", "meta.json")))   # an older run's checkpoint:
    del meta["args"]["template_date"], meta["args"]["data_tokens"]               # no template date, no tokens
    json.dump(meta, open(os.path.join(part, "ckpt", "step_000003", "meta.json"), "w"))
    capsys.readouterr()
    run(argv(part, "--steps", "4", "--resume", os.path.join(part, "ckpt", "step_000003")))
    assert "note: the checkpoint records no template date" in capsys.readouterr().out
    meta["args"]["data_tokens"] = full["data_tokens"]   # recorded, 2026-12-01's tokens: today renders 12-03
    json.dump(meta, open(os.path.join(part, "ckpt", "step_000003", "meta.json"), "w"))
    msg = startup_error(argv(part, "--steps", "4", "--resume", os.path.join(part, "ckpt", "step_000003")))
    assert "trained on other tokens" in msg and "the date a dated chat template writes (pass --template-date with " \
           "the day the checkpoint's run started)" in msg, msg


def test_long_text_is_run_defining_and_a_checkpoint_from_before_it_resumes_unless_it_splits(assets, done, tmp_path,
                                                                                            capsys):
    """--long-text split (the default) on text records past --max-len: the data line counts the split records and
    their windows, config.json records the flag, and a resume with --long-text truncate is refused before any weight
    is read, naming both values. A checkpoint from before the flag (it truncated): a resume that would split records
    is refused naming --long-text truncate, and with it resumes as the uninterrupted truncating run; one whose data
    split nothing (chat records) resumes with the default, unless its --eval-data would split (the eval loss, and
    --keep-best's best, would be measured on other samples)."""
    text = ["--data", assets["text"]]
    out = str(tmp_path / "split")
    run(quick_argv(assets, out, *text, "--steps", "2", "--save-every", "1"))
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if x.startswith("data: "))
    assert " split " in line and " windows" in line and "truncated 0" in line, line
    assert json.load(open(os.path.join(out, "config.json")))["long_text"] == "split"
    step1 = os.path.join(out, "ckpt", "step_000001")
    msg = startup_error(quick_argv(assets, out, *text, "--steps", "2", "--resume", step1, "--long-text", "truncate"))
    assert "--long-text: the checkpoint has 'split', this run 'truncate'" in msg, msg
    old = str(tmp_path / "old")   # a run that truncated, its checkpoints made to look as from before the flag
    run(quick_argv(assets, old, *text, "--steps", "2", "--save-every", "1", "--long-text", "truncate"))
    full = metrics(old)
    meta_path = os.path.join(old, "ckpt", "step_000001", "meta.json")
    meta = json.load(open(meta_path))
    del meta["args"]["long_text"], meta["args"]["data_tokens"]
    json.dump(meta, open(meta_path, "w"))
    msg = startup_error(quick_argv(assets, old, *text, "--steps", "2", "--resume", os.path.dirname(meta_path)))
    assert "from before --long-text" in msg and "Pass --long-text truncate to continue it" in msg, msg
    run(quick_argv(assets, old, *text, "--steps", "2", "--resume", os.path.dirname(meta_path), "--long-text",
                   "truncate"))
    assert metrics(old) == [{**m, **{k: r[k] for k in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
                                                        "peak_mem_gb")}} for m, r in zip(full, metrics(old))], \
        "the resume changed the math"
    chat = str(tmp_path / "chat")   # nothing to split: a checkpoint from before the flag resumes as it is
    shutil.copytree(done, chat)   # (the module's 4-step run on the chat data)
    meta_path = os.path.join(chat, "ckpt", "step_000002", "meta.json")
    meta = json.load(open(meta_path))
    del meta["args"]["long_text"]
    json.dump(meta, open(meta_path, "w"))
    msg = startup_error(quick_argv(assets, chat, "--steps", "4", "--resume", os.path.dirname(meta_path),
                                   "--eval-data", assets["text"]))   # but its eval data would be other samples
    assert "from before --long-text" in msg and "--data/--eval-data" in msg, msg
    run(quick_argv(assets, chat, "--steps", "4", "--resume", os.path.dirname(meta_path)))
    assert [m["step"] for m in metrics(chat)] == [1, 2, 3, 4]


def test_device_memory_other_processes_hold_is_not_counted(monkeypatch):
    """budgets.device_budget on a made-up CUDA device of 141 GB: with this process's context alone in use (0.8 GB)
    the budget is the device's total; with another job holding 29.8 GB more it is 141 - (30.8 - 1.0 RUNTIME) GB and says
    so, naming the device and its PCI bus; --gpu-mem plans that memory as given; a torch without cudaMemGetInfo gives
    the total. preflight_memory.check then refuses a plan that fits the total but not that."""
    import argparse
    import types

    import torch

    import parallel.plan
    from parallel import budgets, preflight_memory
    from parallel.plan_totals import GB, RUNTIME

    total, used = 141e9, [0.8e9]
    fake = dict(is_available=lambda: True, current_device=lambda: 0, get_device_name=lambda *a: "H200 (test)",
                get_device_properties=lambda d: types.SimpleNamespace(total_memory=int(total), pci_bus_id=0x1B),
                mem_get_info=lambda d=None: (int(total - used[0]), int(total)), memory_reserved=lambda d=None: 0)
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    args = argparse.Namespace(gpu_mem=None)
    assert budgets.device_budget(args, 1) == ("cuda", total, "141.0 GB per GPU (H200 (test))")
    used[0] = 30.8e9
    target, mem, where = budgets.device_budget(args, 1)
    assert (target, mem) == ("cuda", total - (30.8e9 - RUNTIME["cuda"])), mem
    assert where == ("141.0 GB per GPU (H200 (test)), less 29.8 GB in use outside this process's allocator now on "
                     "cuda:0 (PCI bus 1B), 110.2 GB free: other processes (nvidia-smi names them) or more than the "
                     "planned runtime of this one's own"), where
    assert budgets.device_budget(argparse.Namespace(gpu_mem=80), 1)[1:] == (80 * GB, "80.0 GB per GPU (--gpu-mem)")
    def no_query(d=None):
        raise RuntimeError("no cudaMemGetInfo here")
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_query)
    assert budgets.device_budget(args, 1)[1] == total
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake["mem_get_info"])
    plan = types.SimpleNamespace(host=0, peak=120e9, total=120e9 * 1.1 + RUNTIME["cuda"])   # fits 141 GB, not 111
    monkeypatch.setattr(parallel.plan, "memory_plan", lambda *a, **k: plan)
    monkeypatch.setattr("parallel.plan_search._fixes", lambda *a: [])
    run = types.SimpleNamespace(max_len=8, pack=True, mem_check=True, init_adapter=None)
    with pytest.raises(ValueError, match=r"is more than 141.0 GB per GPU \(H200 \(test\)\), less 29.8 GB in use "
                                         r"outside this process's allocator now on cuda:0.*It cannot fit"):
        preflight_memory.check(run, None, None, [budgets.Budget(0, target, mem, where, float("inf"), "", "m")], print)


def test_host_memory_free_is_the_lower_of_the_machine_and_its_cgroup(tmp_path, monkeypatch):
    """budgets.cgroup_headroom on made-up cgroup trees: a limit less usage net of page cache (not shmem), the least
    over the process's own cgroup and every parent up to the root (v2: a limit on the job, the step's unlimited, as
    Slurm sets them; v1's memory controller likewise); "max" and v1's unlimited value are no limit; usage over the
    limit is no room, not a negative one; no cgroup files at all: None. host_available takes it when below psutil's.
    A CPU run's device memory (plan_search._budget): the least cgroup limit over the local ranks, when below the RAM."""
    from parallel import budgets

    def tree(name, files):
        for path, text in files.items():
            (tmp_path / name / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / path).write_text(text)
        return str(tmp_path / name / "cg"), str(tmp_path / name / "proc")

    v2 = {"proc": "0::/job/step\n", "cg/memory.max": "1000000\n", "cg/memory.current": "600000\n",
          "cg/memory.stat": "anon 5\nfile 100000\nshmem 20000\nfile_mapped 7 8\n",
          "cg/job/memory.max": "800000\n", "cg/job/memory.current": "700000\n",   # the job's limit, no stat
          "cg/job/step/memory.max": "max\n", "cg/job/step/memory.current": "650000\n"}
    assert budgets.cgroup_headroom(*tree("v2", v2)) == 800000 - 700000
    v2["cg/job/memory.max"] = "max\n"   # then the root's: limit less usage net of page cache not in shmem
    assert budgets.cgroup_headroom(*tree("v2", v2)) == 1000000 - (600000 - (100000 - 20000))
    over = {"proc": "0::/\n", "cg/memory.max": "1000\n", "cg/memory.current": "5000\n"}
    assert budgets.cgroup_headroom(*tree("over", over)) == 0
    unlimited = {"proc": "0::/job\n", "cg/memory.max": "max\n", "cg/job/memory.max": "max\n",
                 "cg/job/memory.current": "1\n"}
    assert budgets.cgroup_headroom(*tree("unlimited", unlimited)) is None
    v1 = {"proc": "4:memory:/slurm/job_1/task_0\n1:name=systemd:/x\n0::/\n",
          "cg/memory/memory.limit_in_bytes": "9223372036854771712\n", "cg/memory/memory.usage_in_bytes": "5\n",
          "cg/memory/slurm/job_1/memory.limit_in_bytes": "3000\n",
          "cg/memory/slurm/job_1/memory.usage_in_bytes": "2500\n",
          "cg/memory/slurm/job_1/memory.stat": "total_cache 600\ntotal_shmem 100\n",
          "cg/memory/slurm/job_1/task_0/memory.limit_in_bytes": "9223372036854771712\n",
          "cg/memory/slurm/job_1/task_0/memory.usage_in_bytes": "2400\n"}
    assert budgets.cgroup_headroom(*tree("v1", v1)) == 3000 - (2500 - 500)
    assert budgets.cgroup_headroom(*tree("v1", v1), limit=True) == 3000   # the least limit, for a CPU run's budget
    assert budgets.cgroup_headroom(str(tmp_path / "none"), str(tmp_path / "none")) is None

    # a CPU run's memory: RAM over the local ranks, or the job's cgroup limit over them when that is lower
    from parallel import plan_search
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # (the CPU branch, on any machine)
    monkeypatch.setattr(budgets, "cgroup_headroom", lambda limit=False: 4e9 if limit else None)
    target, mem, where = plan_search._budget(argparse.Namespace(gpu_mem=None), 2)
    assert (target, mem) == ("cpu", 2e9) and "this job's memory cgroup limit (4.0 GB" in where, where
    monkeypatch.setattr(budgets, "cgroup_headroom", lambda limit=False: None)
    import psutil
    assert plan_search._budget(argparse.Namespace(gpu_mem=None), 2)[1] == psutil.virtual_memory().total / 2

    import psutil
    monkeypatch.setattr(budgets, "cgroup_headroom", lambda: 5)
    assert budgets.host_available() == (5.0, "left under this job's memory cgroup limit")
    monkeypatch.setattr(budgets, "cgroup_headroom", lambda: None)
    free, where = budgets.host_available()
    assert where == "available (psutil)" and abs(free - psutil.virtual_memory().available) < 4 * 2 ** 30   # (workers)


def test_keep_best_keeps_the_lowest_eval_checkpoint_through_rotation_and_resume(assets, tmp_path, capsys):
    """--keep-best with --keep-ckpts 1 and an eval every step (trained to answer "yes ...", evaluated on "no ...": the
    eval loss rises again after its low): the step of the lowest eval loss in metrics.jsonl keeps its checkpoint
    beside the newest, and OUT/adapter_best holds that checkpoint's adapter (= `python -m parallel.checkpoint` of it,
    bit for bit; not the final adapter). Resumed from that step and trained to the end again, the run carries the
    best in the checkpoint (a fresh best would take the next, worse eval and rotate the best away): the same folders,
    losses and best adapter. Resumed onto other --eval-data, or into another --out, the best is chosen anew (said);
    resumed without the flag, no step is protected; a leftover adapter_best.old-export is cleared. --overwrite
    removes an old adapter_best; the flag without --eval-every is refused before any weight is read. (The run resumed
    is a copy of the first, the same deterministic run; other --eval-data is 10 training records; --micro-batch 2;
    4 steps: the lowest eval loss comes before the last, as asserted.)"""
    from safetensors.torch import load_file

    from parallel import checkpoint_export

    for word, n in (("yes", 24), ("no", 8)):
        with open(tmp_path / f"{word}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}: say it"},
                                                 {"role": "assistant", "content": " ".join([word] * 6)}]}) + "\n")
    flags = ("--steps", "4", "--eval-every", "1", "--eval-data", str(tmp_path / "no.jsonl"), "--keep-best",
             "--keep-ckpts", "1", "--lr", "0.5", "--data", str(tmp_path / "yes.jsonl"))   # (no default --data)
    full = str(tmp_path / "full")
    run(quick_argv(assets, full, *flags))
    evals = [(r["eval_loss"], r["step"]) for r in metrics(full)]
    b = min(evals)[1]
    assert b != 4, f"the eval loss fell to the last step {evals}: no rotation to protect the best from"
    assert f"best: eval_loss {min(evals)[0]:.6f} at step {b}" in capsys.readouterr().out
    steps = lambda out: sorted(os.listdir(os.path.join(out, "ckpt")))
    assert steps(full) == sorted(["latest", f"step_{b:06d}", "step_000004"]), steps(full)
    tensors = lambda d: load_file(os.path.join(d, "adapter_model.safetensors"))
    checkpoint_export.export(os.path.join(full, "ckpt", f"step_{b:06d}"), str(tmp_path / "exported"))
    best, exported, final = (tensors(os.path.join(full, "adapter_best")), tensors(tmp_path / "exported"),
                             tensors(os.path.join(full, "adapter")))
    assert best.keys() == exported.keys() and all(torch.equal(best[k], exported[k]) for k in best), "not step b's"
    assert any(not torch.equal(best[k], final[k]) for k in best), "adapter_best is the final adapter"
    part = str(tmp_path / "part")
    shutil.copytree(full, part)   # (the same run again, bit for bit: copied, not rerun)
    run(quick_argv(assets, part, *flags, "--resume", os.path.join(part, "ckpt", f"step_{b:06d}")))   # back to b
    assert [r["loss"] for r in metrics(part)] == [r["loss"] for r in metrics(full)], "the resume changed the math"
    assert steps(part) == steps(full), (steps(part), "the resume lost the best")
    again = tensors(os.path.join(part, "adapter_best"))
    assert all(torch.equal(again[k], best[k]) for k in best), "the resumed run's best adapter differs"
    os.makedirs(os.path.join(part, "adapter_best.old-export"))   # a swap killed halfway, and other eval data
    open(os.path.join(part, "adapter_best.old-export", "x"), "w").close()
    capsys.readouterr()
    run(quick_argv(assets, part, *[eval_head(assets) if x == str(tmp_path / "no.jsonl") else x for x in flags],
                   "--resume", os.path.join(part, "ckpt", f"step_{b:06d}")))   # (another --eval-data)
    out = capsys.readouterr().out
    assert f"the checkpoint's best (step {b}, eval_loss {min(evals)[0]:.6f}) was measured on other --eval-data" in out
    new = min((r["eval_loss"], r["step"]) for r in metrics(part) if r["step"] > b)
    assert f"best: eval_loss {new[0]:.6f} at step {new[1]}" in out and steps(part) == sorted(
        {"latest", f"step_{new[1]:06d}", "step_000004"}), (steps(part), new)
    assert not os.path.exists(os.path.join(part, "adapter_best.old-export")), "a leftover swap folder stayed"
    other = str(tmp_path / "other")   # a resume into a new --out: the best lies in another run's folder
    run(quick_argv(assets, other, *flags, "--resume", os.path.join(full, "ckpt", f"step_{b:06d}")))
    assert "is in another run folder: the best is chosen among this run's evaluations" in capsys.readouterr().out
    run(quick_argv(assets, full, "--steps", "4", "--keep-ckpts", "1", "--data", str(tmp_path / "yes.jsonl"),
                   "--lr", "0.5", "--resume", os.path.join(full, "ckpt", f"step_{b:06d}")))   # no --keep-best
    assert steps(full) == ["latest", "step_000004"], (steps(full), "a run without --keep-best protected a step")
    run(quick_argv(assets, part, "--steps", "1", "--overwrite"))
    assert not os.path.exists(os.path.join(part, "adapter_best")), "--overwrite left another run's best adapter"
    msg = startup_error(train_argv(assets, str(tmp_path / "no_every"), "--keep-best", "--eval-data", assets["data"]))
    assert "--keep-best keeps the checkpoint of the lowest eval loss, saved at each evaluation, but --eval-every 0 " \
           "evaluates only at the end: pass --eval-every N" in msg and "no evaluation data" not in msg, msg
    msg = startup_error(train_argv(assets, str(tmp_path / "no_eval"), "--keep-best"))
    assert "but it has no evaluation data: pass --eval-data FILE (or --eval-split); --eval-every 0 evaluates only " \
           "at the end" in msg, msg


def test_a_tokenizer_without_pad_or_eos_pads_chat_rows_with_id_0(assets, tmp_path):
    """A tokenizer with neither a pad nor an EOS token (chat data needs neither: the template writes the turns' end)
    crashed in step 1, after the model was built (`torch.full(..., None)` in collate). Padding is never a target and
    follows the row's real tokens, so id 0 pads: the losses equal the run padding with EOS."""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": None, "pad_token": None}))
    flags = ("--no-pack", "--micro-batch", "4", "--steps", "2")
    run(train_argv(assets, str(tmp_path / "eos"), *flags))
    run([*train_argv({**assets, "model": str(model)}, str(tmp_path / "none"), *flags), "--data-cache", "none"])
    want = [r["loss"] for r in metrics(str(tmp_path / "eos"))]
    assert [r["loss"] for r in metrics(str(tmp_path / "none"))] == want


def test_a_resume_refuses_a_base_model_changed_at_its_path(assets, tmp_path):
    """The base's path was all a resume compared: an edited config.json (rope_theta, rms_norm_eps) or other weights
    of the same shapes written in place resumed silently onto another model (until 2026-12-03). The run records
    model_sha256 (config.json, the weight files' sizes, headers and first and last MB); a resume compares it."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    base = {**assets, "model": str(model)}
    out = str(tmp_path / "out")
    run(quick_argv(base, out, "--steps", "1"))
    again = [*quick_argv(base, out, "--steps", "2"), "--resume", os.path.join(out, "ckpt")]
    cfg = (model / "config.json").read_text()
    (model / "config.json").write_text(json.dumps({**json.loads(cfg), "rms_norm_eps": 1e-2}))
    with pytest.raises(ValueError, match=r"--model's files \(config.json.*the base at that path changed.*"
                                         r"--init-adapter\): the checkpoint has '[0-9a-f]{64}', this run "):
        run(again)
    (model / "config.json").write_text(cfg)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    save_file({k: v.flip(0).contiguous() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"--model's files"):
        run(again)
    save_file(tensors, weights, metadata={"format": "pt"})   # the same weights again: it resumes
    run(again)
    assert [r["step"] for r in metrics(out)] == [1, 2]
    # files beside the weights the loader never reads (until 2026-12-04 in the record, and checked at start-up): a
    # sharded base's consolidated.safetensors left as a Git LFS pointer, a pytorch_model.bin deleted to free disk
    from model.hub import model_fingerprint
    os.rename(weights, model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}))
    (model / "pytorch_model.bin").write_bytes(b"an unused copy")
    (model / "consolidated.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    out2 = str(tmp_path / "out2")
    run(quick_argv(base, out2, "--steps", "1"))   # (the pointer is never read)
    (model / "pytorch_model.bin").unlink()
    run([*quick_argv(base, out2, "--steps", "2"), "--resume", os.path.join(out2, "ckpt")])
    assert [r["step"] for r in metrics(out2)] == [1, 2]
    # a run of 2026-12-03 recorded every weight-like file (every_file): the same files resume, and keep that record
    (model / "pytorch_model.bin").write_bytes(b"an unused copy")
    old = model_fingerprint(str(model), every_file=True)
    assert old != model_fingerprint(str(model))
    meta_path = os.path.join(out2, "ckpt", "step_000002", "meta.json")
    meta = json.loads(open(meta_path).read())
    meta["args"]["model_sha256"] = old
    open(meta_path, "w").write(json.dumps(meta))
    run([*quick_argv(base, out2, "--steps", "3"), "--resume", os.path.join(out2, "ckpt")])
    assert json.loads(open(os.path.join(out2, "adapter", "trained_on.json")).read())["model_sha256"] == old


def test_a_save_into_a_folder_made_unwritable_mid_run_is_one_line(assets, tmp_path, monkeypatch, capsys):
    """A run's folder made unwritable mid-run (a permission, not a full disk) stopped a save with a traceback and exit
    1; it is said in one line that names the save, as a full disk's is, with the way on (review, helper 54). Rank 0's
    own error names what it was doing too (it said only "[Errno 28] No space left on device" at `latest`)."""
    import train
    from parallel import checkpoint

    out = tmp_path / "out"
    real = checkpoint._fsync_write

    def refused(path, text):
        if "step_000002" in path:
            raise PermissionError(13, "Permission denied", path)
        return real(path, text)

    monkeypatch.setattr(checkpoint, "_fsync_write", refused)
    capsys.readouterr()
    with one_thread():
        code = train.cli(quick_argv(assets, str(out), "--save-every", "1"))
    said = capsys.readouterr().err
    meta = os.path.join(str(out), "ckpt", ".tmp-step_000002", "meta.json")
    assert code == 2 and said.startswith(f"error: saving checkpoint step 2 failed (PermissionError: [Errno 13] "
                                         f"Permission denied: {meta!r}). Free space (or fix the folder), then run "
                                         f"the same command with --resume {out / 'ckpt'}"), said
    assert "Traceback" not in said and (out / "ckpt" / "latest").read_text().strip() == "step_000001"
