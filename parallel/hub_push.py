"""--push-to-hub ORG/NAME[@BRANCH]: the run's adapter uploaded to a Hugging Face model repo at its end (TRL's
push_to_hub), after it is on disk, so an upload that fails loses nothing.

Contract:
- `check(args)` (preflight.check_start, before anything is written and any weight read; --plan pushes nothing and
  checks nothing): the id's form (ORG/NAME by huggingface_hub's rules, a branch after @), --hub-private only with it,
  a token where huggingface_hub finds one (`get_token`: HF_TOKEN, `hf auth login`'s file), HF_HUB_OFFLINE unset. Each
  refusal is one ValueError naming the value and the fix: a day of training that cannot be uploaded is refused at its
  start, as --report-to wandb without a key is. No network at start-up (nodes that reach the Hub only at the end, a
  slow or down Hub): whether the token may write to ORG is known at the upload only.
- `push(args, best, log)`: rank 0, in train.py's finish() (inside guard.on_rank0: a failure stops every rank alike, none
  left waiting in a collective), after OUT/adapter, OUT/adapter_best and metrics.jsonl are written and closed, before
  OUT's lock is let go (a next run's --overwrite cannot empty a folder being uploaded). What is pushed is the run's
  result: OUT/adapter_best when --keep-best exported it in this run (`best.exported`; TRL's load_best_model_at_end then
  push_to_hub pushes the best), else OUT/adapter; its files, as they are on disk, to the repo's top level (its
  README.md, the model card, replaces the repo's, as TRL's push does), on BRANCH (created from main
  when missing) or main, the repo created when missing (private with --hub-private, else the
  account's default; huggingface_hub keeps an existing repo's visibility, so --hub-private onto a public repo is
  refused, uploading nothing), in one commit whose message names OUT, which adapter, its step and eval loss. The log
  says which.
- A failed upload (offline, 401/403, a rate limit, no such org) leaves every file of OUT as written and raises
  `PushFailed` (a ValueError): train.cli's one `error:` line names the repo, the error and the `hf upload` command that
  retries it, and the run exits 2, as any error whose message is the fix: a job whose adapter did not get where it was
  to go fails, so schedulers and scripts notice. A requeue with --resume auto (the run's last step is saved) trains
  nothing, exports the same adapter and pushes again. A stop by signal, or any error before the end, pushes nothing.
- The upload runs under the watchdog's --timeout like any phase (an adapter is MBs; one with --train-embeddings GBs).
"""

from __future__ import annotations

import json
import os
import re
import shlex

BRANCH = re.compile(r"(?!-)(?!.*\.\.)(?!.*//)[\w./-]+(?<![/.])")   # a git branch name (no spaces, ~^:?*[\)


class PushFailed(ValueError):
    """The upload failed; the adapter and metrics are on disk (module docstring)."""


def parse(spec: str) -> tuple[str, str | None]:
    """(repo id, branch or None) of --push-to-hub's ORG/NAME[@BRANCH]; a ValueError naming the value and the form."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, at, branch = spec.partition("@")
    form = "--push-to-hub takes ORG/NAME or ORG/NAME@BRANCH (a model repo, e.g. my-org/qwen7b-long-lora)"
    if repo.count("/") != 1:   # (a bare NAME would go to whichever account the token is: said, not guessed)
        raise ValueError(f"--push-to-hub {spec!r}: {form}" + ("; the namespace (your user or an org) is needed"
                                                              if "/" not in repo else ""))
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ValueError(f"--push-to-hub {spec!r}: {e} ({form})") from None
    if at and not (BRANCH.fullmatch(branch) and not branch.endswith(".lock")):
        raise ValueError(f"--push-to-hub {spec!r}: {branch!r} is not a branch name (letters, digits, . _ - /); "
                         f"{form}")
    return repo, branch or None


def check(args) -> None:
    """At start-up, before anything is written (module docstring)."""
    spec = getattr(args, "push_to_hub", None)
    if getattr(args, "hub_private", False) and not spec:
        raise ValueError("--hub-private makes the repo --push-to-hub creates private: pass --push-to-hub ORG/NAME "
                         "too, or drop it")
    if not spec:
        return
    import huggingface_hub
    from huggingface_hub import constants

    repo, _ = parse(spec)
    later = f"or drop --push-to-hub and upload later: hf upload {repo} OUT/adapter ."
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"--push-to-hub {spec}: HF_HUB_OFFLINE is set here, so the upload at the run's end would "
                         f"fail: unset it for this job, {later}")
    try:
        token = huggingface_hub.get_token()
    except Exception as e:   # noqa: BLE001 - HF_OIDC_RESOURCE's exchange failing: said, with the way on
        raise ValueError(f"--push-to-hub {spec}: no Hugging Face token ({type(e).__name__}: {e}); fix it, "
                         f"{later}") from None
    if not token:
        raise ValueError(f"--push-to-hub {spec}: no Hugging Face token here (no HF_TOKEN, no `hf auth login` token "
                         f"file {constants.HF_TOKEN_PATH}): run `hf auth login` or set HF_TOKEN to a token that may "
                         f"write to {repo.split('/')[0]}, {later}")


def _last_record(out: str) -> dict:
    """metrics.jsonl's last step record (closed: the run's last step), or {}."""
    rec = {}
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                try:
                    got = json.loads(line)
                except ValueError:   # (a torn line)
                    continue
                rec = got if isinstance(got, dict) and "step" in got else rec
    except OSError:
        pass
    return rec


def stale(folder: str) -> list[str]:
    """The top-level files an adapter export may write that `folder` lacks: an earlier push's (its RoPE overrides, its
    chat template) are deleted in the same commit, so the repo holds this adapter's files alone, not a mix that loads
    wrong; anything else in the repo (other folders, a .gitattributes) is left as it is."""
    from model.export import WRITTEN
    return sorted(f for f in WRITTEN if not os.path.isfile(os.path.join(folder, f)))


def push(args, best, log) -> None:
    """Rank 0, at the run's end (module docstring)."""
    if not args.push_to_hub:
        return
    import huggingface_hub

    from model.hub import said

    repo, branch = parse(args.push_to_hub)
    if getattr(best, "exported", None):   # --keep-best's adapter, exported in this run: the run's result
        folder, which, step, loss = best.exported, "adapter_best", best.step, best.loss
    else:
        rec = _last_record(args.out)
        folder, which, step, loss = os.path.join(args.out, "adapter"), "adapter", rec.get("step"), rec.get("eval_loss")
    message = f"{which} of {args.out}" + (f" at step {step}" if step else "") + (
        f", eval_loss {loss:.6g}" if isinstance(loss, float) else "")
    gone = stale(folder)
    retry = " ".join(["hf upload", shlex.quote(repo), shlex.quote(folder), ".", "--commit-message",
                      shlex.quote(message), *(["--revision", shlex.quote(branch)] if branch else []),
                      *[x for f in gone for x in ("--delete", shlex.quote(f))],
                      *(["--private"] if args.hub_private else [])])
    try:
        api = huggingface_hub.HfApi()
        api.create_repo(repo, private=args.hub_private or None, exist_ok=True)   # (an existing repo's: kept)
        public = args.hub_private and api.repo_info(repo).private is False   # --hub-private onto a public repo
        if branch and not public:
            api.create_branch(repo, branch=branch, exist_ok=True)
        info = None if public else api.upload_folder(repo_id=repo, folder_path=folder, revision=branch,
                                                     commit_message=message, delete_patterns=gone)
    except Exception as e:   # noqa: BLE001 - any failure: the files stay, the way to retry is said
        raise PushFailed(f"--push-to-hub {args.push_to_hub}: uploading {folder} failed ({type(e).__name__}: "
                         f"{said(e)}). The run finished: "
                         f"its adapters and {os.path.join(args.out, 'metrics.jsonl')} are on disk. Retry: "
                         f"{retry}") from e
    if public:   # (refused, not made private: others may read it)
        raise PushFailed(f"--push-to-hub {args.push_to_hub} --hub-private: https://huggingface.co/{repo} exists and is "
                         f"public (--hub-private makes private only a repo it creates), so {folder} was not uploaded. "
                         f"The run finished: its adapters and {os.path.join(args.out, 'metrics.jsonl')} are on disk. "
                         f"Make the repo private (https://huggingface.co/{repo}/settings), then: {retry}; or push "
                         "another repo, or this one public (the same without --private)")
    log(f"pushed: {folder} ({message}) to https://huggingface.co/{repo}" + (f"/tree/{branch}" if branch else "")
        + (f", commit {info.oid[:12]}" if isinstance(getattr(info, "oid", None), str) else ""))
