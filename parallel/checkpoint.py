"""Save and resume training with torch.distributed.checkpoint (DCP).

Contract:
- `save(dir, model, optimizer, step, extra)` writes `dir/step_{step:06d}/` with the LoRA parameters
  (frozen base weights are not saved: they come from the checkpoint again), the AdamW state, both as
  sharded DCP files that any later mesh can load, plus `meta.json` (step, extra: e.g. the resolved
  config) and every rank's RNG state. The LR schedule and the data position are functions of the
  step, so the step restores them. A `latest` file is written last, so a crash mid-save leaves the
  previous checkpoint as the one to resume.
- `load(dir, model, optimizer)` restores all of it into an already-assembled model and returns the
  step to continue from. `dir` may be the `ckpt/` folder (the latest one is used) or one step folder.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

OPTS = StateDictOptions(ignore_frozen_params=True)


def _rng_state():
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def save(ckpt_dir: str, model, optimizer, step: int, extra: dict | None = None) -> str:
    path = os.path.join(ckpt_dir, f"step_{step:06d}")
    msd, osd = get_state_dict(model, optimizer, options=OPTS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(_rng_state(), os.path.join(path, f"rng_{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step, **(extra or {})}, f, indent=1, default=str)
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))
    if dist.is_initialized():
        dist.barrier()
    return path


def resolve(path: str) -> str:
    """A step folder, or the one named by `latest` in a ckpt folder; clear error otherwise."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    raise FileNotFoundError(f"--resume {path!r}: no checkpoint there (expected a step_* folder with "
                            "meta.json, or a ckpt folder with a 'latest' file)")


def load(path: str, model, optimizer) -> int:
    path = resolve(path)
    msd, osd = get_state_dict(model, optimizer, options=OPTS)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    # non-strict: the checkpoint holds only the trainable (LoRA) tensors; the frozen base came from disk
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = os.path.join(path, f"rng_{rank}.pt")
    if os.path.isfile(rng):   # a different world size resumes with fresh RNG on the new ranks
        st = torch.load(rng, weights_only=False)
        torch.set_rng_state(st["cpu"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state(st["cuda"])
    with open(os.path.join(path, "meta.json")) as f:
        return int(json.load(f)["step"])
