"""--report-to wandb: each step's record as a Weights & Biases run's history row, at its step (parallel/metrics.py's
contract: each step logged once, as the uninterrupted run logged it).

- W&B is configured by its own environment variables, read by wandb itself: WANDB_PROJECT and WANDB_ENTITY (where
  the run goes; W&B's default project otherwise), WANDB_API_KEY or `wandb login` (the key), WANDB_MODE=offline (no
  network: `wandb sync OUT/wandb/offline-run-*` uploads it later). The run is named after OUT, grouped under that
  name, its config OUT/config.json's flags; wandb's own files go to OUT/wandb.
- A W&B run cannot drop history rows (metrics.jsonl drops the steps past a resume's checkpoint, TensorBoard's folder is
  rewritten without them), and a row at a step it already holds is ignored, so a resume that would log some step
  again opens a new W&B run in the same group, named OUT@STEP (STEP: the resume's checkpoint), and says so; it
  starts with metrics.jsonl's lines up to STEP, so it holds the run's every step as metrics.jsonl does. A resume
  whose steps are all new to a W&B run that was closed (a stop that saved its last step: SIGTERM, a preemption
  notice) goes on in that W&B run.
- OUT/wandb/run.json keeps the W&B run's id, the highest step logged to it (written before the row) and whether
  `finish()` returned (`closed`). wandb's service holds rows it was sent: a process killed (OOM, the watchdog), or
  a service killed by the scheduler's SIGTERM to every process of the job, loses them, so a W&B run not closed is
  never continued (review, helper 88: steps 1..2 of a run killed after saving step 2 were in no W&B run). A resume
  without --report-to wandb from below the last step marks it (`stale`): its steps are trained again where W&B will
  not see them, so the next resume with it opens a new run too.
- W&B mirrors metrics.jsonl, which holds every step, so a service gone mid-run (a row or finish() failing) is a
  warning, not the stop parallel/metrics.py's contract makes of a failed sink: the run goes on without W&B, the run
  stays unclosed, and the next resume's new W&B run gets every step (review, helper 88: SLURM's SIGTERM killed the
  service, and the failed row stopped every rank unsaved).
"""

from __future__ import annotations

import json
import os
import secrets
import sys

from parallel.signals import Stopped

WANDB_DIR = "wandb"   # OUT/wandb: wandb's own files and run.json


def check_key() -> None:
    """At start-up: wandb.init, after the model is built, would refuse a run with no API key (or ask for one at a
    terminal, with every other rank waiting); say it first. Where wandb 0.31 finds the server, the mode and the key
    (wandb/sdk/lib/wbauth): the environment; the settings files, ~/.config/wandb/settings (or WANDB_CONFIG_DIR's)
    then ./wandb/settings (what `wandb login --host`, `wandb offline` write: base_url, mode, api_key); the netrc file
    (NETRC, else ~/.netrc) entry for the server's host:port, read as wandb reads it (a file others may read is not
    refused). A check looking at less refused keys wandb finds (review, helper 88). None needed offline or disabled."""
    import configparser
    import netrc
    from urllib.parse import urlsplit

    env, files = os.environ, {}
    root = env.get("WANDB_DIR") or "."
    for path in (os.path.join(env.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb"), "settings"),
                 os.path.join(root, ".wandb" if os.path.exists(os.path.join(root, ".wandb")) else "wandb", "settings")):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
            files.update(parser.items("default"))   # (the later file wins, as in wandb)
        except (OSError, configparser.Error):
            pass
    mode = env.get("WANDB_MODE") or files.get("mode", "")
    if mode in ("offline", "disabled", "dryrun") or env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") \
            or files.get("api_key") or env.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return
    url = env.get("WANDB_BASE_URL") or files.get("base_url") or "https://api.wandb.ai"
    host = urlsplit(url.rstrip("/")).netloc   # (host:port, as `wandb login` writes the entry)
    path = env.get("NETRC") or next((p for p in map(os.path.expanduser, ("~/.netrc", "~/_netrc"))
                                     if os.path.exists(p)), os.path.expanduser("~/.netrc"))
    try:
        if (netrc.netrc(os.path.expanduser(path)).authenticators(host) or (None,) * 3)[2]:
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ValueError(f"--report-to wandb: no W&B API key for {host} here (no WANDB_API_KEY, no entry in {path}, "
                     "none in W&B's settings files): run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline to "
                     "log locally (`wandb sync` later); a key wandb finds elsewhere: set WANDB_API_KEY to it")


def _state(out: str) -> tuple[str, dict | None]:
    path = os.path.join(out, WANDB_DIR, "run.json")
    if not os.path.isfile(path):
        return path, None
    with open(path) as f:
        return path, json.load(f)


def _keep(path: str, state: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def mark_stale(out: str, resume_step: int) -> None:
    """A resume without --report-to wandb, from below the W&B run's last step: the next one with it opens a new run."""
    path, state = _state(out)
    if state and state["last_step"] > resume_step and not state.get("stale"):
        _keep(path, {**state, "stale": True})


class WandB:
    """The sink (parallel/metrics.py's contract; module docstring)."""

    def __init__(self, out: str, *, resume_step: int | None = None, log=lambda m: print(m, flush=True)):
        import wandb

        path, state = _state(out)
        if resume_step is None and os.path.isdir(os.path.join(out, WANDB_DIR)):
            raise ValueError(f"{os.path.join(out, WANDB_DIR)!r} already holds a W&B run; a fresh run never adds to "
                             "another's. Pass --resume to continue that run, --overwrite, or a new --out")
        name = os.path.basename(os.path.normpath(out))
        same = state is not None and resume_step is not None and state["last_step"] <= resume_step and \
            not state.get("stale") and state.get("closed")
        if state is not None and not same:   # (steps after resume_step that W&B holds, or may; or rows lost: a new run)
            why = "a resume without --report-to wandb trained some of them again" if state.get("stale") else \
                f"those past {resume_step} are trained again" if state["last_step"] > resume_step else \
                "it was never closed (a kill: rows its service was sent may be missing)"
            log(f"note: the W&B run {state['id']} holds steps up to {state['last_step']}, and {why}: this run's go "
                f"to a new W&B run, {name}@{resume_step}, in group {name}, after metrics.jsonl's steps up to "
                f"{resume_step}")
        with open(os.path.join(out, "config.json")) as f:   # (written just before: the run's flags)
            config = json.load(f)
        os.makedirs(os.path.join(out, WANDB_DIR), exist_ok=True)
        run_id = state["id"] if same else secrets.token_hex(6)   # (W&B run ids: lowercase letters and digits)
        self.path, self.state = path, {"id": run_id, "last_step": state["last_step"] if same else 0, "closed": False}
        self.log, self.dead, self.errors = log, False, wandb.errors.Error
        _keep(path, self.state)   # (before init: a failed init leaves a run the next resume does not continue)
        self.run = wandb.init(dir=out, id=run_id, resume="allow" if same else "never", config=config, group=name,
                              name=None if same else name if resume_step is None else f"{name}@{resume_step}")
        if resume_step is not None and not same:
            for rec in _logged(os.path.join(out, "metrics.jsonl"), resume_step):
                self.write(rec)

    def write(self, rec: dict) -> None:
        if self.dead:
            return
        self.state["last_step"] = max(self.state["last_step"], rec["step"])
        _keep(self.path, self.state)   # first (module docstring)
        try:
            self.run.log({k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))
                          and not isinstance(v, bool)}, step=rec["step"])
        except (OSError, self.errors) as e:
            self._died(rec["step"], e)

    def close(self) -> None:
        if self.dead:
            return
        failed = sys.exc_info()[1]   # (close() runs in train.py's finally: the error it ends on, if any)
        try:   # a run that failed is W&B's "failed" (exit code 1), not "finished"; a signal's stop, saved, is not one
            self.run.finish(exit_code=int(failed is not None and not isinstance(failed, Stopped)))
        except (OSError, self.errors) as e:
            return self._died(self.state["last_step"], e)
        _keep(self.path, {**self.state, "closed": True})   # (after: every row sent is W&B's)

    def _died(self, step: int, e: BaseException) -> None:
        """wandb's service gone (the scheduler's SIGTERM reaches every process of the job): the run goes on without
        W&B rather than stop, unsaved, on a mirror of metrics.jsonl; the next resume's new W&B run gets every step."""
        self.dead = True
        self.log(f"warning: W&B took no row at step {step} ({type(e).__name__}: {e}): its service is gone (a "
                 "scheduler's signal to every process of the job?); the run goes on without it, metrics.jsonl holds "
                 "every step, and a resume with --report-to wandb logs them all to a new W&B run")


def _logged(path: str, step: int):
    """metrics.jsonl's records up to `step` (the resume truncated it there), their non-finite numbers restored."""
    if not os.path.isfile(path):   # (a resume from another run's checkpoint into a new OUT)
        return
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:   # (a torn line)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                yield {**rec, **{k: float(v) for k, v in (rec.get("nonfinite") or {}).items()}}
