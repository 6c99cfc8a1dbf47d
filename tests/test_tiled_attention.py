"""--tiled-attn (parallel/tiled_attention.py): the attention sublayer over query tiles computes the untiled one.

Pins (CPU, float32, tiny random checkpoints written by transformers, NF4 base + LoRA on all seven projections with
B != 0, so every LoRA gradient is non-zero):
- loss and every LoRA gradient equal those of the untiled model, whose attention is torch SDPA per document
  (model.attention.SDPAAttention, the reference core), for tiles of 5 and 7 query rows (uneven; a document boundary
  inside a tile) and one tile, set through the default tile rule (kernels.BACKWARD_BLOCK // 4), with and without AC
  (tile 5 both, tile 7 with, one tile without; the untiled reference computed once per model and AC setting):
  Qwen2 (q/k/v bias), Qwen3 (q/k norms), Qwen3 with a 7-token sliding window on layer 0 and Mistral with an
  8-token window on both layers; rows far from position 0, one row of two packed documents;
- with LoRA dropout the gradients are those of the function forward computed: the reference runs the same tiles
  with autograd from the same seed (torch SDPA with an explicit mask per tile), and the masks really vary;
- with --offload-activations each block's release (the next block's input comes back) fires once per backward,
  from the tiles, after the block's kept attention output is freed;
- what it saves: no q, no LoRA intermediate of q/k/v/o (the planner's no-AC term equals the bytes autograd keeps
  is in test_plan); the tile rule; rows of documents keep off cuDNN (a graph per shape) on a GPU;
- a second-order gradient through it raises instead of returning a silently wrong one.
The train.py runs (1 rank, dp_shard 4 with FSDP2) are in test_train; the planner's CPU check in bench/plan.py.

Run: .venv/bin/python -m pytest -q tests/test_tiled_attention.py
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from tests.helpers import build_nonzero_b

TOL = dict(rtol=1e-5, atol=1e-6)
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096)
FAMILIES = {
    "qwen2": lambda: T.Qwen2Config(**COMMON),
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=24),
    "qwen3_window7": lambda: T.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=7,
                                           layer_types=["sliding_attention", "full_attention"]),
    "mistral_window8": lambda: T.MistralConfig(**COMMON, sliding_window=8),
}


def _save(cfg, path):
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():   # non-trivial norms (q/k norms included), so a skipped one shows
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: _save(make(), tmp_path_factory.mktemp(name)) for name, make in FAMILIES.items()}


def _opts(path, **kw):
    from parallel.parallelize import BuildOptions

    return BuildOptions(path, quant="nf4", lora_r=4, lora_alpha=8, seed=3, **kw)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 37), generator=g)
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    pos = pos.clone()
    pos[1, 20:] = torch.arange(17)   # row 1: two packed documents, the second from token 20
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    return ids, pos, labels


def _branched_batch():
    """Shared-prompt pairs (model.attention's branches): row 0 a prompt ++ answer of 20 tokens, a branch of 8 from
    position 12, then a document of 9; row 1 a prompt of 5 ++ answer of 16, a branch of 16 from position 5."""
    ids, _, labels = _batch()
    pos = torch.cat([torch.arange(20), torch.arange(12, 20), torch.arange(9)]), \
        torch.cat([torch.arange(21), torch.arange(5, 21)])
    return ids, torch.stack(pos), labels


def _loss_and_grads(model, batch=_batch):
    ids, pos, labels = batch()
    lsum, n = model(ids, position_ids=pos, labels=labels)
    (lsum / n).backward()
    return (lsum / n).detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def untiled(ckpts):
    """(family, ac, batch) -> the untiled model's (loss, grads) on `batch`, computed once: each is the reference of
    several tiles."""
    seen = {}

    def get(family, ac, batch=_batch):
        if (family, ac, batch) not in seen:   # the model's own core: torch SDPA
            seen[family, ac, batch] = _loss_and_grads(build_nonzero_b(_opts(ckpts[family], ac=ac))[0], batch)
        return seen[family, ac, batch]
    return get


# each tile (uneven 5 and 7, one tile) and both AC settings; a tile's code does not depend on AC (the block's
# checkpoint replays the same tiles): 4 of the 6 pairs
TILE_AC = pytest.mark.parametrize("tile,ac", [(5, False), (5, True), (7, True), (64, False)],
                                  ids=["tile5-no_ac", "tile5-ac", "tile7-ac", "one_tile-no_ac"])


@TILE_AC
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiled_attention_matches_untiled_sdpa(untiled, ckpts, family, tile, ac, monkeypatch):
    from parallel import kernels

    ref = untiled(family, ac)
    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 4 * tile)      # the default rule: min(BACKWARD_BLOCK // 4, ...)
    assert kernels.tile_rows(37) == min(tile, 256)
    model, _ = build_nonzero_b(_opts(ckpts[family], ac=ac, tiled_attn=True))
    got = _loss_and_grads(model)
    label = f"{family} tile {tile} ac {ac}"
    torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"{label}: loss")
    assert len(ref[1]) == 14 * 2 and all(g.abs().sum() > 0 for g in ref[1].values()), label
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"{label}: grad {k}")


@TILE_AC
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tiled_attention_with_shared_prompt_branches(untiled, ckpts, family, tile, ac, monkeypatch):
    """--tiled-attn with --dpo-share-prompt's rows: a branch's tiles see its parent's prompt too (the prefix's key
    blocks), as the reference SDPA with model.attention's mask does; a tile crosses the branch's start."""
    from model.attention import document_bounds, document_branches
    from parallel import kernels

    pos = _branched_batch()[1]
    assert document_branches(pos, document_bounds(pos)) == [[(20, 28, 0, 12)], [(21, 37, 0, 5)]]
    ref = untiled(family, ac, _branched_batch)
    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 4 * tile)
    model, _ = build_nonzero_b(_opts(ckpts[family], ac=ac, tiled_attn=True))
    got = _loss_and_grads(model, _branched_batch)
    label = f"{family} tile {tile} ac {ac}"
    torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"{label}: loss")
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"{label}: grad {k}")
    plain = untiled(family, ac)   # (the branches change the loss)
    assert abs(plain[0] - ref[0]) > 1e-4


def test_tile_rule():
    from parallel.kernels import tile_rows

    assert tile_rows(37) == 256 and tile_rows(4096) == 512 and tile_rows(131072) == 16384
    assert tile_rows(524288) == 16384 and tile_rows(4096, 100) == 100
    assert tile_rows(4608) == 640 and tile_rows(12800) == 1664   # multiples of 128: never 64 mod 128 (cuDNN)


def test_rows_of_documents_keep_off_cudnn(monkeypatch):
    """Packed rows call the kernels with one shape per document piece; where cuDNN would lead (it builds a graph
    per new shape) they take flash-attn, else torch's flash op; elsewhere the usual choice (None)."""
    from types import SimpleNamespace

    from parallel import kernel_choice
    from parallel.tiled_attention import _document_backend

    monkeypatch.setattr(kernel_choice, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(kernel_choice, "_cudnn_usable", lambda: True)
    monkeypatch.setattr(kernel_choice, "_fa", None)
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0")
    assert _document_backend(x, 128) == "sdpa_cuda"
    monkeypatch.setattr(kernel_choice, "_fa", object())
    assert _document_backend(x, 128) == "flash_attn"
    assert _document_backend(SimpleNamespace(is_cuda=True, dtype=torch.float32, device="cuda:0"), 128) is None
    monkeypatch.setattr(kernel_choice, "_capability", lambda device: (8, 0))   # no cuDNN lead on Ampere: untouched
    assert _document_backend(x, 128) is None
    assert _document_backend(torch.zeros(1, 2, 3), 128) is None


def test_tiled_attention_with_lora_dropout_replays_the_masks(ckpts, monkeypatch):
    """Each tile draws q's, k/v's and o_proj's dropout masks in forward; backward recomputes them from the RNG states
    forward saw. Reference: the same tiles, in the same order, run with autograd from the same seed."""
    from parallel import kernels

    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 20)   # 5-row tiles
    model, _ = build_nonzero_b(_opts(ckpts["qwen3"], ac=False, lora_dropout=0.3, tiled_attn=True))
    model.train()
    block = model.model.layers[1]
    attn, norm = block.self_attn, block.input_layernorm
    S, hd = 23, attn.head_dim
    pos = torch.arange(S).expand(2, S)
    cos, sin = model.rope(pos, torch.float32)
    x0 = torch.randn(2, S, model.args.dim, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, S, model.args.dim, generator=torch.Generator().manual_seed(2))

    def reference(x):
        outs, ks, vs = [], [], []
        for a in range(0, S, 5):
            e = min(a + 5, S)
            y = norm(x[:, a:e])
            q = attn.queries(y, cos[:, a:e], sin[:, a:e])[0]
            k, v = attn.keys_values(y, cos[:, a:e], sin[:, a:e])
            ks.append(k)
            vs.append(v)
            keep = torch.arange(a, e)[:, None] >= torch.arange(e)[None, :]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(ks, 1).transpose(1, 2),
                                               torch.cat(vs, 1).transpose(1, 2), attn_mask=keep, scale=hd ** -0.5,
                                               enable_gqa=True).transpose(1, 2)
            outs.append(attn.o_proj(o.flatten(2)))
        return torch.cat(outs, 1)

    def run(f, seed=7):
        x = x0.clone().requires_grad_()
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(seed)
        y = f(x)
        torch.manual_seed(99)   # whatever runs between forward and backward draws too
        y.backward(dy)
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in attn.named_parameters() if p.requires_grad}

    tiled = lambda x: attn(norm(x), cos, sin, model.attention, None)
    ref, got = run(reference), run(tiled)
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="output (the same masks)")
    torch.testing.assert_close(got[1], ref[1], **TOL, msg="input grad")
    assert len(ref[2]) == 8
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], **TOL, msg=f"grad {n}")
    other = run(tiled, seed=8)   # the masks matter: another seed gives another output and gradients
    assert (other[0] - got[0]).abs().max() > 1e-3 and (other[1] - got[1]).abs().max() > 1e-3


def test_offload_release_fires_once_per_block_from_the_tiles(ckpts):
    """--offload-activations: the tiles' backward releases the next block's input (HostOffload.release) once per
    block that has a predecessor, after its query tiles (the sublayer runs no core to hook)."""
    model, _ = build_nonzero_b(_opts(ckpts["qwen2"], ac=True, tiled_attn=True, offload_activations=True))
    hooks = model.model.layers[0].forward.hooks
    calls, release = [], hooks.release

    def alive():   # the attention outputs [B, S, H, hd] still referenced from Python at this moment
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (2, 37, 4, 16))
    hooks.release = lambda *a: (calls.append(alive()), release(*a))[1]
    got = _loss_and_grads(model)
    assert len(calls) == 2, f"{len(calls)} releases for 2 blocks"
    # the block's kept out (k, v, lse too) is dropped before the next block's input comes back
    assert calls == [0, 0], f"attention outputs alive at the releases: {calls}"
    model2, _ = build_nonzero_b(_opts(ckpts["qwen2"], ac=True))
    ref = _loss_and_grads(model2)
    torch.testing.assert_close(got[0], ref[0], **TOL, msg="loss with offload")
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"grad {k} with offload")


def test_saves_no_query_sized_tensor_but_the_output(ckpts):
    """No AC: a middle block's sublayer saves its input, k, v (RoPE applied), out and lse; nothing else of q's size
    (q, its LoRA intermediates, the norm's output) is kept for backward."""
    model, _ = build_nonzero_b(_opts(ckpts["qwen2"], ac=False, tiled_attn=True))
    ids, pos, labels = _batch()
    shapes = []
    block = model.model.layers[1]
    fwd = block.self_attn.forward

    def watched(*a):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            return fwd(*a)
    block.self_attn.forward = watched
    model(ids, position_ids=pos, labels=labels)
    B, S, D, H, K, hd = 2, 37, 64, 4, 2, 16
    assert sorted(shapes) == sorted([(B, S, D), (B, S, hd), (B, S, hd), (B, S, K, hd), (B, S, K, hd),
                                     (B, S, H, hd), (B, H, S)]), shapes


@pytest.mark.parametrize("mem", [dict(ac_group=2), dict(ac_blocks=1), dict(tiled_mlp=True, offload_activations=True)],
                         ids=["ac_group2", "ac_blocks1", "tiled_mlp_offload"])
def test_tiled_attention_composes_with_the_memory_flags(ckpts, mem, monkeypatch):
    """With the group recompute (both blocks in one group), a block left out of AC, the tiled MLP and offload:
    the untiled no-AC model's loss and LoRA gradients (5-row tiles)."""
    from parallel import kernels

    ref = _loss_and_grads(build_nonzero_b(_opts(ckpts["qwen3"], ac=False))[0])
    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 20)
    got = _loss_and_grads(build_nonzero_b(_opts(ckpts["qwen3"], ac=True, tiled_attn=True, **mem))[0])
    torch.testing.assert_close(got[0], ref[0], **TOL, msg=f"{mem}: loss")
    assert len(ref[1]) == 28
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], **TOL, msg=f"{mem}: grad {k}")


def test_double_backward_raises(ckpts):
    """The backward recomputes and differentiates the tiles once: create_graph through it raises (it would
    otherwise return gradients with no graph behind them)."""
    model, _ = build_nonzero_b(_opts(ckpts["qwen2"], ac=False, tiled_attn=True))
    ids, pos, labels = _batch()
    lsum, n = model(ids, position_ids=pos, labels=labels)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(lsum / n, params, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        sum(g.sum() for g in grads if g.requires_grad).backward()


def test_refused_with_a_cp_attention_core(ckpts):
    """build_model refuses --tiled-attn with a context-parallel core before any weight is read (the CLI refuses
    --cp > 1 earlier, in parallel.mesh.validate); a sublayer handed a CP core's document ids refuses too."""
    from parallel.cp import ContextParallelAttention
    from parallel.mesh import ParallelDims

    dims = ParallelDims.from_args(2, 1, -1, 2, "ring", None, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="--tiled-attn tiles one process's .* drop one of them"):
        build_nonzero_b(_opts(ckpts["qwen2"], tiled_attn=True), attention=ContextParallelAttention(dims, *[None] * 3))
    model, _ = build_nonzero_b(_opts(ckpts["qwen2"], ac=False, tiled_attn=True))
    x = torch.randn(1, 8, model.args.dim)
    cos, sin = model.rope(torch.arange(8)[None], torch.float32)
    with pytest.raises(ValueError, match="runs the attention on one process .* use --cp 1"):
        model.model.layers[0].self_attn(x, cos, sin, model.attention, torch.zeros(1, 8, dtype=torch.long))
