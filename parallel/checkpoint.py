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
    2. all files go to `dir/.tmp-step_N/`, meta.json last (its presence marks a complete folder; a write error
       removes the folder);
    3. rank 0 renames it to `step_N` (a folder of the same step, from an earlier run, is moved aside
       first and deleted after), then replaces `latest` (write + rename), then deletes all but the
       newest `keep` folders at or below this step.
  `protect` (--keep-best's step, parallel/keep_best.py) is kept beside the newest `keep`.
- `branch(path)` (rank 0, a resume): the newer step folders beside `path` become `step_N.abandoned` and `latest`
  names `path`, so a crash before the next save comes back here, not to a step past the metrics kept; a save of
  step N or later removes `step_N.abandoned`. The run's exports (OUT/adapter, OUT/adapter_best) were made past
  `path`, so they become `adapter.abandoned` (..-2, ...) too: none is left describing a step the run no longer has.
- `load(path, model, optimizer, steps=N)` restores all of it into an already-assembled model and returns the
  step to continue from (rank 0 says which; and, at step N or past it, that the run has nothing left to train).
- `python -m parallel.checkpoint OUT/ckpt[/step_N] --out DIR` (`main(argv)`, its exit code): the adapter of a
  checkpoint (`parallel.checkpoint_export.export`).
Which step folder a path names and whether it is whole: parallel/checkpoint_folders.py (`resolve`, `read_meta`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from parallel.checkpoint_folders import ABANDONED_RE, STEP_RE, _previous_good, _read, _steps, _warn, read_meta, resolve
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
        try:
            _fsync_write(os.path.join(tmp, "meta.json"), json.dumps({"step": step, **(extra or {})}, indent=1,
                                                                     default=str))
        except OSError:   # (DCP's GBs off the full disk, as above)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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


def load(path: str, model, optimizer, *, warn=_warn, steps: int | None = None) -> int:
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
        if steps is not None and step >= steps:   # (a requeue of a run that had ended: --resume auto on a finished one)
            print(f"note: step {step} is this run's last: nothing to train; its adapter is written again from it",
                  flush=True)
    return step


def main(argv=None) -> int:
    """`python -m parallel.checkpoint`: the exit code (2 and one `error:` line on stderr when refused)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m parallel.checkpoint",
                                 description="The PEFT adapter of a train.py checkpoint, without resuming the run")
    ap.add_argument("ckpt", help="OUT/ckpt (its newest good checkpoint) or OUT/ckpt/step_N")
    ap.add_argument("--out", required=True, help="a new (or empty) directory for the adapter")
    ap.add_argument("--model", default=None, help="the run's base model, if moved since the run (default: the path "
                    "the run recorded); the adapter names it")
    a = ap.parse_args(argv)
    from parallel.checkpoint_export import export
    try:
        step = export(a.ckpt, a.out, model=a.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # an unwritable --out, a full disk (write_adapter removed what it had written)
        print(f"error: writing the adapter to {a.out!r} failed ({type(e).__name__}: {e}); nothing is left there: free "
              "space (or fix the folder), then run the same command again", file=sys.stderr)
        return 2
    print(f"adapter of {step} in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
