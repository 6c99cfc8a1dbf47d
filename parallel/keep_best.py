"""--keep-best: the checkpoint of the lowest eval loss survives rotation, and its adapter is exported at the end;
--early-stop: the run ends once the eval loss has stopped improving.

Contract:
- `Best.of_run(args, ckpt, log)`: the lowest eval loss so far, its step and the eval data's sha256. train.py writes
  them into every checkpoint's meta.json (`meta()`) and passes the step to `checkpoint.save(protect=)`, so rotation
  keeps it beside the newest --keep-ckpts. A resume goes on comparing with a checkpoint's best only onto the same
  eval data, tokenized to the same samples (`eval_tokens`), and in the same run folder; otherwise (other
  --eval-data, the same files tokenized otherwise, a resume into another --out) the best is chosen among the run's
  own evaluations from there on, said. Without --keep-best nothing is tracked or protected.
- `update(step, loss)` at each evaluation: the eval loss is reduced over ranks, so every rank holds the same best
  and makes the same saves.
- `eval_identity(args)`: what an eval loss was measured on (the eval files' sha256 in any order, or --eval-split's
  spec, seed and --data's bytes): a resume compares with a checkpoint's best only when it is the same.
- `EarlyStop.of_run(args, ckpt, log)`, `--early-stop N [--early-stop-delta D]`: `update(step, loss)` at each
  evaluation is True once N evaluations in a row have not gone below the best so far by more than D (the first
  evaluation in the loop sets the best; one that improves by D or less neither counts as better nor moves the best; a
  non-finite loss never improves). train.py then saves that step, exports its adapter and ends, as at the last step;
  the LR schedule is the whole run's. The state (best, its step, evaluations since) travels in meta.json and a resume
  in the same folder onto the same eval data and samples goes on counting (with another --early-stop-delta it counts
  again from the checkpoint's best, said); `exhausted(meta, args, ckpt)` (train.py,
  once the data are tokenized, before anything is written or a weight read) refuses a resume of a run that stopped so
  (it would stop at its next evaluation), unless --early-stop is raised past its count or dropped; onto eval files
  tokenized to other samples it counts again instead, as `of_run` does. Every rank reduces the same loss: every rank
  stops at the same step.
- `export_best(ckpt_dir, best, out_dir, log)`, rank 0 at the end: that checkpoint's adapter
  (`checkpoint_export.export(replace=True)`) to OUT/adapter_best, written whole in a .tmp, then swapped in. A checkpoint
  that cannot be read is a warning, not an error: the run itself is done and its own adapter written. `best.exported`:
  the folder once written (parallel/hub_push.py pushes it, not an older run's adapter_best left by a failed export).
"""

from __future__ import annotations

import math
import os

from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: caught by name)

from parallel.checkpoint_export import export
from parallel.checkpoint_folders import problem, read_meta


class Best:
    """The lowest eval loss, its step and the eval data it was measured on (module docstring)."""

    def __init__(self, eval_sha: str | None = None):
        self.step, self.loss, self.eval_sha = None, math.inf, eval_sha
        self.exported = None   # OUT/adapter_best once export_best wrote it (what --push-to-hub pushes)

    @classmethod
    def of_run(cls, args, ckpt: str | None, log) -> Best:
        """A run's start: a resume's best when it was measured on these eval data and lies in this run's own ckpt
        folder (a resume into a new --out, or onto other eval data, chooses anew from its evaluations on, said)."""
        best = cls(eval_identity(args) if args.keep_best else None)
        got = read_meta(ckpt).get("best") if ckpt and args.keep_best else None
        if got:
            here = _here(ckpt, args.out)
            gone = problem(os.path.join(os.path.dirname(os.path.normpath(ckpt)), f"step_{got['step']:06d}"))
            if here and got.get("eval_data_sha256") == best.eval_sha and _same_samples(ckpt, args) and gone:
                # (a resume from below a newer best, whose save rotated this one away: review, helper 46)
                log(f"note: --keep-best: the checkpoint's best (step {got['step']}, eval_loss "
                    f"{got['eval_loss']:.6f}) is no longer in {os.path.dirname(os.path.normpath(ckpt))} ({gone}): "
                    "the best is chosen among this run's evaluations from here on")
            elif here and got.get("eval_data_sha256") == best.eval_sha and _same_samples(ckpt, args):
                best.step, best.loss = got["step"], got["eval_loss"]
            else:
                log(f"note: --keep-best: the checkpoint's best (step {got['step']}, eval_loss {got['eval_loss']:.6f}) "
                    f"{_other(got, best.eval_sha, here)}: the best is chosen among this run's evaluations from here "
                    "on")
        return best

    def update(self, step: int, loss: float) -> bool:
        if loss < self.loss:   # (a NaN eval loss is never the best)
            self.step, self.loss = step, loss
            return True
        return False

    def meta(self) -> dict:
        return {"best": {"step": self.step, "eval_loss": self.loss, "eval_data_sha256": self.eval_sha}} \
            if self.step else {}


def eval_identity(args) -> str:
    """The eval set of a run's eval losses (module docstring)."""
    from data.mix import data_files
    from data.store import file_sha256

    if split := getattr(args, "eval_split", None):   # (those records of --data, which a resume keeps)
        sha = args.data_sha256 if not isinstance(args.data_sha256, list) else ",".join(args.data_sha256)
        return f"--eval-split {split!r} --seed {args.seed} of --data {sha}"
    # the eval files' bytes in any order (their eval loss is the same); one file's: its sha256, as before
    return ",".join(sorted(map(file_sha256, data_files(args.eval_data))))


def _here(ckpt: str, out: str) -> bool:
    """The checkpoint lies in this run's own OUT/ckpt."""
    return os.path.realpath(os.path.dirname(os.path.normpath(ckpt))) == os.path.realpath(os.path.join(out, "ckpt"))


class EarlyStop:
    """--early-stop's count of evaluations without improvement (module docstring); `patience` 0: off."""

    def __init__(self, patience: int = 0, delta: float = 0.0, eval_sha: str | None = None):
        self.patience, self.delta, self.eval_sha = patience or 0, delta, eval_sha
        self.best, self.step, self.bad = math.inf, None, 0

    @classmethod
    def of_run(cls, args, ckpt: str | None, log) -> EarlyStop:
        """A run's start: a resume's count when it was measured on these eval data in this run's folder."""
        out = cls(getattr(args, "early_stop", None), getattr(args, "early_stop_delta", 0.0),
                  eval_identity(args) if getattr(args, "early_stop", None) else None)
        got = read_meta(ckpt).get("early_stop") if ckpt and out.patience else None
        here = got and _here(ckpt, args.out)
        if here and got.get("eval_data_sha256") == out.eval_sha and _same_samples(ckpt, args):
            out.best, out.step, out.bad = _loss(got["eval_loss"]), got["step"], got["bad"]
            # each counted evaluation may have been an improvement under the new delta, or not: recount from the best
            if (was := _delta(ckpt)) != out.delta and out.bad:
                log(f"note: --early-stop-delta {out.delta:g}: the checkpoint's count ({got['bad']} evaluations "
                    f"{_since(got['step'], got['eval_loss'])}) was made with --early-stop-delta {was:g}: counting "
                    "starts again here, from that best")
                out.bad = 0
        elif got:
            log(f"note: --early-stop: the checkpoint's count ({got['bad']} evaluations "
                f"{_since(got['step'], got['eval_loss'])}) {_other(got, out.eval_sha, here)}: counting starts again "
                "here")
        return out

    def update(self, step: int, loss: float) -> bool:
        """An evaluation's loss; True: the run stops here."""
        if not self.patience:
            return False
        if loss < self.best - self.delta:   # (a NaN never is)
            self.best, self.step, self.bad = loss, step, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    def said(self, step: int, steps: int) -> str:
        by = f" by more than {self.delta:g}" if self.delta else ""
        what = (f"eval_loss has not gone below step {self.step}'s {self.best:.6f}{by} in the {self.bad} evaluation"
                f"{'s' * (self.bad != 1)} since" if self.step else
                f"no evaluation gave a finite eval_loss ({self.bad} of them)")
        return f"early stop: {what} (--early-stop {self.patience}): the run ends at step {step} of {steps}"

    def meta(self) -> dict:   # (the count from the first evaluation on, also when none was finite: best null)
        return {"early_stop": {"step": self.step, "eval_loss": self.best if self.step else None, "bad": self.bad,
                               "eval_data_sha256": self.eval_sha}} if self.patience and (self.step or self.bad) else {}


def _same_samples(ckpt: str, args) -> bool:
    """The eval files tokenized to the checkpoint's run's eval samples (`eval_tokens`; unknown on either side: yes).
    The same bytes can give other samples (a chat template's date, --max-len): their losses do not compare."""
    was, now = read_meta(ckpt).get("args", {}).get("eval_tokens"), getattr(args, "eval_tokens", None)
    return None in (was, now) or was == now


def _other(got: dict, eval_sha: str | None, here: bool) -> str:
    """Why a checkpoint's best or count is not carried on (`_here`, then the eval files, then their samples)."""
    return ("is in another run folder" if not here else "was measured on other --eval-data"
            if got.get("eval_data_sha256") != eval_sha else
            "was measured on other eval samples of the same --eval-data (tokenized otherwise)")


def _loss(v) -> float:
    return math.inf if v is None else v


def _since(step, loss) -> str:
    return f"since step {step}'s eval_loss {loss:.6f}" if step else "none of them with a finite eval_loss"


def _delta(ckpt: str) -> float:
    """The --early-stop-delta a checkpoint's count was made with."""
    return read_meta(ckpt).get("args", {}).get("early_stop_delta") or 0.0


def exhausted(meta: dict, args, ckpt: str) -> str | None:
    """Why a resume of `ckpt` would stop at once: its run stopped early under this --early-stop (else None)."""
    got = meta.get("early_stop")
    n = getattr(args, "early_stop", None)
    if not (n and got and got["bad"] >= n and _here(ckpt, args.out or os.path.dirname(os.path.dirname(ckpt)))
            and got.get("eval_data_sha256") == eval_identity(args) and _same_samples(ckpt, args)
            and _delta(ckpt) == (getattr(args, "early_stop_delta", 0.0) or 0.0)):
        return None   # (other eval samples, another delta: EarlyStop.of_run counts again from here, said)
    return (f"--resume: at the checkpoint's step {meta['step']} it had counted {got['bad']} evaluations "
            f"{_since(got['step'], got['eval_loss'])}, which --early-stop {n} stops at (the run ended "
            f"there, its adapter in the run folder's adapter/): it would stop at its next evaluation. To train on, "
            f"pass --early-stop above {got['bad']}, or drop it")


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
    best.exported = out_dir
    log(f"best: eval_loss {best.loss:.6f} at step {best.step}, its adapter in {out_dir}")
