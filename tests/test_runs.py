"""parallel/runs.py and parallel/outdir.py: a run never writes into another run's results, resume keeps the run's math,
metrics.jsonl stays strict JSON and matches the checkpoint it resumes from.

Pins:
- fresh directories are unique even for runs started in the same second;
- a used `--out` is refused unless --resume/--overwrite; `--out` naming a file, --overwrite of a
  directory that is not a run's, --resume from outside a used --out: refused, every file byte-identical;
- --overwrite deletes exactly the run's own entries (a symlink is removed, never followed);
- a live run's lock refuses a second run (a real second process holds it), a stale lock file does not;
- on 2 gloo ranks, `claim` gives both ranks the same fresh path, and a refusal is raised on both;
- on 2 gloo ranks, a finished train.main lets go of OUT's lock before any rank returns (rank 0 slow to): a --resume of
  it and a run into the same --out with --overwrite, next in the same job, start on both ranks;
- `check_resume` names the flag, the checkpoint's value and the new one; layout flags may change;
- metrics.MetricsLog writes null for NaN/Inf (kind under "nonfinite"), and on resume drops lines past the step.

Run: .venv/bin/python -m pytest -q tests/test_runs.py
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from parallel import metrics, outdir, resume, runs
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hashes(root) -> dict:
    """path -> sha256 of every file (and symlink target) under root: 'byte-identical' made checkable."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            if os.path.islink(p):
                out[p] = "link:" + os.readlink(p)
            elif os.path.isfile(p):
                out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _used_run(path):
    """A directory as a finished run leaves it."""
    os.makedirs(os.path.join(path, "ckpt", "step_000002"))
    os.makedirs(os.path.join(path, "adapter"))
    open(os.path.join(path, "ckpt", "latest"), "w").write("step_000002")
    open(os.path.join(path, "ckpt", "step_000002", "meta.json"), "w").write('{"step": 2}')
    open(os.path.join(path, "adapter", "adapter_model.safetensors"), "wb").write(b"\x00" * 64)
    open(os.path.join(path, "config.json"), "w").write('{"global_batch": 8, "lora_r": 16}')
    open(os.path.join(path, "metrics.jsonl"), "w").write("".join(
        json.dumps({"step": k, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-4}) + "\n" for k in (1, 2)))
    return str(path)


def _refused(fn, *phrases, kind=ValueError):
    with pytest.raises(kind) as e:
        fn()
    for p in phrases:
        assert p in str(e.value), f"{p!r} not in {str(e.value)!r}"
    return str(e.value)


def test_fresh_dirs_unique_in_the_same_second(tmp_path):
    root = str(tmp_path / "runs")
    made = [runs.fresh_dir(root, now=1_700_000_000.0) for _ in range(3)]
    assert len(set(made)) == 3, made
    assert all(os.path.isdir(p) and not os.listdir(p) for p in made), made
    assert made[1] == made[0] + "-2", made


def test_used_out_refused_and_untouched(tmp_path):
    out, other = _used_run(tmp_path / "run"), _used_run(tmp_path / "other")
    (tmp_path / "afile").write_text("x")
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    crashed = tmp_path / "crashed"   # a run killed before its first checkpoint was whole
    (crashed / "ckpt" / ".tmp-step_000001").mkdir(parents=True)
    (crashed / "config.json").write_text('{"global_batch": 8}')
    before = _hashes(tmp_path)
    msg = _refused(lambda: runs.claim(out), f"--out {out!r} already holds a run", f"--resume {out}/ckpt",
                   "--overwrite")
    msg = _refused(lambda: runs.claim(str(foreign)), f"--out {str(foreign)!r}", "cat.jpg", "not a train.py run")
    assert "--resume" not in msg and "--overwrite" not in msg, f"a user's folder was offered a flag that fails: {msg}"
    msg = _refused(lambda: runs.claim(str(crashed)), "already holds a run", "saved no checkpoint", "--overwrite")
    assert "--resume" not in msg, msg
    _refused(lambda: outdir.check_out(out, resume=os.path.join(out, "ckpt"), overwrite=True), "pass only one")
    _refused(lambda: runs.claim(out, resume=os.path.join(other, "ckpt")), "would mix two runs")
    # another run inside a used --out: nested below it, or --out a folder above it holding the user's own files
    # (until 2026-12-05 anything under --out resumed there and wrote over its config, metrics, ckpt and adapter;
    # review, helper 46)
    nested = _used_run(tmp_path / "run" / "sub")
    above = tmp_path / "above"
    _used_run(above / "runs" / "x")
    (above / "config.json").write_text('{"mine": 1}')
    before = _hashes(tmp_path)
    for o, r, theirs in ((out, os.path.join(nested, "ckpt"), nested),
                         (out, os.path.join(nested, "ckpt", "step_000002"), nested),
                         (str(above), str(above / "runs" / "x" / "ckpt"), str(above / "runs" / "x"))):
        _refused(lambda o=o, r=r: runs.claim(o, resume=r), f"--out {o!r} already holds files", "is not one of its "
                 f"own checkpoints ({o}/ckpt): resuming there would mix two runs' results and write over those files",
                 f"Pass --out {theirs} to continue that run")
    assert _hashes(tmp_path) == before
    for r in ("ckpt", os.path.join("ckpt", "step_000002")):   # its own: through a link to --out too
        outdir.check_out(out, resume=os.path.join(out, r))
    # the run folder itself, or a file in it, as --resume: its ckpt is named (review, helper 54: "would mix two runs'
    # results ... pass a new --out", which led away from the fix)
    for r, what in ((out, "the run folder"), (out + "/", "the run folder"),
                    (os.path.join(out, "config.json"), "a file in the run folder"),
                    (os.path.join(out, "adapter"), "the run's exported adapter in")):
        msg = _refused(lambda r=r: outdir.check_out(out, resume=r), f"--resume {r!r} is {what} {out!r}, not a "
                       f"checkpoint: pass --resume {os.path.join(out, 'ckpt')} (its newest step)")
        assert "mix two runs" not in msg, msg
    os.symlink(out, tmp_path / "link")
    outdir.check_out(str(tmp_path / "link"), resume=os.path.join(out, "ckpt", "step_000002"))
    shutil.rmtree(nested)
    os.remove(tmp_path / "link")
    _refused(lambda: runs.claim(str(tmp_path / "afile")), "is a file", "directory")
    _refused(lambda: runs.claim(str(tmp_path / "afile" / "sub")), "--out",
             "is a file, so no directory can be made under it")
    _refused(lambda: runs.claim(str(foreign), overwrite=True), "--overwrite refuses", "cat.jpg",
             "not a train.py run directory")
    # another tool's project folder with train.py's names in it (until 2026-12-03 --overwrite deleted its ckpt/ and
    # config.json): each name must hold what train.py writes, and one must say so
    project = tmp_path / "project"
    (project / "ckpt" / "epoch_3").mkdir(parents=True)
    (project / "ckpt" / "epoch_3" / "model.ckpt").write_text("w")
    (project / "config.json").write_text('{"experiment": "sweep-7"}')
    (project / "notes.txt").write_text("notes")
    other_tool = tmp_path / "other_tool"   # only another tool's metrics.jsonl
    other_tool.mkdir()
    (other_tool / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.9}\n')
    logger = tmp_path / "logger"   # another logger's step records, beside another trainer's adapter (until 2026-12-04
    (logger / "adapter").mkdir(parents=True)   # a "step" key made it a run: --overwrite deleted both)
    (logger / "adapter" / "adapter_config.json").write_text("{}")
    (logger / "metrics.jsonl").write_text('{"step": 100, "train/loss": 1.23}\n')
    empty_ckpt = tmp_path / "empty_ckpt"
    (empty_ckpt / "ckpt").mkdir(parents=True)
    before = _hashes(tmp_path)
    for folder, why in ((project, "its config.json is not train.py's"), (other_tool, "metrics.jsonl is not train.py's"),
                        (logger, "metrics.jsonl is not train.py's"), (empty_ckpt, "holds anything train.py wrote")):
        for overwrite in (True, False):
            msg = _refused(lambda f=str(folder), o=overwrite: runs.claim(f, overwrite=o), why,
                           "not a train.py run directory")
            assert "--overwrite to" not in msg and "--resume" not in msg, msg
    assert _hashes(tmp_path) == before, "a refusal changed files"
    (project / "config.json").write_text('{"global_batch": 8}')   # train.py's config, a foreign ckpt/ entry
    before = _hashes(tmp_path)
    _refused(lambda: runs.claim(str(project), overwrite=True), "ckpt folder holds epoch_3, which train.py never writes")
    assert _hashes(tmp_path) == before, "a refusal changed files"


def test_out_is_checked_where_it_is_written(tmp_path):
    """--out is checked as the directory it names on disk (found by review, 2026-12-04): 'DIR/new/..' is DIR once new/
    is made, and was taken for a fresh directory: train.py wrote its config.json over the user's. An empty --out (an
    unset variable) and a parent that is a dangling link are refused at once (the latter failed after the data were
    read). A step_1 folder in a run's ckpt/ (a user's export there) is not train.py's: --overwrite leaves the run."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text('{"mine": 1}')
    (user / "notes.txt").write_text("notes")
    before = _hashes(tmp_path)
    for overwrite in (False, True):
        _refused(lambda o=overwrite: runs.claim(str(user / "typo" / ".."), overwrite=o),
                 "its config.json is not train.py's", "not a train.py run directory")
    _refused(lambda: outdir.check_out(""), "--out is empty")
    _refused(lambda: outdir.check_out("~/runs/x"), "'~/runs/x' starts with a '~' no shell expanded",
             f"pass --out {os.path.expanduser('~/runs/x')}")   # (--out=~/runs/x: made ./~/runs/x)
    os.symlink(str(tmp_path / "nowhere"), str(tmp_path / "dang"))
    _refused(lambda: outdir.check_out(str(tmp_path / "dang" / "sub")), f"{str(tmp_path / 'dang')!r} is a link to",
             "which does not exist")
    out = _used_run(tmp_path / "run")
    (tmp_path / "run" / "ckpt" / "step_1" / "adapter").mkdir(parents=True)   # a user's export
    os.makedirs(os.path.join(out, "ckpt", "step_0000001"))   # 7 digits: not a name train.py gives step 1
    before = _hashes(tmp_path)
    _refused(lambda: runs.claim(out, overwrite=True), "ckpt folder holds step_0000001, step_1, which train.py never "
             "writes")
    assert _hashes(tmp_path) == before, "a refusal changed files"
    with runs.claim(str(tmp_path / "run" / "ckpt" / ".." / ".." / "fresh")) as rd:   # (a path through '..' is fine)
        assert os.path.isdir(rd.path) and os.listdir(tmp_path / "fresh") == ["run.lock"]


def test_out_inside_what_another_run_owns_is_refused(tmp_path):
    """An --out inside another run's ckpt/ (its step folders rotate away), adapter/ (swapped whole at each export) or
    another entry it owns is refused before anything is written (review, helper 80: a run
    there was accepted, then deleted by the other run's rotation without a word; the export's and the merge's:
    test_train_runs, test_export). Beside them, or in a folder of the run that it does not own, it is not; nor is a
    folder named like a run's entry in a folder that is no run."""
    run = _used_run(tmp_path / "run")
    os.symlink(os.path.join(run, "adapter"), tmp_path / "link")   # (through a link too)
    before = _hashes(tmp_path)
    for inside in (os.path.join(run, "ckpt", "step_000002", "b"), os.path.join(run, "ckpt"),
                   os.path.join(run, "adapter", "x"), os.path.join(run, "tensorboard", "x")):
        entry = os.path.join(run, os.path.relpath(inside, run).split(os.sep)[0])
        msg = _refused(lambda o=inside: outdir.check_out(o), f"--out {inside!r} is ", f"{entry!r}, which the train.py "
                       f"run {run!r} owns")
        assert ("inside " in msg) == (inside != entry), msg
    _refused(lambda: outdir.check_out(str(tmp_path / "link" / "y")), "which the train.py run")
    assert _hashes(tmp_path) == before, "a refusal changed files"
    for fine in (os.path.join(run, "mine", "x"), str(tmp_path / "beside"), str(tmp_path / "notarun" / "ckpt" / "x")):
        outdir.check_out(fine)


def test_out_this_user_cannot_write_in_is_refused_at_once(tmp_path):
    """An --out (or, without one, runs/) in a directory this user cannot write in was refused only by claim(), after
    the data were tokenized (review, helper 53). /proc takes no new entry even from root, whom os.access passes."""
    for out in ("/proc/run", "/proc/a/b/run"):
        _refused(lambda o=out: outdir.check_out(o), f"--out {out!r}: this user cannot write in '/proc'",
                 "pass an --out you can write to")
    _refused(lambda: outdir.check_out(None, root="/proc/runs"), "no --out given, so this run would make "
             "'/proc/runs/<date-time>': this user cannot write in '/proc'", "pass --out with a directory")
    outdir.check_out(str(tmp_path / "new" / "run"))
    outdir.check_out(None, root=str(tmp_path / "runs"))
    assert os.listdir(tmp_path) == [], "the probe left something behind"
    # another rank's probe, there while this one lists the folder (or one a kill left), is not a file of the user's
    # (review, helper 56: `mkdir -p OUT` then 8 ranks: refused on some, in 4 of 40 tries)
    (tmp_path / "out" / ".train-probe-abc123").mkdir(parents=True)
    outdir.check_out(str(tmp_path / "out"))
    with runs.claim(str(tmp_path / "out")):
        pass


def test_overwrite_removes_exactly_the_run(tmp_path):
    out = _used_run(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    keep = tmp_path / "elsewhere"
    keep.mkdir()
    (keep / "precious.bin").write_bytes(b"1234")
    os.rename(os.path.join(out, "adapter"), str(tmp_path / "adapter_real"))
    os.symlink(str(keep), os.path.join(out, "adapter"))   # adapter -> a folder outside OUT
    with runs.claim(out, overwrite=True) as rd:   # (deleted by clear(): train.py's open_files, once the model is built)
        assert rd.pending == ("adapter", "ckpt", "metrics.jsonl", "config.json"), rd.pending
        assert len(os.listdir(out)) == 6 and rd.ours is None, "the claim deleted before the run had its model"
        rd.clear()
        assert sorted(os.listdir(out)) == ["notes.txt", "run.lock"] and rd.ours == out, os.listdir(out)
    assert (keep / "precious.bin").read_bytes() == b"1234", "overwrite followed a symlink out of OUT"
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    # a deletion the folder refuses for another cause than the disk (a process holding files open, an NFS .nfs file):
    # the path named and the way on, as a start-up error, not a traceback; a disk error stays one (said as a full
    # disk's, with the way on: notes.exit_code)
    import errno

    out = _used_run(tmp_path / "held")
    for err, kind in ((OSError(errno.ENOTEMPTY, "Directory not empty"), ValueError),
                      (PermissionError(errno.EACCES, "Permission denied"), PermissionError)):
        with runs.claim(out, overwrite=True) as rd:
            real = shutil.rmtree
            shutil.rmtree = lambda p, *a, e=err, **k: (_ for _ in ()).throw(e)
            try:
                with pytest.raises(kind) as got:
                    rd.clear()
            finally:
                shutil.rmtree = real
        if kind is ValueError:
            said = str(got.value)
            assert f"--overwrite could not delete {os.path.join(out, 'adapter')!r}" in said and \
                "run the same command again" in said, said
    # train.py's own runs --overwrite takes (refused from 2026-12-03 to 2026-12-04): one killed while writing its
    # config.json (torn, beside its run.lock, no metrics yet), one whose ckpt is a link to scratch storage (the link
    # goes, never what it names)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "run.lock").write_text("pid 1\n")
    (torn / "config.json").write_text('{\n "model": "/m",\n "qu')
    scratch = tmp_path / "scratch_ckpt"
    (scratch / "step_000002").mkdir(parents=True)
    (scratch / "step_000002" / "meta.json").write_text('{"step": 2}')
    (scratch / "latest").write_text("step_000002")
    linked = _used_run(tmp_path / "linked")
    shutil.rmtree(os.path.join(linked, "ckpt"))
    os.symlink(str(scratch), os.path.join(linked, "ckpt"))
    for folder in (str(torn), linked):
        with runs.claim(folder, overwrite=True) as rd:
            assert "config.json" in rd.pending, rd.pending
            rd.clear()
            assert sorted(os.listdir(folder)) == ["run.lock"], os.listdir(folder)
    assert sorted(os.listdir(scratch)) == ["latest", "step_000002"], "overwrite followed the ckpt link"



def test_an_interrupted_overwrite_is_taken_again(tmp_path, monkeypatch):
    """--overwrite deletes the run's config.json, metrics and ckpt last, so one killed mid-way leaves a run directory
    that another --overwrite takes (until 2026-12-04 they went first: a kill left adapter/ and adapter_best/ beside
    run.lock, refused as "not a train.py run directory" by every later command). Such a leftover, made before the
    fix, is taken too: only train.py's names beside its lock."""
    out = _used_run(tmp_path / "run")
    shutil.copytree(os.path.join(out, "adapter"), os.path.join(out, "adapter_best"))
    real_rmtree, calls = shutil.rmtree, []

    def killed(path, *a, **k):   # the kill: during the second folder's removal
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(runs.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt), runs.claim(out, overwrite=True) as rd:
        rd.clear()   # (train.py's open_files, once the model is built; its finally lets go of the lock)
    monkeypatch.setattr(runs.shutil, "rmtree", real_rmtree)
    assert calls == ["adapter", "adapter_best"] and {"config.json", "metrics.jsonl", "ckpt"} <= set(os.listdir(out))
    with runs.claim(out, overwrite=True) as rd:
        assert "config.json" in rd.pending, rd.pending
        rd.clear()
        assert sorted(os.listdir(out)) == ["run.lock"], os.listdir(out)
    before = tmp_path / "before"   # the leftover of the old order
    for d in ("adapter", "adapter_best"):
        (before / d).mkdir(parents=True)
        (before / d / "adapter_model.safetensors").write_bytes(b"x")
    (before / "run.lock").write_text("pid 1\n")
    with runs.claim(str(before), overwrite=True) as rd:
        assert rd.pending == ("adapter", "adapter_best"), rd.pending
        rd.clear()
        assert os.listdir(before) == ["run.lock"]
    (before / "adapter").mkdir()   # without --overwrite, or with a file of the user's, still refused
    _refused(lambda: runs.claim(str(before)), "none of config.json, metrics.jsonl, ckpt")
    (before / "notes.txt").write_text("mine")
    _refused(lambda: runs.claim(str(before), overwrite=True), "--overwrite refuses", "notes.txt")
    foreign = tmp_path / "foreign"   # a model's config.json beside a lock: judged as without one, never deleted
    (foreign / "adapter").mkdir(parents=True)
    (foreign / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (foreign / "run.lock").write_text("pid 1\n")
    _refused(lambda: runs.claim(str(foreign), overwrite=True), "its config.json is a model's")
    assert sorted(os.listdir(foreign)) == ["adapter", "config.json", "run.lock"]


def test_resume_without_out_continues_its_run(tmp_path):
    out = _used_run(tmp_path / "run")
    with runs.claim(None, resume=os.path.join(out, "ckpt", "step_000002"), root=str(tmp_path / "runs")) as rd:
        assert os.path.samefile(rd.path, out), rd.path
    with runs.claim(None, root=str(tmp_path / "runs")) as rd:
        assert os.path.dirname(rd.path) == str(tmp_path / "runs") and os.listdir(rd.path) == ["run.lock"]


HOLDER = """
import sys
sys.path.insert(0, {root!r})
from parallel import resume, runs
rd = runs.claim({out!r}, resume={resume!r})
print("locked", flush=True)
sys.stdin.read()
"""


def test_live_lock_refuses_stale_lock_does_not(tmp_path):
    out = _used_run(tmp_path / "run")
    resume = os.path.join(out, "ckpt")
    code = HOLDER.format(root=ROOT, out=out, resume=resume)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked", "the holder process did not take the lock"
        before = _hashes(tmp_path)
        msg = _refused(lambda: runs.claim(out, resume=resume), "in use by a live run", "another --out")
        assert f"pid {holder.pid}" in msg, msg
        _refused(lambda: runs.claim(out, overwrite=True), "in use by a live run")
        # a second run started beside it with neither flag (the same command twice at once) is told the run is live,
        # not offered the --resume or --overwrite that this live run's lock would refuse (until 2026-12-07)
        _refused(lambda: runs.claim(out), "in use by a live run", f"pid {holder.pid}")
        assert _hashes(tmp_path) == before, "a refused run changed files (the lock note included)"
    finally:
        holder.stdin.close()   # the holder reads EOF and exits: its lock goes with it
        holder.wait(timeout=30)
    assert os.path.isfile(os.path.join(out, "run.lock")), "the stale lock file should still be there"
    with runs.claim(out, resume=resume) as rd:   # stale file, no live holder: not blocked
        assert open(os.path.join(rd.path, "run.lock")).read().startswith(f"pid {os.getpid()} ")


def _claim_ranks(rank, world_size, root, used):
    got = {}
    with runs.claim(None, root=root) as rd:
        got["fresh"] = rd.path
    try:
        runs.claim(used)
    except ValueError as e:
        got["refusal"] = str(e)
    with runs.claim(used, overwrite=True) as rd:   # what --overwrite deletes, known on every rank (its way on if the
        got["pending"], got["ours"] = rd.pending, rd.ours   # start fails before: the same command, not a --resume)
    got["kept"] = sorted(os.listdir(used))
    return got


@pytest.mark.timeout(120)
def test_claim_agrees_across_ranks(tmp_path):
    used = _used_run(tmp_path / "run")
    got = run_ranks(_claim_ranks, 2, str(tmp_path / "runs"), used, timeout=100, pg_timeout=30)
    assert got[0]["fresh"] == got[1]["fresh"], f"ranks disagree on the fresh dir: {got}"
    assert os.listdir(str(tmp_path / "runs")) == [os.path.basename(got[0]["fresh"])], "more than one dir made"
    for r in (0, 1):
        assert "already holds a run" in got[r].get("refusal", ""), f"rank {r} did not raise the refusal: {got[r]}"
        assert got[r]["pending"] == ("adapter", "ckpt", "metrics.jsonl", "config.json") and got[r]["ours"] is None, \
            f"rank {r}: {got[r]}"
        assert got[r]["kept"] == ["adapter", "ckpt", "config.json", "metrics.jsonl", "run.lock"], got[r]["kept"]


def _two_runs_in_one_job(rank, world_size, argv, resume_out):
    """train.main(argv) (`--keep-best`: rank 0 exports adapter_best last), then at once a --resume of its step 1 and the
    same --out again with --overwrite, on each rank; rank 0 slow to let go of OUT's lock (as a slow disk or the
    adapter_best export makes it). Returns what each later run raised, or "ok"."""
    import time

    import train

    release = runs.RunDir.release

    def slow_release(self):
        if rank == 0 and self._fd is not None:
            time.sleep(2)
        release(self)

    runs.RunDir.release = slow_release
    out = argv[argv.index("--out") + 1]
    got = []
    try:
        train.main(argv)
        for later in ([*argv[:argv.index("--out")], "--out", resume_out, "--resume", f"{out}/ckpt/step_000001"],
                      [*argv, "--overwrite"]):
            try:
                train.main(later)
                got.append("ok")
            except (ValueError, RuntimeError) as e:
                got.append(f"{type(e).__name__}: {e}")
                break   # (the ranks now disagree: no further run in step)
    finally:
        runs.RunDir.release = release
    return got


@pytest.mark.timeout(300)
def test_a_finished_run_lets_go_of_its_out_before_any_rank_returns(assets, tmp_path):
    """Two train.main calls in one 2-rank job (a script: SFT then a --resume, or a sweep into one --out): no rank
    returns while rank 0 still holds OUT's lock (review, helper 91: ranks 1.. returned first, the next run's start-up
    check on them found OUT "in use by a live run" (rank 0's own pid), rank 0 went on into the collectives, which
    broke (gloo) or waited for the launcher (NCCL))."""
    from tests.helpers import eval_head, train_argv

    argv = train_argv(assets, str(tmp_path / "run"), "--dp-shard", "2", "--steps", "1", "--eval-every", "1",
                      "--keep-best", "--eval-data", eval_head(assets))   # (the last --steps counts; 10 eval records)
    got = run_ranks(_two_runs_in_one_job, 2, argv, str(tmp_path / "resumed"), timeout=280, pg_timeout=60)
    assert got == [["ok", "ok"]] * 2, f"the later runs on ranks 0, 1: {got}"


CKPT = dict(model="/m", quant="nf4", dtype=None, data="d.jsonl", max_len=256, seed=0, global_batch=8, lora_r=16,
            lora_alpha=32.0, lora_dropout=0.0, lora_targets="q_proj,v_proj", lr=2e-4, warmup=10,
            weight_decay=0.0, clip=1.0, steps=10, cp=2, dp_shard=2, dp_replicate=1, cp_impl="ulysses",
            ulysses_degree=None, micro_batch=1, pack=True, ac=True)


def test_own_checkpoint_is_only_out_ckpt(tmp_path):
    """The checkpoint train.py may branch (rename newer step folders, rewrite latest): one in OUT/ckpt itself, never
    another run's below OUT (`--out runs --resume runs/x/ckpt/step_N` passes check_out) or elsewhere."""
    for d in ("out/ckpt/step_000002", "out/x/ckpt/step_000004", "other/ckpt/step_000001"):
        (tmp_path / d).mkdir(parents=True)
    out = str(tmp_path / "out")
    assert resume.own_checkpoint(str(tmp_path / "out/ckpt/step_000002"), out)
    assert resume.own_checkpoint(str(tmp_path / "out/ckpt/step_000002") + "/", out)
    assert not resume.own_checkpoint(str(tmp_path / "out/x/ckpt/step_000004"), out)
    assert not resume.own_checkpoint(str(tmp_path / "other/ckpt/step_000001"), out)
    assert not resume.own_checkpoint(str(tmp_path / "other/ckpt/step_000001"), str(tmp_path / "new"))
    assert not resume.own_checkpoint(None, out)


def test_check_resume_with_several_data_files(tmp_path, monkeypatch):
    """--data as a list: one file recorded as a string (runs from before several files) is the same run as a list of
    it (and its sha256 as a string the same as a list of it); the files spelled another way are the same, another
    order or another set is refused, one changed file is named; --data-weights define the run (all 1 = none)."""
    for f in ("a.jsonl", "b.jsonl"):
        (tmp_path / f).write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "b.jsonl")
    monkeypatch.chdir(tmp_path)
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    two = {**CKPT, "data": [a, b], "data_sha256": ["aa", "bb"], "data_weights": [2.0, 1.0]}
    resume.check_resume({**CKPT, "data": a, "data_sha256": "aa"}, {**CKPT, "data": [a], "data_sha256": "aa"})
    resume.check_resume({**CKPT, "data": [a], "data_sha256": ["aa"]},
                        {**CKPT, "data": "./a.jsonl", "data_sha256": "aa"})
    resume.check_resume(two, {**two, "data": ["a.jsonl", "link.jsonl"]})   # (relative, a symlink)
    resume.check_resume({**two, "data_weights": None}, {**two, "data_weights": [1.0, 1.0]})
    resume.check_resume({k: v for k, v in two.items() if k != "data_weights"}, {**two, "data_weights": None})
    swapped = _refused(lambda: resume.check_resume(two, {**two, "data": [b, a], "data_sha256": ["bb", "aa"]}),
                       "--data: the checkpoint has")
    assert "--data's bytes" not in swapped, swapped   # (the files are other ones, not changed ones)
    _refused(lambda: resume.check_resume(two, {**two, "data": [a], "data_sha256": "aa", "data_weights": None}),
             "--data: the checkpoint has", "--data-weights: the checkpoint has [2.0, 1.0], this run None")
    _refused(lambda: resume.check_resume(two, {**two, "data_sha256": ["aa", "bc"]}),
             f"--data's bytes: {b} (sha256 bb then, bc now) changed since the checkpoint's run; restore it, or train "
             "the new data from the old run's adapter with --init-adapter")
    _refused(lambda: resume.check_resume(two, {**two, "data_weights": [2.0, 0.5]}), "--data-weights")
    # shares of a file's records rotate over the epochs since 2026-12-04; a run from before (no data_mix recorded)
    # took the same ones every epoch, and its resume keeps that ("fixed", which preflight gives it)
    assert [resume.data_mix(w) for w in (None, [2.0, 1.0], [2.0, 0.5], [1e-6])] == [None, None, "rotate", "rotate"]
    assert resume.data_mix([2.0, 0.5], before=True) == "fixed" and resume.data_mix([2.0], before=True) is None
    half = {**two, "data_weights": [2.0, 0.5]}
    resume.check_resume(half, {**half, "data_mix": "fixed"})
    resume.check_resume({**half, "data_mix": "rotate"}, {**half, "data_mix": "rotate"})
    resume.check_resume(two, {**two, "data_mix": None})
    _refused(lambda: resume.check_resume(half, {**half, "data_mix": "rotate"}),
             "--data-weights' shares (fixed: the same records every epoch, as runs before 2026-12-04 took them; "
             "rotate: the next records each epoch): the checkpoint has 'fixed', this run 'rotate'")
    _refused(lambda: resume.check_resume({**CKPT, "data": a, "data_sha256": "aa"},
                                         {**CKPT, "data": [a], "data_sha256": "ab"}),
             "--data's bytes (sha256: the file")


def test_keep_best_knows_its_eval_files_in_any_order(tmp_path):
    """--keep-best's eval-set identity: the eval files' bytes in any order (the same eval loss), not their paths; one
    file's is its sha256 as before several; other bytes are another set."""
    from types import SimpleNamespace

    from data.store import file_sha256
    from parallel.keep_best import Best

    for name, text in (("a", "{}\n"), ("b", "[]\n"), ("c", "{}\n")):
        (tmp_path / f"{name}.jsonl").write_text(text)
    a, b, c = (str(tmp_path / f"{x}.jsonl") for x in "abc")
    best = lambda ev: Best.of_run(SimpleNamespace(keep_best=True, eval_data=ev, eval_split=None, data_sha256="d",
                                                  seed=0, out=str(tmp_path)), None, print).eval_sha
    assert best([a, b]) == best([b, a]) == best([c, b]) != best([a]) == best(a) == file_sha256(a)


def test_early_stop_counts_again_under_another_delta(tmp_path):
    """--early-stop's count is of evaluations that did not beat the best by more than --early-stop-delta: a resume
    with another delta cannot carry it (each of them may have been an improvement under the new one, or not), so it
    counts again from the checkpoint's best, said, and a run that stopped is not refused a resume with another delta.
    Until 2026-12-06 the count carried over whatever the delta."""
    import json
    from types import SimpleNamespace

    from parallel.keep_best import EarlyStop, eval_identity, exhausted

    (tmp_path / "ev.jsonl").write_text("{}\n")
    step = tmp_path / "out" / "ckpt" / "step_000004"
    step.mkdir(parents=True)
    run = lambda delta, n=3: SimpleNamespace(early_stop=n, early_stop_delta=delta, eval_split=None, eval_tokens=None,
                                             eval_data=str(tmp_path / "ev.jsonl"), out=str(tmp_path / "out"))
    meta = {"step": 4, "args": {"early_stop_delta": 0.1},
            "early_stop": {"step": 2, "eval_loss": 1.5, "bad": 2, "eval_data_sha256": eval_identity(run(0.1))}}
    (step / "meta.json").write_text(json.dumps(meta))
    for delta, bad in ((0.1, 2), (0.0, 0), (0.5, 0)):
        said = []
        early = EarlyStop.of_run(run(delta), str(step), said.append)
        assert (early.step, early.best, early.bad) == (2, 1.5, bad), (delta, vars(early))
        assert said == ([] if bad else [f"note: --early-stop-delta {delta:g}: the checkpoint's count (2 evaluations "
                                        "since step 2's eval_loss 1.500000) was made with --early-stop-delta 0.1: "
                                        "counting starts again here, from that best"]), said
        why = exhausted(meta, run(delta, n=2), str(step))
        assert (why is None) == (delta != 0.1), (delta, why)


def test_keep_best_and_early_stop_start_again_on_other_eval_samples(tmp_path):
    """The same eval files tokenized to other samples (`eval_tokens`: a chat template's date, another tokenizer file)
    give losses that do not compare: --keep-best's best and --early-stop's count start again, said; the same samples
    (or a checkpoint from before the record) carry both on."""
    import json
    import warnings
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from parallel.keep_best import Best, EarlyStop, eval_identity, exhausted

    (tmp_path / "ev.jsonl").write_text("{}\n")
    step = tmp_path / "out" / "ckpt" / "step_000004"
    best_step = tmp_path / "out" / "ckpt" / "step_000002"   # (the best's folder, as rotation keeps it)
    with warnings.catch_warnings():   # ("assuming the intent is to save in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(best_step), no_dist=True)
    (best_step / "meta.json").write_text('{"step": 2}')
    step.mkdir(parents=True)
    run = lambda tokens: SimpleNamespace(keep_best=True, early_stop=3, early_stop_delta=0.0, eval_split=None,
                                         eval_data=str(tmp_path / "ev.jsonl"), out=str(tmp_path / "out"),
                                         eval_tokens=tokens)
    sha = eval_identity(run(None))
    for was, now, kept in (("2 samples, 9 tokens, sha256 " + "a" * 64,) * 2 + (True,),
                           (None, "2 samples, 9 tokens, sha256 " + "a" * 64, True),
                           ("2 samples, 9 tokens, sha256 " + "a" * 64, "2 samples, 11 tokens, sha256 " + "b" * 64,
                            False)):
        (step / "meta.json").write_text(json.dumps({
            "step": 4, "args": {"eval_tokens": was} if was else {},
            "best": {"step": 2, "eval_loss": 1.5, "eval_data_sha256": sha},
            "early_stop": {"step": 2, "eval_loss": 1.5, "bad": 1, "eval_data_sha256": sha}}))
        said = []
        best, early = Best.of_run(run(now), str(step), said.append), EarlyStop.of_run(run(now), str(step), said.append)
        assert (best.step, best.loss) == ((2, 1.5) if kept else (None, float("inf"))), (was, now)
        assert (early.step, early.best, early.bad) == ((2, 1.5, 1) if kept else (None, float("inf"), 0)), (was, now)
        assert len(said) == 2 * (not kept) and all("was measured on other eval samples of the same --eval-data" in n
                                                   for n in said), said
        # a run that stopped at --early-stop 1 is refused a resume only onto the same samples (others count anew;
        # the refusal was checked before tokenizing, on the files' bytes alone)
        stopped = SimpleNamespace(**{**vars(run(now)), "early_stop": 1})
        why = exhausted(json.loads((step / "meta.json").read_text()), stopped, str(step))
        assert (why is not None) == kept and (not kept or "which --early-stop 1 stops at" in why), (was, now, why)
    # the best's folder rotated away (a resume from below a newer best, which removed it; review, helper 46):
    # --keep-best chooses anew, said, rather than end with no adapter_best
    shutil.rmtree(best_step)
    said = []
    best = Best.of_run(run("2 samples, 9 tokens, sha256 " + "a" * 64), str(step), said.append)
    assert best.step is None and said == [
        f"note: --keep-best: the checkpoint's best (step 2, eval_loss 1.500000) is no longer in {step.parent} (it does "
        "not exist): the best is chosen among this run's evaluations from here on"], said


def test_check_resume_names_each_difference():
    # a new layout, reordered targets and more steps are the same run
    resume.check_resume(CKPT, {**CKPT, "cp": 4, "dp_shard": 1, "cp_impl": "ring", "micro_batch": 2, "pack": False,
                             "lora_targets": "v_proj,q_proj", "steps": 20}, ckpt_step=4)
    for flag, new in (("lora_alpha", 16.0), ("lora_r", 8), ("lora_targets", "q_proj"), ("global_batch", 16),
                      ("seed", 1), ("data", "other.jsonl"), ("model", "/m2"), ("max_len", 512), ("quant", "none"),
                      ("lr", 1e-3)):
        _refused(lambda f=flag, v=new: resume.check_resume(CKPT, {**CKPT, f: v}),
                 "--" + flag.replace("_", "-"), repr(CKPT[flag]), repr(new), "fresh run")
    # --eval-split changes which records are trained on (a run from before it had none)
    _refused(lambda: resume.check_resume(CKPT, {**CKPT, "eval_split": 0.1}), "--eval-split", "None", "0.1")
    _refused(lambda: resume.check_resume({**CKPT, "eval_split": 0.1}, {**CKPT, "eval_split": 0.2}), "--eval-split")
    resume.check_resume({**CKPT, "eval_split": 0.1}, {**CKPT, "eval_split": 0.1})
    resume.check_resume(CKPT, {**CKPT, "eval_split": None})
    msg = _refused(lambda: resume.check_resume(CKPT, {**CKPT, "seed": 3, "lora_r": 4}), "--seed", "--lora-r")
    assert "--cp" in msg, "the message should say which layout flags may change"
    _refused(lambda: resume.check_resume(CKPT, {**CKPT, "steps": 3}, ckpt_step=4), "--steps 3", "step 4")
    _refused(lambda: resume.check_resume({**CKPT, "data_sha256": "aa"}, {**CKPT, "data_sha256": "ab"}),
             "--data's bytes (sha256: the file changed")
    resume.check_resume({**CKPT, "data_sha256": None}, {**CKPT, "data_sha256": "ab"})   # a demo run's: not recorded
    # a fork's new flag (in neither list) defines the run; the listed ones may change
    _refused(lambda: resume.check_resume({**CKPT, "z_loss_weight": 1e-4}, {**CKPT, "z_loss_weight": 1.0}),
             "--z-loss-weight: the checkpoint has 0.0001, this run 1.0 (a flag not listed in parallel/resume.py's "
             "LAYOUT or FREE defines the run)")
    resume.check_resume({**CKPT, "save_every": 5, "eval_every": 2}, {**CKPT, "save_every": 9, "eval_every": 4})
    resume.check_resume(CKPT, {**CKPT, "z_loss_weight": 1.0})   # a checkpoint from before the flag: not known
    _refused(lambda: resume.check_resume({**CKPT, "schedule": "lr_at: def lr_at(s, a, t):\n    return a.lr"},
                                         {**CKPT, "schedule": "lr_at: def lr_at(s, a, t):\n    return 2 * a.lr"}),
             "the LR schedule (train.py's lr_at) differs from the checkpoint's run at line 2: '    return a.lr' there, "
             "'    return 2 * a.lr' here")
    resume.check_resume({**CKPT, "schedule": "lr_at: def lr_at(s, a, t):\n    return a.lr"},
                        {**CKPT, "schedule": "lr_at: (no source)"})   # a .pyc-only deployment: cannot compare
    adamw = {"optimizer": {"class": "AdamW", "betas": [0.9, 0.999]},
             "optimizer_code": "make_optimizer: def make_optimizer(params, args):\n    return AdamW(params)"}
    plus = {**adamw, "optimizer_code": adamw["optimizer_code"].replace("AdamW(params)",
                                                                       "AdamW(groups_by_name(params))")}
    _refused(lambda: resume.check_resume({**CKPT, **adamw}, {**CKPT, **plus}),   # (LoRA+: groups by name)
             "the optimizer's code (train.py's make_optimizer) differs from the checkpoint's run at line 2: "
             "'    return AdamW(params)' there, '    return AdamW(groups_by_name(params))' here")
    adam = {**adamw, "optimizer": {**adamw["optimizer"], "class": "Adam"}}
    msg = _refused(lambda: resume.check_resume({**CKPT, **adamw}, {**CKPT, **adam}),
                   "the optimizer (train.py's make_optimizer): the checkpoint's run used "
                   "{'class': 'AdamW', 'betas': [0.9, 0.999]}, this run {'class': 'Adam', 'betas': [0.9, 0.999]}")
    assert "code" not in msg.split("\n")[1], msg
    resume.check_resume({**CKPT, "optimizer": adamw["optimizer"]}, {**CKPT, **plus})   # a record without code
    # the tokens the data gave (train.py, once tokenized): the same bytes under another tokenizer are another run
    had = {"data_tokens": "3 samples, 9 tokens, sha256 " + "a" * 64}
    now = {"data_tokens": "1 samples, 4 tokens, sha256 " + "b" * 64}
    _refused(lambda: resume.same_tokens(had, now), "other tokens (3 samples, 9 tokens, sha256 aaaaaaaaaaaa) than this "
             "run's --data gives (1 samples, 4 tokens, sha256 bbbbbbbbbbbb)", "--init-adapter")
    resume.same_tokens(had, had)
    resume.same_tokens({}, now)   # a checkpoint from before the record: not known
    said = _refused(lambda: resume.same_tokens(had, {**now, "objective": "dpo"}), "other tokens")
    assert "this trainer's preference-pair targets, TRL's since 2026-12-05" in said   # (review, helper 43)
    assert "preference-pair" not in _refused(lambda: resume.same_tokens(had, now), "other tokens")
    # the eval samples may differ (--eval-data is free), but their losses then do not compare: said (review, helper
    # 43: a tokenization change went on silently, with --keep-best's best measured on the old targets)
    ev = lambda c: {**had, "eval_tokens": f"2 samples, 5 tokens, sha256 {c * 64}"}
    assert resume.same_tokens(ev("c"), ev("c")) is None and resume.same_tokens(had, ev("c")) is None
    note = resume.same_tokens(ev("c"), ev("d"))
    assert note.startswith("note: the eval samples are not the checkpoint's run's (2 samples, 5 tokens, sha256 "
                           "dddddddddddd, then 2 samples, 5 tokens, sha256 cccccccccccc"), note
    assert "--keep-best" in note


def test_every_flag_of_train_py_is_classified_for_resume():
    """Each of train.py's flags is compared on resume (RUN_DEFINING) or listed as free to change (LAYOUT, FREE), and
    no flag is in two lists: a flag added upstream takes a decision, not a default."""
    import train

    dests = {a.dest for a in train.build_parser()._actions if a.dest != "help"}
    lists = {"RUN_DEFINING": set(resume.RUN_DEFINING), "LAYOUT": set(resume.LAYOUT), "FREE": set(resume.FREE)}
    assert not dests - set().union(*lists.values()), f"flags in no list: {sorted(dests - set().union(*lists.values()))}"
    names = sorted(lists)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not lists[a] & lists[b], f"in {a} and {b}: {lists[a] & lists[b]}"


def test_metrics_strict_json_and_resume_truncation(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = metrics.MetricsLog(path)
    for s in (1, 2, 3):
        log.write({"step": s, "loss": float("nan") if s == 2 else 1.5, "grad_norm": float("inf") if s == 2 else 0.5})
    log.close()

    def strict(c):
        raise AssertionError(f"non-JSON literal {c} in metrics.jsonl")

    rows = [json.loads(line, parse_constant=strict) for line in open(path)]
    assert rows[1] == {"step": 2, "loss": None, "grad_norm": None, "nonfinite": {"loss": "nan", "grad_norm": "inf"}}
    assert rows[0] == {"step": 1, "loss": 1.5, "grad_norm": 0.5}

    before = _hashes(tmp_path)
    _refused(lambda: metrics.MetricsLog(path), "already holds metrics", "--resume")
    assert _hashes(tmp_path) == before, "a fresh MetricsLog touched existing metrics"

    with open(path, "a") as f:
        f.write('{"step": 4, "lo')   # a line torn by a crash mid-write
    lines = open(path).read().splitlines(keepends=True)
    log = metrics.MetricsLog(path, resume_step=2)
    assert log.dropped == 2, log.dropped
    log.write({"step": 3, "loss": 1.0})
    log.close()
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3]
    assert not os.path.exists(path + ".tmp")
    # the lines dropped (steps the resume trains again, as a crash or a resume from an older step left them) are kept
    # beside it, as the abandoned steps' checkpoints and adapters are (until 2026-12-07 they were gone); a second
    # resume adds its own; each line a record (the torn one is not) tagged with the step resumed from
    abandoned = str(tmp_path / "metrics.abandoned.jsonl")
    rows = [json.loads(line) for line in open(abandoned)]
    assert rows == [{**json.loads(lines[2]), "abandoned_at_resume_from": 2}], rows
    now = [json.loads(line) for line in open(path)]
    moved = [{**r, "abandoned_at_resume_from": 1} for r in now[1:]]
    metrics.MetricsLog(path, resume_step=1).close()
    assert [json.loads(line) for line in open(abandoned)][1:] == moved, "a second resume's lines"
    # a kill between the move and metrics.jsonl's rewrite: the next resume finds the same lines and moves them once
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in now)
    metrics.MetricsLog(path, resume_step=1).close()
    assert [json.loads(line) for line in open(abandoned)][1:] == moved, "moved twice"
    assert "metrics.abandoned.jsonl" in outdir.OWNED, "--overwrite would leave it"
    # a full disk (/dev/full refuses every write): the write fails once, and close() has nothing left to flush (until
    # 2026-12-05 a buffered line failed again in close, in train.py's finally, hiding the first error and its run
    # folder, so the advice said "run the same command again", which is refused; review, helper 46)
    log = metrics.MetricsLog("/dev/full")
    with pytest.raises(OSError, match="No space left on device"):
        log.write({"step": 1, "loss": 1.0})
    log.close()


def test_tensorboard_sink_draws_each_record_when_it_is_written(tmp_path):
    """--report-to tensorboard, read by TensorBoard's own reader: a record is on disk when write() returns (a killed
    run's last steps are drawn), a non-finite loss drawn as NaN where metrics.jsonl writes null, flags not drawn."""
    import math

    from tests.helpers import tensorboard_scalars

    log = metrics.Metrics(str(tmp_path), ["tensorboard"])
    try:
        said = log.write({"step": 1, "loss": float("nan"), "grad_norm": 0.5, "tokens": 96, "profiled": True})
        drawn = tensorboard_scalars(str(tmp_path))   # before close()
    finally:
        log.close()
    assert said == {"step": 1, "loss": None, "grad_norm": 0.5, "tokens": 96, "profiled": True,
                    "nonfinite": {"loss": "nan"}}, said
    assert sorted(drawn) == ["grad_norm", "loss", "tokens"] and drawn["grad_norm"] == [(1, 0.5)], drawn
    assert drawn["tokens"] == [(1, 96.0)] and len(drawn["loss"]) == 1 and math.isnan(drawn["loss"][0][1]), drawn
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1]


def _wandb_env(monkeypatch, tmp_path, mode="offline"):
    """W&B offline, and no key, settings or netrc of this machine's user in sight."""
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    if mode:
        monkeypatch.setenv("WANDB_MODE", mode)


def test_wandb_sink_logs_each_step_once_across_resumes(tmp_path, monkeypatch, capsys):
    """--report-to wandb, read back from wandb's own record log (tests/helpers.wandb_runs): each record a row at its
    step (numbers only; NaN kept, flags and booleans not), the run named and grouped after OUT. A resume from the
    W&B run's last step goes on in that run; one from below it (the steps after it are trained again, and W&B ignores
    a row at a step it holds) opens a new run, OUT@STEP, in the group, and says so; so does one after a resume
    without the flag trained from below it. A new run starts with metrics.jsonl's steps up to STEP (review, helper 88).
    A fresh run into a folder holding a W&B run is refused."""
    from tests.helpers import wandb_runs

    _wandb_env(monkeypatch, tmp_path)
    out = str(tmp_path / "myrun")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"lr": 0.001, "steps": 9}, f)
    rec = lambda k: {"step": k, "loss": 1.0 / k, "grad_norm": 0.5, "tokens": 96, "profiled": True}  # noqa: E731

    def segment(steps, resume_step, report_to=("wandb",)):
        log = metrics.Metrics(out, list(report_to), resume_step=resume_step)
        try:
            for k in steps:
                log.write(rec(k))
        finally:
            log.close()

    segment([1, 2, 3], None)
    (first, run), = wandb_runs(out).items()
    assert (run["name"], run["group"]) == ("myrun", "myrun"), run
    assert run["rows"] == [(k, {"loss": 1.0 / k, "grad_norm": 0.5, "tokens": 96}) for k in (1, 2, 3)], run["rows"]
    segment([4], 3)   # (a stop that saved step 3: nothing logged twice)
    assert list(wandb_runs(out)) == [first] and [k for k, _ in wandb_runs(out)[first]["rows"]] == [1, 2, 3, 4]
    capsys.readouterr()
    segment([3, 4, 5], 2)   # steps 3 and 4 again
    assert f"note: the W&B run {first} holds steps up to 4, and those past 2 are trained again: this run's go to a " \
        "new W&B run, myrun@2, in group myrun, after metrics.jsonl's steps up to 2" in capsys.readouterr().out
    runs_now = wandb_runs(out)
    (second, run), = [(k, v) for k, v in runs_now.items() if k != first]
    assert (run["name"], run["group"]) == ("myrun@2", "myrun") and [k for k, _ in run["rows"]] == [1, 2, 3, 4, 5], run
    assert run["rows"] == [(k, {"loss": 1.0 / k, "grad_norm": 0.5, "tokens": 96}) for k in range(1, 6)], run["rows"]
    assert [k for k, _ in runs_now[first]["rows"]] == [1, 2, 3, 4], "the first run is left as it was"
    segment([2, 3, 4, 5, 6], 1, report_to=())   # without the flag, from below step 5, to past it: W&B's run
    capsys.readouterr()
    segment([7], 6)   # holds steps 3-5 this run no longer has, so step 7 goes to a new one
    assert f"note: the W&B run {second} holds steps up to 5, and a resume without --report-to wandb trained some " \
        "of them again: this run's go to a new W&B run, myrun@6, in group myrun" in capsys.readouterr().out
    third = [k for k in wandb_runs(out) if k not in (first, second)]
    assert len(third) == 1 and wandb_runs(out)[third[0]]["name"] == "myrun@6", wandb_runs(out)
    assert wandb_runs(out)[third[0]]["rows"] == [(k, {"loss": 1 / k, "grad_norm": 0.5, "tokens": 96})
                                                 for k in range(1, 8)]
    assert [k for k, _ in wandb_runs(out)[second]["rows"]] == [1, 2, 3, 4, 5]
    before = sorted(os.listdir(os.path.join(out, "wandb")))
    with pytest.raises(ValueError, match="already holds a W&B run; a fresh run never adds to another's"):
        metrics.WandB(out)   # (claim refuses the folder first; this is the sink's own guard)
    assert sorted(os.listdir(os.path.join(out, "wandb"))) == before


def test_wandb_run_never_closed_is_not_continued(tmp_path, monkeypatch, capsys):
    """wandb's service holds the rows it is sent: a process killed after saving its last step (OOM), or a service
    killed by the scheduler's SIGTERM to every process of the job (SLURM), loses them, as wandb's own record log
    shows. The resume from that step then opens a new W&B run holding metrics.jsonl's steps, never goes on in the one
    that lost them (steps 1..3 were in no W&B run: review, helper 88)."""
    import signal

    from tests.helpers import wandb_runs

    _wandb_env(monkeypatch, tmp_path)
    out = str(tmp_path / "myrun")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"lr": 0.001}, f)
    rec = lambda k: {"step": k, "loss": 1.0 / k, "grad_norm": float("nan") if k == 2 else 0.5}  # noqa: E731
    killed = (f"import os, signal\nfrom parallel import metrics\nlog = metrics.Metrics({out!r}, ['wandb'])\n"
              "for k in (1, 2, 3):\n    log.write({'step': k, 'loss': 1.0 / k, 'grad_norm': float('nan') if k == 2 "
              "else 0.5})\nos.kill(os.getpid(), signal.SIGKILL)   # (OOM, after step 3's save)")
    r = subprocess.run([sys.executable, "-c", killed], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with open(os.path.join(out, "wandb", "run.json")) as f:
        first = json.load(f)["id"]
    lost = wandb_runs(out, unfinished=[first]).get(first, {"rows": []})   # (the killed service wrote no record at all)
    assert [k for k, _ in lost["rows"]] != [1, 2, 3], "the service kept its rows: this test shows nothing"
    capsys.readouterr()
    log = metrics.Metrics(out, ["wandb"], resume_step=3)
    log.write(rec(4))
    log.close()
    assert f"note: the W&B run {first} holds steps up to 3, and it was never closed" in capsys.readouterr().out
    (second, run), = [(k, v) for k, v in wandb_runs(out, unfinished=[first]).items() if k != first]
    assert run["name"] == "myrun@3" and [k for k, _ in run["rows"]] == [1, 2, 3, 4], run
    assert math.isnan(run["rows"][1][1]["grad_norm"]) and run["rows"][3][1] == {"loss": 0.25, "grad_norm": 0.5}
    assert run["config"] == {"lr": 0.001}, run["config"]


def test_wandb_service_killed_mid_run_is_a_warning_not_a_stop(tmp_path, monkeypatch, capsys):
    """SLURM's SIGTERM reaches every process of the job, wandb's service too, which dies at once: its next row (or
    finish) raised ConnectionResetError, which stopped every rank unsaved, or replaced the stop's own exit (review,
    helper 88). Now W&B is dropped with a warning and the run goes on: metrics.jsonl holds every step, the W&B run is
    not marked closed, and the resume logs them all to a new W&B run."""
    from tests.helpers import wandb_runs

    _wandb_env(monkeypatch, tmp_path)
    out = str(tmp_path / "myrun")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"lr": 0.001}, f)
    script = (f"import os, signal, psutil\nfrom parallel import metrics\nlog = metrics.Metrics({out!r}, ['wandb'])\n"
              "log.write({'step': 1, 'loss': 1.0})\nlog.write({'step': 2, 'loss': 0.5})\n"
              "core = [p for p in psutil.Process().children(recursive=True) if 'wandb-core' in p.name()]\n"
              "assert core, 'no wandb-core child'\n"
              "[p.send_signal(signal.SIGTERM) for p in core]\npsutil.wait_procs(core, timeout=30)\n"
              "log.write({'step': 3, 'loss': 0.25})\nlog.write({'step': 4, 'loss': 0.2})\nlog.close()\n"
              "print('closed')")
    r = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "closed" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert r.stdout.count("warning: W&B took no row at step ") == 1 and "the run goes on without it, metrics.jsonl " \
        "holds every step" in r.stdout, r.stdout
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    with open(os.path.join(out, "wandb", "run.json")) as f:
        state = json.load(f)
    assert not state["closed"], state
    capsys.readouterr()
    log = metrics.Metrics(out, ["wandb"], resume_step=4)
    log.write({"step": 5, "loss": 0.1})
    log.close()
    assert "it was never closed" in capsys.readouterr().out
    (_, run), = [(k, v) for k, v in wandb_runs(out, unfinished=[state["id"]]).items() if k != state["id"]]
    assert run["name"] == "myrun@4" and [k for k, _ in run["rows"]] == [1, 2, 3, 4, 5], run


def test_wandb_run_of_a_failed_run_is_failed_and_a_fresh_one_never_resumes(tmp_path, monkeypatch):
    """A run that ends on an error is W&B's "failed" (its exit record's code 1), not "finished"; a signal's stop,
    its steps saved, and a run that ends well are 0. A fresh W&B run is started with resume="never", so a
    WANDB_RESUME=must the user's environment holds cannot make wandb.init look for (or refuse) our new id."""
    from parallel.signals import Stopped
    from tests.helpers import wandb_runs

    _wandb_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_RESUME", "must")
    codes = {}
    for name, error in (("ok", None), ("crashed", RuntimeError("boom")), ("stopped", Stopped("stopped", 15))):
        out = str(tmp_path / name)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({}, f)
        log = metrics.Metrics(out, ["wandb"])
        try:
            try:
                log.write({"step": 1, "loss": 1.0})
                if error:
                    raise error
            finally:
                log.close()
        except (RuntimeError, Stopped) as e:
            assert e is error
        (run,) = wandb_runs(out).values()
        codes[name] = run["exit_code"]
    assert codes == {"ok": 0, "crashed": 1, "stopped": 0}, codes
    calls = []
    monkeypatch.setattr("wandb.init", lambda **kw: calls.append(kw) or (_ for _ in ()).throw(RuntimeError("stop")))
    os.makedirs(tmp_path / "fresh")
    (tmp_path / "fresh" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="stop"):
        metrics.Metrics(str(tmp_path / "fresh"), ["wandb"])
    assert calls[0]["resume"] == "never", calls


def test_wandb_without_a_key_is_refused_at_start_up(tmp_path, monkeypatch):
    """Online with no API key anywhere wandb documents (WANDB_API_KEY, ~/.netrc from `wandb login`), wandb.init
    would refuse after the model is built, or ask at a terminal with the other ranks waiting: said at start-up. A key
    in either place, offline or disabled, passes."""
    _wandb_env(monkeypatch, tmp_path, mode=None)
    with pytest.raises(ValueError, match=r"--report-to wandb: no W&B API key for api.wandb.ai here \(no WANDB_API_KEY, "
                                         r"no entry in .*/home/.netrc, none in W&B's settings files\): run `wandb "
                                         r"login`, set WANDB_API_KEY, or WANDB_MODE=offline"):
        metrics.check_sinks(["wandb"])
    metrics.check_sinks(["tensorboard"])
    os.makedirs(tmp_path / "home")
    (tmp_path / "home" / ".netrc").write_text("machine example.org login user password x\n")
    with pytest.raises(ValueError, match="no W&B API key"):
        metrics.check_sinks(["wandb"])   # (another host's entry)
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    os.chmod(tmp_path / "home" / ".netrc", 0o600)
    metrics.check_sinks(["wandb"])
    for env in ({"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": "k" * 40}):
        _wandb_env(monkeypatch, tmp_path, mode=None)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        metrics.check_sinks(["wandb"])


def _wandb_finds_a_key() -> bool:
    """wandb 0.31's own answer (wandb_setup's settings: the settings files, then the environment; wbauth's sources):
    offline or disabled, or a key for the server it would log to."""
    from wandb.sdk.lib.wbauth import wbnetrc
    from wandb.sdk.lib.wbauth.host_url import HostUrl
    from wandb.sdk.wandb_settings import Settings

    s = Settings()
    s.settings_system = os.path.join(os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb"),
                                     "settings")
    s.update_from_system_settings()
    s.update_from_env_vars(dict(os.environ))
    if s.mode in ("offline", "disabled"):
        return True
    host = HostUrl(s.base_url)
    return bool(os.environ.get("WANDB_API_KEY") or wbnetrc.read_netrc_auth_with_source(host=host) or
                (s.api_key and host.is_same_url(s.base_url)))


def test_wandb_key_check_agrees_with_wandb_where_it_finds_a_key(tmp_path, monkeypatch):
    """The start-up check passes exactly where wandb's own lookup finds a key (or needs none): a server with a port
    (`wandb login --host` writes host:port in the netrc), the server, the mode or the key in W&B's settings files
    (`wandb login --host`, `wandb offline`), a ~/.netrc others may read (wandb reads it; Python's netrc() refuses
    it), an entry without a password. Looking at less, it refused users wandb logs in (review, helper 88)."""
    key = "k" * 40
    cases = {   # name: (environment, {file under tmp: text}), each from a clean slate
        "nothing": ({}, {}),
        "port": ({"WANDB_BASE_URL": "http://localhost:8080"}, {"netrc": f"machine localhost:8080 password {key}"}),
        "port-less entry": ({"WANDB_BASE_URL": "http://localhost:8080"},
                            {"netrc": f"machine localhost password {key}"}),
        "host in settings": ({}, {"home/.config/wandb/settings": "[default]\nbase_url = https://wandb.corp.example\n",
                                  "netrc": f"machine wandb.corp.example login u password {key}"}),
        "api.wandb.ai entry, other host in settings": ({}, {
            "home/.config/wandb/settings": "[default]\nbase_url = https://wandb.corp.example\n",
            "netrc": f"machine api.wandb.ai login u password {key}"}),
        "wandb offline": ({}, {"home/.config/wandb/settings": "[default]\nmode = offline\n"}),
        "wandb offline here": ({}, {"cwd/wandb/settings": "[default]\nmode = offline\n"}),
        "key in settings": ({}, {"home/.config/wandb/settings": f"[default]\napi_key = {key}\n"}),
        "readable ~/.netrc": ({"NETRC": None}, {"home/.netrc": f"machine api.wandb.ai login u password {key}"}),
        "no password": ({}, {"netrc": "machine api.wandb.ai login u"}),
        "env key": ({"WANDB_API_KEY": key}, {}),
    }
    seen = {}
    for name, (env, files) in cases.items():
        case = tmp_path / name.replace(" ", "_").replace(",", "")
        _wandb_env(monkeypatch, case, mode=None)
        (case / "cwd").mkdir(parents=True)
        monkeypatch.chdir(case / "cwd")
        for k, v in env.items():
            monkeypatch.delenv(k) if v is None else monkeypatch.setenv(k, v)
        for f, text in files.items():
            f = case / ("home/.netrc" if f == "netrc" else f)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text + "\n")
            os.chmod(f, 0o644)
        try:
            metrics.check_sinks(["wandb"])
            passed = True
        except ValueError as e:
            assert str(e).startswith("--report-to wandb: no W&B API key for "), e
            passed = False
        seen[name] = (passed, _wandb_finds_a_key())
    assert all(a == b for a, b in seen.values()), {k: v for k, v in seen.items() if v[0] != v[1]}
    assert [k for k, (_, found) in seen.items() if not found] == [
        "nothing", "port-less entry", "api.wandb.ai entry, other host in settings", "no password"], seen


def test_logged_numbers_keep_six_significant_digits_when_small():
    """metrics.rounded, what train.py logs a loss, norm, reward or eval loss as: 6 decimals at 0.1 and above (as
    before), 6 significant digits below (round(v, 6) logged an eval loss of 3e-7 as 0.0; review, helper 90)."""
    import math

    assert metrics.rounded(4.5153981234) == 4.515398 and metrics.rounded(-12.3456789) == -12.345679
    assert metrics.rounded(3.21987654e-7) == 3.21988e-7 and metrics.rounded(-0.0123456789) == -0.0123457
    assert metrics.rounded(0.1) == 0.1 and metrics.rounded(0.0) == 0.0 and metrics.rounded(1e-300) == 1e-300
    assert math.isnan(metrics.rounded(float("nan"))) and metrics.rounded(float("inf")) == float("inf")
    assert metrics.rounded(2.0e-7) != metrics.rounded(2.1e-7)


def test_config_json_keeps_every_value_and_writes_a_list_of_numbers_on_one_line():
    """config.json: `json.loads` gives back the dict as it was (strings that look like lists untouched, booleans,
    floats, nested lists), and 10,000 held-out lines of --eval-split take one line, not 10,000."""
    from parallel.run_config import config_json

    config = {"eval_split_records": {"a.jsonl": list(range(1, 10001)), "b.jsonl": [7]}, "loss": "x = [1,  2]\n[3]",
              "flags": [True, False], "rates": [0.5, 2], "nested": [[1, 2], []], "none": None, "empty": []}
    text = config_json(config)
    assert json.loads(text) == config
    assert len(text.splitlines()) < 30, text[:500]
    assert '"a.jsonl": [1, 2, 3,' in text and '"loss": "x = [1,  2]\\n[3]"' in text


def test_check_resume_of_dpo_runs_and_their_reference():
    """A DPO checkpoint from before the reference was recorded resumes as its base reference (refused with an adapter
    now); an adapter reference is its bytes, wherever they are; another reference is named with its fix; another
    --objective or --dpo-loss is said as that, not as the reference (there is no --dpo-reference flag)."""
    dpo = {**CKPT, "objective": "dpo", "dpo_beta": 0.1, "dpo_loss": "sigmoid"}
    old = {k: v for k, v in dpo.items() if k != "dpo_loss"}   # (a run from 2026-12-04's first DPO: no such keys)
    resume.check_resume(old, {**dpo, "dpo_reference": "base", "init_adapter": None})
    _refused(lambda: resume.check_resume(old, {**dpo, "dpo_reference": "adapter sha256 ab", "init_adapter": "/s"}),
             "DPO's reference: the checkpoint's run's was the base model (LoRA off), this run's the adapter '/s'",
             "drop --init-adapter")
    sft = {**dpo, "dpo_reference": "adapter sha256 ab", "init_adapter": "/sft/adapter"}
    resume.check_resume(sft, {**sft, "init_adapter": "/copy/elsewhere"})   # the same bytes at another path
    said = _refused(lambda: resume.check_resume(sft, {**sft, "dpo_reference": "adapter sha256 cd"}),
                    "the checkpoint's run read '/sft/adapter'; the same bytes anywhere will do")
    assert said.count("DPO's reference") == 1, said
    said = _refused(lambda: resume.check_resume(sft, {**sft, "dpo_loss": "orpo", "dpo_reference": "none"}),
                    "--dpo-loss: the checkpoint has 'sigmoid', this run 'orpo'")
    assert "reference" not in said and "--dpo-reference" not in said, said
    # another --objective, either way: said alone, with the way to train it from that run's adapter (review, helper 41:
    # an SFT checkpoint resumed as DPO listed LOSS_FN's text first)
    for was, now in (({**CKPT, "out": "/runs/sft"}, {**CKPT, "objective": "dpo", "loss": "dpo",
                                                     "dpo_reference": "base"}),
                     ({**sft, "out": "/runs/dpo"}, {**sft, "objective": "sft", "dpo_reference": None,
                                                    "loss": "cross-entropy"})):
        said = _refused(lambda w=was, n=now: resume.check_resume(w, n), f"--resume: the checkpoint's run trained "
                        f"--objective {was.get('objective', 'sft')}, this one --objective {now['objective']}: a resume "
                        f"continues the same run. To train {now['objective']} from where it got to, start a fresh "
                        f"run from its adapter: --objective {now['objective']} --init-adapter {was['out']}/adapter")
        assert "the checkpoint has" not in said and "reference" not in said, said
    # --long-text does nothing to pairs (their sides are never split): a DPO run resumes with either
    resume.check_resume({**dpo, "long_text": "truncate"}, {**dpo, "dpo_reference": "base", "long_text": "split"})
    _refused(lambda: resume.check_resume({**CKPT, "long_text": "truncate"}, {**CKPT, "long_text": "split"}),
             "--long-text: the checkpoint has 'truncate', this run 'split'")
