"""bench/plan.py, bench/load.py, bench/attention.py --blocks / --tiles / --docs, bench/memtrace.py, bench/micro_batch.py
cannot rot: each runs its smallest case (micro_batch.py and attention.py --docs as scripts; the others through their
main(argv) in this process, `_main`: the same code without a fresh interpreter's imports, their ranks still processes
of their own).

Pins: `bench/plan.py --only "cp1 nf4 1k"` prints that row, with the measured peak within the bench's own goal
(planned/measured ratio in [0.75, 1.25]); `bench/load.py --small --reps 1 --ranks 2` prints both quant rows, and the
lean path's per-rank peak is not above the whole-tensor path's (within the printed MB's rounding: the small
checkpoint's peaks are 0-1 MB; tests/test_load_memory.py bounds the lean peak), and the row of the same model's 4-bit
upload (2 ranks: the lean path still reads each rank's rows, FSDP2 over 2). Timings are printed by the scripts and not
asserted (no timing assertions in tests).

Run: .venv/bin/python -m pytest -q tests/test_bench_smoke.py
"""

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _main(name, *argv, capsys, monkeypatch):
    """bench/NAME.py's main(argv) in this process, one thread, what it prints: the script's run without a fresh
    interpreter's imports (~4 s of a core each). Imported as the package module bench.NAME (not by putting bench/ on
    sys.path: bench/loss.py would shadow loss), so its spawned ranks unpickle its functions by that name; the module
    globals and environment it sets for a run (kernels' backward block, memtrace.py's chunks and tile, plan.py's
    malloc threshold) are put back after the test."""
    import model.qlora
    import model.rmsnorm
    import model.rope
    import parallel.memory
    from parallel import kernels
    from tests.helpers import one_thread

    for mod, attr in ((kernels, "BACKWARD_BLOCK"), (kernels, "backward_block"), (model.rmsnorm, "NORM_CHUNK"),
                      (model.rope, "ROPE_CHUNK"), (model.qlora, "ROW_CHUNK"), (parallel.memory, "tile_tokens")):
        monkeypatch.setattr(mod, attr, getattr(mod, attr))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # (its spawned ranks' environment, as the script's was)
    if name == "plan":   # (set by plan.main for its ranks: put back after the test)
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    capsys.readouterr()
    with one_thread(), torch.random.fork_rng():   # (memtrace seeds torch's generator: this process's, put back)
        importlib.import_module(f"bench.{name}").main(list(argv))
    return capsys.readouterr().out


@pytest.mark.timeout(300)
def test_plan_bench_smallest_row(capsys, monkeypatch):
    out = _main("plan", "--only", "cp1 nf4 1k", capsys=capsys, monkeypatch=monkeypatch)
    row = re.search(r"^cp1 nf4 1k\s+1\s+(\d+)\s+(\d+)\s+([\d.]+)", out, re.M)
    assert row, out
    planned, measured, ratio = int(row[1]), int(row[2]), float(row[3])
    assert planned > 0 and measured > 0 and 0.75 <= ratio <= 1.25, out


@pytest.mark.timeout(300)
def test_load_bench_small(capsys, monkeypatch):
    out = _main("load", "--small", "--reps", "1", "--ranks", "2", capsys=capsys, monkeypatch=monkeypatch)
    rows = {m[0]: [float(x) for x in m[1:]] for m in re.findall(
        r"^(none|nf4)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)$", out, re.M)}
    assert set(rows) == {"none", "nf4"}, out
    for quant, (whole_s, lean_s, ratio, _, _, whole_mb, lean_mb) in rows.items():
        # (times print to 0.01 s: --small's 2 MB load took 0.02 s on a loaded 2-core machine, and one under 0.005 s
        # prints '0.00'; the ratio is of the unrounded times)
        assert whole_s >= 0 and lean_s >= 0 and ratio > 0, (quant, out)
        # (--small's checkpoint is 2 MB: each path's per-rank peak is 0-1 MB as printed, so one MB either way is the
        # rounding and the allocator; a lean path that read whole tensors would not pass test_load_memory's bound)
        assert lean_mb <= whole_mb + 1, (quant, out)
    up = re.search(r"^4bit ([\d.]+) s \(float32 checkpoint: ([\d.]+) s, ratio ([\d.]+)\), cpu ([\d.]+) s", out, re.M)
    assert up and float(up[3]) > 0, out   # (the 4-bit upload of the same model, read as stored)


@pytest.mark.timeout(120)
def test_attention_bench_tiles_mode(capsys, monkeypatch):
    """`bench/attention.py --tiles N`: kernels.attention and --tiled-attn's kernel calls, and their ratio line."""
    out = _main("attention", "--tiles", "64", "--seq", "200", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                "--iters", "1", "--warmup", "0", capsys=capsys, monkeypatch=monkeypatch)
    assert re.search(r"kernels.attention: fwd\+bwd [\d.]+ s", out) and re.search(r"64-row tiles: fwd\+bwd [\d.]+ s",
                                                                                   out), out
    assert re.search(r"tiles / kernels.attention: time [\d.]+", out), out
    diff = float(re.search(r"max \|difference\| of out, dq, dk, dv between the two: (\S+)", out).group(1))
    assert diff < 1e-4, out   # float32: the same attention, summed in another order


@pytest.mark.timeout(120)
def test_attention_bench_docs_mode():
    """`bench/attention.py --docs N`: ring attention over packed rows with each mask tile, and the table of ratios to
    the whole-block row. As a script (the benches' way in: its __main__, the sys.path that keeps bench/loss.py from
    shadowing loss, ranks forked from the forkserver unpickling __main__'s functions), once for all of them."""
    out = _run("bench/attention.py", "--docs", "40", "--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim",
               "16", "--mask-tiles", "16,0", "--iters", "1", "--warmup", "0", timeout=110)
    assert re.search(r"^\| 16 \| 2 \| 256 \| 40 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    assert re.search(r"^\| whole \| 2 \| 256 \| 40 \| [\d.]+ \| [\d.]+ \| 1.000 \| 1.000 \|$", out, re.M), out


def test_attention_bench_blocks_mode(capsys, monkeypatch):
    """`bench/attention.py --blocks N`: both runs (one kernel call, N-token blocks) and their ratio line."""
    out = _main("attention", "--blocks", "64", "--seq", "200", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                "--iters", "1", "--warmup", "0", capsys=capsys, monkeypatch=monkeypatch)
    assert re.search(r"one call: fwd\+bwd [\d.]+ s", out) and re.search(r"64-token blocks: fwd\+bwd [\d.]+ s", out), out
    assert re.search(r"blocks / one call: time [\d.]+", out), out


@pytest.mark.timeout(200)
def test_memtrace_bench_small(capsys, monkeypatch):
    """`bench/memtrace.py`: the seven --mem-phases phases in order, each with its peak (in [T, D]) and the sites
    alive then (a repository line or torch's own), then the planner's terms for the same run."""
    out = _main("memtrace", "--tokens", "512", "--layers", "2", "--tiled-mlp", "--top", "3", capsys=capsys,
                monkeypatch=monkeypatch)
    names = re.findall(r"^(\S.*?)\s{2,}([\d.]+) \[T, D\]$", out, re.M)
    assert [n for n, _ in names] == ["forward", "loss", "last block: MLP", "last block: o_proj",
                                     "last block: attention", "last block: q/k/v, norm", "rest of backward"], out
    assert all(float(v) > 0 for _, v in names), names
    assert re.search(r"^\s+[\d.]+\s+\d+\s+model/\S+:\d+ \(", out, re.M), out   # a site in the decoder
    # torch's own sums (autograd's, no repository frame inside the step) as such: this test's frames, outside the
    # step, are no op's site
    assert "autograd's sum (in place" in out and "tests/" not in out, out
    assert "planned (parallel/plan.py, cpu):" in out and "| block recompute (AC)" in out, out
    # the loss phase (block checkpoints, rope tables, final norm input and output, grad_hidden, the logits block)
    # is what the planner's activation and loss terms say: counted storages against parallel/plan.py
    terms = re.findall(r"^\s+([\d.]+)  ((?:activations: |\| or: ).*)$", out, re.M)
    plan = sum(float(v) for v, _ in terms)
    assert len(terms) == 4 and float(dict((n, v) for n, v in names)["loss"]) == pytest.approx(plan, rel=0.05), \
        (terms, names)


@pytest.mark.timeout(300)
def test_micro_batch_bench_smoke():
    """bench/micro_batch.py's CPU case prints both rows and their ratio; the two runs train the same samples, so their
    losses agree to float rounding (timings are printed, not asserted). Two steps of 8 samples, one of them 1,024
    tokens long and seven short ones (--micro-batch auto packs those into one micro-batch beside the long one: 2
    against 8)."""
    out = _run("bench/micro_batch.py", "--steps", "2", "--global-batch", "8", "--samples", "16", "--period", "8",
               timeout=280)
    assert re.search(r"^--micro-batch    1: [\d,]+ tokens/s", out, re.M) and \
        re.search(r"^--micro-batch auto: [\d,]+ tokens/s", out, re.M), out
    diff = float(re.search(r"largest loss difference ([\d.e+-]+)", out)[1])
    assert diff <= 1e-4 and "auto / 1: " in out, out
