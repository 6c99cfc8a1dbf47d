"""Pins the contract of loss.chunked_cross_entropy against torch's own F.cross_entropy.

The reference is F.cross_entropy(reduction="sum") on the full [N, V] logits in float64. Checked: the
loss sum, the target count, and the gradients w.r.t. hidden and (when trainable) the weight, for N
smaller than a chunk, not a multiple of it, chunks and whole batches with every label ignored, bf16
inputs, a non-unit upstream gradient, and that a frozen weight is never saved for backward.

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
