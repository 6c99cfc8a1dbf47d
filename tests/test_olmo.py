"""OLMo 2 and OLMo 3 (`model_type: olmo2` / `olmo3`, model/gemma.py's post-norm block) compute what transformers'
Olmo2ForCausalLM and Olmo3ForCausalLM do.

Pins (CPU, float32 unless said, tiny random checkpoints saved by transformers, every norm weight drawn away from 1 and
every bias away from 0; 6 query / 2 KV heads of 8):
- OLMo 2 (attention_bias true: q/k/v/o biases) and OLMo 3 (a sliding then a full layer, a 4-token window under 19+
  token rows, the full layers' RoPE theta 1e6 scaled linear x8, the sliding layers' 1e4): logits = transformers' on
  rows far from position 0 and on a packed row of two documents; each layer's RoPE table matters there;
- config.json read as transformers reads it (OLMo 3 as it ships: rope_theta, YaRN rope_scaling on the full layers,
  layer types every fourth full; OLMo 2's one RoPE); a flat rope_parameters and an OLMo 3 rope_theta that transformers
  4.57 and 5 give the sliding layers differently are refused naming the key;
- the norm = transformers' Olmo2RMSNorm (the weight applied in float32 before the cast) in float32 and bf16, outputs
  bit for bit and gradients; q_norm / k_norm over the whole projection width (H·Hd, K·Hd), not per head;
- LoRA's loss and every LoRA gradient = peft's on the transformers model, plain and under AC + tiled MLP + tiled
  attention (the sublayers take the block input itself: no norm in front of them);
- AC's block recompute computes the sublayer outputs the post norms save (nf4, tiled MLP): grads = no AC's;
- one process = cp 2 ring = cp 2 Ulysses (2 ranks, gloo): loss, grad norm and every LoRA gradient on every rank;
- --train-norms trains the two post norms and q/k norms of each block; the adapter loads in peft with our logits;
- a checkpoint's trained whole-width q/k norms fit the base in `export --model`;
- --plan reads bench/configs/olmo-3-7b; the plan's activation terms = the bytes autograd saves (post norms, no
  pre-norms, whole-width q/k norms); --mem-phases' hooks find the MLP's input without a norm in front of it.

Run: .venv/bin/python -m pytest -q tests/test_olmo.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model
from tests.dist import run_ranks

TYPES = ["sliding_attention", "full_attention"]
ROPE3 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=4096)
CONFIGS = {"olmo2": (T.Olmo2Config, dict(SIZES, attention_bias=True, rope_theta=3e4)),
           "olmo3": (T.Olmo3Config, dict(SIZES, sliding_window=4, layer_types=TYPES, rope_parameters=ROPE3))}
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, (cls, cfg) in CONFIGS.items():
        torch.manual_seed(0)
        hf = T.AutoModelForCausalLM.from_config(cls(**cfg)).float().eval()
        with torch.no_grad():   # transformers starts norm weights at 1 and biases at 0: both would hide a dropped one
            for n, p in hf.named_parameters():
                if "norm" in n or "bias" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, max_shard_size="60KB")
        out[name] = str(path)
    return out


def _hf(path):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_logits_match_transformers(ckpts, name):
    hf, ours = _hf(ckpts[name]), model.from_pretrained(ckpts[name]).eval()
    assert type(hf).__name__ == f"{name.capitalize()}ForCausalLM"
    blocks = ours.model.layers
    assert [b.self_attn.window for b in blocks] == ([4, None] if name == "olmo3" else [None, None])
    assert all(b.pre_norms == () and b.input_layernorm is None for b in blocks)
    assert [tuple(b.self_attn.q_norm.weight.shape) + tuple(b.self_attn.k_norm.weight.shape) for b in blocks] == \
        [(48, 16)] * 2   # the whole projection's width: 6·8 and 2·8
    assert blocks[0].self_attn.q_proj.bias is not None and blocks[0].self_attn.o_proj.bias is not None or \
        name == "olmo3"
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        # packed: two documents, each as transformers computes it alone
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"
        if name == "olmo3":   # each layer the other RoPE table: far off
            assert [b.table for b in blocks] == [1, 0]
            for b in blocks:
                b.table = 1 - b.table
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "RoPE tables have no effect"


def test_config_read_as_transformers_reads_it():
    """OLMo 3 as it ships (allenai/Olmo-3-1025-7B: top-level rope_theta, YaRN rope_scaling, no rope_parameters): YaRN
    on the full layers only, the sliding layers plain 500000, layer types every fourth full; OLMo 2's one RoPE, no
    window; refusals naming the key."""
    with open(os.path.join(BENCH, "olmo-3-7b", "config.json")) as f:
        hub = {k: v for k, v in json.load(f).items() if k != "layer_types"} | {"num_hidden_layers": 8}
    a = model.ModelArgs.from_config_dict(hub)
    want = T.Olmo3Config(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    full, local = want.rope_parameters["full_attention"], want.rope_parameters["sliding_attention"]
    assert a.rope_parameters() == full and {"rope_type": "default", **a.local_rope} == local, (full, local)
    assert a.layer_types == want.layer_types == (TYPES[:1] * 3 + TYPES[1:]) * 2
    assert [a.window(i) for i in range(4)] == [4096] * 3 + [None]
    assert (a.norm_eps, a.n_kv_heads, a.qkv_bias, a.o_bias, a.tie_embeddings) == (1e-6, 32, False, False, False)
    bare = {"model_type": "olmo3", **SIZES}   # Olmo3Config's defaults
    b, w = model.ModelArgs.from_config_dict(bare), T.Olmo3Config(**SIZES)
    assert (b.rope_theta, b.local_rope, b.layer_types, b.sliding_window, b.norm_eps) == (
        w.rope_parameters["full_attention"]["rope_theta"], {"rope_theta": 5e5}, w.layer_types, w.sliding_window, 1e-5)
    two = model.ModelArgs.from_config_dict({"model_type": "olmo2", **SIZES, "rope_theta": 5e5, "attention_bias": True})
    assert (two.rope_theta, two.local_rope, two.sliding_window, two.layer_types, two.o_bias, two.qkv_bias) == (
        5e5, None, None, None, True, True)
    assert (two.post_norms, two.qk_norm_whole, two.norm_offset) == (True, True, 0.0)
    with pytest.raises(ValueError, match="rope_parameters"):   # flat: transformers reads per layer type only
        model.ModelArgs.from_config_dict({**bare, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="sliding_attention.rope_theta"):
        model.ModelArgs.from_config_dict({**bare, "rope_theta": 1e4})
    c = model.ModelArgs.from_config_dict({**bare, "rope_theta": 1e4, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}})
    assert (c.rope_theta, c.local_rope) == (1e4, {"rope_theta": 2e4})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 16 * 7])
def test_norm_matches_transformers(dtype, chunk, monkeypatch):
    """model.gemma.GemmaRMSNorm(offset 0) against Olmo2RMSNorm on the same input and weight: the output bit for bit in
    float32 and bf16 (both apply the weight in float32, then cast), and the gradients of input and weight against
    autograd through transformers' formula, in one chunk and in chunks of 7 rows."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    import model.gemma as gemma

    if chunk:
        monkeypatch.setattr(gemma, "NORM_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 10, 16, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(16, generator=g) * 0.5).to(dtype)
    dy = torch.randn(3, 10, 16, generator=g).to(dtype)
    theirs, ours = Olmo2RMSNorm(16, 1e-6).to(dtype), gemma.GemmaRMSNorm(16, 1e-6, offset=0).to(dtype)
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


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpts, name, mem):
    """peft's LoRA on transformers' model with our adapter's values: the same loss and every LoRA gradient, with the
    memory steps whose sublayers would run a norm in front of them (here: none, they take x itself)."""

    from model.lora_spec import LORA_TARGETS
    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpts[name], quant="none", lora_r=4, lora_alpha=8, seed=3, **mem))
    assert_lora_grads_match_peft(_hf(ckpts[name]), LORA_TARGETS, ours, peft_model, ids, labels, 14 * 2)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_block_recompute_computes_the_outputs_the_post_norms_save(ckpts, name):
    """Under AC a Llama block's recompute skips the MLP's output (the tiled MLP returns a stand-in, an NF4 down
    projection's base zeros); OLMo's post-feedforward norm saves that output, so there it is computed: nf4 with AC,
    and with AC + tiled MLP + tiled attention, equal the nf4 build without AC."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    got = {}
    for label, mem in (("no AC", dict(ac=False)), ("AC", dict(ac=True)),
                       ("AC, tiled", dict(ac=True, tiled_mlp=True, tiled_attn=True))):
        ours, peft_model = build_nonzero_b(BuildOptions(ckpts[name], quant="nf4", lora_r=4, lora_alpha=8, seed=3,
                                                        **mem))
        s, n = ours(ids, labels=ids)
        (s / n).backward()
        got[label] = s.detach(), {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    for label in ("AC", "AC, tiled"):
        torch.testing.assert_close(got[label][0], got["no AC"][0], rtol=1e-5, atol=1e-5, msg=f"{label}: loss")
        for k, g in got["no AC"][1].items():
            torch.testing.assert_close(got[label][1][k], g, rtol=1e-4, atol=1e-6, msg=f"{label}: grad {k}")


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    from tests.test_qlora import _cases, layout

    cases = {"OLMo 2, plain weights, cp 2 ring": layout("none", 2, "ring", family="olmo2"),
             "OLMo 3, nf4, cp 2 Ulysses": layout("nf4", 2, family="olmo3"),
             "OLMo 3, plain weights, cp 2 ring": layout("none", 2, "ring", family="olmo3")}
    assert run_ranks(_cases, 2, ckpts, cases, timeout=280) == [len(cases)] * 2


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_train_norms_adapter_loads_in_peft(ckpts, name, tmp_path):
    """--train-norms: each block's post-attention and post-feedforward norms and q/k norms, and the final norm, train;
    gradients = peft's with them as modules_to_save; the adapter loads in peft, our logits."""
    from peft import PeftModel

    from model.export import export_adapter
    from tests.test_norms import _batch, _ours, _peft_twin

    ours, peft_model = _ours(ckpts[name])
    ref, mine, theirs = _peft_twin(ckpts[name], "none", ours)
    assert sum("norm" in k for k in mine) == 4 * 2 + 1, sorted(mine)
    ids, labels, pos = _batch()
    s, n = ours(ids, position_ids=pos, labels=labels)
    s.backward()
    logits = ref(input_ids=ids, position_ids=pos).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum",
                                      ignore_index=-100).backward()
    for k in mine:
        torch.testing.assert_close(mine[k].grad, theirs[k].grad, rtol=1e-4, atol=1e-6, msg=f"grad {k}")
    export_adapter(peft_model, str(tmp_path / "adapter"), ckpts[name])
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert len(json.load(f)["modules_to_save"]) == 4 * 2 + 1
    peft = PeftModel.from_pretrained(_hf(ckpts[name]), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos),
                                   rtol=1e-5, atol=1e-5, msg="peft's logits")


def test_plan_reads_the_7b_config():
    import contextlib
    import io

    import train
    from model.load import read_args

    path = os.path.join(BENCH, "olmo-3-7b")
    m = read_args(path)
    assert (m.model_type, m.dim, m.n_layers, m.head_dim, m.post_norms, m.local_rope) == (
        "olmo3", 4096, 32, 128, True, {"rope_theta": 5e5})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["--plan", "--model", path, "--max-len", "32768", "--global-batch", "1", "--gpu-mem", "80"])
    assert "olmo3" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("name,flags", [("olmo2", []), ("olmo3", []), ("olmo2", ["--tiled-mlp", "--tiled-attn"]),
                                        ("olmo3", ["--train-norms"]), ("olmo2", ["--lora-targets", "k_proj,down_proj"]),
                                        ("olmo2", ["--lora-targets", "v_proj,o_proj"]),
                                        ("olmo2", ["--lora-targets", "o_proj,gate_proj,up_proj"]),
                                        ("olmo3", ["--lora-targets", "down_proj"])],
                         ids=["olmo2", "olmo3", "olmo2_tiled_both", "olmo3_train_norms", "olmo2_k_down",
                              "olmo2_v_o", "olmo2_o_gate_up", "olmo3_down"])
def test_planned_activations_match_autograd(ckpts, name, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms (no pre-norm: q/k/v's and gate/up's LoRA A keep the
    sublayer's input itself; the post norms' inputs and rsqrt; the q/k norms' inputs with one rsqrt a token) = the
    bytes autograd keeps for backward in a real forward (unique storages, parameters excluded)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts[name], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            *flags])
    opts = dict(tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn, train_norms=args.train_norms,
                lora_targets=tuple(args.lora_targets.split(",")))
    ours, _ = build_model(BuildOptions(ckpts[name], quant="nf4", ac=False, lora_dropout=0.0, **opts), device="cpu")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="cannot reset VmHWM")
@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled_mlp"])
def test_mem_phases_find_the_mlp_input_without_a_norm_before_it(ckpts, tiled):
    """--mem-phases hooks the norm in front of the last block's MLP: OLMo's block has none, the MLP's own input is
    watched instead; every phase fires, in the backward's order."""
    from parallel.parallelize import BuildOptions
    from parallel.phases import PhaseMeter
    from tests.helpers import build_nonzero_b
    from tests.test_phases import PHASES

    ours, _ = build_nonzero_b(BuildOptions(ckpts["olmo3"], quant="none", lora_r=4, lora_alpha=8, seed=3, ac=True,
                                           tiled_mlp=tiled))
    meter = PhaseMeter(ours, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    with meter.measuring(True):
        s, n = ours(ids, labels=ids)
        (s / n).backward()
    assert [name for name, _ in meter.phases] == PHASES, meter.phases


def test_checkpoint_export_takes_the_whole_width_q_k_norms(ckpts):
    """`export --model BASE` checks a checkpoint's trained tensors against the base's shapes (a wrong base is refused):
    OLMo's trained q_norm / k_norm are [H·Hd] and [K·Hd], not [Hd], and fit; a per-head one does not."""
    from model.load import read_args
    from parallel.checkpoint_export import _misfit
    from tests.test_norms import _ours

    ours, _ = _ours(ckpts["olmo3"])
    trained = {n: p.detach() for n, p in ours.named_parameters() if p.requires_grad}
    assert trained["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    m = read_args(ckpts["olmo3"])
    assert _misfit(trained, m) is None
    bad = dict(trained, **{"model.layers.1.self_attn.k_norm.weight": torch.zeros(8)})
    assert "k_norm.weight is [8], the model's is [16]" in _misfit(bad, m)


def test_rope_scaling_overrides_load_in_transformers_as_trained(ckpts):
    """OLMo 3 has a RoPE per layer type: a --rope-scaling run's base_config_overrides.json (ModelArgs.rope_overrides)
    names both, and transformers' `from_pretrained(DIR, rope_parameters=...)` with it computes our scaled logits."""
    from model.load import read_args

    over = read_args(ckpts["olmo3"], "yarn:4").rope_overrides()
    assert set(over) == {"full_attention", "sliding_attention"}, over
    hf = T.AutoModelForCausalLM.from_pretrained(ckpts["olmo3"], dtype=torch.float32, rope_parameters=over).eval()
    ours = model.from_pretrained(ckpts["olmo3"], rope_scaling="yarn:4").eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert rel(ours(ids), _hf(ckpts["olmo3"])(input_ids=ids).logits) > 1e-3, "the scaling changes nothing here"
