"""train.py --profile N (parallel/profiler.py): step N's time by category and by op, in OUT/profile.txt.

Pins (1 CPU rank, the tiny checkpoint of tests/conftest.py):
- the file comes for the chosen step only; its categories add up to its busy time, which lies inside the
  step's wall time; the matmul category holds aten::mm; metrics.jsonl marks that step, and only it;
- a step outside the run, or below 1, or not after a resumed run's checkpoint, is refused with the fix, before
  any weight is read; bench/gpu.py's extra profiled step with --schedule-steps leaves the timed steps' lr and
  losses as they were without it;
- the categories of real CUDA kernel names (cuDNN's and flash attention, cuBLAS/CUTLASS GEMMs, bitsandbytes'
  dequantization, copies and casts, NCCL) as a GPU profile names them.

Run: .venv/bin/python -m pytest -q tests/test_profiler.py
"""

from __future__ import annotations

import json
import os
import re

import pytest

from parallel.profiler import categorize
from tests.helpers import no_weights, one_thread, train_argv


def test_profile_writes_the_chosen_step(assets, tmp_path):
    import train

    out = str(tmp_path / "out")
    with one_thread():
        train.main(train_argv(assets, out, "--steps", "3", "--profile", "2"))
    text = open(os.path.join(out, "profile.txt")).read()
    m = re.match(r"step 2: ([\d.]+) s wall \(profiled: slower than the others\); ([\d.]+) s of self CPU time", text)
    assert m, text[:300]
    wall, busy = float(m.group(1)), float(m.group(2))
    assert 0 < busy <= wall * 1.05, (wall, busy)
    cats = dict((c, float(s)) for c, s in re.findall(r"^  (\S[\w ]*?)\s+([\d.]+)\s+[\d.]+%$", text, re.M))
    assert cats["matmul"] > 0 and sum(cats.values()) == pytest.approx(busy, abs=0.003), (cats, busy)
    assert re.search(r"^\s+[\d.]+\s+\d+\s+matmul\s+aten::mm$", text, re.M), text
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r.get("profiled", False) for r in rows] == [False, True, False], rows
    assert not os.path.exists(os.path.join(out, "profile-rank1.txt"))


@pytest.mark.parametrize("n, msg", [("4", r"--profile 4: this run has steps 1\.\.3; pick one of them"),
                                    ("0", r"--profile must be a step number >= 1")])
def test_profile_outside_the_run_is_refused_before_weights(assets, tmp_path, n, msg, monkeypatch):
    """... and, with --steps given, before the data are read (review, helper 54: after tokenizing)."""
    import train
    from data import run_data

    monkeypatch.setattr(run_data, "load_run_data", lambda *a, **k: pytest.fail("the data were read first"))
    with no_weights(), one_thread(), pytest.raises(ValueError, match=msg):
        train.main(train_argv(assets, str(tmp_path / "out"), "--steps", "3", "--profile", n))


def test_profiled_extra_step_keeps_the_schedule(assets, tmp_path):
    """bench/gpu.py's profiled row: one more step under --profile with --schedule-steps of the timed ones, so
    those steps train exactly as the run without the extra step (same lr, same losses)."""
    import train

    rows = {}
    for name, extra in (("plain", ["--steps", "3"]),
                        ("profiled", ["--steps", "4", "--profile", "4", "--schedule-steps", "3"])):
        out = str(tmp_path / name)
        with one_thread():
            train.main(train_argv(assets, out, *extra))
        rows[name] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [(r["lr"], r["loss"]) for r in rows["profiled"][:3]] == [(r["lr"], r["loss"]) for r in rows["plain"]]
    assert rows["profiled"][3].get("profiled") is True


def test_profile_of_a_step_before_the_resume_is_refused(assets, tmp_path):
    import train

    out = str(tmp_path / "out")
    with one_thread():
        train.main(train_argv(assets, out, "--steps", "2"))
    with no_weights(), one_thread(), pytest.raises(ValueError, match="--profile 2: this run resumes after step 2"):
        train.main(train_argv(assets, out, "--steps", "4", "--resume", os.path.join(out, "ckpt"), "--profile", "2"))


@pytest.mark.parametrize("name, cat", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(flash::Flash_fwd_params)", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off",
     "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "matmul"),
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, int)",
     "NF4 dequantize"),
    ("Memcpy DtoH (Device -> Pinned)", "copies"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copies"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
])
def test_kernel_categories(name, cat):
    assert categorize(name) == cat
