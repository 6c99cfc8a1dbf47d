"""When the training loop writes a checkpoint, and what with (train.py's loop asks; parallel/checkpoint.py writes).

Contract:
- `Saves(args, model, opt, meta, saved)`: `meta()` is the dict each checkpoint's meta.json records beside the step
  (read at each save: --keep-best's best, the early-stop count, the non-finite steps), `saved` the newest step on
  disk (a resume of this run's own checkpoint: its step; else 0). Checkpoints go to OUT/ckpt (`.dir`).
- `clock()`: 1.0 on rank 0 when --save-minutes have passed since the last save (or the start), else 0.0. The loop
  MAX-reduces it with the step's memory peaks, so rank 0's clock decides for every rank and no rank saves alone.
- `after(step, steps, due)`: saves step `step` when --save-every divides it, it is the last, or `due` (the clock,
  a --keep-best evaluation, an early stop); every rank calls it with the same values.
- `before_stop(step, rng)`: a stop signal in step `step + 1`: its partial gradients are dropped and step `step` is
  saved with the RNG as it left it (`rng`), unless it is on disk already; the folder to resume is returned (None
  before the first step).
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from parallel import checkpoint


class Saves:
    def __init__(self, args, model, opt, meta, saved: int, protect=lambda: None, phase=lambda what, step: None):
        self.args, self.model, self.opt, self.meta, self.protect, self.phase = args, model, opt, meta, protect, phase
        self.dir, self.saved, self.at = os.path.join(args.out, "ckpt"), saved, time.time()

    def save(self, step: int, **kw) -> None:
        self.phase("save", step)   # (the watchdog's: a long save is not a stuck rank)
        checkpoint.save(self.dir, self.model, self.opt, step, self.meta(), keep=self.args.keep_ckpts,
                        protect=self.protect(), **kw)

    def clock(self) -> float:
        minutes = self.args.save_minutes
        return float(dist.get_rank() == 0 and 0 < minutes * 60 <= time.time() - self.at)

    def after(self, step: int, steps: int, due) -> None:
        every = self.args.save_every
        if (every and step % every == 0) or step == steps or due:
            self.save(step)
            self.saved, self.at = step, time.time()

    def before_stop(self, step: int, rng: dict) -> str | None:
        if step > self.saved:
            self.opt.zero_grad(set_to_none=True)   # (DCP would skip an AdamW state that was never made)
            self.save(step, rng=rng)
        return self.dir if step else None
