"""Qwen3.5-MoE (`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM; the multimodal `qwen3_5_moe`,
Qwen3_5MoeForConditionalGeneration: Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B): Qwen3.5's hybrid decoder with
model/moe.py's MoE block on every layer plus a shared expert, computing and training what transformers and peft do.

Pins (CPU, float32 unless said; tiny random checkpoints saved by transformers 5, whose save_pretrained writes the
experts split, `mlp.experts.{e}.gate_proj.weight`, as the Hub's are; layers linear, linear, linear, full; 4 experts,
top 2, a shared expert of another width; router and shared-expert gate drawn large, norms away from their defaults):
- config.json read as Qwen3_5MoeTextConfig reads it (every block MoE, always renormalised, the shared expert's width);
  n_params = transformers' parameter count; the start-up shape check expects the shared expert and its gate;
- logits = transformers' on whole rows and on a packed row (each document alone); the MoE block =
  Qwen3_5MoeSparseMoeBlock in float32 and bf16 (a mutated shared expert or gate is caught);
- LoRA (attention + linear_attn targets) loss and every gradient = peft's on transformers' model; MLP targets refused;
- nf4: exactly the Linears transformers + bitsandbytes quantize (the shared expert and its [1, D] gate too, not the
  router);
- the exported adapter loads in peft on Qwen3_5MoeForCausalLM and on the wrapper with our logits; the merge =
  merge_and_unload;
- cp 2 Ulysses and ring (FSDP, cp_linear) = one process;
- the memory plan's activations = autograd's saved bytes; --plan reads bench/configs/qwen3.5-35b-a3b.

Run: .venv/bin/python -m pytest -q tests/test_qwen3_5_moe.py
"""

import json
import os
import warnings
from dataclasses import replace

import pytest
import torch
import transformers as T

import model

TYPES = ["linear_attention"] * 3 + ["full_attention"]
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
SIZES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=4096, layer_types=TYPES, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, **LINEAR)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _perturb(m):
    with torch.no_grad():   # norms, A_log, dt_bias off their defaults; a router and gate that decide
        for n, p in m.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n:
                p.add_(torch.randn_like(p) * 0.3)
            elif n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_moe")
    torch.manual_seed(0)
    hf = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**SIZES)).float()
    _perturb(hf)
    hf.save_pretrained(d / "text")
    cfg = T.Qwen3_5MoeConfig(text_config=dict(SIZES, model_type="qwen3_5_moe_text"), vision_config=VISION,
                             tie_word_embeddings=False)
    torch.manual_seed(1)
    w = T.Qwen3_5MoeForConditionalGeneration(cfg).float()
    _perturb(w)
    w.save_pretrained(d / "wrapper")
    return {"text": str(d / "text"), "wrapper": str(d / "wrapper")}


def _hf(path):
    cls = T.Qwen3_5MoeForCausalLM if os.path.basename(path) == "text" else T.Qwen3_5MoeForConditionalGeneration
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def _ids(s, seed=1, b=2):
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_whole_and_packed_rows_match_transformers(ckpts):
    from model.load_checks import check_config_shapes
    from model.moe import MoE

    for path in (ckpts["text"], ckpts["wrapper"]):
        hf, ours = _hf(path), model.from_pretrained(path).eval()
        assert [isinstance(b.mlp, MoE) and hasattr(b.mlp, "shared_expert") for b in ours.model.layers] == [True] * 4
        assert check_config_shapes(path, model.load.read_args(path)) is None, "start-up shape check"
        ids = _ids(70)
        with torch.no_grad():
            assert rel(ours(ids), hf(input_ids=ids).logits) < 1e-5, f"{path}: whole rows"
            packed = torch.cat([torch.arange(30), torch.arange(40)])[None]
            want = torch.cat([hf(input_ids=ids[:1, :30]).logits, hf(input_ids=ids[:1, 30:]).logits], 1)
            assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, f"{path}: packed row"


@pytest.mark.parametrize("flags", [[], ["--tiled-mlp"], ["--lora-targets", "k_proj,o_proj"]],
                         ids=["attn", "tiled_mlp", "k_o"])
def test_planned_activations_match_autograd(tmp_path, flags):
    """No AC, fp32, one process, nf4, the hybrid layers (linear, linear, linear, full: parallel/plan_linear's terms in
    the linear ones): the plan's activation terms (parallel/plan_moe.saved: the router, the experts' and the shared
    expert's intermediates, its gate's sigmoid) = the bytes autograd keeps for backward in a real forward."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    torch.manual_seed(0)
    hf = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**SIZES)).float()
    _perturb(hf)
    hf.save_pretrained(tmp_path)
    args = train.build_parser().parse_args(["--model", str(tmp_path), "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            "--lora-targets", "attn", *flags])
    ours, _ = build_model(BuildOptions(str(tmp_path), quant="nf4", ac=False, lora_dropout=0.0,
                                       tiled_mlp=args.tiled_mlp, lora_targets=tuple(args.lora_targets.split(","))),
                          device="cpu")
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


def test_planned_weights_are_the_models(ckpts):
    """One process, fp32, nf4, LoRA on the attention and linear_attn: the plan's NF4 weight term = the built model's
    NF4 codes (every block's experts, shared expert and its gate, linear or full: until 2026-12-07 the linear blocks
    were planned with a dense MLP in place of their experts), its block norms' term = the other frozen block tensors
    (routers, linear_attn's conv1d, A_log, dt_bias, gated norm; the full layers' q/k norms, [hd] each)."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(["--model", ckpts["text"], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--lora-targets", "attn"])
    ours, _ = build_model(BuildOptions(ckpts["text"], quant="nf4", lora_targets=tuple(args.lora_targets.split(","))),
                          device="cpu")
    dims, pack = validate(args, ours.args, 1)
    terms = memory_plan(ours.args, dims, args, "cpu", pack).terms
    term = lambda key: next(v for k, v in terms.items() if k.startswith(key))   # noqa: E731
    params = [(n, p) for n, p in ours.named_parameters() if ".layers." in n]
    nbytes = lambda keep: sum(p.numel() * p.element_size() for n, p in params if keep(n))   # noqa: E731
    names = {n for n, _ in params}
    codes = lambda n: n.endswith(".weight") and n[:-len("weight")] + "absmax" in names   # noqa: E731 (NF4's packed)
    assert term("base weights") == nbytes(codes) > 0
    assert term("block norms") == nbytes(lambda n: not codes(n) and not n.endswith("absmax") and "lora_" not in n) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_matches_transformers(dtype):
    """model/moe.py's MoE with a shared expert = transformers' Qwen3_5MoeSparseMoeBlock (eager experts) on the same
    weights: the routing (always renormalised) bit for bit, the block's output in float32 and bf16 (the shared
    expert's output × sigmoid(shared_expert_gate), added after the experts' sum)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from model.moe import MoE, moe_fields

    cfg = T.Qwen3_5MoeTextConfig(**SIZES)
    cfg._experts_implementation = "eager"
    spec = moe_fields({"model_type": "qwen3_5_moe_text", **SIZES})["moe"]
    g = torch.Generator().manual_seed(0)
    theirs, ours = Qwen3_5MoeSparseMoeBlock(cfg).to(dtype), MoE(64, spec).to(dtype)
    with torch.no_grad():
        theirs.gate.weight.copy_(torch.randn(4, 64, generator=g) * 0.5)
        theirs.experts.gate_up_proj.copy_(torch.randn(4, 64, 64, generator=g) * 0.2)
        theirs.experts.down_proj.copy_(torch.randn(4, 64, 32, generator=g) * 0.2)
        for n, p in theirs.named_parameters():
            if "shared_expert" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, ex in enumerate(ours.experts):
            ex.gate_proj.weight.copy_(theirs.experts.gate_up_proj[e, :32])
            ex.up_proj.weight.copy_(theirs.experts.gate_up_proj[e, 32:])
            ex.down_proj.weight.copy_(theirs.experts.down_proj[e])
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, n).weight.copy_(getattr(theirs.shared_expert, n).weight)
        ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
    x = torch.randn(3, 11, 64, generator=g).to(dtype)
    with torch.no_grad():
        _, w_ref, idx_ref = theirs.gate(x.view(-1, 64))
        w, idx = ours.route(x.view(-1, 64))
        assert torch.equal(idx, idx_ref), "experts chosen"
        torch.testing.assert_close(w, w_ref, rtol=0, atol=0, msg="routing weights (renormalised)")
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(ours(x), theirs(x), **tol, msg="block output")


def test_config_read_as_transformers_reads_it():
    """bench/configs/qwen3.5-35b-a3b (Qwen3_5MoeTextConfig's defaults: 40 layers, 3 of 4 linear, 256 experts, top 8,
    width 512, a shared expert of 512) and a bare config.json: the sizes transformers reads, every block MoE, n_params =
    transformers' count (less the q/k norms, which n_params leaves out for every model); the wrapper's text_config."""
    with open(os.path.join(BENCH, "qwen3.5-35b-a3b", "config.json")) as f:
        hub = json.load(f)
    a, w = model.ModelArgs.from_config_dict(hub), T.Qwen3_5MoeTextConfig(**{k: v for k, v in hub.items()
                                                                            if k != "model_type"})
    assert (a.model_type, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size, a.rotary_dim) == (
        "qwen3_5_moe_text", w.hidden_size, w.num_hidden_layers, w.num_attention_heads, w.num_key_value_heads,
        w.head_dim, w.vocab_size, 64)
    assert (a.moe.experts, a.moe.top_k, a.moe.width, a.moe.norm_topk, a.moe.shared) == (
        w.num_experts, w.num_experts_per_tok, w.moe_intermediate_size, True, w.shared_expert_intermediate_size)
    assert a.layer_types == w.layer_types and all(a.moe.sparse(i) for i in range(40))
    bare = {k: v for k, v in SIZES.items() if k != "layer_types" and k not in LINEAR}
    for extra in ({}, {"layer_types": TYPES, **LINEAR}, {"full_attention_interval": 2, "num_experts": 6}):
        cfg = {"model_type": "qwen3_5_moe_text", **bare, **extra}
        ours, want = model.ModelArgs.from_config_dict(cfg), T.Qwen3_5MoeTextConfig(**cfg)
        assert ours.layer_types == want.layer_types and ours.moe.experts == want.num_experts, extra
        hf = T.Qwen3_5MoeForCausalLM(want)
        assert ours.n_params == sum(p.numel() for n, p in hf.named_parameters() if "q_norm" not in n
                                    and "k_norm" not in n), extra
    wrapped = model.ModelArgs.from_config_dict({"model_type": "qwen3_5_moe", "architectures": [
        "Qwen3_5MoeForConditionalGeneration"], "text_config": dict(SIZES), "vision_config": VISION})
    assert (wrapped.wrapper, wrapped.model_type, wrapped.moe.shared) == ("qwen3_5_moe", "qwen3_5_moe_text", 48)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size 0"):
        model.ModelArgs.from_config_dict({"model_type": "qwen3_5_moe_text", **bare,
                                          "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match="output_router_logits"):
        model.ModelArgs.from_config_dict({"model_type": "qwen3_5_moe_text", **bare, "output_router_logits": True})


def test_plan_reads_the_35b_config():
    """--plan on bench/configs/qwen3.5-35b-a3b prints a plan; its NF4 weight term counts each MoE block's experts, its
    shared expert and the shared expert's gate (parallel/plan_moe.kinds), the attention's or linear_attn's Linears."""
    import contextlib
    import io

    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    path = os.path.join(BENCH, "qwen3.5-35b-a3b")
    out = io.StringIO()
    argv = ["--plan", "--model", path, "--max-len", "32768", "--global-batch", "1", "--gpu-mem", "80",
            "--lora-targets", "attn"]
    with contextlib.redirect_stdout(out):
        train.main(argv)
    assert "qwen3_5_moe_text" in out.getvalue() and "fits" in out.getvalue(), out.getvalue()
    m = read_args(path)
    args = train.build_parser().parse_args(argv[1:7] + argv[9:])
    dims, pack = validate(args, m, 1)
    weights = lambda m: next(v for k, v in memory_plan(m, dims, args, "cuda", pack).terms.items()
                             if k.startswith("base weights"))
    plain = replace(m, moe=replace(m.moe, shared=0))   # (the same blocks without a shared expert)
    assert weights(m) - weights(plain) == 40 * (3 * 512 * 2048 + 2048) // 2   # NF4: half a byte a weight


def _build(path, fsdp_mesh=None, attention=None, linear=None, **kw):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ATTN) | kw
    return build_nonzero_b(BuildOptions(path, **opts), fsdp_mesh=fsdp_mesh, attention=attention, linear=linear)


N_LORA = 3 * 3 + 4   # LoRA layers: 3 linear blocks (in_proj_qkv, in_proj_z, out_proj), 1 full block (q, k, v, o)


def test_lora_grads_match_peft_on_transformers(ckpts):
    """peft's LoRA on Qwen3_5MoeForCausalLM with our adapter's values on packed rows (each document alone there):
    the same loss and every LoRA gradient (through the experts, the router's weights and the shared expert's gate)."""
    from peft import LoraConfig, get_peft_model

    ids = _ids(90, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(20), torch.arange(70)]).expand(2, 90)
    ours, peft_model = _build(ckpts["text"], ac=False)
    s, n = ours(ids, position_ids=pos, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = get_peft_model(_hf(ckpts["text"]), LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTN),
                                                       lora_dropout=0.0, init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    hf.train()
    logits = torch.cat([hf(input_ids=ids[:, :20]).logits, hf(input_ids=ids[:, 20:]).logits], 1)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    assert theirs.keys() == mine.keys() and len(mine) == N_LORA * 2, sorted(set(theirs) ^ set(mine))
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=f"grad {k}")


def test_mlp_targets_refused_naming_the_fix(ckpts):
    """gate_proj / up_proj / down_proj would take LoRA on every expert here, while peft on transformers' model reads
    them as the shared expert's alone (checked: its experts are fused parameters, no modules): refused at start-up
    (before any weight) and by build_model, naming --lora-targets attn; attn passes, and not giving the flag (its
    default here is attn: tests/test_qwen3_moe.py test_default_targets_are_the_models)."""
    from peft import LoraConfig, get_peft_model

    import train
    from parallel.flags import check_model_flags
    from parallel.parallelize import BuildOptions, build_model

    pm = get_peft_model(_hf(ckpts["text"]), LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"]))
    adapted = {n.split(".lora_A")[0] for n, _ in pm.named_parameters() if ".lora_A" in n}
    assert adapted and all(".mlp.shared_expert." in n for n in adapted), adapted
    margs = model.load.read_args(ckpts["text"])
    for flags in (["--lora-targets", "attn,mlp"], ["--lora-targets", "mlp"], ["--lora-targets", "down_proj"]):
        args = train.build_parser().parse_args(["--model", ckpts["text"], *flags])
        with pytest.raises(ValueError, match=r"MoE blocks \(4 of 4\).*shared expert.*--lora-targets attn"):
            check_model_flags(args, margs)
    check_model_flags(train.build_parser().parse_args(["--model", ckpts["text"], "--lora-targets", "attn"]), margs)
    with pytest.raises(ValueError, match="--lora-targets attn"):
        build_model(BuildOptions(ckpts["text"], quant="none"), device="cpu")


def test_nf4_quantizes_what_bitsandbytes_would(ckpts):
    """Every nn.Linear of transformers' language model but lm_head is NF4: the shared expert's three and its gate
    [1, D] too; each expert's projections (fused parameters there, per-expert Linears here); the router (no Linear
    in transformers) stays float32; the logits = the plain model's with those weights through bitsandbytes' NF4."""
    from bitsandbytes.functional import dequantize_4bit

    from model.nf4 import NF4Linear
    from tests.helpers import bnb_nf4

    q, _ = _build(ckpts["text"], quant="nf4", lora_targets=("q_proj",), ac=False)
    hf = _hf(ckpts["text"])
    linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    experts = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(4) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")}
    nf4 = {n.replace("base_layer", "").replace("..", ".").rstrip(".") for n, m in q.named_modules()
           if isinstance(m, NF4Linear)}
    assert nf4 == linears | experts and sum(n.endswith("shared_expert_gate") for n in nf4) == 4
    assert q.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32
    plain, _ = _build(ckpts["text"], lora_targets=("q_proj",), ac=False)
    with torch.no_grad():
        for n, m in plain.named_modules():
            if n.replace("base_layer", "").replace("..", ".").rstrip(".") in nf4 and isinstance(m, torch.nn.Linear):
                w = m.weight.reshape(-1, 64)   # (rows of 64: bnb_nf4's CPU state reads those right)
                m.weight.copy_(dequantize_4bit(*bnb_nf4(w)).view_as(m.weight))
        ids = _ids(40, 2)
        torch.testing.assert_close(q(ids), plain(ids), rtol=1e-5, atol=1e-5)


def _peft_loaded(base, adapter, nf4=False):
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


@pytest.mark.parametrize("which", ["text", "wrapper"])
def test_exported_adapter_loads_in_peft_with_our_logits(ckpts, tmp_path, which):
    from model.export import export_adapter

    ours, peft_model = _build(ckpts[which], ac=False)
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[which])
    with torch.no_grad():
        mine = ours(_ids(70))
    pm = _peft_loaded(ckpts[which], str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=_ids(70)).logits, mine, rtol=1e-5, atol=1e-5)
        with pm.disable_adapter():
            assert rel(pm(input_ids=_ids(70)).logits, mine) > 1e-3, "the adapter changes nothing"
    assert sum(n.endswith(".lora_A") for n, _ in pm.named_modules()) == N_LORA


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_merge_is_what_peft_merges(ckpts, tmp_path, quant):
    """`python -m model.merge` = peft's merge_and_unload on the base as stored (none) or on training's NF4 round trip
    of it (nf4: the experts', the shared expert's and its gate's weights too); transformers loads it with no missing or
    unexpected key; the router and norms as stored, bit for bit; the shared expert round-tripped under nf4 only."""
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter

    base = ckpts["text"]
    ours, peft_model = _build(base, quant=quant, ac=False)
    export_adapter(peft_model, str(tmp_path / "a"), base, quant=quant)
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a"), quant == "nf4").merge_and_unload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, info = T.Qwen3_5MoeForCausalLM.from_pretrained(out, output_loading_info=True,
                                                            experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(got.eval()(input_ids=_ids(70)).logits, ref(input_ids=_ids(70)).logits, rtol=1e-5,
                                   atol=1e-5, msg="merged")
        torch.testing.assert_close(got(input_ids=_ids(70)).logits, ours.eval()(_ids(70)), rtol=1e-4, atol=1e-4,
                                   msg="ours")
    stored = load_file(os.path.join(base, "model.safetensors"))
    wrote = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(f"{out}/{f}").items()}
    assert wrote.keys() == stored.keys()
    for k in stored:
        if k.endswith("mlp.gate.weight") or "norm" in k:
            assert torch.equal(wrote[k], stored[k]), k
        elif "shared_expert" in k or ".experts." in k:
            assert torch.equal(wrote[k], stored[k]) == (quant == "none"), k


def _cp_equals_one_process(rank, world_size, path):
    """cp 2 (Ulysses, then ring) under FSDP with train.py's cores (cp_attention, cp_linear) on packed rows whose
    documents cross the shards: the global loss and every LoRA gradient = one process's."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.cp_linear import cp_linear
    from parallel.mesh import ParallelDims

    ids = _ids(84, 9)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(30), torch.arange(54)]).expand(2, 84)
    ref, _ = _build(path, ac=True)
    s, n = ref(ids, position_ids=pos, labels=labels)
    (s / n).backward()
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    for impl in ("ulysses", "ring"):
        dims = ParallelDims.from_args(world_size, 1, -1, 2, impl, None, n_heads=4, n_kv_heads=2)
        meshes = dims.build_mesh("cpu")
        ours, _ = _build(path, ac=True, fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims),
                         linear=cp_linear(meshes, dims))
        cr = meshes.cp.get_local_rank()
        ls, ln = ours(shard_sequence(ids, dims, cr, 0), position_ids=shard_sequence(pos, dims, cr, None),
                      labels=shard_sequence(labels, dims, cr, -100))
        total = ln.detach().clone()
        dist.all_reduce(total, group=meshes.cp.get_group())
        (ls / total).backward()
        got = ls.detach().clone()
        dist.all_reduce(got, group=meshes.cp.get_group())
        torch.testing.assert_close(got / total, s.detach() / n, rtol=1e-5, atol=1e-6, msg=f"{impl}: loss")
        grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for k, p in ours.named_parameters() if p.requires_grad}
        assert grads.keys() == want.keys() and len(grads) == N_LORA * 2
        for k in grads:
            assert rel(grads[k], want[k]) < 1e-5, f"{impl}: grad {k}"
    return True


@pytest.mark.timeout(300)
def test_cp_ulysses_and_ring_equal_one_process(ckpts):
    from tests.dist import run_ranks

    assert run_ranks(_cp_equals_one_process, 2, ckpts["text"], timeout=280) == [True, True]


def test_start_up_shape_check_reads_the_shared_expert(ckpts, tmp_path):
    """train.py's start-up check of the weight headers (model/load_checks.py) expects each MoE block's shared expert
    and its gate beside the router and experts: one missing is named before any weight is read."""
    import shutil

    from safetensors.torch import load_file, save_file

    from model.load_checks import check_config_shapes

    m = model.load.read_args(ckpts["text"])
    for gone in ("model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.3.mlp.shared_expert_gate.weight"):
        bad = tmp_path / gone.split(".")[4]
        shutil.copytree(ckpts["text"], bad)
        t = load_file(str(bad / "model.safetensors"))
        save_file({k: v for k, v in t.items() if k != gone}, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
            check_config_shapes(str(bad), m)
