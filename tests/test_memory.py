"""The long-context memory steps (parallel/memory.py): same math, less memory.

Pins (CPU, float32, a tiny Qwen2 checkpoint made by transformers, NF4 base weights, peft LoRA with B != 0):
- the tiled MLP (uneven tiles, the default tile rule, and one tile) gives the untiled peft/bitsandbytes MLP's
  output, input gradient and every LoRA gradient;
- with --offload-activations the block inputs that torch's checkpoint saves leave its saved set (an outer
  saved_tensors_hooks that sees them with plain AC sees none of them), each is copied to host memory once,
  the device tensors are freed after forward (weak references die), block i-1's input is prefetched only
  after block i's attention backward (logged by a marker inside the attention call; prefetching at block i's
  unpack, as before, fails), and the loss and LoRA gradients equal those of plain AC and of no AC at all;
- on 4 gloo ranks (dp_shard 4; cp 2 ring × dp_shard 2), FSDP2 with the tiled MLP and offload gives the
  single-process untiled model's loss and LoRA gradients on every rank; so does --ac-group 2 (3 blocks), whose
  group recompute makes no more all-gathers than plain AC (FSDP2 keeps recomputed blocks unsharded);
- the first checkpoint keeps the token ids, not the embedding's output (no block 0 input outlives the forward,
  none is offloaded); --ac-group G on 5 blocks keeps only the other groups' inputs, recomputes in the expected
  order (a lookup taken by the inner block instead of the group pairs the group's recompute with the wrong
  saved tensors: wrong gradients, caught by the order) and equals no AC; ids overwritten before backward
  raise, an embedding output changed in place before block 0 is saved as usual (equals no AC);
- --ac-blocks 2 on 5 blocks recomputes only blocks 1 and 0, offloads only their inputs, and equals no AC;
- apply_norm_rebuild: no block norm output outlives the forward (but layer 0's first), and the loss and LoRA
  grads equal the model without the step bit for bit (no AC, tiled, AC, --ac-group, dropout); LoRA grads
  equal peft's on the transformers model of the same checkpoint (no AC; AC + tiled MLP); the tiled MLP takes
  post_attention_layernorm into its tiles (that norm's backward never runs; trainable norm weights get the
  same gradients);
- --ac-keep-attn: backward runs no attention forward (plain AC: one per recomputed block), equals no AC
  (with the tiled MLP, --ac-blocks, and packed rows on the emulated varlen op whose one-time check must stay
  out of the cache); its misuses are refused;
- the eager RMSNorm (model.llama, row chunks) holds, at bf16, its output plus one chunk of float32 temporaries
  in forward and the input gradient plus one chunk in backward (RSS high-water mark in a child process; the
  whole-tensor float32 math held ~5x and ~10x the input).

Run: .venv/bin/python -m pytest -q tests/test_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks
from tests.helpers import build_nonzero_b, step_of, tiny_checkpoint

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), inter=96)


def _opts(path, **kw):
    from parallel.parallelize import BuildOptions

    return BuildOptions(path, **{"quant": "nf4", **kw}, lora_r=4, lora_alpha=8, seed=3)


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("spare", [False, True], ids=["leaf input", "spare input"])
def test_tiled_mlp_matches_untiled(ckpt, spare):
    """The tiled MLP's output and gradients equal the untiled one's. Handed an intermediate (the decoder's h), it
    writes the input gradient into that input's own storage; a leaf input (the caller's) it leaves as it was."""
    from parallel.memory import apply_tiled_mlp

    torch.manual_seed(0)
    model, _ = build_nonzero_b(_opts(ckpt, ac=False))
    mlp = model.model.layers[1].mlp
    x0 = torch.randn(2, 23, model.args.dim)      # 46 tokens: the default rule (D = 48) gives one tile
    dy = torch.randn(2, 23, model.args.dim)

    def run(tiled=False):
        x = x0.clone().requires_grad_()
        for p in mlp.parameters():
            p.grad = None
        h = x * 1 if spare else x
        ptr, into = h.data_ptr(), []
        if spare:
            h.register_hook(lambda g: into.append(g.data_ptr() == ptr))
        y = mlp(h)
        y.backward(dy)
        assert into == ([tiled] if spare else []), into   # tiled: the gradient is h's own storage
        assert spare or torch.equal(x.detach(), x0)
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad}

    import parallel.memory as memory

    rows = []   # the row counts of [rows, D] tensors the tiled backward creates
    backward = memory._TiledMLP.backward

    def watched(ctx, dout):
        class Shapes(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == x0.shape[-1] \
                        and out.untyped_storage().data_ptr() not in ptrs:
                    rows.append(out.shape[0])
                return out
        ptrs = {t.untyped_storage().data_ptr() for t in (*ctx.saved_tensors, dout)}
        with Shapes():
            return backward(ctx, dout)

    ref = run()
    assert len(ref[2]) == 6 and all(g.abs().sum() > 0 for g in ref[2].values())
    for tile in (5, 7, 46, None):   # uneven, uneven, one tile, the rule
        apply_tiled_mlp(model, tile)
        rows.clear()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(memory._TiledMLP, "backward", staticmethod(watched))
            got = run(tiled=True)
        if tile in (5, 7):   # the input gradient: no [46, D] buffer where the input is spare, one otherwise
            assert (46 in rows) != spare, rows
        torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"tile {tile}: output")
        torch.testing.assert_close(got[1], ref[1], **TOL, msg=f"tile {tile}: input grad")
        for n in ref[2]:
            torch.testing.assert_close(got[2][n], ref[2][n], **TOL, msg=f"tile {tile}: grad {n}")
        mlp.forward = type(mlp).forward.__get__(mlp)   # untile for the next tile size


@pytest.mark.parametrize("sublayer", ["mlp", "attention"])
def test_tiles_dequantize_each_nf4_weight_once_per_call(ckpt, monkeypatch, sublayer):
    """The tiled MLP and the tiled attention dequantize each NF4 weight once per forward call and once per backward
    call (model.nf4.dequant_once), not once a tile: the MLP's 46 tokens in 10 tiles of 5, the attention's 23-row
    rows in 5 query tiles of 5 (before: bitsandbytes' per-tile calls, and one of ours per tile for the base whose
    output is only differentiated). The cache is gone after each call; outputs and gradients equal the untiled
    layers'."""
    import model.nf4 as nf4
    from parallel.memory import apply_tiled_mlp
    from parallel.tiled_attention import apply_tiled_attention

    calls = []
    real = nf4.dequantize
    monkeypatch.setattr(nf4, "dequantize", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))

    def step(tiled):
        torch.manual_seed(0)
        model, _ = build_nonzero_b(_opts(ckpt, ac=False))
        if tiled:
            (apply_tiled_mlp if sublayer == "mlp" else apply_tiled_attention)(model, 5)
        block = model.model.layers[1]
        x = torch.randn(2, 23, model.args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        cos, sin = model.rope(torch.arange(23).expand(2, 23), torch.float32)
        part = block.mlp if sublayer == "mlp" else block.self_attn
        y = part(x) if sublayer == "mlp" else part(x, cos, sin, model.attention, None)
        n_fwd = len(calls)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        assert getattr(nf4._once, "weights", None) is None, "the cache outlived its call"
        return n_fwd, len(calls) - n_fwd, y.detach(), x.grad, {k: p.grad.clone() for k, p in part.named_parameters()
                                                               if p.requires_grad}

    n = 3 if sublayer == "mlp" else 4   # gate, up, down / q, k, v, o
    untiled = step(False)
    calls.clear()
    tiled = step(True)
    assert tiled[:2] == (n, n), (tiled[:2], "dequantizations in the tiled forward, backward")
    for a, b, what in zip(tiled[2:4], untiled[2:4], ("output", "input grad")):
        torch.testing.assert_close(a, b, **TOL, msg=what)
    for k in untiled[4]:
        torch.testing.assert_close(tiled[4][k], untiled[4][k], **TOL, msg=k)


def test_tiled_mlp_with_lora_dropout_replays_the_masks(ckpt):
    """--lora-dropout draws masks in each tile's forward: backward recomputes the tiles from the same RNG state in
    the same order, so the gradients are those of the function forward computed (reference: the same tiles run
    with grad, no recompute, from the same seed; with fresh masks the LoRA grads were off by ~2x)."""
    from parallel.memory import apply_tiled_mlp

    model, _ = build_nonzero_b(_opts(ckpt, ac=False, lora_dropout=0.3))
    model.train()
    mlp = model.model.layers[1].mlp
    forward = mlp.forward
    x0 = torch.randn(2, 23, model.args.dim, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, 23, model.args.dim, generator=torch.Generator().manual_seed(2))

    def run(f):
        x = x0.clone().requires_grad_()
        for p in mlp.parameters():
            p.grad = None
        torch.manual_seed(7)
        y = f(x)
        torch.manual_seed(99)   # whatever runs between forward and backward draws too
        y.backward(dy)
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad}

    ref = run(lambda x: torch.cat([forward(x.reshape(-1, x.shape[-1])[i:i + 5]) for i in range(0, 46, 5)]).view_as(x))
    apply_tiled_mlp(model, 5)
    got = run(mlp)
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="output (the same masks)")
    torch.testing.assert_close(got[1], ref[1], **TOL, msg="input grad")
    assert len(ref[2]) == 6
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], **TOL, msg=f"grad {n}")


class _Marked(torch.autograd.Function):   # identity; its backward logs the label: the gradient got there
    log = None

    @staticmethod
    def forward(ctx, x, label):
        ctx.label = label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Marked.log.append(ctx.label)
        return g, None


def test_offload_moves_block_inputs(ckpt5, monkeypatch):
    import torch.nn.functional as F

    import parallel.offload as po

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    order = _Marked.log = []
    prefetch, sdpa = po._Offloaded.prefetch, F.scaled_dot_product_attention

    def logged(self):
        order.append(("prefetch", self.tag) if self.fetched is None else ("ready", self.tag))
        prefetch(self)
    monkeypatch.setattr(po._Offloaded, "prefetch", logged)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: sdpa(_Marked.apply(q, "attn"), *a, **kw))

    def run(**kw):
        order.clear()
        model, _ = build_nonzero_b(_opts(ckpt5, **kw))
        for block in model.model.layers:   # q_proj's output gradient: rope's backward is done, q/k/v's is next
            block.self_attn.q_proj.register_forward_hook(lambda m, a, out: _Marked.apply(out, "qproj"))
        D, L = model.args.dim, model.args.n_layers
        inputs, seen = [], []
        for i, block in enumerate(model.model.layers):
            block.register_forward_pre_hook(lambda m, a, i=i: inputs.append((i, weakref.ref(a[0]))))

        def pack(t):
            seen.append(tuple(t.shape))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s, n = model(ids, labels=ids)
        hooks = getattr(model.model.layers[0].forward, "hooks", None)
        alive = [i for i, r in inputs if r() is not None]
        if hooks is not None:
            for k, h in enumerate(_handles(hooks)):
                h.tag = k
        (s / n).backward()
        return s.detach(), _lora_grads(model), seen.count((2, 29, D)), alive, hooks, L

    ref = run(ac=False)
    ac = run(ac=True)
    off = run(ac=True, offload_activations=True)
    L = ac[5]
    # plain AC: the outer hooks see each block's input saved by its checkpoint (+ the final norm's input), but
    # block 0's: its checkpoint keeps the token ids and looks the embedding up again
    assert ac[2] == L, f"AC: [B, S, D] tensors saved outside the checkpoints: {ac[2]}"
    assert off[2] == 1, f"offload: the block inputs must leave the saved set, saw {off[2]}"
    assert off[4].moved == L - 1, f"offload: {off[4].moved} tensors copied to host, want {L - 1} (not block 0's)"
    assert ac[3] == list(range(1, L)), f"AC keeps every block input alive but the embedding's: {ac[3]}"
    assert off[3] == [], f"offload: block inputs {off[3]} still alive on the device after forward"
    # backward visits the blocks last to first (handles of blocks 1..L-1, tags 0..L-2): block b's own fetch,
    # then its attention backward ("attn"), then block b-1's prefetch, overlapping b's q/k/v backward ("qproj")
    want = [("prefetch", L - 2), "attn", ("prefetch", L - 3), "qproj"]
    want += [x for b in range(L - 2, 1, -1) for x in (("ready", b - 1), "attn", ("prefetch", b - 2), "qproj")]
    want += [("ready", 0), "attn", "qproj", "attn", "qproj"]
    assert order == want, f"fetch order {order} != {want}"
    for label, got in (("AC", ac), ("AC + offload", off)):
        torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"{label}: loss")
        for n in ref[1]:
            torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"{label}: grad {n}")


def test_offload_forgets_a_forward_dropped_without_backward(ckpt3, monkeypatch):
    """A graph-building forward whose loss is dropped (no backward) must leave nothing the next backward would
    prefetch: a prefetched handle nobody fetches is a device buffer a side-stream copy may still be writing."""
    import parallel.offload as po

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    prefetched, prefetch = [], po._Offloaded.prefetch
    monkeypatch.setattr(po._Offloaded, "prefetch", lambda self: prefetched.append(self) or prefetch(self))
    model, _ = build_nonzero_b(_opts(ckpt3, offload_activations=True))
    model(ids, labels=ids)   # dropped
    s, n = model(ids, labels=ids)
    (s / n).backward()
    hooks = model.model.layers[0].forward.hooks
    assert prefetched and all(h.used for h in prefetched), "a handle was prefetched but never fetched"
    assert hooks.pending is None and hooks.last is None
    L = model.args.n_layers   # the dropped forward's host buffers went back to the pool: no second set was made
    assert hooks.pool.made == L - 1 and len(hooks.pool.free) == L - 1, (hooks.pool.made, len(hooks.pool.free))


def test_offload_host_buffers_are_exact_and_reused(ckpt5):
    """The offload's host memory (parallel.offload.HostPool) over steps of 29, 29, 40 and 20 tokens: the L - 1
    block inputs take L - 1 buffers of exactly B x S x D x 4 bytes (the planner's host term), a second step of the
    same length makes none, a longer one replaces them (the pool then holds the new L - 1, not both sets), a shorter
    one reuses them; every step's loss and LoRA gradients equal plain AC's (a reused larger buffer, sliced). Sized
    ahead (HostOffload's reserve, what train.py takes from the plan), one set is made in step 1 and kept."""
    from parallel.offload import HostPool

    model, _ = build_nonzero_b(_opts(ckpt5, offload_activations=True))
    plain, _ = build_nonzero_b(_opts(ckpt5))
    D, L = model.args.dim, model.args.n_layers
    hooks = model.model.layers[0].forward.hooks
    made = []
    for k, S in enumerate((29, 29, 40, 20)):
        ids = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(k))
        got = [step_of(m, ids) for m in (model, plain)]
        torch.testing.assert_close(got[0][0], got[1][0], **TOL, msg=f"step {k} ({S} tokens): loss")
        for name in got[1][1]:
            torch.testing.assert_close(got[0][1][name], got[1][1][name], **TOL, msg=f"step {k}: grad {name}")
        pool = hooks.pool
        assert isinstance(pool, HostPool) and len(pool.free) == L - 1, (k, len(pool.free))   # all back after backward
        made.append(pool.made)
        biggest = max((29, 29, 40, 20)[:k + 1])
        assert pool.held == sum(b.nbytes for b in pool.free) == (L - 1) * 2 * biggest * D * 4, (k, pool.held)
    assert made == [L - 1, L - 1, 2 * (L - 1), 2 * (L - 1)], made

    # sized ahead (train.py: the plan's block input at the data's longest row): one set, all made in step 1
    floor = 2 * 40 * D * 4
    sized, _ = build_nonzero_b(_opts(ckpt5, offload_activations=True, offload_reserve=floor))
    for k, S in enumerate((20, 40, 29)):
        ids = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(k))
        got = [step_of(m, ids) for m in (sized, plain)]
        torch.testing.assert_close(got[0][0], got[1][0], **TOL, msg=f"sized, step {k}: loss")
        pool = sized.model.layers[0].forward.hooks.pool
        assert pool.made == L - 1 and pool.held == (L - 1) * floor, (k, pool.made, pool.held)


def test_host_buffer_is_registered_in_whole_pages_and_unregistered(monkeypatch):
    """On CUDA a host buffer is ordinary memory page-locked in place (torch.cuda.cudart().cudaHostRegister; a fake
    runtime and side stream here): whole pages of its own from the tensor storage's first byte (torch's is_pinned asks
    about the storage), the flag 0; dropped, it waits for the side stream before it is unregistered at the same
    address. A pool that must grow synchronizes the stream before dropping its free buffers. The pool takes the
    smallest free buffer that fits. A registration that fails falls back to torch's pinned allocator, once the error is
    taken off the runtime, for that buffer and every later one, said once; a sticky error, or that allocator failing
    too, stops with the runtime's message and the fixes."""
    import gc
    import mmap

    import parallel.offload as po

    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

        def cudaGetErrorString(self, err):
            return f"error {err} (test)"

    class Stream:
        def synchronize(self):
            calls.append(("sync",))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    page = mmap.PAGESIZE
    b = po._HostBuffer(10 * page + 123, Stream())
    (_, ptr, size, flags), = calls
    assert ptr % page == 0 and ptr == b.data.data_ptr() == b.data.untyped_storage().data_ptr(), ptr
    assert size == 11 * page and flags == 0 and b.data.numel() == 10 * page + 123, size
    b.data.fill_(7)   # the mapping is writable memory
    del b
    gc.collect()
    assert calls[-2:] == [("sync",), ("unregister", ptr)], calls

    calls.clear()
    pool = po.HostPool(Stream())
    small = [pool.take(n) for n in (3 * page, 5 * page, 4 * page)]
    for x in small:
        pool.give(x)
    assert pool.take(4 * page - 1) is small[2] and pool.made == 3   # the smallest that fits
    pool.give(small[2])
    ptrs = [x.data.data_ptr() for x in small]
    del small, x
    calls.clear()
    big = pool.take(6 * page)   # none fits: the stream is synchronized before the free buffers go
    gc.collect()
    assert calls[0] == ("sync",) and {c[1] for c in calls if c[0] == "unregister"} == set(ptrs), calls
    assert pool.made == 4 and pool.held == big.nbytes == 6 * page and pool.free == [], (pool.made, pool.held)

    # a registration that fails: the error is taken off the runtime, and torch's pinned allocator (a plain tensor
    # here, recorded) serves this buffer and every later one, with no registration tried again; said once
    monkeypatch.setattr(Runtime, "cudaHostRegister", lambda self, ptr, size, flags: calls.append(("register",)) or 2)
    monkeypatch.setattr(po.HostPool, "warned", False)
    taken, sticky = [], [False]
    monkeypatch.setattr(po, "_take_last_error", lambda: taken.append(1) or not sticky[0])
    monkeypatch.setattr(po, "_pinned", lambda n: calls.append(("pinned", n)) or torch.empty(n, dtype=torch.uint8))
    calls.clear()
    with pytest.warns(UserWarning, match=r"pinned by torch's allocator, which rounds each buffer up to a power of two "
                                         r"and keeps it cached \(page-locking 8,192 bytes of host memory in place "
                                         r"failed \(error 2 \(test\)\)\)"):
        b = po._HostBuffer(2 * page - 5, Stream())
    assert calls == [("register",), ("pinned", 2 * page - 5)] and taken == [1] and po.HostPool.warned, calls
    assert b.registered is None and b.data.numel() == 2 * page - 5, b.registered
    calls.clear()
    b2 = po._HostBuffer(3 * page, Stream())
    assert calls == [("pinned", 3 * page)] and b2.registered is None, calls
    del b, b2
    gc.collect()
    assert ("unregister",) not in {c[:1] for c in calls}, "a buffer never registered was unregistered"
    monkeypatch.setattr(po.HostPool, "warned", False)   # a sticky error: the device is gone, the step stops
    sticky[0] = True
    with pytest.raises(RuntimeError, match=r"page-locking 8,192 bytes of host memory in place failed \(error 2 "
                                           r"\(test\)\), and the device fails since; free host memory, lower "
                                           r"--max-len or drop --offload-activations"):
        po._HostBuffer(2 * page - 5, Stream())
    sticky[0] = False   # torch's allocator cannot lock it either
    monkeypatch.setattr(po, "_pinned", lambda n: (_ for _ in ()).throw(RuntimeError("no host memory (test)")))
    with pytest.raises(RuntimeError, match=r"failed \(error 2 \(test\)\), and so did torch's pinned allocator "
                                           r"\(no host memory \(test\)\); free host memory"):
        po._HostBuffer(2 * page - 5, Stream())


def _handles(hooks):
    """The packed handles of the last forward, first block first (walking the prefetch links back)."""
    out, h = [], hooks.last and hooks.last()
    while h is not None:
        out.append(h)
        h = h.prev and h.prev()
    return out[::-1]


def _fsdp_cases(rank, world_size, path, mem):
    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims

    B, S = 4, 24
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 128, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    pos = torch.arange(S).expand(B, S)
    ref, _ = build_nonzero_b(_opts(path, ac=False))
    rsum, rn = ref(ids, position_ids=pos, labels=labels)
    (rsum / rn).backward()
    ref_grads = _lora_grads(ref)
    for cp, impl in ((1, "ulysses"),) + ((2, "ring"),) * (not mem.get("tiled_attn")):   # (tiled attention: cp 1)
        label = f"cp {cp} {impl} × dp_shard {world_size // cp}"
        dims = ParallelDims.from_args(world_size, 1, -1, cp, impl, None, n_heads=6, n_kv_heads=2)
        meshes = dims.build_mesh("cpu")
        model, _ = build_nonzero_b(_opts(path, **mem), fsdp_mesh=meshes.fsdp,
                                   attention=cp_attention(meshes, dims) if cp > 1 else None)
        d, c = meshes.dp.get_local_rank(), meshes.cp.get_local_rank()
        rows = slice(d * B // dims.dp, (d + 1) * B // dims.dp)
        lsum, ln = model(shard_sequence(ids[rows], dims, c, 0), position_ids=shard_sequence(pos[rows], dims, c, None),
                         labels=shard_sequence(labels[rows], dims, c, -100))
        tot = torch.stack([lsum.detach(), ln.detach().to(lsum.dtype)])
        dist.all_reduce(tot, group=meshes.dp_cp.get_group())
        (lsum / tot[1]).backward()
        torch.testing.assert_close(tot[0] / tot[1], rsum.detach() / rn, **TOL, msg=f"{label}: loss")
        n = 0
        for name, p in model.named_parameters():
            if p.requires_grad:
                n += 1
                torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], **TOL, msg=f"{label}: grad {name}")
        assert n == len(ref_grads) == 14 * len(model.model.layers), f"{label}: {n} LoRA parameters"
        if mem.get("ac_group", 1) > 1 and cp == 1:   # the group recompute gathers no block twice
            args = (shard_sequence(ids[rows], dims, c, 0), shard_sequence(pos[rows], dims, c, None),
                    shard_sequence(labels[rows], dims, c, -100))
            plain, _ = build_nonzero_b(_opts(path, **dict(mem, ac_group=1)), fsdp_mesh=meshes.fsdp)
            assert _all_gathers(model, *args) == _all_gathers(plain, *args), \
                f"{label}: FSDP2 resharded a block the group recompute unsharded (all-gathered twice)"
    return True


def _all_gathers(model, ids, pos, labels):
    """FSDP2 all-gathers in one forward + backward (counted at its collective)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    n, real = [0], pg.foreach_all_gather

    def counted(*a, **kw):
        n[0] += 1
        return real(*a, **kw)
    pg.foreach_all_gather = counted
    try:
        lsum, _ = model(ids, position_ids=pos, labels=labels)
        lsum.backward()
    finally:
        pg.foreach_all_gather = real
    return n[0]


@pytest.mark.timeout(300)
def test_fsdp_tiled_offload_match_single_process(ckpt):
    mem = dict(ac=True, tiled_mlp=True, offload_activations=True)
    assert run_ranks(_fsdp_cases, 4, ckpt, mem, timeout=280) == [True] * 4


@pytest.mark.timeout(300)
def test_fsdp_tiled_attention_matches_single_process(ckpt):
    """--tiled-attn with the tiled MLP and offload under FSDP2 (dp_shard 4): the single-process untiled model's
    loss and LoRA gradients on every rank."""
    mem = dict(ac=True, tiled_mlp=True, tiled_attn=True, offload_activations=True)
    assert run_ranks(_fsdp_cases, 4, ckpt, mem, timeout=280) == [True] * 4


@pytest.mark.timeout(300)
def test_fsdp_ac_group_matches_single_process(ckpt3):
    """3 blocks in groups of 2 ([0, 1] recomputed under FSDP2's hooks, then [2] alone), tiled MLP inside."""
    mem = dict(ac=True, tiled_mlp=True, ac_group=2)
    assert run_ranks(_fsdp_cases, 4, ckpt3, mem, timeout=280) == [True] * 4


@pytest.fixture(scope="module")
def ckpt3(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt3"), inter=96, layers=3)


@pytest.fixture(scope="module")
def ckpt5(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt5"), inter=96, layers=5)


@pytest.mark.parametrize("group,tiled", [(2, False), (3, False), (2, True), (5, True)])
def test_ac_group_keeps_one_input_per_group(ckpt5, group, tiled):
    """--ac-group G on 5 blocks: after forward only the groups' first inputs are alive and saved outside the
    checkpoints; the loss and every LoRA gradient equal no AC at all; backward recomputes G - 1 blocks per
    group in full and stops the group recompute at its last block's input."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt5, **kw))
        inputs, calls, seen = [], [], []
        for i, block in enumerate(model.model.layers):
            block.register_forward_pre_hook(lambda m, a, i=i: inputs.append((i, weakref.ref(a[0]))))
            block.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))

        def pack(t):
            seen.append(tuple(t.shape))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s, n = model(ids, labels=ids)
        alive = [i for i, r in inputs if r() is not None]
        forward_calls, calls[:] = list(calls), []
        (s / n).backward()
        return s.detach(), _lora_grads(model), seen.count((2, 29, model.args.dim)), alive, forward_calls, calls

    ref = run(ac=False)
    got = run(ac=True, ac_group=group, tiled_mlp=tiled)
    starts = list(range(0, 5, group))   # the first group's input is looked up again from the token ids
    assert got[3] == starts[1:], f"G={group}: block inputs alive after forward {got[3]}, want {starts[1:]}"
    assert got[2] == len(starts), f"G={group}: {got[2]} [B, S, D] tensors saved outside (the groups' but the "\
        "first, +1: final norm)"
    assert got[4] == list(range(5)), got[4]
    # backward, last group first: the group's blocks but its last (outer recompute), then each block (inner)
    want = []
    for g0 in reversed(starts):
        blocks = list(range(g0, min(g0 + group, 5)))
        want += (blocks[:-1] if len(blocks) > 1 else []) + blocks[::-1]
    assert got[5] == want, f"G={group}: MLP calls in backward {got[5]}, want {want}"
    torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"G={group}: loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"G={group}: grad {n}")


def test_first_checkpoint_lookup_guards_in_place_changes(ckpt3):
    """The first checkpoint keeps the ids and looks the embedding up again (saved-tensor hooks, which autograd's
    in-place check does not cover): ids overwritten between forward and backward (a reused input buffer) raise,
    naming the fix; an embedding output changed in place before block 0 (a fork's forward hook) is saved as
    usual, and the LoRA gradients equal no AC with the same hook."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(scale=False, reuse=False, **kw):
        model, _ = build_nonzero_b(_opts(ckpt3, **kw))
        if scale:
            model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.mul_(3))
        buf = ids.clone()
        s, n = model(buf, labels=ids)
        if reuse:
            buf.copy_(torch.flip(ids, [1]))   # the next micro-batch written into the same buffer
        (s / n).backward()
        return s.detach(), _lora_grads(model)

    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        run(reuse=True, ac=True)
    run(reuse=True, ac=False)   # no lookup without AC: nothing to refuse
    ref, got = run(scale=True, ac=False), run(scale=True, ac=True)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")


@pytest.mark.parametrize("mem", [dict(), dict(ac_group=2)], ids=["blocks", "group2"])
def test_embedding_output_dropped_during_forward(ckpt5, mem):
    """With AC the first checkpoint keeps the ids, so nothing needs the embedding's [T, D] output once the first
    checkpoint has run: the forward drops it then (block 1's input with plain AC, block 2's with --ac-group 2),
    not when the last block is done, where every block's checkpoint is alive beside it."""
    model, _ = build_nonzero_b(_opts(ckpt5, ac=True, **mem))
    emb, alive = [], {}
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: emb.append(weakref.ref(out)))
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda m, a, i=i: (alive.setdefault(i, emb[0]() is not None), None)[1])
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    s, n = model(ids, labels=ids)
    first = 1 if not mem else 2
    assert alive == {i: i < first for i in range(5)}, alive
    (s / n).backward()


@pytest.mark.parametrize("mem", [dict(), dict(tiled_mlp=True), dict(offload_activations=True)],
                         ids=["plain", "tiled", "offload"])
def test_ac_blocks_checkpoints_only_the_first(ckpt5, mem):
    """--ac-blocks 2 on 5 blocks: backward recomputes blocks 1 and 0 only (the last 3 keep their activations),
    the offload moves only those 2 inputs, and the loss and every LoRA gradient equal no AC at all."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt5, **kw))
        calls = []
        for i, block in enumerate(model.model.layers):
            block.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
        s, n = model(ids, labels=ids)
        forward_calls, calls[:] = list(calls), []
        (s / n).backward()
        hooks = getattr(model.model.layers[0].forward, "hooks", None)
        return s.detach(), _lora_grads(model), forward_calls, calls, hooks

    ref = run(ac=False)
    got = run(ac=True, ac_blocks=2, **mem)
    assert got[2] == list(range(5)) and got[3] == [1, 0], f"MLP calls: forward {got[2]}, backward {got[3]}"
    assert not hasattr(run(ac=True, ac_blocks=0)[4], "moved"), "--ac-blocks 0: no block is checkpointed"
    if mem.get("offload_activations"):
        assert got[4].moved == 1, f"offloaded {got[4].moved} block inputs, want block 1's (block 0's: token ids)"
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")


def test_ac_group_refuses_offload_and_no_ac(ckpt):
    from parallel.parallelize import build_model

    with pytest.raises(ValueError, match="--ac-group 2 with --offload-activations"):
        build_model(_opts(ckpt, ac=True, ac_group=2, offload_activations=True))
    with pytest.raises(ValueError, match="--ac-group 2 groups the checkpoints of --ac"):
        build_model(_opts(ckpt, ac=False, ac_group=2))


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_input_norm_output_is_gone_when_the_attention_kernel_runs(ckpt3, ac):
    """model.llama.Attention runs its block's input norm itself (Block hands it `takes_norm`'s stand-in), so the
    norm's [T, D] output dies with q, k, v made: it is gone whenever the attention core runs, in forward and in
    the block recompute (AC), at every layer (the first one too: LoRA A keeps the embedding output instead), not
    held by the sublayer call's argument until o_proj returns. The loss equals the plain SDPA model's."""
    from model.attention import SDPAAttention

    ids = torch.randint(0, 128, (1, 29), generator=torch.Generator().manual_seed(5))
    model, _ = build_nonzero_b(_opts(ckpt3, ac=ac))
    outs, seen, core = {}, [], model.attention

    class Watching(type(core)):
        def __call__(self, q, *a, **k):
            seen.append([i for i, r in outs.items() if r() is not None])
            return core(q, *a, **k)
    model.attention = Watching.__new__(Watching)
    model.attention.__dict__.update(core.__dict__)
    for i, block in enumerate(model.model.layers):
        block.input_layernorm.register_forward_hook(lambda m, a, y, i=i: outs.__setitem__(i, weakref.ref(y)))
    s, n = model(ids, labels=ids)
    (s / n).backward()
    assert sorted(outs) == [0, 1, 2], f"input norms seen running: {sorted(outs)}"
    assert len(seen) == 3 * (1 + ac), f"core calls: {len(seen)} (forward, plus the recompute under AC)"
    assert seen == [[]] * len(seen), f"layers whose input norm output was alive at a core call: {seen}"
    model.attention = SDPAAttention()   # the reference core, same weights
    torch.testing.assert_close(model(ids, labels=ids)[0].detach(), s.detach(), **TOL, msg="loss vs SDPA")


def _without_norm_rebuild(monkeypatch):
    import parallel.parallelize as pz

    monkeypatch.setattr(pz, "apply_norm_rebuild", lambda model: None)


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=False, tiled_mlp=True), dict(ac=True, tiled_mlp=True),
                                 dict(ac=True, ac_group=2), dict(ac=False, lora_dropout=0.1)],
                         ids=["no_ac", "tiled", "ac_tiled", "ac_group", "dropout"])
def test_norm_outputs_are_rebuilt_not_kept(ckpt3, monkeypatch, mem):
    """apply_norm_rebuild: no block norm's output outlives the forward (without AC, where nothing is recomputed),
    layer 0's first too (LoRA A keeps the embedding output it is made from: even without AC, one [T, D] less in
    the first block's backward under AC, where that input is looked up again anyway); the loss
    and every LoRA gradient equal, bit for bit, the same model built without the step (LoRA A keeping the
    norms' outputs), with the tiled MLP, AC, --ac-group, and with dropout (where peft hands LoRA A a new tensor
    and the step stands aside)."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        torch.manual_seed(0)   # the same dropout masks
        model, _ = build_nonzero_b(_opts(ckpt3, **kw))
        outs = {}
        for i, block in enumerate(model.model.layers):
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(block, name).register_forward_hook(
                    lambda m, a, y, k=(i, name): outs.__setitem__(k, weakref.ref(y)))
        s, n = model(ids, labels=ids)
        alive = sorted(k for k, r in outs.items() if r() is not None)   # kept for backward by someone
        ran = {name for _, name in outs}   # the norms run over all tokens (a forward hook fired)
        (s / n).backward()
        want = {"input_layernorm"} | ({"post_attention_layernorm"} if not mem.get("tiled_mlp") else set())
        assert ran == want, f"norms run whole: {ran} (the tiled MLP runs its norm over its own tiles: a stand-in)"
        return s.detach(), _lora_grads(model), alive

    got = run(**mem)
    if not mem["ac"] and not mem.get("lora_dropout"):
        assert got[2] == [], f"norm outputs autograd keeps: {got[2]}"
    with monkeypatch.context() as m:
        _without_norm_rebuild(m)
        ref = run(**mem)
    if not mem["ac"] and not mem.get("lora_dropout"):   # the tiled MLP's norm never runs whole, kept by nobody
        assert len(ref[2]) == (3 if mem.get("tiled_mlp") else 6), \
            f"without the step LoRA A keeps all {3 if mem.get('tiled_mlp') else 6} norm outputs, saw {ref[2]}"
    assert torch.equal(got[0], ref[0]), f"loss {got[0]} != {ref[0]}"
    for k in ref[1]:
        assert torch.equal(got[1][k], ref[1][k]), f"grad {k}: max diff {(got[1][k] - ref[1][k]).abs().max()}"


@pytest.mark.parametrize("flags", [dict(tiled_mlp=True), dict(tiled_mlp=True, tiled_attn=True),
                                   dict(tiled_mlp=True, ac_keep_attn=True)], ids=["tiled", "tiled_attn", "keep_attn"])
def test_tiled_sublayers_never_run_their_norm_whole(ckpt3, flags):
    """Under AC, a tiled sublayer's block norm never runs over all tokens, in forward or in the block's recompute
    (model.llama.Block hands it memory.norm_stand_in: each tile runs the norm), and the tiled MLP's output in a
    recompute, never read, is one element, not a [T, D] buffer: on an H200 at 524,288 tokens those two [T, D]
    tensors (3.8 GB each) sat beside the recompute at the block's peak. Layer 0's too (its input, the embedding
    output, needs no grad; the tiles' LoRA A still do). The loss and LoRA gradients equal the untiled model's."""
    import model.rmsnorm as rmsnorm
    import parallel.memory as pm
    from parallel.recompute import recomputing

    # 600 tokens: the tiled attention's tiles (256 rows at least, parallel.kernels.tile_rows) are shorter
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(4))
    forward, norm_forward, outs, rows = pm._TiledMLP.forward, rmsnorm._RMSNormFn.forward, [], []

    def spy(ctx, *a):
        y = forward(ctx, *a)
        outs.append((recomputing(), y.untyped_storage().nbytes() // y.element_size(), y.numel()))
        return y

    def norm_spy(ctx, x, weight, eps):   # every RMSNorm call, however it is reached: its weight and rows
        rows.append((weight.data_ptr(), x.numel() // x.shape[-1]))
        return norm_forward(ctx, x, weight, eps)

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt3, ac=True, **kw))
        whole, rows[:] = [], []
        for i, block in enumerate(model.model.layers):
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(block, name).register_forward_hook(lambda m, a, y, k=(i, name): whole.append(k))
        s, n = model(ids, labels=ids)
        (s / n).backward()
        names = {getattr(b, name).weight.data_ptr(): (i, name) for i, b in enumerate(model.model.layers)
                 for name in ("input_layernorm", "post_attention_layernorm")}
        by_call = sorted({names[w] for w, r in rows if w in names and r == ids.numel()})
        return s.detach(), _lora_grads(model), sorted(set(whole)), by_call

    pm._TiledMLP.forward, rmsnorm._RMSNormFn.forward = staticmethod(spy), staticmethod(norm_spy)
    try:
        got = run(**flags)
    finally:
        pm._TiledMLP.forward, rmsnorm._RMSNormFn.forward = staticmethod(forward), staticmethod(norm_forward)
    attn = {(i, "input_layernorm") for i in range(3)} if not flags.get("tiled_attn") else set()
    assert got[2] == sorted(attn), f"norm modules run over all tokens: {got[2]}"
    assert got[3] == sorted(attn), f"RMSNorm calls over all tokens, by norm: {got[3]}"
    assert [r for r, _, _ in outs] == [False] * 3 + [True] * 3, outs   # 3 forwards, then 3 block recomputes
    assert all(stored == (1 if r else n) for r, stored, n in outs), f"(recompute, elements stored, numel): {outs}"
    ref = run(**{**flags, "tiled_mlp": False, "tiled_attn": False})
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"grad {k}")


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_tiled_mlp_differentiates_its_norm(ckpt3, monkeypatch, ac):
    """The tiled MLP takes over post_attention_layernorm (model.llama.Block hands it a stand-in): each tile runs
    the norm and the MLP from the norm's input, so the norm's own backward over all T tokens (and its [T, D]
    gradient buffers) never runs: 3 whole-sequence RMSNorm backwards (input norms of layers 1-2, the final norm)
    instead of 6. With the norms' weights made trainable, their gradients (summed over tiles) and every LoRA
    gradient equal the untiled model's."""
    import model.rmsnorm as rmsnorm

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    backward, calls = rmsnorm._RMSNormFn.backward, []
    monkeypatch.setattr(rmsnorm._RMSNormFn, "backward",   # the rows of each RMSNorm backward
                        staticmethod(lambda ctx, g: calls.append(g.numel() // g.shape[-1]) or backward(ctx, g)))

    def run(tiled=True):
        model, _ = build_nonzero_b(_opts(ckpt3, ac=ac, tiled_mlp=tiled))
        assert ids.numel() > model.args.dim, "tiles (D tokens) must be shorter than the sequence to tell apart"
        for block in model.model.layers:
            block.post_attention_layernorm.weight.requires_grad_(True)
        calls.clear()
        s, n = model(ids, labels=ids)
        (s / n).backward()
        return s.detach(), _lora_grads(model), calls.count(ids.numel())   # whole-sequence ones (not tiles)

    got = run()
    assert got[2] == 3, f"RMSNorm backwards: {got[2]}"
    ref = run(tiled=False)   # the untiled MLP: its norm runs (and is differentiated) over all tokens
    assert ref[2] == 6
    assert any("post_attention_layernorm" in k for k in ref[1])
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"grad {k}")


@pytest.mark.parametrize("quant, dropout", [("nf4", 0.0), ("none", 0.0), ("nf4", 0.1)], ids=str)
def test_fused_lora_equals_peft_forward(ckpt3, monkeypatch, quant, dropout):
    """model.qlora.fuse_lora: every LoRA layer (7 per block) runs the fused addmm, never peft's own forward, and
    the loss and every LoRA gradient equal the same model on peft's forward (4-bit and plain base layers,
    with dropout: the same masks); the tiled MLP and AC in the path."""
    import model.qlora as qlora
    import parallel.parallelize as pz
    from parallel.parallelize import BuildOptions

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    slow_calls = []

    def run():
        torch.manual_seed(0)
        model, _ = build_nonzero_b(BuildOptions(ckpt3, quant=quant, lora_r=4, lora_alpha=8, seed=3, ac=True,
                                                tiled_mlp=True, lora_dropout=dropout))
        s, n = model(ids, labels=ids)
        (s / n).backward()
        return s.detach(), _lora_grads(model)

    fuse = qlora.fuse_lora

    def counting(model):
        n = fuse(model)
        for m in model.modules():
            if hasattr(m, "_peft_forward"):
                m._peft_forward = (lambda f: lambda *a, **k: slow_calls.append(1) or f(*a, **k))(m._peft_forward)
        assert n == 7 * 3
        return n

    monkeypatch.setattr(pz, "fuse_lora", counting)
    got = run()
    assert not slow_calls, f"peft's forward ran {len(slow_calls)} times"
    monkeypatch.setattr(pz, "fuse_lora", lambda model: 0)
    ref = run()
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    assert got[1].keys() == ref[1].keys() and len(got[1]) == 2 * 7 * 3
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"grad {k}")


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_input_gradients_are_summed_in_place(ckpt3, tiled):
    """Where a [T, D] tensor gets two gradients (the post-attention residual: its own and the MLP's (or the tiled
    MLP's); a block's input: the residual's and its norm's), the sum lands in place in one of them, never in a
    third tensor: the final gradient seen there has been written in place (version > 0; a fresh sum has
    version 0). Autograd sums in place only into the gradient that arrived first, and only if it is not a view:
    RMSNorm returns its input gradient unviewed; undone, the sum is a third [T, D]. o_proj's input gets one
    gradient, built in place by model.qlora._BaseAndA (its base's, then LoRA A's share added: version > 0)."""
    model, _ = build_nonzero_b(_opts(ckpt3, ac=False, tiled_mlp=tiled))
    seen = {}

    def watch(name, x):   # from a forward hook: the gradient hook on x sees x's final (summed) gradient
        x.register_hook(lambda g: (seen.setdefault(name, g._version), None)[1])

    for i, block in enumerate(model.model.layers):
        block.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: watch(f"{i} o_proj input", a[0]))
        # h, the post-attention residual (summed into o_proj's output in place): its own and the MLP's gradients;
        # the tiled MLP is handed a stand-in for its norm's output, tagged with h (memory.norm_stand_in)
        block.mlp.register_forward_pre_hook(
            lambda m, a, i=i: watch(f"{i} residual", a[0]._norm_output[1]) if tiled else None)
        if not tiled:
            block.post_attention_layernorm.register_forward_pre_hook(lambda m, a, i=i: watch(f"{i} residual", a[0]))
        if i:
            block.register_forward_pre_hook(lambda m, a, i=i: watch(f"{i} block input", a[0]))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    s, n = model(ids, labels=ids)
    (s / n).backward()
    assert len(seen) == 3 * 3 - 1, seen
    fresh = sorted(k for k, version in seen.items() if version == 0)
    assert not fresh, f"summed into a new tensor at: {fresh}"


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_o_proj_input_gradient_in_one_buffer(ckpt3, monkeypatch, quant):
    """model.qlora._BaseAndA: o_proj (and only o_proj: q/k/v and gate/up share their input, down_proj's base is
    skipped in a recompute) runs its frozen base and LoRA A in one node whose backward builds the input gradient
    in one buffer, so LoRA A's own node never runs; the loss and every LoRA gradient equal, bit for bit, the same
    model on autograd's two gradients summed (4-bit and plain bases, with AC and the tiled MLP in the path), and
    within float32 rounding when A's share is added in 7-row chunks (no [T, in] product beside the gradient)."""
    import model.qlora as qlora

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run():
        torch.manual_seed(0)
        model, _ = build_nonzero_b(_opts(ckpt3, quant=quant, ac=True, tiled_mlp=True))
        a_calls = []
        for name, m in model.named_modules():
            if name.endswith("lora_A.default"):
                m.register_forward_hook(lambda m, a, y, name=name: a_calls.append(name.split(".")[-3]))
        s, n = model(ids, labels=ids)
        (s / n).backward()
        return s.detach(), _lora_grads(model), sorted(set(a_calls))

    nodes, big = [], []
    backward = qlora._BaseAndA.backward

    def watched(ctx, dy, da):   # records the rows of every matrix product
        class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and func is torch.ops.aten.mm.default:
                    big.append(out.shape[0])
                return out
        nodes.append(ctx.base)
        with Sizes():
            return backward(ctx, dy, da)

    monkeypatch.setattr(qlora._BaseAndA, "backward", staticmethod(watched))
    got = run()   # 58 tokens: A's share in one chunk
    monkeypatch.setattr(qlora, "ROW_CHUNK", 7 * 48)   # 7-row chunks of A's share: several per layer, one uneven
    big.clear()
    chunked = run()
    # per node: the base's gradient (the one [58 tokens, in] buffer), A's share in 7-row pieces (9 for 58 rows,
    # the last 2), dA [r = 4, in]: no second [58, in]
    assert big.count(58) == 3 and max(x for x in big if x != 58) == 7 and big.count(7) == 3 * 8, big
    assert len(nodes) == 2 * 3 and "o_proj" not in got[2], (len(nodes), got[2])   # one per block and run
    assert got[2] == ["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"], got[2]
    monkeypatch.setattr(qlora, "_one_input_grad", lambda *a: False)
    ref = run()
    assert "o_proj" in ref[2]
    assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    for k in ref[1]:
        assert torch.equal(got[1][k], ref[1][k]), f"grad {k}: max diff {(got[1][k] - ref[1][k]).abs().max()}"
        # in 7-row pieces the GEMMs round apart from the whole one in the last bits, which later sums can cancel
        # down to tiny elements: within 1e-5 of the gradient's largest element
        err = (chunked[1][k] - ref[1][k]).abs().max() / ref[1][k].abs().max()
        assert err < 1e-5, f"chunked grad {k}: {err}"


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["one buffer", "peft's path"])
def test_lora_b_and_residual_summed_into_o_proj_base_output(ckpt3, dropout):
    """Where o_proj runs _BaseAndA, LoRA B's share and then the residual are added into the base's output in place:
    h (the post-attention norm's input) lives in the base's output storage, so no [T, D] sits beside them in a
    block's forward or recompute (parallel/plan_block.py, term 10). On peft's path (dropout) they are new tensors."""
    model, _ = build_nonzero_b(_opts(ckpt3, ac=False, lora_dropout=dropout))
    kept = {}   # the tensors themselves: a freed base output's address could be reused for a new h
    for i, block in enumerate(model.model.layers):
        block.self_attn.o_proj.base_layer.register_forward_hook(   # (hooks return None: nothing replaced)
            lambda m, a, o, i=i: (kept.setdefault((i, "base"), o), None)[1])
        block.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: (kept.setdefault((i, "h"), a[0]), None)[1])
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids)
    same = [kept[(i, "base")].untyped_storage().data_ptr() == kept[(i, "h")].untyped_storage().data_ptr()
            for i in range(len(model.model.layers))]
    assert all(same) if dropout == 0 else not any(same), same


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_no_in_place_op_on_a_view_in_the_graph(ckpt3, ac):
    """LoRA B's share and the residual go into o_proj's base output in place through reshapes autograd does not
    track as views (aten._unsafe_view): an in-place op on a view would be a CopySlices node, whose backward
    allocates the base's whole gradient and clones the slice (two [T, D] beside dh per op, per block: on an H200 at
    524,288 tokens 7.5 GB). No CopySlices anywhere in the step's graph, and the o_proj path still sums in place
    (test above) and equals peft (test_fused_lora_equals_peft_forward)."""
    model, _ = build_nonzero_b(_opts(ckpt3, ac=ac))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    s, _ = model(ids, labels=ids)
    seen, stack, names = set(), [s.grad_fn], []
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.append(type(f).__name__)
        stack.extend(g for g, _ in f.next_functions)
    assert "_BaseAndABackward" in names and "AddmmBackward0" in names and "CopySlices" not in names, \
        sorted(set(names))   # (the in-place path taken: _BaseAndA's output, B's share added into it)


def test_q_chain_runs_before_k_and_v(ckpt3, monkeypatch):
    """model.llama makes k, v before q, so backward (latest nodes first) runs q's RoPE and q_proj before k's and
    v's: q's [T, H·Hd] gradients are gone before the input norm's gradient and its rebuilt output exist
    (parallel/plan_block.py's term 9). Per block, the RoPE backward sees q's gradient (6 heads) first, then k's (2)."""
    import model.rope as rope

    seen = []
    backward = rope._RopeFn.backward
    monkeypatch.setattr(rope._RopeFn, "backward", staticmethod(
        lambda ctx, g: seen.append(g.shape[2]) or backward(ctx, g)))
    model, _ = build_nonzero_b(_opts(ckpt3, ac=True, tiled_mlp=True))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    s, n = model(ids, labels=ids)
    (s / n).backward()
    assert seen == [6, 2] * len(model.model.layers), seen


def test_fused_lora_steps_aside_for_a_dtype_cast(ckpt3):
    """bf16 activations with float32 LoRA (a CPU bf16 run): peft casts x to float32 first, so its forward runs."""
    from model.qlora import fuse_lora

    model, _ = build_nonzero_b(_opts(ckpt3, dtype=torch.bfloat16, ac=False))
    layer = model.model.layers[0].self_attn.q_proj
    calls = []
    slow = layer._peft_forward
    layer._peft_forward = lambda *a, **k: calls.append(1) or slow(*a, **k)
    x = torch.randn(1, 5, model.args.dim, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16 and calls == [1]
    assert fuse_lora(torch.nn.Linear(2, 2)) == 0


def test_lora_grads_match_peft_on_transformers(ckpt3):
    """Outside reference for the LoRA gradients (the norm rebuild, tiled MLP and AC in the path): peft's LoRA on
    the transformers Qwen2 of the same checkpoint, with our adapter's values, gives the same loss and every
    LoRA gradient (float32, plain base weights: transformers cannot run bitsandbytes on this CPU model)."""
    import transformers as T
    from peft import LoraConfig, get_peft_model

    from model.lora_spec import LORA_TARGETS
    from parallel.parallelize import BuildOptions

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    for mem in (dict(ac=False), dict(ac=True, tiled_mlp=True)):
        model, peft_model = build_nonzero_b(BuildOptions(ckpt3, quant="none", lora_r=4, lora_alpha=8, seed=3, **mem))
        s, n = model(ids, labels=labels)
        (s / n).backward()
        ours = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
        hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt3, torch_dtype=torch.float32),
                            LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                                       init_lora_weights=False))
        state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
        missing = hf.load_state_dict(state, strict=False).unexpected_keys
        assert not missing, f"{mem}: our LoRA names unknown to peft: {missing[:3]}"
        hf.train()
        logits = hf(input_ids=ids).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                reduction="sum", ignore_index=-100)
        (ref / n).backward()
        torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg=f"{mem}: loss")
        theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
        assert theirs.keys() == ours.keys() and len(ours) == 14 * 3, f"{mem}: {len(ours)} LoRA parameters"
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-6, msg=f"{mem}: grad {k}")


def _attention_ops():
    """A dispatch mode counting the attention kernel ops that really run (a cached one never reaches it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in str(func.overloadpacket):
                self.n.append(str(func.overloadpacket).rsplit("_", 1)[-1])   # "cpu" (forward) or "backward"
            return func(*args, **(kwargs or {}))
    return Count()


@pytest.mark.parametrize("mem", [dict(), dict(tiled_mlp=True), dict(ac_blocks=2)], ids=["ac", "tiled", "ac_blocks"])
def test_ac_keep_attn_runs_attention_once(ckpt3, mem):
    """--ac-keep-attn on 3 blocks (the trainer's kernel core, torch's CPU flash op): forward runs the attention op
    3 times; backward runs its backward 3 times and its forward never (plain AC: 3 more forwards in the
    recompute); the loss and every LoRA gradient equal no AC at all."""
    from parallel.cp import KernelAttention

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt3, **kw), attention=KernelAttention())
        with _attention_ops() as ops:
            s, n = model(ids, labels=ids)
            forward, ops.n[:] = list(ops.n), []
            (s / n).backward()
        return s.detach(), _lora_grads(model), forward, ops.n

    ref = run(ac=False)
    plain = run(ac=True, **mem)
    got = run(ac=True, ac_keep_attn=True, **mem)
    recomputed = 3 if "ac_blocks" not in mem else 2
    assert plain[2] == got[2] == ["cpu"] * 3, f"forward attention ops: plain {plain[2]}, kept {got[2]}"
    assert sorted(plain[3]) == ["backward"] * 3 + ["cpu"] * recomputed, f"plain AC backward: {plain[3]}"
    assert got[3] == ["backward"] * 3, f"--ac-keep-attn backward ran {got[3]}"
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")


def test_ac_keep_attn_refusals(ckpt):
    from parallel.parallelize import build_model

    for kw, msg in ((dict(ac=False), "--ac-keep-attn keeps the attention outputs of --ac's checkpoints: drop --no-ac"),
                    (dict(ac=True, ac_group=2), "--ac-keep-attn with --ac-group 2"),
                    (dict(ac=True, offload_activations=True), "--ac-keep-attn with --offload-activations")):
        with pytest.raises(ValueError, match=msg):
            build_model(_opts(ckpt, ac_keep_attn=True, **kw))


def test_ac_keep_attn_with_packed_rows_and_the_varlen_check(ckpt3, monkeypatch):
    """Packed rows (2 documents per row) on the varlen path (torch's CUDA op emulated on CPU through the CPU flash
    op, which --ac-keep-attn caches): the op's one-time check runs inside block 0's first checkpointed forward
    but not in its recompute, so its calls must stay out of the selective-AC cache (else the recompute would be
    handed the check's outputs); loss and LoRA grads equal no AC."""
    from parallel import backends, kernels
    from parallel.cp import KernelAttention
    from tests.test_kernels import _emulated_varlen

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(17), torch.arange(23)]).expand(2, 40)
    calls = []

    def run(**kw):
        monkeypatch.setattr(kernels, "_varlen_checked", {})   # the check runs in this build's first forward
        model, _ = build_nonzero_b(_opts(ckpt3, **kw), attention=KernelAttention())
        s, n = model(ids, position_ids=pos, labels=ids)
        (s / n).backward()
        return s.detach(), _lora_grads(model)

    monkeypatch.setattr(kernels, "_varlen_eligible", lambda q: True)
    monkeypatch.setattr(backends, "VARLEN_OPS", _emulated_varlen(calls, backend="cpu"))
    ref = run(ac=False)
    got = run(ac=True, ac_keep_attn=True)
    # the check once per build; the op 3 times (no AC), then 3 + 3 (the emulation is Python, so the recompute
    # calls it again, but the CPU flash op inside it is served from the cache)
    assert calls.count([0, 100, 256]) == 2 and calls.count([0, 17, 40, 57, 80]) == 9, calls
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")


# a child process's RSS high-water mark, reset before each measured call; 2**20-element chunks (4 MB in
# float32, 2 MB in bf16) against 134 MB inputs
_PEAK_HELPERS = """
import sys, torch
torch.set_num_threads(1)
import model.rmsnorm as rmsnorm
import model.rope as rope
rmsnorm.NORM_CHUNK = rope.ROPE_CHUNK = 2**20
def hwm():
    return {k: int(v.split()[0]) * 1024 for k, _, v in (l.partition(":") for l in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM")}
def reset():
    open("/proc/self/clear_refs", "w").write("5")
    return hwm()["VmRSS"]
"""

_PEAKS = _PEAK_HELPERS + """
x = torch.randn(65536, 1024, dtype=torch.bfloat16).requires_grad_()
w, g = torch.rand(1024, dtype=torch.bfloat16) + 0.5, torch.randn(65536, 1024, dtype=torch.bfloat16)
base = reset()
y = rmsnorm.RMSNorm(1024, 1e-6).to(torch.bfloat16)(x)
fwd = hwm()["VmHWM"] - base
base = reset()
y.backward(g)
print(fwd / (2 * x.numel()), (hwm()["VmHWM"] - base) / (2 * x.numel()))
del x, w, g, y
q = torch.randn(1, 65536, 16, 64, dtype=torch.bfloat16).requires_grad_()
k = torch.randn(1, 65536, 1, 64, dtype=torch.bfloat16).requires_grad_()
ang = torch.arange(65536.0)[None, :, None] * torch.rand(64)
cos, sin, g = ang.cos().bfloat16(), ang.sin().bfloat16(), torch.randn_like(q)
for mode in ("chunks", "whole"):
    if mode == "whole":   # the formula without the chunks (what compiled code fuses)
        torch.compiler.is_compiling = lambda: True
    q.grad = None
    base = reset()
    y, _ = rope.Rotary()(q, k, cos, sin)
    fwd = hwm()["VmHWM"] - base
    base = reset()
    y.backward(g)
    print(fwd / (2 * q.numel()), (hwm()["VmHWM"] - base) / (2 * q.numel()))
    del y
"""


@pytest.fixture(scope="module")
def peaks():
    """The peak-memory measurements of RMSNorm and RoPE (chunked, then whole), in one fresh process (its VmHWM reset
    before each): {"norm": (forward, backward), "chunks": ..., "whole": ...}, in units of the input's bytes. One
    process for the three (it was one per measurement: each start imports torch)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _PEAKS], cwd=root, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    return {name: tuple(map(float, line.split())) for name, line in zip(("norm", "chunks", "whole"), lines)}


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="cannot reset VmHWM")
def test_rope_temporaries_stay_within_a_chunk(peaks):
    """u = q's bf16 bytes (134 MB, 64k tokens x 16 heads x 64). Eager RoPE (model.rope._RopeFn) holds its
    output plus one chunk's temporaries each way (forward: q's and k's outputs; backward: q's gradient); the
    whole-tensor formula held about 3 u forward (q·cos, the rotated half, its product, the sum) and 3 u in
    backward, measured here side by side (2026-11-30: 1.07 / 1.26 u against 3.01 / 2.77 u; 1.10 / 1.30 u before
    the multiply-adds)."""
    assert peaks["chunks"][0] < 1.5 and peaks["chunks"][1] < 1.5, peaks
    assert peaks["whole"][0] > 2.5 and peaks["whole"][1] > 2, peaks   # the measurement sees what chunks remove


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="cannot reset VmHWM")
def test_rmsnorm_float32_temporaries_stay_within_a_chunk(peaks):
    """u = the bf16 input's bytes (134 MB); a chunk's float32 temporaries are 4 MB (0.03 u) each. Forward
    keeps the output (u) and the fp32 rstd; backward allocates the input gradient (u). The whole-tensor math
    peaked at 5.0 u and 10.1 u (measured before the chunks)."""
    fwd, bwd = peaks["norm"]
    assert fwd < 2 and bwd < 2, (fwd, bwd)


def _retained_grads(ckpt, **kw):
    """One checkpointed block's input and LoRA gradients, twice over a graph kept with retain_graph."""
    model, _ = build_nonzero_b(_opts(ckpt, **kw))
    block = model.model.layers[1]
    cos, sin = model.rope(torch.arange(23).expand(2, 23), torch.float32)
    x = torch.randn(2, 23, model.args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    dy = torch.randn(2, 23, model.args.dim, generator=torch.Generator().manual_seed(2))
    y = block(x, cos, sin, model.attention, None)
    wrt = [x] + [p for p in block.parameters() if p.requires_grad]
    return torch.autograd.grad(y, wrt, dy, retain_graph=True), torch.autograd.grad(y, wrt, dy)


@pytest.mark.parametrize("mem", [dict(), dict(tiled_mlp=True, tiled_attn=True)], ids=["ac", "tiled"])
def test_checkpointed_block_recomputes_again_for_a_retained_graph(ckpt, mem):
    """A checkpointed block's graph kept with retain_graph is recomputed once per backward: its recompute context
    is entered again (a one-shot context manager raised AttributeError there); both backwards give no AC's grads.
    --ac-keep-attn: torch's selective checkpoint allows one backward and says so (its error, not ours)."""
    ref = _retained_grads(ckpt, ac=False)[0]
    for i, got in enumerate(_retained_grads(ckpt, ac=True, **mem)):
        assert len(got) == len(ref) == 15
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **TOL, msg=f"{mem} backward {i + 1}")
    if not mem:
        with pytest.raises(RuntimeError, match="only allowed to backward once"):
            _retained_grads(ckpt, ac=True, ac_keep_attn=True)


@pytest.mark.parametrize("quant, mem", [("nf4", dict()), ("nf4", dict(ac_keep_attn=True)), ("nf4", dict(ac_group=2)),
                                        ("nf4", dict(ac_blocks=2)), ("none", dict())],
                         ids=["nf4", "keep_attn", "group2", "ac_blocks2", "plain_linear"])
def test_down_projection_base_skipped_in_block_recompute(ckpt3, quant, mem):
    """A block recompute does not run the down projection's 4-bit base GEMM (its output is read by nobody there):
    per step each block's down base runs once on all tokens (forward) where q's runs twice (forward + recompute);
    a group recompute (--ac-group 2: block 0, up to block 1's saved input) still runs it, a block outside --ac-blocks
    is never recomputed; an nn.Linear base (--quant none) saves its weight, so the probe leaves it alone and it
    runs in the recompute. The loss and every LoRA gradient equal no AC at all."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt3, quant=quant, **kw))
        calls = {}
        for i, block in enumerate(model.model.layers):
            for name in ("down_proj", "q_proj"):
                lin = getattr(block.mlp if name == "down_proj" else block.self_attn, name).base_layer
                wrapped = getattr(lin.forward, "forward", None)   # the _UnreadOutput's inner forward (down's)
                inner = wrapped or lin.forward

                def counting(x, key=(i, name), inner=inner):
                    if x.reshape(-1, x.shape[-1]).shape[0] > 1:   # not the one-row probe
                        calls[key] = calls.get(key, 0) + 1
                    return inner(x)
                if wrapped:
                    lin.forward.forward = counting
                else:
                    lin.forward = counting
        s, n = model(ids, labels=ids)
        (s / n).backward()
        return s.detach(), _lora_grads(model), calls

    ref = run(ac=False)
    got = run(ac=True, **mem)
    recomputed = {0, 1, 2} if "ac_blocks" not in mem else {0, 1}
    skipped = recomputed if quant == "nf4" else set()
    group_rerun = {0} if "ac_group" in mem else set()   # the first group's recompute runs block 0, up to 1's input
    for i in range(3):
        assert got[2][(i, "q_proj")] == 1 + (i in recomputed) + (i in group_rerun), (i, got[2])
        assert got[2][(i, "down_proj")] == 1 + (i in recomputed and i not in skipped) + (i in group_rerun), \
            (i, got[2])
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")


def test_skipping_a_base_that_saves_tensors_would_break_the_recompute(ckpt3):
    """What the probe guards: an nn.Linear base (--quant none) forced to skip in the recompute saves one tensor
    fewer there than in forward, which torch's checkpoint refuses (or would pair wrong tensors)."""
    model, _ = build_nonzero_b(_opts(ckpt3, quant="none", ac=True))
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    s, n = model(ids, labels=ids)
    assert all(b.mlp.down_proj.base_layer.forward.safe is False for b in model.model.layers)
    for b in model.model.layers:
        b.mlp.down_proj.base_layer.forward.safe = True
    with pytest.raises(Exception, match="(?i)recomput|saved|metadata"):
        (s / n).backward()


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_backward_tiles_run_no_down_or_o_proj_gemm(ckpt3, ac):
    """--tiled-mlp --tiled-attn: the backward tiles only differentiate the down projection's and o_proj's outputs,
    so their 4-bit bases run no GEMM in backward (zeros carrying dy @ W instead): the down base runs in forward
    only (under AC the tiled MLP skips its recompute too), o_proj's in forward and, under AC, in the block
    recompute (the post-attention norm saves its output). The loss and every LoRA gradient equal the untiled
    model without AC."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))

    def run(**kw):
        model, _ = build_nonzero_b(_opts(ckpt3, **kw))
        calls = {"down_proj": [], "o_proj": []}
        for block in model.model.layers:
            for name, lin in (("down_proj", block.mlp.down_proj), ("o_proj", block.self_attn.o_proj)):
                wrapper = lin.base_layer.forward

                def counting(x, name=name, inner=wrapper.forward):
                    if x.reshape(-1, x.shape[-1]).shape[0] > 1:   # not the one-row probe
                        calls[name].append(phase[0])
                    return inner(x)
                wrapper.forward = counting
        phase = ["forward"]
        s, n = model(ids, labels=ids)
        phase[0] = "backward"
        (s / n).backward()
        return s.detach(), _lora_grads(model), calls

    ref = run(ac=False)
    got = run(ac=ac, tiled_mlp=True, tiled_attn=True)
    down, o = got[2]["down_proj"], got[2]["o_proj"]
    assert down.count("forward") >= 3 and "backward" not in down, down
    assert o.count("forward") >= 3 and o.count("backward") == (o.count("forward") if ac else 0), o
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss")
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], **TOL, msg=f"grad {n}")
