"""Qwen3-MoE (`model_type: qwen3_moe`, model/moe.py's sparse MLP on Qwen3's decoder) computes what transformers'
Qwen3MoeForCausalLM does.

Pins (CPU, float32 unless said; tiny random checkpoints saved by transformers 5, whose save_pretrained writes the
experts split, `mlp.experts.{e}.gate_proj.weight`, as the Hub's are; 4 experts, top 2, 3 blocks of which block 1 is
dense through mlp_only_layers; norm_topk_prob false and true; router weights drawn large so the top 2 are decided,
norm weights away from 1):
- logits = transformers' on whole rows and on a packed row of two documents; a mutated router (no renormalisation,
  softmax after the top k, the experts' weights swapped, the softmax in the compute dtype) is caught;
- config.json read as transformers reads it (num_experts or num_local_experts, mlp_only_layers, decoder_sparse_step,
  Qwen3MoeConfig's defaults); output_router_logits true refused naming the key;
- LoRA's loss and every LoRA gradient = peft's on the transformers model (attention targets), plain and under AC +
  tiled MLP; MLP targets (the experts', and peft's reading of them) refused naming --lora-targets attn;
- --lora-targets not given: each bench/configs model's default (the attention's on Qwen3-MoE, GPT-OSS, Qwen3.5-MoE,
  said once; DEFAULT_TARGETS less the names a model lacks on the others), and --plan on the MoE ones without it;
- nf4: the experts' projections are NF4, the router stays in the compute dtype; AC = no AC;
- one process = cp 2 ring = cp 2 Ulysses (2 ranks, gloo): loss, grad norm and every LoRA gradient on every rank.

Run: .venv/bin/python -m pytest -q tests/test_qwen3_moe.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model

SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
             mlp_only_layers=[1], max_position_embeddings=4096, rope_theta=3e4)
CONFIGS = {"renorm": dict(SIZES, norm_topk_prob=True), "plain": dict(SIZES, norm_topk_prob=False)}
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def save_checkpoint(path, cfg: dict) -> str:
    """A random Qwen3MoeForCausalLM of `cfg` saved by transformers (module docstring); returns the path."""
    torch.manual_seed(0)
    hf = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**cfg)).float().eval()
    with torch.no_grad():   # norm weights start at 1 (a dropped one hidden); a router of std 0.02 routes by a hair
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path, max_shard_size="60KB")
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: save_checkpoint(tmp_path_factory.mktemp(name), cfg) for name, cfg in CONFIGS.items()}


def _hf(path):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.mark.parametrize("name", ["renorm", "plain"])
def test_logits_match_transformers(ckpts, name):
    from model.moe import MoE

    hf, ours = _hf(ckpts[name]), model.from_pretrained(ckpts[name]).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert [isinstance(b.mlp, MoE) for b in ours.model.layers] == [True, False, True]
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_router_and_block_match_transformers(dtype, norm_topk):
    """MoE.route = transformers' Qwen3MoeTopKRouter bit for bit (softmax in float32, top k, renormalised, cast back to
    the compute dtype: a softmax in bf16 or a renormalisation dropped or added differ); the MoE block =
    Qwen3MoeSparseMoeBlock (eager experts) on the same weights, in float32 and bf16."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from model.moe import MoE, MoESpec

    cfg = T.Qwen3MoeConfig(**dict(SIZES, norm_topk_prob=norm_topk))
    cfg._experts_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    theirs, ours = Qwen3MoeSparseMoeBlock(cfg).to(dtype), MoE(48, MoESpec(4, 2, 32, norm_topk)).to(dtype)
    with torch.no_grad():
        theirs.gate.weight.copy_(torch.randn(4, 48, generator=g) * 0.5)
        theirs.experts.gate_up_proj.copy_(torch.randn(4, 64, 48, generator=g) * 0.2)
        theirs.experts.down_proj.copy_(torch.randn(4, 48, 32, generator=g) * 0.2)
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, ex in enumerate(ours.experts):
            ex.gate_proj.weight.copy_(theirs.experts.gate_up_proj[e, :32])
            ex.up_proj.weight.copy_(theirs.experts.gate_up_proj[e, 32:])
            ex.down_proj.weight.copy_(theirs.experts.down_proj[e])
    x = torch.randn(3, 11, 48, generator=g).to(dtype)
    with torch.no_grad():
        _, w_ref, idx_ref = theirs.gate(x.view(-1, 48))
        w, idx = ours.route(x.view(-1, 48))
        assert torch.equal(idx, idx_ref), "experts chosen"
        assert w.dtype == w_ref.dtype == dtype
        torch.testing.assert_close(w, w_ref, rtol=0, atol=0, msg="routing weights")
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(ours(x), theirs(x), **tol, msg="block output")


def test_config_read_as_transformers_reads_it():
    """Qwen3-30B-A3B's config.json (bench/configs/qwen3-30b-a3b, from the model card) and a bare one (Qwen3MoeConfig's
    defaults: 4 KV heads, head_dim hidden / heads, 128 experts, top 8, width 768, no renormalisation); the blocks
    transformers makes MoE (mlp_only_layers, decoder_sparse_step); num_local_experts (what transformers 5 writes) as
    num_experts; refusals naming the key."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    with open(os.path.join(BENCH, "qwen3-30b-a3b", "config.json")) as f:
        hub = json.load(f)
    a = model.ModelArgs.from_config_dict(hub)
    assert (a.model_type, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size, a.rope_theta,
            a.max_position_embeddings, a.qk_norm, a.sliding_window) == (
        "qwen3_moe", 2048, 48, 32, 4, 128, 151936, 1e6, 40960, True, None)
    assert (a.moe.experts, a.moe.top_k, a.moe.width, a.moe.norm_topk) == (128, 8, 768, True)
    assert all(a.moe.sparse(i) for i in range(48))
    bare = {k: SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads")} | {"num_attention_heads": 8}   # (4 KV heads by default)
    b, w = model.ModelArgs.from_config_dict({"model_type": "qwen3_moe", **bare}), T.Qwen3MoeConfig(**bare)
    assert (b.n_kv_heads, b.head_dim, b.moe.experts, b.moe.top_k, b.moe.width, b.moe.norm_topk, b.norm_eps,
            b.max_position_embeddings) == (w.num_key_value_heads, 48 // 8, w.num_experts, w.num_experts_per_tok,
                                           w.moe_intermediate_size, w.norm_topk_prob, w.rms_norm_eps,
                                           w.max_position_embeddings)
    for extra in (dict(mlp_only_layers=[0, 2]), dict(decoder_sparse_step=2), dict(decoder_sparse_step=2,
                                                                                     mlp_only_layers=[3]),
                  dict(num_hidden_layers=4, num_local_experts=3, num_experts_per_tok=3)):
        cfg = dict(bare, num_hidden_layers=4, **{k: v for k, v in extra.items() if k != "num_hidden_layers"})
        c = model.ModelArgs.from_config_dict({"model_type": "qwen3_moe", **cfg})
        hf = T.Qwen3MoeConfig(**cfg)
        want = [isinstance(Qwen3MoeDecoderLayer(hf, i).mlp, Qwen3MoeSparseMoeBlock) for i in range(4)]
        assert [c.moe.sparse(i) for i in range(4)] == want, extra
        assert c.moe.experts == hf.num_experts, extra
    slide = model.ModelArgs.from_config_dict({"model_type": "qwen3_moe", **bare, "use_sliding_window": True,
                                              "sliding_window": 16})
    assert [slide.window(i) for i in range(3)] == [16] * 3   # every layer, as Qwen3MoeAttention
    with pytest.raises(ValueError, match="output_router_logits"):
        model.ModelArgs.from_config_dict({"model_type": "qwen3_moe", **bare, "output_router_logits": True})
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is more than num_experts 8"):
        model.ModelArgs.from_config_dict({"model_type": "qwen3_moe", **bare, "num_experts": 8,
                                          "num_experts_per_tok": 9})


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True)], ids=["plain", "ac_tiled_mlp"])
def test_lora_grads_match_peft_on_transformers(ckpts, mem):
    """peft's LoRA on transformers' model with our adapter's values: the same loss and every LoRA gradient (the
    routing weights' gradient flows into the hidden states through the frozen router, as in transformers); the tiled
    MLP routes each tile's tokens as the whole row's."""

    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpts["renorm"], quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=ATTN, **mem))
    assert_lora_grads_match_peft(_hf(ckpts["renorm"]), ATTN, ours, peft_model, ids, labels, 2 * 4 * 3)


def test_lora_on_experts_refused_naming_the_fix(ckpts):
    """The MLP names would adapt each expert's projections (and peft on transformers' model reads them as its experts'
    fused parameters, adapting no dense block's MLP): named, refused at start-up (the flag checks, before any weight is
    read) and by build_model, naming --lora-targets attn; attn passes (and no --lora-targets:
    test_default_targets_are_the_models)."""
    import train
    from parallel.flags import check_model_flags
    from parallel.parallelize import BuildOptions, build_model

    margs = model.ModelArgs.from_config_dict(json.load(open(os.path.join(ckpts["renorm"], "config.json"))))
    for flags in (["--lora-targets", "attn,mlp"], ["--lora-targets", "mlp"],
                  ["--lora-targets", "down_proj", "--lora-layers", "1"]):
        args = train.build_parser().parse_args(["--model", ckpts["renorm"], *flags])
        with pytest.raises(ValueError, match=r"experts' projections in its MoE blocks \(2 of 3\).*--lora-targets attn"):
            check_model_flags(args, margs)
    check_model_flags(train.build_parser().parse_args(["--model", ckpts["renorm"], "--lora-targets", "attn"]), margs)
    with pytest.raises(ValueError, match="--lora-targets attn"):
        build_model(BuildOptions(ckpts["renorm"], quant="none"), device="cpu")


def test_nf4_experts_and_ac(ckpts):
    """nf4: every expert's projection and the dense MLP's are NF4, the router stays a plain Linear in the compute
    dtype; AC's block recompute and AC + tiled MLP give no-AC's loss and LoRA gradients."""
    from model.moe import MoE
    from model.nf4 import NF4Linear
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    got = {}
    for label, mem in (("no AC", dict(ac=False)), ("AC", dict(ac=True)), ("AC, tiled", dict(ac=True, tiled_mlp=True))):
        ours, peft_model = build_nonzero_b(BuildOptions(ckpts["plain"], quant="nf4", lora_r=4, lora_alpha=8, seed=3,
                                                        lora_targets=ATTN, **mem))
        moe = ours.model.layers[0].mlp
        assert isinstance(moe, MoE) and type(moe.gate) is torch.nn.Linear and moe.gate.weight.dtype == torch.float32
        nf4 = [n for n, m in ours.named_modules() if isinstance(m, NF4Linear)]
        assert len(nf4) == 3 * 4 + 2 * 4 * 3 + 3 and not any(n.endswith("mlp.gate") for n in nf4), nf4
        s, n = ours(ids, labels=ids)
        (s / n).backward()
        got[label] = s.detach(), {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    for label in ("AC", "AC, tiled"):
        torch.testing.assert_close(got[label][0], got["no AC"][0], rtol=1e-5, atol=1e-5, msg=f"{label}: loss")
        for k, g in got["no AC"][1].items():
            torch.testing.assert_close(got[label][1][k], g, rtol=1e-4, atol=1e-6, msg=f"{label}: grad {k}")


def _cp_equals_one_process(rank, world_size, path, cases):
    """Each case, (quant, cp impl[, LoRA targets]): one process on the whole batch = this cp layout (FSDP2 over both
    ranks): global loss, grad norm, every LoRA gradient, the experts' NF4 codes as integers."""
    import torch.distributed as dist

    from model.nf4 import NF4Linear
    from parallel.cp import cp_attention, shard_sequence
    from parallel.fsdp import clip_grad_norm_
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, lora_parameters
    from tests.helpers import build_nonzero_b

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 21), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.arange(21).expand(2, 21)
    for label, (quant, impl, *targets) in cases.items():   # (targets: ATTN unless a case names its own)
        cfg = BuildOptions(path, quant=quant, lora_r=4, lora_alpha=8, ac=True, seed=3,
                           lora_targets=(targets or [ATTN])[0])
        ref, _ = build_nonzero_b(cfg)
        rsum, rn = ref(ids, position_ids=pos, labels=labels)
        (rsum / rn).backward()
        ref_norm = clip_grad_norm_(lora_parameters(ref), 1e9)
        dims = ParallelDims.from_args(world_size, 1, -1, 2, impl, None, n_heads=6, n_kv_heads=2)
        meshes = dims.build_mesh("cpu")
        ours, _ = build_nonzero_b(cfg, fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims))
        cr = meshes.cp.get_local_rank()
        lsum, ln = ours(*(shard_sequence(t, dims, cr, fill) for t, fill in ((ids, 0),)),
                        position_ids=shard_sequence(pos, dims, cr, None), labels=shard_sequence(labels, dims, cr, -100))
        total, loss = ln.detach().clone(), lsum.detach().clone()
        dist.all_reduce(total), dist.all_reduce(loss)
        (lsum / total).backward()
        norm = clip_grad_norm_(lora_parameters(ours), 1e9)
        torch.testing.assert_close(loss / total, rsum / rn, rtol=1e-5, atol=1e-5, msg=f"{label}: loss")
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-5, msg=f"{label}: grad norm")
        want, mods = dict(ref.named_parameters()), dict(ref.named_modules())
        for n, p in ours.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad.full_tensor(), want[n].grad, rtol=1e-5, atol=1e-5,
                                           msg=f"{label}: grad {n}")
        for n, m in ours.named_modules():
            if isinstance(m, NF4Linear) and ".experts." in n:
                assert torch.equal(m.weight.full_tensor().view(torch.uint8), mods[n].weight.view(torch.uint8)), n
    return len(cases)


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    from tests.dist import run_ranks

    cases = {"nf4, cp 2 Ulysses": ("nf4", "ulysses"), "plain weights, cp 2 ring": ("none", "ring")}
    assert run_ranks(_cp_equals_one_process, 2, ckpts["renorm"], cases, timeout=280) == [len(cases)] * 2


def _trained(path, quant):
    """Our model with a nonzero LoRA on the attention (as after training) and its peft wrapper."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    return build_nonzero_b(BuildOptions(path, quant=quant, lora_r=4, lora_alpha=8, seed=3, lora_targets=ATTN,
                                        ac=False), b_std=0.2)


def _peft_loaded(base, adapter, nf4=False):
    """peft's model of our adapter on transformers' base (nf4: on its NF4 round trip, data/demo_compare.py's)."""
    import warnings

    from peft import PeftModel

    from data.demo_compare import nf4_round_trip

    hf = _hf(base)
    if nf4:
        nf4_round_trip(hf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(hf, adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    return pm


def test_exported_adapter_loads_in_peft_with_our_logits(ckpts, tmp_path):
    from model.export import export_adapter

    ours, peft_model = _trained(ckpts["renorm"], "none")
    export_adapter(peft_model, str(tmp_path / "a"), ckpts["renorm"], quant="none")
    pm = _peft_loaded(ckpts["renorm"], str(tmp_path / "a"))
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
        with pm.disable_adapter():
            assert rel(pm(input_ids=ids).logits, ours(ids)) > 1e-3, "the adapter changes nothing"
    assert sum(n.endswith(".lora_A") for n, _ in pm.named_modules()) == 4 * 3


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_merge_is_what_peft_merges(ckpts, tmp_path, quant):
    """`python -m model.merge`: transformers loads the merge with no missing or unexpected key and peft's
    merge_and_unload logits, on the base as stored (quant none) or on its NF4 round trip (nf4: each expert's gate, up
    and down and the attention and dense MLP as training quantized them; data/demo_compare.py's round trip of
    transformers' model, its fused experts too); the router and norms as stored, bit for bit."""
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter

    base = ckpts["plain"]
    ours, peft_model = _trained(base, quant)
    export_adapter(peft_model, str(tmp_path / "a"), base, quant=quant)
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a"), quant == "nf4").merge_and_unload()
    merged, info = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager",
                                                          output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys")), info
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5, msg="merged logits")
        torch.testing.assert_close(merged(input_ids=ids).logits, ours(ids), rtol=1e-4, atol=1e-4, msg="ours")
    stored = {k: v for f in os.listdir(base) if f.endswith(".safetensors") for k, v in load_file(f"{base}/{f}").items()}
    wrote = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    assert wrote.keys() == stored.keys()
    for k in stored:
        if k.endswith("mlp.gate.weight") or "norm" in k:
            assert torch.equal(wrote[k], stored[k]), k
        elif ".experts." in k:
            assert torch.equal(wrote[k], stored[k]) == (quant == "none"), k


@pytest.mark.parametrize("name,want", [
    ("qwen3-30b-a3b", ATTN), ("gpt-oss-20b", ATTN), ("qwen3.5-35b-a3b", ATTN + ("in_proj_qkv", "in_proj_z",
                                                                              "out_proj")),
    ("gemma-4-26b-a4b", None), ("qwen2.5-7b", None), ("qwen3.5-9b", None)])
def test_default_targets_are_the_models(name, want, capsys, tmp_path):
    """--lora-targets not given: DEFAULT_TARGETS less the names a model lacks (model_targets, as before) where every
    name can be adapted (a dense model; Gemma 4's MoE beside its dense MLP), else the adaptable rest, which is what
    `attn` gives there (Qwen3-MoE, GPT-OSS, Qwen3.5-MoE: the MLP names are the experts'), said once, and the list the
    run records; the same names given are refused as before; --plan runs on the MoE configs without the flag."""
    import train
    from model.load import read_args
    from model.lora_spec import DEFAULT_TARGETS, model_targets
    from parallel.flags import check_model_flags

    path, said = os.path.join(BENCH, name), []
    m = read_args(path)
    args = train.build_parser().parse_args(["--model", path])
    check_model_flags(args, m, said.append)
    check_model_flags(args, m, said.append)   # (validate runs again under --fast: the list stays, said once)
    assert args.lora_targets == ",".join(want or model_targets(DEFAULT_TARGETS, m)) and type(args.lora_targets) is str
    assert len(said) == (want is not None) and all(f"LoRA on {args.lora_targets}, this {m.model_type}" in s
                                                   for s in said), said
    if name == "qwen3.5-9b":   # (a model with linear layers: the default in full)
        assert args.lora_targets == ",".join(DEFAULT_TARGETS)
    explicit = train.build_parser().parse_args(["--model", path, "--lora-targets", ",".join(DEFAULT_TARGETS)])
    if want is None:
        check_model_flags(explicit, m)
        assert explicit.lora_targets == args.lora_targets
        return
    with pytest.raises(ValueError, match="experts' projections in its MoE blocks.*pass --lora-targets attn.*"
                       "or leave the flag out"):
        check_model_flags(explicit, m)
    if name == "qwen3-30b-a3b":   # --init-adapter: within the default's names when the flags are checked, and
        # within the model's own default after (an experts' adapter: no)
        from safetensors.torch import save_file

        from parallel.flags import check_flags
        ok, mlp = (os.path.join(tmp_path, d) for d in ("attn", "mlp"))
        for d, mods in ((ok, list(ATTN)), (mlp, ["q_proj", "gate_proj"])):
            os.makedirs(d)
            json.dump({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": mods},
                      open(os.path.join(d, "adapter_config.json"), "w"))
            save_file({}, os.path.join(d, "adapter_model.safetensors"))
            check_flags(args := train.build_parser().parse_args(["--model", path, "--init-adapter", d]))
            if d == ok:   # (past the targets: its tensors, none here, are checked next)
                with pytest.raises(ValueError, match="holds no tensors for 192 of those projections"):
                    check_model_flags(args, m)
                continue
            with pytest.raises(ValueError, match=r"target_modules \['q_proj', 'gate_proj'\], beyond this run's "
                               "--lora-targets q_proj,k_proj,v_proj,o_proj"):
                check_model_flags(args, m)
    capsys.readouterr()
    train.main(["--plan", "--model", path, "--max-len", "8192", "--world-size", "1", "--gpu-mem", "80"])
    out = capsys.readouterr().out
    assert out.startswith(f"--lora-targets not given: LoRA on {','.join(want)}") and "\nfits: " in out, out


def test_plan_reads_the_30b_config():
    """--plan on Qwen3-30B-A3B: the MoE blocks' NF4 experts and routers in the weight terms (48 blocks of 4 attention
    projections and 3·128 experts of 768 x 2048, as parallel/plan_moe.kinds counts them)."""
    import contextlib
    import io

    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    path = os.path.join(BENCH, "qwen3-30b-a3b")
    m = read_args(path)
    out = io.StringIO()
    argv = ["--plan", "--model", path, "--max-len", "32768", "--global-batch", "1", "--gpu-mem", "80",
            "--lora-targets", "attn"]
    with contextlib.redirect_stdout(out):
        train.main(argv)
    assert "qwen3_moe" in out.getvalue(), out.getvalue()
    args = train.build_parser().parse_args(argv[1:7] + argv[9:])   # (less --gpu-mem: --plan's own)
    dims, pack = validate(args, m, 1)
    p = memory_plan(m, dims, args, "cuda", pack)
    weights = next(v for k, v in p.terms.items() if k.startswith("base weights"))
    per_block = (2048 * 4096 * 2 + 2048 * 512 * 2 + 3 * 128 * 768 * 2048) // 2   # NF4: half a byte a weight
    assert weights == 48 * per_block, (weights, 48 * per_block)
    assert next(v for k, v in p.terms.items() if "routers" in k) == 48 * (128 * 2048 + 2 * 2048 + 2 * 128) * 2   # (+ 2
    # norms, the q/k norms [hd])


@pytest.mark.parametrize("name,flags", [("renorm", []), ("plain", []), ("renorm", ["--tiled-mlp"]),
                                        ("plain", ["--lora-targets", "k_proj,o_proj"])],
                         ids=["renorm", "plain", "renorm_tiled_mlp", "plain_k_o"])
def test_planned_activations_match_autograd(ckpts, name, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms (an MoE block's router softmax, top k, the slots'
    order, each expert's intermediates and weighted outputs: parallel/plan_moe.saved; the dense block as Qwen3's) = the
    bytes autograd keeps for backward in a real forward (unique storages, parameters excluded)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts[name], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            "--lora-targets", "attn", *flags])
    ours, _ = build_model(BuildOptions(ckpts[name], quant="nf4", ac=False, lora_dropout=0.0, tiled_mlp=args.tiled_mlp,
                                       lora_targets=tuple(args.lora_targets.split(","))), device="cpu")
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


def test_start_up_shape_check_reads_the_experts(ckpts, tmp_path):
    """train.py's start-up check of the weight headers (model/load_checks.py) expects each MoE block's router and
    experts, not a dense MLP there (it refused every Qwen3-MoE checkpoint: 'lacks ... mlp.gate_proj'); an expert
    missing is named; experts stored fused (experts.gate_up_proj) are refused naming the form."""
    import shutil

    from safetensors.torch import load_file, save_file

    from model.load import read_args
    from model.load_checks import check_config_shapes

    m = read_args(ckpts["renorm"])
    check_config_shapes(ckpts["renorm"], m)
    gone = "model.layers.2.mlp.experts.3.up_proj.weight"
    for name, change in (("cut", lambda t: {k: v for k, v in t.items() if k != gone}),
                         ("fused", lambda t: {**{k: v for k, v in t.items() if ".experts." not in k},
                                              "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 48)})):
        bad = tmp_path / name
        shutil.copytree(ckpts["renorm"], bad)
        for f in bad.glob("*.safetensors"):
            f.unlink()
        (bad / "model.safetensors.index.json").unlink()
        every = {k: v for f in os.listdir(ckpts["renorm"]) if f.endswith(".safetensors")
                 for k, v in load_file(os.path.join(ckpts["renorm"], f)).items()}
        save_file(change(every), str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match="experts.3.up_proj" if name == "cut" else "holds the experts fused"):
            check_config_shapes(str(bad), m)
