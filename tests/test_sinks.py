"""Attention sinks (GPT-OSS's `self_attn.sinks` [H]) on every attention path equal transformers' eager GptOss attention.

Pins, with random non-zero sinks (one per head, some large), float64 unless said, GQA 8/2:
- `parallel.kernels.attention(..., sinks=)` (the one-process cores: whole rows, sliding-window tiles, one call per
  document) and the model's default core `model.attention.SDPAAttention`: out and dQ, dK, dV equal transformers'
  `eager_attention_forward` of models/gpt_oss (its sink column concatenated to the logits) with the mask written out
  (causal, same document, inside the window), at 1e-10; float32 through torch's CPU flash op (the CPU backend) at
  1e-5; the ring's planned calls on one process (`ring_attention` without a group: branches' path) too;
- a row with every key masked gets out 0 and lse = the sink (`kernels.with_sinks`), never NaN;
- --tiled-attn (parallel/tiled_attention.py, tiles of 5 rows, a window and a document boundary inside tiles): a tiny
  float64 decoder with sinks gives the untiled (SDPAAttention) loss and every parameter gradient (at 1e-5: the tiled
  sublayer sums in another order, ~1e-8 apart in float64 without sinks too);
- context parallel, cp 2 Ulysses (each rank its heads' sinks) and ring (zigzag), and cp 4 hybrid (Ulysses 2 × ring 2),
  every rank: packed rows with and without windows, out and dQ, dK, dV gathered = the eager reference;
- a sink that requires grad is refused (frozen base weight here: its gradient is not computed).
The backward takes the sink-merged (out, lse): the mutation that saves the kernel's own (out, lse) fails the dQ/dK/dV
checks here.

Run: .venv/bin/python -m pytest -q tests/test_sinks.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from model.attention import SDPAAttention
from parallel import kernels, masks
from parallel.cp import KernelAttention, gather_sequence, shard_sequence
from parallel.ring import ring_attention
from tests.dist import run_ranks
from tests.helpers import cp_layouts

TOL = dict(atol=1e-10, rtol=1e-10)
H, HKV, D = 8, 2, 16


def _sinks(h=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(h, generator=g, dtype=torch.float64) * 2 + torch.linspace(-3, 4, h, dtype=torch.float64))


def _keep(bounds, s, window):
    """Bool [B, S, S]: causal, same document, inside the window (transformers' sliding rule)."""
    keep = torch.zeros(len(bounds), s, s, dtype=torch.bool)
    for r, row in enumerate(bounds):
        for x, y in zip(row[:-1], row[1:]):
            keep[r, x:y, x:y] = True
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    return keep & (j <= i) & ((i - j < window) if window is not None else True)


def eager(q, k, v, sinks, bounds, window):
    """transformers' GptOss eager attention on [B, S, H, D] tensors (its module: sinks, KV groups, eval mode)."""
    mod = nn.Module()
    mod.sinks, mod.num_key_value_groups, mod.training = nn.Parameter(sinks.to(q.dtype)), q.shape[2] // k.shape[2], False
    keep = _keep(bounds, q.shape[1], window)
    bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf"))[:, None]   # [B, 1, S, S]
    t = lambda x: x.transpose(1, 2)
    return eager_attention_forward(mod, t(q), t(k), t(v), bias, scaling=q.shape[-1] ** -0.5)[0]   # [B, S, H, D]


def _inputs(b, s, dtype=torch.float64, seed=0, h=H, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, D, generator=g, dtype=dtype).requires_grad_() for n in (h, hkv, hkv))
    return q, k, v, torch.randn(b, s, h, D, generator=g, dtype=dtype)


def _grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def _compare(got, want, label, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{label} {name}: not finite"
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{label} {n}: {m}")


CASES = {"whole": ([[0, 40], [0, 40]], None), "window 7": ([[0, 40], [0, 40]], 7),
         "packed": ([[0, 1, 13, 27, 40], [0, 40]], None), "packed window 5": ([[0, 9, 30, 40], [0, 3, 40]], 5)}


@pytest.mark.parametrize("case", CASES)
def test_one_process_cores_match_transformers_eager(case):
    bounds, window = CASES[case]
    q, k, v, dout = _inputs(len(bounds), bounds[0][-1])
    sinks = _sinks()
    want = _grads(lambda *x: eager(*x, sinks, bounds, window), q, k, v, dout)
    docs = None if all(len(r) == 2 for r in bounds) else bounds
    pos = torch.cat([torch.arange(y - x) for x, y in zip(bounds[0][:-1], bounds[0][1:])])[None]
    got = {
        "kernels float64": _grads(lambda *x: kernels.attention(*x, True, None, docs=docs, window=window, sinks=sinks),
                                  q, k, v, dout),
        "SDPAAttention": _grads(lambda *x: SDPAAttention()(*x, docs, D ** -0.5, window=window, sinks=sinks),
                                q, k, v, dout),
        "KernelAttention": _grads(lambda *x: KernelAttention()(*x, docs, D ** -0.5, window=window, sinks=sinks),
                                  q, k, v, dout)}
    if len(bounds) == 1 or bounds[0] == bounds[1]:   # the ring's planned calls on one process (branches' path)
        full = torch.stack([pos[0]] * len(bounds)) if docs else None
        meta = masks.documents(full) if docs else None
        got["ring, no group"] = _grads(lambda *x: ring_attention(*x, D ** -0.5, None, docs=meta, window=window,
                                                                 tile=6, sinks=sinks), q, k, v, dout)
    for label, g in got.items():
        _compare(g, want, f"{case} {label}", TOL)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    got32 = _grads(lambda *x: kernels.attention(*x, True, None, docs=docs, window=window, backend="cpu",
                                                sinks=sinks.float()), q32, k32, v32, dout.float())
    _compare([x.double() for x in got32], want, f"{case} float32 cpu backend", dict(atol=1e-5, rtol=1e-4))


def test_row_with_no_key_gets_zero_and_the_sink():
    q, k, v, _ = _inputs(1, 6)
    keep = torch.ones(1, 6, 6, dtype=torch.bool)
    keep[0, 2] = False   # row 2 sees nothing
    out, lse = kernels.with_sinks(*kernels.forward(q, k, v, False, 0.25, mask=keep), _sinks())
    assert torch.isfinite(out).all() and (out[0, 2] == 0).all(), "a row with no key: out 0"
    torch.testing.assert_close(lse[0, :, 2], _sinks(), msg="a row with no key: lse is the sink")


def test_sinks_that_require_grad_are_refused():
    q, k, v, _ = _inputs(1, 4)
    with pytest.raises(ValueError, match="frozen base weights"):
        kernels.attention(q, k, v, sinks=_sinks().requires_grad_())


def test_tiled_attention_with_sinks_matches_untiled(monkeypatch):
    from model.config import ModelArgs
    from model.llama import Transformer
    from parallel.tiled_attention import apply_tiled_attention
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=40, sinks=True,
                     sliding_window=6, layer_types=["sliding_attention", "full_attention"], qkv_bias=True, o_bias=True)
    ref = Transformer(args).double()
    for layer in ref.model.layers:
        layer.self_attn.sinks.copy_(_sinks(4, seed=len(layer.self_attn.sinks)) * 0.7)
        assert not layer.self_attn.sinks.requires_grad
    tiled = Transformer(args).double()
    tiled.load_state_dict(ref.state_dict())
    tiled.attention = KernelAttention()
    apply_tiled_attention(tiled, tile=5)
    ids = torch.randint(0, 50, (1, 23), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(11), torch.arange(12)])[None]   # two documents: a boundary inside a tile
    labels = ids.roll(-1, 1)
    results = []
    for model in (ref, tiled):
        loss, _ = model(ids, pos, labels=labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL, msg="tiled loss")
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-7,   # (the tiles' own order: ~1e-8
                                   msg=lambda m, n=name: f"tiled grad {n}: {m}")   # apart with no sinks too)


# --- context parallel ------------------------------------------------------------------------------------------

def _cp_ranks(rank, world, splits=((2, 1), (1, 2))):
    masks.MASK_TILE = 6   # ring blocks cut into pieces: masked pieces, merges
    done = []
    for dims, attn, impl in cp_layouts(world, splits):
        r = dist.get_rank(attn.cp_group)
        for bounds, window in ([[[0, 1, 13, 27, 40], [0, 40]], None], [[[0, 9, 30, 40], [0, 40]], 5],
                               [[[0, 40], [0, 40]], 7], [[[0, 40]], None]):
            label = f"{impl} bounds={bounds} window={window}"
            b, s = len(bounds), bounds[0][-1]
            q, k, v, dout = _inputs(b, s, seed=s + (window or 0))
            sinks = _sinks()
            want = _grads(lambda *x, w=window, bs=bounds, sk=sinks: eager(*x, sk, bs, w), q, k, v, dout)
            pos = torch.stack([torch.cat([torch.arange(y - x) for x, y in zip(row[:-1], row[1:])]) for row in bounds])
            local = [shard_sequence(x.detach(), dims, r, 0.0).requires_grad_() for x in (q, k, v)]
            meta = attn.prepare(shard_sequence(pos, dims, r, None))
            out = attn(*local, meta, D ** -0.5, window=window, sinks=sinks)
            out.backward(shard_sequence(dout, dims, r, 0.0))
            got = [gather_sequence(x, attn.cp_group, dims, s) for x in [out.detach()] + [x.grad for x in local]]
            _compare(got, want, f"rank {rank} {label}", TOL)
            done.append(label)
    return done


@pytest.mark.timeout(240)
def test_cp_ulysses_and_ring_with_sinks_match_eager_on_every_rank():
    done = run_ranks(_cp_ranks, 2)
    assert all(len(d) == 8 for d in done), done


@pytest.mark.timeout(300)
def test_hybrid_cp4_with_sinks_matches_eager_on_every_rank():
    """Ulysses 2 × ring 2: each rank's heads' sinks (its Ulysses rank's slice) merged after the ring's last merge, the
    ring's pieces regrouped into chunks (parallel.cp._pieces_to_chunks) before it."""
    done = run_ranks(_cp_ranks, 4, [(2, 2)], timeout=280)
    assert all(len(d) == 4 and all(x.startswith("hybrid") for x in d) for d in done), done

