"""How long a run trains: its optimizer steps from --steps, --epochs or one epoch, and the note when a resume
changes that length (so its LR schedule's).

Contract:
- `schedule_note(ckpt, steps)`: a note when the LR schedule's length changes on resume.
- `total_steps(args, ckpt, order)`: --steps; or --epochs E, `ceil(order.samples_in(E) / --global-batch)` (E × the
  samples of an epoch, when epochs are alike; refused below the checkpoint's step); or one epoch,
  `ceil(order.size(0) / --global-batch)`, which a resume counts as its run did
  (`steps_total` in the checkpoint; one from before it: rounded down). A run with --steps or --epochs resumes with one.
"""

from __future__ import annotations

import math
from fractions import Fraction


def schedule_note(ckpt: str | None, steps: int | None, why: str = "--steps") -> str | None:
    """A note when a resume trains to another length than its checkpoint's run: the LR schedule's length changes."""
    if not ckpt:
        return None
    from parallel.checkpoint_folders import read_meta

    meta = read_meta(ckpt)
    had = meta.get("args", {}).get("schedule_steps") or meta.get("args", {}).get("steps") or meta.get("steps_total")
    if isinstance(had, int) and isinstance(steps, int) and had != steps:
        return (f"note: the checkpoint's run scheduled the LR over {had} steps, this one over {steps} ({why}): the "
                f"steps after {meta['step']} follow the schedule over the new length, not the one the run would have "
                "gone on with")
    return None


def epoch_samples(epochs: float, n_samples: int) -> int:
    """Samples in `epochs` passes over `n_samples`, rounded up: exact for the decimal typed (1.1 × 100 is 110, not
    the float's 110.00000000000001, which made 12 steps of 10)."""
    return math.ceil(Fraction(str(epochs)) * n_samples)


def total_steps(args, ckpt: str | None, order) -> int:
    """The run's optimizer steps (module docstring); `order`: its data.GlobalBatches (epochs of `order.size(e)`
    samples)."""
    if args.steps:
        return args.steps
    n = order.size(0) if all(order.size(e) == order.size(0) for e in range(2)) else None   # (else: they vary)
    per = f"{n} samples" if n else f"epochs of {order.size(0)}, {order.size(1)}, ... samples"
    if getattr(args, "epochs", None):
        steps = -(-order.samples_in(args.epochs) // args.global_batch)   # each sample at least floor(E) times
        if ckpt:
            from parallel.checkpoint_folders import read_meta
            if steps < (at := read_meta(ckpt)["step"]):
                raise ValueError(f"--epochs {args.epochs:g} is {steps} steps of {args.global_batch} over {per}, "
                                 f"below the checkpoint's step {at}: nothing would train. Pass more "
                                 "--epochs to train on, or use the adapter that run exported")
        return steps
    if ckpt:   # (check_resume refused a run that had --steps or --epochs)
        from parallel.checkpoint_folders import read_meta
        return read_meta(ckpt).get("steps_total", max(1, order.size(0) // args.global_batch))   # (until 2026-12-02)
    return math.ceil(order.size(0) / args.global_batch)   # one epoch: every sample at least once
