"""Pins `chunked_cross_entropy(..., softcap=c)`: every path is of the capped logits u = c·tanh(z / c) (Gemma 2/4's
final_logit_softcapping, as transformers' Gemma4ForCausalLM computes them before its loss), gradients through the cap.

The reference is torch on the full [N, V] logits in float64, differentiated by autograd: F.cross_entropy on
c * torch.tanh(z / c) (the loss sum, per-token losses under a per-row upstream, the hidden's and a trainable weight's
gradients), the DFT formula softmax(u)[y].detach() * F.cross_entropy(u, y) on the capped logits, and a label-smoothing
loss_fn (F.cross_entropy(label_smoothing=0.1)); chunk sizes 1, one that does not divide N, auto, ignored rows and a
wholly ignored chunk; bf16 within 1.25x the error of the usual bf16 path. `hits` counts on the capped float32 logits:
torch's argmax of the float64 capped logits, and a tie where the target and a larger logit both saturate (float32
tanh rounds to 1) counts. softcap=None is the uncapped loss unchanged; a bad softcap is refused naming its value.

Run: .venv/bin/python -m pytest -q tests/test_loss_softcap.py
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import loss as loss_mod
from loss import chunked_cross_entropy

D, V, IGNORE = 32, 1000, -100
CAP = 4.0          # small against these logits (|z| up to ~30), so the cap bends most rows and saturates some
UPSTREAM = 0.37    # non-unit gradient of loss_sum, as when the caller divides by a global count


def inputs(n, dtype=torch.float32, seed=0, scale=1.0):
    """Random rows, a third made likely (hidden near 3 × the target's weight row: z_target ~ 24, z / CAP ~ 6, in the
    tanh's tail), a fifth ignored, and rows 8-15 all ignored (a whole chunk at chunk sizes 8, 4 and 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g) * 1.5
    weight = torch.randn(V, D, generator=g) * 0.5
    labels = torch.randint(0, V, (n,), generator=g)
    sure = torch.arange(n) % 3 == 0
    hidden[sure] = weight[labels[sure]] * 3 + 0.3 * hidden[sure]
    labels[torch.rand(n, generator=g) < 0.2] = IGNORE
    labels[8:16] = IGNORE
    return (hidden * scale).to(dtype), weight.to(dtype), labels


def capped(z, c):
    return c * torch.tanh(z / c)


def reference(hidden, weight, labels, c, train_weight, loss=None, upstream=UPSTREAM):
    """float64 full logits, capped, `loss(u, labels)` (default: per-row cross-entropy, 0 on ignored rows); autograd
    under `upstream` (a scalar, or per-row [N]); returns (per-row losses or the scalar, grad hidden, grad weight)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_(train_weight)
    u = capped(h @ w.t(), c)
    out = (loss or (lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE, reduction="none")))(u, labels)
    (out * upstream).sum().backward()
    return out.detach(), h.grad, (w.grad if train_weight else None)


def ours(hidden, weight, labels, train_weight, upstream=UPSTREAM, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    out, count = chunked_cross_entropy(h, w, labels, ignore_index=IGNORE, **kw)
    (out * upstream).sum().backward()
    return out.detach(), count, h.grad, w.grad


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("n, chunk_size, c, scale", [(5, 64, CAP, 1.0), (37, 8, CAP, 1.0), (37, 1, CAP, 1.0),
                                                     (123, None, CAP, 1.0), (200, 7, CAP, 1.0), (64, 16, 30.0, 7.5)],
                         ids=["n<chunk", "n%chunk!=0", "chunk1", "auto", "many-chunks", "gemma-cap30"])
def test_softcap_cross_entropy_matches_torch_float64(n, chunk_size, c, scale, train_weight):
    """Loss sum (with grad and without), target count, the hidden's and (trainable) weight's gradients =
    F.cross_entropy on c·tanh(z / c) in float64 by autograd; ignored rows get exactly 0; the cap matters here (the
    uncapped loss is far off)."""
    hidden, weight, labels = inputs(n, seed=n, scale=scale)
    rows, ref_gh, ref_gw = reference(hidden, weight, labels, c, train_weight)
    loss, count, gh, gw = ours(hidden, weight, labels, train_weight, chunk_size=chunk_size, softcap=c)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and gh.dtype == torch.float32
    assert count.item() == (labels != IGNORE).sum().item() and not count.requires_grad
    torch.testing.assert_close(loss.double(), rows.sum(), rtol=1e-5, atol=1e-4, msg="capped loss sum")
    with torch.no_grad():   # (no gradient: the cap is made in place, no tanh block)
        loss_ng, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, softcap=c)
    torch.testing.assert_close(loss_ng.double(), rows.sum(), rtol=1e-5, atol=1e-4, msg="capped loss sum, no_grad")
    torch.testing.assert_close(gh.double(), ref_gh, rtol=1e-4, atol=1e-5, msg="capped grad hidden")
    if train_weight:
        torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-5, msg="capped grad weight")
    else:
        assert gw is None
    if n > 16:
        assert torch.equal(gh[8:16], torch.zeros_like(gh[8:16])), "ignored rows: exactly 0 gradient"
        plain, _, plain_gh, _ = ours(hidden, weight, labels, False, chunk_size=chunk_size)
        assert abs(plain.item() - loss.item()) > 0.05 * loss.item(), "the cap changes the loss"
        assert rel_err(plain_gh, ref_gh) > 0.05, "the cap changes the gradient"


def test_softcap_per_token():
    """per_token (DPO's per-row losses, a frozen weight): each row's capped cross-entropy, 0 on ignored rows, and each
    row's gradient scaled by its own incoming factor = torch autograd in float64 with that per-row upstream."""
    hidden, weight, labels = inputs(41, seed=9)
    up = torch.linspace(0.2, 1.7, 41)
    rows, ref_gh, _ = reference(hidden, weight, labels, CAP, False, upstream=up.double())
    losses, _, gh, _ = ours(hidden, weight, labels, False, upstream=up, chunk_size=6, per_token=True, softcap=CAP)
    assert losses.shape == (41,)
    torch.testing.assert_close(losses.double(), rows, rtol=1e-5, atol=1e-6, msg="capped per-token losses")
    torch.testing.assert_close(gh.double(), ref_gh, rtol=1e-4, atol=1e-5, msg="capped per-token grad hidden")


def dft_rows(u, y):
    """Dynamic Fine-Tuning on the capped logits: each target's cross-entropy × its probability held constant."""
    p = F.softmax(u, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1).detach()
    return torch.where(y != IGNORE, p * F.cross_entropy(u, y, ignore_index=IGNORE, reduction="none"), 0.0)


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("n, chunk_size", [(37, 8), (30, 1), (123, None)], ids=["n%chunk!=0", "chunk1", "auto"])
def test_softcap_dft_matches_the_formula_on_capped_logits(n, chunk_size, train_weight):
    hidden, weight, labels = inputs(n, seed=n + 1)
    rows, ref_gh, ref_gw = reference(hidden, weight, labels, CAP, train_weight, loss=dft_rows)
    loss, _, gh, gw = ours(hidden, weight, labels, train_weight, chunk_size=chunk_size, dft=True, softcap=CAP)
    torch.testing.assert_close(loss.double(), rows.sum(), rtol=1e-5, atol=1e-5, msg="capped dft loss")
    torch.testing.assert_close(gh.double(), ref_gh, rtol=1e-4, atol=1e-6, msg="capped dft grad hidden")
    if train_weight:
        torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-6, msg="capped dft grad weight")
    ce, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, softcap=CAP)
    assert ce.item() > loss.item() * 1.05, (ce.item(), loss.item())   # (the weighting is on)


def label_smoothing(logits, labels):
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum", label_smoothing=0.1)


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("chunk_size", [8, 1, 11], ids=["chunk8", "chunk1", "n%chunk!=0"])
def test_softcap_loss_fn_sees_the_capped_logits(chunk_size, train_weight):
    """A loss_fn gets the capped float32 logits (|u| <= c) and autograd's chunk-local gradient w.r.t. them goes through
    the cap: label smoothing = the same F.cross_entropy(label_smoothing=0.1) on float64 capped full logits."""
    hidden, weight, labels = inputs(45, seed=11)
    ref, ref_gh, ref_gw = reference(hidden, weight, labels, CAP, train_weight, loss=label_smoothing)
    seen = []

    def spy(z, y):
        seen.append(z.detach().abs().max().item())
        return label_smoothing(z, y)

    loss, _, gh, gw = ours(hidden, weight, labels, train_weight, chunk_size=chunk_size, loss_fn=spy, softcap=CAP)
    assert max(seen) <= CAP and max(seen) > 0.99 * CAP, max(seen)
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-5, "capped loss_fn loss"
    assert rel_err(gh, ref_gh) < 1e-5, "capped loss_fn grad hidden"
    if train_weight:
        assert rel_err(gw, ref_gw) < 1e-5, "capped loss_fn grad weight"
    else:
        assert gw is None


@pytest.mark.parametrize("custom", [False, True], ids=["fused", "loss_fn"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_softcap_hits_count_on_the_capped_logits_ties_included(custom, grad):
    """`hits` (0-dim count and [N] rows) reads the capped float32 logits. Rows whose capped max is one logit: hit iff
    torch's argmax of the float64 capped logits is the target (tanh is monotonic: the uncapped argmax too). Rows 40-45
    are made to saturate: target z / c ~ 12.5 and another logit's ~ 15, both past float32 tanh's 1 (not float64's):
    the capped target ties with the row's largest and counts, though the other is the argmax (capped float64 or not).
    Loss and gradients unchanged by `hits`."""
    hidden, weight, labels = inputs(53, seed=5)
    labels[40:46] = torch.arange(6) * 7 + 1
    for r in range(40, 46):   # (the least-norm hidden with z_target = 50, z_other = 60)
        rows = torch.stack([weight[labels[r]], weight[labels[r] + 3]])
        hidden[r] = torch.linalg.pinv(rows) @ torch.tensor([12.5 * CAP, 15.0 * CAP])
    z = hidden.double() @ weight.double().t()
    u64, u32 = capped(z, CAP), capped(hidden @ weight.t(), CAP)
    target = labels != IGNORE
    tie = torch.zeros(53, dtype=torch.bool)
    tie[40:46] = True
    assert (u32[40:46].gather(1, labels[40:46, None]) == u32[40:46].amax(1, keepdim=True)).all()   # (float32 ties)
    assert (u64.argmax(1)[40:46] != labels[40:46]).all() and (z.argmax(1)[40:46] != labels[40:46]).all()
    want = ((u64.argmax(1) == labels) | tie) & target
    assert 5 < int(want[~tie].sum()) < int(target.sum()) - 6, int(want.sum())   # (some rows right, some wrong)
    fn = (lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE, reduction="sum")) if custom else None
    count, each = torch.zeros((), dtype=torch.int64), torch.zeros(53, dtype=torch.int64)
    outs = []
    for hits in (None, count, each):
        h = hidden.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss, _ = chunked_cross_entropy(h, weight, labels, chunk_size=7, loss_fn=fn, hits=hits, softcap=CAP)
        if grad:
            loss.backward()
        outs.append((loss.detach(), h.grad))
    assert int(count) == int(want.sum()), (int(count), int(want.sum()))
    assert torch.equal(each, want.long()), (each, want)
    for out in outs[1:]:
        assert torch.equal(out[0], outs[0][0]) and (not grad or torch.equal(out[1], outs[0][1]))


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_softcap_bf16(train_weight):
    """bf16 hidden and weight: loss and gradients as close to float64 on the same bf16 values as the usual bf16 path
    (bf16 logits upcast, capped in float32, F.cross_entropy by autograd), within 1.25x its error, and within 1e-3
    (loss) and 2e-2 (gradients, relative L2) at most; gradients come back in bf16."""
    hidden, weight, labels = inputs(50, dtype=torch.bfloat16, seed=3)
    rows, ref_gh, ref_gw = reference(hidden, weight, labels, CAP, train_weight)
    loss, _, gh, gw = ours(hidden, weight, labels, train_weight, chunk_size=16, softcap=CAP)
    nh, nw = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    naive = F.cross_entropy(capped((nh @ nw.t()).float(), CAP), labels, ignore_index=IGNORE, reduction="sum")
    (naive * UPSTREAM).backward()
    ref = rows.sum().item()
    off, naive_off = abs(loss.item() - ref), abs(naive.item() - ref)
    assert loss.dtype == torch.float32 and off <= min(1e-3 * ref, 1.25 * naive_off + 1e-6), (off, naive_off)
    assert gh.dtype == torch.bfloat16 and rel_err(gh, ref_gh) < min(2e-2, 1.25 * rel_err(nh.grad, ref_gh))
    if train_weight:
        assert gw.dtype == torch.bfloat16 and rel_err(gw, ref_gw) < min(2e-2, 1.25 * rel_err(nw.grad, ref_gw))


def test_softcap_none_is_the_uncapped_loss_and_the_cap_halves_the_auto_chunk(monkeypatch):
    """softcap=None = no softcap argument, bit for bit (loss, gradients, hits), and the uncapped chunks: with the budget
    set to 8 rows of float32 logits, a loss_fn sees chunks of 8 rows uncapped and capped without grad (one block), 4
    rows capped with grad (the tanh block beside it: the same bytes)."""
    hidden, weight, labels = inputs(21, seed=7)
    outs = []
    for kw in ({}, {"softcap": None}):
        hits = torch.zeros(21, dtype=torch.int64)
        h = hidden.clone().requires_grad_()
        loss, count = chunked_cross_entropy(h, weight, labels, chunk_size=5, hits=hits, **kw)
        loss.backward()
        outs.append((loss, count, h.grad, hits))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 8 * 4 * V)
    for softcap, grad, rows in ((None, True, 8), (CAP, False, 8), (CAP, True, 4)):
        seen = []
        fn = lambda z, y, seen=seen: (seen.append(z.shape[0]), F.cross_entropy(z, y, ignore_index=IGNORE,
                                                                                 reduction="sum"))[1]
        with torch.set_grad_enabled(grad):
            chunked_cross_entropy(hidden.clone().requires_grad_(), weight, labels, loss_fn=fn, softcap=softcap)
        assert seen == [rows] * (21 // rows) + [21 % rows], (softcap, grad, seen)


@pytest.mark.parametrize("bad", [0, 0.0, -30.0, math.inf, math.nan, True, "30", torch.tensor(30.0)])
def test_softcap_must_be_a_finite_positive_number(bad):
    hidden, weight, labels = inputs(4)
    with pytest.raises(ValueError, match=r"softcap must be None \(no cap\) or a finite number > 0 .*got " +
                       re.escape(repr(bad)) + "$"):
        chunked_cross_entropy(hidden.requires_grad_(), weight, labels, softcap=bad)
