"""parallel/plan_linear.py's terms for Qwen3.5's linear-attention (Gated DeltaNet) blocks against the module itself.

Pins (CPU, model/deltanet.py's GatedDeltaNet with frozen weights, the input needing grad; float32 and bfloat16;
lengths below, at and past a chunk multiple, one and several chunks, 1-3 rows, as many key as value heads and half;
the core in one segment and in several, model.deltanet.SEGMENT's and shorter ones):
- `saved` = the bytes autograd keeps for backward (tests.helpers.saved_bytes: unique storages, parameters and the
  input excluded), to the byte; out_proj's LoRA A input (`lora_inputs`) with a LoRA pair on out_proj;
- `shapes`, `dense` and `dense_shapes` = the module's parameters; CHUNK, SEGMENT and GATED_CHUNK = model.deltanet's;
- `sublayer_saved` (parallel/plan.py's per-block term) in the lowest adapted block, whose input needs no grad: what
  LoRA on each set of targets needs, to the byte (none adapted: nothing; the other blocks: `saved`);
- `backward` within 0.8-1.1 of the backward's peak allocation above its start (the profiler's CPU memory events);
  within 0.97-1.05 where the gated norm's backward is the peak (short segments, wide value heads; whole and chunked).
Not checked: context parallelism's terms (cp > 1), fla's CUDA kernel, any GPU trace.

Run: .venv/bin/python -m pytest -q tests/test_plan_linear.py
"""

import functools

import pytest
import torch

from model import deltanet
from model.deltanet import GatedDeltaNet, local_linear_core
from parallel import plan_linear
from tests.helpers import saved_bytes

D, K = 32, 4


def _module(Hk, Hv, dk, dv, dtype=torch.float32):
    torch.manual_seed(0)
    return GatedDeltaNet(D, Hk, Hv, dk, dv, K, 1e-6).to(dtype).requires_grad_(False)


def test_sizes_are_the_models():
    assert (plan_linear.CHUNK, plan_linear.SEGMENT, plan_linear.GATED_CHUNK) == \
        (deltanet.CHUNK, deltanet.SEGMENT, deltanet.GATED_CHUNK)


@pytest.mark.parametrize("S,Hk,Hv,dk,dv,dtype,rows,segment", [
    (128, 2, 4, 16, 8, torch.float32, 1, None), (100, 2, 2, 8, 16, torch.float32, 1, None),
    (200, 1, 3, 8, 8, torch.float32, 2, None), (128, 2, 4, 16, 8, torch.bfloat16, 1, None),
    (77, 2, 2, 16, 8, torch.bfloat16, 1, None), (300, 2, 6, 8, 12, torch.bfloat16, 1, None),
    (64, 1, 2, 8, 16, torch.float32, 3, None), (64, 1, 2, 8, 16, torch.bfloat16, 1, None),
    (192, 2, 4, 8, 8, torch.float32, 2, None), (2100, 1, 2, 8, 8, torch.bfloat16, 1, None),
    (300, 2, 4, 16, 8, torch.float32, 2, 2), (257, 2, 2, 8, 16, torch.bfloat16, 1, 1)])
def test_saved_is_what_autograd_keeps(S, Hk, Hv, dk, dv, dtype, rows, segment):
    m = _module(Hk, Hv, dk, dv, dtype)
    x = torch.randn(rows, S, D, dtype=dtype, requires_grad=True)
    core = functools.partial(local_linear_core, segment=segment)
    _, got = saved_bytes(lambda: m(x, None, core), [*m.parameters(), x])
    e = torch.finfo(dtype).bits // 8
    assert plan_linear.saved(rows * S, rows, Hk, Hv, dk, dv, K, e, segment=segment or deltanet.SEGMENT) == got


def test_out_proj_lora_input():
    """A LoRA pair on out_proj keeps the gated norm's output (A's input, a tensor of its own) and A's output [T, r]."""
    m = _module(2, 4, 16, 8)
    a, b = torch.randn(4, 32, requires_grad=True), torch.randn(D, 4, requires_grad=True)
    base = m.out_proj.forward
    m.out_proj.forward = lambda y: base(y) + y @ a.T @ b.T
    x = torch.randn(1, 130, D, requires_grad=True)
    _, got = saved_bytes(lambda: m(x, None), [*m.parameters(), x, a, b])
    want = plan_linear.saved(130, 1, 2, 4, 16, 8, K, 4) + plan_linear.lora_inputs(["out_proj"], 130, 4, 8, 4)
    assert got == want + 4 * 130 * 4   # + A's output, B's input [T, r] (parallel/plan.py's T·r·el)


def test_weights_are_the_modules():
    m = _module(2, 4, 16, 8)
    mods = dict(m.named_modules())
    assert {n: tuple(mods[n].weight.shape) for n in plan_linear.shapes(D, 2, 4, 16, 8)} == \
        {n: s for n, s in plan_linear.shapes(D, 2, 4, 16, 8).items()}
    linears = {n + ".weight" for n in plan_linear.shapes(D, 2, 4, 16, 8)}
    assert plan_linear.dense(2, 4, 16, 8, K) == sum(p.numel() for n, p in m.named_parameters() if n not in linears)


def _backward_peak(S, Hk, Hv, dk, dv, dtype, rows, segment):
    """(the backward's peak allocation above its start, the profiler's CPU memory events; plan_linear.backward)."""
    from torch.profiler import ProfilerActivity, profile

    m = _module(Hk, Hv, dk, dv, dtype)
    x = torch.randn(rows, S, D, dtype=dtype, requires_grad=True)
    out = m(x, None, functools.partial(local_linear_core, segment=segment))
    dy = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(dy)
    cur = top = 0
    for _, n in sorted((ev.start_ns(), ev.nbytes()) for ev in prof.profiler.kineto_results.events()
                       if ev.name() == "[memory]"):
        cur += n
        top = max(top, cur)
    return top, plan_linear.backward(rows * S, rows, Hk, Hv, dk, dv, torch.finfo(dtype).bits // 8, K=K,
                                     segment=segment or deltanet.SEGMENT)


@pytest.mark.parametrize("S,Hk,Hv,dk,dv,dtype,rows,segment", [
    (256, 1, 2, 128, 128, torch.float32, 1, None), (256, 2, 2, 64, 64, torch.float32, 1, None),
    (256, 2, 4, 16, 8, torch.bfloat16, 1, None), (256, 2, 2, 8, 64, torch.bfloat16, 1, None),
    (2100, 1, 2, 128, 128, torch.float32, 1, None), (2500, 2, 2, 64, 64, torch.bfloat16, 1, None),
    (700, 2, 4, 32, 32, torch.bfloat16, 1, 4), (300, 2, 4, 16, 16, torch.float32, 2, 2)])
def test_backward_excess_near_the_measured_peak(S, Hk, Hv, dk, dv, dtype, rows, segment):
    """One segment (all 256 tokens) and several (SEGMENT's at 2,100 and 2,500 tokens; shorter ones): the core's
    gradients and one recomputed segment are the peak."""
    top, planned = _backward_peak(S, Hk, Hv, dk, dv, dtype, rows, segment)
    assert 0.8 < top / planned < 1.1, (top, planned)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", [("in_proj_qkv", "in_proj_z"), ("in_proj_b",), ("in_proj_a",), ("in_proj_z",),
                                     ("in_proj_qkv", "out_proj"), ("out_proj",), ()])
def test_first_block_keeps_what_its_targets_need(targets, dtype):
    """The lowest adapted block (Qwen3.5's layer 0: its input needs no grad) keeps only what LoRA on `targets` needs:
    `sublayer_saved(first=True)` = autograd's bytes less LoRA's own A outputs (B's inputs), which parallel/plan.py
    counts per target; the other blocks (`first=False`) = `saved` + out_proj's A input."""
    from model.linear_layers import LinearSpec

    Hk, Hv, dk, dv, T = 2, 4, 16, 8, 130
    spec = type("M", (), {"linear": LinearSpec(Hk, Hv, dk, dv, K), "dim": D})
    e = torch.finfo(dtype).bits // 8

    def adapted(lin, a, b):   # a LoRA pair on the projection: its output needs grad
        base = lin.forward
        lin.forward = lambda y: base(y) + y @ a.T @ b.T

    for first in (True, False):
        m, pairs = _module(Hk, Hv, dk, dv, dtype), []
        for name in targets:
            lin = getattr(m, name)
            pairs += [torch.randn(2, lin.in_features, dtype=dtype, requires_grad=True),
                      torch.randn(lin.out_features, 2, dtype=dtype, requires_grad=True)]
            adapted(lin, *pairs[-2:])
        x = torch.randn(1, T, D, dtype=dtype, requires_grad=not first)
        _, got = saved_bytes(functools.partial(m, x, None), [*m.parameters(), x, *pairs])
        want = plan_linear.sublayer_saved(spec, T, 1, e, 1, list(targets), first, True)
        assert got - e * T * 2 * len(targets) == want, (first, got, want)


def test_dense_shapes_are_the_modules():
    """`dense_shapes`: each never-quantized parameter's (dim 0, elements), as FSDP2 shards it; they sum to `dense`."""
    from model.linear_layers import LinearSpec

    m = _module(2, 4, 16, 8)
    spec = type("M", (), {"linear": LinearSpec(2, 4, 16, 8, K), "dim": D})
    got = sorted((p.shape[0], p.numel()) for n, p in m.named_parameters() if not n.endswith(("proj_qkv.weight",
                 "proj_z.weight", "proj_b.weight", "proj_a.weight", "out_proj.weight")))
    assert sorted(plan_linear.dense_shapes(spec)) == got
    assert sum(n for _, n in got) == plan_linear.dense(2, 4, 16, 8, K)


@pytest.mark.parametrize("S,Hv,dv,dtype,segment,chunk", [
    (2048, 2, 128, torch.bfloat16, 1, None), (2048, 2, 128, torch.float32, 1, None),
    (2048, 2, 128, torch.bfloat16, 1, 16384), (1000, 4, 64, torch.bfloat16, 2, None)])
def test_backward_gated_norm_peak(monkeypatch, S, Hv, dv, dtype, segment, chunk):
    """Short segments, wide value heads: the gated norm's backward is the peak (its input's gradient, x's and z's,
    and one chunk's float32 temporaries: the whole tensor, or 32 chunks of GATED_CHUNK 16,384)."""
    if chunk:
        monkeypatch.setattr(deltanet, "GATED_CHUNK", chunk)
        monkeypatch.setattr(plan_linear, "GATED_CHUNK", chunk)
    top, planned = _backward_peak(S, 1, Hv, 16, dv, dtype, 1, segment)
    assert 0.97 < top / planned < 1.05, (top, planned)
