"""Gemma 3 text models (`model_type: gemma3_text`, model/gemma.py) compute what transformers' Gemma3ForCausalLM does.

Pins (CPU, float32 unless said, a tiny random Gemma3ForCausalLM saved by transformers: 2 layers, sliding then full,
a 4-token window under 19+ token rows, 6 query / 2 KV heads of 16 (hidden 48: head_dim != hidden / heads),
query_pre_attn_scalar 24 != head_dim, the full layers' RoPE theta 1e6 scaled linear x8, the sliding layers' 1e4,
every norm weight drawn away from 0 (the identity of Gemma's offset norm), tied embeddings):
- logits = transformers' on rows far from position 0 and on a packed row of two documents; the attention scale,
  each layer's RoPE table and the embedding scale each matter there (the wrong one moves the logits far);
- config.json read as transformers reads it (layer types from sliding_window_pattern, the classic hub keys
  rope_theta / rope_local_base_freq / rope_scaling); Gemma 2's soft-capping, bidirectional attention and another
  activation refused naming the key;
- the norm = transformers' Gemma3RMSNorm in float32 and bf16 (the weight applied before the cast), outputs and
  gradients, in one chunk and in several; the embedding scale rounded to bf16 as transformers rounds it; NEFTune's
  noise added to the scaled embedding;
- LoRA's loss and every LoRA gradient = peft's on the transformers model, plain and under AC + tiled MLP + tiled
  attention (the post norms behind the tiled sublayers);
- AC's block recompute computes the sublayer outputs the post norms save (nf4, tiled MLP): grads = no AC's;
- one process = cp 2 ring = cp 2 Ulysses (2 ranks, gloo): loss, grad norm and every LoRA gradient on every rank;
- --train-norms trains the four block norms and q/k norms of each block; the adapter loads in peft with our logits;
- --plan reads bench/configs/gemma-3-12b (no weights) and counts the two RoPE tables.
- the plan's AC checkpoints (--ac-group 1-3) = the block inputs autograd keeps: the scaled embedding kept whole.

Run: .venv/bin/python -m pytest -q tests/test_gemma3.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model
from tests.dist import run_ranks

TYPES = ["sliding_attention", "full_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
CONFIG = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, layer_types=TYPES,
              rope_parameters=ROPE, max_position_embeddings=4096)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    hf = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():   # transformers starts every norm weight at 0: the identity would hide a dropped offset
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path, max_shard_size="60KB")
    return str(path)


def _hf(path):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_logits_match_transformers(ckpt):
    hf, ours = _hf(ckpt), model.from_pretrained(ckpt).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert [b.self_attn.window for b in ours.model.layers] == [4, None]
    assert [b.table for b in ours.model.layers] == [1, 0]
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        # packed: two documents, each as transformers computes it alone
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"
        # each feature matters here: the wrong one is far off
        for b in ours.model.layers:
            b.self_attn.scale = 16 ** -0.5   # head_dim's scale, not query_pre_attn_scalar's
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "attention scale has no effect"
        for b in ours.model.layers:
            b.self_attn.scale, b.table = 24 ** -0.5, 1 - b.table   # each layer the other RoPE table
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "RoPE tables have no effect"
        for b in ours.model.layers:
            b.table = 1 - b.table
        ours.args.embed_scale = False
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "embedding scale has no effect"


def test_config_read_as_transformers_reads_it():
    """The keys transformers writes; the classic hub form (google/gemma-3-4b-it's text_config: rope_theta,
    rope_local_base_freq, rope_scaling linear, sliding_window_pattern); refusals naming the key."""
    base = {**T.Gemma3TextConfig(**CONFIG).to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    a = model.ModelArgs.from_config_dict(base)
    assert (a.rope_theta, a.rope_scaling, a.local_rope) == (1e6, {"rope_type": "linear", "factor": 8.0},
                                                            {"rope_theta": 1e4})
    assert (a.attn_scale, a.tie_embeddings, a.layer_types, a.head_dim) == (24 ** -0.5, True, TYPES, 16)
    hub = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    hub.update(num_hidden_layers=7, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    want = T.Gemma3TextConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    b = model.ModelArgs.from_config_dict(hub)
    assert b.layer_types == want.layer_types == TYPES[:1] * 5 + TYPES[1:] + TYPES[:1], b.layer_types
    full, local = want.rope_parameters["full_attention"], want.rope_parameters["sliding_attention"]
    assert b.rope_parameters() == full and {"rope_type": "default", **b.local_rope} == local, (full, local)
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("use_bidirectional_attention", True), ("hidden_activation", "gelu")):
        with pytest.raises(ValueError, match=key):
            model.ModelArgs.from_config_dict({**base, key: value})
    # either layer kind's RoPE base that no model runs on (null, 0): named (a float() traceback, or NaN angles, before
    # 2026-12-07), in the classic form and in transformers' per-layer-type one
    for edit, said in (({"rope_theta": None}, "rope_theta None"), ({"rope_local_base_freq": 0.0}, "rope_theta 0.0")):
        with pytest.raises(ValueError, match=f"{said} must be a number above 0"):
            model.ModelArgs.from_config_dict({**hub, **edit})
    local = {**base["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": -1.0}}
    with pytest.raises(ValueError, match="rope_theta -1.0 must be a number above 0"):
        model.ModelArgs.from_config_dict({**base, "rope_parameters": local})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 16 * 7])
def test_norm_matches_transformers(dtype, chunk, monkeypatch):
    """model.gemma.GemmaRMSNorm against Gemma3RMSNorm on the same input and weight: the output bit for bit in float32
    and within bf16's rounding of it in bf16 (both apply (1 + w) in float32, then cast), and the gradients of input
    and weight against autograd through transformers' formula, in one chunk and in chunks of 7 rows."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    import model.gemma as gemma

    if chunk:
        monkeypatch.setattr(gemma, "NORM_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 10, 16, generator=g) * 3).to(dtype)
    w = (torch.randn(16, generator=g) * 0.5).to(dtype)
    dy = torch.randn(3, 10, 16, generator=g).to(dtype)
    theirs, ours = Gemma3RMSNorm(16, 1e-6).to(dtype), gemma.GemmaRMSNorm(16, 1e-6).to(dtype)
    results = []
    for norm in (theirs, ours):
        with torch.no_grad():
            norm.weight.copy_(w)
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        results.append((y, xi.grad, norm.weight.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert y1.dtype == dtype
    torch.testing.assert_close(y1, y0, rtol=0, atol=0, msg="output")   # same float32 math, same cast
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx1, gx0, **tol, msg="input gradient")
    torch.testing.assert_close(gw1, gw0, **tol, msg="weight gradient")


def test_embedding_scale_rounds_as_transformers_and_noise_comes_after(ckpt):
    """bf16: x·sqrt(48) with the scale rounded to bf16 first = Gemma3TextScaledWordEmbedding's output; the noise
    callable (NEFTune's) is handed that scaled output."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from model.gemma import scale_embedding

    emb = Gemma3TextScaledWordEmbedding(128, 3840, 0, embed_scale=3840 ** 0.5).to(torch.bfloat16)
    ids = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(scale_embedding(emb.weight[ids], 3840), emb(ids)), "bf16 scale (62.0, not 61.97)"
    ours, hf = model.from_pretrained(ckpt).eval(), _hf(ckpt)
    seen = []
    with torch.no_grad():
        ours(ids, noise=lambda x: seen.append(x.clone()))
        torch.testing.assert_close(seen[0], hf.model.embed_tokens(ids), rtol=0, atol=0)


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpt, mem):
    """peft's LoRA on transformers' Gemma3ForCausalLM with our adapter's values: the same loss and every LoRA
    gradient, with the memory steps that run the pre-sublayer norms inside the sublayers too."""

    from model.lora_spec import LORA_TARGETS
    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3, **mem))
    assert_lora_grads_match_peft(_hf(ckpt), LORA_TARGETS, ours, peft_model, ids, labels, 14 * 2)


def test_block_recompute_computes_the_outputs_the_post_norms_save(ckpt):
    """Under AC a Llama block's recompute skips the MLP's output (nothing saved reads it: the tiled MLP returns a
    stand-in, an NF4 down projection's base zeros); Gemma's post-feedforward norm saves that output, so there it is
    computed: nf4 with AC, and with AC + tiled MLP + tiled attention, equal the nf4 build without AC."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    got = {}
    for name, mem in (("no AC", dict(ac=False)), ("AC", dict(ac=True)),
                      ("AC, tiled", dict(ac=True, tiled_mlp=True, tiled_attn=True))):
        ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="nf4", lora_r=4, lora_alpha=8, seed=3, **mem))
        s, n = ours(ids, labels=ids)
        (s / n).backward()
        got[name] = s.detach(), {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    for name in ("AC", "AC, tiled"):
        torch.testing.assert_close(got[name][0], got["no AC"][0], rtol=1e-5, atol=1e-5, msg=f"{name}: loss")
        for k, g in got["no AC"][1].items():
            torch.testing.assert_close(got[name][1][k], g, rtol=1e-4, atol=1e-6, msg=f"{name}: grad {k}")


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpt):
    from tests.test_qlora import _cases, layout

    cases = {"Gemma 3, plain weights, cp 2 ring": layout("none", 2, "ring", family="gemma3"),
             "Gemma 3, nf4, cp 2 Ulysses": layout("nf4", 2, family="gemma3")}
    assert run_ranks(_cases, 2, {"gemma3": ckpt}, cases, timeout=280) == [len(cases)] * 2


def test_train_norms_adapter_loads_in_peft(ckpt, tmp_path):
    """--train-norms: each block's input, post-attention, pre- and post-feedforward norms and q/k norms, and the final
    norm, train; loss and gradients = peft's with them as modules_to_save; the adapter loads in peft, our logits."""
    from peft import PeftModel

    from model.export import export_adapter
    from tests.test_norms import _batch, _ours, _peft_twin

    ours, peft_model = _ours(ckpt)
    ref, mine, theirs = _peft_twin(ckpt, "none", ours)
    assert sum("norm" in k for k in mine) == 6 * 2 + 1, sorted(mine)
    ids, labels, pos = _batch()
    s, n = ours(ids, position_ids=pos, labels=labels)
    s.backward()
    logits = ref(input_ids=ids, position_ids=pos).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum",
                                      ignore_index=-100).backward()
    for k in mine:
        torch.testing.assert_close(mine[k].grad, theirs[k].grad, rtol=1e-4, atol=1e-6, msg=f"grad {k}")
    export_adapter(peft_model, str(tmp_path / "adapter"), ckpt)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert len(json.load(f)["modules_to_save"]) == 6 * 2 + 1
    peft = PeftModel.from_pretrained(_hf(ckpt), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos),
                                   rtol=1e-5, atol=1e-5, msg="peft's logits")


def test_plan_reads_the_12b_config_and_counts_both_rope_tables():
    import contextlib
    import io

    import train
    from model.load import read_args
    from parallel.mesh import ParallelDims
    from parallel.plan import memory_plan

    path = os.path.join(CONFIGS, "gemma-3-12b")
    m = read_args(path)
    assert (m.model_type, m.dim, m.n_layers, m.head_dim, m.attn_scale, m.tie_embeddings) == (
        "gemma3_text", 3840, 48, 256, 256 ** -0.5, True)
    assert [m.window(i) for i in range(6)] == [1024] * 5 + [None]
    args = train.build_parser().parse_args(["--model", path, "--max-len", "8192", "--global-batch", "1"])
    p = memory_plan(m, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 16, 8), args, "cuda", True)
    rope = [v for k, v in p.terms.items() if k.startswith("activations: rope")]
    assert rope == [2 * 2 * 8192 * 256 * 2], rope   # cos and sin, bf16, the full and the sliding layers' tables
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["--plan", "--model", path, "--max-len", "8192", "--global-batch", "1", "--gpu-mem", "80"])
    assert "gemma3_text" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("flags", [[], ["--tiled-mlp", "--tiled-attn"], ["--train-norms"],
                                   ["--lora-targets", "gate_proj,up_proj,down_proj"], ["--lora-targets", "o_proj"]],
                         ids=["plain", "tiled_both", "train_norms", "mlp", "o"])
def test_planned_activations_match_autograd(ckpt, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms (the post norms' inputs and rsqrt, both RoPE
    tables, the q/k norms' inputs) = the bytes autograd keeps for backward in a real forward (unique storages,
    parameters excluded)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    opts = dict(tiled_mlp="--tiled-mlp" in flags, tiled_attn="--tiled-attn" in flags,
                train_norms="--train-norms" in flags,
                lora_targets=tuple(flags[flags.index("--lora-targets") + 1].split(",")) if "--lora-targets" in flags
                else BuildOptions.lora_targets)
    ours, _ = build_model(BuildOptions(ckpt, quant="nf4", ac=False, lora_dropout=0.0, **opts), device="cpu")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    args = train.build_parser().parse_args(["--model", ckpt, "--max-len", "128", "--global-batch", "1", "--quant",
                                            "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0", *flags])
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_planned_ac_checkpoints_keep_the_scaled_embedding(tmp_path, group):
    """AC (--ac-group G), fp32, one process, 4 blocks: Gemma's scaled embedding output is a new tensor, so the first
    checkpoint keeps it whole (no ids to look up again, as a frozen Llama's): the plan's checkpoint term = the [T, D]
    block inputs autograd keeps outside the checkpoints (the final norm's input, planned in the loss phase, the one
    more); G > 1 planned one group input fewer before (the ids' lookup)."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    cfg = dict(CONFIG, num_hidden_layers=4, layer_types=TYPES * 2)
    torch.manual_seed(0)
    T.Gemma3ForCausalLM(T.Gemma3TextConfig(**cfg)).save_pretrained(tmp_path)
    ours, _ = build_model(BuildOptions(str(tmp_path), quant="nf4", ac=True, ac_group=group), device="cpu")
    S, D, held = 128, ours.args.dim, []
    ids = torch.randint(0, 128, (1, S), generator=torch.Generator().manual_seed(2))
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


def test_rope_scaling_overrides_load_in_transformers_as_trained(ckpt):
    """A --rope-scaling run's base_config_overrides.json (ModelArgs.rope_overrides) is per layer type for Gemma 3:
    transformers' `from_pretrained(DIR, rope_parameters=...)` with it computes our scaled model's logits (a flat dict
    there reads as the full layers' default RoPE, dropping the scaling)."""
    from model.load import read_args

    over = read_args(ckpt, "yarn:4").rope_overrides()
    assert set(over) == {"full_attention", "sliding_attention"}, over
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, rope_parameters=over).eval()
    ours = model.from_pretrained(ckpt, rope_scaling="yarn:4").eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert rel(ours(ids), _hf(ckpt)(input_ids=ids).logits) > 1e-3, "the scaling changes nothing here"
