"""A ckpt folder's step folders: which are whole, and which one a path names. Cheap: no weights are read.

Contract:
- `resolve(path)` is cheap (no weights; run it at start-up): a step folder, or the one `latest` names in a ckpt folder
  (a newer whole step folder written after `latest` wins: a save killed between its rename and `latest`'s). An
  abandoned step (`parallel.checkpoint.branch`) or an unfinished save's folder is refused, naming the live steps. A
  folder is readable when meta.json parses and every byte range DCP's `.metadata` points at is present on disk (a
  truncated file fails this). Given a ckpt folder whose newest checkpoint is unreadable, it falls back to the previous
  readable one and warns, naming both; given an unreadable step folder, it refuses, naming the previous readable one.
- `has_step(ckpt_dir)`: it holds a whole step folder; `problem(folder)`: why a step folder cannot be loaded, or None;
  `read_meta(path)`: a resolved step folder's meta.json.
- Rotation (`parallel.checkpoint.save`) and resume see only the step_NNNNNN folders save() names (`_steps`).
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch.distributed.checkpoint as dcp

STEP_RE = re.compile(r"step_(\d+)$")
ABANDONED_RE = re.compile(r"step_(\d+)\.abandoned(-\d+)?$")


def has_step(ckpt_dir: str) -> bool:
    """`ckpt_dir` holds a whole step folder (one `resolve` can resume)."""
    return any(problem(p) is None for _, p in _steps(ckpt_dir))


def _steps(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every folder save() names (step_000042), newest first. Only those: rotation deletes what this
    returns, and a folder of another name (`step_1`, an adapter exported into the ckpt folder by hand, or a copy)
    is not ours to delete, nor a step to resume."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, e)) for e in os.listdir(ckpt_dir)
             if (m := STEP_RE.match(e)) and e == f"step_{int(m.group(1)):06d}"
             and os.path.isdir(os.path.join(ckpt_dir, e))]
    return sorted(found, reverse=True)


def problem(folder: str) -> str | None:
    """Why a step folder cannot be loaded, or None. Reads meta.json and DCP's .metadata only."""
    if not os.path.isdir(folder):
        return "it does not exist"
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            int(json.load(f)["step"])
    except FileNotFoundError:
        return "meta.json is missing (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"meta.json is unreadable ({e})"
    try:
        md = dcp.FileSystemReader(folder).read_metadata()
    except Exception as e:   # noqa: BLE001 - missing, truncated or foreign: all mean "cannot load"
        return f".metadata is unreadable ({type(e).__name__}: {e})"
    need = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        p = os.path.join(folder, rel)
        have = os.path.getsize(p) if os.path.isfile(p) else None
        if have is None or have < size:
            return f"{rel} is {'missing' if have is None else f'truncated ({have} of {size} bytes)'}"
    return None


def _previous_good(ckpt_dir: str, below: int | None) -> str | None:
    for s, path in _steps(ckpt_dir):
        if (below is None or s < below) and problem(path) is None:
            return path
    return None


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def resolve(path: str, *, warn=_warn, flag: str = "--resume") -> str:
    """The readable step folder `path` names (see the contract); clear errors before any weight, naming `flag` (the
    argument `path` came as) and what is there instead."""
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path))
        have = [os.path.basename(p) for _, p in reversed(_steps(parent))]
        raise FileNotFoundError(f"{flag} {path!r} does not exist" + (f"; {parent!r} holds {', '.join(have)}" if have
                                                                     else ""))
    base, parent = os.path.basename(os.path.normpath(path)), os.path.dirname(os.path.normpath(path))
    if ABANDONED_RE.match(base) or base.startswith((".tmp-", ".old-")):   # (its steps: another trajectory)
        live = [os.path.basename(p) for _, p in _steps(parent)]
        raise ValueError(f"{flag} {path!r} is " + ("an abandoned step (a resume went back below it and trained its "
                                                   "steps again)" if ABANDONED_RE.match(base) else
                                                   "an unfinished save's folder") + ", never resumed"
                         + (f"; pass {flag} {parent} (its newest step) or one of {', '.join(live)}" if live else ""))
    m = STEP_RE.match(base)
    if m or os.path.isfile(os.path.join(path, "meta.json")):
        why = problem(path)
        if why is None:
            return path
        prev = _previous_good(os.path.dirname(os.path.normpath(path)), int(m.group(1)) if m else None)
        raise ValueError(f"checkpoint {path!r} cannot be read: {why}. "
                         + (f"The previous good one is {prev!r}: pass {flag} {prev}" if prev else
                            "There is no earlier good checkpoint beside it"))
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest) and not _steps(path):
        inner = os.path.join(path, "ckpt")   # a run directory given for its ckpt folder
        there = os.path.join(parent, "ckpt")
        if os.path.isdir(inner):
            fix = f"; pass {flag} {inner}"
        elif os.path.isfile(path) and base == "latest":   # the file that names the newest step, for its folder
            fix = f": 'latest' is the file naming the newest step; pass {flag} {parent}, which resumes that step"
        elif os.path.isfile(os.path.join(path, "adapter_config.json")):   # RUN/adapter: the export, no optimizer
            fix = ": that is an exported adapter (its LoRA weights, no optimizer state or data position)" + (
                "; " + (f"pass {flag} {there} to continue its run, or " if os.path.isdir(there) else "pass ")
                + f"--init-adapter {path} to start a new run from its weights" if flag == "--resume" else
                ", already what an export writes")
        else:
            fix = ""
        raise FileNotFoundError(f"{flag} {path!r}: no checkpoint there (expected a step_* folder with meta.json, or a "
                                "ckpt folder with a 'latest' file)" + fix)
    newest = os.path.join(path, _read(latest)) if os.path.isfile(latest) else _steps(path)[0][1]
    m = STEP_RE.match(os.path.basename(newest))
    if _steps(path) and (top := _steps(path)[0])[0] > (int(m.group(1)) if m else -1) and problem(top[1]) is None \
            and (not os.path.isfile(latest) or _mtime(os.path.join(top[1], "meta.json")) > _mtime(latest)):
        newest = top[1]   # whole, written after `latest`, not yet named by it: a save killed between its two renames
        # (one written before, a run before 2026-12-02 left beside the steps it resumed below: another trajectory)
    why = problem(newest)
    if why is None:
        return newest
    m = STEP_RE.match(os.path.basename(newest))
    prev = _previous_good(path, int(m.group(1)) if m else None)
    if prev is None:
        raise ValueError(f"the newest checkpoint {newest!r} cannot be read ({why}) and {path!r} holds no earlier "
                         "good one; start a fresh run")
    aside = sorted((e for e in os.listdir(path) if ABANDONED_RE.match(e) and e.startswith(
        os.path.basename(newest) + ".")), key=lambda e: (len(e), e)) if not os.path.exists(newest) else []
    if aside:   # branch() stopped before `latest` (its newest name: .abandoned, .abandoned-2, ...)
        warn(f"{os.path.basename(newest)}, which 'latest' names, was set aside as {aside[-1]} by a resume from an "
             f"older step that stopped before it saved; resuming from {prev!r}, the newest step left. Steps after it "
             "are trained again")
    else:
        warn(f"the newest checkpoint {newest!r} cannot be read ({why}); resuming from the previous good one, "
             f"{prev!r}. Steps after it are trained again")
    return prev


def _mtime(path: str) -> int:
    return os.stat(path).st_mtime_ns


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def read_meta(path: str) -> dict:
    """meta.json of a resolved step folder: {"step": N, "args": {...}, ...}."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)
