"""Multi-GPU checks under torchrun (NCCL, one GPU per rank); skipped unless at least 2 GPUs are visible.

Pins, with every visible GPU (capped at 8) as one rank:
- CP attention (Ulysses all-to-all, zigzag ring over batched P2P, and with 4+ even ranks the hybrid)
  equals single-GPU SDPA on the whole sequence: output and q/k/v gradients, bf16
  (tests/gpu/multi_gpu_cp.py, launched with `torchrun --standalone`: a free port, no fixed one);
- `train.main` for 2 steps on the demo model and corpus (float32, no quantization, --no-pack,
  --global-batch 4) gives the 1-GPU run's per-step losses (1e-4 absolute) and grad norms (1e-3
  relative) and the same exported adapter (1e-3 relative norm of the difference) with --cp 2
  (Ulysses), --cp 2 --cp-impl ring, and --dp-shard 2 (FSDP2's reduce-scatter), 2 ranks each.

Run: make test-gpu   (or python3 -m pytest -q tests/gpu/test_multi_gpu.py on a machine with 2+ GPUs)
"""

import json
import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip(f"{torch.cuda.device_count()} CUDA device(s) visible: these tests need at least 2",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NGPU = min(torch.cuda.device_count(), 8)
TRAIN = ["--steps", "2", "--global-batch", "4", "--dtype", "fp32", "--quant", "none", "--no-pack", "--no-progress"]
LAYOUTS = {"cp2_ulysses": ["--cp", "2", "--cp-impl", "ulysses"], "cp2_ring": ["--cp", "2", "--cp-impl", "ring"],
           "dp2": ["--dp-shard", "2"]}


def torchrun(nproc, *args, cwd=ROOT, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
def test_cp_attention_matches_single_gpu_sdpa():
    proc = torchrun(NGPU, os.path.join(ROOT, "tests", "gpu", "multi_gpu_cp.py"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rank 0 ring: checked" in proc.stdout and "rank 0 ulysses: checked" in proc.stdout, proc.stdout[-2000:]


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def adapter(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))


@pytest.mark.timeout(900)
def test_train_two_steps_match_one_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", PYTHONUNBUFFERED="1")
    ref_out = str(tmp_path / "ref")
    # cwd tmp_path: the demo assets go to tmp_path/runs/demo_assets, built once by this first run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TRAIN, "--out", ref_out],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref, ref_ad = metrics(ref_out), adapter(ref_out)
    assert len(ref) == 2
    for name, flags in LAYOUTS.items():
        out = str(tmp_path / name)
        proc = torchrun(2, os.path.join(ROOT, "train.py"), *TRAIN, *flags, "--out", out, cwd=tmp_path)
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        got = metrics(out)
        for a, b in zip(got, ref, strict=True):
            assert abs(a["loss"] - b["loss"]) < 1e-4, (name, "loss", a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * abs(b["grad_norm"]), (name, "grad_norm", a, b)
        ad = adapter(out)
        assert ad.keys() == ref_ad.keys(), name
        for key in ref_ad:
            diff = (ad[key].double() - ref_ad[key].double()).norm() / ref_ad[key].double().norm().clamp(min=1e-12)
            assert diff < 1e-3, (name, key, float(diff))
