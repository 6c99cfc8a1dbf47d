"""CUDA-only check of attention sinks (GPT-OSS's `self_attn.sinks`, parallel/kernels.py `with_sinks`) through every
CUDA backend that takes the shape, never run on a GPU before this file was written (2026-12-07, a session without
one): on CPU tests/test_sinks.py pins them against transformers' eager GptOss attention; here the CUDA kernels' own
backward is handed (out', lse') with the sink merged in, which is exact only if each kernel's backward reads the lse
and out it is given (as the contract says: ring attention relies on it too).
- GPT-OSS-20B's attention shape (64 query heads, 8 KV heads, head_dim 64, bf16) at 2,048 tokens, sinks of both signs:
  a whole row, a sliding window of 128 (GPT-OSS's), and a packed row of three documents with the window; forward and
  backward through `parallel.kernels.attention(..., backend=b, sinks=s)` for each backend `kernel_choice.candidates`
  lists: out, dq, dk, dv = transformers' eager GptOss attention in float64 on the GPU, within bf16 tolerance
  (relative to the reference's norm).

Run: make test-gpu   (or python3 -m pytest -q -s tests/gpu/test_gpu_sinks.py)
"""

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: these tests need a GPU", allow_module_level=True)

from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

from parallel import kernel_choice, kernels  # noqa: E402

DEV = torch.device("cuda")
H, K, HD, S = 64, 8, 64, 2048


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _eager(q, k, v, sinks, bounds, window):
    """transformers' GptOss eager attention (float64, [B, S, H, D]) with the document and window mask written out."""
    mod = nn.Module()
    mod.sinks, mod.num_key_value_groups, mod.training = nn.Parameter(sinks.double()), H // K, False
    keep = torch.zeros(S, S, dtype=torch.bool, device=DEV)
    for a, e in zip(bounds[:-1], bounds[1:]):
        keep[a:e, a:e] = True
    i, j = torch.arange(S, device=DEV)[:, None], torch.arange(S, device=DEV)[None]
    keep &= (j <= i) & ((i - j < window) if window else True)
    bias = torch.zeros(S, S, dtype=torch.float64, device=DEV).masked_fill(~keep, float("-inf"))[None, None]
    t = lambda x: x.transpose(1, 2)
    return eager_attention_forward(mod, t(q), t(k), t(v), bias, scaling=HD ** -0.5)[0]


CASES = {"whole": ([0, S], None), "window 128": ([0, S], 128), "packed window 128": ([0, 300, 1500, S], 128)}


@pytest.mark.parametrize("case", list(CASES))
def test_sinks_through_every_cuda_backend_equal_transformers_eager(case):
    bounds, window = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(0)
    q, dout = (torch.randn(1, S, H, HD, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, S, K, HD, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(H, generator=g, device=DEV, dtype=torch.float32) * 2   # (both signs: some rows mostly sink)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = _eager(*leaves, sinks, bounds, window)
    want = [ref.detach(), *torch.autograd.grad(ref, leaves, dout.double())]
    backends = kernel_choice.candidates(q, k)
    assert backends, "no CUDA backend takes GPT-OSS's attention shape"
    for backend in backends:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = kernels.attention(*leaves, True, HD ** -0.5, docs=None if len(bounds) == 2 else [bounds],
                                window=window, backend=backend, sinks=sinks.to(q.dtype))
        out.backward(dout)
        torch.cuda.synchronize()
        for name, got, ref_x in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves], want):
            assert got.shape == ref_x.shape and torch.isfinite(got).all(), f"{backend} {name}"
            assert _rel(got, ref_x) < 2e-2, f"{backend} {case} {name}: {_rel(got, ref_x):.3g} of the reference's norm"
