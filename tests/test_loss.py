"""Pins the contract of loss.chunked_cross_entropy against torch's own F.cross_entropy.

The reference is F.cross_entropy(reduction="sum") on the full [N, V] logits in float64. Checked: the
loss sum, the target count, and the gradients w.r.t. hidden and (when trainable) the weight, for N
smaller than a chunk, not a multiple of it, chunks and whole batches with every label ignored, bf16
inputs, a non-unit upstream gradient, and that a frozen weight is never saved for backward. `dft=True` (--sft-loss
dft): against torch autograd on the full logits of softmax(z)[y].detach() * F.cross_entropy(z, y, reduction="none")
summed over targets (float64), float32 and bf16, several chunk sizes, ignored rows and chunks, per-token.

Run: .venv/bin/python -m pytest -q tests/test_loss.py
"""

import pytest
import torch
import torch.nn.functional as F

from loss import CHUNK_BYTES, auto_chunk_size, chunked_cross_entropy

D, V, IGNORE = 32, 1000, -100
UPSTREAM = 0.37  # non-unit gradient of loss_sum, as when the caller divides by a global count


def make_inputs(n, dtype=torch.float32, ignore_frac=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGNORE
    return hidden, weight, labels


def reference(hidden, weight, labels, train_weight):
    """float64 full-logits loss sum and gradients under UPSTREAM, via F.cross_entropy."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_(train_weight)
    loss = F.cross_entropy(h @ w.t(), labels, ignore_index=IGNORE, reduction="sum")
    (loss * UPSTREAM).backward()
    return loss.detach(), h.grad, (w.grad if train_weight else None)


def chunked(hidden, weight, labels, train_weight, chunk_size, hidden_grad=True):
    h = hidden.detach().clone().requires_grad_(hidden_grad)
    w = weight.detach().clone().requires_grad_(train_weight)
    loss, count = chunked_cross_entropy(h, w, labels, ignore_index=IGNORE, chunk_size=chunk_size)
    if loss.requires_grad:
        (loss * UPSTREAM).backward()
    return loss, count, h.grad, w.grad


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize(
    "n, chunk_size",
    [(5, 64), (37, 8), (64, 16), (123, None), (200, 7)],
    ids=["n<chunk", "n%chunk!=0", "n%chunk==0", "auto", "many-chunks"],
)
def test_matches_full_logits_float32(n, chunk_size, train_weight):
    hidden, weight, labels = make_inputs(n, seed=n)
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, labels, train_weight)
    loss, count, gh, gw = chunked(hidden, weight, labels, train_weight, chunk_size)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert count.item() == (labels != IGNORE).sum().item() and not count.requires_grad
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-4)
    assert gh.dtype == torch.float32
    torch.testing.assert_close(gh.double(), ref_gh, rtol=1e-4, atol=1e-5)
    if train_weight:
        assert gw.dtype == torch.float32
        torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-5)
    else:
        assert gw is None


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_all_ignored_chunks(train_weight):
    hidden, weight, labels = make_inputs(40, ignore_frac=0.0, seed=1)
    labels[0:16] = IGNORE  # chunks 0 and 1 fully ignored
    labels[24:32] = IGNORE  # chunk 3 fully ignored
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, labels, train_weight)
    loss, count, gh, gw = chunked(hidden, weight, labels, train_weight, chunk_size=8)
    assert count.item() == 16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gh.double(), ref_gh, rtol=1e-4, atol=1e-5)
    assert torch.equal(gh[0:16], torch.zeros_like(gh[0:16])), "ignored rows must get exactly 0 grad"
    if train_weight:
        torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_no_target_at_all(train_weight, dtype):
    hidden, weight, labels = make_inputs(30, dtype=dtype, seed=2)
    labels[:] = IGNORE
    loss, count, gh, gw = chunked(hidden, weight, labels, train_weight, chunk_size=8)
    assert count.item() == 0
    assert loss.item() == 0.0 and torch.isfinite(loss)
    assert gh.dtype == dtype and torch.equal(gh, torch.zeros_like(gh))
    if train_weight:
        assert gw.dtype == dtype and torch.equal(gw, torch.zeros_like(gw))


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_bf16_inputs(train_weight):
    # Reference in float64 on the same bf16 values. The chunk's logits come out of a bf16 GEMM and the
    # returned grads are bf16, so elementwise closeness is ~2^-8 relative at best. Tolerance: loss sum
    # within 1e-3 relative, grads within 1e-2 relative (L2 norm), and no worse than 1.25x the error of
    # the usual bf16 path (bf16 logits upcast to float32, F.cross_entropy, autograd). Seen: ~4e-3.
    hidden, weight, labels = make_inputs(50, dtype=torch.bfloat16, seed=3)
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, labels, train_weight)
    loss, count, gh, gw = chunked(hidden, weight, labels, train_weight, chunk_size=16)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(train_weight)
    naive = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE, reduction="sum")
    (naive * UPSTREAM).backward()

    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-3, atol=0.0)
    assert gh.dtype == torch.bfloat16
    assert rel_err(gh, ref_gh) < min(1e-2, 1.25 * rel_err(h.grad, ref_gh))
    if train_weight:
        assert gw.dtype == torch.bfloat16
        assert rel_err(gw, ref_gw) < min(1e-2, 1.25 * rel_err(w.grad, ref_gw))


def test_bf16_weight_gradient_is_rounded_once_not_per_chunk():
    """A trainable bf16 weight (a tied embedding trained through the head) over 400 one-row chunks: its gradient sums
    in float32 and is rounded once, as torch's one full-logits GEMM rounds it, so it is as close to the float64
    reference as autograd's (a bf16 running sum, rounded per chunk, lands several times further off)."""
    hidden, weight, labels = make_inputs(400, dtype=torch.bfloat16, ignore_frac=0.0, seed=5)
    _, _, ref_gw = reference(hidden, weight, labels, train_weight=True)
    _, _, _, gw = chunked(hidden, weight, labels, train_weight=True, chunk_size=1)
    w = weight.clone().requires_grad_()
    naive = F.cross_entropy((hidden @ w.t()).float(), labels, ignore_index=IGNORE, reduction="sum")
    (naive * UPSTREAM).backward()
    assert gw.dtype == torch.bfloat16
    assert rel_err(gw, ref_gw) < 1.25 * rel_err(w.grad, ref_gw), (rel_err(gw, ref_gw), rel_err(w.grad, ref_gw))


def test_hidden_without_grad():
    hidden, weight, labels = make_inputs(20, seed=4)
    ref_loss, _, ref_gw = reference(hidden, weight, labels, train_weight=True)
    loss, _, gh, gw = chunked(hidden, weight, labels, train_weight=True, chunk_size=6, hidden_grad=False)
    assert gh is None
    torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-5)
    # Nothing requires grad: plain forward, same loss, no graph.
    loss2, _, _, _ = chunked(hidden, weight, labels, train_weight=False, chunk_size=6, hidden_grad=False)
    assert not loss2.requires_grad
    torch.testing.assert_close(loss2.double(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss2, loss.detach(), rtol=0, atol=0)


def test_no_grad_mode_forward_only():
    hidden, weight, labels = make_inputs(20, seed=5)
    ref_loss, _, _ = reference(hidden, weight, labels, train_weight=False)
    h = hidden.clone().requires_grad_()
    with torch.no_grad():
        loss, count = chunked_cross_entropy(h, weight, labels, chunk_size=6)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-4)


def _saved_tensor_ptrs(fn):
    ptrs = []

    def pack(t):
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return ptrs


def test_frozen_weight_not_saved_for_backward():
    hidden, weight, labels = make_inputs(24, seed=6)
    h = hidden.clone().requires_grad_()
    wptr = weight.untyped_storage().data_ptr()
    # Positive control: the naive path does save the weight, so the hook can see it.
    naive = _saved_tensor_ptrs(lambda: F.cross_entropy(h @ weight.t(), labels, reduction="sum"))
    assert wptr in naive
    saved = _saved_tensor_ptrs(lambda: chunked_cross_entropy(h, weight, labels, chunk_size=8))
    assert wptr not in saved
    assert len(saved) == 1, "frozen weight: only grad_hidden is kept for backward"


def test_backward_twice_is_an_error():
    # Backward scales the stored grads in place, so a retained graph must refuse a second pass.
    hidden, weight, labels = make_inputs(10, seed=7)
    h = hidden.clone().requires_grad_()
    loss, _ = chunked_cross_entropy(h, weight, labels, chunk_size=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through one forward.*run the forward again"):
        loss.backward()


def test_auto_chunk_size_and_validation():
    qwen_v = 151_936
    assert auto_chunk_size(32_768, qwen_v) == CHUNK_BYTES // (4 * qwen_v)
    assert auto_chunk_size(32_768, qwen_v) * qwen_v * 4 <= CHUNK_BYTES
    assert auto_chunk_size(3, qwen_v) == 3
    assert auto_chunk_size(100, 10**12) == 1
    hidden, weight, labels = make_inputs(4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(hidden, weight, labels[:3])


# --- a custom loss_fn rides the same chunks (autograd per chunk, no hand-written gradient) ---------

def label_smoothing(logits, labels):
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum", label_smoothing=0.1)


def z_loss(logits, labels):
    keep = labels != IGNORE
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return ce + 1e-2 * torch.where(keep, torch.logsumexp(logits, -1) ** 2, 0.0).sum()


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("loss_fn", [label_smoothing, z_loss], ids=["label_smoothing", "z_loss"])
def test_custom_loss_fn_matches_full_logits_float64(loss_fn, train_weight):
    # Reference: the same loss_fn on the full [N, V] logits in float64, differentiated by autograd.
    hidden, weight, labels = make_inputs(45, seed=11)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_(train_weight)
    ref = loss_fn(h64 @ w64.t(), labels)
    (ref * UPSTREAM).backward()

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(train_weight)
    loss, count = chunked_cross_entropy(h, w, labels, chunk_size=8, loss_fn=loss_fn)
    (loss * UPSTREAM).backward()
    assert count.item() == (labels != IGNORE).sum().item()
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-5, "loss"
    assert rel(h.grad, h64.grad) < 1e-5, "grad hidden"
    if train_weight:
        assert rel(w.grad, w64.grad) < 1e-5, "grad weight"
    else:
        assert w.grad is None
    # The custom path differs from plain cross-entropy (the test would catch loss_fn being ignored).
    plain, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert abs(plain.item() - loss.item()) > 1e-3 * abs(loss.item())


def test_custom_loss_fn_sees_chunks_and_ignore_index():
    hidden, weight, labels = make_inputs(20, seed=12)
    seen = []

    def spy(logits, lab):
        seen.append((tuple(logits.shape), logits.dtype, lab.clone()))
        return F.cross_entropy(logits, lab, ignore_index=IGNORE, reduction="sum")

    loss, _ = chunked_cross_entropy(hidden.requires_grad_(), weight, labels, chunk_size=8, loss_fn=spy)
    assert [s[0] for s in seen] == [(8, V), (8, V), (4, V)] and all(s[1] == torch.float32 for s in seen)
    assert torch.equal(torch.cat([s[2] for s in seen]), labels), "labels arrive unchanged, ignored rows included"
    fused, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    torch.testing.assert_close(loss, fused, rtol=1e-6, atol=1e-5)


def test_custom_loss_fn_must_return_a_scalar():
    hidden, weight, labels = make_inputs(10, seed=13)
    per_token = lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE, reduction="none")
    with pytest.raises(ValueError, match="scalar"):
        chunked_cross_entropy(hidden.requires_grad_(), weight, labels, chunk_size=4, loss_fn=per_token)


def test_custom_loss_fn_frozen_weight_not_saved():
    hidden, weight, labels = make_inputs(24, seed=14)
    h = hidden.clone().requires_grad_()
    out = []
    saved = _saved_tensor_ptrs(lambda: out.append(chunked_cross_entropy(h, weight, labels, chunk_size=8,
                                                                        loss_fn=label_smoothing)[0]))
    assert weight.untyped_storage().data_ptr() not in saved   # not even inside the per-chunk graphs
    kept = [t for t in out[0].grad_fn.saved_tensors if t is not None]
    assert len(kept) == 1 and kept[0].shape == h.shape, "frozen weight: only grad_hidden is kept for backward"



@pytest.mark.parametrize("custom", [False, True], ids=["fused", "loss_fn"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_hits_count_the_targets_whose_logit_is_the_rows_largest(custom, grad):
    """`hits` (token accuracy's numerator) = the count of target rows where the full logits' argmax (torch's) is the
    target, over chunks that do not divide N, ignored rows and an all-ignored chunk; it leaves the loss and the
    gradients as they were, on the fused path and with a loss_fn, with and without grad. A [N] `hits` gets each row's
    1 or 0 by the same rule: torch's argmax == label on exactly the target rows (--eval-positions' accuracy by
    position, review, helper 109). A floating `hits` is refused: FSDP2's mixed precision hands forward a bf16 copy
    of it, whose count the caller never saw (review, helper 98); so is one of another shape, naming both."""
    hidden, weight, labels = make_inputs(53)
    labels[14:21] = IGNORE   # (chunk 2 of 7 rows: all ignored)
    hidden[:20] = weight[labels[:20].clamp(min=0)] * 3   # (20 rows made right, so the count is not ~0 at V=1000)
    want = ((hidden @ weight.t()).argmax(1) == labels)[labels != IGNORE].sum()
    assert 5 < int(want) < int((labels != IGNORE).sum()), int(want)
    fn = (lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE, reduction="sum")) if custom else None
    outs = []
    count, each = torch.zeros((), dtype=torch.int64), torch.ones(53, dtype=torch.int64)   # (each: added to, not set)
    for hits in (None, count, each):
        h = hidden.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss, n = chunked_cross_entropy(h, weight, labels, chunk_size=7, loss_fn=fn, hits=hits)
        if grad:
            loss.backward()
        outs.append((loss.detach(), h.grad))
    assert int(count) == int(want) and count.dtype == torch.int64, (count, want)
    right = ((hidden @ weight.t()).argmax(1) == labels) & (labels != IGNORE)
    assert torch.equal(each - 1, right.long()), (each - 1, right)
    for out in outs[1:]:
        torch.testing.assert_close(out[0], outs[0][0], rtol=0, atol=0)
        if grad:
            torch.testing.assert_close(out[1], outs[0][1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"hits must be an integer tensor \(torch.int64\), got torch.bfloat16"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=7, hits=torch.zeros((), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"hits must be 0-dim \(the count\) or shaped as labels \(53,\).*got \(52,\)"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=7, hits=torch.zeros(52, dtype=torch.int64))


# --- dft=True (--sft-loss dft): each target's loss and gradient × its own detached probability -----------------

def dft_inputs(n, dtype=torch.float32, seed=0):
    """make_inputs with a third of the rows made likely (hidden near 3 × the target's weight row), so the targets'
    probabilities span ~1e-6 to ~1 (at V=1000 random ones are all ~1e-3: a weighting by them would be near-uniform),
    ignored rows included, and rows 8-15 all ignored (a whole chunk at chunk sizes 8 and 4)."""
    hidden, weight, labels = make_inputs(n, ignore_frac=0.2, seed=seed)
    sure = torch.arange(n) % 3 == 0
    hidden[sure] = weight[labels[sure].clamp(min=0)] * 3 + 0.3 * hidden[sure]
    labels[8:16] = IGNORE
    return hidden.to(dtype), weight.to(dtype), labels


def dft_reference(hidden, weight, labels, train_weight, upstream=UPSTREAM):
    """torch autograd in float64 on the full logits: sum over targets of softmax(z)[y].detach() * cross_entropy(z, y);
    `upstream` a scalar or a per-row [N] factor (per_token)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_(train_weight)
    z, keep = h @ w.t(), labels != IGNORE
    p = F.softmax(z, -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1).detach()
    rows = torch.where(keep, p * F.cross_entropy(z, labels, ignore_index=IGNORE, reduction="none"), 0.0)
    (rows * upstream).sum().backward()
    return rows.detach(), h.grad, (w.grad if train_weight else None), p[keep]


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("n, chunk_size", [(5, 64), (37, 8), (123, None), (200, 7), (64, 4)],
                         ids=["n<chunk", "n%chunk!=0", "auto", "many-chunks", "ignored-chunks"])
def test_dft_matches_torch_autograd_float32(n, chunk_size, train_weight):
    """The loss sum, the target count, and the hidden's and (trainable) weight's gradients = torch autograd on the
    full logits (float64) with the probability detached; differs from plain cross-entropy; `hits` unchanged."""
    hidden, weight, labels = dft_inputs(n, seed=n)
    rows, ref_gh, ref_gw, p = dft_reference(hidden, weight, labels, train_weight)
    if n > 30:   # (the weighting matters: some targets near 1, some far below)
        assert p.max() > 0.5 and p.min() < 1e-3, (p.max(), p.min())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    hits = torch.zeros((), dtype=torch.int64)
    loss, count = chunked_cross_entropy(h, w, labels, chunk_size=chunk_size, dft=True, hits=hits)
    (loss * UPSTREAM).backward()
    assert count.item() == (labels != IGNORE).sum().item() and loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), rows.sum(), rtol=1e-5, atol=1e-5, msg="dft loss")
    torch.testing.assert_close(h.grad.double(), ref_gh, rtol=1e-4, atol=1e-6, msg="dft grad hidden")
    if train_weight:
        torch.testing.assert_close(w.grad.double(), ref_gw, rtol=1e-4, atol=1e-6, msg="dft grad weight")
    else:
        assert w.grad is None
    assert torch.equal(h.grad[8:16], torch.zeros_like(h.grad[8:16])), "ignored rows: exactly 0 gradient"
    ce_hits = torch.zeros((), dtype=torch.int64)
    ce, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, hits=ce_hits)
    assert int(hits) == int(ce_hits), "token accuracy's count: the same as cross-entropy's"
    assert ce.item() > loss.item() * 1.05, (ce.item(), loss.item())   # (the weighting is on)


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_dft_bf16_weights(train_weight):
    """bf16 hidden and weight: as close to torch autograd in float64 on the same bf16 values as the usual bf16 path
    (bf16 logits upcast, then the same formula in autograd) is, within 1.25× its error (loss and gradients; seen: the
    loss 2e-3 relative, both paths, from the bf16 logits of targets made likely, ~24), and within 3e-2 at most."""
    hidden, weight, labels = dft_inputs(50, dtype=torch.bfloat16, seed=3)
    rows, ref_gh, ref_gw, _ = dft_reference(hidden, weight, labels, train_weight)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    loss, _ = chunked_cross_entropy(h, w, labels, chunk_size=16, dft=True)
    (loss * UPSTREAM).backward()
    nh, nw = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    z = (nh @ nw.t()).float()
    p = F.softmax(z, -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1).detach()
    naive = (p * F.cross_entropy(z, labels, ignore_index=IGNORE, reduction="none")).sum()
    (naive * UPSTREAM).backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    off, naive_off = abs(loss.item() - rows.sum().item()), abs(naive.item() - rows.sum().item())
    assert off <= min(3e-2 * rows.sum().item(), 1.25 * naive_off + 1e-6), ("dft loss, bf16", off, naive_off)
    assert rel_err(h.grad, ref_gh) < min(3e-2, 1.25 * rel_err(nh.grad, ref_gh)), "dft grad hidden, bf16"
    if train_weight:
        assert w.grad.dtype == torch.bfloat16
        assert rel_err(w.grad, ref_gw) < min(3e-2, 1.25 * rel_err(nw.grad, ref_gw)), "dft grad weight, bf16"


def test_dft_per_token():
    """per_token (a frozen weight): each row's DFT loss (0 on ignored rows), and each row's gradient scaled by its own
    incoming factor = torch autograd (float64) with a per-row upstream."""
    hidden, weight, labels = dft_inputs(41, seed=9)
    up = torch.linspace(0.2, 1.7, 41)
    rows, ref_gh, _, _ = dft_reference(hidden, weight, labels, False, upstream=up.double())
    h = hidden.clone().requires_grad_()
    losses, _ = chunked_cross_entropy(h, weight, labels, chunk_size=6, dft=True, per_token=True)
    (losses * up).sum().backward()
    assert losses.shape == (41,)
    torch.testing.assert_close(losses.double(), rows, rtol=1e-5, atol=1e-6, msg="dft per-token losses")
    torch.testing.assert_close(h.grad.double(), ref_gh, rtol=1e-4, atol=1e-6, msg="dft per-token grad hidden")


def test_dft_with_a_loss_fn_is_refused():
    hidden, weight, labels = make_inputs(10, seed=15)
    with pytest.raises(ValueError, match="dft scales the fused cross-entropy; a loss_fn computes its own loss"):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=4, dft=True, loss_fn=label_smoothing)
