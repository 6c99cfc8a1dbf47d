"""GLM-4.5 / GLM-4.6 (`model_type: glm4_moe`, model/glm4_moe.py) computes what transformers' Glm4MoeForCausalLM does.

Pins (CPU; tiny random checkpoints saved by transformers 5, whose save_pretrained writes the experts split,
`mlp.experts.{e}.gate_proj.weight`, as the Hub's are; 3 blocks of which block 0 dense (first_k_dense_replace 1); 8
experts in 4 groups, 2 groups kept, top 3, 2 shared experts, routed_scaling_factor 2.5, q/k/v biases, q/k norm,
partial RoPE 0.5; router weights drawn large and a non-zero correction bias; norms away from 1; an MTP layer's tensors
(model.layers.3.*) added to the checkpoint as the Hub's releases hold them):
- logits = transformers' (float64) on whole rows and a packed row of two documents, and on a second config (no
  biases, no q/k norm, one group, no renormalisation);
- the router = Glm4MoeTopkRouter: the same experts and weights, on inputs where the correction bias changes the
  choice (checked: without it other experts are chosen) and the group limit excludes experts;
- config.json read as Glm4MoeConfig reads it (bench/configs/glm-4.5-air and its defaults); n_params = transformers'
  meta-device count; bad group sizes refused naming the keys;
- the MTP layer's tensors are never read (nor built); the start-up shape check passes, naming them;
- LoRA's loss and every LoRA gradient = peft's on transformers' model (attention targets), plain and AC + tiled MLP;
  MLP targets refused naming --lora-targets attn, `experts` (LoRA on the routed experts: tests/test_glm4_moe_lora.py)
  accepted; the adapter loads in peft with our logits and `python -m model.merge` = peft's merge_and_unload
  (transformers loads it);
- planned saved bytes (parallel/plan_glm4.py) = autograd's, untiled and --tiled-mlp; the plan's frozen block tensors
  and routers = the model's (bf16 and FSDP2: tests/test_glm4_router_fp32.py); nf4 on the experts and shared experts,
  the router unquantized;
- one process = cp 2 Ulysses = cp 2 ring (+ tiled MLP) (2 ranks, gloo): loss and every LoRA gradient on every rank.

Run: .venv/bin/python -m pytest -q tests/test_glm4_moe.py
"""

import json
import os

import pytest
import torch
import transformers as T
from safetensors.torch import save_file

import model
from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=3,
             n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5,
             attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=3e4,
             max_position_embeddings=4096)
PLAIN = dict(SIZES, attention_bias=False, use_qk_norm=False, n_group=1, topk_group=1, norm_topk_prob=False,
             n_shared_experts=1, routed_scaling_factor=1.0)
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MTP = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.q_proj.weight", "shared_head.norm.weight")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def save_checkpoint(path, cfg: dict, scale_embeddings: float = 1.0) -> str:
    """A random Glm4MoeForCausalLM of `cfg` saved by transformers, plus one MTP layer's tensors in a shard of their
    own (module docstring), the embeddings and head × `scale_embeddings`; returns the path."""
    torch.manual_seed(0)
    hf = T.Glm4MoeForCausalLM(T.Glm4MoeConfig(**cfg)).float().eval()
    with torch.no_grad():   # norm weights start at 1, biases at 0 (a dropped one hidden); a router of std 0.02
        for n, p in hf.named_parameters():   # routes by a hair
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            if "embed" in n or "lm_head" in n:
                p.mul_(scale_embeddings)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.config.num_nextn_predict_layers = 1
    hf.save_pretrained(path, max_shard_size="60KB")
    n, index = cfg["num_hidden_layers"], os.path.join(path, "model.safetensors.index.json")
    mtp = {f"model.layers.{n}.{k}": torch.randn(48, 48) for k in MTP}
    save_file(mtp, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    with open(index) as f:
        idx = json.load(f)
    idx["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    with open(index, "w") as f:
        json.dump(idx, f)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("glm"), SIZES)


def _hf(path, dtype=torch.float32):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


def _ids(s=29, seed=1):
    return torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(ckpt, tmp_path):
    from model.glm4_moe import Glm4MoE

    plain = save_checkpoint(tmp_path / "plain", PLAIN)
    for path in (ckpt, plain):
        hf, ours = _hf(path, torch.float64), model.from_pretrained(path, dtype=torch.float64).eval()
        assert type(hf).__name__ == "Glm4MoeForCausalLM"
        assert [isinstance(b.mlp, Glm4MoE) for b in ours.model.layers] == [False, True, True]
        ids = _ids(37)
        pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
        with torch.no_grad():
            ref = hf(input_ids=ids, position_ids=pos).logits
            assert rel(ours(ids, position_ids=pos), ref) < 1e-12, f"{path}: whole rows"
            packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
            want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
            # (the router computes in float32 as transformers': a GEMM over 37 tokens against two over 15 and 22 may
            # round its scores otherwise (oneDNN's blocking follows the row count: 1.9e-9 on an Intel AVX-512 machine,
            # 2026-12-07); a packing bug, another document's keys or positions, moves the logits by ~1e-1)
            assert rel(ours(ids[:1], position_ids=packed), want) < 1e-6, f"{path}: packed row"


def test_router_matches_transformers():
    """Router = Glm4MoeTopkRouter on the same weights (float64 input; the router computes in float32 as transformers'):
    the chosen experts exactly, the weights to float32 rounding, where the correction bias changes the choice and the
    group limit keeps experts out that the top k alone would take."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from model.glm4_moe import Router

    margs = model.ModelArgs.from_config_dict({"model_type": "glm4_moe", **SIZES})
    g = torch.Generator().manual_seed(0)
    theirs, ours = Glm4MoeTopkRouter(T.Glm4MoeConfig(**SIZES)), Router(48, margs.moe)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 48, generator=g) * 0.5)
        theirs.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 48, generator=g, dtype=torch.float64)
    with torch.no_grad():
        _, w_ref, idx_ref = theirs(x)
        w, idx = ours(x)
        assert torch.equal(idx.sort(-1)[0], idx_ref.sort(-1)[0]), "experts chosen"
        order = lambda i, v: v.gather(1, i.argsort(-1))
        torch.testing.assert_close(order(idx, w), order(idx_ref, w_ref), msg="routing weights")
        s = torch.sigmoid(x.float() @ theirs.weight.T)
        unbiased = s.topk(3, dim=-1)[1].sort(-1)[0]
        assert (unbiased != idx.sort(-1)[0]).any(-1).sum() > 5, "the bias changes the choice in this case"
        groups = (idx // 2).unique(dim=None).numel()
        assert all((row // 2).unique().numel() <= 2 for row in idx) and groups > 2, "at most topk_group groups"


def test_config_and_n_params_as_transformers():
    """bench/configs/glm-4.5-air (the Hub's config.json) and a bare config.json (Glm4MoeConfig's defaults) read as
    transformers reads them; n_params = transformers' parameters on the meta device; bad groups refused."""
    with open(os.path.join(BENCH, "glm-4.5-air", "config.json")) as f:
        hub = json.load(f)
    a = model.ModelArgs.from_config_dict(hub)
    assert (a.model_type, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size, a.rope_theta,
            a.partial_rotary_factor, a.qkv_bias, a.o_bias, a.qk_norm, a.sliding_window) == (
        "glm4_moe", 4096, 46, 96, 8, 128, 151552, 1e6, 0.5, True, False, False, None)
    assert (a.moe.experts, a.moe.top_k, a.moe.width, a.moe.norm_topk, a.moe.shared, a.moe.groups) == (
        128, 8, 1408, True, 1408, (1, 1, 1.0))
    assert [a.moe.sparse(i) for i in range(3)] == [False, True, True]
    for cfg in (hub, {"model_type": "glm4_moe", **SIZES}, {"model_type": "glm4_moe", **PLAIN}):
        hf = T.Glm4MoeConfig(**cfg)
        with torch.device("meta"):
            n = sum(p.numel() for p in T.Glm4MoeForCausalLM(hf).parameters())
        b = model.ModelArgs.from_config_dict(cfg)
        qk = 2 * b.head_dim * b.n_layers * b.qk_norm   # (n_params leaves out the q/k norms, a Qwen3's too)
        assert b.n_params + qk == n, (b.n_params, qk, n)
        assert b.rotary_dim == int(b.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert round(a.n_params / 1e9, 1) == 106.9   # (the card's 106B total with its MTP layer's not built)
    bare = {k: SIZES[k] for k in ("vocab_size", "intermediate_size", "num_hidden_layers")} | {
        "num_attention_heads": 8, "hidden_size": 96, "model_type": "glm4_moe"}   # (head_dim 12: 6 dims rotated)
    b, w = model.ModelArgs.from_config_dict(bare), T.Glm4MoeConfig(**bare)
    assert (b.n_kv_heads, b.moe.experts, b.moe.top_k, b.moe.width, b.moe.norm_topk, b.norm_eps, b.partial_rotary_factor,
            b.max_position_embeddings) == (w.num_key_value_heads, w.n_routed_experts, w.num_experts_per_tok,
                                           w.moe_intermediate_size, w.norm_topk_prob, w.rms_norm_eps,
                                           w.rope_parameters["partial_rotary_factor"], w.max_position_embeddings)
    for bad in (dict(n_group=3), dict(n_group=8), dict(topk_group=5), dict(n_group=4, topk_group=1,
                                                                           num_experts_per_tok=3)):
        with pytest.raises(ValueError, match="n_group"):
            model.ModelArgs.from_config_dict({"model_type": "glm4_moe", **SIZES, **bad})
    with pytest.raises(ValueError, match="output_router_logits"):
        model.ModelArgs.from_config_dict({"model_type": "glm4_moe", **SIZES, "output_router_logits": True})


def test_mtp_layers_never_read(ckpt, monkeypatch):
    """The MTP layer's tensors (model.layers.3.*) are in the checkpoint's index but no byte of them is read; the
    start-up check (headers against config.json: the routers, correction biases, shared experts) passes and says so."""
    from model.load import CheckpointReader
    from model.load_checks import check_config_shapes

    note = check_config_shapes(ckpt, model.load.read_args(ckpt))
    assert "4 blocks" in note and "multi-token-prediction layers are those, unread" in note, note

    read = []
    real = CheckpointReader.get_bytes
    monkeypatch.setattr(CheckpointReader, "get_bytes", lambda self, name, *a: read.append(name) or real(
        self, name, *a))
    model.from_pretrained(ckpt)
    assert read and not [n for n in read if n.startswith("model.layers.3.")], "MTP tensors read"
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in read


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True)], ids=["plain", "ac_tiled_mlp"])
def test_lora_grads_match_peft_on_transformers(ckpt, mem):
    from parallel.parallelize import BuildOptions

    ids = _ids(29, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=ATTN, **mem))
    assert_lora_grads_match_peft(_hf(ckpt), ATTN, ours, peft_model, ids, labels, 2 * 4 * 3)
    from model.moe import expert_targets
    why = expert_targets(ours.args, ("q_proj", "gate_proj"))
    assert why and "pass --lora-targets attn" in why, why
    from model.expert_lora import refusal
    assert refusal(ours.args, ("q_proj", "experts")) is None, "experts (tests/test_glm4_moe_lora.py) refused"


def test_adapter_and_merge_load_in_peft_and_transformers(ckpt, tmp_path):
    """Our adapter loads in peft on Glm4MoeForCausalLM with our logits; the merge = peft's merge_and_unload, loaded
    by transformers (the MTP layer's tensors copied as stored, unread there as in the source checkpoint)."""
    from safetensors.torch import load_file

    from tests.helpers import assert_adapter_and_merge_match_peft

    mtp = [f"model.layers.3.{k}" for k in MTP]
    out, _ = assert_adapter_and_merge_match_peft(ckpt, T.Glm4MoeForCausalLM, tmp_path, _ids(19), ATTN, mtp)
    merged = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(
        os.path.join(out, f)).items()}
    source = load_file(os.path.join(ckpt, "mtp.safetensors"))
    assert all(torch.equal(merged[k], source[k]) for k in mtp), "MTP tensors copied as stored"


@pytest.mark.parametrize("flags", [[], ["--tiled-mlp"]], ids=["plain", "tiled_mlp"])
def test_plan_matches_autograd_and_the_parameters(ckpt, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms (parallel/plan_glm4.saved: the float32 sigmoid, the
    gather's indices, the renormalisation, the experts' and shared experts' intermediates, the float32 routing weights'
    products) = the bytes autograd keeps for backward; its 'block norms, biases, routers' term = the model's frozen
    parameters there (the norms, the q/k/v biases), its routers term the routers' and their correction biases'."""
    import train
    from model.nf4 import NF4Linear
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpt, "--max-len", "128", "--global-batch", "1", "--quant",
                                            "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            "--lora-targets", "attn", *flags])
    ours, _ = build_model(BuildOptions(ckpt, quant="nf4", ac=False, lora_dropout=0.0, tiled_mlp=args.tiled_mlp,
                                       lora_targets=ATTN), device="cpu")
    blk = ours.model.layers[1].mlp
    assert all(isinstance(p, NF4Linear) for e in [*blk.experts, blk.shared_experts]
               for p in (e.gate_proj, e.up_proj, e.down_proj)), "experts and shared experts NF4"
    assert blk.gate.weight.dtype == torch.float32 and blk.gate.weight.shape == (8, 48), "router unquantized"
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)
    quantized = {f"{n}.{w}" for n, m in ours.named_modules() if isinstance(m, NF4Linear) for w in ("weight", "absmax")}
    frozen = {n: p.numel() * 4 for n, p in ours.named_parameters() if n.startswith("model.layers.")
              and "lora_" not in n and n not in quantized}
    routers = sum(v for n, v in frozen.items() if ".mlp.gate." in n)
    dims, pack = validate(args, ours.args, 1)
    plan = memory_plan(ours.args, dims, args, "cpu", pack).terms
    assert next(v for k, v in plan.items() if k.startswith("block norms, biases")) == sum(frozen.values()) - routers
    assert plan["routers (float32, whole on every rank)"] == routers == 2 * (8 * 48 + 8) * 4, (plan, routers)


@pytest.mark.timeout(300)
def test_cp2_ulysses_and_ring_equal_one_process(ckpt):
    """tests/test_gpt_oss.py's cases on this checkpoint: loss and every LoRA gradient on every rank (float64, two packed
    rows), Ulysses plain, ring with the tiled MLP."""
    from tests.dist import run_ranks
    from tests.test_gpt_oss import _layouts

    cases = [("ulysses", {}), ("ring", dict(tiled_mlp=True))]
    assert run_ranks(_layouts, 2, ckpt, cases, timeout=280) == [True, True]
