"""Attention backend choice and run-time fallback (parallel/kernel_choice.py), on CPU with faked device facts.

Pins:
- `backend_order` (a pure function of device type, dtype, head dim, lengths, compute capability and
  what is installed): cuDNN first on sm90+ for fp16/bf16 with head_dim <= 128, never for float32,
  pre-Hopper parts or lengths = 64 mod 128 (the cuDNN SM90 backward tail-tile bug); flash-attn next
  when installed (first for packed rows, the varlen kernel); torch's op always last on CUDA;
  CPU -> "cpu"; other devices -> "reference";
- `pick_backend` / `candidates` read the facts from the tensor and the (monkeypatched) device;
- "sdpa_cuda"'s op (`backends.cuda_op`): torch's flash op for fp16/bf16 up to head_dim 256, its memory-efficient op
  for float32, a bias or a larger head (Gemma 4's full layers' 512), forward and backward: with torch's two ops
  faked on the CPU (the flash one refusing heads over 256 as CUDA's does), bf16 heads of 512 with 4 query heads
  per KV head get the efficient op with K/V expanded, and the float64 reference's numbers;
- a backend that raises a RuntimeError falls back to the next one with the same numbers as that
  one, warns once per backend and phase, and is not tried again for that shape; an explicit
  `backend=` never falls back; the last backend's error and out-of-memory errors propagate.

Run: .venv/bin/python -m pytest -q tests/test_backend_choice.py
"""

import types
import warnings

import pytest
import torch

from parallel import backends, kernel_choice, kernels

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
H200, A100 = (9, 0), (8, 0)


@pytest.mark.parametrize("args, want", [
    # (device, dtype, head_dim, sq, sk, capability, cudnn, flash_attn, varlen)
    (("cuda", BF16, 128, 32768, 32768, H200, True, False, False), ["cudnn", "sdpa_cuda"]),
    (("cuda", F16, 64, 4096, 8192, (10, 0), True, True, False), ["cudnn", "flash_attn", "sdpa_cuda"]),
    (("cuda", BF16, 128, 4096, 4096, H200, True, True, True), ["flash_attn", "cudnn", "sdpa_cuda"]),
    (("cuda", BF16, 128, 4096, 4096, A100, True, True, False), ["flash_attn", "sdpa_cuda"]),
    (("cuda", BF16, 128, 4096, 4096, A100, True, False, False), ["sdpa_cuda"]),
    (("cuda", F32, 128, 4096, 4096, H200, True, True, False), ["sdpa_cuda"]),
    (("cuda", BF16, 256, 4096, 4096, H200, True, True, False), ["flash_attn", "sdpa_cuda"]),
    (("cuda", BF16, 512, 8192, 8192, H200, True, True, True), ["sdpa_cuda"]),   # Gemma 4's full layers
    (("cuda", BF16, 100, 4096, 4096, H200, True, True, False), ["sdpa_cuda"]),
    (("cuda", BF16, 128, 4160, 4160, H200, True, False, False), ["sdpa_cuda"]),   # 4160 = 64 mod 128
    (("cuda", BF16, 128, 4096, 192, H200, True, False, False), ["sdpa_cuda"]),    # a K/V block of 64 mod 128
    (("cuda", BF16, 128, 4100, 4100, H200, True, False, False), ["cudnn", "sdpa_cuda"]),
    (("cuda", BF16, 128, 4096, 4096, H200, False, False, False), ["sdpa_cuda"]),  # cuDNN absent or off
    (("cpu", BF16, 128, 4096, 4096, (0, 0), False, False, False), ["cpu"]),
    (("mps", F32, 64, 64, 64, (0, 0), False, False, False), ["reference"]),
], ids=str)
def test_backend_order(args, want):
    assert kernel_choice.backend_order(*args) == want


def fake_q(device="cuda", dtype=BF16, shape=(1, 32768, 28, 128)):
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=shape)


def test_pick_backend_reads_device_facts(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_cudnn_usable", lambda: True)
    monkeypatch.setattr(kernel_choice, "_fa", None)
    monkeypatch.setattr(kernel_choice, "_capability", lambda dev: H200)
    assert kernel_choice.pick_backend(fake_q()) == "cudnn", "H200 bf16 head_dim 128"
    assert kernel_choice.pick_backend(fake_q(dtype=F32)) == "sdpa_cuda", "float32"
    k = fake_q(shape=(1, 8256, 4, 128))   # a K/V block of 64 mod 128 tokens
    assert kernel_choice.pick_backend(fake_q(), k) == "sdpa_cuda", "K/V length 64 mod 128"
    monkeypatch.setattr(kernel_choice, "_capability", lambda dev: A100)
    assert kernel_choice.pick_backend(fake_q()) == "sdpa_cuda", "A100 without flash-attn"
    monkeypatch.setattr(kernel_choice, "_fa", object())   # flash-attn "installed"
    assert kernel_choice.candidates(fake_q()) == ["flash_attn", "sdpa_cuda"], "A100 with flash-attn"
    monkeypatch.setattr(kernel_choice, "_capability", lambda dev: H200)
    assert kernel_choice.candidates(fake_q()) == ["cudnn", "flash_attn", "sdpa_cuda"], "H200 with flash-attn"
    assert kernel_choice.pick_backend(fake_q(), varlen=True) == "flash_attn", "packed rows: the varlen kernel"
    monkeypatch.setattr(kernel_choice, "_cudnn_usable", lambda: False)
    assert kernel_choice.pick_backend(fake_q()) == "flash_attn", "cuDNN unusable"
    assert kernel_choice.pick_backend(torch.zeros(1, 8, 2, 64)) == "cpu", "a real CPU tensor"
    assert kernel_choice.pick_backend(torch.zeros(1, 8, 2, 64, device="meta")) == "reference", "meta tensor"


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 32, 4, 64, generator=g)
    k, v = (torch.randn(1, 32, 2, 64, generator=g) for _ in range(2))
    return q, k, v


@pytest.fixture
def flaky(monkeypatch):
    """A backend "boom" ranked before "cpu" that raises like a kernel refusing a shape."""
    calls = []

    def boom(*args):
        calls.append(len(args))
        raise RuntimeError("boom: head_dim 64 is not supported by this fake kernel\nsecond line")

    monkeypatch.setitem(kernels._FORWARD, "boom", boom)
    monkeypatch.setitem(kernels._BACKWARD, "boom", boom)
    monkeypatch.setattr(kernel_choice, "candidates", lambda q, k=None, varlen=False: ["boom", "cpu"])
    monkeypatch.setattr(kernel_choice, "_refused", set())
    monkeypatch.setattr(kernel_choice, "_logged", set())
    return calls


def test_fallback_runs_next_backend_and_warns_once(flaky):
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = kernels.forward(q, k, v, True, 0.125)
        out2, lse2 = kernels.forward(q, k, v, True, 0.125)
        dout = torch.randn_like(out)
        grads = kernels.backward(dout, q, k, v, out, lse, True, 0.125)
        kernels.backward(dout, q, k, v, out, lse, True, 0.125)
    want_out, want_lse = kernels.forward(q, k, v, True, 0.125, backend="cpu")
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, msg="fallback out = cpu out")
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, msg="fallback lse = cpu lse")
    torch.testing.assert_close(out2, want_out, rtol=0, atol=0, msg="second call out")
    for name, a, b in zip("qkv", grads, kernels.backward(dout, q, k, v, out, lse, True, 0.125, backend="cpu")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"fallback d{name}")
    assert flaky == [5, 8], f"boom tried once per phase, then skipped for this shape: {flaky}"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 2, msgs
    assert "forward" in msgs[0] and "'boom'" in msgs[0] and "'cpu'" in msgs[0] and "second line" not in msgs[0]
    assert "backward" in msgs[1]
    # A new shape tries boom again (it may work there) but does not warn a second time.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.forward(q[:, :16], k[:, :16], v[:, :16], True, 0.125)
    assert flaky == [5, 8, 5] and not [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_no_fallback_when_named_or_last_or_oom(flaky, monkeypatch):
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="boom"):
        kernels.forward(q, k, v, True, 0.125, backend="boom")
    monkeypatch.setattr(kernel_choice, "candidates", lambda q, k=None, varlen=False: ["boom"])
    with pytest.raises(RuntimeError, match="boom"):
        kernels.forward(q, k, v, True, 0.125)

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(kernels._FORWARD, "boom", oom)
    monkeypatch.setattr(kernel_choice, "candidates", lambda q, k=None, varlen=False: ["boom", "cpu"])
    with pytest.raises(torch.OutOfMemoryError):
        kernels.forward(q, k, v, True, 0.125)


def test_shape_errors_are_not_swallowed(flaky):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="causal attention needs equal q/kv lengths"):
        kernels.forward(q, k[:, :8], v[:, :8], True, 0.125)
    assert flaky == [], "checked before any backend runs"


def test_like_copies_only_on_a_layout_change():
    q = torch.randn(1, 8, 4, 16)[:, 4:]               # a ring-style slice: batch stride of the parent
    out = torch.randn(1, 4, 4, 16)                    # same layout but for the size-1 batch dim
    assert backends._like(q, out) is out
    dout = torch.randn(1, 4, 16, 4).transpose(2, 3)   # [B, S, H, D] with H and D swapped in memory
    moved = backends._like(q, dout)
    assert moved is not dout and moved.stride()[1:] == q.stride()[1:]
    torch.testing.assert_close(moved, dout, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, head_dim, bias, want", [
    (BF16, 128, None, "flash"), (F16, 256, None, "flash"), (BF16, 512, None, "efficient"),
    (F16, 264, None, "efficient"), (F32, 128, None, "efficient"), (BF16, 128, torch.zeros(1), "efficient"),
], ids=str)
def test_cuda_op(dtype, head_dim, bias, want):
    assert backends.cuda_op(dtype, head_dim, bias) == want


def test_sdpa_cuda_takes_the_efficient_op_past_head_dim_256(monkeypatch):
    """backends._cuda_forward / _cuda_backward on CPU tensors with torch's CUDA ops faked: the flash op refuses a head
    over 256 (as CUDA's: "FlashAttention forward only supports head dimension at most 256"), the efficient op is
    the float64 reference on the [B, H, S, D] views it is handed, its lse padded to 32 rows as CUDA's is."""
    t, calls = backends._t, []

    def flash(q, *args, **kw):
        calls.append(("flash", q.shape[-1]))
        if q.shape[-1] > 256:
            raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
        raise AssertionError("not reached here: heads of 512 only")

    def eff_forward(q, k, v, bias, lse_too, p, causal, scale=None):
        calls.append(("efficient", k.shape[1]))
        out, lse = backends._ref_forward(t(q), t(k), t(v), causal, scale, bias)
        return t(out), torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32), value=float("nan")), None, None

    def eff_backward(dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal, scale=None):
        calls.append(("efficient backward", k.shape[1]))
        grads = backends._ref_backward(t(dout), t(q), t(k), t(v), t(out), lse[..., :q.shape[2]], causal, scale, bias)
        return (*map(t, grads), None)

    for name, fn in (("_scaled_dot_product_flash_attention", flash), ("_scaled_dot_product_flash_attention_backward",
                     flash), ("_scaled_dot_product_efficient_attention", eff_forward),
                     ("_scaled_dot_product_efficient_attention_backward", eff_backward)):
        monkeypatch.setattr(torch.ops.aten, name, fn)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 40, 8, 512, generator=g).to(BF16) for _ in range(2))
    k, v = (torch.randn(1, 40, 2, 512, generator=g).to(BF16) for _ in range(2))
    out, lse = backends._cuda_forward(q, k, v, True, 512 ** -0.5)
    want_out, want_lse = backends._ref_forward(q, k, v, True, 512 ** -0.5)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse.float(), rtol=0, atol=0)
    grads = backends._cuda_backward(dout, q, k, v, out, lse, True, 512 ** -0.5)
    for name, a, b in zip("qkv", grads, backends._ref_backward(dout, q, k, v, out, lse, True, 512 ** -0.5)):
        assert a.shape == b.shape, name
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()   # (dk, dv: the group summed in bf16
        assert rel <= (0 if name == "q" else 1e-2), f"d{name} off by {rel:.2g}"   # here, in float64 there)
    assert calls == [("efficient", 8), ("efficient backward", 8)], calls   # K/V expanded to the 8 query heads
