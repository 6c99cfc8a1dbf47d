"""CUDA-only check of Gemma 4's full-layer attention (head_dim 512), never run on a GPU before this file was written
(2026-12-07, a session without one):
- a Gemma-4-31B full layer's attention (32 query heads, 4 KV heads, head_dim 512, bf16) at 8,192 tokens, forward and
  backward through `parallel.kernels.attention` (the choice the decoder gets: cuDNN takes heads up to 128, flash-attn
  and torch's flash op up to 256, so "sdpa_cuda" with torch's memory-efficient op, `backends.cuda_op`), one row and a
  packed row of three documents: out, dq, dk, dv = the float64 reference on the GPU within bf16 tolerance (relative
  to the reference's norm), and no backend fell back (no run-time warning).

Run: make test-gpu   (or python3 -m pytest -q -s tests/gpu/test_gpu_gemma4_attention.py)
"""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: these tests need a GPU", allow_module_level=True)

from parallel import backends, kernel_choice, kernels  # noqa: E402

DEV = torch.device("cuda")
H, K, HD, S = 32, 4, 512, 8192


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _reference(q, k, v, dout, scale, bounds):
    """out, dq, dk, dv in float64 on the GPU, one query head at a time ([S, S] of float64: 512 MiB), each document
    alone (causal inside it)."""
    q, k, v, dout = (x[0].double() for x in (q, k, v, dout))   # [S, heads, HD]
    out, dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, e in zip(bounds[:-1], bounds[1:]):
        keep = torch.ones(e - a, e - a, dtype=torch.bool, device=q.device).tril()
        for h in range(H):
            j = h // (H // K)
            qh, kh, vh, doh = q[a:e, h], k[a:e, j], v[a:e, j], dout[a:e, h]
            p = torch.softmax((qh @ kh.T * scale).masked_fill(~keep, float("-inf")), -1)
            oh = p @ vh
            dp = doh @ vh.T
            ds = p * (dp - (doh * oh).sum(-1, keepdim=True))
            out[a:e, h], dq[a:e, h] = oh, ds @ kh * scale
            dk[a:e, j] += ds.T @ qh * scale
            dv[a:e, j] += p.T @ doh
    return [x[None] for x in (out, dq, dk, dv)]


@pytest.mark.parametrize("bounds", [[0, S], [0, 1000, 5000, S]], ids=["one_document", "packed"])
def test_head_dim_512_bf16_equals_float64(bounds):
    g = torch.Generator(device=DEV).manual_seed(0)
    q, dout = (torch.randn(1, S, H, HD, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, S, K, HD, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    assert kernel_choice.candidates(q, k) == ["sdpa_cuda"] and backends.cuda_op(q.dtype, HD) == "efficient"
    scale = HD ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a backend falling back warns: fail instead
        out = kernels.attention(*leaves, True, scale, docs=None if len(bounds) == 2 else [bounds])
        out.backward(dout)
    torch.cuda.synchronize()
    ref = _reference(q, k, v, dout, scale, bounds)
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves], ref):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        assert _rel(got, want) < 2e-2, f"{name}: {_rel(got, want):.3g} of the float64 reference's norm"
