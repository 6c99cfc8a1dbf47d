"""Which checkpoint `--model` (and adapter `--init-adapter`) names: Hub ids fetched into huggingface_hub's cache,
and local fingerprints.

Contract:
- `fetch_checkpoint(name, config_only=False, revision=None)` -> a local directory: `name` itself unless it names no
  file and reads as a Hub repo id ("org/name", "org/name@revision"); then huggingface_hub brings config.json (or
  config, weights and tokenizer files: no *.bin, *.pth, *.gguf) into its cache and the snapshot directory is
  returned (its name is the commit: pass it as `revision` to fetch the rest of the same snapshot). Any failure
  raises FileNotFoundError naming the id and the fix. Every rank may call it at once: the hub's file locks let
  one process download each file while the others wait for it. A name starting with ".", "/" or "~", or one
  that exists, is a path; a relative path that does not exist reads as an id (as in transformers).
  `hub_snapshot(dir)` names such a cache directory "org/name@commit", wherever the cache lives;
  `same_snapshot(name, dir[, fetch])` checks under a process group that every rank read one commit, and fetches
  the rest of it with a failure on any rank raised on all.
- `fetch_adapter(name)`: the same for `--init-adapter` (a PEFT adapter's repo): its adapter_model.safetensors and the
  json/jinja files beside it (model/export.py's), no subfolder; the run records the snapshot path (its commit).
- `model_fingerprint(path)`: a local checkpoint's identity for a resume to compare, a sha256 over config.json,
  the weight index and, per weight file model/load.py reads, its name, size, header and first and last bytes
  (None where nothing local is there to hash: a Hub snapshot's commit is compared instead); `same_model(path,
  recorded)` accepts it by today's rule or by the one runs of 2026-12-03 recorded.
"""

from __future__ import annotations

import os

from model.load import INDEX, weight_files

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
    a base's weights, nor a subfolder's adapter) fetched into the hub's cache, whose snapshot path names the commit."""
    if not (repo := hub_repo(name)):
        return name   # a path (check_init_adapter says what a missing one lacks)
    path = _download("--init-adapter", name, "adapter files", name.partition("@")[2] or None, ADAPTER_FILES, HUB_SKIP,
                     f"pass a local PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or fetch "
                     f"it first (`hf download {repo}`; private repos need `hf auth login`)")
    if not all(os.path.isfile(os.path.join(path, f)) for f in ("adapter_config.json", "adapter_model.safetensors")):
        raise FileNotFoundError(f"--init-adapter {name!r}: the Hub repo {hub_snapshot(path) or repo} holds no "
                                "adapter_config.json and adapter_model.safetensors at its top level: pass a PEFT "
                                "adapter's repo (a model's is --model's)")
    return path


def hub_repo(name: str) -> str | None:
    """The repo of a Hub id ("org/name", "org/name@revision"), or None where `name` reads as a path: one that exists,
    or starts with ".", "/" or "~", or is not two parts of letters, digits, "-", "_", "."."""
    repo = name.partition("@")[0]
    if os.path.exists(name) or name.startswith((".", "/", "~")) or repo.count("/") != 1 or not all(
            part and part.replace("-", "").replace("_", "").replace(".", "").isalnum() for part in repo.split("/")):
        return None
    return repo


def _download(flag: str, name: str, what: str, revision, allow: list, skip, fix: str) -> str:
    """huggingface_hub's snapshot of `name`'s repo (`allow`/`skip`: its file patterns), any failure one
    FileNotFoundError naming `flag`, the id and `fix`."""
    try:
        import huggingface_hub
        if int(os.environ.get("RANK", "0")) != 0:   # one progress bar per job
            huggingface_hub.utils.disable_progress_bars()
        else:
            print(f"{flag} {name}: no such directory here; fetching its {what} from the Hugging Face Hub", flush=True)
        return huggingface_hub.snapshot_download(name.partition("@")[0], revision=revision, allow_patterns=allow,
                                                 ignore_patterns=skip)
    except Exception as e:   # offline, no such repo, gated, disk full: all end here, said once
        why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"{flag} {name!r} is not a directory here, and fetching it from the Hugging Face Hub "
                                f"failed ({type(e).__name__}: {why}); {fix}") from e


def hub_snapshot(path) -> str | None:
    """"org/name@commit" for a directory of huggingface_hub's cache (.../models--org--name/snapshots/<commit>): the
    same checkpoint wherever the cache lives (resume and the adapter's base model name it so). Else None."""
    parts = os.path.normpath(str(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1) + "@" + parts[-1]
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
    dist.all_gather_object(seen, err if fetch else hub_snapshot(path))
    if fetch and any(seen):
        raise FileNotFoundError(next(e for e in seen if e))
    if not fetch and len(set(seen)) > 1:
        raise ValueError(f"{flag}{' ' * bool(name)}{name}: the ranks read different checkpoints ("
                         f"{sorted(set(seen), key=str)}; None: a local directory); pin one: org/name@<commit>, or the "
                         "same directory everywhere")


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
