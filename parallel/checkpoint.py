"""Save and resume training with torch.distributed.checkpoint (DCP); `latest` only names complete folders.

Contract:
- `save(dir, model, optimizer, step, extra, keep=2, rng=None)` writes `dir/step_{step:06d}/`: the LoRA parameters
  (frozen base weights are not saved, a tied embedding under its lm_head name neither: they come from the model
  checkpoint again) and the AdamW state, as sharded
  DCP files any later mesh can load, every rank's RNG state (now, or `rng`: `rng_state()` taken when step `step`
  ended, for a save made later), and `meta.json` (step, extra: e.g. the resolved flags). The LR schedule and the
  data position are functions of the step, so the step restores them. Order, so that a kill
  at any point leaves a resumable `latest`:
    1. every rank checks its trainable tensors; if any holds NaN/Inf, all ranks raise NonFiniteError
       and nothing is written;
    2. all files go to `dir/.tmp-step_N/`, meta.json last (its presence marks a complete folder);
    3. rank 0 renames it to `step_N` (a folder of the same step, from an earlier run, is moved aside
       first and deleted after), then replaces `latest` (write + rename), then deletes all but the
       newest `keep` folders at or below this step.
  `protect` (--keep-best's step, parallel/keep_best.py) is kept beside the newest `keep`.
- `resolve(path)` is cheap (no weights; run it at start-up): a step folder, or the one `latest` names in a ckpt folder
  (a newer whole step folder written after `latest` wins: a save killed between its rename and `latest`'s). An
  abandoned step (`branch`) or an unfinished save's folder is refused, naming the live steps. A folder is readable
  when meta.json parses and every byte range DCP's `.metadata` points at is present on disk (a truncated file fails
  this). Given a ckpt folder whose newest checkpoint is unreadable, it falls back to the previous readable one and
  warns, naming both; given an unreadable step folder, it refuses, naming the previous readable one.
- `branch(path)` (rank 0, a resume): the newer step folders beside `path` become `step_N.abandoned` and `latest`
  names `path`, so a crash before the next save comes back here, not to a step past the metrics kept; a save of
  step N or later removes `step_N.abandoned`. The run's exports (OUT/adapter, OUT/adapter_best) were made past
  `path`, so they become `adapter.abandoned` (..-2, ...) too: none is left describing a step the run no longer has.
- `load(path, model, optimizer)` restores all of it into an already-assembled model and returns the
  step to continue from.
- `export(path, out_dir)`: the PEFT adapter of a checkpoint, as train.py exports at the end, without resuming and
  without building the model (one process reads the LoRA tensors from the DCP files, any layout they were saved
  from); also `python -m parallel.checkpoint OUT/ckpt[/step_N] --out DIR` (refuses a non-empty DIR, one inside
  the ckpt folder, NaN/Inf). Rotation and resume see only the step_NNNNNN folders save() names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from parallel.guard import NonFiniteError, on_rank0

OPTS = StateDictOptions(ignore_frozen_params=True)


def _state(model, optimizer) -> dict:
    """{"model", "optim"}: what save writes and load reads. ignore_frozen_params drops each frozen parameter under
    the one name named_parameters() gives it, so a tied model kept its embedding under the alias (lm_head.weight):
    a second copy of the largest frozen tensor in every checkpoint (272 MB for Qwen2.5-0.5B). Dropped here; a
    checkpoint that holds it (written before) still loads, as DCP reads only the keys asked for. A trained tied
    embedding (--train-embeddings) is kept once, as model.embed_tokens.weight: its lm_head alias is dropped too."""
    msd, osd = get_state_dict(model, optimizer, options=OPTS)
    first, drop = {}, set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad or first.setdefault(id(p), n) != n:   # frozen, or a second name of a trained one
            drop.add(n)
    return {"model": {k: v for k, v in msd.items() if k not in drop}, "optim": osd}
STEP_RE = re.compile(r"step_(\d+)$")
ABANDONED_RE = re.compile(r"step_(\d+)\.abandoned(-\d+)?$")


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _failed(failures: dict, what: str) -> BaseException:
    """The error every rank raises when a rank's part of a save failed: an OSError naming the first such rank (a full
    disk, a read-only folder: train.py says it in one line; its errno kept), else DCP's own exception."""
    r = min(failures)
    exc = failures[r][0]   # (DCP's (exception, traceback) pairs; _agree's the same)
    if not isinstance(exc, OSError):
        return CheckpointException(what, failures)
    out = OSError(f"{what} failed on rank {r} ({type(exc).__name__}: {exc}); no earlier checkpoint was touched")
    out.errno = exc.errno
    return out


def _agree(err: OSError | None, what: str) -> None:
    """A barrier that also raises `_failed` on every rank when this or another rank passes an error."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if err is not None:
            raise _failed({0: (err, None)}, what)
        return
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, None if err is None else (err.errno, f"{err}"))
    if bad := {r: b for r, b in enumerate(box) if b}:
        errs = {r: (OSError(text), None) for r, (_, text) in bad.items()}
        for r, (no, _) in bad.items():
            errs[r][0].errno = no
        raise _failed(errs, what)


def rng_state() -> dict:
    """This rank's RNG state (CPU, and CUDA where present): `save(rng=)` takes one captured earlier."""
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def check_finite(model, what: str) -> None:
    """Raise NonFiniteError on every rank if any rank's share of a trainable tensor holds NaN/Inf."""
    bad, dev = [], None
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.to_local() if hasattr(p, "to_local") else p   # a DTensor: this rank's shard
            dev = t.device
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad.append(name)
    n = torch.tensor([len(bad)], device=dev or "cpu")
    if dist.is_initialized():
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    if n.item():
        here = f": {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else " (on another rank)"
        raise NonFiniteError(f"refusing to write {what}: trainable tensors hold NaN or Inf{here}. The "
                             "previous checkpoint is kept; lower --lr or check the data")


def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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


def save(ckpt_dir: str, model, optimizer, step: int, extra: dict | None = None, *, keep: int = 2,
         rng: dict | None = None, protect: int | None = None) -> str:
    if keep < 1:
        raise ValueError(f"--keep-ckpts must be >= 1 (the checkpoint just written is one), got {keep}")
    check_finite(model, f"checkpoint step {step}")
    name = f"step_{step:06d}"
    final, tmp = os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, f".tmp-{name}")
    rank = _rank()

    def prepare():   # leftovers of a save that was killed (the run lock rules out a live writer)
        os.makedirs(ckpt_dir, exist_ok=True)
        for e in os.listdir(ckpt_dir):
            if e.startswith((".tmp-", ".old-")):
                shutil.rmtree(os.path.join(ckpt_dir, e), ignore_errors=True)
        os.makedirs(tmp)
    on_rank0(prepare, f"saving checkpoint step {step}")   # (every rank then writes into tmp)
    try:
        try:
            dcp.save(_state(model, optimizer), checkpoint_id=tmp)
        except CheckpointException as e:   # every rank gets it when one rank's write failed (a full disk)
            raise _failed(e.failures, f"saving checkpoint step {step}") from None
        err = None
        try:
            with open(os.path.join(tmp, f"rng_{rank}.pt"), "wb") as f:   # on disk before meta.json says it is whole
                torch.save(rng or rng_state(), f)   # (DCP syncs its own files)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            err = e
        _agree(err, f"saving checkpoint step {step}")   # (a barrier: a rank whose write failed leaves none waiting)
    except OSError:
        if rank == 0:   # the half-written folder's space back (every rank stops here: no writer left)
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def commit():   # rank 0; a failure (a full disk) is raised on every rank (guard.on_rank0), none waits on
        _fsync_write(os.path.join(tmp, "meta.json"), json.dumps({"step": step, **(extra or {})}, indent=1,
                                                                 default=str))
        old = os.path.join(ckpt_dir, f".old-{name}")
        if os.path.exists(final):   # re-saving a step (a resumed run): never delete before the new one is in
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_write(os.path.join(ckpt_dir, "latest.tmp"), name)
        os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        shutil.rmtree(old, ignore_errors=True)
        for old_step, path in [sp for sp in _steps(ckpt_dir) if sp[0] <= step][keep:]:   # past the newest `keep`
            if old_step != protect:
                shutil.rmtree(path, ignore_errors=True)
        for e in os.listdir(ckpt_dir):   # branch()'s folders this run has now trained past: superseded
            if (m := ABANDONED_RE.match(e)) and int(m.group(1)) <= step:
                shutil.rmtree(os.path.join(ckpt_dir, e), ignore_errors=True)
        fd = os.open(ckpt_dir, os.O_RDONLY)   # make the renames durable
        os.fsync(fd)
        os.close(fd)
    on_rank0(commit, f"saving checkpoint step {step}")
    return final


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


def branch(path: str, log=print) -> list[str]:
    """Resuming from `path`, a step below its ckpt folder's newest: make it the newest, so that a crash before this
    run's next save resumes here again and not from a step whose metrics the resume dropped. Rank 0, under the lock.
    The newer step folders are renamed `step_N.abandoned` (never resumed; their steps rerun from here, and a save of
    step N or later removes them, superseded) and `latest` names `path`; OUT/adapter and OUT/adapter_best, exported
    past `path`, become `adapter.abandoned` and `adapter_best.abandoned` (-2, ... when taken)."""
    ckpt_dir, name = os.path.split(os.path.normpath(path))
    m = STEP_RE.match(name)
    if not m:
        return []
    newer = [p for s, p in _steps(ckpt_dir) if s > int(m.group(1))]
    run = os.path.dirname(ckpt_dir)
    exports = [p for e in ("adapter", "adapter_best") if newer and os.path.isdir(p := os.path.join(run, e))]
    moved = []
    for p in [*exports, *reversed(newer)]:   # (exports first: a kill in between leaves no export of an abandoned step
        # in place, while the newer steps, still there, have the next resume move them)
        to, n = p + ".abandoned", 2
        while os.path.exists(to):
            to, n = f"{p}.abandoned-{n}", n + 1
        os.rename(p, to)
        moved.append(os.path.basename(to))
    latest = os.path.join(ckpt_dir, "latest")
    if newer or not os.path.isfile(latest) or _read(latest) != name:
        _fsync_write(os.path.join(ckpt_dir, "latest.tmp"), name)
        os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        fd = os.open(ckpt_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if moved:
        exported, steps = moved[:len(exports)], moved[len(exports):]
        log(f"resuming from {name}, below the newest checkpoint: {', '.join(steps)} in {ckpt_dir} (steps this run "
            "trains again: never resumed, kept until this run saves past them)"
            + (f"; the adapters exported past {name} are now {', '.join(exported)} in {run}" if exported else ""))
    return moved


def read_meta(path: str) -> dict:
    """meta.json of a resolved step folder: {"step": N, "args": {...}, ...}."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def load(path: str, model, optimizer, *, warn=_warn) -> int:
    path = resolve(path, warn=warn)
    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:   # noqa: BLE001 - the folder and the way out, the cause kept
        # (DCP's CheckpointException is a BaseException, not an Exception)
        if re.search(r"Missing key in checkpoint state_dict: optim\.", str(e)):   # not a damaged folder
            raise ValueError(f"checkpoint {path!r} was saved with another optimizer than train.py's make_optimizer "
                             f"builds ({str(e).strip().splitlines()[-1][:200]}): resume with the one it was saved "
                             "with, or start a fresh run from its adapter (`python -m parallel.checkpoint` writes a "
                             "step's; --init-adapter takes it)") from None
        prev = _previous_good(os.path.dirname(os.path.normpath(path)), read_meta(path)["step"])
        raise ValueError(f"checkpoint {path!r} cannot be loaded ({type(e).__name__}: {str(e)[:300]})"
                         + (f"; the previous good one is {prev!r}: pass --resume {prev}" if prev else "")) from e
    # non-strict: the checkpoint holds only the trainable (LoRA) tensors; the frozen base came from disk
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng = os.path.join(path, f"rng_{_rank()}.pt")
    if os.path.isfile(rng):   # a different world size resumes with fresh RNG on the new ranks
        st = torch.load(rng, weights_only=False)
        torch.set_rng_state(st["cpu"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state(st["cuda"])
    step = int(read_meta(path)["step"])
    if _rank() == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def export(path: str, out_dir: str, replace: bool = False, model: str | None = None) -> str:
    """Write the PEFT adapter of checkpoint `path` (a step folder, or a ckpt folder's newest good one) to `out_dir`;
    return the step folder read. `replace` (--keep-best's adapter_best): an adapter already there is swapped out once
    the new one is whole (model.export.write_adapter), not refused. `model`: the run's base, moved since (the adapter
    names it; its files must be the ones the run recorded)."""
    from model.config import lora_layers
    from model.export import half_written, peft_keys, write_adapter
    from model.hub import hub_snapshot, same_model
    from model.load import read_args
    from model.norms import is_saved_weight
    from model.qlora import lora_config
    if not out_dir:
        raise ValueError("--out is empty: pass a new directory")
    real_out = os.path.realpath(out_dir)   # what is written ('new/..' is its parent, a link its target): checked
    if os.path.isfile(real_out):
        raise ValueError(f"--out {out_dir!r} is a file: pass a new directory")
    if not replace and os.path.isdir(real_out) and os.listdir(real_out) and not half_written(real_out):
        raise ValueError(f"--out {out_dir!r} exists and is not empty" + (f" (it is {real_out!r})" if real_out !=
                         os.path.abspath(out_dir) else "") + ": pass a new directory")   # (a killed export into it
        # may be written again)
    path = resolve(path, flag="checkpoint")
    real_step = os.path.realpath(path)
    linked_from = os.path.realpath(os.path.dirname(os.path.abspath(path)))   # (a link to a step folder: the folder
    is_ckpt = STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.isfile(os.path.join(linked_from,
                                                                                                     "latest"))
    for ckpt_dir in {os.path.dirname(real_step), *([linked_from] if is_ckpt else [])}:   # it is in, and the ckpt
        # folder the link is in)
        if real_out == ckpt_dir or real_out.startswith(ckpt_dir + os.sep):
            raise ValueError(f"--out {out_dir!r} is inside the checkpoint folder {ckpt_dir!r}, which the run rotates "
                             "and rewrites: pass a directory outside it (e.g. beside it, "
                             f"{os.path.join(os.path.dirname(ckpt_dir), 'adapter_' + os.path.basename(real_step))!r})")
    args = read_meta(path).get("args", {})
    if not {"model", "lora_r", "lora_alpha", "lora_dropout", "lora_targets"} <= set(args):
        raise ValueError(f"{path}/meta.json lacks the run's LoRA flags: not a train.py checkpoint")
    if model is not None:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"--model {model!r} is not a model directory (no config.json): pass the run's base")
        if args.get("model_sha256") and not same_model(model, args["model_sha256"]):
            raise ValueError(f"--model {model!r} is not the base this run trained on (its files differ from the "
                             f"model_sha256 {path}/meta.json records): pass that base")
        if (hub := hub_snapshot(args["model"])) and hub_snapshot(os.path.realpath(model)) != hub \
                and hub_snapshot(model) != hub:   # (a Hub base records no fingerprint: its snapshot is the check)
            raise ValueError(f"--model {model!r} is not the base this run trained on: that is the Hub snapshot {hub} "
                             f"({path}/meta.json); pass its snapshot directory in the hub cache")
        args = {**args, "model": os.path.abspath(model)}
    elif args.get("rope_scaling") is not None and not os.path.isdir(args["model"]):
        raise ValueError(f"the run's base {args['model']!r} (meta.json) is gone, and its --rope-scaling is written "
                         "from the base's config.json: pass --model DIR, the base where it is now")
    try:   # (a damaged file, or a step a live run's rotation removes while this reads it: said, not a traceback)
        md = dcp.FileSystemReader(path).read_metadata()   # the LoRA tensors' names and shapes; not the optimizer's
        # (only LoRA's: a tied model's checkpoint written before _state also holds lm_head.weight, the embedding under
        # its tied name; train.py's own export writes LoRA A and B alone)
        lora = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items()
                if k.startswith("model.") and hasattr(m, "size") and (any(f".lora_{x}." in k for x in (
                    "A", "B", "magnitude_vector")) or is_saved_weight(k))}   # (--train-norms', --train-embeddings')
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": lora}, checkpoint_id=path, no_dist=True)   # one process, whatever layout saved it
    except (Exception, CheckpointException) as e:   # noqa: BLE001 - (DCP's CheckpointException: a BaseException)
        prev = _previous_good(os.path.dirname(os.path.normpath(path)), read_meta(path)["step"]) \
            if os.path.isfile(os.path.join(path, "meta.json")) else None
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {str(e).strip()[:300]})"
                         + (f"; the previous good one is {prev!r}: export that one" if prev else "")) from None
    bad = [k for k, v in lora.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(f"{path} holds NaN or Inf in {', '.join(bad[:4])}: no adapter written")
    rope = args.get("rope_scaling")
    write_adapter(peft_keys(lora), lora_config(args["lora_r"], args["lora_alpha"], args["lora_dropout"],
                                               args["lora_targets"].split(","), args.get("rslora", False),
                                               args.get("dora", False), lora_layers(args.get("lora_layers"))),
                  out_dir, args["model"],
                  read_args(args["model"], rope).rope_parameters() if rope is not None else None,
                  args.get("chat_template_text"), args.get("quant", "nf4"),   # (runs that record none: the default)
                  args.get("model_sha256"), tied=read_meta(path).get("tie_embeddings", False))   # (a checkpoint from
    # before the key trained no tied embedding: refused then; the base's config.json is not read, it may be gone)
    return path


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="The PEFT adapter of a train.py checkpoint, without resuming the run")
    ap.add_argument("ckpt", help="OUT/ckpt (its newest good checkpoint) or OUT/ckpt/step_N")
    ap.add_argument("--out", required=True, help="a new (or empty) directory for the adapter")
    ap.add_argument("--model", default=None, help="the run's base model, if moved since the run (default: the path "
                    "the run recorded); the adapter names it")
    a = ap.parse_args()
    try:
        step = export(a.ckpt, a.out, model=a.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:   # an unwritable --out, a full disk
        print(f"error: writing the adapter to {a.out!r} failed ({type(e).__name__}: {e}); pass a writable new "
              "directory", file=sys.stderr)
        sys.exit(2)
    print(f"adapter of {step} in {a.out}")
