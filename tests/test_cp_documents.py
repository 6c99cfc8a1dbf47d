"""Packed documents and sliding windows under every CP layout equal torch's masked attention.

Pins, for zigzag ring (P=2, P=4), the 2×2 hybrid (ulysses 2 × ring 2) and Ulysses (P=2, P=4): on
every rank, attention over packed rows (documents that cross shard and chunk boundaries, a row that
is one document, documents of length 1, GQA 8/2 and MQA, a length that needs padding) with and
without a sliding window (1, shorter than a chunk, spanning chunks, longer than the row) is sharded
with `shard_sequence`, run through `cp_attention`, gathered, and out, dQ, dK, dV match
`F.scaled_dot_product_attention` with an explicit boolean mask (same document, j <= i,
i - j < window) in float64 at 1e-10. A window with nothing packed takes the ring's mask path too;
with window 1 the ring calls the kernel for its diagonal block only (the rest are skipped, the P2P
traffic is unchanged, nothing hangs). A tiny float64 model with a sliding layer and a full one on
packed rows gives, under ring 2 and Ulysses 2, the one-process loss and (summed) gradients.

Run: .venv/bin/python -m pytest -q tests/test_cp_documents.py
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import kernels, masks
from parallel.cp import cp_attention, gather_sequence, shard_sequence
from parallel.mesh import ParallelDims
from tests.dist import run_ranks
from tests.helpers import cp_layouts

TOL = dict(atol=1e-10, rtol=1e-10)
TILE = 6   # ring pieces here: chunks of 16 and 8 tokens cut unevenly (6 + 6 + 4, 6 + 2)


def masked_sdpa(q, k, v, scale, bounds, window):
    """torch SDPA with the boolean mask written out: same document, causal, inside the window."""
    b, s = q.shape[:2]
    doc = torch.zeros(b, s, dtype=torch.long)
    for r, row in enumerate(bounds):
        for n, (x, y) in enumerate(zip(row[:-1], row[1:])):
            doc[r, x:y] = n
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    keep = (j <= i) & (doc[:, :, None] == doc[:, None, :])
    if window is not None:
        keep = keep & (i - j < window)
    t = lambda x: x.transpose(1, 2)
    return t(F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=keep[:, None], scale=scale,
                                            enable_gqa=True))


def positions(bounds, s):
    pos = torch.empty(len(bounds), s, dtype=torch.long)
    for r, row in enumerate(bounds):
        for x, y in zip(row[:-1], row[1:]):
            pos[r, x:y] = torch.arange(y - x) + 3 * x   # any jump starts a document, not only 0
    return pos


def check(attn, dims, heads, bounds, window, label):
    rank, group = dist.get_rank(attn.cp_group), attn.cp_group
    h, hkv, d = heads
    b, s = len(bounds), bounds[0][-1]
    g = torch.Generator().manual_seed(s * 7 + h + (window or 0))
    q, k, v = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64).requires_grad_()
               for n in (h, hkv, hkv))
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    ref = masked_sdpa(q, k, v, d ** -0.5, bounds, window)
    want = [ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout)]

    local = [shard_sequence(x.detach(), dims, rank, 0.0).requires_grad_() for x in (q, k, v)]
    meta = attn.prepare(shard_sequence(positions(bounds, s), dims, rank, None))
    out = attn(*local, meta, d ** -0.5, window=window)
    out.backward(shard_sequence(dout, dims, rank, 0.0))
    for name, ref_x, mine in zip(("out", "dq", "dk", "dv"), want, [out.detach()] + [x.grad for x in local]):
        full = gather_sequence(mine, group, dims, s)
        assert torch.isfinite(full).all(), f"{label} {name}: not finite"
        torch.testing.assert_close(full, ref_x, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")


# Rows of 64 tokens: on 4 ring ranks the 8 chunks are [0,8), [8,16), ...; on 2 ring ranks [0,16), ...
PACKED = [[0, 1, 13, 14, 15, 40, 64],   # length-1 documents (first token, 13, 14), crossings of 8/16
          [0, 64]]                      # a row that is one document
MANY = [[0, 3, 9, 10, 27, 33, 50, 51, 61]]   # 61 tokens: padded to 64, padding joins the last document
WINDOWS = [None, 1, 5, 20, 100]


def _ranks(rank, world, splits):
    """Ring blocks cut into pieces of TILE tokens (masks.MASK_TILE, 4096 in runs; the model test below and test_train
    keep it): every piece kind, merges and the summed dK/dV of several calls a step run on these 64-token rows."""
    masks.MASK_TILE = TILE
    done, shapes, plain = [], [], kernels.forward
    kernels.forward = lambda *a, f=plain, **kw: shapes.append((kw.get("mask") is not None, *a[0].shape[1:2],
                                                                *a[1].shape[1:2])) or f(*a, **kw)
    try:
        for dims, attn, impl in cp_layouts(world, splits):
            u, r = dims.ulysses, dims.ring
            first = len(shapes)
            for window in WINDOWS:
                for heads in ((8, 2, 16), (4, 1, 32)):   # GQA, MQA
                    label = f"{impl} u{u}×r{r} H,Hkv,D={heads} window={window}"
                    check(attn, dims, heads, PACKED, window, f"{label} packed")
                    done.append(f"{label} packed")
                check(attn, dims, (8, 2, 16), MANY, window, f"{label} many docs, padded")
                done.append(f"{label} many")
                if window is not None:   # one document per row: only the window masks
                    check(attn, dims, (8, 2, 16), [[0, 64], [0, 64]], window, f"{label} unpacked")
                    done.append(f"{label} unpacked")
            if r == 1:
                continue
            masked = [(n, k) for m, n, k in shapes[first:] if m]
            assert masked and max(max(x) for x in masked) <= TILE, f"{impl}: a masked call over {TILE}: {masked}"
            first = len(shapes)   # window 1: the pairs lie on the diagonal; only its pieces are called, each row once
            check(attn, dims, (8, 2, 16), PACKED, 1, f"{impl} window 1 skips")
            calls = shapes[first:]
            assert all(m and n == k <= TILE for m, n, k in calls), f"{impl}: calls (masked?, q, k) {calls}"
            assert sum(n for _, n, _ in calls) == 64 // r, f"{impl}: {calls} cover the {64 // r} local rows once"
    finally:
        kernels.forward = plain
    return done


@pytest.mark.timeout(240)
def test_documents_and_windows_two_ranks():
    done = run_ranks(_ranks, 2, [(1, 2), (2, 1)], timeout=220)
    assert done[0] == done[1]
    assert sum("ring u1×r2" in x for x in done[0]) == len(WINDOWS) * 3 + len(WINDOWS) - 1


@pytest.mark.timeout(300)
def test_documents_and_windows_four_ranks():
    done = run_ranks(_ranks, 4, [(1, 4), (2, 2), (4, 1)], timeout=280)
    assert all(d == done[0] for d in done)
    for impl in ("ring u1×r4", "hybrid u2×r2", "ulysses u4×r1"):
        assert sum(impl in x for x in done[0]) == len(WINDOWS) * 4 - 1, impl


def _model_ranks(rank, world, splits):
    """A sliding-window model (layer 0 slides, layer 1 full) on packed rows: loss and every gradient
    of the CP run (summed over ranks) equal the one-process run."""
    from model import ModelArgs, Transformer
    args = ModelArgs(model_type="mistral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     intermediate_size=48, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 45), generator=g)
    labels = torch.randint(0, 64, (2, 45), generator=g)
    labels[:, :4] = -100
    pos = positions([[0, 13, 14, 45], [0, 45]], 45)
    torch.manual_seed(0)
    ref_model = Transformer(args).double()
    ref_loss, ref_n = ref_model(ids, position_ids=pos, labels=labels)
    ref_loss.backward()
    done = []
    for u, r in splits:
        dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=r)
        meshes = dims.build_mesh("cpu")
        torch.manual_seed(0)
        m = Transformer(args, attention=cp_attention(meshes, dims)).double()
        loss, n = m(shard_sequence(ids, dims, rank, 0), position_ids=shard_sequence(pos, dims, rank, None),
                    labels=shard_sequence(labels, dims, rank, -100))
        loss.backward()
        group = meshes.cp.get_group()
        stats = torch.stack([loss.detach(), torch.as_tensor(n, dtype=torch.float64)])
        dist.all_reduce(stats, group=group)
        label = f"model u{u}×r{r}"
        torch.testing.assert_close(stats, torch.stack([ref_loss.detach(), torch.as_tensor(ref_n, dtype=torch.float64)]),
                                   rtol=1e-6, atol=1e-6, msg=lambda msg, x=label: f"{x} loss, tokens: {msg}")
        for (name, p), (_, want) in zip(m.named_parameters(), ref_model.named_parameters()):
            dist.all_reduce(p.grad, group=group)
            # loss.py sums the loss and forms its fused gradient in float32: float32 round-off
            torch.testing.assert_close(p.grad, want.grad, atol=1e-6, rtol=1e-5,
                                       msg=lambda msg, n=name, x=label: f"{x} grad {n}: {msg}")
        done.append(label)
    return done


@pytest.mark.timeout(180)
def test_sliding_window_model_cp_equals_one_process():
    done = run_ranks(_model_ranks, 2, [(1, 2), (2, 1)], timeout=160)
    assert done == [["model u1×r2", "model u2×r1"]] * 2


# Shared-prompt pairs (model.attention's branches): rows of 61 tokens (padded to 64 under CP), a branch after its
# prompt ++ chosen answer, another document between, and a second row whose branch crosses every chunk
BRANCHED = [[(0, 10, 0), (10, 20, 10), (20, 27, 10), (27, 40, 0), (40, 45, 0), (45, 52, 5), (52, 61, 5)],
            [(0, 30, 0), (30, 33, 30), (33, 61, 30)]]   # (start, end, first position)


def branched_positions(rows=BRANCHED):
    pos = torch.empty(len(rows), rows[0][-1][1], dtype=torch.long)
    for r, row in enumerate(rows):
        for x, y, p in row:
            pos[r, x:y] = torch.arange(p, p + y - x)
    return pos


def check_branched(attn, dims, heads, label, one=False, rows=BRANCHED, window=None):
    """`attn` on the branched rows (sharded, unless `one`: one process) = SDPA with `model.attention.visible`'s
    mask: out, dQ, dK, dV on every rank, float64 (`window`: one that cuts none of them)."""
    from model.attention import visible

    pos = branched_positions(rows)
    b, s = pos.shape
    h, hkv, d = heads
    g = torch.Generator().manual_seed(h + d)
    q, k, v = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64).requires_grad_() for n in (h, hkv, hkv))
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    t = lambda x: x.transpose(1, 2)
    ref = t(F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=visible(pos)[:, None], scale=d ** -0.5,
                                           enable_gqa=True))
    want = [ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout)]
    if one:
        local = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attn(*local, attn.prepare(pos), d ** -0.5, window=window)
        out.backward(dout)
        got = [out.detach()] + [x.grad for x in local]
    else:
        rank = dist.get_rank(attn.cp_group)
        local = [shard_sequence(x.detach(), dims, rank, 0.0).requires_grad_() for x in (q, k, v)]
        out = attn(*local, attn.prepare(shard_sequence(pos, dims, rank, None)), d ** -0.5, window=window)
        out.backward(shard_sequence(dout, dims, rank, 0.0))
        got = [gather_sequence(x, attn.cp_group, dims, s) for x in [out.detach()] + [x.grad for x in local]]
    for name, ref_x, mine in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(mine, ref_x, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")


def test_branched_rows_one_process():
    """The rule itself (a branch sees its parent's first p tokens, nothing of its answer) and the one-process cores:
    the model's SDPA reference and the kernels' (the ring's calls, pieces of 1 token up to whole blocks)."""
    from model.attention import SDPAAttention, document_bounds, document_branches, visible
    from parallel.cp import KernelAttention

    pos = branched_positions()
    assert document_branches(pos, document_bounds(pos)) == [[(20, 27, 0, 10), (52, 61, 40, 5)], [(33, 61, 0, 30)]]
    keep = visible(pos)
    assert keep[0, 20:27, 0:10].all() and not keep[0, 20:27, 10:20].any() and keep[0, 26, 20:27].all()
    assert not keep[0, 20:27, 27:].any() and not keep[0, 27:40, :27].any() and not keep[1, 33:, 30:33].any()
    # positions far from 0 that jump (not a branch: the document before does not start at 0) stay documents apart
    far = torch.tensor([[5, 6, 7, 8, 6, 7]])
    assert document_branches(far, document_bounds(far)) is None
    # a block of a branch's queries against its prefix is one plain call, against the answer before it none
    bounds, branches = document_bounds(pos[:1]), document_branches(pos[:1], document_bounds(pos[:1]))
    span = masks.Span
    assert masks.calls([span(0, 20, 7)], [span(0, 0, 10)], bounds, None, 64, branches) == [
        (0, 7, 0, 10, "full", 20, 0)]
    assert masks.calls([span(0, 20, 7)], [span(0, 10, 10)], bounds, None, 64, branches) == []
    keep_tile = masks.MASK_TILE
    try:
        for tile in (keep_tile, 1, 4, 6):
            masks.MASK_TILE = tile
            for heads in ((8, 2, 16), (4, 1, 32)):
                check_branched(KernelAttention(), None, heads, f"kernels tile {tile} {heads}", one=True)
        check_branched(SDPAAttention(), None, (8, 2, 16), "sdpa", one=True)
    finally:
        masks.MASK_TILE = keep_tile
    # masks.binding: a window cuts nothing when no document (a branch with its prefix) is longer; CP's padding (`pad`)
    # joins only a row's last document (review, helper 49: it was allowed on every document)
    docs = masks.documents(pos)
    assert masks.binding(57, docs) == 57 and masks.binding(58, docs) is None and masks.binding(57, docs, 1) is None
    two = masks.documents(branched_positions([[(0, 10, 0), (10, 14, 0)]]))
    assert masks.binding(9, two, 3) == 9 and masks.binding(10, two, 3) is None and masks.binding(1, two, 3) == 1
    # one row on one process (packed micro-batches, Ulysses): a causal call per document, a full call per branch's
    # prefix, exactly the visible pairs, no masked call (tiles a boundary crosses computed ~50x the visible pairs of a
    # row of short pairs: review, helper 45)
    from parallel import ring
    for r, row in enumerate(BRANCHED):
        one = branched_positions([row])
        plan = ring._plan(None, one.shape[1], masks.documents(one), None)
        assert len(plan) == 1 and all(c[4] in ("causal", "full") for c in plan[0]), plan
        pairs = sum((qe - qa) * (qe - qa + 1) // 2 if kind == "causal" else (qe - qa) * (ke - ka)
                    for qa, qe, ka, ke, kind, *_ in plan[0])
        assert pairs == int(visible(one).sum()), (r, pairs)
        check_branched(KernelAttention(), None, (8, 2, 16), f"kernels, row {r} alone", one=True, rows=[row])
    # several rows (an unpacked micro-batch) run as one row of them side by side: the exact calls too (planned
    # together they took tiles: ~3.5x the kept outputs, review helper 47); the check above ran both rows that way
    from parallel.cp import _one_row
    flat = _one_row(masks.documents(pos), pos.shape[1])
    plan = ring._plan(None, pos.numel(), flat, None)
    assert len(plan) == 1 and all(c[4] in ("causal", "full") for c in plan[0]), plan
    pairs = sum((qe - qa) * (qe - qa + 1) // 2 if kind == "causal" else (qe - qa) * (ke - ka)
                for qa, qe, ka, ke, kind, *_ in plan[0])
    assert pairs == int(visible(pos).sum()), pairs
    made, plan_of = [], ring._plan
    ring._plan = lambda *a, **k: made.append(plan_of(*a, **k)) or made[-1]
    try:
        check_branched(KernelAttention(), None, (8, 2, 16), "kernels, two rows as one", one=True)
    finally:
        ring._plan = plan_of
    assert made and all(len(p) == 1 and c[4] in ("causal", "full") for p in made for c in p[0]), made


def _branched_ranks(rank, world, splits):
    masks.MASK_TILE = TILE
    done = []
    for dims, attn, impl in cp_layouts(world, splits):
        for heads in ((8, 2, 16), (4, 1, 32)):
            label = f"{impl} u{dims.ulysses}×r{dims.ring} {heads}"
            check_branched(attn, dims, heads, label)
            done.append(label)
        check_branched(attn, dims, (4, 1, 32), f"{impl} u{dims.ulysses}×r{dims.ring}, one row", rows=BRANCHED[:1])
        # a window one token shorter than the last document of a row with no padding (64 tokens) is refused, as on
        # one process: until 2026-12-05 CP took any padding a row might hold off that document and dropped the window
        # (review, helper 55); a caller promising no document past the window (train.py: --max-len) runs without one
        pos, rank = branched_positions([[(0, 10, 0), (10, 20, 10), (20, 27, 10), (27, 64, 0)]]), dist.get_rank(
            attn.cp_group)   # (last document: 37 tokens)
        meta = attn.prepare(shard_sequence(pos, dims, rank, None))
        q, k, v = (shard_sequence(torch.randn(1, 64, n, 32, dtype=torch.float64), dims, rank, 0.0) for n in (4, 1, 1))
        with pytest.raises(ValueError, match="a sliding window of 36 tokens, shorter than a document"):
            attn(q, k, v, meta, 32 ** -0.5, window=36)
        attn.longest = 37
        try:
            check_branched(attn, dims, (4, 1, 32), f"{impl} u{dims.ulysses}×r{dims.ring}, window 37 promised",
                           rows=[[(0, 10, 0), (10, 20, 10), (20, 27, 10), (27, 64, 0)]], window=37)
        finally:
            attn.longest = None
    return done


@pytest.mark.timeout(200)
def test_branched_rows_on_every_cp_layout():
    """Shared-prompt pairs' branches under zigzag ring (2 and 4 ranks), the 2×2 hybrid and Ulysses (2, 4): every
    rank's out, dQ, dK, dV = the one-process masked SDPA."""
    assert run_ranks(_branched_ranks, 2, [(1, 2), (2, 1)], timeout=180)[0] == [
        f"{i} {h}" for i in ("ring u1×r2", "ulysses u2×r1") for h in ((8, 2, 16), (4, 1, 32))]
    assert len(run_ranks(_branched_ranks, 4, [(1, 4), (2, 2), (4, 1)], timeout=180)[3]) == 6
