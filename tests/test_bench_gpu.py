"""bench/gpu.py cannot rot: its CPU smoke mode runs end to end and writes the results JSON.

Pins:
- `cut_layers` sets num_hidden_layers and cuts transformers' `layer_types` (and max_window_layers);
- `python bench/gpu.py --smoke --profile` (run once, by bench/gpu_session.sh's CPU run in the `session` fixture, which
  test_gpu_session_script_on_cpu checks) on a copy of the Qwen2.5-7B bench config that carries a 28-entry
  `layer_types` (what transformers 5 writes): the checkpoint written for the tiny 2-layer case has a
  2-entry list (HF's loader refuses a mismatch, so the hf row passing shows it too), our trainer and
  HF + peft each run 1 warm-up + 2 timed steps on the same 128 tokens, and the JSON holds per run
  s/step > 0, tokens/s = tokens / s/step, a peak, the ratio to the other run, and the liger row
  either measured or skipped with a reason; the smoke mode's rows (SMOKE_RUNS: those whose bench-side logic differs)
  run too: ours with --tiled-mlp --offload-activations and with the planner's fewest --ac-blocks, "ours+fastest"
  (parallel/plan_speed's fastest flags that fit: --no-ac here), "ours+dpo" (--objective dpo on pairs of two 64-token
  texts, planned about as the plain row), "ours+dpo-cached" (one pair every step, its reference kept),
  "ours+dpo-prompt" and "ours+dpo-prompt-shared" (pairs sharing a prompt, the second row on fewer tokens),
  "hf+neftune" (transformers' NEFTune hook on the hf model: its embedding noises in that row alone, and a row after it
  in the same process, liger's on a GPU, runs unhooked, and "hf+dora" takes peft's use_dora: peer_main in the test's
  process), and our rows carry the planner's total for their flags and peak / planned, and step 1's peak per phase;
  the rows that only pass train.py a flag (orpo, dora, norms, neftune, dft, tiled-attn) are checked as a table (their
  training is train.py's, tested in its own files).

Run: .venv/bin/python -m pytest -q tests/test_bench_gpu.py
"""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Loaded by path, not by putting bench/ on sys.path: spawned ranks of later tests inherit sys.path,
# and bench/loss.py would then shadow the top-level loss module in them.
_spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench", "gpu.py"))
bench_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gpu)


@pytest.mark.parametrize("row", sorted(bench_gpu.FLAG_ROWS))
def test_every_row_passes_the_trainers_start_up_checks(row):
    """A row whose flags the trainer refuses (e.g. two that exclude each other) would only show on the GPU."""
    import train
    from parallel.flags import check_flags

    spec = dict(ckpt="m", data="d.jsonl", tokens=131072, steps=2, quant="nf4", dtype="bf16")
    args = train.build_parser().parse_args(bench_gpu.ours_argv(spec, "out", bench_gpu.FLAG_ROWS[row]))
    check_flags(args)


def test_default_rows_exist():
    known = {"ours", *bench_gpu.PEERS, bench_gpu.FIT_AC, bench_gpu.FASTEST, bench_gpu.FASTEST_COMPILE,
             *bench_gpu.FLAG_ROWS}
    assert set(bench_gpu.DEFAULT_RUNS) == set(bench_gpu.CASES)
    for case, rows in bench_gpu.DEFAULT_RUNS.items():
        assert set(rows) <= known, (case, set(rows) - known)


def test_cut_layers():
    cfg = {"num_hidden_layers": 28, "layer_types": ["full_attention"] * 28, "max_window_layers": 28, "x": 1}
    cut = bench_gpu.cut_layers(cfg, 8)
    assert cut == {"num_hidden_layers": 8, "layer_types": ["full_attention"] * 8, "max_window_layers": 8, "x": 1}
    assert cfg["num_hidden_layers"] == 28, "the input is not modified"
    assert bench_gpu.cut_layers({"num_hidden_layers": 4}, 2) == {"num_hidden_layers": 2}


def test_shards_are_kept_across_lengths(tmp_path):
    """A case of another length reuses the shards another case wrote (max_position_embeddings, raised to the case's
    tokens, is in config.json alone); another config (its dims) rewrites them."""
    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "qwen2.5-7b", "config.json")))
    shards = tmp_path / "shards"
    mtimes = lambda: {f.name: f.stat().st_mtime_ns for f in shards.iterdir() if f.suffix == ".safetensors"}  # noqa: E731
    bench_gpu.write_checkpoint(cfg, 2, 524288, str(tmp_path), True)
    for f in mtimes():   # dated 1970: a shard written again has today's date
        os.utime(shards / f, ns=(0, 0))
    ckpt = bench_gpu.write_checkpoint(cfg, 2, 128, str(tmp_path), True)
    assert mtimes() == dict.fromkeys(["rest.safetensors", "layer-000.safetensors", "layer-001.safetensors"], 0), \
        mtimes()
    assert json.load(open(os.path.join(ckpt, "config.json")))["max_position_embeddings"] == 131072
    bench_gpu.write_checkpoint(dict(cfg, rms_norm_eps=1e-5), 2, 128, str(tmp_path), True)
    assert 0 not in mtimes().values(), "another config kept stale shards"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """bench/gpu_session.sh run once on this machine (test_gpu_session_script_on_cpu's stand-ins), its BENCH the smoke
    mode with --profile on a copy of the Qwen2.5-7B bench config that carries a 28-entry `layer_types` (what
    transformers 5 writes): both tests read this one run (one bench/gpu.py, not two)."""
    import shutil
    import stat

    tmp_path = tmp_path_factory.mktemp("session")
    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "qwen2.5-7b", "config.json")))
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    repo, shims, out = tmp_path / "repo", tmp_path / "bin", tmp_path / "out"
    for d in (repo / "bench", shims):
        d.mkdir(parents=True)
    for name in os.listdir(ROOT):
        if name not in ("bench", ".git", ".whl"):   # (no wheels: nothing is installed into /tmp/site)
            (repo / name).symlink_to(os.path.join(ROOT, name))
    for name in os.listdir(os.path.join(ROOT, "bench")):
        if not name.startswith("gpu-results"):
            (repo / "bench" / name).symlink_to(os.path.join(ROOT, "bench", name))
    (shims / "python3").write_text(
        "#!/bin/sh\ncase \"$1 $2\" in '-c import torch, sys; sys.exit(not torch.cuda.is_available())') exit 0;; esac\n"
        f"exec {shutil.which(sys.executable) or sys.executable} \"$@\"\n")
    (shims / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.total [MiB], driver_version'\n")
    for f in shims.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER",
                                                            "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                                                            "PYTORCH_HIP_ALLOC_CONF")}
    env.update(PATH=f"{shims}:{env['PATH']}", OUT=str(out), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOTAL="540",
               TEST_S="120", DEMO="0", TEST_K="nf4 or dpo",   # (-k's quotes through PYTEST_ADDOPTS)
               BENCH=f"--smoke --config {tmp_path / 'cfg'} --work {tmp_path / 'work'} --profile")
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_session.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=560)
    log = (out / "bench-gpu.log").read_text() if (out / "bench-gpu.log").is_file() else ""
    return SimpleNamespace(proc=proc, tmp=tmp_path, repo=repo, out=out, log=log)


@pytest.mark.timeout(600)
def test_smoke_mode_writes_results(session):
    """`bench/gpu.py --smoke --profile` (run by the session fixture's bench/gpu_session.sh: its log, results and work
    folder)."""
    tmp_path, out = session.tmp, session.out / "gpu-results.json"
    assert session.proc.returncode == 0 and "bench-gpu exit 0 " in session.log, \
        session.proc.stdout[-3000:] + session.proc.stderr[-3000:]
    proc = SimpleNamespace(stdout=session.log)
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["versions"]["torch"]
    # every row: train.py's allocator default
    assert res["versions"]["alloc_conf"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    case = res["cases"]["32k"]
    assert (case["tokens"], case["layers"], case["warmup"], case["steps"]) == (128, 2, 1, 3), case
    written = json.load(open(tmp_path / "work" / "ckpt-2l" / "config.json"))
    assert written["num_hidden_layers"] == 2 and written["layer_types"] == ["full_attention"] * 2
    rows = case["rows"]
    assert sorted(rows) == sorted(["ours", "hf", "liger", "ours+fit-ac", "ours+fastest", "ours+tiled+offload",
                                   "ours+dpo", "ours+dpo-cached", "ours+dpo-prompt", "ours+dpo-prompt-shared",
                                   "hf+neftune"])
    for name in ("ours", "hf", "ours+fit-ac", "ours+fastest", "ours+tiled+offload", "ours+dpo", "ours+dpo-cached",
                 "hf+neftune"):
        r = rows[name]
        assert "error" not in r, (name, r, proc.stdout[-3000:])
        assert len(r["times"]) == 3 and r["s_per_step"] > 0 and r["peak_gb"] > 0, (name, r)
        assert abs(r["tokens_per_s"] - 128 / r["s_per_step"]) < 1e-6, (name, r)
    assert rows["ours"]["ratio"]["hf"] == pytest.approx(rows["ours"]["tokens_per_s"] / rows["hf"]["tokens_per_s"])
    assert rows["hf"]["ratio"]["ours"] == pytest.approx(1 / rows["ours"]["ratio"]["hf"])
    assert "s_per_step" in rows["liger"] or rows["liger"]["skipped"], rows["liger"]
    assert "| ours |" in proc.stdout and "| hf |" in proc.stdout, proc.stdout[-2000:]
    # our rows carry the planner's total for their flags (train.py --plan's number) and the measured ratio
    mem = rows["ours+tiled+offload"]
    assert mem["flags"] == ["--tiled-mlp", "--offload-activations"] and rows["ours"]["flags"] == []
    # DPO: pairs of two 64-token texts, rows of 128 like the others, against the plain row; planned as 2 × 64
    dpo = rows["ours+dpo"]
    assert dpo["flags"] == ["--objective", "dpo"] and dpo["ratio"]["ours"] > 0 and dpo["planned_gb"] > 0, dpo
    assert dpo["planned_gb"] == pytest.approx(rows["ours"]["planned_gb"], rel=0.05), (dpo, rows["ours"])
    cached = rows["ours+dpo-cached"]   # (one pair every step: its reference kept by the warm-up step, then read)
    assert cached["flags"] == ["--objective", "dpo", "--dpo-cache-ref"] and cached["ratio"]["ours"] > 0, cached
    kept = [torch.load(f, weights_only=True) for f in (tmp_path / "work" / "32k").glob("ours-*/reference_logps.pt")]
    assert [k["have"].tolist() for k in kept] == [[True]], kept
    # pairs sharing a prompt of 7/8 of a side, as they come and with --dpo-share-prompt: the same pairs, the prompt
    # once (fewer tokens a step, a smaller plan)
    plain, shared = rows["ours+dpo-prompt"], rows["ours+dpo-prompt-shared"]
    assert shared["flags"] == ["--objective", "dpo", "--dpo-share-prompt"] and "error" not in shared, shared
    assert shared["s_per_step"] > 0 and plain["s_per_step"] > 0, (plain, shared)
    assert plain["step_tokens"] == 128 and shared["step_tokens"] < 0.7 * plain["step_tokens"], (plain, shared)
    assert shared["loss"] == pytest.approx(plain["loss"], abs=1e-4), (plain, shared)   # (the same pairs' DPO)
    # transformers' NEFTune hook on HF's embeddings in its row only
    assert [rows[n]["embedding_noise"] for n in ("hf", "hf+neftune")] == [False, True], rows
    assert rows["hf+neftune"]["ratio"]["hf"] > 0 and rows["ours"]["ratio"]["hf+neftune"] > 0, rows
    # the planner's fewest checkpointed blocks on this machine (CPU RAM: the tiny model fits with none)
    assert rows["ours+fit-ac"]["flags"] == ["--ac-blocks", "0"], rows["ours+fit-ac"]
    # the fastest flags that fit (no liger row on CPU: 95% of this machine), with why and the estimate
    fast = rows["ours+fastest"]
    assert fast["flags"] == ["--no-ac"] and "95% of the device" in fast["chosen"], fast
    for r in (rows["ours"], mem):
        assert r["planned_gb"] > 0 and r["peak_vs_plan"] == pytest.approx(r["peak_gb"] / r["planned_gb"])
        # on CPU the RSS (imports included) is compared with --plan's total; CUDA compares allocated with live
        assert r["plan_basis"] == "total" and r["planned_total_gb"] == r["planned_gb"] and "reserved_gb" not in r
        # step 1's peak per phase (train.py --mem-phases), or why there is none (no VmHWM reset on this CPU)
        ph = r["mem_phases"]
        assert isinstance(ph, str) or [n for n, _ in ph][-1] == "rest of backward" and len(ph) == 7, ph
    assert "step 1 peak per phase (GB): forward" in proc.stdout or "clear_refs" in proc.stdout, proc.stdout[-2000:]
    assert "ours+tiled+offload --tiled-mlp --offload-activations: peak" in proc.stdout, proc.stdout[-2000:]
    # --profile: the plain row ran one more step under train.py --profile, kept out of its timed steps
    prof = rows["ours"]["profile_head"]
    assert prof.startswith("step 4: ") and "by category" in prof and "matmul" in prof, prof
    assert "profile_head" not in mem and "  profile (" in proc.stdout, proc.stdout[-2000:]


def test_peer_rows_in_one_process(tmp_path, monkeypatch):
    """The peers' process (peer_main, here in this one, one step a row on the smoke mode's checkpoint): a row after
    hf+neftune (liger's on a GPU) runs with transformers' NEFTune hook removed, and hf+dora, alone in its process
    (run_order), builds peft's model with use_dora (the others without)."""
    import peft

    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "qwen2.5-7b", "config.json")))
    ckpt = bench_gpu.write_checkpoint(cfg, 2, 128, str(tmp_path), True)
    made = []
    wrap = peft.get_peft_model
    monkeypatch.setattr(peft, "get_peft_model", lambda m, c: made.append(c.use_dora) or wrap(m, c))
    (tmp_path / "ids.json").write_text(json.dumps([list(range(300, 428))]))
    for n, rows in enumerate((["hf+neftune", "hf"], ["hf+dora"])):
        spec = dict(ckpt=ckpt, ids=str(tmp_path / "ids.json"), steps=1, quant="none", dtype="fp32", rows=rows,
                    result=str(tmp_path / f"peer{n}.json"))
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        bench_gpu.peer_main(str(tmp_path / "spec.json"))
    after = json.loads((tmp_path / "peer0.json").read_text())
    assert [after[n]["embedding_noise"] for n in ("hf+neftune", "hf")] == [True, False], after
    dora = json.loads((tmp_path / "peer1.json").read_text())["hf+dora"]
    assert made == [False, True] and dora["times"][0] > 0 and dora["embedding_noise"] is False, (made, dora)


def test_flag_rows_run_with_runs():
    """The rows of ours that only pass train.py flags are not in the smoke mode's default list (SMOKE_RUNS; each flag's
    training is tested with train.py: --dpo-loss orpo in tests/test_dpo.py, --dora in tests/test_train.py,
    --train-norms / --train-embeddings in tests/test_norms.py, --neftune-alpha in tests/test_neftune.py, --sft-loss dft
    in tests/test_train.py, --tiled-attn's phases in tests/test_phases.py): their flags as the table gives them, and
    every one of them a known row that --runs takes."""
    assert set(bench_gpu.SMOKE_RUNS) <= {"ours", *bench_gpu.PEERS, bench_gpu.FIT_AC, bench_gpu.FASTEST,
                                         *bench_gpu.FLAG_ROWS}
    rows = bench_gpu.FLAG_ROWS
    assert rows["ours+orpo"] == ["--objective", "dpo", "--dpo-loss", "orpo"]
    assert rows["ours+tiled-attn+offload"] == ["--tiled-mlp", "--tiled-attn", "--offload-activations"]
    assert rows["ours+dora"] == ["--dora"] and rows["ours+norms"] == ["--train-norms"]
    assert rows["ours+norms+emb"] == ["--train-norms", "--train-embeddings"]
    assert rows["ours+neftune"] == ["--neftune-alpha", "5"] and rows["ours+dft"] == ["--sft-loss", "dft"]
    assert bench_gpu.ROW_DATA.get("ours+orpo", "pairs") == "pairs"   # (the DPO row's pairs)


def test_fastest_row_keeps_under_the_cap():
    """ours+fastest's flags (here with --cap-gb's 25 GB, as an earlier run's Liger peak would give): the planner's
    live peak for them, on this machine's target, is within LIGER_MARGIN x the cap, and the row says why."""
    import train
    from model.load import read_args
    from parallel.flags import check_flags
    from parallel.mesh import validate
    from parallel.plan import memory_plan
    from parallel.plan_search import _budget

    ckpt = os.path.join(ROOT, "bench", "configs", "qwen2.5-7b")   # config.json is all the planner reads
    spec = dict(ckpt=ckpt, data="d.jsonl", tokens=32768, steps=2, quant="nf4", dtype="bf16")
    margs = read_args(ckpt)
    for cap, extra in ((25.0, ()), (25.0, ("--compile",)), (1e6, ())):   # 1e6 GB: the device (here RAM) bounds it
        flags, why = bench_gpu.fastest_flags(spec, cap, "--cap-gb", extra)
        assert f"--cap-gb {cap:.2f} GB" in why, why
        args = train.build_parser().parse_args(bench_gpu.ours_argv(spec, "out", [*extra, *flags]))
        check_flags(args)   # with --compile among the run's flags: what the compile row runs
        dims, pack = validate(args, margs, 1)
        args.gpu_mem = None   # (the planner's own flag, as bench/gpu.py sets it)
        target, mem, _ = _budget(args, 1)
        plan = memory_plan(margs, dims, args, target, pack)
        assert plan.peak <= bench_gpu.LIGER_MARGIN * cap * 1e9 and plan.total <= 0.95 * mem, (cap, flags)


def test_row_order_and_cap_checks():
    """The peers run right after plain ours (or first without it), before every other row of ours, whose fastest rows
    take Liger's peak as their cap; --cap-gb must be positive and for one case."""
    assert bench_gpu.run_order(["ours+fastest"], ["liger"]) == [["liger"], ["ours+fastest"]]
    assert bench_gpu.run_order(["ours", "ours+fit-ac", "ours+fastest+compile"], ["hf", "liger"]) == [
        ["ours"], ["hf", "liger"], ["ours+fit-ac"], ["ours+fastest+compile"]]
    assert bench_gpu.run_order(["ours", "ours+dora"], ["hf", "hf+dora"]) == [   # (peft's DoRA: its own model)
        ["ours"], ["hf"], ["hf+dora"], ["ours+dora"]]
    # hf+neftune hooks and unhooks hf's model in the peers' process: before liger, whose patch stays on the model
    assert bench_gpu.run_order(["ours", "ours+neftune", "ours+dft"], ["hf", "hf+neftune", "liger"]) == [
        ["ours"], ["hf", "hf+neftune", "liger"], ["ours+neftune"], ["ours+dft"]]
    assert bench_gpu.PEERS.index("hf") < bench_gpu.PEERS.index("hf+neftune") < bench_gpu.PEERS.index("liger")
    assert bench_gpu.run_order(["ours", "ours+tiled"], []) == [["ours"], ["ours+tiled"]]
    for argv in (["--cap-gb", "0", "--case", "32k"], ["--cap-gb", "25"]):   # the default case is all
        with pytest.raises(SystemExit):
            bench_gpu.main(argv)


@pytest.mark.timeout(600)
def test_gpu_session_script_on_cpu(session):
    """bench/gpu_session.sh end to end on this machine (the session fixture's run), with stand-ins for the GPU
    machine's: python3 is this interpreter (claiming CUDA to the Makefile's host check alone, so `make test-gpu` and
    `make bench-gpu` take the GPU machine's branch), nvidia-smi a stub, the repository a tree of links whose bench/ is
    its own (the results file lands there), DEMO=0 (no demo-assets build: the GPU tests, which train the demo, skip
    here; tests/test_demo.py builds and checks the assets), `make test-gpu` collecting tests/gpu (every module skips
    without CUDA), then bench/gpu.py's smoke mode with the plain row's profile step (test_smoke_mode_writes_results
    checks its rows). What comes back: every file in $OUT under a name the device tool returns, no more than it
    returns, the results and the profile among them; the tests' log verbose, so that a cap that cuts it still says
    which tests ran (make test-gpu's -q took back the script's -v: the log held dots)."""
    import re

    proc, repo, out = session.proc, session.repo, session.out
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== demo assets" not in proc.stdout and "== make test-gpu" in proc.stdout, proc.stdout[-3000:]
    files = sorted(os.listdir(out))
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) and (out / f).is_file() for f in files), files
    assert "bnb-import.txt" not in files, files   # (an empty file when bitsandbytes imports: one of the 8 taken)
    assert len(files) <= 8 and {"env.txt", "test-gpu.log", "bench-gpu.log", "gpu-results.json",
                                "profile-1-32k-ours.txt"} <= set(files), files
    assert "collecting ... " in (out / "test-gpu.log").read_text(), (out / "test-gpu.log").read_text()[-2000:]
    res = json.loads((out / "gpu-results.json").read_text())
    assert res["cases"]["32k"]["rows"]["ours"]["s_per_step"] > 0, res
    assert (repo / "bench" / "gpu-results.json").is_file()   # (the link tree's: the checkout's own is untouched)


@pytest.mark.parametrize("config", ["qwen2.5-7b", "gemma-3-12b", "olmo-3-7b"])
def test_checkpoint_holds_what_the_decoder_loads(tmp_path, config):
    """The bench's random checkpoint of any bench config (Gemma 3's four norms and offset norms, OLMo's post norms and
    whole-width q/k norms, Qwen's biases) is what our loader reads: every tensor the model has, none else, and the
    norms are the identity (Gemma's offset 0, the others' 1)."""
    from model.load import CheckpointReader, from_pretrained

    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", config, "config.json")))
    ckpt = bench_gpu.write_checkpoint(bench_gpu.cut_layers(cfg, 2), 2, 128, str(tmp_path), True)
    model = from_pretrained(ckpt)
    reader = CheckpointReader(ckpt)
    assert set(reader.where) == set(model.state_dict()) - ({"lm_head.weight"} if model.args.tie_embeddings else set())
    for n, m in model.named_modules():
        if n.endswith("norm"):
            x = torch.randn(3, m.weight.shape[0])
            torch.testing.assert_close(m(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps), msg=n)
    reader.close()


def test_gemma4_checkpoint_loads_in_transformers_at_any_cut(tmp_path):
    """Gemma 4's last layer is full whatever config.json's type says (transformers and our reader force it): the 31B's
    config (as `main` hands it: uncut) at 2 layers (layer 1 sliding in the 60-layer list) and at 6 in the same shard
    cache loads in Gemma4ForCausalLM with no missing, unexpected or mismatched tensor (the 2-layer checkpoint's layer 1
    was written as a sliding one: a size mismatch), and in ours; layer_scalar is 1 (transformers' init), not noise."""
    import transformers as T

    from model.load import from_pretrained

    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "gemma-4-31b", "config.json")))
    for layers in (2, 6, 2):
        ckpt = bench_gpu.write_checkpoint(cfg, layers, 128, str(tmp_path), True)
        hf, info = T.AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (layers, info)
        assert hf.model.layers[-1].self_attn.v_proj is None and len(hf.model.layers) == layers
        ours = from_pretrained(ckpt)
        assert all(float(b.layer_scalar) == 1.0 for b in ours.model.layers)
