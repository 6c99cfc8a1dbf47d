"""Which directory a run may write into, and what of it is a run's (checked before the process group: no file changes).

Contract:
- `check_out(out, resume=, overwrite=)` runs on every rank before the process group: checks whose only trace
  is a probe directory made and removed at once. It refuses a directory this user cannot write in (a probe, not
  `os.access`: root passes that on read-only mounts), `--out` naming a file, a used directory without `--resume` or
  `--overwrite`, `--overwrite` of a directory that is not a run's, and a resume into a used `--out` from a
  checkpoint not in its own OUT/ckpt (outside it, or another run's nested below it, or OUT a folder above that
  run: it would mix two runs' results, or write over OUT's files).
- `inside_a_run(path)`: why a path lies in what another run owns (its ckpt/, adapter/, ...), or None; also checked
  by the adapter export and the merge.
- `run_of(resume)`: the run directory a checkpoint belongs to (`RUN/ckpt`, `RUN/ckpt/step_N`), or None.
- `OWNED`: every name a run writes into OUT (--overwrite deletes exactly these); `MARKERS`: the names that make a
  directory a run's, when they are train.py's own (`_not_a_run`).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re

LOCK = "run.lock"
PROBE = ".train-probe-"   # check_out's writability probe, made and removed at once by every rank
# everything a run writes into OUT; --overwrite deletes exactly these
OWNED = ("config.json", "metrics.jsonl", "metrics.jsonl.tmp", "metrics.abandoned.jsonl", "ckpt", "adapter",
         "adapter.tmp-export", "adapter.old-export", "adapter.tmp", "adapter.old", "adapter_best",
         "adapter_best.tmp-export", "adapter_best.old-export", "adapter_best.tmp", "adapter_best.old",
         "adapter.abandoned*", "adapter_best.abandoned*", "mem_phases.json", "mem_trace.rank*.txt", "profile.txt",
         "profile-rank*.txt", "loss.png", "reference_logps.pt", "reference_logps.pt.tmp", "reference_logps_eval.pt",
         "reference_logps_eval.pt.tmp", "tensorboard", "wandb", LOCK)   # (* : fnmatch; .tmp/.old: the names until
# 2026-12-02)
# a directory holding one of these may be a run's (run.lock alone is not: a run that died at start-up); it is one
# when they are train.py's own (`_not_a_run`)
MARKERS = ("config.json", "metrics.jsonl", "ckpt")
# what train.py puts in ckpt/ (its step folders are named step_{N:06d}, as checkpoint_folders._steps counts them: a
# step_1 a user made there is not train.py's, and --overwrite leaves such a folder alone)
CKPT_ENTRY = re.compile(r"(\.tmp-|\.old-)?step_(\d{6}|[1-9]\d{6,})(\.abandoned(-\d+)?)?|latest(\.tmp)?")


def _entries(path: str) -> list[str]:
    """What a directory holds, a leftover lock file and check_out's probes (another rank's, now) not counted."""
    return sorted(e for e in os.listdir(path) if e != LOCK and not e.startswith(PROBE)) if os.path.isdir(path) else []


def _own(resume: str, out: str) -> bool:
    """`resume` names OUT/ckpt or a step folder in it (through links too), not another run's below OUT."""
    from parallel.resume import own_checkpoint

    try:
        return os.path.samefile(resume, os.path.join(out, "ckpt")) or own_checkpoint(resume, out)
    except OSError:   # (no OUT/ckpt)
        return False


def run_of(resume: str) -> str | None:
    """The run directory a checkpoint (`RUN/ckpt` or `RUN/ckpt/step_N`) belongs to, if it is one."""
    p = os.path.abspath(resume)
    ckpt = p if os.path.basename(p) == "ckpt" else os.path.dirname(p)
    run = os.path.dirname(ckpt)
    if os.path.basename(ckpt) == "ckpt" and any(os.path.exists(os.path.join(run, m)) for m in MARKERS):
        return run
    return None


def _nearest(path: str) -> str:
    """`path`, or the nearest of its parents there (a dangling link too; "/" always is)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _writable(where: str, what: str, fix: str = "pass an --out you can write to") -> None:
    """Refuse, before any data is tokenized, a directory this run could not create its files in."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE, dir=where))
    except OSError as e:
        raise ValueError(f"{what}: this user cannot write in {where!r} ({e.strerror}); {fix}") from None


def inside_a_run(path: str, but: str | None = None) -> str | None:
    """Why `path` must not be written into: it is, or lies inside, an entry a train.py run owns in its folder (`OWNED`:
    its ckpt/, whose steps rotate; adapter/ and adapter_best/, swapped whole at each export; tensorboard/ ...), which
    that run, its resume or an --overwrite of it deletes or replaces; None otherwise (links resolved). Until
    2026-12-06 a run, an export or a merge into another run's ckpt/step_N/ or adapter/ was taken, and lost there
    (review, helper 80). `but`: a run whose own entries are not asked about (an export of its own checkpoint)."""
    real = p = os.path.realpath(path)
    own = but and os.path.realpath(but)
    while (up := os.path.dirname(p)) != p:
        owned = up != own and any(fnmatch.fnmatch(os.path.basename(p), pat) for pat in OWNED)
        if owned and (used := _entries(up)) and any(e in MARKERS for e in used) and _not_a_run(up, used) is None:
            return (f"{path!r} is {'inside ' * (p != real)}{p!r}, which the train.py run {up!r} owns: its checkpoint "
                    "rotation, its exports or an --overwrite of it delete or replace it")
        p = up
    return None


def check_out(out: str | None, *, resume: str | None = None, overwrite: bool = False, root: str = "runs") -> None:
    """Refuse an output directory this run must not write into. Safe on every rank, early."""
    if resume and overwrite:
        raise ValueError("--resume continues a run and --overwrite deletes one: pass only one of them")
    if out is None:   # a fresh directory under `root` (or, with --resume, the checkpoint's run) is chosen by claim()
        mine = run_of(resume) if resume else None
        where = _nearest(mine or root)
        if os.path.isdir(where):   # (a file there: claim says so)
            _writable(where, f"--resume {resume!r} continues its run {mine!r}" if mine else
                      f"no --out given, so this run would make {os.path.join(root, '<date-time>')!r}",
                      "pass --out with a directory you can write to" + (" (the run goes on there)" if mine else ""))
        return
    if not out:
        raise ValueError("--out is empty (an unset variable?): pass a directory path, or leave --out out for a fresh "
                         "runs/<date-time>")
    if out.split(os.sep)[0].startswith("~"):   # (--out=~/x: no shell expands a ~ after '='; it made ./~/x, review,
        raise ValueError(f"--out {out!r} starts with a '~' no shell expanded (after '=' or in quotes), so it would "
                         f"be a folder named '~' here: pass --out {os.path.expanduser(out)}")   # helper 80)
    if why := inside_a_run(out):
        raise ValueError(f"--out {why}. Pass a directory outside it")
    up = _nearest(os.path.dirname(os.path.abspath(out)))
    if not os.path.exists(up):
        raise ValueError(f"--out {out!r}: {up!r} is a link to {os.readlink(up)!r}, which does not exist: create "
                         "that directory, or pass another --out")
    real = os.path.realpath(out)   # what is written to and checked: 'DIR/new/..' is DIR once new/ is made
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, not a directory; pass a directory path")
    if os.path.islink(out) and not os.path.exists(out):
        raise ValueError(f"--out {out!r} is a link to {os.readlink(out)!r}, which does not exist: create that "
                         "directory, or pass another --out")
    if not os.path.isdir(up):
        raise ValueError(f"--out {out!r}: {up!r} is a file, so no directory can be made under it; pass another --out")
    _writable(real if os.path.isdir(real) else up, f"--out {out!r}")
    used = _entries(real)
    if not used:
        return
    if resume:
        r = os.path.realpath(resume)   # RUN, RUN/config.json, RUN/adapter: the same run, not another's (review,
        exported = any(os.path.isfile(os.path.join(r, f)) for f in ("adapter_config.json", "adapter_model.safetensors"))
        what = "the run folder" if r == real else None if os.path.dirname(r) != real else \
            "a file in the run folder" if os.path.isfile(r) else "the run's exported adapter in" if exported else None
        if what:   # helpers 54 and 56: it said two runs would be mixed, and to pass a new --out)
            raise ValueError(f"--resume {resume!r} is {what} {out!r}, not a checkpoint: pass --resume "
                             f"{os.path.join(out, 'ckpt')} (its newest step) or a step folder in it")
        if os.path.exists(resume) and not _own(resume, out):   # (none there: resolve says so) one inside OUT but
            # another run's, nested below it, or OUT a folder above that run: its config, metrics, checkpoints and
            # adapter would be written over (review, helper 46)
            theirs = run_of(resume)
            raise ValueError(f"--out {out!r} already holds files ({', '.join(used)}) and --resume {resume!r} is not "
                             f"one of its own checkpoints ({os.path.join(out, 'ckpt')}): resuming there would mix two "
                             "runs' results and write over those files. " + (
                                 f"Pass --out {theirs} to continue that run, " if theirs else "Pass ")
                             + "a new --out, or --resume a checkpoint of this one")
        return
    listed = f"{', '.join(used[:6])}{' ...' if len(used) > 6 else ''}"
    flag = "--overwrite refuses" if overwrite else "--out"   # (neither --resume nor --overwrite takes another's files)
    if overwrite and os.path.isfile(os.path.join(real, LOCK)) and not any(e in MARKERS for e in used) and \
            all(any(fnmatch.fnmatch(e, pat) for pat in OWNED) for e in used):
        return   # no marker, only train.py's names beside its lock: an --overwrite killed before 2026-12-04 (the
        # markers went first); a config.json there is judged by _not_a_run below, lock or not
    if not any(e in MARKERS for e in used):
        raise ValueError(f"{flag} {out!r}: it holds {listed} but none of {', '.join(MARKERS)}, so it is not a "
                         "train.py run directory and nothing here may replace those files. Pass a new --out")
    if why := _not_a_run(real, used):
        raise ValueError(f"{flag} {out!r}: {why}, so it is not a train.py run directory and nothing here may "
                         "replace those files. Pass a new --out")
    if not overwrite:
        ckpt = os.path.join(out, "ckpt")
        whole = any(re.fullmatch(r"step_\d+", e) and os.path.isfile(os.path.join(real, "ckpt", e, "meta.json"))
                    for e in _entries(os.path.join(real, "ckpt")))   # (a save killed mid-write, or only abandoned
        # ones: nothing to resume)
        cont = f"Pass --resume {ckpt} to continue it, " if whole else "It saved no checkpoint to continue from. Pass "
        raise ValueError(f"--out {out!r} already holds a run ({listed}). {cont}--overwrite to replace its "
                         "results, or a new --out")


def _not_a_run(out: str, used: list[str]) -> str | None:
    """Why a directory holding config.json, metrics.jsonl or ckpt is not a train.py run (None: it is one). --overwrite
    deletes those names, so each present must be train.py's own (a config.json of its flags, or torn beside its
    run.lock; metrics lines with its step, loss, grad_norm and lr; a ckpt folder, or a link to one, of step folders),
    and one at least must say so: another tool's ckpt/ or config.json is never
    taken for a run's (until 2026-12-03 any of the three names was)."""
    weights = [e for e in used if e.endswith((".safetensors", ".bin", ".gguf", ".pth", ".index.json"))]
    if weights:
        return f"it holds model weights ({', '.join(weights[:3])})"
    ours = False
    if "config.json" in used:
        try:
            with open(os.path.join(out, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            cfg = None   # torn by a crash while written: neither's
        if isinstance(cfg, dict) and "model_type" in cfg and "global_batch" not in cfg:
            return f"its config.json is a model's (model_type {cfg['model_type']!r})"
        if cfg is not None and not (isinstance(cfg, dict) and "global_batch" in cfg):
            return "its config.json is not train.py's (no global_batch: another tool's)"
        ours = cfg is not None or os.path.isfile(os.path.join(out, LOCK))   # (torn, beside train.py's lock: its own,
    if "metrics.jsonl" in used:                                           # killed before the first step's line)
        try:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                first = f.readline()
            rec = json.loads(first) if first.endswith("\n") else None   # (an unfinished first line: neither's)
        except (OSError, ValueError):
            rec = "?"
        if rec is not None and not (isinstance(rec, dict) and {"step", "loss", "grad_norm", "lr"} <= set(rec)):
            return "its metrics.jsonl is not train.py's (its first line is no step record of train.py's)"
        ours = ours or rec is not None
    if "ckpt" in used:
        ckpt = os.path.join(out, "ckpt")
        held = _entries(ckpt) if os.path.isdir(ckpt) else None   # (a link to scratch storage: its folder's entries;
        # --overwrite removes the link only)
        if held is None or (other := [e for e in held if not CKPT_ENTRY.fullmatch(e)]):
            return (f"its ckpt folder holds {', '.join(other[:3])}, which train.py never writes" if held is not None
                    else "its ckpt is not a folder train.py made")
        ours = ours or bool(held)
    return None if ours else "none of its config.json, metrics.jsonl or ckpt holds anything train.py wrote"
