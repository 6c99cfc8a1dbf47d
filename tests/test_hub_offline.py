"""HF_HUB_OFFLINE=1 (a compute node without network, after a login node fetched): `--data hf://...` and `--model
org/name` read huggingface_hub's cache (data/hub_data.py's offline contract, model/hub.py).

The cache is written by the real huggingface_hub (its dataset_info, list_repo_files, snapshot_download: blobs/,
snapshots/<commit>/ links, trees/<commit>.json, refs/) talking HTTP to a stand-in Hub (an httpx MockTransport set as
the library's client, with the library's own request hook, serving folders as commits); offline is the library's
own switch (`constants.HF_HUB_OFFLINE`), under which that hook stops any request before it reaches the stand-in. Pins:
- a run of `--data hf://datasets/o/n/data/*.parquet` offline, after the same command ran online, reads the same
  files, records the same pin and trains to the same losses, with no HTTP call, and says how many files of which
  commit it read; a resume of the online run given the URL offline resumes;
- a cache filled as `hf download` fills it (snapshot_download at the branch, its refs/main) is read offline; a tag
  fetched online and a short commit resolve; without the cached listing the glob matches the files cached and says
  so;
- a glob's file the cache lacks (a partial fetch), a revision not cached, a repo never fetched: one error naming the
  URL, the cache folder and `hf download`, before --out exists;
- `--model o/m` (and `--init-adapter o/x`) fetched online train offline from the cache to the same losses.

Run: .venv/bin/python -m pytest -q tests/test_hub_offline.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest

from tests.helpers import hub_http, no_weights, one_thread, startup_error, train_argv
from tests.test_hub_data import _parquet

URL = "hf://datasets/o/n/data/*.parquet"
A, B = "a" * 40, "b" * 40


@pytest.fixture
def hub(assets, tmp_path, monkeypatch):
    """The stand-in Hub over HTTP: repos {"datasets/o/n": {"refs": {...}, "commits": {commit: folder}}}; every
    request recorded in calls. The hub's cache: tmp_path/hf. `offline(True)` sets the library's switch."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

    httpx2 = hub_http()   # (httpx under huggingface_hub 1.x)

    repo = tmp_path / "repo_a"   # o/n at commit A (tag v1): two train files, a deeper one, a README
    _parquet(assets["data"], repo / "data" / "train-00000.parquet", 0, 20)
    _parquet(assets["data"], repo / "data" / "train-00001.parquet", 20, 40)
    _parquet(assets["data"], repo / "data" / "extra" / "more.parquet", 0, 5)
    (repo / "README.md").write_text("---\nconfigs: []\n---\n")
    state = {"calls": [], "repos": {"datasets/o/n": {"refs": {"main": A, "v1": A}, "commits": {A: str(repo)}}}}

    def files(folder):
        return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/") for d, _, fs in os.walk(folder)
                      for f in fs)

    def commit_of(r, rev):
        c = r["refs"].get(rev, rev)
        hit = [k for k in r["commits"] if k.startswith(c)] if len(c) >= 4 else []
        return hit[0] if len(hit) == 1 else None

    def answer(request):
        state["calls"].append((request.method, request.url.path))
        m = re.fullmatch(r"/api/(models|datasets)/(\w+/\w+)(?:/(revision|tree)/([^/]+))?(/.*)?", request.url.path) \
            or re.fullmatch(r"/(?:(datasets)/)?(\w+/\w+)/(resolve)/([^/]+)/(.+)", request.url.path)
        kind, name, what, rev, rest = m.groups() if m else (None,) * 5
        r = state["repos"].get(f"{kind or 'models'}/{name}")
        commit = commit_of(r, rev or "main") if r else None
        if commit is None:
            return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound" if r else "RepoNotFound"},
                                   json={"error": f"no {name} {rev}"})
        folder = r["commits"][commit]
        if what in (None, "revision"):
            return httpx2.Response(200, json={"id": name, "sha": commit, "siblings": [
                {"rfilename": f} for f in files(folder)]})
        if what == "tree":
            return httpx2.Response(200, json=[{"type": "file", "path": f, "size": os.path.getsize(
                os.path.join(folder, f)), "oid": hashlib.sha1(open(os.path.join(folder, f), "rb").read()).hexdigest()}
                for f in files(folder)])
        body = open(os.path.join(folder, rest), "rb").read()
        return httpx2.Response(200, content=b"" if request.method == "HEAD" else body, headers={
            "X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"', "Content-Length": str(len(body))})

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(   # (the library's hook: offline, no request goes out)
        transport=httpx2.MockTransport(answer), event_hooks={"request": [hf_request_event_hook]},
        follow_redirects=True))
    state["offline"] = lambda on: monkeypatch.setattr(constants, "HF_HUB_OFFLINE", on)
    state["store"] = str(tmp_path / "hf" / "datasets--o--n")
    yield state
    huggingface_hub.set_client_factory(default_client_factory)


def _losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def _starts(argv):
    import train
    from parallel import preflight

    args, _ = preflight.parse(train.build_parser(), argv, train.DEMO)
    with no_weights():
        resume = preflight.check_start(args, demo=False)[1]
    return args, resume


def test_the_command_that_ran_online_runs_offline_from_the_cache(assets, hub, tmp_path, capsys):
    import train

    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "online"), "--data", URL, "--steps", "2"))
        assert any(c[0] == "GET" and "/resolve/" in c[1] for c in hub["calls"]), hub["calls"]   # fetched over HTTP
        hub["calls"].clear()
        hub["offline"](True)
        capsys.readouterr()
        train.main(train_argv(assets, str(tmp_path / "offline"), "--data", URL, "--steps", "2"))
    assert hub["calls"] == [], f"offline, the library was asked over HTTP: {hub['calls']}"
    assert f"--data {URL}: HF_HUB_OFFLINE: 2 files of commit {A} read from the Hugging Face cache\n" in \
        capsys.readouterr().out
    on, off = (json.load(open(tmp_path / d / "config.json")) for d in ("online", "offline"))
    snap = os.path.join(hub["store"], "snapshots", A)
    assert off["data"] == on["data"] == [f"{snap}/data/train-0000{i}.parquet" for i in (0, 1)], off["data"]
    assert off["hub_data"] == on["hub_data"] == {"--data": [f"hf://datasets/o/n@{A}/data/*.parquet"]}
    assert len(_losses(tmp_path / "online")) == 2 and _losses(tmp_path / "offline") == _losses(tmp_path / "online")
    # a resume of the online run, the URL given offline: the pin compared, no network
    args, resume = _starts(train_argv(assets, str(tmp_path / "online"), "--data", URL, "--steps", "3", "--resume",
                                      str(tmp_path / "online" / "ckpt")))
    assert resume.endswith("step_000002") and args.hub_data == on["hub_data"] and hub["calls"] == []


def test_a_cache_filled_by_hf_download_tags_and_short_commits(assets, hub, tmp_path, capsys, monkeypatch):
    """`hf download --repo-type dataset o/n --include 'data/*'` (snapshot_download at the main branch: refs/main) is
    read offline; a tag an online run resolved and a short commit resolve offline too; without the listing the cache
    keeps of a commit the glob matches the files cached, said on the start-up line."""
    import huggingface_hub

    huggingface_hub.snapshot_download("o/n", repo_type="dataset", allow_patterns=["data/*"])
    hub["repos"]["datasets/o/n"]["commits"][B] = hub["repos"]["datasets/o/n"]["commits"][A]   # main moved on (B)
    hub["repos"]["datasets/o/n"]["refs"]["main"] = B
    _starts(train_argv(assets, str(tmp_path / "w"), "--data", "hf://datasets/o/n@v1/data/train-00000.parquet"))
    hub["offline"](True)
    hub["calls"].clear()
    pinned = {}
    for rev in ("", "@v1", "@aaaaaaa", "@" + A):
        args, _ = _starts(train_argv(assets, str(tmp_path / "w"), "--data", f"hf://datasets/o/n{rev}/data/**"))
        pinned[rev] = args.hub_data["--data"][0], args.data
    snap = os.path.join(hub["store"], "snapshots", A)
    want = [f"{snap}/data/extra/more.parquet"] + [f"{snap}/data/train-0000{i}.parquet" for i in (0, 1)]
    assert all(p == (f"hf://datasets/o/n@{A}/data/**", want) for p in pinned.values()), pinned
    assert hub["calls"] == [], hub["calls"]
    shutil.rmtree(os.path.join(hub["store"], "trees"))   # (an older huggingface_hub keeps no listing)
    monkeypatch.setattr(huggingface_hub._tree_cache, "_IN_MEMORY_TREE_CACHE", {})   # (nor the library's memory)
    capsys.readouterr()
    assert _starts(train_argv(assets, str(tmp_path / "w"), "--data", URL))[0].data == want[1:]
    assert "2 files of commit " + A + " read from the Hugging Face cache (the cache keeps no listing of that commit: " \
        "PATH was matched among its files cached, which can be fewer than the repo holds)" in capsys.readouterr().out


def test_what_the_cache_lacks_is_one_error_before_anything(assets, hub, tmp_path):
    """A glob whose second file was never fetched (the commit's cached listing names it), a revision not cached, a repo
    never fetched: one error naming the URL, the cache folder and the fix; no --out."""
    import train

    with no_weights():   # online: one file of the two the glob matches
        _starts(train_argv(assets, str(tmp_path / "w"), "--data", "hf://datasets/o/n/data/train-00000.parquet"))
    hub["offline"](True)
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", URL))
    assert msg.startswith(f"--data {URL}: HF_HUB_OFFLINE is set and its commit {A}'s snapshot lacks 1 of the 2 files "
                          f"'data/*.parquet' matches (data/train-00001.parquet: a partial fetch) in the Hugging Face "
                          f"cache {hub['store']}; run the same command once where the Hub can be reached"), msg
    assert "`hf download --repo-type dataset o/n --revision main --include 'data/*.parquet'`" in msg, msg
    msg = startup_error(train_argv(assets, out, "--data", "hf://datasets/o/n@v2/data/*.parquet"))
    assert f"HF_HUB_OFFLINE is set and its revision 'v2' is not (branches and tags cached: main; commits: {A}) in " \
           f"the Hugging Face cache {hub['store']};" in msg and "--revision v2 " in msg, msg
    msg = startup_error(train_argv(assets, out, "--data", "hf://datasets/o/gone/x.parquet"))
    assert "hf://datasets/o/gone/x.parquet: HF_HUB_OFFLINE is set and the dataset was never fetched in the " \
           f"Hugging Face cache {os.path.dirname(hub['store'])}/datasets--o--gone;" in msg, msg
    assert not os.path.exists(out) and train   # nothing written


def test_a_hub_model_and_adapter_fetched_online_train_offline(assets, hub, tmp_path, capsys):
    """`--model o/m` and `--init-adapter o/x` (fetched online by a first run) train offline from the cache to the
    online run's losses, with no HTTP call."""
    import train

    shutil.copytree(assets["model"], tmp_path / "m")
    hub["repos"]["models/o/m"] = {"refs": {"main": A}, "commits": {A: str(tmp_path / "m")}}
    with one_thread():
        train.main(train_argv(assets, str(tmp_path / "sft"), "--steps", "1"))
        hub["repos"]["models/o/x"] = {"refs": {"main": B}, "commits": {B: str(tmp_path / "sft" / "adapter")}}
        argv = lambda out: [*train_argv(assets, out, "--steps", "2", "--init-adapter", "o/x")[2:], "--model", "o/m"]
        train.main(argv(str(tmp_path / "online")))
        hub["offline"](True)
        hub["calls"].clear()
        capsys.readouterr()
        train.main(argv(str(tmp_path / "offline")))
    assert hub["calls"] == [], hub["calls"]
    said = capsys.readouterr().out   # (offline, the cache is read: the log says so, not "fetching")
    assert "--model o/m: no such directory here; reading its weights and tokenizer from the Hugging Face cache " \
        "(HF_HUB_OFFLINE)" in said and "from the Hugging Face Hub" not in said, said
    assert len(_losses(tmp_path / "online")) == 2 and _losses(tmp_path / "offline") == _losses(tmp_path / "online")
    cfg = json.load(open(tmp_path / "offline" / "config.json"))
    assert f"models--o--m/snapshots/{A}" in cfg["model"] and f"models--o--x/snapshots/{B}" in cfg["init_adapter"], cfg
    # what the cache lacks: a model whose config.json alone was fetched (`--plan`), one never fetched
    from model.hub import fetch_checkpoint

    hub["repos"]["models/o/p"] = hub["repos"]["models/o/m"]
    hub["offline"](False)
    fetch_checkpoint("o/p", config_only=True)
    hub["offline"](True)
    for name, why in (("o/p", "IncompleteSnapshotError"), ("o/q", "LocalEntryNotFoundError")):
        with pytest.raises(FileNotFoundError) as e:
            fetch_checkpoint(name)
        assert f"--model {name!r} is not a directory here, and reading it from the Hugging Face cache " \
            f"(HF_HUB_OFFLINE) failed ({why}: " \
            in str(e.value) and f"`hf download {name}`" in str(e.value), str(e.value)


@pytest.mark.parametrize("junk", ["", "\n", "../snapshots/" + A])
def test_a_ref_file_holding_no_commit_is_refused(assets, hub, tmp_path, junk):
    """refs/main cut short (huggingface_hub writes it in place: a crash leaves it empty) or holding a path: one error
    naming the ref file and what it holds, before --out; it read as the commit "" (the snapshots/ folder itself: the
    glob matched every commit's files, pinned hf://datasets/o/n@/..., which parse refuses) or escaped snapshots/."""
    with no_weights():
        _starts(train_argv(assets, str(tmp_path / "w"), "--data", "hf://datasets/o/n/data/train-00000.parquet"))
    with open(os.path.join(hub["store"], "refs", "main"), "w") as f:
        f.write(junk)
    hub["offline"](True)
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, "--data", "hf://datasets/o/n/**/*.parquet"))
    assert f"hf://datasets/o/n/**/*.parquet: HF_HUB_OFFLINE is set and its ref file refs/main holds " \
           f"{junk.strip()[:50]!r} (not a commit) in the Hugging Face cache {hub['store']}; run the same command " \
           "once where the Hub can be reached" in msg, msg
    assert not os.path.exists(out)
