"""CUDA-only checks of Qwen3.5's Gated DeltaNet (model/deltanet.py, model/deltanet_core.py), never run on a GPU before
this file was written (2026-12-07, a session without one):
- the sublayer on CUDA in bf16 (the torch rule in segments, packed rows with documents crossing chunk and segment edges)
  = the same weights on the CPU in float64: output and the input's gradient within bf16 tolerance (relative to the
  reference's norm), and the parameters' gradients;
- with flash-linear-attention installed (`fla`, optional: the core's CUDA fast path, cu_seqlens for the documents),
  the fla path = the torch path on the same inputs, outputs and input gradients; without fla that test is skipped
  naming the package;
- one layer at Qwen3.5-9B's linear sizes (16 key / 32 value heads of 128, hidden 4096), 32,768 tokens, bf16: forward +
  backward time and peak memory printed for the GPU log (no assertion on time), and the peak is checked against the
  planner's saved + backward terms (parallel/plan_linear.py: CPU-measured so far) within 1.5x either way.

Run: make test-gpu   (or python3 -m pytest -q -s tests/gpu/test_gpu_deltanet.py)
"""

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: these tests need a GPU", allow_module_level=True)

from model import deltanet_core  # noqa: E402
from model.deltanet import GatedDeltaNet, prepare_linear  # noqa: E402

DEV = torch.device("cuda")


def _module(D, Hk, Hv, dk, dv, seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(D, Hk, Hv, dk, dv, 4, 1e-6)
    with torch.no_grad():   # off the defaults: real decays, a norm weight that is not ones
        m.A_log.uniform_(-1.0, 1.5)
        m.dt_bias.uniform_(-1.0, 1.0)
        m.norm.weight.uniform_(0.5, 1.5)
        for p in (m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight, m.in_proj_a.weight,
                  m.out_proj.weight):
            p.normal_(0, D ** -0.5)
    return m


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("lengths", [[2100], [5, 700, 64, 1200, 131]], ids=["one_document", "packed"])
def test_bf16_on_cuda_equals_float64_on_cpu(lengths):
    D, Hk, Hv, dk, dv = 256, 2, 4, 64, 64
    ref = _module(D, Hk, Hv, dk, dv).double()
    dev = _module(D, Hk, Hv, dk, dv).to(DEV, torch.bfloat16)
    pos = _positions(lengths)
    torch.manual_seed(1)
    x = torch.randn(1, pos.shape[1], D, dtype=torch.float64)
    gy = torch.randn(1, pos.shape[1], D, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr, prepare_linear(pos))
    yr.backward(gy)
    xd = x.to(DEV, torch.bfloat16).requires_grad_(True)
    yd = dev(xd, prepare_linear(pos.to(DEV)))
    yd.backward(gy.to(DEV, torch.bfloat16))
    assert _rel(yd.cpu(), yr) < 2e-2, _rel(yd.cpu(), yr)
    assert _rel(xd.grad.cpu(), xr.grad) < 3e-2, _rel(xd.grad.cpu(), xr.grad)
    for (n, pr), (_, pd) in zip(ref.named_parameters(), dev.named_parameters()):
        assert _rel(pd.grad.cpu(), pr.grad) < 5e-2, (n, _rel(pd.grad.cpu(), pr.grad))


def test_fla_path_equals_the_torch_rule(monkeypatch):
    pytest.importorskip("fla", reason="flash-linear-attention (fla) is not installed: the core's CUDA fast path")
    D, Hk, Hv, dk, dv = 256, 2, 4, 64, 64
    m = _module(D, Hk, Hv, dk, dv).to(DEV, torch.bfloat16)
    pos = _positions([5, 700, 64, 1200, 131])
    torch.manual_seed(1)
    x = torch.randn(1, pos.shape[1], D, device=DEV, dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    outs = []
    for fla in (False, True):
        monkeypatch.setattr(deltanet_core, "FLA", fla)
        xi = x.clone().requires_grad_(True)
        y = m(xi, prepare_linear(pos.to(DEV)))
        y.backward(gy)
        outs.append((y.float(), xi.grad.float()))
    (yt, gt), (yf, gf) = outs
    assert _rel(yf, yt) < 2e-2 and _rel(gf, gt) < 3e-2, (_rel(yf, yt), _rel(gf, gt))


def test_qwen3_5_9b_layer_at_32k_prints_its_time_and_peak():
    from parallel import plan_linear

    D, Hk, Hv, dk, dv, T = 4096, 16, 32, 128, 128, 32768
    m = _module(D, Hk, Hv, dk, dv).to(DEV, torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):   # (the first warms up)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        y = m(x, None)
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        dt, peak = time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
        x.grad = None
        del y
    planned = plan_linear.saved(T, 1, Hk, Hv, dk, dv, 4, 2, 1) + plan_linear.backward(T, 1, Hk, Hv, dk, dv, 2, 1)
    print(f"\nGated DeltaNet, Qwen3.5-9B linear layer, {T} tokens bf16, torch rule "
          f"(fla {'on' if deltanet_core._fla_rule is not None and deltanet_core.FLA else 'off'}): fwd+bwd {dt:.3f} s, "
          f"{T / dt:,.0f} tokens/s, peak above start {peak / 2**30:.2f} GiB, planned {planned / 2**30:.2f} GiB")
    assert 1 / 1.5 < peak / planned < 1.5, (peak, planned)
