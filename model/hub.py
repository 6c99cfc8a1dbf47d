"""Which checkpoint `--model` (and adapter `--init-adapter`) names: Hub ids fetched into huggingface_hub's cache,
and local fingerprints.

Contract:
- `fetch_checkpoint(name, config_only=False, revision=None)` -> a local directory: `name` itself unless it names no
  file and reads as a Hub repo id ("org/name", "org/name@revision"); then huggingface_hub brings config.json (or
  config, weights and tokenizer files: no *.bin, *.pth, *.gguf) into its cache and the snapshot directory is
  returned (its name is the commit: pass it as `revision` to fetch the rest of the same snapshot). Any failure
  raises FileNotFoundError naming the id and the fix. Under HF_HUB_OFFLINE the cached snapshot is read as it is
  (huggingface_hub's offline snapshot_download: refs/ for a branch, its cached listing refusing a snapshot that lacks
  files; tests/test_hub_offline.py). Every rank may call it at once: the hub's file locks let
  one process download each file while the others wait for it. A name starting with ".", "/" or "~", or one
  that exists, is a path; a relative path that does not exist reads as an id (as in transformers).
  `hub_snapshot(dir)` names such a cache directory "org/name@commit", wherever the cache lives;
  `same_snapshot(name, dir[, fetch])` checks under a process group that every rank read one commit, and fetches
  the rest of it with a failure on any rank raised on all.
- `fetch_adapter(name)`: the same for `--init-adapter` (a PEFT adapter's repo): its adapter_model.safetensors and the
  json/jinja files beside it (model/export.py's), at the top level or, for "org/name/sub/folder[@revision]", in that
  subfolder alone (a trainer's checkpoint-500/; peft's `from_pretrained(..., subfolder=)`), never deeper; the run
  records the snapshot path (`hub_snapshot(dir, sub=True)`: "org/name/sub/folder@commit").
- `model_fingerprint(path)`: a local checkpoint's identity for a resume to compare, a sha256 over config.json,
  the weight index and, per weight file model/load.py reads, its name, size, header and first and last bytes
  (None where nothing local is there to hash: a Hub snapshot's commit is compared instead); `same_model(path,
  recorded)` accepts it by today's rule or by the one runs of 2026-12-03 recorded.
"""

from __future__ import annotations

import os

from model.stored import INDEX, weight_files

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]   # config, weights, tokenizer
HUB_SKIP = ["consolidated*", "*/*"]   # Mistral's original-format copy of the weights, subfolders (Llama's original/)
ADAPTER_FILES = ["adapter_model.safetensors", "*.json", "*.jinja"]   # an adapter, model/export.py's files beside it


def fetch_checkpoint(name: str, config_only: bool = False, revision: str | None = None) -> str:
    """A local checkpoint directory for `--model name` (see the module docstring)."""
    if not isinstance(name, str) or not (repo := hub_repo(name)):
        return name   # a path (a missing one fails in read_args, naming it)
    return _download("--model", name, "config.json" if config_only else "weights and tokenizer",
                     revision or name.partition("@")[2] or None, ["config.json"] if config_only else HUB_FILES,
                     None if config_only else HUB_SKIP,
                     f"pass a local checkpoint directory (config.json + *.safetensors), or fetch it first (`hf "
                     f"download {repo}`; gated models need `hf auth login`)")


def fetch_adapter(name: str) -> str:
    """A local PEFT adapter folder for `--init-adapter name`: `name` itself, or for a Hub id its adapter files (never
    a base's weights, nor another folder's adapter) fetched into the hub's cache, whose snapshot path names the commit;
    "org/name/sub/folder" reads the adapter in that subfolder (the returned path is the snapshot's subfolder)."""
    if not (repo := hub_repo(name, sub=True)):
        return name   # a path (check_init_adapter says what a missing one lacks)
    sub = name.partition("@")[0][len(repo) + 1:]   # ("": the top level)
    inside = sub + "/" if sub else ""   # (fnmatch's * crosses "/": the ignore pattern keeps deeper folders out)
    snap = _download("--init-adapter", name, f"adapter files{' in ' + inside if sub else ''}",
                     name.partition("@")[2] or None, [inside + f for f in ADAPTER_FILES],
                     [inside + "*/*"] if sub else HUB_SKIP,
                     f"pass a local PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or fetch "
                     f"it first (`hf download {repo}`; private repos need `hf auth login`)")
    path = os.path.join(snap, *sub.split("/")) if sub else snap
    if not all(os.path.isfile(os.path.join(path, f)) for f in ("adapter_config.json", "adapter_model.safetensors")):
        where = f"in its folder {sub}/" if sub else "at its top level"
        raise FileNotFoundError(f"--init-adapter {name!r}: the Hub repo {hub_snapshot(snap) or repo} holds no "
                                f"adapter_config.json and adapter_model.safetensors {where} "
                                f"({_adapters_in(repo, os.path.basename(snap))}): pass a PEFT adapter's repo, or "
                                "org/name/FOLDER for one in a folder (a model's repo is --model's)")
    return path


def _adapters_in(repo: str, commit: str) -> str:
    """What a Hub repo holds at `commit`, for an error: its folders with an adapter_config.json, else its files."""
    try:
        import huggingface_hub
        files = huggingface_hub.list_repo_files(repo, revision=commit)
    except Exception as e:   # (offline: the error above stands without the list)
        return f"its files could not be listed: {type(e).__name__}"
    dirs = sorted({os.path.dirname(f) for f in files if os.path.basename(f) == "adapter_config.json"})
    if dirs:
        return "adapters in it: " + ", ".join(f"{repo}/{d}" if d else f"{repo} (top level)" for d in dirs)
    return f"no adapter_config.json anywhere in it; its files: {', '.join(sorted(files)[:8]) or 'none'}" \
        f"{' ...' * (len(files) > 8)}"


def id_part(part: str) -> bool:
    """One part of a Hub repo id (its org, its name): letters, digits, "-", "_", "."."""
    return bool(part) and part.replace("-", "").replace("_", "").replace(".", "").isalnum()


def hub_repo(name: str, sub: bool = False) -> str | None:
    """The repo of a Hub id ("org/name", "org/name@revision"; where `sub`, also "org/name/sub/folder[@revision]", a
    folder in the repo), or None where `name` reads as a path: one that exists, or starts with ".", "/" or "~", or
    whose parts are not of letters, digits, "-", "_", "." (two of them, or where `sub` more), or of three or more whose
    first is a folder here (runs/sft/adapter mistyped: a local path, never some Hub repo "runs/sft")."""
    parts = name.partition("@")[0].split("/")
    if os.path.exists(name) or name.startswith((".", "/", "~")) or len(parts) < 2 or len(parts) > 2 and not sub or \
            len(parts) > 2 and os.path.isdir(parts[0]) or \
            not all(map(id_part, parts)):
        return None
    return "/".join(parts[:2])


def _download(flag: str, name: str, what: str, revision, allow: list, skip, fix: str) -> str:
    """huggingface_hub's snapshot of `name`'s repo (`allow`/`skip`: its file patterns), any failure one
    FileNotFoundError naming `flag`, the id and `fix`."""
    offline = False
    try:
        import huggingface_hub
        offline = huggingface_hub.constants.HF_HUB_OFFLINE   # (then the cache is read: said so, not "fetching")
        if int(os.environ.get("RANK", "0")) != 0:   # one progress bar per job
            huggingface_hub.utils.disable_progress_bars()
        else:
            print(f"{flag} {name}: no such directory here; " + (f"reading its {what} from the Hugging Face cache "
                  "(HF_HUB_OFFLINE)" if offline else f"fetching its {what} from the Hugging Face Hub"), flush=True)
        return huggingface_hub.snapshot_download("/".join(name.partition("@")[0].split("/")[:2]), revision=revision,
                                                 allow_patterns=allow, ignore_patterns=skip)   # (the repo: no folder)
    except Exception as e:   # offline, no such repo, gated, disk full: all end here, said once
        how = "reading it from the Hugging Face cache (HF_HUB_OFFLINE)" if offline else \
            "fetching it from the Hugging Face Hub"
        raise FileNotFoundError(f"{flag} {name!r} is not a directory here, and {how} "
                                f"failed ({type(e).__name__}: {said(e)}); {fix}") from e


def said(e: BaseException, limit: int = 400) -> str:
    """A hub error's text on one line: huggingface_hub's HTTP errors put the reason on lines after the first, and a
    403's first line is its request id alone ("(Request ID: ...)"), so the first line alone can say nothing."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text[:limit] + " ..." * (len(text) > limit) if text else type(e).__name__


def hub_snapshot(path, sub: bool = False) -> str | None:
    """"org/name@commit" for a directory of huggingface_hub's cache (.../models--org--name/snapshots/<commit>): the
    same checkpoint wherever the cache lives (resume and the adapter's base model name it so). Else None. `sub`: a
    folder inside a snapshot too (--init-adapter's in a subfolder), "org/name/sub/folder@commit"."""
    parts = os.path.normpath(str(path)).split(os.sep)
    for i in range(len(parts) - 2, 0, -1) if sub else [len(parts) - 2]:   # (the last "snapshots" in the path)
        if i >= 1 and parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1][len("models--"):].replace("--", "/", 1) + "".join("/" + p for p in parts[i + 2:]) \
                + "@" + parts[i + 1]
    return None


def same_snapshot(name: str, path: str, fetch: bool = False, flag: str = "--model") -> None:
    """Under a process group, for `--model name` (or `flag`'s; "": unnamed) resolved to `path` on each rank: raise
    on every rank alike when the ranks read different Hub commits (a push between their fetches, or a node with a
    local copy at that path);
    `fetch`: then fetch the rest of the snapshot (weights, tokenizer) on every rank, a failure on one raising on all,
    so no rank waits in a later collective for one that stopped."""
    import torch.distributed as dist

    if fetch and path == name:   # a local directory (the check before made every rank agree): nothing to fetch
        return
    world, err = dist.get_world_size(), None
    if fetch:
        try:
            fetch_checkpoint(name, revision=os.path.basename(path))
        except FileNotFoundError as e:
            err = str(e)
    seen = [None] * world
    dist.all_gather_object(seen, err if fetch else hub_snapshot(path, sub=flag == "--init-adapter"))
    if fetch and any(seen):
        raise FileNotFoundError(next(e for e in seen if e))
    if not fetch and len(set(seen)) > 1:
        ids = {s.rpartition("@")[0] for s in seen if s}   # (one id: the pin spelled with it, a folder's too)
        raise ValueError(f"{flag}{' ' * bool(name)}{name}: the ranks read different checkpoints ("
                         f"{sorted(set(seen), key=str)}; None: a local directory); pin one: "
                         f"{ids.pop() if len(ids) == 1 else 'org/name'}@<commit>, or the same directory everywhere")


def model_fingerprint(path: str, sample: int = 1 << 20, every_file: bool = False) -> str | None:
    """A local checkpoint's identity for a resume to compare (None: not a local directory, or no weights yet, as a Hub
    snapshot's before its fetch, whose commit is compared instead): a sha256 over config.json, the weight index, and
    per weight file the loader reads (`weight_files`) its name, size, safetensors header and its first and last
    `sample` bytes, so an edited config.json or other weights in place (another fine-tune of the same shapes) are told
    apart, where a copy elsewhere, or a file beside them the loader never reads, is not (~8 MB read for a 7B model's
    shards). `every_file`: the rule until 2026-12-04 (every *.index.json and every .safetensors/.bin/.pt/.pth file),
    which runs of 2026-12-03 recorded (`same_model`)."""
    import hashlib

    if not os.path.isdir(path):
        return None
    names = sorted(os.listdir(path))
    if every_file:
        weights = [n for n in names if n.endswith((".safetensors", ".bin", ".pt", ".pth"))]
        jsons = [n for n in names if n == "config.json" or n.endswith(".index.json")]
    else:
        try:
            weights, wmap = weight_files(path)
        except (OSError, ValueError, KeyError, TypeError):   # (an unreadable index: the loader says what is wrong)
            weights, wmap = [n for n in names if n.endswith(".safetensors")], None
        weights = [n for n in weights if os.path.isfile(os.path.join(path, n))]
        jsons = [n for n in ("config.json", INDEX if wmap is not None else None) if n and n in names]
    if not weights:
        return None
    h = hashlib.sha256()
    for n in jsons + weights:
        fn = os.path.join(path, n)
        size = os.path.getsize(fn)
        h.update(f"{n}\0{size}\0".encode())
        with open(fn, "rb") as f:
            if n.endswith(".json"):
                h.update(f.read())
                continue
            if n.endswith(".safetensors"):
                head = f.read(8)   # (a length past the file, as a Git LFS pointer's text gives: the loader says so)
                hn = int.from_bytes(head, "little") if len(head) == 8 else 0
                h.update(head + f.read(hn if 8 + hn <= size else 0))
            h.update(f.read(sample))
            f.seek(max(f.tell(), size - sample))
            h.update(f.read(sample))
    return h.hexdigest()


def same_model(path: str, recorded: str | None) -> bool:
    """`path`'s files give the fingerprint a run recorded, by today's rule or by the one of 2026-12-03."""
    return recorded is not None and recorded in (model_fingerprint(path), model_fingerprint(path, every_file=True))
