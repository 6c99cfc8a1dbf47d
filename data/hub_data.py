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
  the snapshot's, whose path names the commit. Any failure of the hub (offline, no such repo or revision, gated, disk
  full) is one FileNotFoundError naming the URL and the fix, before anything is written. Every rank fetches at once:
  the hub's file locks let one process download each file while the others wait.
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
            "private dataset needs `hf auth login` (and its terms accepted on that page); offline, fetch it where the "
            f"hub can be reached, `hf download --repo-type dataset {repo}{f' --revision {rev}' if rev else ''} "
            f"--include '{path}'`, and pass the files it downloads in place of {url}")


def _hub_call(flag: str, url: str, parsed: tuple, call):
    """`call()`, any failure one FileNotFoundError naming `flag`, the URL and the fix."""
    try:
        return call()
    except Exception as e:   # offline, no such repo or revision, gated, disk full: all end here, said once
        raise FileNotFoundError(f"{flag} {url}: fetching it from the Hugging Face Hub failed ({type(e).__name__}: "
                                f"{said(e)}); {_fix(url, *parsed)}") from e


def _listed(flag: str, url: str) -> tuple[str, str, list[str], str]:
    """(repo, commit, the matched files in the repo, sorted, the entry pinned); nothing matched: refused."""
    import huggingface_hub

    repo, rev, path = parsed = parse(url, flag)
    commit = _hub_call(flag, url, parsed, lambda: huggingface_hub.dataset_info(repo, revision=rev).sha)
    files = _hub_call(flag, url, parsed, lambda: huggingface_hub.list_repo_files(repo, repo_type="dataset",
                                                                                 revision=commit))
    got = sorted(f for f in files if matches(path, f))
    if not got:
        shown = sorted(files)[:SHOWN]
        raise FileNotFoundError(
            f"{flag} {url}: no file of the dataset {repo} at commit {commit} matches {path!r} ({len(files)} files; "
            f"{', '.join(shown) or 'none'}{' ...' * (len(files) > SHOWN)}); a glob's * stays within one folder "
            "(data/*.parquet), ** crosses folders (**/*.parquet): name its files that way")
    return repo, commit, got, f"{PREFIX}datasets/{repo}@{commit}/{path}"


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
            local = [entry] if got is None else _fetched(flag, entry, *got[:3])
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
    return paths


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
