"""The Gated DeltaNet's gated norm (model/deltanet.py's GatedRMSNorm, `_GatedNormFn`) against transformers'
Qwen3_5RMSNormGated and autograd through it.

Pins (CPU; weights drawn away from transformers' init of ones; x, z at scale 3):
- outputs bitwise = transformers' module in float32 and bfloat16: dv 128 (Qwen3.5's) whole and in row chunks of 3, 8
  and 13 rows (the last one short), dv 16 whole (the CPU's reduction over a short last dim groups rows by their count:
  a 7-row chunk of dv 16 may differ from the whole tensor's in the last bit, at dv >= 64 none does);
- gradients of x, z and the weight (--train-norms) = autograd through transformers' module (bfloat16 with a bfloat16
  and a float32 weight): bfloat16 z's bitwise, x's and the weight's within one bf16 ulp and nearly all bitwise (the
  hand-derived backward rounds to bf16 where autograd's casts do; x's float32 sum before its cast is in another order:
  ~1 element in 10k a ulp off); float32 within 1e-6 relative (the rsqrt's chain rule in another order, a float32
  weight's sum over row chunks: ~1e-7 measured); float64 = autograd through the same formula kept in float64
  (transformers' upcasts to float32 only) within 1e-12, which pins the derivation itself; every subset of inputs
  needing grad;
- autograd keeps x, z and the float32 rsqrt [T·Hv] only (not the float32 x, z, silu(z) and w·normed);
- a trained (--train-norms) float32 weight on bf16 inputs computes as its bf16 cast, as the other norms;
- compiled (torch.compile of the module: the formula, compiled once) = eager within float32 rounding and keeps the
  same bytes.

Run: .venv/bin/python -m pytest -q tests/test_gated_norm.py
"""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

from model import deltanet
from model.deltanet import GatedRMSNorm, _gated_norm, _GatedNormFn
from tests.helpers import saved_bytes

EPS = 1e-6


def _pair(dv, dtype, seed=0, weight_dtype=None):
    torch.manual_seed(seed)
    ref = Qwen3_5RMSNormGated(dv, eps=EPS).to(weight_dtype or dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(dv))
    ours = GatedRMSNorm(dv, EPS).to(weight_dtype or dtype)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, z = ((3 * torch.randn(2, 13, 3, dv)).to(dtype) for _ in range(2))   # [B, S, Hv, dv]: 78 rows
    return ref, ours, x, z


def _grads(module, x, z, dout, need):
    x, z = x.clone().requires_grad_(need[0]), z.clone().requires_grad_(need[1])
    module.weight.requires_grad_(need[2])
    out = module(x, z)
    wrt = [t for t, n in zip((x, z, module.weight), need) if n]
    return out, dict(zip([i for i in range(3) if need[i]], torch.autograd.grad(out, wrt, dout)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv,rows", [(128, None), (128, 3), (128, 8), (128, 13), (16, None)])
def test_output_is_transformers_bitwise(monkeypatch, dtype, dv, rows):
    if rows:   # row chunks of `rows` (NORM_CHUNK elements each): 78 rows in 26, 10 and 6 chunks, the last one short
        monkeypatch.setattr(deltanet, "GATED_CHUNK", rows * dv)
    ref, ours, x, z = _pair(dv, dtype)
    with torch.no_grad():
        want, got = ref(x, z), ours(x, z)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("need", [(True, True, True), (True, True, False), (True, False, False), (False, True, False),
                                  (False, False, True)])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.float32)])   # (a float32 weight: w·normed's
def test_gradients_are_autograds_through_transformers(monkeypatch, dtype, weight_dtype, need):   # float32, cast back)
    monkeypatch.setattr(deltanet, "GATED_CHUNK", 8 * 128)   # 10 chunks
    ref, ours, x, z = _pair(128, dtype, seed=1, weight_dtype=weight_dtype)
    dout = torch.randn(x.shape).to(dtype)
    if weight_dtype is not None:   # (the module casts a trained float32 weight to x's dtype, as model.rmsnorm.RMSNorm:
        # the Function itself then, with transformers' float32 weight)
        ours.forward = lambda x, z: _GatedNormFn.apply(x, z, ours.weight, EPS)
    want, got = _grads(ref, x, z, dout, need), _grads(ours, x, z, dout, need)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for i in want[1]:
        assert got[1][i].dtype == want[1][i].dtype, i
        if want[1][i].dtype == torch.bfloat16:   # z's: bitwise (per element, autograd's ops); x's and the weight's
            # (a sum over dv or over rows, in float32 in another order): within one bf16 ulp, nearly all bitwise
            torch.testing.assert_close(got[1][i], want[1][i], rtol=0 if i == 1 else 2**-7, atol=0)
            assert (got[1][i] != want[1][i]).float().mean() < 0.01, ("x", "z", "weight")[i]
        else:
            torch.testing.assert_close(got[1][i], want[1][i], rtol=1e-6, atol=1e-6 * want[1][i].abs().max().item())


def test_float64_gradients_are_the_formulas():
    """transformers' module upcasts float64 to float32: the float64 reference is the same formula kept in float64."""
    _, ours, x, z = _pair(128, torch.float64, seed=2)
    dout = torch.randn(x.shape, dtype=torch.float64)
    got = _grads(ours, x, z, dout, (True, True, True))[1]
    xr, zr, w = x.clone().requires_grad_(), z.clone().requires_grad_(), ours.weight.detach().clone().requires_grad_()
    want = torch.autograd.grad(_gated_norm(xr, zr, w, EPS)[0], (xr, zr, w), dout)
    for i in range(3):
        torch.testing.assert_close(got[i], want[i], rtol=1e-12, atol=1e-12 * want[i].abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_its_inputs_and_rsqrt(monkeypatch, dtype):
    monkeypatch.setattr(deltanet, "GATED_CHUNK", 8 * 128)
    _, ours, x, z = _pair(128, dtype)
    ours.requires_grad_(False)
    x, z = x.requires_grad_(), z.requires_grad_()
    _, kept = saved_bytes(lambda: ours(x, z), [ours.weight])
    assert kept == x.nbytes + z.nbytes + 4 * x.numel() // 128   # + the float32 rsqrt, one a row


def test_compiled_is_eager():
    _, ours, x, z = _pair(32, torch.float32, seed=3)
    dout = torch.randn(x.shape)
    compiled = torch.compile(ours.forward, dynamic=True)
    need = (True, True, True)
    eager = _grads(ours, x, z, dout, need)
    forward = ours.forward
    ours.forward = compiled
    try:
        got = _grads(ours, x, z, dout, need)
        # the weight still trained, as for `got` (excluded from the bytes; frozen, dynamo would compile again)
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        _, kept = saved_bytes(lambda: ours(xs, zs), [ours.weight])
        _, kept_eager = saved_bytes(lambda: forward(xs, zs), [ours.weight])
    finally:
        ours.forward = forward
    torch.testing.assert_close(got[0], eager[0])
    for i in range(3):
        torch.testing.assert_close(got[1][i], eager[1][i], rtol=1e-5, atol=1e-5 * eager[1][i].abs().max().item())
    assert kept == kept_eager == xs.nbytes + zs.nbytes + 4 * xs.numel() // 32


def test_trained_float32_weight_computes_in_the_compute_dtype():
    """--train-norms' float32 master on bf16 inputs computes as its bf16 cast (FSDP2's mixed precision hands forward
    that cast on CUDA; model.norms.cast_weight does it where nothing did), as the other norms do."""
    _, ours, x, z = _pair(128, torch.bfloat16, seed=4, weight_dtype=torch.float32)
    with torch.no_grad():
        want = _GatedNormFn.apply(x, z, ours.weight.to(torch.bfloat16), EPS)
        assert not torch.equal(_GatedNormFn.apply(x, z, ours.weight, EPS), want)   # (the cast matters here)
    got = ours.requires_grad_(True)(x, z)
    assert torch.equal(got, want)
