"""parallel/checkpoint.py: `latest` only ever names a complete checkpoint, and no checkpoint holds NaN.

Pins (a tiny module with a frozen and a trainable Linear, torch.optim.AdamW, DCP on gloo):
- save/load round-trips the trainable weights and the AdamW state exactly; `keep` leaves the newest N;
- a save killed mid-write (DCP wrote, then a file was truncated and the process "died") while
  re-saving the step `latest` names leaves that checkpoint and `latest` byte-identical;
- a truncated newest checkpoint: `resolve(ckpt)` falls back to the previous good one with a warning
  naming both, and `load` restores that one; naming the broken step folder is refused, naming the
  previous good one; a missing folder is a FileNotFoundError;
- NaN in a trainable tensor: `save` raises NonFiniteError naming the tensor and writes nothing; on
  2 ranks, NaN on rank 1 only makes both ranks raise (no rank is left in a collective).

Run: .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import checkpoint, checkpoint_folders
from parallel.guard import NonFiniteError
from tests.dist import run_ranks


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.lora = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lora(self.base(x))


def _trained(seed, steps=1):
    torch.manual_seed(seed)
    m = Tiny()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        m(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _hashes(root) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A 1-rank gloo group, as train.py makes for a plain process."""
    own = not dist.is_initialized()
    if own:
        store = os.path.join(tempfile.mkdtemp(), "pg")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def _same(a, opt_a, b, opt_b, label):
    torch.testing.assert_close(a.lora.weight, b.lora.weight, rtol=0, atol=0, msg=f"{label}: lora weight")
    sa, sb = opt_a.state_dict()["state"][0], opt_b.state_dict()["state"][0]
    for k in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=f"{label}: AdamW {k}")


def test_round_trip_and_keep(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for step in range(1, 5):
        m, opt = _trained(step)
        checkpoint.save(ckpt, m, opt, step, {"args": {"seed": step}}, keep=2)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000003", "step_000004"], os.listdir(ckpt)
    assert open(os.path.join(ckpt, "latest")).read() == "step_000004"
    fresh, fopt = _trained(99)
    assert checkpoint.load(ckpt, fresh, fopt) == 4
    _same(fresh, fopt, m, opt, "load(ckpt)")
    assert checkpoint_folders.read_meta(checkpoint_folders.resolve(ckpt))["args"] == {"seed": 4}
    with pytest.raises(ValueError, match="--keep-ckpts must be >= 1"):
        checkpoint.save(ckpt, m, opt, 5, keep=0)


def test_rotation_deletes_only_the_step_folders_save_writes(tmp_path):
    """A folder named like a step but not as save() names them (`step_1`: an adapter a user exported into the ckpt
    folder, a copy) is neither rotated away nor resumed, and does not make rotation delete the real step_000001."""
    ckpt = tmp_path / "ckpt"
    m, opt = _trained(1)
    checkpoint.save(str(ckpt), m, opt, 1, keep=2)
    (ckpt / "step_1" / "adapter").mkdir(parents=True)
    (ckpt / "step_1" / "adapter" / "adapter_model.safetensors").write_bytes(b"the user's")
    checkpoint.save(str(ckpt), m, opt, 2, keep=2)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001", "step_000002", "step_1"], os.listdir(ckpt)
    checkpoint.save(str(ckpt), m, opt, 3, keep=2)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000002", "step_000003", "step_1"], os.listdir(ckpt)
    assert (ckpt / "step_1" / "adapter" / "adapter_model.safetensors").read_bytes() == b"the user's"
    os.remove(ckpt / "latest")   # the newest is found among save()'s folders only
    assert checkpoint_folders.resolve(str(ckpt)) == str(ckpt / "step_000003")


def test_a_checkpoint_of_another_optimizer_is_refused_as_such(tmp_path):
    """A fork that swapped AdamW for SGD with momentum, resuming a checkpoint from before the optimizer was recorded:
    a ValueError saying so (DCP's own CheckpointException is a BaseException, which got past the message)."""
    ckpt = str(tmp_path / "ckpt")
    m, opt = _trained(1)
    checkpoint.save(ckpt, m, opt, 1, {"args": {}})
    fresh, _ = _trained(2)
    sgd = torch.optim.SGD([fresh.lora.weight], lr=1e-2, momentum=0.9)
    fresh.lora.weight.sum().backward()
    sgd.step()   # (its state exists: momentum_buffer)
    with pytest.raises(ValueError, match=r"was saved with another optimizer than train.py's make_optimizer builds "
                                         r"\(.*momentum.*\): resume with the one it was saved with"):
        checkpoint.load(ckpt, fresh, sgd)


def test_killed_resave_leaves_latest_intact(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    m, opt = _trained(1)
    checkpoint.save(ckpt, m, opt, 2)
    before = _hashes(ckpt)
    real = checkpoint.dcp.save

    def dies_mid_write(state, checkpoint_id):
        real(state, checkpoint_id=checkpoint_id)
        data = [f for f in os.listdir(checkpoint_id) if f.endswith(".distcp")]
        with open(os.path.join(checkpoint_id, data[0]), "r+b") as f:
            f.truncate(10)
        raise KeyboardInterrupt("killed mid-save")

    m2, opt2 = _trained(2)
    monkeypatch.setattr(checkpoint.dcp, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(ckpt, m2, opt2, 2)   # a resumed run re-saving step 2
    monkeypatch.undo()
    after = {p: h for p, h in _hashes(ckpt).items() if "/.tmp-" not in p}
    assert after == before, "a killed re-save changed the checkpoint `latest` names"
    fresh, fopt = _trained(99)
    assert checkpoint.load(ckpt, fresh, fopt) == 2
    _same(fresh, fopt, m, opt, "after a killed re-save")
    checkpoint.save(ckpt, m2, opt2, 2)       # the next save clears the leftover and replaces step 2
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000002"], os.listdir(ckpt)
    checkpoint.load(ckpt, fresh, fopt)
    _same(fresh, fopt, m2, opt2, "re-saved step 2")


def test_a_disk_full_at_meta_json_removes_the_half_written_step(tmp_path, monkeypatch):
    """The disk fills up after DCP wrote the step's files (GBs) and before meta.json: the error is the disk's (errno
    kept, for train.py's one line), the folder that holds those GBs goes, as one whose DCP write failed goes (until
    2026-12-07 `.tmp-step_N` stayed on the full disk until the next save), and the checkpoint before is untouched."""
    import errno

    ckpt = str(tmp_path / "ckpt")
    m, opt = _trained(1)
    checkpoint.save(ckpt, m, opt, 1)
    before = _hashes(ckpt)
    real = checkpoint._fsync_write

    def full(path, text):
        if os.path.basename(path) == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, text)

    m2, opt2 = _trained(2)
    monkeypatch.setattr(checkpoint, "_fsync_write", full)
    with pytest.raises(OSError) as e:
        checkpoint.save(ckpt, m2, opt2, 2)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC, e.value
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001"] and _hashes(ckpt) == before, os.listdir(ckpt)
    fresh, fopt = _trained(99)
    assert checkpoint.load(ckpt, fresh, fopt) == 1
    _same(fresh, fopt, m, opt, "the step before the full disk")


def test_truncated_newest_falls_back_with_warning(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for step in (3, 4):
        m, opt = _trained(step)
        checkpoint.save(ckpt, m, opt, step, keep=2)
        if step == 3:
            good, good_opt = m, opt
    newest = os.path.join(ckpt, "step_000004")
    data = [f for f in os.listdir(newest) if f.endswith(".distcp")][0]
    with open(os.path.join(newest, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest, data)) // 2)
    prev = os.path.join(ckpt, "step_000003")
    warnings = []
    assert checkpoint_folders.resolve(ckpt, warn=warnings.append) == prev
    assert len(warnings) == 1 and newest in warnings[0] and prev in warnings[0] and "truncated" in warnings[0], warnings
    with pytest.raises(ValueError) as e:
        checkpoint_folders.resolve(newest)
    assert newest in str(e.value) and f"--resume {prev}" in str(e.value) and data in str(e.value), str(e.value)
    fresh, fopt = _trained(99)
    assert checkpoint.load(ckpt, fresh, fopt, warn=warnings.append) == 3
    _same(fresh, fopt, good, good_opt, "fallback load")
    os.remove(os.path.join(prev, "meta.json"))
    with pytest.raises(ValueError, match="holds no earlier good one"):
        checkpoint_folders.resolve(ckpt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_folders.resolve(str(tmp_path / "nope" / "ckpt"))
    # a step that is not there names those that are; a run directory names its ckpt folder; the flag is the caller's
    with pytest.raises(FileNotFoundError) as e:
        checkpoint_folders.resolve(os.path.join(ckpt, "step_100"), flag="checkpoint")
    assert str(e.value) == f"checkpoint {os.path.join(ckpt, 'step_100')!r} does not exist; {ckpt!r} holds " \
        "step_000003, step_000004", str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        checkpoint_folders.resolve(str(tmp_path))
    assert str(e.value).startswith(f"--resume {str(tmp_path)!r}: no checkpoint there") and \
        str(e.value).endswith(f"; pass --resume {ckpt}"), str(e.value)
    # the file 'latest' names its ckpt folder; an exported adapter beside it names that folder and --init-adapter
    # (until 2026-12-05 both said only "no checkpoint there")
    with pytest.raises(FileNotFoundError) as e:
        checkpoint_folders.resolve(os.path.join(ckpt, "latest"))
    assert str(e.value).endswith(f"'latest' is the file naming the newest step; pass --resume {ckpt}, which resumes "
                                 "that step"), str(e.value)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        checkpoint_folders.resolve(str(adapter))
    assert str(e.value).endswith(f"that is an exported adapter (its LoRA weights, no optimizer state or data "
                                 f"position); pass --resume {ckpt} to continue its run, or --init-adapter {adapter} "
                                 "to start a new run from its weights"), str(e.value)
    with pytest.raises(FileNotFoundError, match="already what an export writes"):
        checkpoint_folders.resolve(str(adapter), flag="checkpoint")


def test_nonfinite_weights_never_saved(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    m, opt = _trained(1)
    checkpoint.save(ckpt, m, opt, 1)
    before = _hashes(tmp_path)
    with torch.no_grad():
        m.lora.weight[1, 2] = float("inf")
    with pytest.raises(NonFiniteError) as e:
        checkpoint.save(ckpt, m, opt, 2)
    assert "lora.weight" in str(e.value) and "checkpoint step 2" in str(e.value), str(e.value)
    assert _hashes(tmp_path) == before and sorted(os.listdir(ckpt)) == ["latest", "step_000001"]


def _two_ranks(rank, world_size, root):
    torch.manual_seed(0)   # the same replicated module on both ranks
    m, opt = _trained(0)
    checkpoint.save(os.path.join(root, "ckpt"), m, opt, 1)
    fresh, fopt = _trained(5)
    step = checkpoint.load(os.path.join(root, "ckpt"), fresh, fopt)
    ok = step == 1 and torch.equal(fresh.lora.weight, m.lora.weight)
    if rank == 1:
        with torch.no_grad():
            m.lora.weight[0, 0] = float("nan")
    try:
        checkpoint.save(os.path.join(root, "ckpt"), m, opt, 2)
        refused = None
    except NonFiniteError as e:
        refused = str(e)
    return ok, refused


@pytest.mark.timeout(120)
def test_nonfinite_on_one_rank_stops_all(tmp_path):
    got = run_ranks(_two_ranks, 2, str(tmp_path), timeout=100, pg_timeout=30)
    assert all(ok for ok, _ in got), f"2-rank save/load round trip failed: {got}"
    assert "lora.weight" in (got[1][1] or ""), f"rank 1 (the NaN) did not refuse: {got[1]}"
    assert "on another rank" in (got[0][1] or ""), f"rank 0 did not refuse with rank 1: {got[0]}"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_000001"], os.listdir(tmp_path / "ckpt")


def test_resume_takes_live_whole_steps_only_and_the_step_it_resolved_at_start(tmp_path):
    """resolve: a whole step newer than `latest` (a save killed between its folder's rename and `latest`'s) is the
    newest, not lost; an abandoned step (a resume went back below it) or an unfinished save's folder is refused,
    naming the live steps (until 2026-12-03 an explicit one resumed, mixing two trajectories). runs.claim: under the
    lock --resume must still resolve to the step it resolved to at start-up, else a run live then saved since and
    resuming the older step would drop its newer steps (refused; the lock is released)."""
    from parallel import runs

    out = tmp_path / "run"
    ckpt = str(out / "ckpt")
    (out / "ckpt").mkdir(parents=True)
    (out / "config.json").write_text('{"global_batch": 8}')
    for step in (1, 2):
        m, opt = _trained(step)
        checkpoint.save(ckpt, m, opt, step, keep=4)
    at_start = checkpoint_folders.resolve(ckpt)
    assert at_start.endswith("step_000002")
    m, opt = _trained(3)
    checkpoint.save(ckpt, m, opt, 3, keep=4)   # the other run, still live at this one's start, saves step 3
    with pytest.raises(ValueError, match=r"--resume .* resolved to step_000002 at start-up, but now to step_000003: "
                                         r"a run that was still writing there saved since"):
        runs.claim(str(out), resume=ckpt, resolved=at_start)
    with runs.claim(str(out), resume=ckpt, resolved=checkpoint_folders.resolve(ckpt)) as rd:   # (the lock was released)
        assert rd.path == str(out)
    # into another --out, step 2 of that run drops none of its steps: taken while whole (refused until 2026-12-04),
    # refused once its run removed it
    with runs.claim(str(tmp_path / "fork"), resume=ckpt, resolved=at_start) as rd:
        assert rd.path == str(tmp_path / "fork")
    os.rename(at_start, at_start + "-gone")
    with pytest.raises(ValueError, match=r"resolved to step_000002 at start-up, but now: gone: the run writing there "
                                         r"removed it.*Start this run again$"):
        runs.claim(str(tmp_path / "fork2"), resume=ckpt, resolved=at_start)
    os.rename(at_start + "-gone", at_start)
    latest, t2 = os.path.join(ckpt, "latest"), os.stat(os.path.join(ckpt, "step_000002", "meta.json")).st_mtime_ns
    open(latest, "w").write("step_000002")   # killed before `latest` moved to step 3: as step 2's save left it
    os.utime(latest, ns=(t2, t2))
    assert checkpoint_folders.resolve(ckpt).endswith("step_000003")
    # `latest` written after step 3 (a run before 2026-12-02 resumed step 2, saved, and left the older trajectory's
    # step 3 whole beside it): step 3 is another trajectory's, not taken (it was, from 2026-12-03 to 2026-12-04)
    os.utime(latest)
    assert checkpoint_folders.resolve(ckpt).endswith("step_000002")
    checkpoint.branch(os.path.join(ckpt, "step_000002"), log=lambda m: None)
    assert checkpoint_folders.resolve(ckpt).endswith("step_000002"), "a branch's abandoned step came back"
    os.makedirs(os.path.join(ckpt, ".tmp-step_000004"))
    for name, what in (("step_000003.abandoned", "an abandoned step"), (".tmp-step_000004", "an unfinished save")):
        with pytest.raises(ValueError, match=rf"--resume .*{name}' is {what}.*never resumed; pass --resume {ckpt} "
                                             r"\(its newest step\) or one of step_000002, step_000001"):
            checkpoint_folders.resolve(os.path.join(ckpt, name))


def test_a_branch_killed_between_its_renames_leaves_no_export_of_an_abandoned_step(tmp_path, monkeypatch):
    """branch moves OUT/adapter (exported at the newest step) aside before the newer step folders: killed after the
    first rename, no adapter of the abandoned trajectory stays in place, and the next resume moves the steps (until
    2026-12-04 the exports went last: killed between, OUT/adapter stayed, and no later branch moved it)."""
    out = tmp_path / "run"
    ckpt = str(out / "ckpt")
    for step in (1, 2, 3):
        m, opt = _trained(step)
        checkpoint.save(ckpt, m, opt, step, keep=4)
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    rename, calls = os.rename, []

    def killed(a, b):
        calls.append(a)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed")
        rename(a, b)
    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.branch(os.path.join(ckpt, "step_000001"), log=lambda m: None)
    monkeypatch.setattr(os, "rename", rename)
    assert not (out / "adapter").exists() and (out / "adapter.abandoned" / "adapter_config.json").is_file()
    said = []
    checkpoint.branch(os.path.join(ckpt, "step_000001"), log=said.append)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001", "step_000002.abandoned", "step_000003.abandoned"]
    assert checkpoint_folders.resolve(ckpt).endswith("step_000001") and "step_000003.abandoned" in said[0], said


def test_a_branch_killed_before_latest_is_said_as_such(tmp_path, monkeypatch):
    """branch renames the newer steps, then `latest`: killed between, `latest` names a step set aside; the next
    resolve takes the newest step left and says why (until 2026-12-04: "cannot be read (it does not exist)")."""
    ckpt = str(tmp_path / "run" / "ckpt")
    for step in (1, 2, 3):
        m, opt = _trained(step)
        checkpoint.save(ckpt, m, opt, step, keep=4)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.branch(os.path.join(ckpt, "step_000001"), log=lambda m: None)
    monkeypatch.undo()
    said = []
    assert checkpoint_folders.resolve(ckpt, warn=said.append).endswith("step_000001")
    assert said == [f"step_000003, which 'latest' names, was set aside as step_000003.abandoned by a resume from an "
                    f"older step that stopped before it saved; resuming from {os.path.join(ckpt, 'step_000001')!r}, "
                    "the newest step left. Steps after it are trained again"], said
