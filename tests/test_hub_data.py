"""`--data hf://datasets/ORG/NAME[@REVISION]/PATH`: a Hub dataset's files, fetched at start-up (data/hub_data.py).

Pins, with huggingface_hub's dataset_info, list_repo_files and snapshot_download replaced by a local stand-in (no
hub here) whose commits are folders, and whose snapshot_download copies what its allow_patterns select
(huggingface_hub's own filter_repo_objects) into <cache>/datasets--o--n/snapshots/<commit>/:
- a glob of two Parquet files trains to the losses of the same two files passed by hand, fetching those files alone
  (not a deeper folder's, the README, another split's) at the one commit its revision resolved to; config.json
  records the snapshot's files and the entry pinned to its commit;
- PATH's glob matches what Python's glob(recursive=True) matches in the same tree (`*` within a folder, `**` across);
- `@v1` pins that revision's commit; a --data-weights weight applies to each file its entry gives; --eval-data takes
  an entry too; a glob matching nothing is refused before any download, naming the repo, commit and its files; a
  failed fetch is one error naming the URL and the fix; neither leaves an --out;
- 2 gloo ranks that resolve different commits (a push between) stop together with one error naming both;
- a resume given the URL again resumes while the repo has not moved (or moved without touching the files), and is
  refused, naming `@<commit>` to pin, once it moved on; the pin resumes;
- `python -m data.show --data hf://...` shows the files the URL gives.

Run: .venv/bin/python -m pytest -q tests/test_hub_data.py
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub.utils import filter_repo_objects

from tests.helpers import hub_403, no_weights, one_thread, startup_error, train_argv

URL = "hf://datasets/o/n/data/*.parquet"


def _parquet(src: str, path, lo: int, hi: int) -> None:
    rows = [json.loads(line) for line in open(src)][lo:hi]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _serve(state, root):
    """The stand-in's three functions over `state` (commits: {commit: folder}, tags, head); every call recorded."""
    def resolve(revision):
        commit = state["head"] if revision in (None, "main") else state["tags"].get(revision, revision)
        if commit not in state["commits"]:
            raise OSError(f"Revision Not Found for url: {revision}")
        return commit

    def dataset_info(repo_id, revision=None, **kw):
        state["calls"].append(("info", repo_id, revision))
        if state["fail"]:
            raise state["fail"]
        return types.SimpleNamespace(sha=resolve(revision))

    def files(commit):
        src = state["commits"][commit]
        return sorted(os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/") for d, _, fs in os.walk(src)
                      for f in fs)

    def list_repo_files(repo_id, revision=None, repo_type=None, **kw):
        state["calls"].append(("list", repo_id, revision, repo_type))
        return files(resolve(revision))

    def snapshot_download(repo_id, repo_type=None, revision=None, allow_patterns=None, **kw):
        state["calls"].append(("download", repo_id, revision, repo_type, allow_patterns))
        commit = resolve(revision)
        snap = os.path.join(root, "cache", f"{repo_type}s--{repo_id.replace('/', '--')}", "snapshots", commit)
        for f in filter_repo_objects(files(commit), allow_patterns=allow_patterns):
            os.makedirs(os.path.dirname(os.path.join(snap, f)), exist_ok=True)
            shutil.copy(os.path.join(state["commits"][commit], f), os.path.join(snap, f))
        return snap
    return dataset_info, list_repo_files, snapshot_download


@pytest.fixture
def hub(assets, tmp_path, monkeypatch):
    """The stand-in hub, its head commit "a"*40 (tag v1): data/train-0000{0,1}.parquet (the chat records' halves),
    beside files a `data/*.parquet` fetch must leave: a deeper folder's Parquet, a README, an eval split."""
    import huggingface_hub

    repo = tmp_path / "repo_a"
    _parquet(assets["data"], repo / "data" / "train-00000.parquet", 0, 20)
    _parquet(assets["data"], repo / "data" / "train-00001.parquet", 20, 40)
    _parquet(assets["data"], repo / "data" / "extra" / "more.parquet", 0, 5)
    _parquet(assets["data"], repo / "eval" / "test.parquet", 30, 40)
    (repo / "README.md").write_text("---\nconfigs: []\n---\n")
    state = {"calls": [], "fail": None, "commits": {"a" * 40: str(repo)}, "tags": {"v1": "a" * 40}, "head": "a" * 40}
    for name, fn in zip(("dataset_info", "list_repo_files", "snapshot_download"), _serve(state, str(tmp_path))):
        monkeypatch.setattr(huggingface_hub, name, fn)

    def push(commit, change):   # a new head: the repo copied, then `change(folder)`
        shutil.copytree(repo, new := tmp_path / f"repo_{commit[0]}")
        change(new)
        state["commits"][commit], state["head"] = str(new), commit
    state["push"] = push
    return state


def _losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_glob_trains_like_its_files_passed_by_hand(assets, hub, tmp_path):
    """train.py, 1 process, 2 steps: `--data hf://datasets/o/n/data/*.parquet` = `--data train-00000.parquet
    train-00001.parquet`, and only those two files are fetched, at the commit resolved once."""
    import train

    local = [os.path.join(hub["commits"]["a" * 40], "data", f"train-0000{i}.parquet") for i in (0, 1)]
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "local"), "--data", *local, "--steps", "2"))
        assert hub["calls"] == [], "local files reached the hub"
        train.main(train_argv(assets, str(tmp_path / "hub"), "--data", URL, "--steps", "2"))
    names = ["data/train-00000.parquet", "data/train-00001.parquet"]
    assert hub["calls"] == [("info", "o/n", None), ("list", "o/n", "a" * 40, "dataset"),
                            ("download", "o/n", "a" * 40, "dataset", names)], hub["calls"]
    snap = tmp_path / "cache" / "datasets--o--n" / "snapshots" / ("a" * 40)
    fetched = sorted(os.path.relpath(f, snap) for f in glob.glob(str(snap / "**"), recursive=True) if os.path.isfile(f))
    assert fetched == names, f"fetched more (or less) than the glob matched: {fetched}"
    assert len(_losses(tmp_path / "local")) == 2 and _losses(tmp_path / "hub") == _losses(tmp_path / "local")
    cfg = json.load(open(tmp_path / "hub" / "config.json"))
    assert cfg["data"] == [str(snap / n) for n in names], cfg["data"]   # the files read (the path names the commit)
    assert cfg["hub_data"] == {"--data": [f"hf://datasets/o/n@{'a' * 40}/data/*.parquet"]}, cfg["hub_data"]


@pytest.mark.parametrize("pattern", ["data/*.parquet", "**/*.parquet", "data/**", "**", "*", "data/train-0000[1]*",
                                     "d?ta/*/*.parquet", "**/extra/*", "data/**/*.parquet", "README.md", "eval"])
def test_a_glob_matches_what_pythons_recursive_glob_matches(hub, pattern):
    from data.hub_data import matches

    tree = hub["commits"]["a" * 40]
    files = [os.path.relpath(os.path.join(d, f), tree) for d, _, fs in os.walk(tree) for f in fs]
    want = sorted(f for f in glob.glob(pattern, root_dir=tree, recursive=True, include_hidden=True)
                  if os.path.isfile(os.path.join(tree, f)))
    assert sorted(f for f in files if matches(pattern, f)) == want


def test_revision_pins_weights_apply_per_file_and_eval_data(assets, hub, tmp_path):
    """`@v1` is resolved to its commit once, and its files come from that commit while the head has moved on; a
    --data-weights weight covers each file of its entry; --eval-data's entry resolves alike; a weight count that fits
    neither the entries nor the files is refused before any hub call."""
    import train
    from parallel import preflight

    hub["push"]("b" * 40, lambda d: (d / "data" / "train-00001.parquet").unlink())   # head: one train file
    argv = train_argv(assets, str(tmp_path / "out"), "--data", "hf://datasets/o/n@v1/data/train-*.parquet",
                      assets["data"], "--data-weights", "2", "1", "--eval-data", "hf://datasets/o/n/eval/test.parquet")
    args, _ = preflight.parse(train.build_parser(), argv, train.DEMO)
    with no_weights():
        preflight.check_start(args, demo=False)
    snap = lambda c: str(tmp_path / "cache" / "datasets--o--n" / "snapshots" / (c * 40))
    assert args.data == [f"{snap('a')}/data/train-0000{i}.parquet" for i in (0, 1)] + [assets["data"]], args.data
    assert args.data_weights == [2, 2, 1], args.data_weights
    assert args.eval_data == f"{snap('b')}/eval/test.parquet", args.eval_data
    assert ("info", "o/n", "v1") in hub["calls"] and ("download", "o/n", "a" * 40, "dataset", [
        "data/train-00000.parquet", "data/train-00001.parquet"]) in hub["calls"], hub["calls"]
    assert args.hub_data == {"--data": [f"hf://datasets/o/n@{'a' * 40}/data/train-*.parquet"],
                             "--eval-data": [f"hf://datasets/o/n@{'b' * 40}/eval/test.parquet"]}, args.hub_data
    hub["calls"].clear()
    msg = startup_error(train_argv(assets, str(tmp_path / "w"), "--data", URL, "--data-weights", "1", "1"))
    assert "--data-weights gives 2 weights for 1 --data file" in msg, msg
    assert hub["calls"] == [], hub["calls"]


def test_a_glob_matching_nothing_is_refused_before_any_download(assets, hub, tmp_path):
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", assets["data"], "hf://datasets/o/n/data/*.jsonl"))
    assert f"no file of the dataset o/n at commit {'a' * 40} matches 'data/*.jsonl'" in msg, msg
    assert "README.md, data/extra/more.parquet" in msg and "** crosses folders" in msg, msg   # what it holds, the rule
    assert [c[0] for c in hub["calls"]] == ["info", "list"], hub["calls"]
    assert not os.path.exists(out)


def test_a_download_that_comes_back_short_is_one_clear_error(assets, hub, tmp_path, monkeypatch):
    """huggingface_hub's snapshot_download returns an older partial snapshot folder unchecked when the Hub goes away
    between the listing and the fetch: a matched file missing there is one error naming it and the fix, before
    anything is written (not a later "does not exist" naming a cache path)."""
    import huggingface_hub

    real = huggingface_hub.snapshot_download

    def short(*a, **kw):   # the second matched file never arrives
        snap = real(*a, **kw)
        os.remove(os.path.join(snap, "data", "train-00001.parquet"))
        return snap
    monkeypatch.setattr(huggingface_hub, "snapshot_download", short)
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", "hf://datasets/o/n/data/*.parquet"))
    assert f"download of commit {'a' * 40} came back without data/train-00001.parquet" in msg, msg
    assert "hf download --repo-type dataset" in msg and not os.path.exists(out), msg


def test_a_failed_fetch_is_one_clear_error_before_anything(assets, hub, tmp_path):
    hub["fail"] = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", URL))
    assert msg.startswith(f"--data {URL}: fetching it from the Hugging Face Hub failed (OSError: We couldn't"), msg
    assert "`hf auth login`" in msg and "`hf download --repo-type dataset o/n --include 'data/*.parquet'`" in msg, msg
    assert not os.path.exists(out), "a failed fetch left an output directory"
    assert "hf://datasets/ORG/NAME[@REVISION]/PATH" in startup_error(train_argv(assets, out, "--data", "hf://o/n/x"))


def _two_ranks(rank, world, assets, root, repo):
    import huggingface_hub

    import train
    from data.hub_data import same_commits

    same = types.SimpleNamespace(hub_data={"--data": ["hf://datasets/o/n@" + "a" * 40 + "/x.parquet"]})
    assert same_commits(same) is None, f"rank {rank}: one commit refused"
    commit = str(rank) * 40   # rank 1 looks the repo up after a push
    state = {"calls": [], "fail": None, "commits": {commit: repo}, "tags": {}, "head": commit}
    huggingface_hub.dataset_info, huggingface_hub.list_repo_files, huggingface_hub.snapshot_download = \
        _serve(state, root)
    with no_weights():
        try:
            train.main(train_argv(assets, os.path.join(root, "out"), "--data", URL))
        except (ValueError, FileNotFoundError) as e:
            return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.timeout(300)
def test_ranks_on_two_commits_stop_together(assets, hub, tmp_path):
    from tests.dist import run_ranks

    msgs = run_ranks(_two_ranks, 2, assets, str(tmp_path), hub["commits"]["a" * 40], timeout=240)
    assert msgs[0] == msgs[1] and msgs[0] and "the ranks read different commits of the Hub dataset" in msgs[0], msgs
    assert all(f"hf://datasets/o/n@{c * 40}/data/*.parquet" in msgs[0] for c in "01"), msgs[0]
    assert "pin one: hf://datasets/ORG/NAME@<commit>/PATH" in msgs[0], msgs[0]


def test_resume_refused_once_the_repo_moved_on_and_the_pin_resumes(assets, hub, tmp_path):
    import train
    from parallel import preflight

    out = str(tmp_path / "run")
    with one_thread():
        train.main(train_argv(assets, out, "--data", URL, "--steps", "1"))
    again = lambda url="hf://datasets/o/n/data/*.parquet": train_argv(
        assets, out, "--data", url, "--steps", "2", "--resume", os.path.join(out, "ckpt"))

    def starts(argv):
        with no_weights():
            return preflight.check_start(train.build_parser().parse_args(argv), demo=False)[1]
    assert starts(again()).endswith("step_000001")   # not moved
    hub["push"]("b" * 40, lambda d: (d / "README.md").write_text("edited"))   # moved, the files' bytes the same
    assert starts(again()).endswith("step_000001")
    hub["push"]("c" * 40, lambda d: _parquet(assets["data"], d / "data" / "train-00001.parquet", 20, 39))
    msg = startup_error(again())
    assert f"--data {URL}: the dataset has moved on since the checkpoint's run (its commit {'a' * 40}, now " \
           f"{'c' * 40})" in msg, msg
    assert f"pin its commit, --data hf://datasets/o/n@{'a' * 40}/data/*.parquet" in msg, msg
    assert starts(again(f"hf://datasets/o/n@{'a' * 40}/data/*.parquet")).endswith("step_000001")


def test_data_show_reads_the_files_a_url_gives(assets, hub, tmp_path, capsys):
    """`python -m data.show --data hf://...` prints what it prints for the matched files passed by hand."""
    from data.show import main as show

    local = [os.path.join(hub["commits"]["a" * 40], "data", f"train-0000{i}.parquet") for i in (0, 1)]
    said = []
    for data in (local, [URL]):
        assert show(["--model", assets["model"], "--data", *data, "--n", "1", "--max-len", "64", "--no-color"]) == 0
        said.append(capsys.readouterr().out)
    snap = str(tmp_path / "cache" / "datasets--o--n" / "snapshots" / ("a" * 40))
    fetching = f"--data {URL}: fetching 2 files of commit {'a' * 40} from the Hugging Face Hub\n"
    assert "train-00001.parquet" in said[0] and said[1] == fetching + said[0].replace(hub["commits"]["a" * 40], snap)


def test_a_403s_reason_is_in_the_error(hub):
    """A fine-grained token without gated-repo access: the hub's 403, as huggingface_hub raises it (its first line is
    the request id alone, the reason on the lines after), is said in full, not as "(Request ID: ...)"."""
    from data.hub_data import resolve

    why = "Please enable access to public gated repositories in your fine-grained token settings to view this repo"
    url = "https://huggingface.co/api/datasets/o/n"
    hub["fail"] = hub_403(why, "GET", url)
    with pytest.raises(FileNotFoundError) as e:
        resolve(types.SimpleNamespace(data=URL, eval_data=None, data_weights=None))
    assert f"(HfHubHTTPError: (Request ID: Root=1-abc) 403 Forbidden: {why}. Cannot access content at: {url}." in \
        str(e.value) and "`hf auth login`" in str(e.value), str(e.value)
