"""`--model org/name`: a Hugging Face Hub repo id fetched into huggingface_hub's cache (model/hub.fetch_checkpoint).

Pins, with huggingface_hub.snapshot_download replaced by a local stand-in (no hub here) that copies what its
allow_patterns select from the tiny checkpoint of tests/conftest.py into <cache>/snapshots/<commit>/:
- a run given the id first fetches config.json alone (before the process group and any weight), then the
  weights and tokenizer of that same commit once the layout has passed its checks; it trains to the same losses
  and adapter as a run on the local directory (no consolidated.* copy, no subfolder fetched), the adapter names
  the id and commit as its base model (what peft loads), and a --resume given the id again is accepted; a resume
  from another cache location of the same commit is accepted, of another commit refused; `python -m model.merge
  --adapter` alone fetches the base the adapter names (id and commit) and writes the local merge's weights;
- ranks that resolve the id to different commits (a push in between), or one rank's failed weights fetch, stop
  every rank with the same error;
- `--plan` fetches config.json only; `org/name@rev` asks for that revision;
- a fetch that fails (offline, no such repo, gated) is one FileNotFoundError naming the id and the fix, raised
  before any weight is read and before --out is created; paths (existing or not) never reach the hub.

Run: .venv/bin/python -m pytest -q tests/test_hub.py
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects

from tests.helpers import no_weights, one_thread, train_argv

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(assets, tmp_path, monkeypatch):
    """The stand-in hub: every snapshot_download call is recorded; `fail` makes the next ones raise."""
    import huggingface_hub

    state = {"calls": [], "fail": None}

    repo = tmp_path / "repo"   # the repo as the hub holds it: the checkpoint, a Mistral-style consolidated copy of
    shutil.copytree(assets["model"], repo)   # the weights and a subfolder (Llama's original/), which it must skip
    (repo / "consolidated.safetensors").write_bytes(b"not this")
    (repo / "original").mkdir()
    (repo / "original" / "params.json").write_text("{}")
    files = [os.path.relpath(os.path.join(d, f), repo) for d, _, fs in os.walk(repo) for f in fs]

    def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        state["calls"].append(dict(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns))
        if state["fail"]:
            raise state["fail"]
        commit = state.get("commit", COMMIT) if revision in (None, "main") else revision
        snap = tmp_path / "cache" / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit
        for f in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (snap / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / f, snap / f)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


def _run(argv):
    import train

    with one_thread():
        train.main(argv)


def _losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_hub_id_trains_like_the_local_directory(assets, hub, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    _run(train_argv(assets, local, "--steps", "2"))
    assert hub["calls"] == [], "a local directory reached the hub"
    argv = train_argv(assets, remote, "--steps", "2")
    argv[argv.index(assets["model"])] = "org/tiny"
    _run(argv)
    config_only, full = hub["calls"]
    assert config_only == dict(repo_id="org/tiny", revision=None, allow_patterns=["config.json"]), config_only
    assert full["repo_id"] == "org/tiny" and full["revision"] == COMMIT, full   # the same snapshot
    assert "*.safetensors" in full["allow_patterns"] and "*.bin" not in full["allow_patterns"], full
    snapshot = json.load(open(os.path.join(remote, "config.json")))["model"]
    assert snapshot.endswith(os.path.join("snapshots", COMMIT)), snapshot   # the run records what it read
    assert sorted(os.listdir(snapshot)) == sorted(f for f in os.listdir(assets["model"])), os.listdir(snapshot)
    assert _losses(remote) == _losses(local)
    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (local, remote))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    cfg = json.load(open(os.path.join(remote, "adapter", "adapter_config.json")))
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == ("org/tiny", COMMIT), cfg   # what peft fetches
    local_base = json.load(open(os.path.join(local, "adapter", "adapter_config.json")))["base_model_name_or_path"]
    assert local_base == os.path.abspath(assets["model"]), local_base
    # the merge finds the base through the adapter (id and commit): the same weights as the local directory's merge
    from model.merge import main as merge

    for d, extra in ((local, ["--model", assets["model"]]), (remote, [])):
        assert merge(["--adapter", os.path.join(d, "adapter"), "--out", os.path.join(d, "merged"), *extra]) == 0
    assert hub["calls"][-1]["repo_id"] == "org/tiny" and hub["calls"][-1]["revision"] == COMMIT, hub["calls"][-1]
    a, b = (load_file(os.path.join(d, "merged", "model.safetensors")) for d in (local, remote))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the Hub run records its commit, not the files: a base outside the hub cache (or another commit's snapshot) is
    # not known to be it, so is refused until --any-base (until 2026-12-04 any --model merged unchecked)
    into_local = ["--adapter", os.path.join(remote, "adapter"), "--model", assets["model"]]
    capsys.readouterr()
    assert merge([*into_local, "--out", os.path.join(remote, "m2")]) == 2
    assert f"that is the Hub snapshot org/tiny@{COMMIT}" in (err := capsys.readouterr().err) and \
        "a directory outside the hub cache" in err and "--any-base" in err, err
    assert not os.path.exists(os.path.join(remote, "m2"))
    other = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("b" * 40)
    shutil.copytree(assets["model"], other)
    assert merge(["--adapter", os.path.join(remote, "adapter"), "--model", str(other), "--out",
                  os.path.join(remote, "m3")]) == 2
    assert f"this is the snapshot org/tiny@{'b' * 40}" in capsys.readouterr().err
    assert merge([*into_local, "--out", os.path.join(remote, "m4"), "--any-base"]) == 0
    # ... wherever it is run from: a ./org/tiny in the current directory (another model) is not the Hub id (until
    # 2026-12-04 its presence switched the check off, and the merge without --model took it for the base)
    (tmp_path / "cwd" / "org").mkdir(parents=True)
    shutil.copytree(assets["model"], tmp_path / "cwd" / "org" / "tiny")
    here = os.getcwd()
    monkeypatch.chdir(tmp_path / "cwd")
    assert merge([*into_local, "--out", os.path.join(remote, "m5")]) == 2
    assert f"that is the Hub snapshot org/tiny@{COMMIT}" in capsys.readouterr().err
    assert merge(["--adapter", os.path.join(remote, "adapter"), "--out", os.path.join(remote, "m6")]) == 0
    assert hub["calls"][-1]["revision"] == COMMIT, "the merge took ./org/tiny for the base"
    monkeypatch.chdir(here)
    # exporting the Hub run's checkpoint with --model: the snapshot it recorded, not any model (until 2026-12-04 any
    # was taken and named in the adapter, which then merged into it unchecked)
    from parallel.checkpoint_export import export
    with pytest.raises(ValueError, match=f"that is the Hub snapshot org/tiny@{COMMIT}"):
        export(os.path.join(remote, "ckpt"), str(tmp_path / "e1"), model=assets["model"])
    export(os.path.join(remote, "ckpt"), str(tmp_path / "e2"), model=snapshot)
    # resuming with the id again reads the same snapshot: accepted, and one step more as an uninterrupted run would
    _run(argv[:-2] + ["--steps", "3", "--resume", os.path.join(remote, "ckpt")])
    assert len(_losses(remote)) == 3, _losses(remote)


def test_plan_fetches_config_only_and_revisions_pass_through(assets, hub, capsys):
    import train

    train.main(["--plan", "--model", "org/tiny@v1.0", "--data", assets["data"], "--max-len", "64",
                "--global-batch", "8", "--quant", "none", "--dtype", "fp32"])
    assert hub["calls"] == [dict(repo_id="org/tiny", revision="v1.0", allow_patterns=["config.json"])], hub["calls"]
    assert "fits" in capsys.readouterr().out


def test_a_failed_fetch_is_one_clear_error_before_anything(assets, hub, tmp_path):
    import train

    hub["fail"] = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    out = str(tmp_path / "out")
    argv = train_argv(assets, out)
    argv[argv.index(assets["model"])] = "org/tiny"
    with no_weights(), pytest.raises(FileNotFoundError) as e:
        train.main(argv)
    msg = str(e.value)
    assert "'org/tiny'" in msg and "couldn't connect" in msg and "hf download org/tiny" in msg, msg
    assert not os.path.exists(out), "a failed fetch left an output directory"


@pytest.mark.parametrize("name", ["./models/tiny", "/no/such/dir", "tiny", "org/tiny/extra", "org/ti ny"])
def test_paths_never_reach_the_hub(assets, hub, tmp_path, name):
    import train

    argv = train_argv(assets, str(tmp_path / "out"))
    argv[argv.index(assets["model"])] = name
    with no_weights(), pytest.raises(FileNotFoundError, match="does not exist"):
        train.main(argv)
    assert hub["calls"] == [], hub["calls"]


def test_resume_compares_hub_commits_not_cache_paths():
    from parallel.resume import check_resume

    snap = lambda root, commit: os.path.join(root, "models--org--tiny", "snapshots", commit)
    check_resume({"model": snap("/home/a/.cache/huggingface/hub", COMMIT)}, {"model": snap("/scratch/hub", COMMIT)})
    with pytest.raises(ValueError, match="--model: the checkpoint has"):
        check_resume({"model": snap("/scratch/hub", COMMIT)}, {"model": snap("/scratch/hub", "f" * 40)})


def _two_ranks(rank, world, assets, root, mode):
    import huggingface_hub

    import train

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        if mode == "push":   # rank 1 sees the repo after a push
            revision = revision or str(rank) * 40
        elif allow_patterns != ["config.json"] and rank == 1:
            raise OSError("Connection reset by peer")   # rank 1's weights fetch fails
        snap = os.path.join(root, f"models--{repo_id.replace('/', '--')}", "snapshots", revision or COMMIT)
        if not os.path.isdir(snap):   # whole or not there, as the hub's cache: both ranks fetch one snapshot at once,
            tmp = f"{snap}.rank{rank}.tmp"   # and a copy over the other's files let it read one being rewritten
            shutil.copytree(assets["model"], tmp)
            try:
                os.rename(tmp, snap)
            except OSError:   # the other rank's came first
                shutil.rmtree(tmp)
        return snap

    huggingface_hub.snapshot_download = snapshot_download
    argv = train_argv(assets, os.path.join(root, "out"))
    argv[argv.index(assets["model"])] = "org/tiny"
    with no_weights():
        try:
            train.main(argv)
        except (ValueError, FileNotFoundError) as e:
            return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.timeout(300)
def test_ranks_stop_together_on_different_commits_or_one_failed_fetch(assets, tmp_path):
    """Both errors come on every rank alike (no rank left waiting in a collective for one that stopped)."""
    from tests.dist import run_ranks

    msgs = run_ranks(_two_ranks, 2, assets, str(tmp_path / "push"), "push", timeout=240)
    assert msgs[0] == msgs[1] and msgs[0] and "the ranks read different checkpoints" in msgs[0], msgs
    assert "org/tiny@" + "0" * 40 in msgs[0] and "org/tiny@" + "1" * 40 in msgs[0], msgs[0]
    msgs = run_ranks(_two_ranks, 2, assets, str(tmp_path / "fail"), "fail", timeout=240)
    assert msgs[0] == msgs[1] and msgs[0].startswith("FileNotFoundError") and "Connection reset" in msgs[0], msgs
