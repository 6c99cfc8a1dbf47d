"""`--compile` (parallel/compile.py): torch.compile of RMSNorm, RoPE and SwiGLU changes no number.

Pins (CPU inductor, float32, a tiny Qwen2 checkpoint made by transformers, NF4 base, peft LoRA with B != 0, activation
checkpointing on): the compiled model's loss and every LoRA gradient equal the eager model's in one process (whole rows
under --ac-keep-attn; with --tiled-mlp --tiled-attn, whose tiles call the compiled pieces; over three lengths, tiled),
and on 2 gloo ranks (FSDP2 over cp 2 ring) equal the one-process eager model on every rank; with the tiles also
--train-norms (the norms' gradients). The compiled forwards really are compiled (dynamo wrappers on every RMSNorm,
Rotary and SwiGLU).
The one-process tests fill inductor's on-disk cache (the --ac-keep-attn one: whole rows), so the 2-rank one mostly
reuses their kernels.

Run: .venv/bin/python -m pytest -q tests/test_compile.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks
from tests.helpers import build_nonzero_b, tiny_checkpoint

TOL = dict(rtol=1e-4, atol=1e-6)   # fused float32 kernels may round in another order


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _opts(path, **kw):
    from parallel.parallelize import BuildOptions

    return BuildOptions(path, quant="nf4", lora_r=4, lora_alpha=8, seed=3, ac=True, **kw)


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, 20), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(12), torch.arange(8)]).expand(2, 20)   # two packed documents per row
    return ids, labels, pos


def _step(model, ids, labels, pos):
    lsum, n = model(ids, position_ids=pos, labels=labels)
    (lsum / n).backward()
    return (lsum / n).detach(), {k: p.grad for k, p in model.named_parameters() if p.requires_grad}


def _assert_compiled(model):
    """Every RMSNorm, Rotary and SwiGLU of `model` runs a dynamo-wrapped forward."""
    from model.llama import SwiGLU
    from model.rmsnorm import RMSNorm
    from model.rope import Rotary

    compiled = [m for m in model.modules() if isinstance(m, (RMSNorm, Rotary, SwiGLU))]
    forwards = [getattr(m.forward, "norm_forward", m.forward) for m in compiled]   # block norms: apply_norm_rebuild
    assert len(compiled) == 2 * 4 + 1 and all(hasattr(getattr(f, "compiled", f), "_torchdynamo_orig_callable")
                                                for f in forwards)


@pytest.mark.timeout(600)
def test_compile_equals_eager_one_process(ckpt):
    """Compiled with --tiled-mlp --tiled-attn vs eager untiled: the tiles run the compiled block norms, q/k norms and
    RoPE with grad in backward, and (--train-norms) the norms' weights are trained: their gradients too. (Untiled,
    whole rows, compiled = eager: test_compile_with_ac_keep_attn_compiles_and_equals_eager and the 2-rank test.)"""
    batch = _batch()
    ref_loss, ref_grads = _step(build_nonzero_b(_opts(ckpt, train_norms=True))[0], *batch)
    model, _ = build_nonzero_b(_opts(ckpt, compile=True, tiled_mlp=True, tiled_attn=True, train_norms=True))
    _assert_compiled(model)
    loss, grads = _step(model, *batch)
    torch.testing.assert_close(loss, ref_loss, **TOL, msg="loss")
    assert grads.keys() == ref_grads.keys() and len(grads) == 28 + 5
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], **TOL, msg=f"grad {k}")


@pytest.mark.timeout(600)
def test_compile_with_ac_keep_attn_compiles_and_equals_eager(ckpt, monkeypatch):
    """--compile --ac-keep-attn: the compiled pieces (every RMSNorm, Rotary and SwiGLU, on whole rows) still compile
    inside the selective-checkpoint cache (dynamo builds graphs) and the loss and LoRA grads equal eager plain AC; a
    torch whose cache would stop compilation refuses the pair up front (checked by pretending to be one)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.utils import checkpoint as c

    import train
    from parallel.cp import KernelAttention

    batch = _batch()
    ref_loss, ref_grads = _step(build_nonzero_b(_opts(ckpt), attention=KernelAttention())[0], *batch)
    torch._dynamo.reset()
    counters.clear()
    model, _ = build_nonzero_b(_opts(ckpt, compile=True, ac_keep_attn=True), attention=KernelAttention())
    _assert_compiled(model)
    loss, grads = _step(model, *batch)
    assert len(grads) == len(ref_grads) == 28
    assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
    torch.testing.assert_close(loss, ref_loss, **TOL, msg="loss")
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], **TOL, msg=f"grad {k}")
    monkeypatch.setattr(c._CachingTorchDispatchMode, "ignore_compile_internals", classmethod(lambda cls: False))
    args = train.build_parser().parse_args(["--compile", "--ac-keep-attn"])
    from parallel.flags import check_flags
    with pytest.raises(ValueError, match="--ac-keep-attn with --compile"):
        check_flags(args)


def _two_ranks(rank, world_size, path):
    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims

    ids, labels, pos = _batch()
    ref_loss, ref_grads = _step(build_nonzero_b(_opts(path))[0], ids, labels, pos)
    dims = ParallelDims.from_args(world_size, 1, -1, 2, "ring", None, n_heads=6, n_kv_heads=2)
    meshes = dims.build_mesh("cpu")
    model, _ = build_nonzero_b(_opts(path, compile=True), fsdp_mesh=meshes.fsdp,
                               attention=cp_attention(meshes, dims))
    c = meshes.cp.get_local_rank()
    lsum, n = model(shard_sequence(ids, dims, c, 0), position_ids=shard_sequence(pos, dims, c, None),
                    labels=shard_sequence(labels, dims, c, -100))
    tot = torch.stack([lsum.detach(), n.detach().to(lsum.dtype)])
    dist.all_reduce(tot)
    (lsum / tot[1]).backward()
    torch.testing.assert_close(tot[0] / tot[1], ref_loss, **TOL, msg=f"rank {rank}: loss")
    for k, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[k], **TOL, msg=f"rank {rank}: grad {k}")
    return True


@pytest.mark.timeout(600)
def test_compile_fsdp_ring_two_ranks_equals_one_process(ckpt):
    assert run_ranks(_two_ranks, 2, ckpt, timeout=560, pg_timeout=300) == [True, True]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mem", [dict(tiled_mlp=True), dict(tiled_mlp=True, tiled_attn=True)],
                         ids=["tiled_mlp", "tiled_mlp_and_attn"])
def test_compiled_pieces_stay_compiled_across_rows_tiles_and_lengths(ckpt, mem):
    """One compiled function serves every block, whole rows and tiles (--tiled-mlp, --tiled-attn), layer 0's input
    (no grad), no_grad forward tiles and AC recomputes, over three sequence lengths: each compiled function keeps
    few dynamo cache entries (a new length makes none: no size is specialised) and none reaches dynamo's limit,
    past which it would silently run eager; the loss and LoRA grads equal eager."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from model.llama import SwiGLU
    from model.rmsnorm import RMSNorm
    from model.rope import Rotary

    torch._dynamo.reset()
    eager, _ = build_nonzero_b(_opts(ckpt, **mem))
    model, _ = build_nonzero_b(_opts(ckpt, compile=True, **mem))
    g = torch.Generator().manual_seed(7)
    entries = []
    for length in (20, 23, 31):
        ids = torch.randint(0, 128, (2, length), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
        pos = torch.arange(length).expand(2, length)
        ref = _step(eager, ids, labels, pos)
        got = _step(model, ids, labels, pos)
        torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"loss at {length}")
        for k in ref[1]:
            torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"grad {k} at {length}")
        entries.append({cls.__name__: len(_debug_get_cache_entry_list(cls.forward.__code__))
                        for cls in (RMSNorm, Rotary, SwiGLU)})
    limit = torch._dynamo.config.recompile_limit
    assert entries[1] == entries[2] == entries[0], f"a new length recompiled: {entries}"
    # RMSNorm: rows with and without grad, layer 0's input, no_grad tiles (a rank more without rows-in, rows-out),
    # layer 0's rebuild for LoRA A (no grad, its input needing none)
    assert 0 < entries[-1]["RMSNorm"] <= 5 and 0 < entries[-1]["Rotary"] <= 2 and 0 < entries[-1]["SwiGLU"] <= 2 \
        and limit >= 8, (entries, limit)
