"""SmolLM3 (`model_type: smollm3`, NoPE layers) and Granite 3 dense (`granite`, four multipliers) compute what
transformers' SmolLM3ForCausalLM and GraniteForCausalLM do (model/arch_fields.py's smollm3_fields, granite_fields).

Pins (CPU, float32 unless said, tiny random checkpoints saved by transformers, norm weights drawn away from 1; 6 query /
2 KV heads of 8; Granite's multipliers far from 1: embedding 7, residual 0.3, attention 0.05, logits / 4):
- logits = transformers' on rows far from position 0 and on a packed row of two documents: SmolLM3 with a NoPE layer
  after a RoPE layer (RoPE there is far off), and with its sliding window on the NoPE layers (a 4-token window under
  37-token rows); Granite (each multiplier set to 1 is far off); in bf16 within rounding;
- config.json read as transformers reads it: SmolLM3-3B's and Granite 3.3 8B's (bench/configs), SmolLM3Config's
  defaults (every fourth layer NoPE, theta 2e6, tied, 4 KV heads), its sliding layers; refusals naming the key;
- LoRA's loss and every LoRA gradient = peft's on the transformers model, plain and under AC + tiled MLP + tiled
  attention; one process = cp 2 ring = cp 2 Ulysses (2 ranks, gloo) on every rank;
- --train-norms: the adapter loads in peft with our logits;
- Granite's per-token losses (DPO's log-probs) and token accuracy come from the scaled logits (transformers');
- --plan reads both bench configs; the plan's activation terms = the bytes autograd saves; with AC the first
  checkpoint keeps Granite's scaled embedding output whole (offload moves L block inputs, not L - 1).

Run: .venv/bin/python -m pytest -q tests/test_smollm3_granite.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model
from tests.dist import run_ranks

SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MULT = dict(embedding_multiplier=7.0, residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=4.0)
CONFIGS = {"smollm3": (T.SmolLM3Config, dict(SIZES, no_rope_layer_interval=2, rope_theta=3e4)),
           "smollm3_slide": (T.SmolLM3Config, dict(SIZES, no_rope_layer_interval=2, use_sliding_window=True,
                                                   sliding_window=4)),
           "granite": (T.GraniteConfig, dict(SIZES, **MULT, rope_theta=3e4))}
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, (cls, cfg) in CONFIGS.items():
        torch.manual_seed(0)
        hf = T.AutoModelForCausalLM.from_config(cls(**cfg)).float().eval()
        with torch.no_grad():   # transformers starts norm weights at 1: a dropped one would hide
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, max_shard_size="60KB")
        out[name] = str(path)
    return out


def _hf(path, dtype=torch.float32):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _rows():
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(ckpts, name):
    hf, ours = _hf(ckpts[name]), model.from_pretrained(ckpts[name]).eval()
    blocks = ours.model.layers
    want = {"smollm3": ([True, False], [None, None]), "smollm3_slide": ([True, False], [None, 4]),
            "granite": ([True, True], [None, None])}[name]
    assert ([b.self_attn.rope for b in blocks], [b.self_attn.window for b in blocks]) == want
    ids, pos = _rows()
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]   # two documents, each as transformers alone
        alone = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), alone) < 1e-5, "packed row"
        if name.startswith("smollm3"):   # RoPE on the NoPE layer: far off
            blocks[1].self_attn.rope = True
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "the NoPE layer has no effect"
            return
        a = ours.args   # each multiplier matters
        for field in ("embed_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier"):
            was = getattr(a, field)
            setattr(a, field, 1.0)
            for b in blocks:
                b.residual, b.self_attn.scale = a.residual_multiplier, a.attn_scale
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, f"{field} has no effect"
            setattr(a, field, was)
            for b in blocks:
                b.residual, b.self_attn.scale = a.residual_multiplier, a.attn_scale


@pytest.mark.parametrize("name", ["smollm3_slide", "granite"])
def test_bf16_logits_within_rounding(ckpts, name):
    """bf16: the multiplies in transformers' places and dtypes; logits within bf16 rounding of transformers' bf16."""
    hf, ours = _hf(ckpts[name], torch.bfloat16), model.from_pretrained(ckpts[name], dtype=torch.bfloat16).eval()
    ids, pos = _rows()
    with torch.no_grad():
        ref, got = hf(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos)
        exact = _hf(ckpts[name])(input_ids=ids, position_ids=pos).logits
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), ref.float()) < 1e-2 and rel(got.float(), exact) < 2 * rel(ref.float(), exact) + 1e-3


def test_config_read_as_transformers_reads_it():
    """SmolLM3-3B and Granite 3.3 8B as they ship, SmolLM3Config's defaults and sliding layers; refusals naming the
    key."""
    for d in ("smollm3-3b", "granite-3.3-8b"):
        with open(os.path.join(BENCH, d, "config.json")) as f:
            hub = json.load(f)
        a = model.ModelArgs.from_config_dict(hub)
        cls = T.SmolLM3Config if d.startswith("smollm3") else T.GraniteConfig
        w = cls(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
        assert (a.rope_theta, a.n_kv_heads, a.tie_embeddings, a.norm_eps, a.max_position_embeddings) == (
            w.rope_parameters["rope_theta"], w.num_key_value_heads, w.tie_word_embeddings, w.rms_norm_eps,
            w.max_position_embeddings)
        assert [a.window(i) for i in range(a.n_layers)] == [None] * a.n_layers, d
        if d.startswith("smollm3"):
            assert a.rope_layers == w.no_rope_layers and a.rope_layers[:4] == [1, 1, 1, 0]
            assert a.attn_scale == 128 ** -0.5
        else:
            assert a.rope_layers is None and (a.embed_multiplier, a.residual_multiplier, a.attn_scale,
                                              a.logits_scaling) == (12.0, 0.22, 0.0078125, 16.0)
    bare = {k: v for k, v in SIZES.items() if "token" not in k} | {"num_hidden_layers": 8}
    s, w = model.ModelArgs.from_config_dict({"model_type": "smollm3", **bare}), T.SmolLM3Config(**bare)
    assert (s.rope_layers, s.rope_theta, s.tie_embeddings, s.sliding_window) == (
        w.no_rope_layers, w.rope_parameters["rope_theta"], True, None) and s.rope_layers[3] == 0
    s = model.ModelArgs.from_config_dict({"model_type": "smollm3", **bare, "num_key_value_heads": None})
    assert s.n_kv_heads == 6   # (null: the query heads', as SmolLM3Config; missing: 4)
    slide = dict(bare, use_sliding_window=True, sliding_window=16)
    s, w = model.ModelArgs.from_config_dict({"model_type": "smollm3", **slide}), T.SmolLM3Config(**slide)
    assert s.layer_types == w.layer_types and [s.window(i) for i in range(4)] == [None, None, None, 16]
    g = model.ModelArgs.from_config_dict({"model_type": "granite", **bare})
    assert (g.embed_multiplier, g.residual_multiplier, g.attention_multiplier, g.logits_scaling, g.tie_embeddings,
            g.sliding_window, g.rope_theta) == (1.0, 1.0, 1.0, 1.0, False, None, 1e4)
    slid = ["sliding_attention"] * 8
    for cfg, key in (({"model_type": "smollm3", **bare, "layer_types": slid}, "use_sliding_window"),
                     ({"model_type": "smollm3", **bare, "no_rope_layers": [1, 2] * 4}, "no_rope_layers"),
                     ({"model_type": "smollm3", **bare, "no_rope_layers": [1, 0]}, "no_rope_layers"),
                     ({"model_type": "granite", **bare, "logits_scaling": 0}, "logits_scaling"),
                     ({"model_type": "granite", **bare, "residual_multiplier": "0.2"}, "residual_multiplier"),
                     ({"model_type": "granitemoehybrid", **bare}, "granitemoehybrid")):
        with pytest.raises(ValueError, match=key):
            model.ModelArgs.from_config_dict(cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpts, name, mem):
    """peft's LoRA on transformers' model with our adapter's values: the same loss and every LoRA gradient (Granite:
    the residual multiplier in o_proj's output summed in place and on the tiled MLP's output)."""

    from model.lora_spec import LORA_TARGETS
    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpts[name], quant="none", lora_r=4, lora_alpha=8, seed=3, **mem))
    assert_lora_grads_match_peft(_hf(ckpts[name]), LORA_TARGETS, ours, peft_model, ids, labels, 14 * 2)


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    from tests.test_qlora import _cases, layout

    cases = {"SmolLM3, plain weights, cp 2 ring": layout("none", 2, "ring", family="smollm3"),
             "SmolLM3 sliding, nf4, cp 2 Ulysses": layout("nf4", 2, family="smollm3_slide"),
             "Granite, nf4, cp 2 ring": layout("nf4", 2, "ring", family="granite"),
             "Granite, plain weights, cp 2 Ulysses": layout("none", 2, family="granite")}
    assert run_ranks(_cases, 2, ckpts, cases, timeout=280) == [len(cases)] * 2


@pytest.mark.parametrize("name", ["smollm3", "granite"])
def test_train_norms_adapter_loads_in_peft(ckpts, name, tmp_path):
    from peft import PeftModel

    from model.export import export_adapter
    from tests.test_norms import _batch, _ours

    ours, peft_model = _ours(ckpts[name])
    ids, _, pos = _batch()
    export_adapter(peft_model, str(tmp_path / "adapter"), ckpts[name])
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert len(json.load(f)["modules_to_save"]) == 2 * 2 + 1
    peft = PeftModel.from_pretrained(_hf(ckpts[name]), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos),
                                   rtol=1e-5, atol=1e-5, msg="peft's logits")


def test_granite_per_token_losses_and_accuracy_use_the_scaled_logits(ckpts):
    """`per_token=True` (DPO's log-probs) = -log_softmax of transformers' logits (divided by logits_scaling) at each
    target, and `hits` (token accuracy) counts transformers' argmax."""
    hf, ours = _hf(ckpts["granite"]), model.from_pretrained(ckpts["granite"]).eval()
    ids, pos = _rows()
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    hits = torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        nll, n = ours(ids, position_ids=pos, labels=labels, per_token=True)
        ours(ids, position_ids=pos, labels=labels, hits=hits)
        z = hf(input_ids=ids, position_ids=pos).logits
    keep = labels != -100
    want = -z.log_softmax(-1)[keep].gather(1, labels[keep][:, None])[:, 0]
    torch.testing.assert_close(nll.view(2, -1)[keep], want, rtol=1e-5, atol=1e-5)
    assert hits.item() == (z.argmax(-1) == labels)[keep].sum().item() and n == keep.sum()


def test_plan_reads_the_bench_configs():
    import contextlib
    import io

    import train

    for d, mt in (("smollm3-3b", "smollm3"), ("granite-3.3-8b", "granite")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.main(["--plan", "--model", os.path.join(BENCH, d), "--max-len", "32768", "--global-batch", "1",
                        "--gpu-mem", "80"])
        assert mt in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("name,flags", [("smollm3_slide", []), ("granite", []), ("granite", ["--tiled-mlp",
                                                                                            "--tiled-attn"]),
                                        ("smollm3", ["--train-norms"])],
                         ids=["smollm3", "granite", "granite_tiled_both", "smollm3_train_norms"])
def test_planned_activations_match_autograd(ckpts, name, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms = the bytes autograd keeps for backward in a real
    forward (unique storages, parameters excluded): the NoPE layer's unrotated q, k and the multipliers save no more."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts[name], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            *flags])
    opts = dict(tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn, train_norms=args.train_norms)
    ours, _ = build_model(BuildOptions(ckpts[name], quant="nf4", ac=False, lora_dropout=0.0, **opts), device="cpu")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


def test_planner_counts_granites_scaled_first_checkpoint(ckpts):
    """AC + offload: the first checkpoint keeps Granite's scaled embedding output (no token-id lookup: ac._FromIds
    would lose the multiplier), so offload moves both block inputs, and the plan's host bytes say so."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    ours, _ = build_model(BuildOptions(ckpts["granite"], quant="nf4", dtype=torch.float32, ac=True,
                                       offload_activations=True), device="cpu")
    ids = torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(2))
    ours(ids, labels=ids)
    args = train.build_parser().parse_args(["--model", ckpts["granite"], "--max-len", "128", "--global-batch", "1",
                                            "--offload-activations"])
    dims, pack_rows = validate(args, ours.args, 1)
    moved = ours.model.layers[0].forward.hooks.moved
    p = memory_plan(ours.args, dims, args, "cuda", pack_rows)
    assert moved == 2 and p.host == moved * p.host_each, (moved, p.host / p.host_each)


def test_step_time_leaves_the_nope_layers_rope_pass_out():
    """plan_speed: SmolLM3-3B's RoPE work (the elementwise time a RoPE pass adds) is 27/36 of the same model's with
    RoPE on all 36 layers: its every fourth layer has none."""
    from dataclasses import replace

    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan_speed import step_seconds

    path = os.path.join(BENCH, "smollm3-3b")
    m = read_args(path)
    args = train.build_parser().parse_args(["--model", path, "--max-len", "32768", "--global-batch", "1"])
    dims, pack = validate(args, m, 1)
    work = {k: step_seconds(a, dims, args, "cuda", pack, rope=5)[1]["elementwise"]
            - step_seconds(a, dims, args, "cuda", pack, rope=0)[1]["elementwise"]
            for k, a in (("nope", m), ("all", replace(m, rope_layers=None)))}
    assert sum(m.rope_layers) == 27 and work["nope"] == pytest.approx(work["all"] * 27 / 36, rel=1e-9), work


@pytest.mark.parametrize("group", [1, 2, 3])
def test_planned_ac_checkpoints_keep_granites_scaled_embedding(tmp_path, group):
    """AC (--ac-group G), fp32, one process, 4 blocks: Granite's embedding × embedding_multiplier is a new tensor, so
    the first checkpoint keeps it whole: the plan's checkpoint term = the [T, D] block inputs autograd keeps (the final
    norm's input, planned in the loss phase, the one more); G > 1 planned one group input fewer (the ids' lookup)."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    torch.manual_seed(0)
    T.GraniteForCausalLM(T.GraniteConfig(**dict(SIZES, num_hidden_layers=4), **MULT)).save_pretrained(tmp_path)
    ours, _ = build_model(BuildOptions(str(tmp_path), quant="nf4", ac=True, ac_group=group), device="cpu")
    S, D, held = 128, ours.args.dim, []
    ids = torch.randint(0, SIZES["vocab_size"], (1, S), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        ours(ids, labels=ids)
    args = train.build_parser().parse_args(["--model", str(tmp_path), "--max-len", str(S), "--global-batch", "1",
                                            "--dtype", "fp32", "--ac-group", str(group)])
    dims, pack_rows = validate(args, ours.args, 1)
    p = memory_plan(ours.args, dims, args, "cpu", pack_rows)
    (planned,) = [v for k, v in p.terms.items() if k.startswith("activations: ") and "checkpoints" in k]
    kept = held.count(((1, S, D), torch.float32)) - 1
    assert held.count(((1, S), torch.int64)) == 0 and kept == -(-4 // group), (kept, held)
    assert planned == kept * 4 * S * D, (planned / (4 * S * D), kept)
