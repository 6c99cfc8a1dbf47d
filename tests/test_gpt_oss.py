"""GPT-OSS (`model_type: gpt_oss`, model/gpt_oss.py) computes what transformers' GptOssForCausalLM does, its fused
experts are read expert by expert and written back fused, and its adapters and merges load in transformers and peft.

Pins (CPU, float32 unless said, tiny random models made and saved by transformers 5.25: 2 layers sliding (window 4)
and full, q/k/v/o biases, 6 experts of width 24 top 2 with biases; sinks, biases, norms and experts drawn away from
transformers' init; the router × 20 so the top 2 are decided; YaRN, the config's default):
- logits = transformers' on rows far from position 0 (every window binds) and on a packed row; the sinks, the clamp
  (swiglu_limit), the gate/up interleave (swapped) and the router's bias each move them far;
- config.json read as GptOssConfig reads it (defaults: layer types, window 128, YaRN, rope_theta 150000);
- LoRA on the attention: the loss and every LoRA gradient = peft's on GptOssForCausalLM (none on an expert there or
  here); MLP targets refused (model.moe.expert_targets); train.py without --lora-targets trains the attention, its
  adapter in peft;
- the exported adapter loads in peft with our logits; `python -m model.merge` = peft's merge_and_unload, the experts
  written fused back as stored (bit for bit), transformers loads the merged folder;
- cp 2 Ulysses and cp 2 ring (2 ranks, float64, packed rows) = one process: loss and every LoRA gradient, every rank;
- NF4: every expert projection 4-bit (biases kept), the router not;
- the memory plan (kernel core, nf4, with and without --tiled-mlp): activations = autograd's saved bytes, the block's
  frozen norms, biases, router and sinks = the model's.

Run: .venv/bin/python -m pytest -q tests/test_gpt_oss.py
"""

import os

import pytest
import torch
import transformers as T

import model
from tests.helpers import build_nonzero_b

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
              swiglu_limit=1.5)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(autouse=True)
def clamp_as_configured(monkeypatch):
    """transformers 5.17 (the GPU machine's, make test-compat) fixes the experts' clamp at 7.0 whatever swiglu_limit
    says; 5.25 reads it. The tiny models' 1.5 (a clamp that binds) is then the reference's on both (real checkpoints
    say 7.0)."""
    experts = T.models.gpt_oss.modeling_gpt_oss.GptOssExperts
    init = experts.__init__

    def reading(self, config):
        init(self, config)
        self.limit = getattr(config, "swiglu_limit", self.limit)
    monkeypatch.setattr(experts, "__init__", reading)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _save(path, **kw):
    torch.manual_seed(0)
    m = T.GptOssForCausalLM(T.GptOssConfig(**{**CONFIG, **kw})).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
            elif n.endswith(("sinks", "bias")) or "experts" in n:
                p.normal_(0, 1.0 if n.endswith("sinks") else 0.3)
            if n.endswith("router.weight"):
                p.mul_(20)
    m.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpt_oss"))


def _ids(s=29, seed=1):
    return torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(ckpt):
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = model.from_pretrained(ckpt).eval()
    b = ours.model.layers[0]
    assert len(b.mlp.experts) == 6 and b.mlp.top_k == 2 and tuple(b.mlp.experts[0].gate_proj.weight.shape) == (24, 32)
    assert [blk.self_attn.window for blk in ours.model.layers] == [4, None]
    ids = _ids()
    pos = torch.arange(29).expand(2, 29) + torch.tensor([[5000], [0]])   # (past YaRN's original 4096)
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(11), torch.arange(18)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :11]).logits, hf(input_ids=ids[:1, 11:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"

        def moved(what, change, undo):
            for blk in ours.model.layers:
                change(blk)
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, f"{what} has no effect"
            for blk in ours.model.layers:
                undo(blk)

        moved("the sinks", lambda b: setattr(b, "kept", b.self_attn.sinks.clone()) or b.self_attn.sinks.zero_(),
              lambda b: b.self_attn.sinks.copy_(b.kept))
        moved("the clamp", lambda b: [setattr(e, "limit", 1e9) for e in b.mlp.experts],
              lambda b: [setattr(e, "limit", 1.5) for e in b.mlp.experts])
        moved("the router's bias", lambda b: b.mlp.router.bias.mul_(-1), lambda b: b.mlp.router.bias.mul_(-1))
        for blk in ours.model.layers:   # gate and up de-interleaved the other way round
            for e in blk.mlp.experts:
                e.gate_proj.weight.data, e.up_proj.weight.data = e.up_proj.weight.data, e.gate_proj.weight.data
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "gate/up swapped has no effect"


def test_config_read_as_transformers_reads_it(ckpt):
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    keys = ("model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size")
    minimal = {k: cfg[k] for k in keys} | {"num_hidden_layers": 4}
    a, hf = model.ModelArgs.from_config_dict(minimal), T.GptOssConfig(**minimal)
    assert [a.window(i) for i in range(4)] == [hf.sliding_window if t == "sliding_attention" else None
                                               for t in hf.layer_types] == [128, None, 128, None]
    assert (a.n_kv_heads, a.head_dim, a.norm_eps) == (hf.num_key_value_heads, hf.head_dim, hf.rms_norm_eps)
    assert a.rope_theta == hf.rope_parameters["rope_theta"] == 150000
    assert {k: v for k, v in a.rope_scaling.items()} == {k: v for k, v in hf.rope_parameters.items()
                                                         if k != "rope_theta"}
    assert (a.moe.experts, a.moe.top_k, a.moe.width, a.moe.clamp) == (128, 4, hf.intermediate_size, (7.0, 1.702))
    assert a.qkv_bias and a.o_bias and a.sinks and a.norm_offset == 0.0
    with pytest.raises(ValueError, match="output_router_logits"):
        model.ModelArgs.from_config_dict({**minimal, "output_router_logits": True})


def test_lora_grads_match_peft_on_transformers(ckpt):
    from peft import LoraConfig, get_peft_model

    from parallel.parallelize import BuildOptions

    ids = _ids(23, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=ATTN, ac=False))
    s, n = ours(ids, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
                        LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTN), lora_dropout=0.0,
                                   init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    logits = hf.train()(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    assert theirs.keys() == mine.keys() and len(mine) == 2 * 4 * 2, sorted(set(mine) ^ set(theirs))
    for k in mine:
        assert rel(mine[k], theirs[k]) < 1e-4, f"grad {k}"
    from model.moe import expert_targets
    why = expert_targets(ours.args, ("q_proj", "gate_proj"))
    assert why and "pass --lora-targets attn" in why, why


def test_adapter_and_merge_load_in_peft_and_transformers(ckpt, tmp_path):
    from safetensors.torch import load_file

    from model.nf4 import NF4Linear
    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_adapter_and_merge_match_peft

    out, _ = assert_adapter_and_merge_match_peft(ckpt, T.GptOssForCausalLM, tmp_path, _ids(19), ATTN)
    stored, merged = (load_file(os.path.join(p, "model.safetensors")) for p in (ckpt, out))
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    kept = [k for k in stored if "experts" in k or "router" in k or "sinks" in k]
    assert len(kept) == 2 * 7 and all(torch.equal(merged[k], stored[k]) for k in kept), "fused experts as stored"
    q, _ = build_nonzero_b(BuildOptions(ckpt, quant="nf4", lora_r=4, lora_alpha=8.0, lora_targets=ATTN, seed=3))
    blk = q.model.layers[1].mlp
    assert all(isinstance(p, NF4Linear) for e in blk.experts for p in (e.gate_proj, e.up_proj, e.down_proj))
    assert type(blk.router) is torch.nn.Linear and blk.experts[0].gate_proj.bias is not None


def _layouts(rank, world_size, path, cases):
    """Each case (impl, flags): cp 2's loss and LoRA gradients = one process's on two packed rows (float64); the
    attention's LoRA on every block (tests/test_glm4_moe.py runs it too)."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims, kv_heads
    from parallel.parallelize import BuildOptions

    ids = torch.randint(0, 128, (2, 44), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.stack([torch.cat([torch.arange(17), torch.arange(27)]), torch.cat([torch.arange(30),
                                                                                   torch.arange(14)])])
    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ATTN, ac=True, dtype=torch.float64)
    margs = model.load.read_args(path)
    grads = lambda m: {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                       for k, p in m.named_parameters() if p.requires_grad}
    for impl, flags in cases:
        what = f"cp 2 {impl} {flags} rank {rank}"
        ref, _ = build_nonzero_b(BuildOptions(path, **opts))
        s, n = ref(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        dims = ParallelDims.from_args(world_size, 1, -1, 2, impl, None, margs.n_heads, kv_heads(margs))
        meshes = dims.build_mesh("cpu")
        m, _ = build_nonzero_b(BuildOptions(path, **opts, **flags), fsdp_mesh=meshes.fsdp,
                               attention=cp_attention(meshes, dims))
        c = meshes.cp.get_local_rank()
        ls, ln = m(shard_sequence(ids, dims, c, 0), position_ids=shard_sequence(pos, dims, c, None),
                   labels=shard_sequence(labels, dims, c, -100))
        total, got = ln.detach().clone(), ls.detach().clone()
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
        dist.all_reduce(got, group=meshes.dp_cp.get_group())
        (ls / total).backward()
        torch.testing.assert_close(got / total, s.detach() / n, rtol=1e-7, atol=0, msg=f"{what}: loss")
        want, have = grads(ref), grads(m)
        assert have.keys() == want.keys() and len(have) == 2 * len(ATTN) * margs.n_layers, what
        for k in have:
            assert (r := rel(have[k], want[k])) < 1e-6, f"{what}: grad {k} off by {r:.2g}"
    return True


@pytest.mark.timeout(300)
def test_cp2_ulysses_and_ring_equal_one_process(ckpt):
    from tests.dist import run_ranks

    cases = [("ulysses", {}), ("ring", dict(tiled_mlp=True))]
    assert run_ranks(_layouts, 2, ckpt, cases, timeout=280) == [True, True]


@pytest.mark.parametrize("flags", [[], ["--tiled-mlp"]], ids=["plain", "tiled_mlp"])
def test_plan_matches_autograd_and_the_parameters(tmp_path, flags):
    """No AC, fp32, one process, nf4, the kernel core (the GPU path; no window: the CPU kernel keeps a windowed layer's
    [S, S] mask, no GPU's): the plan's activation terms (parallel/plan_moe.saved's GPT-OSS branch: the softmax over
    the top k, the clamped SwiGLU's six [I] a slot) = the bytes autograd keeps for backward; its 'block norms,
    biases, routers' term = the model's frozen parameters there (the experts' and router's biases, the sinks, the
    q/k/v/o biases, the norms: parallel/plan_moe.extras)."""
    import train
    from model.nf4 import NF4Linear
    from parallel.cp import KernelAttention
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan
    from tests.helpers import planned_and_saved_activations

    ckpt = _save(tmp_path / "m", intermediate_size=32, sliding_window=None, layer_types=["full_attention"] * 2)
    args = train.build_parser().parse_args(["--model", ckpt, "--max-len", "128", "--global-batch", "1", "--quant",
                                            "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            "--lora-targets", "attn", *flags])
    ours, _ = build_model(BuildOptions(ckpt, quant="nf4", ac=False, lora_dropout=0.0, tiled_mlp=args.tiled_mlp,
                                       lora_targets=ATTN), device="cpu", attention=KernelAttention())
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)
    quantized = {f"{n}.{w}" for n, m in ours.named_modules() if isinstance(m, NF4Linear) for w in ("weight", "absmax")}
    frozen = sum(p.numel() * 4 for n, p in ours.named_parameters() if n.startswith("model.layers.")
                 and "lora_" not in n and n not in quantized)
    assert frozen > 0 and not any(n.startswith("model.layers.") and p.dtype == torch.uint8
                                  for n, p in ours.named_parameters() if n not in quantized)
    dims, pack = validate(args, ours.args, 1)
    plan = memory_plan(ours.args, dims, args, "cpu", pack).terms
    assert next(v for k, v in plan.items() if k.startswith("block norms, biases, routers")) == frozen, (plan, frozen)


def test_bench_configs_and_n_params_are_transformers():
    """bench/configs/gpt-oss-20b, -120b (the Hub's config.json, quantization_config mxfp4 as shipped): read as
    GptOssConfig reads them (the model card's sizes), n_params = transformers' parameters on the meta device (every
    bias, the sinks, the router's bias: 20.91B, 116.83B); a tiny model's n_params = its parameters."""
    import json

    sizes = {"gpt-oss-20b": (24, 32, 20.91), "gpt-oss-120b": (36, 128, 116.83)}
    for name, (layers, experts, billions) in sizes.items():
        path = os.path.join(os.path.dirname(__file__), "..", "bench", "configs", name)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        assert cfg["quantization_config"]["quant_method"] == "mxfp4"
        a, hf = model.load.read_args(path), T.GptOssConfig(**cfg)
        assert (a.n_layers, a.dim, a.n_heads, a.head_dim, a.n_kv_heads, a.moe.experts, a.moe.top_k, a.moe.width,
                a.vocab_size) == (layers, 2880, 64, 64, 8, experts, 4, 2880, 201088), name
        assert [a.window(i) for i in range(4)] == [128, None, 128, None] and a.rope_scaling["factor"] == 32.0
        with torch.device("meta"):
            n = sum(p.numel() for p in T.GptOssForCausalLM(hf).parameters())
        assert a.n_params == n and round(n / 1e9, 2) == billions, (name, a.n_params, n)
    a = model.ModelArgs.from_config_dict(T.GptOssConfig(**CONFIG).to_dict())
    assert a.n_params == sum(p.numel() for p in T.GptOssForCausalLM(T.GptOssConfig(**CONFIG)).parameters())


def test_train_py_default_targets_are_the_attention(tmp_path, capsys):
    """train.py without --lora-targets on GPT-OSS (every MLP routed experts, which LoRA does not adapt) trains the
    attention's four, said once at start-up and recorded in config.json; the adapter's target_modules are the four and
    peft loads it on GptOssForCausalLM with LoRA on each block's q/k/v/o and nothing else, every tensor as saved; the
    same names given (attn,mlp) are refused at start-up, before any weight, naming --lora-targets attn."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    import train
    from tests.fixtures import make_chat_jsonl, make_tokenizer
    from tests.helpers import one_thread, startup_error, train_argv

    tok = make_tokenizer(tmp_path / "m")
    path = _save(tmp_path / "m", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assets, out = {"model": path, "data": str(tmp_path / "chat.jsonl")}, str(tmp_path / "run")
    make_chat_jsonl(assets["data"], 16, seed=1)
    with one_thread():
        train.main(train_argv(assets, out))
    said = [ln for ln in capsys.readouterr().out.splitlines() if "--lora-targets" in ln]
    assert len(said) == 1 and said[0].startswith("--lora-targets not given: LoRA on q_proj,k_proj,v_proj,o_proj, "
                                                 "this gpt_oss model's default"), said
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["lora_targets"] == ",".join(ATTN)
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(ATTN)
    pm = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                   os.path.join(out, "adapter"))
    got = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    assert {n.split(".lora_")[0].split("layers.")[1] for n in got} == {f"{i}.self_attn.{t}" for i in range(2)
                                                                       for t in ATTN}, sorted(got)
    saved = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert len(saved) == len(got) == 2 * 4 * 2
    for k, v in saved.items():
        torch.testing.assert_close(got[k.replace(".weight", ".default.weight")], v, rtol=0, atol=0, msg=k)
    said = startup_error(train_argv(assets, str(tmp_path / "mlp"), "--lora-targets", "attn,mlp"))
    assert "experts' projections in its MoE blocks (2 of 2)" in said and "pass --lora-targets attn" in said, said
