"""`--data hf://datasets/ORG/NAME[@REVISION]/PATH` (and `--eval-data`'s): a Hub dataset's files, read as they are
(data/formats.py reads Parquet and compressed JSONL), fetched into huggingface_hub's cache at start-up.

Contract:
- The form is huggingface_hub's HfFileSystem URL, so it never reads as a local path. REVISION is a branch, tag or
  commit (one holding "/" is written %2F-quoted, or as HfFileSystem spells its special refs: `@refs/convert/parquet`,
  `@refs/pr/N`). PATH names one file, or is a glob (`matches`): split at "/", each part matches one folder or file
  name by fnmatch's case-sensitive rule (`*`, `?`, `[seq]`; `*` never crosses a "/"), and a part that is `**` matches
  any number of folders, none included (as Python's `glob(recursive=True)`: `**/*.jsonl` is every .jsonl file).
- `resolve(args)` (preflight.check_start, after the flag checks and before any data check, so every check after it
  reads local files): for each hf:// entry of --data and --eval-data, REVISION resolved to its commit once and the
  repo's files listed at that commit (every file of a run comes from one commit: a push mid-start cannot mix them);
  PATH matched against them; a PATH matching nothing is refused, naming the repo, commit and some of its files, before
  any download. Then only the matched files are fetched (snapshot_download of exactly those names, at the commit) and
  the entry is replaced by them, sorted, each one a --data file: a --data-weights weight given for the entry applies
  to each file (0.5: half of each file's records; checked one weight per entry as given, first). `args.hub_data`
  records {flag: each entry pinned, hf://datasets/ORG/NAME@COMMIT/PATH} (None without one); the files recorded are
  the snapshot's, whose path names the commit. Any failure of the hub (no network, no such repo or revision, gated,
  disk full) is one FileNotFoundError naming the URL and the fix (with no network: fetch where there is one, then
  HF_HUB_OFFLINE=1), before anything is written. Every rank fetches at once: the hub's file locks let one process
  download each file while the others wait. REVISION's commit is written to the cache's refs/ (as huggingface_hub
  writes a branch's; its fetch at the commit writes none), for an offline rerun of the URL.
- Under huggingface_hub's offline mode (`constants.HF_HUB_OFFLINE`: HF_HUB_OFFLINE=1, a compute node without network
  after a login node fetched the data) the same URL is read from the hub's cache with no network call: REVISION (the
  main branch when none) resolved by the cache's refs/ file (a branch or tag: written by `hf download` and by an
  online run of this URL), a full commit as given, a short one (4+ hex digits) against the cached snapshots' commits
  (one alone must start with it); PATH matched against the commit's full file listing where the cache holds it
  (huggingface_hub's trees/<commit>.json, written by every snapshot_download of that commit: ours and `hf download`'s),
  so a glob matches the files it matched online and a matched file the snapshot lacks (a partial fetch) is refused,
  never silently left out. A cache with no such listing
  (an older huggingface_hub, files fetched one by one) is matched against the snapshot's files, which may be fewer
  than the repo's: said on the start-up line, which always names how many files matched and the commit. The same
  pins are recorded (so a resume compares them, `moved`, with no network). A repo never fetched, a revision not in
  the cache, a refs/ file holding no commit (cut short) or a matched file missing is one FileNotFoundError naming the
  URL, the cache folder and the fix (run once online, or `hf download ...`), before anything is written.
- `same_commits(args)` (collective, preflight.same_everywhere): every rank resolved each entry to one commit, else
  every rank raises one error naming the commits and the pin.
- `moved(ckpt_args, args)` (parallel/resume.py, where --data's files differ from the checkpoint's): the message for
  a resume whose hf:// entry now resolves to another commit, naming `@<commit>` to pin the checkpoint's. A repo that
  moved on without changing the matched files' bytes resumes (the same bytes are the same run, as local files moved).
"""

from __future__ import annotations

import glob
import os
import re
from fnmatch import fnmatchcase
from urllib.parse import unquote

from data.mix import check_weights, data_files
from model.hub import id_part, said

PREFIX = "hf://"
SPECIAL_REFS = re.compile(r"refs/(?:convert/(?:parquet|duckdb)|pr/\d+)(?=/)")   # (HfFileSystem's, "/" inside)
FORM = "hf://datasets/ORG/NAME[@REVISION]/PATH (PATH a file of the repo or a glob: data/train-*.parquet)"
SHOWN = 8   # a repo's files an error lists


def is_hub(entry) -> bool:
    return isinstance(entry, str) and entry.startswith(PREFIX)


def parse(url: str, flag: str = "--data") -> tuple[str, str | None, str]:
    """(ORG/NAME, REVISION or None, PATH) of a hf:// URL; anything else of that prefix a ValueError naming the form."""
    kind, _, rest = url[len(PREFIX):].partition("/")
    org, _, rest = rest.partition("/")
    name, _, path = rest.partition("/")
    name, at, rev = name.partition("@")
    if at and (special := SPECIAL_REFS.match(rev + "/" + path)):   # @refs/convert/parquet/default/train/*.parquet
        rev, path = special.group(0), path[len(special.group(0)) - len(rev):]
    if kind != "datasets" or not (id_part(org) and id_part(name)) or not path or at and not rev:
        why = "reads dataset repos only" if kind != "datasets" and kind else "needs a repo and a path in it"
        raise ValueError(f"{flag} {url}: {flag} {why}: write {FORM}")
    return f"{org}/{name}", unquote(rev) if at else None, path


def matches(pattern: str, path: str) -> bool:
    """A repo file's path matched by PATH's glob (module docstring)."""
    def match(pat: list[str], parts: list[str]) -> bool:
        if not pat:
            return not parts
        if pat[0] == "**":   # any number of folders, none included
            return any(match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatchcase(parts[0], pat[0]) and match(pat[1:], parts[1:])
    return match(pattern.split("/"), path.split("/"))


def _fix(url: str, repo: str, rev: str | None, path: str) -> str:
    return (f"check the name{' and revision' * bool(rev)} at https://huggingface.co/datasets/{repo}; a gated or "
            "private dataset needs `hf auth login` (and its terms accepted on that page); with no network here, fetch "
            f"it where the hub can be reached (this command, or `hf download --repo-type dataset {repo}"
            f"{f' --revision {rev}' if rev else ''} --include '{path}'`) into the cache this node reads (HF_HOME) and "
            f"run here with HF_HUB_OFFLINE=1: {url} is then read from the cache")


def _hub_call(flag: str, url: str, parsed: tuple, call):
    """`call()`, any failure one FileNotFoundError naming `flag`, the URL and the fix."""
    try:
        return call()
    except Exception as e:   # offline, no such repo or revision, gated, disk full: all end here, said once
        raise FileNotFoundError(f"{flag} {url}: fetching it from the Hugging Face Hub failed ({type(e).__name__}: "
                                f"{said(e)}); {_fix(url, *parsed)}") from e


def _listed(flag: str, url: str) -> tuple[str, str, list[str], str, list[str] | None]:
    """(repo, commit, the matched files in the repo, sorted, the entry pinned, their local paths where offline (None:
    to be fetched)); nothing matched: refused."""
    import huggingface_hub
    from huggingface_hub import constants

    repo, rev, path = parsed = parse(url, flag)
    if constants.HF_HUB_OFFLINE:
        return _cached(flag, url, parsed)
    commit = _hub_call(flag, url, parsed, lambda: huggingface_hub.dataset_info(repo, revision=rev).sha)
    files = _hub_call(flag, url, parsed, lambda: huggingface_hub.list_repo_files(repo, repo_type="dataset",
                                                                                 revision=commit))
    return repo, commit, _matched(flag, url, commit, files), f"{PREFIX}datasets/{repo}@{commit}/{path}", None


def _matched(flag: str, url: str, commit: str, files: list[str], cached: str = "") -> list[str]:
    """The files of `commit` PATH matches, sorted; none: refused, naming some of them."""
    repo, _, path = parse(url, flag)
    if got := sorted(f for f in files if matches(path, f)):
        return got
    shown = sorted(files)[:SHOWN]
    raise FileNotFoundError(
        f"{flag} {url}: no file of the dataset {repo} at commit {commit}{cached} matches {path!r} ({len(files)} "
        f"files; {', '.join(shown) or 'none'}{' ...' * (len(files) > SHOWN)}); a glob's * stays within one folder "
        "(data/*.parquet), ** crosses folders (**/*.parquet): name its files that way")


def _cached(flag: str, url: str, parsed: tuple) -> tuple[str, str, list[str], str, list[str]]:
    """`_listed` under HF_HUB_OFFLINE, from huggingface_hub's cache alone (module docstring)."""
    import huggingface_hub
    from huggingface_hub import constants

    repo, rev, path = parsed
    want = rev or constants.DEFAULT_REVISION
    store = os.path.join(constants.HF_HUB_CACHE, "datasets--" + repo.replace("/", "--"))   # (the hub's layout)

    def lacks(what: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"{flag} {url}: HF_HUB_OFFLINE is set and {what} in the Hugging Face cache {store}; run the same command "
            f"once where the Hub can be reached (it caches the files), or there `hf download --repo-type dataset "
            f"{repo} --revision {want} --include '{path}'`, with HF_HOME (or HF_HUB_CACHE) naming the cache this "
            "node reads")
    refs, snaps = (os.path.join(store, d) for d in ("refs", "snapshots"))
    named = sorted(os.path.relpath(os.path.join(d, f), refs).replace(os.sep, "/") for d, _, fs in os.walk(refs)
                   for f in fs)   # (refs/refs/pr/1: "refs/pr/1")
    commits = sorted(os.listdir(snaps)) if os.path.isdir(snaps) else []
    if want in named:   # a branch or tag (or a short commit an online look-up resolved)
        with open(os.path.join(refs, *want.split("/"))) as f:
            commit = f.read().strip()
        if not re.fullmatch(r"[0-9a-f]{40}", commit):   # (huggingface_hub writes it in place: a crash can leave it
            raise lacks(f"its ref file refs/{want} holds {commit[:50]!r} (not a commit)")   # empty; "" read as the
            # snapshots/ folder itself, every commit's files the glob's, pinned @ nothing)
    elif re.fullmatch(r"[0-9a-f]{4,40}", want) and len(hit := [c for c in commits if c.startswith(want)]) == 1:
        commit = hit[0]
    else:
        raise lacks(f"its revision {want!r} is not (branches and tags cached: {', '.join(named) or 'none'}; commits: "
                    f"{', '.join(commits[:SHOWN]) or 'none'})" if named or commits else "the dataset was never fetched")
    snap = os.path.join(store, "snapshots", commit)
    if not os.path.isdir(snap):
        raise lacks(f"its commit {commit} ({want}) has no snapshot")
    try:   # the commit's full listing (huggingface_hub >= 2: snapshot_download keeps it): the glob's online files
        files = [f.path for f in huggingface_hub.get_cached_repo_tree(repo, repo_type="dataset", revision=commit)]
    except Exception:   # (no listing kept, or a huggingface_hub without one): the files cached are all it sees
        files = None
    here = sorted(os.path.relpath(os.path.join(d, f), snap).replace(os.sep, "/") for d, _, fs in os.walk(snap)
                  for f in fs)
    got = _matched(flag, url, commit, here if files is None else files, " (its files cached)" * (files is None))
    paths = [os.path.join(snap, *n.split("/")) for n in got]
    if missing := [n for n, p in zip(got, paths) if not os.path.isfile(p)]:
        raise lacks(f"its commit {commit}'s snapshot lacks {len(missing)} of the {len(got)} files {path!r} matches "
                    f"({', '.join(missing[:4])}{' ...' * (len(missing) > 4)}: a partial fetch)")
    if int(os.environ.get("RANK", "0")) == 0:   # (how many and which commit: what a run reads offline, said)
        print(f"{flag} {url}: HF_HUB_OFFLINE: {len(got)} file{'s' * (len(got) > 1)} of commit {commit} read from the "
              "Hugging Face cache" + (files is None) * " (the cache keeps no listing of that commit: PATH was matched "
              "among its files cached, which can be fewer than the repo holds)", flush=True)
    return repo, commit, got, f"{PREFIX}datasets/{repo}@{commit}/{path}", paths


def resolve(args) -> None:
    """Each hf:// entry of --data and --eval-data replaced by its files, fetched (module docstring)."""
    args.hub_data = None
    for flag, key in (("--data", "data"), ("--eval-data", "eval_data")):
        given = data_files(getattr(args, key, None))
        if not any(map(is_hub, given)):
            continue
        weights = args.data_weights if key == "data" else None
        check_weights(weights, given)   # one per entry as given (the files an entry gives are not known yet)
        listed = [_listed(flag, e) if is_hub(e) else None for e in given]   # every glob matched before any download
        files, each = [], []
        for entry, w, got in zip(given, weights or [None] * len(given), listed):
            local = [entry] if got is None else got[4] or _fetched(flag, entry, *got[:3])
            files += local
            each += [w] * len(local)
        setattr(args, key, files[0] if len(files) == 1 else files)   # (one file: a path, as preflight.parse gives)
        if weights is not None:
            args.data_weights = each
        args.hub_data = {**(args.hub_data or {}), flag: [got[3] for got in listed if got]}


def _fetched(flag: str, url: str, repo: str, commit: str, names: list[str]) -> list[str]:
    """The matched files brought into the hub's cache (those names alone, at `commit`): their local paths."""
    import huggingface_hub

    if int(os.environ.get("RANK", "0")) != 0:   # one progress bar per job
        huggingface_hub.utils.disable_progress_bars()
    else:
        print(f"{flag} {url}: fetching {len(names)} file{'s' * (len(names) > 1)} of commit {commit} from the Hugging "
              "Face Hub", flush=True)
    snap = _hub_call(flag, url, parse(url, flag), lambda: huggingface_hub.snapshot_download(
        repo, repo_type="dataset", revision=commit, allow_patterns=[glob.escape(n) for n in names]))   # (a name's
    paths = [os.path.join(snap, *n.split("/")) for n in names]   # [ or * matches itself alone)
    # (the Hub gone between the listing and the fetch: snapshot_download returns an older partial copy unchecked)
    if missing := [n for n, p in zip(names, paths) if not os.path.isfile(p)]:
        raise FileNotFoundError(f"{flag} {url}: the Hugging Face Hub's download of commit {commit} came back without "
                                f"{', '.join(missing[:4])}{' ...' * (len(missing) > 4)} (offline part-way, or an "
                                f"older partial copy in the cache); {_fix(url, *parse(url, flag))}")
    _remember(os.path.dirname(os.path.dirname(snap)), parse(url, flag)[1], commit)
    return paths


def _remember(store: str, rev: str | None, commit: str) -> None:
    """REVISION's commit written to the cache's refs/ (as huggingface_hub writes a branch's there: an offline rerun of
    the URL resolves it so; our snapshot_download, given the commit, writes none). A read-only cache: left as it is."""
    import tempfile

    from huggingface_hub import constants

    ref = os.path.join(store, "refs", *(rev or constants.DEFAULT_REVISION).split("/"))
    if (rev or constants.DEFAULT_REVISION) == commit:
        return
    try:
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(ref), prefix=".ref.")   # (atomic: ranks write it at once)
        with os.fdopen(fd, "w") as f:
            f.write(commit)
        os.replace(tmp, ref)
    except OSError:
        pass


def same_commits(args) -> None:
    """Collective: every rank resolved --data's and --eval-data's hf:// entries to the same commits (a push between
    the ranks' look-ups gives two), else every rank raises one error naming them and the pin."""
    import torch.distributed as dist

    if not getattr(args, "hub_data", None) or not dist.is_initialized() or dist.get_world_size() == 1:
        return   # (the same argv on every rank: all of them gather, or none)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, args.hub_data)
    if any(s != seen[0] for s in seen):
        said = sorted({p for s in seen for ps in (s or {}).values() for p in ps})
        raise ValueError(f"--data/--eval-data: the ranks read different commits of the Hub dataset ({', '.join(said)}"
                         "); pin one: hf://datasets/ORG/NAME@<commit>/PATH")


def moved(ckpt_args: dict, args: dict) -> str | None:
    """Module docstring: the resume's message when an hf:// --data entry resolves to another commit now."""
    now = {(repo, path): (commit, url) for url in ((args.get("hub_data") or {}).get("--data") or [])
           for repo, commit, path in [parse(url)]}
    for url in (ckpt_args.get("hub_data") or {}).get("--data") or []:
        repo, commit, path = parse(url)
        if (repo, path) in now and now[repo, path][0] != commit:
            return (f"--data hf://datasets/{repo}/{path}: the dataset has moved on since the checkpoint's run (its "
                    f"commit {commit}, now {now[repo, path][0]}) and the files it gives differ; to resume on the "
                    f"run's files pin its commit, --data {url} (or train the new files from the run's adapter with "
                    "--init-adapter OUT/adapter in a fresh run)")
    return None
