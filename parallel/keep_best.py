"""--keep-best: the checkpoint of the lowest eval loss survives rotation, and its adapter is exported at the end.

Contract:
- `Best.of_run(args, ckpt, log)`: the lowest eval loss so far, its step and the eval data's sha256. train.py writes
  them into every checkpoint's meta.json (`meta()`) and passes the step to `checkpoint.save(protect=)`, so rotation
  keeps it beside the newest --keep-ckpts. A resume goes on comparing with a checkpoint's best only onto the same
  eval data and in the same run folder; otherwise (other --eval-data, a resume into another --out) the best is chosen
  among the run's own evaluations from there on, said. Without --keep-best nothing is tracked or protected.
- `update(step, loss)` at each evaluation: the eval loss is reduced over ranks, so every rank holds the same best
  and makes the same saves.
- `export_best(ckpt_dir, best, out_dir, log)`, rank 0 at the end: that checkpoint's adapter
  (`checkpoint.export(replace=True)`) to OUT/adapter_best, written whole in a .tmp, then swapped in. A checkpoint
  that cannot be read is a warning, not an error: the run itself is done and its own adapter written.
"""

from __future__ import annotations

import math
import os

from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: caught by name)

from parallel.checkpoint import export, problem, read_meta


class Best:
    """The lowest eval loss, its step and the eval data it was measured on (module docstring)."""

    def __init__(self, eval_sha: str | None = None):
        self.step, self.loss, self.eval_sha = None, math.inf, eval_sha

    @classmethod
    def of_run(cls, args, ckpt: str | None, log) -> Best:
        """A run's start: a resume's best when it was measured on these eval data and lies in this run's own ckpt
        folder (a resume into a new --out, or onto other eval data, chooses anew from its evaluations on, said)."""
        from data.mix import data_files
        from data.store import file_sha256

        split = getattr(args, "eval_split", None)   # (its eval set: those records of --data, which a resume keeps)
        sha = args.data_sha256 if not isinstance(args.data_sha256, list) else ",".join(args.data_sha256)
        # the eval files' bytes in any order (their eval loss is the same); one file's: its sha256, as before
        files = lambda: ",".join(sorted(map(file_sha256, data_files(args.eval_data))))
        best = cls(None if not args.keep_best else files() if not split else
                   f"--eval-split {split!r} --seed {args.seed} of --data {sha}")
        got = read_meta(ckpt).get("best") if ckpt and args.keep_best else None
        if got:
            here = os.path.realpath(os.path.dirname(ckpt)) == os.path.realpath(os.path.join(args.out, "ckpt"))
            if here and got.get("eval_data_sha256") == best.eval_sha:
                best.step, best.loss = got["step"], got["eval_loss"]
            else:
                log(f"note: --keep-best: the checkpoint's best (step {got['step']}, eval_loss {got['eval_loss']:.6f}) "
                    f"{'was measured on other --eval-data' if here else 'is in another run folder'}: the best is "
                    "chosen among this run's evaluations from here on")
        return best

    def update(self, step: int, loss: float) -> bool:
        if loss < self.loss:   # (a NaN eval loss is never the best)
            self.step, self.loss = step, loss
            return True
        return False

    def meta(self) -> dict:
        return {"best": {"step": self.step, "eval_loss": self.loss, "eval_data_sha256": self.eval_sha}} \
            if self.step else {}


def export_best(ckpt_dir: str, best: Best, out_dir: str, log) -> None:
    """Rank 0: the adapter of the best checkpoint to `out_dir` (module docstring)."""
    folder = os.path.join(ckpt_dir, f"step_{best.step:06d}")
    try:
        if why := problem(folder):
            raise ValueError(why)
        export(folder, out_dir, replace=True)   # (swapped in whole, a killed swap's leftovers cleared)
    except (Exception, CheckpointException) as e:   # noqa: BLE001
        log(f"warning: --keep-best: the best checkpoint {folder} cannot be exported ({type(e).__name__}: {e}); no "
            f"{out_dir}")
        return
    log(f"best: eval_loss {best.loss:.6f} at step {best.step}, its adapter in {out_dir}")
