"""What a run logs each step, on rank 0: OUT/metrics.jsonl always, and the sinks `--report-to` names.

Contract:
1. `Metrics(out, report_to, resume_step)` opens metrics.jsonl and each named sink; `write(rec)` once a step
   (rec: train.py's step record, {"step": k, "loss": ..., ...}), `close()` once, also after an error.
2. Each step is logged once, as the uninterrupted run logged it. A resume runs the steps after its checkpoint's
   (`resume_step`) again, so every sink first drops, or hides, what it holds past that step: metrics.jsonl rewrites
   itself without those lines (moved to metrics.abandoned.jsonl, each tagged "abandoned_at_resume_from"; a torn line
   is no record, and goes), TensorBoard's folder likewise (`TensorBoard`); a resume without `--report-to
   tensorboard` of a run that had it rewrites that folder too, so its later steps never reappear beside new ones.
   W&B cannot drop rows: a resume that would log a step again opens a new W&B run (parallel/sink_wandb.py).
   None: a fresh run, which never overwrites: a sink whose files are already there is refused.
3. `MetricsLog` keeps metrics.jsonl strict JSON (non-finite floats are written as null, their kind listed under
   "nonfinite"), its lines unbuffered, and a resume's rewrite atomic (a temporary file renamed: a crash leaves the
   old file or the new one).
4. A sink of your own (MLflow, a CSV; parallel/sink_wandb.py is one): a class in `SINKS`, `Sink(out,
   resume_step=N|None)` with `write(rec)` and `close()`, its files named in parallel/outdir.py's `OWNED` (so
   --overwrite removes them), keeping 2. Its writes run on rank 0 inside guard.on_rank0: an exception stops every
   rank at that step, naming it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

from parallel.sink_wandb import WandB, check_key, mark_stale

TB_DIR = "tensorboard"
ABANDONED = "metrics.abandoned.jsonl"   # the lines a resume drops from metrics.jsonl, appended


def rounded(v: float) -> float:
    """A loss, norm or reward as logged: 6 decimals, or 6 significant digits below 0.1, so a small value (an eval
    loss of 3e-7, a DPO loss near 0) is not logged as 0.0, nor two of them as a tie (review, helper 90)."""
    if not math.isfinite(v) or v == 0 or abs(v) >= 0.1:
        return round(v, 6)
    return round(v, 5 - math.floor(math.log10(abs(v))))


def step_record(step: int, loss: float, gnorm: float, lr: float, tokens: int, seconds: float, world: int, peaks,
                epoch: float, skipped: int, more: dict, *, cuda: bool, profiled: bool, mfu: float | None) -> dict:
    """train.py's step line and metrics.jsonl record, in the README's column order: `peaks` the step's MAX-reduced
    (peak allocated GB, peak reserved GB), `more` the objective's own (token_acc; DPO's), `mfu` None without a
    known peak TFLOPS. A metric of your own: add it to the returned dict in the loop."""
    rec = dict(step=step, loss=rounded(loss), grad_norm=rounded(gnorm), lr=lr, tokens=tokens,
               tokens_per_s=round(tokens / seconds, 1), tokens_per_s_per_gpu=round(tokens / seconds / world, 1),
               step_time_s=round(seconds, 3), peak_mem_gb=round(float(peaks[0]), 3), epoch=round(epoch, 3),
               skipped=skipped, **more)
    if cuda:   # the caching allocator's high-water mark (allocated + its cached slack)
        rec["peak_reserved_gb"] = round(float(peaks[1]), 3)
    if profiled:
        rec["profiled"] = True
    if mfu is not None:   # model FLOPs (README): 6·matmul params + causal attention over each sample
        rec["mfu"] = round(mfu, 4)
    return rec


def strict(rec: dict) -> dict:
    """Non-finite floats -> None, their kind ("nan", "inf", "-inf") listed under "nonfinite"."""
    out, bad = {}, {}
    for k, v in rec.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k], bad[k] = None, str(v)
        else:
            out[k] = v
    if bad:
        out["nonfinite"] = bad
    return out


def _lines(n: int) -> str:
    return f"{n} line" + ("s" if n != 1 else "")


def _append_once(path: str, lines: list[str]) -> None:
    """Append `lines` (fsynced) unless the file already ends with them: a kill between this append and metrics.jsonl's
    rewrite moves the same lines again at the next resume."""
    block = "".join(lines)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - len(block.encode())))
            if f.read().decode(errors="replace") == block:
                return
    with open(path, "a") as f:
        f.write(block)
        f.flush()
        os.fsync(f.fileno())


class MetricsLog:
    """metrics.jsonl: one strict-JSON line per step.

    `resume_step=None`: a fresh run; an existing non-empty file is refused (claim() already refuses
    the directory; this keeps a fresh run from ever truncating results). `resume_step=N`: keep the
    lines up to step N (the checkpoint's), move the rest to `ABANDONED` (said), then append."""

    def __init__(self, path: str, *, resume_step: int | None = None):
        self.path, self.dropped, self.fd = path, 0, None   # dropped: lines removed on resume
        if resume_step is None:
            if os.path.isfile(path) and os.path.getsize(path):
                raise ValueError(f"{path!r} already holds metrics; a fresh run never truncates them. "
                                 "Pass --resume to continue that run, --overwrite, or a new --out")
        elif os.path.isfile(path):
            self.dropped = self._truncate(resume_step)
        # unbuffered, appending: a write the disk refuses fails once, there, with nothing left in a buffer for close()
        # to flush and fail again (which hid the first error and the run folder it names; review, helper 46)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _truncate(self, step: int) -> int:
        keep, dropped, torn = [], [], 0
        with open(path := self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    s = rec["step"]
                except (ValueError, KeyError, TypeError):   # a torn last line from a crash, or junk: not a record
                    torn += 1
                    continue
                line = line if line.endswith("\n") else line + "\n"
                if s <= step:
                    keep.append(line)
                else:   # tagged with the step resumed from: several resumes' lines tell apart
                    dropped.append(json.dumps({**rec, "abandoned_at_resume_from": step}) + "\n")
        if dropped:   # kept, as the abandoned steps' checkpoints and adapters are (parallel/checkpoint.branch): a
            _append_once(os.path.join(os.path.dirname(path), ABANDONED), dropped)   # crash's last steps, a spike
            print(f"metrics.jsonl: {_lines(len(dropped))} past step {step} (steps this run trains again) "   # before
                  f"moved to {ABANDONED}", flush=True)   # a NaN, as first logged (until 2026-12-07 dropped)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return len(dropped) + torn

    def write(self, rec: dict) -> dict:
        rec = strict(rec)
        data = (json.dumps(rec, allow_nan=False) + "\n").encode()
        while data:   # (a torn line from a refused write is dropped on resume, as a crash's)
            data = data[os.write(self.fd, data):]
        return rec

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class TensorBoard:
    """OUT/tensorboard: each number of the step record a scalar, tagged with its metrics.jsonl key, at its step (a
    NaN loss as NaN). Flushed every step, as metrics.jsonl is written, so a killed run's last steps are there.

    A resume rewrites the folder as metrics.jsonl rewrites itself: the events up to its step, as TensorBoard draws
    them (each tag's later steps dropped where a restart logged it again), go into this run's new file, then the
    older files are removed. `tensorboard --logdir` ignores `purge_step` (its default loader reads no restart event;
    the Python one takes the first it reads for the session's start), so hiding is not enough (review, helper 61);
    `purge_step` is still given, for a crash between the new file and the removals."""

    def __init__(self, out: str, *, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        path = os.path.join(out, TB_DIR)
        old = sorted(os.path.join(path, f) for f in os.listdir(path) if "tfevents" in f) if os.path.isdir(path) else []
        if resume_step is None and old:
            raise ValueError(f"{path!r} already holds TensorBoard events; a fresh run never adds to another's. Pass "
                             "--resume to continue that run, --overwrite, or a new --out")
        kept = _drawn(path, resume_step) if old else []
        self.writer = SummaryWriter(path, purge_step=None if resume_step is None else resume_step + 1)
        try:
            for tag, step, value, wall_time in kept:
                self.writer.add_scalar(tag, value, step, walltime=wall_time)
            self.writer.flush()
            for f in old:
                os.remove(f)
        except BaseException:   # (its writer thread goes with the error: close() is never called on this one)
            self.writer.close()
            raise

    def write(self, rec: dict) -> None:
        for key, v in rec.items():
            if key != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(key, v, rec["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _drawn(path: str, step: int) -> list[tuple]:
    """(tag, step, value, wall time) of each scalar TensorBoard's own reader draws from `path`, up to `step`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})   # (0: every event, none sampled away)
    acc.Reload()
    other = {kind: tags for kind, tags in acc.Tags().items() if kind != "scalars" and tags}
    if other:   # (a fork's add_histogram, add_text, add_image: the rewrite below carries scalars only)
        said = "; ".join(f"{kind}: {', '.join(map(str, tags)) if isinstance(tags, list) else 'yes'}"
                         for kind, tags in other.items())
        raise ValueError(f"{path!r} holds TensorBoard data other than scalars ({said}), which a resume's rewrite of "
                         f"the folder (its events up to step {step}) would drop: carry them in parallel/metrics.py's "
                         "_drawn, or move the folder aside to resume without them")
    kept = {}   # (tag, step) -> the last read: a resume killed between its new file and the removals left the older
    # files beside it, whose steps up to `step` the new file holds again (as the server draws them: a step read
    # again replaces the earlier one); kept twice, they would be rewritten twice on every later resume
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            if e.step <= step:
                kept[tag, e.step] = (tag, e.step, e.value, e.wall_time)
    return sorted(kept.values(), key=lambda x: (x[1], x[3]))


SINKS = {"tensorboard": (TensorBoard, "tensorboard"), "wandb": (WandB, "wandb")}   # name -> (class, its package)


def check_sinks(report_to: list[str] | None) -> None:
    """At start-up, before any weight: each named sink's package imports."""
    for name in report_to or ():
        package = SINKS[name][1]
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(f"--report-to {name} needs the {package} package, which this python lacks: pip install "
                             f"{package} (make install installs it), or drop --report-to {name}")
        if name == "wandb":
            check_key()


class Metrics:
    """metrics.jsonl and the sinks, written as one (what train.py holds)."""

    def __init__(self, out: str, report_to: list[str] | None = None, resume_step: int | None = None):
        self.sinks, self.failed = [], False
        try:
            self.log = MetricsLog(os.path.join(out, "metrics.jsonl"), resume_step=resume_step)
            self.sinks.append(self.log)
            for name in dict.fromkeys(report_to or ()):
                self.sinks.append(SINKS[name][0](out, resume_step=resume_step))
            if resume_step is not None and "tensorboard" not in (report_to or ()) and \
                    os.path.isdir(os.path.join(out, TB_DIR)) and importlib.util.find_spec("tensorboard"):
                TensorBoard(out, resume_step=resume_step).close()   # (its run had it: its later steps go as well)
            if resume_step is not None and "wandb" not in (report_to or ()):
                mark_stale(out, resume_step)   # (steps the W&B run holds are trained again without it)
        except BaseException:
            self.close()
            raise

    def write(self, rec: dict) -> dict:
        """The record as metrics.jsonl holds it (strict JSON), written there first."""
        try:
            said = self.log.write(rec)
            for sink in self.sinks[1:]:
                sink.write(rec)
        except BaseException:
            self.failed = True   # close() then raises nothing of its own: this error is the one said
            raise
        return said

    def close(self) -> None:
        sinks, self.sinks, first = self.sinks, [], None
        for sink in sinks:   # each closed, even after one that failed; the first failure raised
            try:
                sink.close()
            except BaseException as e:
                first = first or e
        if first is not None and not self.failed:   # (a sink whose write failed fails its close again, as
            raise first   # TensorBoard's buffered writer does: raised from train.py's finally, it hid the first error)
