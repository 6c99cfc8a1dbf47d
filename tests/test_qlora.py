"""QLoRA on FSDP2: 4-bit bits survive sharding, and the assembled model computes one process's math.

Pins (gloo on CPU, float32): for a tiny Qwen2 checkpoint (6 query / 2 KV heads) built by transformers (and a Qwen3
and a Llama 3 one, each on one 4-rank layout),
- the packed NF4 bits of every layer, gathered from the FSDP2 shards, equal the single-process
  quantization exactly (compared as integers), at 1, 2 and 4 ranks;
- the logits, the loss and every LoRA gradient of the assembled model on 2 ranks (dp_shard 2; cp 2
  ring) and 4 ranks (cp 4 hybrid 2 × 2 via auto with 6 heads / 2 KV heads; HSDP dp_replicate 2 × dp_shard 2, and
  × cp 2 ring; Qwen3 under cp 2 Ulysses × dp_shard 2, Llama 3 under cp 2 ring × dp_shard 2, tied embeddings on
  dp_shard 4; DoRA on dp_shard 2, cp 2 ring × dp_shard 2 (nf4, LoRA on block 1 alone) and cp 2 Ulysses × dp_shard 2
  (plain), its magnitudes moved off their start and gradients checked too) equal those of the unsharded
  single-process model on the whole batch, with nf4 and with plain weights;
- the clipped global gradient norm equals the single-process `clip_grad_norm_`;
- the LoRA init is identical on every layout (it depends on the seed only);
- with CUDA's dtypes on gloo (`BuildOptions.mixed_precision`: FSDP2 hands the float32 trained tensors to forward in
  bf16 over a bf16 NF4 base, gradients reduced in float32): LoRA, DoRA, --train-norms, a tied --train-embeddings and
  all of them under cp 2 Ulysses with the tiled MLP reach forward in bf16, and their loss (5e-3) and every trained
  tensor's gradient (3e-2 of its norm; the largest seen 1.9e-2) equal the float32 single-process model's.

Each layout is a named case (ONE_RANK, TWO_RANKS, FOUR_RANKS); a failure names the case and the quantity.

Run: .venv/bin/python -m pytest -q tests/test_qlora.py
"""

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks
from tests.helpers import tiny_checkpoint

TOL = dict(rtol=1e-5, atol=1e-5)


def check_layout_equals_one_process(rank, world_size, path, quant, cp, impl, fsdp, replicate=1, dora=False,
                                    layers=None):
    """Build this layout's model and the single-process reference on every rank, run one forward and
    backward on the same global batch, and assert: target count, global mean loss, global grad norm,
    the LoRA init and every LoRA gradient, the NF4 codes and absmax as integers, and the logits."""
    from model.nf4 import NF4Linear
    from parallel.cp import cp_attention, shard_sequence
    from parallel.fsdp import clip_grad_norm_
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, lora_parameters
    from tests.helpers import build_nonzero_b

    cfg = BuildOptions(path, quant=quant, lora_r=4, lora_alpha=8, ac=True, seed=3, dora=dora, lora_layers=layers)
    ref, _ = build_nonzero_b(cfg)                                    # plain module, whole batch
    dims = ParallelDims.from_args(world_size, replicate, -1, cp, impl, None, n_heads=6, n_kv_heads=2)
    meshes = dims.build_mesh("cpu")
    attn = cp_attention(meshes, dims) if cp > 1 else None
    model, _ = build_nonzero_b(cfg, fsdp_mesh=meshes.fsdp if fsdp else None, attention=attn)
    if dora:   # magnitudes off their start (there m / ‖W + s·B A‖ is 1), the same on both: DoRA's rescaling counts
        _move_magnitudes(ref), _move_magnitudes(model)

    # the same global batch on every rank; data rank d takes rows d::dp, cp rank c its shard
    g = torch.Generator().manual_seed(11)
    B, S = 4, 21
    ids = torch.randint(0, 128, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    labels[0, :7] = -100
    pos = torch.arange(S).expand(B, S)

    # reference: one process, whole batch
    rsum, rn = ref(ids, position_ids=pos, labels=labels)
    (rsum / rn).backward()
    ref_norm = clip_grad_norm_(lora_parameters(ref), 1e9)
    with torch.no_grad():
        ref_logits = ref(ids, position_ids=pos)

    d, cr = meshes.dp.get_local_rank(), meshes.cp.get_local_rank()
    rows = slice(d * B // dims.dp, (d + 1) * B // dims.dp)
    lids = shard_sequence(ids[rows], dims, cr, 0)
    llab = shard_sequence(labels[rows], dims, cr, -100)
    lpos = shard_sequence(pos[rows], dims, cr, None)
    lsum, ln = model(lids, position_ids=lpos, labels=llab)
    total = ln.detach().clone()
    dist.all_reduce(total, group=meshes.dp_cp.get_group())       # the GLOBAL target count
    loss_total = lsum.detach().clone()
    dist.all_reduce(loss_total, group=meshes.dp_cp.get_group())
    (lsum / total).backward()
    norm = clip_grad_norm_(lora_parameters(model), 1e9)

    out = {}
    torch.testing.assert_close(total, rn.float() if total.is_floating_point() else rn, msg="target count")
    torch.testing.assert_close(loss_total / total, rsum / rn, **TOL, msg="global mean loss")
    torch.testing.assert_close(norm, ref_norm, **TOL, msg="global grad norm")
    ref_p = dict(ref.named_parameters())
    n_lora = 0
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if p.requires_grad:
            n_lora += 1
            torch.testing.assert_close(full.detach(), ref_p[n].detach(), rtol=0, atol=0, msg=f"init {n}")
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, ref_p[n].grad, **TOL, msg=f"grad {n}")
    per = 4 if ref.args.fused else 7   # (Phi-3: qkv_proj, gate_up_proj for five of them)
    assert n_lora == (3 if dora else 2) * per * len(layers or (0, 1)), n_lora   # (DoRA: A, B and the magnitude)
    # packed NF4 bits: gathered shards == single-process quantization, as integers
    ref_mods = dict(ref.named_modules())
    n_nf4 = 0
    for n, m in model.named_modules():
        if isinstance(m, NF4Linear):
            n_nf4 += 1
            w = m.weight.full_tensor() if hasattr(m.weight, "full_tensor") else m.weight
            assert torch.equal(w.detach().view(torch.uint8), ref_mods[n].weight.detach().view(torch.uint8)), n
            assert torch.equal(m.state().absmax, ref_mods[n].state().absmax), n
    assert n_nf4 == (2 * per if quant == "nf4" else 0)
    # logits of this rank's shard (no-grad path) equal the reference's at the same tokens
    with torch.no_grad():
        logits = model(lids, position_ids=lpos)
    ref_local = shard_sequence(ref_logits[rows], dims, cr, 0.0)
    keep = llab != -100   # padded positions hold padding logits on both sides; compare real ones
    torch.testing.assert_close(logits[keep], ref_local[keep], **TOL, msg="logits")
    out["n_lora"] = n_lora
    return out


def _move_magnitudes(model):
    """Each DoRA magnitude × (1 + 0.1·N(0, 1)), drawn from its name (this rank's shard of the full draw)."""
    from model.nf4 import _full
    from model.qlora import _generator, set_param

    for n, p in model.named_parameters():
        if "lora_magnitude_vector" in n:
            set_param(p, _full(p) * (1 + 0.1 * torch.randn(p.shape, generator=_generator(0, n))))


def _cases(rank, world_size, paths, cases):
    """Several layouts per spawn (spawning costs seconds): each case builds its own mesh, on its family's checkpoint."""
    for label, case in cases.items():
        case = dict(case)
        try:
            check_layout_equals_one_process(rank, world_size, paths[case.pop("family", "qwen2")], **case)
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from e
    return len(cases)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny random checkpoints saved by transformers, 6 query / 2 KV heads, 2 layers, vocabulary 128: Qwen2 (q/k/v
    bias), also with tied embeddings (the loss's vocabulary matrix is the sharded embedding); Qwen3 (q/k RMSNorms, no
    bias, head_dim 16 while hidden / heads is 8); Llama 3 (llama3 RoPE scaling from 16 original positions: its
    frequency bands differ from plain RoPE at these positions, no bias)."""

    import transformers as T

    def save(cfg, name):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        T.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path, max_shard_size="60KB")
        return str(path)

    common = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=4096)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    return {"qwen2": tiny_checkpoint(tmp_path_factory.mktemp("ckpt")),
            "tied": tiny_checkpoint(tmp_path_factory.mktemp("tied"), tie=True),
            "qwen3": save(T.Qwen3Config(**common, head_dim=16), "qwen3"),
            "llama3": save(T.LlamaConfig(**common, rope_parameters=llama3), "llama3")}


def layout(quant, cp=1, impl="ulysses", replicate=1, family="qwen2", dora=False, layers=None):
    return dict(quant=quant, cp=cp, impl=impl, fsdp=True, replicate=replicate, family=family, dora=dora, layers=layers)


ONE_RANK = {"nf4, FSDP2 on 1 rank": layout("nf4")}
TWO_RANKS = {"nf4, dp_shard 2": layout("nf4"), "plain weights, dp_shard 2": layout("none"),
             "nf4, cp 2 ring": layout("nf4", 2, "ring"), "DoRA, nf4, dp_shard 2": layout("nf4", dora=True)}
# (each case costs seconds on every rank: none repeats another's code path; a plain dp_shard 4 runs in the tied one, a
# qwen2 cp 2 Ulysses × dp_shard 2 in Qwen3's, plain weights under ring in HSDP 2 × cp 2 ring, the tied embedding under
# cp in none: it is sharded by dp_shard only, the sequence cut does not reach it)
FOUR_RANKS = {"nf4, cp 4 hybrid (auto: Ulysses 2 × ring 2)": layout("nf4", 4, "auto"),
              "nf4, HSDP dp_replicate 2 × dp_shard 2": layout("nf4", replicate=2),
              "plain weights, HSDP 2 × cp 2 ring": layout("none", 2, "ring", replicate=2),
              "Qwen3, nf4, cp 2 Ulysses × dp_shard 2": layout("nf4", 2, family="qwen3"),
              "Llama 3, nf4, cp 2 ring × dp_shard 2": layout("nf4", 2, "ring", family="llama3"),
              "tied embeddings, nf4, dp_shard 4": layout("nf4", family="tied"),
              "DoRA, --lora-layers 1 (block 0 runs no backward), nf4, cp 2 ring × dp_shard 2":
                  layout("nf4", 2, "ring", dora=True, layers=(1,)),
              "DoRA, plain weights, cp 2 Ulysses × dp_shard 2": layout("none", 2, dora=True)}


@pytest.mark.timeout(300)
def test_fsdp2_on_one_rank_equals_one_process(ckpt):
    assert run_ranks(_cases, 1, ckpt, ONE_RANK, timeout=280) == [len(ONE_RANK)]


@pytest.mark.timeout(300)
def test_two_rank_layouts_equal_one_process(ckpt):
    assert run_ranks(_cases, 2, ckpt, TWO_RANKS, timeout=280) == [len(TWO_RANKS)] * 2


@pytest.mark.timeout(300)
def test_four_rank_layouts_equal_one_process(ckpt):
    assert run_ranks(_cases, 4, ckpt, FOUR_RANKS, timeout=280) == [len(FOUR_RANKS)] * 4


def _move(model, which):
    """Each trained tensor that `which(name)` picks × (1 + 0.1·N(0, 1)), drawn from its name (this rank's shard of
    the full draw): DoRA's magnitudes, trained norms and embedding off their start, the same on every layout."""
    from model.nf4 import _full
    from model.qlora import _generator, set_param

    for n, p in model.named_parameters():
        if p.requires_grad and which(n):
            set_param(p, _full(p) * (1 + 0.1 * torch.randn(p.shape, generator=_generator(0, n))))


def check_mixed_precision(rank, world_size, paths, cases):
    """The CUDA path's dtypes on gloo (`BuildOptions.mixed_precision`): FSDP2 hands the float32 LoRA tensors, DoRA's
    magnitudes and the trained norms and embedding to forward in bf16 over a bf16 NF4 base, and reduces their
    gradients in float32. Per case: the forward sees them in bf16, and the loss and every trained tensor's gradient
    equal the float32 single-process model's within bf16's rounding (relative to each gradient's norm)."""
    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    g = torch.Generator().manual_seed(11)
    B, S = 2, 24
    ids = torch.randint(0, 128, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    pos = torch.arange(S).expand(B, S)
    worst = {}
    for label, case in cases.items():
        case = dict(case)
        path, cp = paths[case.pop("family", "qwen2")], case.pop("cp", 1)
        opts = dict(quant="nf4", lora_r=4, lora_alpha=8, ac=True, seed=3, **case)
        moved = lambda n: "lora_magnitude_vector" in n or n.endswith("norm.weight") or "embed_tokens" in n
        ref, _ = build_nonzero_b(BuildOptions(path, **opts))
        dims = ParallelDims.from_args(world_size, 1, -1, cp, "ulysses", None, n_heads=6, n_kv_heads=2)
        meshes = dims.build_mesh("cpu")
        model, _ = build_nonzero_b(BuildOptions(path, dtype=torch.bfloat16, mixed_precision=True, **opts),
                                   fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims) if cp > 1 else None)
        _move(ref, moved), _move(model, moved)
        seen = {}   # the dtype each trained tensor reaches forward in
        hooks = [m.register_forward_pre_hook(lambda m, a, name=name, seen=seen: seen.update(
            {f"{name}.{k}": p.dtype for k, p in m.named_parameters(recurse=False) if p.requires_grad}))
            for name, m in model.named_modules()]
        rsum, rn = ref(ids, position_ids=pos, labels=labels)
        (rsum / rn).backward()
        d, cr = meshes.dp.get_local_rank(), meshes.cp.get_local_rank()
        rows = slice(d * B // dims.dp, (d + 1) * B // dims.dp)
        lsum, ln = model(shard_sequence(ids[rows], dims, cr, 0), position_ids=shard_sequence(pos[rows], dims, cr, None),
                         labels=shard_sequence(labels[rows], dims, cr, -100))
        for h in hooks:
            h.remove()
        total, loss = ln.detach().float(), lsum.detach().float()
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
        dist.all_reduce(loss, group=meshes.dp_cp.get_group())
        (lsum / total).backward()
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert seen and set(seen.values()) == {torch.bfloat16}, f"{label}: forward dtypes {set(seen.values())}"
        assert {n.removeprefix("model.") for n in trained} >= {n.split(".", 1)[1] for n in seen} - {""}, label
        err = {"loss": abs((loss / total).item() - (rsum / rn).item()) / (rsum / rn).item()}
        ref_p = dict(ref.named_parameters())
        for n, p in trained.items():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert grad.dtype == torch.float32, (label, n, grad.dtype)
            want = ref_p[n].grad
            err[n] = ((grad - want).norm() / want.norm()).item()
        worst[label] = max(err.items(), key=lambda kv: kv[1])
        assert err["loss"] < 5e-3 and all(e < 3e-2 for e in err.values()), (label, sorted(err.items(),
                                                                                      key=lambda kv: -kv[1])[:4])
    return worst


MIXED = {"LoRA, dp_shard 2": {}, "DoRA, dp_shard 2": {"dora": True},
         "--train-norms, dp_shard 2": {"train_norms": True},
         "tied --train-embeddings, dp_shard 2": {"family": "tied", "train_embeddings": True},
         "DoRA + norms + embedding, cp 2 Ulysses, tiled MLP": {"cp": 2, "dora": True, "train_norms": True,
                                                               "train_embeddings": True, "tiled_mlp": True}}


@pytest.mark.timeout(300)
def test_bf16_mixed_precision_as_on_cuda_matches_float32(ckpt):
    """What only the GPU ran before (FSDP2's bf16 mixed precision: DoRA, trained norms, a tied trained embedding, the
    chunked loss's float32 head gradient) runs on gloo with CUDA's dtypes, against the float32 model."""
    worst = run_ranks(check_mixed_precision, 2, ckpt, MIXED, timeout=280)   # (each case's largest error, per rank)
    assert len(worst) == 2 and set(worst[0]) == set(MIXED), worst
