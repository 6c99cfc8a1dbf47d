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
- `--init-adapter org/x` (model/hub.fetch_adapter; DPO after an SFT adapter pushed to the Hub): only the adapter's
  top-level files are fetched (not a base's weights, a README or a subfolder's adapter); the run = the same run from
  the local folder (losses, adapter, DPO's reference), config.json records the snapshot (hub_snapshot: org/x@commit),
  a resume given the id again finds the reference; ranks on two commits stop with one error; a failed fetch or a
  model's repo is refused before --out exists; `--plan --init-adapter org/x@v1` fetches that revision and checks it.
- `--init-adapter org/x/checkpoint-500` (an adapter in a folder of the repo, peft's subfolder=): that folder's adapter
  files alone fetched (not the top level's, a deeper folder's, its optimizer), the run = the local folder's, the
  snapshot folder recorded (org/x/checkpoint-500@commit); ranks on two commits stop with one error naming it; a
  missing folder, one without an adapter, or a repo with adapters in folders only is one error naming the id, the
  folder and the adapters the repo holds, before --out exists; `--plan` with `@v1` fetches that revision.
- `--push-to-hub org/name[@branch]` (parallel/hub_push.py), with huggingface_hub.HfApi replaced by a stand-in that
  binds each call to the installed HfApi's signature and keeps the uploaded bytes: at the end the repo (and branch) is
  created and OUT/adapter's files are uploaded to its top level, byte for byte, in a commit naming OUT and the step;
  with --keep-best OUT/adapter_best's (not the final adapter); no token, HF_HUB_OFFLINE, a malformed id or branch, or
  --hub-private alone is one error before any weight and before --out exists; a failed upload keeps the adapter and
  metrics, says the `hf upload` retry and exits 2, and a requeue (resume of the finished run) pushes it; on 2 gloo
  ranks rank 0 alone uploads, and a failed upload stops both with its error, none hanging.

Run: .venv/bin/python -m pytest -q tests/test_hub.py
"""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects

from tests.helpers import hub_403, hub_http, no_weights, one_thread, train_argv

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(assets, tmp_path, monkeypatch):
    """The stand-in hub: every snapshot_download call is recorded; `fail` makes the next ones raise."""
    import huggingface_hub

    state = {"calls": [], "fail": None, "repos": {}}   # repos: other repo ids' folders (org/x: an adapter's)

    repo = tmp_path / "repo"   # the repo as the hub holds it: the checkpoint, a Mistral-style consolidated copy of
    shutil.copytree(assets["model"], repo)   # the weights and a subfolder (Llama's original/), which it must skip
    (repo / "consolidated.safetensors").write_bytes(b"not this")
    (repo / "original").mkdir()
    (repo / "original" / "params.json").write_text("{}")

    def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        state["calls"].append(dict(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns))
        if state["fail"]:
            raise state["fail"]
        commit = state.get("commit", COMMIT) if revision in (None, "main") else revision
        snap = tmp_path / "cache" / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit
        src = state["repos"].get(repo_id, repo)
        files = [os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs]
        for f in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (snap / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(src, f), snap / f)
        return str(snap)

    def list_repo_files(repo_id, revision=None, **kw):   # (what an error says the repo holds)
        state["calls"].append(dict(repo_id=repo_id, revision=revision, listed=True))
        src = state["repos"].get(repo_id, repo)
        return sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
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


def test_a_hub_page_address_reads_as_the_id_it_names(assets, hub, capsys):
    """--model and --init-adapter pasted from a browser (https://huggingface.co/ORG/NAME[/tree/REV[/FOLDER]]) are the
    id they name: --plan fetches org/tiny@v1.0's config.json from the page's address as from the id (until 2026-12-06
    the address read as a local path: "no such directory"); --init-adapter's folder and an id's trailing "/" too;
    a folder for --model, a dataset's page and another site are refused at parsing, naming the form."""
    import train

    train.main(["--plan", "--model", "https://huggingface.co/org/tiny/tree/v1.0", "--data", assets["data"],
                "--max-len", "64", "--global-batch", "8", "--quant", "none", "--dtype", "fp32"])
    assert hub["calls"] == [dict(repo_id="org/tiny", revision="v1.0", allow_patterns=["config.json"])], hub["calls"]
    assert "fits" in capsys.readouterr().out
    parse = lambda *a: train.build_parser().parse_args(list(a))   # noqa: E731
    assert parse("--model", "https://huggingface.co/org/tiny/").model == "org/tiny"
    assert parse("--model", "https://hf.co/org/tiny/tree/refs%2Fpr%2F1").model == "org/tiny@refs/pr/1"
    assert parse("--init-adapter", "https://huggingface.co/org/x/tree/main/checkpoint-500").init_adapter == \
        "org/x/checkpoint-500@main"
    assert parse("--init-adapter", "org/x/checkpoint-500/").init_adapter == "org/x/checkpoint-500"
    for flag, bad, said in (("--model", "https://huggingface.co/org/x/tree/main/sub", "pass the repo: org/x@main"),
                            ("--model", "https://huggingface.co/datasets/org/d", "a dataset's page"),
                            ("--init-adapter", "https://example.com/org/x", "not a Hugging Face repo's page")):
        with pytest.raises(SystemExit):
            parse(flag, bad)
        assert said in capsys.readouterr().err, (flag, bad)


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


def test_a_mistyped_local_adapter_path_never_reaches_the_hub(assets, hub, tmp_path, monkeypatch):
    """--init-adapter runs/sft/adapter where ./runs exists but not that folder: a local path that is not there, said
    as such; never a fetch of some Hub repo "runs/sft" (a three-part name reads as a repo folder only when its first
    part is no folder here)."""
    import train

    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/other")
    with no_weights(), pytest.raises((FileNotFoundError, ValueError), match="runs/sft/adapter"):
        train.main(train_argv(assets, str(tmp_path / "out"), "--init-adapter", "runs/sft/adapter"))
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
        if mode in ("push", "adapter", "subfolder"):   # rank 1 sees the repo after a push
            revision = revision or str(rank) * 40
        elif allow_patterns != ["config.json"] and rank == 1:
            raise OSError("Connection reset by peer")   # rank 1's weights fetch fails
        snap = os.path.join(root, f"models--{repo_id.replace('/', '--')}", "snapshots", revision or COMMIT)
        if not os.path.isdir(snap):   # whole or not there, as the hub's cache: both ranks fetch one snapshot at once,
            tmp = f"{snap}.rank{rank}.tmp"   # and a copy over the other's files let it read one being rewritten
            shutil.copytree(assets["model" if mode in ("push", "fail") else "adapter"],
                            os.path.join(tmp, "checkpoint-1") if mode == "subfolder" else tmp)
            try:
                os.rename(tmp, snap)
            except OSError:   # the other rank's came first
                shutil.rmtree(tmp)
        return snap

    huggingface_hub.snapshot_download = snapshot_download
    argv = train_argv(assets, os.path.join(root, "out"))
    if mode in ("adapter", "subfolder"):   # --model a local directory, --init-adapter a Hub id (or a folder in it)
        argv += ["--init-adapter", "org/x" + "/checkpoint-1" * (mode == "subfolder")]
    else:
        argv[argv.index(assets["model"])] = "org/tiny"
    with no_weights():
        try:
            train.main(argv)
        except (ValueError, FileNotFoundError) as e:
            return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["adapter", "subfolder"])
def test_ranks_stop_together_on_different_adapter_commits(assets, sft, tmp_path, mode):
    """--init-adapter org/x (or org/x/checkpoint-1, an adapter in a folder of the repo) fetched at two commits (a push
    between the ranks' fetches): every rank stops with one error naming both, before any weight (not two ranks
    training from different starts)."""
    from tests.dist import run_ranks

    msgs = run_ranks(_two_ranks, 2, {**assets, "adapter": sft}, str(tmp_path / mode), mode, timeout=240)
    assert msgs[0] == msgs[1] and msgs[0] and "--init-adapter: the ranks read different checkpoints" in msgs[0], msgs
    x = "org/x" + "/checkpoint-1" * (mode == "subfolder")
    assert f"{x}@" + "0" * 40 in msgs[0] and f"{x}@" + "1" * 40 in msgs[0] and f"pin one: {x}@<commit>" in msgs[0], \
        msgs[0]


@pytest.mark.timeout(300)
def test_ranks_stop_together_on_different_commits_or_one_failed_fetch(assets, tmp_path):
    """Both errors come on every rank alike (no rank left waiting in a collective for one that stopped)."""
    from tests.dist import run_ranks

    msgs = run_ranks(_two_ranks, 2, assets, str(tmp_path / "push"), "push", timeout=240)
    assert msgs[0] == msgs[1] and msgs[0] and "the ranks read different checkpoints" in msgs[0], msgs
    assert "org/tiny@" + "0" * 40 in msgs[0] and "org/tiny@" + "1" * 40 in msgs[0], msgs[0]
    msgs = run_ranks(_two_ranks, 2, assets, str(tmp_path / "fail"), "fail", timeout=240)
    assert msgs[0] == msgs[1] and msgs[0].startswith("FileNotFoundError") and "Connection reset" in msgs[0], msgs


# ----------------------------------------------------------------------------- --init-adapter org/name


@pytest.fixture(scope="module")
def sft(assets, tmp_path_factory):
    """One SFT step's adapter folder (r 4, as train_argv's runs): what the stand-in hub serves as org/x."""
    out = str(tmp_path_factory.mktemp("sft") / "sft")
    _run(train_argv(assets, out, "--steps", "1"))
    return os.path.join(out, "adapter")


def _push_adapter(hub, assets, sft, root):
    """org/x: the adapter folder as pushed, beside what an adapter fetch must leave: a base's weights, a README, an
    older checkpoint's weights alone in a subfolder, and a trainer's checkpoint-500/ (the adapter, its optimizer,
    and a deeper folder's adapter), which org/x/checkpoint-500 names."""
    repo = root / "adapter_repo"
    shutil.copytree(sft, repo)
    shutil.copy(os.path.join(assets["model"], "model.safetensors"), repo / "model.safetensors")
    (repo / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    (repo / "checkpoint-1").mkdir()
    shutil.copy(os.path.join(sft, "adapter_model.safetensors"), repo / "checkpoint-1")
    shutil.copytree(sft, repo / "checkpoint-500")
    (repo / "checkpoint-500" / "optimizer.pt").write_bytes(b"not this")
    shutil.copytree(sft, repo / "checkpoint-500" / "deeper")
    hub["repos"]["org/x"] = str(repo)


def test_init_adapter_hub_id_trains_like_the_local_folder(assets, hub, sft, tmp_path):
    """DPO after an SFT adapter pushed to the Hub: --init-adapter org/x fetches the adapter files alone, trains to the
    losses and adapter of the same run from the local folder (the policy's start and the reference), records the
    snapshot (its commit), and a resume given the id again finds the same reference."""
    from safetensors.torch import load_file

    from model.hub import hub_snapshot
    from tests.fixtures import make_pairs_jsonl

    _push_adapter(hub, assets, sft, tmp_path)
    make_pairs_jsonl(pairs := str(tmp_path / "pairs.jsonl"), 16, seed=7)
    dpo = lambda out, init, *x: train_argv(assets, str(tmp_path / out), "--objective", "dpo", "--dpo-beta", "0.5",
                                           "--data", pairs, "--steps", "2", "--init-adapter", init, *x)  # noqa: E731
    _run(dpo("local", sft))
    assert hub["calls"] == [], "a local folder reached the hub"
    _run(dpo("remote", "org/x", "--save-every", "1"))
    assert [c["repo_id"] for c in hub["calls"]] == ["org/x"], hub["calls"]   # once, before the process group
    allow = hub["calls"][0]["allow_patterns"]
    assert "adapter_model.safetensors" in allow and "*.safetensors" not in allow, allow   # never a base's weights
    cfg = json.load(open(os.path.join(tmp_path, "remote", "config.json")))
    assert hub_snapshot(cfg["init_adapter"]) == f"org/x@{COMMIT}", cfg["init_adapter"]   # what it started from
    adapter = sorted(f for f in os.listdir(sft) if f != "README.md")   # (its model card: not fetched, not read)
    assert sorted(os.listdir(cfg["init_adapter"])) == adapter, os.listdir(cfg["init_adapter"])
    local = json.load(open(os.path.join(tmp_path, "local", "config.json")))
    assert cfg["dpo_reference"] == local["dpo_reference"] != "base", cfg["dpo_reference"]   # that adapter's bytes
    assert _losses(tmp_path / "remote") == _losses(tmp_path / "local")
    a, b = (load_file(os.path.join(tmp_path, d, "adapter", "adapter_model.safetensors")) for d in ("local", "remote"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a resume given the id again: its reference found (fetched again, the same bytes), step 2 as the run's
    _run(dpo("resumed", "org/x", "--resume", os.path.join(tmp_path, "remote", "ckpt", "step_000001")))
    assert len(hub["calls"]) == 2 and _losses(tmp_path / "resumed") == _losses(tmp_path / "remote")[1:], \
        (hub["calls"], _losses(tmp_path / "resumed"))


def test_init_adapter_in_a_hub_subfolder_trains_like_the_local_folder(assets, hub, sft, tmp_path):
    """--init-adapter org/x/checkpoint-500 (a trainer's checkpoint pushed as a folder; peft's subfolder=): that folder's
    adapter files alone are fetched (not the top level's, another folder's, a deeper one's, nor its optimizer), the run
    = the same run from the local folder (losses, adapter), and config.json records the snapshot's folder (its
    commit: org/x/checkpoint-500@commit)."""
    from safetensors.torch import load_file

    from model.hub import hub_snapshot

    _push_adapter(hub, assets, sft, tmp_path)
    run = lambda out, init: train_argv(assets, str(tmp_path / out), "--steps", "2", "--init-adapter", init)  # noqa
    _run(run("local", sft))
    assert hub["calls"] == [], "a local folder reached the hub"
    _run(run("remote", "org/x/checkpoint-500"))
    [call] = hub["calls"]   # once, before the process group
    assert call["repo_id"] == "org/x" and call["revision"] is None, call
    assert call["allow_patterns"] and all(p.startswith("checkpoint-500/") for p in call["allow_patterns"]), call
    folder = json.load(open(os.path.join(tmp_path, "remote", "config.json")))["init_adapter"]
    assert hub_snapshot(folder, sub=True) == f"org/x/checkpoint-500@{COMMIT}", folder   # what it started from
    snap = os.path.dirname(folder)
    fetched = sorted(os.path.relpath(os.path.join(d, f), snap) for d, _, fs in os.walk(snap) for f in fs)
    assert fetched == sorted(os.path.join("checkpoint-500", f) for f in os.listdir(sft) if f != "README.md"), \
        fetched   # (the adapter's files; its model card is not read)
    assert _losses(tmp_path / "remote") == _losses(tmp_path / "local")
    a, b = (load_file(os.path.join(tmp_path, d, "adapter", "adapter_model.safetensors")) for d in ("local", "remote"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_adapter_subfolder_without_an_adapter_is_one_clear_error(assets, hub, sft, tmp_path):
    """org/x/FOLDER where the repo has no such folder, or one without an adapter (weights alone), and org/y whose
    adapters lie only in folders: one FileNotFoundError naming the id, the folder and the adapters the repo holds,
    before any weight and before --out exists."""
    import train

    _push_adapter(hub, assets, sft, tmp_path)
    shutil.copytree(sft, tmp_path / "y" / "checkpoint-7")   # org/y: a trainer's checkpoints only
    hub["repos"]["org/y"] = str(tmp_path / "y")
    out = str(tmp_path / "out")
    has = "adapters in it: org/x (top level), org/x/checkpoint-500, org/x/checkpoint-500/deeper"
    for name, where, there in (("org/x/checkpoint-9", "in its folder checkpoint-9/", has),
                               ("org/x/checkpoint-1@v2", "in its folder checkpoint-1/", has),
                               ("org/y", "at its top level", "adapters in it: org/y/checkpoint-7")):
        with no_weights(), pytest.raises(FileNotFoundError) as e:
            train.main(train_argv(assets, out, "--init-adapter", name))
        repo, commit = name.split("/checkpoint")[0].split("@")[0], "v2" if "@" in name else COMMIT
        assert f"--init-adapter {name!r}: the Hub repo {repo}@{commit} holds no adapter_config.json and " \
               f"adapter_model.safetensors {where} ({there}): pass a PEFT adapter's repo, or org/name/FOLDER" \
               in str(e.value), str(e.value)
        assert not os.path.exists(out), "a refused --init-adapter left an output directory"


def test_init_adapter_failed_fetch_is_one_clear_error_before_anything(assets, hub, tmp_path):
    """A failed fetch of --init-adapter org/x, or a model's repo given to it, is one FileNotFoundError naming the id
    and the fix, before any weight and before --out exists; a path never reaches the hub."""
    import train

    out = str(tmp_path / "out")
    hub["fail"] = OSError("401 Client Error: Repository Not Found for url: https://huggingface.co/api/models/org/x")
    with no_weights(), pytest.raises(FileNotFoundError) as e:
        train.main(train_argv(assets, out, "--init-adapter", "org/x"))
    msg = str(e.value)
    assert "--init-adapter 'org/x'" in msg and "Repository Not Found" in msg and "hf download org/x" in msg, msg
    assert not os.path.exists(out), "a failed fetch left an output directory"
    hub["fail"] = None   # org/tiny is a model: no adapter at its top level
    with no_weights(), pytest.raises(FileNotFoundError, match=f"'org/tiny': the Hub repo org/tiny@{COMMIT} holds no "
                                                              "adapter_config.json"):
        train.main(train_argv(assets, out, "--init-adapter", "org/tiny"))
    assert not os.path.exists(out)
    hub["calls"].clear()
    with no_weights(), pytest.raises(ValueError, match="no such directory"):
        train.main(train_argv(assets, out, "--init-adapter", "./org/x"))
    assert hub["calls"] == [] and not os.path.exists(out), hub["calls"]


def test_plan_fetches_an_init_adapter_hub_id(assets, hub, sft, tmp_path, capsys):
    """`--plan --init-adapter org/x@v1`: its adapter files at that revision, checked against the model (the planner
    reads its safetensors header) as a run's are."""
    import train

    _push_adapter(hub, assets, sft, tmp_path)
    plan = ["--plan", "--model", assets["model"], "--data", assets["data"], "--max-len", "64", "--global-batch", "8",
            "--quant", "none", "--dtype", "fp32", "--lora-r", "4"]
    train.main([*plan, "--init-adapter", "org/x@v1"])
    train.main([*plan, "--init-adapter", "org/x/checkpoint-500@v1"])   # (an adapter in a folder of the repo)
    assert [(c["repo_id"], c["revision"], c["allow_patterns"][0].split("/")[0]) for c in hub["calls"]] == [
        ("org/x", "v1", "adapter_model.safetensors"), ("org/x", "v1", "checkpoint-500")], hub["calls"]
    assert capsys.readouterr().out.count("fits") >= 2
    with pytest.raises(ValueError, match="r 4 and lora_alpha"):   # the adapter checked: not another run's r
        train.main([*plan[:-1], "8", "--init-adapter", "org/x@v1"])


# ----------------------------------------------------------------------------- --push-to-hub org/name


class _Api:
    """The stand-in for huggingface_hub.HfApi (no hub here): each call bound to the installed HfApi's own signature
    (a keyword it lacks fails), recorded in `state["calls"]`; upload_folder keeps the bytes of the folder's files, as
    they are when it runs, in `state["repo"]`; `state["fail"]` raised by the next call instead."""

    state: dict = {}

    def __getattr__(self, name):
        import inspect

        def call(*a, **kw):
            inspect.signature(getattr(HfApi, name)).bind(self, *a, **kw)   # (the real class, imported above)
            self.state["calls"].append((name, a, kw))
            if self.state.get("fail"):
                raise self.state["fail"]
            if name == "repo_info":   # (create_repo keeps an existing repo's visibility: `public` is one)
                return types.SimpleNamespace(private=not self.state.get("public"))
            if name == "upload_folder":
                root = kw["folder_path"]
                self.state["repo"] = {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                                      for d, _, fs in os.walk(root) for f in fs}
                return type("CommitInfo", (), {"oid": "c" * 40})()
        return call


@pytest.fixture
def hub_api(monkeypatch):
    """The stand-in HfApi, a token in HF_TOKEN (what the start-up check looks for), no offline mode."""
    import huggingface_hub
    from huggingface_hub import constants

    state = {"calls": [], "fail": None}
    monkeypatch.setattr(_Api, "state", state)
    monkeypatch.setattr(huggingface_hub, "HfApi", _Api)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    return state


def _folder(path):
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(path) for f in fs}


def test_push_to_hub_uploads_the_runs_adapter_at_the_end(assets, hub_api, tmp_path, capsys):
    """A 2-step run with --push-to-hub org/lora@exp --hub-private: after training, the repo is created (private,
    exist_ok), the branch too, and OUT/adapter's files go to its top level, byte for byte, in one commit naming OUT and
    the step; the log line says what went where. Without the flag nothing reaches the hub."""
    out = str(tmp_path / "run")
    _run(train_argv(assets, str(tmp_path / "plain"), "--steps", "1"))
    assert hub_api["calls"] == [], hub_api["calls"]
    _run(train_argv(assets, out, "--steps", "2", "--push-to-hub", "org/lora@exp", "--hub-private"))
    names = [c[0] for c in hub_api["calls"]]
    assert names == ["create_repo", "repo_info", "create_branch", "upload_folder"], hub_api["calls"]
    (_, a, kw), _, (_, ba, bkw), (_, _, up) = hub_api["calls"]
    assert a == ("org/lora",) and kw == {"private": True, "exist_ok": True}, (a, kw)
    assert ba == ("org/lora",) and bkw == {"branch": "exp", "exist_ok": True}, (ba, bkw)
    assert up["repo_id"] == "org/lora" and up["revision"] == "exp" and up.get("path_in_repo") is None, up
    assert up["folder_path"] == os.path.join(out, "adapter"), up
    # an earlier push's RoPE overrides or template (this run has neither) go in the same commit; nothing else does
    assert up["delete_patterns"] == ["base_config_overrides.json", "chat_template.jinja"], up
    local = _folder(os.path.join(out, "adapter"))
    assert "adapter_model.safetensors" in local and "adapter_config.json" in local, sorted(local)
    assert hub_api["repo"] == local, "the uploaded bytes are not OUT/adapter's"
    assert up["commit_message"] == f"adapter of {out} at step 2", up["commit_message"]
    said = capsys.readouterr().out
    assert f"pushed: {out}/adapter (adapter of {out} at step 2) to https://huggingface.co/org/lora/tree/exp" in said


def test_push_to_hub_with_keep_best_pushes_adapter_best(assets, hub_api, tmp_path):
    """--keep-best: the run's result is the best evaluation's adapter (TRL's load_best_model_at_end + push_to_hub), so
    OUT/adapter_best is pushed, its bytes, and the commit names it, its step and eval loss (trained on "yes ...",
    evaluated on "no ...": the eval loss rises again after its low, so the best is not the last step)."""
    for word, n in (("yes", 24), ("no", 8)):
        with open(tmp_path / f"{word}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}: say it"},
                                                 {"role": "assistant", "content": " ".join([word] * 6)}]}) + "\n")
    out = str(tmp_path / "run")
    _run(train_argv(assets, out, "--steps", "6", "--eval-every", "1", "--eval-data", str(tmp_path / "no.jsonl"),
                    "--keep-best", "--lr", "0.5", "--data", str(tmp_path / "yes.jsonl"), "--push-to-hub", "org/lora"))
    loss, b = min((r["eval_loss"], r["step"]) for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))))
    assert b != 6, "the eval loss fell to the last step: adapter_best would be the final adapter"
    assert [c[0] for c in hub_api["calls"]] == ["create_repo", "upload_folder"], hub_api["calls"]
    up = hub_api["calls"][-1][2]
    assert up["folder_path"] == os.path.join(out, "adapter_best") and up["revision"] is None, up
    assert hub_api["repo"] == _folder(os.path.join(out, "adapter_best")), "not adapter_best's bytes"
    assert hub_api["repo"] != _folder(os.path.join(out, "adapter")), "adapter_best = the final adapter: no contrast"
    # (the message holds 6 significant digits of the loss, metrics.jsonl 6 decimals of it: the logged value formatted
    # is rounded twice, 5.947815 -> 5.94782 where the message says 5.94781, as since the assets model's attention was
    # sharpened on 2026-12-07; the loss is within 5e-7 of the logged one, so the message's digits are those of one
    # end of that interval)
    ends = {f"adapter_best of {out} at step {b}, eval_loss {x:.6g}" for x in (loss - 5e-7, loss + 5e-7)}
    assert up["commit_message"] in ends, (up["commit_message"], ends)


def test_push_to_hub_refusals_come_before_anything(assets, hub_api, tmp_path, monkeypatch):
    """No token (no HF_TOKEN, no token file), HF_HUB_OFFLINE, a malformed id or branch, --hub-private alone: each one
    error naming the value and the fix, at start-up, before any weight is read and before --out exists."""
    from huggingface_hub import constants

    from tests.helpers import startup_error

    out = str(tmp_path / "run")
    argv = lambda *x: train_argv(assets, out, "--steps", "2", *x)
    for spec, said in (("lora", "the namespace (your user or an org) is needed"),
                       ("datasets/org/lora", "takes ORG/NAME or ORG/NAME@BRANCH"),
                       ("org/lo..ra", "Cannot have -- or .. in repo_id"), ("org/lora@my branch", "is not a branch")):
        assert said in (e := startup_error(argv("--push-to-hub", spec))) and repr(spec) in e, (spec, e)
    assert "pass --push-to-hub ORG/NAME too" in startup_error(argv("--hub-private"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set" in (e := startup_error(argv("--push-to-hub", "org/lora"))) and \
        "hf upload org/lora OUT/adapter ." in e, e
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    e = startup_error(argv("--push-to-hub", "org/lora"))
    assert "--push-to-hub org/lora: no Hugging Face token here" in e and "hf auth login" in e and "HF_TOKEN" in e, e
    assert not os.path.exists(out) and hub_api["calls"] == [], hub_api["calls"]
    (tmp_path / "no_token").write_text("hf_from_login\n")   # `hf auth login`'s file is a token too: past the check
    with pytest.raises(ValueError, match="missing.jsonl does not exist"):   # (checked after the token)
        _run(argv("--push-to-hub", "org/lora", "--data", str(tmp_path / "missing.jsonl")))


def test_a_failed_push_keeps_the_run_and_says_the_retry(assets, hub_api, tmp_path, capsys):
    """The upload fails (a 401): the adapter and metrics.jsonl stay as written, the `error:` line names the repo, the
    error and the `hf upload` command that retries it, and the run exits 2 (documented: a job whose adapter did not
    reach the hub fails). A requeue resuming the finished run trains nothing and pushes the same adapter."""
    from huggingface_hub.errors import HfHubHTTPError

    import train

    httpx2 = hub_http()   # (httpx under huggingface_hub 1.x)

    out = str(tmp_path / "run")
    url = "https://huggingface.co/api/repos/create"
    hub_api["fail"] = HfHubHTTPError(f"401 Client Error: Unauthorized for url: {url}",
                                     response=httpx2.Response(401, request=httpx2.Request("POST", url)))
    argv = train_argv(assets, out, "--steps", "2", "--push-to-hub", "org/lora")
    capsys.readouterr()
    with one_thread():
        assert train.cli(argv) == 2
    err = capsys.readouterr().err
    line = next((x for x in err.splitlines() if x.startswith("error: --push-to-hub org/lora: uploading")), None)
    assert line and "401 Client Error: Unauthorized" in line and "metrics.jsonl are on disk" in line, err
    import shlex
    retry = shlex.split(line.split("Retry: ", 1)[1])
    assert retry == ["hf", "upload", "org/lora", os.path.join(out, "adapter"), ".", "--commit-message",
                     f"adapter of {out} at step 2", "--delete", "base_config_overrides.json", "--delete",
                     "chat_template.jinja"], retry   # (an earlier push's files this adapter has not: gone with it)
    kept = _folder(os.path.join(out, "adapter"))
    assert "adapter_model.safetensors" in kept and len(_losses(out)) == 2, (sorted(kept), _losses(out))
    hub_api["fail"], hub_api["calls"] = None, []
    _run(argv + ["--resume", os.path.join(out, "ckpt")])
    assert [c[0] for c in hub_api["calls"]] == ["create_repo", "upload_folder"], hub_api["calls"]
    assert hub_api["repo"] == kept and len(_losses(out)) == 2, "the requeue's push is not the run's adapter"


def _push_ranks(rank, world, assets, root, fail):
    import huggingface_hub

    import train

    class Api(_Api):
        state = {"calls": [], "fail": OSError("Connection reset by peer") if fail else None}

    huggingface_hub.HfApi = Api
    os.environ["HF_TOKEN"] = "hf_stand_in"
    try:
        train.main(train_argv(assets, os.path.join(root, "out"), "--steps", "2", "--push-to-hub", "org/lora"))
    except ValueError as e:
        return [c[0] for c in Api.state["calls"]], f"{type(e).__name__}: {e}"
    return [c[0] for c in Api.state["calls"]], None


@pytest.mark.timeout(300)
def test_push_to_hub_on_two_ranks_uploads_once_and_fails_together(assets, tmp_path):
    """2 gloo ranks: rank 0 alone uploads (once); a failed upload stops both ranks with its error (rank 1 quoting rank
    0's), neither left waiting in a collective, the adapter on disk."""
    from tests.dist import run_ranks

    got = run_ranks(_push_ranks, 2, assets, str(tmp_path / "ok"), False, timeout=240)
    assert got == [(["create_repo", "upload_folder"], None), ([], None)], got
    got = run_ranks(_push_ranks, 2, assets, str(tmp_path / "fail"), True, timeout=240)
    assert got[0][0] == ["create_repo"] and got[1][0] == [], got
    assert got[0][1].startswith("PushFailed: --push-to-hub org/lora: uploading") and "Connection reset" in got[0][1]
    assert got[1][1].startswith("ValueError: finishing") and "failed on rank 0 (PushFailed: --push-to-hub" in \
        got[1][1], got[1][1]
    assert os.path.isfile(tmp_path / "fail" / "out" / "adapter" / "adapter_model.safetensors")


def test_a_failed_push_says_the_hubs_reason(hub_api, tmp_path):
    """A token that may not write to the org: the hub's 403, as huggingface_hub raises it (its first line is the
    request id alone, the reason after), is said in full in the error, with the retry."""
    from parallel.hub_push import PushFailed, push

    why = "You don't have the rights to create a commit in org/lora"
    url = "https://huggingface.co/api/models/org/lora/preupload/main"
    hub_api["fail"] = hub_403(why, "POST", url)
    (tmp_path / "adapter").mkdir()
    with pytest.raises(PushFailed) as e:
        push(types.SimpleNamespace(push_to_hub="org/lora", hub_private=False, out=str(tmp_path)), None, print)
    assert f"failed (HfHubHTTPError: (Request ID: Root=1-abc) 403 Forbidden: {why}. Cannot access content at: {url}. " \
           "Make sure your token has the correct permissions.). The run finished" in str(e.value), str(e.value)
    assert "Retry: hf upload org/lora" in str(e.value), str(e.value)


def test_hub_private_onto_an_existing_public_repo_uploads_nothing(hub_api, tmp_path):
    """huggingface_hub's create_repo ignores `private` for a repo that exists (its docstring, checked here): with
    --hub-private and org/lora public, nothing is uploaded and the error says so, and how to go on."""
    import inspect

    from parallel.hub_push import PushFailed, push

    assert "ignored if the repo already exists" in inspect.getdoc(HfApi.create_repo)
    hub_api["public"] = True
    (tmp_path / "adapter").mkdir()
    with pytest.raises(PushFailed) as e:
        push(types.SimpleNamespace(push_to_hub="org/lora@exp", hub_private=True, out=str(tmp_path)), None, print)
    assert [c[0] for c in hub_api["calls"]] == ["create_repo", "repo_info"], hub_api["calls"]
    assert "https://huggingface.co/org/lora exists and is public" in str(e.value) and \
        "Make the repo private (https://huggingface.co/org/lora/settings), then: hf upload org/lora" in str(e.value) \
        and "--private" in str(e.value), str(e.value)
    hub_api["public"], hub_api["calls"] = False, []   # private (or created now): pushed
    push(types.SimpleNamespace(push_to_hub="org/lora", hub_private=True, out=str(tmp_path)), None, print)
    assert [c[0] for c in hub_api["calls"]] == ["create_repo", "repo_info", "upload_folder"], hub_api["calls"]
