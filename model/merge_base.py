"""The merge's base and --quant, as the adapter records them (what `python -m model.merge` folds it into).

Contract:
- `adapter_base(adapter_dir)`: the base adapter_config.json names, its path or a Hub id as id@commit (a merge
  without --model fetches that); None when it names none.
- `other_base(adapter_dir, model)`: why `model` is not the base the adapter was trained on (trained_on.json's
  model_sha256 for a local base, adapter_config.json's commit for a Hub one), or None; adapters that record
  neither pass. The merge refuses on it unless --any-base.
- `run_quant(adapter_dir)`: (quant, the file that says it) from trained_on.json, else the run's config.json beside
  the adapter; (None, None) when neither says it (the merge then asks for --quant, never guesses).
They read the adapter's small files and, for `other_base`, `model`'s fingerprint (model/hub.py); they write nothing.
"""

from __future__ import annotations

import json
import os
import re


def run_quant(adapter_dir: str) -> tuple[str | None, str | None]:
    """(quant, where it came from): the adapter's own trained_on.json (train.py and `python -m parallel.checkpoint`
    write it), else the training run's config.json beside the adapter (adapters from before 2026-12-02), if any."""
    from model.export import TRAINED_ON

    for path in (os.path.join(adapter_dir, TRAINED_ON),
                 os.path.join(os.path.dirname(os.path.abspath(adapter_dir)), "config.json")):
        try:
            with open(path) as f:
                quant = json.load(f).get("quant")
        except (OSError, ValueError, AttributeError):
            continue
        if quant in ("nf4", "none"):
            return quant, path
    return None, None


def other_base(adapter_dir: str, model: str) -> str | None:
    """Why `model` is not the base the adapter was trained on, or None: trained_on.json's model_sha256 (train.py records
    the base's `model.hub.model_fingerprint` for a local --model) against the same fingerprint of `model` now. A path
    names nothing: a base moved elsewhere folds in, another checkpoint of the same shapes at the path it names (the
    base model beside its Instruct tune), or one edited in place since, does not. Adapters that record none pass."""
    from model.export import TRAINED_ON
    from model.hub import model_fingerprint, same_model

    try:
        with open(os.path.join(adapter_dir, TRAINED_ON)) as f:
            want = json.load(f).get("model_sha256")
    except (OSError, ValueError, AttributeError):
        return None
    if not want:   # a Hub model's run records its commit instead (adapter_config.json's revision)
        return _other_commit(adapter_dir, model)
    if same_model(model, want):
        return None
    got = model_fingerprint(model)
    return (f"--model {model!r} is not the base {adapter_dir!r} was trained on: its files (config.json, the weight "
            f"index, each weight file's size, header, first and last MB) give model_sha256 {str(got)[:12]}..., "
            f"{TRAINED_ON} records {want[:12]}... (another checkpoint, or this one edited since); pass the base it "
            "was trained on, or --any-base to fold it into this one anyway")


def _other_commit(adapter_dir: str, model: str) -> str | None:
    """For an adapter trained on a Hub model (adapter_config.json: "org/name" and the commit as its revision): why
    `model` is not that snapshot, or None. A snapshot of the hub cache names its commit; another directory's files
    cannot be compared with it."""
    from model.hub import hub_snapshot

    trained = adapter_base(adapter_dir)
    if not trained or "@" not in trained or os.path.isabs(trained) or os.path.isdir(trained):
        return None   # a local base, or no commit recorded: nothing to compare
    got = hub_snapshot(os.path.realpath(model)) or hub_snapshot(model)
    if got == trained:
        return None
    this = f"the snapshot {got}" if got else "a directory outside the hub cache, whose files cannot be compared with it"
    return (f"--model {model!r} is not the base {adapter_dir!r} was trained on: that is the Hub snapshot {trained} "
            f"(adapter_config.json), this is {this}; pass --model {trained} (fetched into the hub cache), or "
            "--any-base to fold it into this one anyway")


def adapter_base(adapter_dir: str) -> str | None:
    """The base model adapter_config.json names: its path, or a Hub id as id@commit."""
    try:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    base, rev = cfg.get("base_model_name_or_path"), cfg.get("revision")
    if not (isinstance(base, str) and rev) or os.path.isabs(base):
        return base
    # a Hub id with the commit train.py records for one (its local bases are absolute paths): never looked up in the
    # current directory, where an unrelated ./org/name would pass for it; another tool's relative path with a branch
    # name (peft's revision "main") is a directory when there is one
    ours = re.fullmatch(r"[0-9a-f]{40}", str(rev)) and re.fullmatch(r"[\w.-]+/[\w.-]+", base) and \
        not base.startswith(".")
    return f"{base}@{rev}" if ours or not os.path.isdir(base) else base
