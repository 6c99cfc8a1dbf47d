"""Gemma 4's dense language model (`gemma4_text`, Gemma4ForCausalLM; the multimodal `gemma4` wrapper,
Gemma4ForConditionalGeneration: google/gemma-4-31B's form) computes what transformers does.

Pins (CPU, float32, tiny random models made and saved by transformers: 4 layers sliding, full, sliding, full, a
4-token window under 19+ token rows, 4 query heads; sliding layers 2 KV heads of 16, full layers their own head size
32 (and 1 KV head with attention_k_eq_v), every norm weight and layer_scalar drawn away from 1):
- logits = transformers' on rows far from position 0 and on a packed row (each document as transformers computes it
  alone), attention_k_eq_v true (no v_proj on the full layers) and false, final_logit_softcapping on; softcap,
  layer_scalar, v_norm and the per-layer-type RoPE each move the logits far when dropped;
- proportional RoPE (the full layers') = transformers' Gemma4TextRotaryEmbedding + apply_rotary_pos_emb, and it is
  not a prefix partial RoPE;
- config.json read as Gemma4TextConfig reads it (global_head_dim / num_global_key_value_heads or per_layer_config;
  the last layer made full; layer_scalar loaded from the checkpoint); n_params = the model's parameters;
  bidirectional attention and another activation refused naming the key (26B-A4B's MoE block:
  tests/test_gemma4_moe.py; E2B / E4B's parts: tests/test_gemma4_small.py);
- LoRA's loss and every LoRA gradient = peft's on Gemma4ForCausalLM (targets naming v_proj: peft and we adapt the
  sliding layers' v_proj only), plain and under AC + tiled MLP + tiled attention;
- the wrapper: logits = Gemma4ForConditionalGeneration's (with a vision tower); our exported adapter loads in peft on
  it with our logits and no LoRA in the vision tower; `python -m model.merge` = peft's merge_and_unload, layer_scalar
  and the vision tower written as stored;
- a train.py run with --tiled-mlp --tiled-attn trains (the memory plan: tests/test_plan_layers.py; --cp:
  tests/test_gemma4_layouts.py).

Run: .venv/bin/python -m pytest -q tests/test_gemma4.py
"""

import os
import warnings

import pytest
import torch
import transformers as T

import model

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIG = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              hidden_size_per_layer_input=0, sliding_window=4, layer_types=TYPES, max_position_embeddings=4096,
              final_logit_softcapping=None)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _perturb(m):
    """transformers starts every norm weight and layer_scalar at 1: the identity would hide a dropped one."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n and "vision" not in n:
                p.add_(torch.randn_like(p) * 0.3)
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar"):
                b.fill_(0.5 + torch.rand(()).item())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d, out = tmp_path_factory.mktemp("gemma4"), {}
    for kv in (True, False):
        torch.manual_seed(0)
        hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**CONFIG, attention_k_eq_v=kv)).float().eval()
        _perturb(hf)
        hf.save_pretrained(d / str(kv))
        out[kv] = str(d / str(kv))
    return out


def _hf(path, **kw):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _ids(s=37, seed=1):
    return torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k_eq_v", [True, False], ids=["k_eq_v", "v_proj"])
def test_logits_match_transformers(ckpts, k_eq_v):
    hf, ours = _hf(ckpts[k_eq_v], final_logit_softcapping=2.0), model.from_pretrained(ckpts[k_eq_v]).eval()
    ours.args.logit_softcap = 2.0   # (the tiny model's logits are small: a low cap makes it act)
    assert type(hf).__name__ == "Gemma4ForCausalLM"
    blocks = ours.model.layers
    assert [(b.self_attn.head_dim, b.self_attn.n_kv_heads, b.self_attn.v_proj is None) for b in blocks] == [
        (16, 2, False), (32, 1 if k_eq_v else 2, k_eq_v)] * 2
    assert [b.self_attn.window for b in blocks] == [4, None] * 2 and [b.table for b in blocks] == [1, 0] * 2
    for i, b in enumerate(blocks):   # loaded from the checkpoint, not the module's 1
        assert torch.equal(b.layer_scalar, hf.model.layers[i].layer_scalar) and b.layer_scalar.item() != 1
    ids = _ids()
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"
        ours.args.logit_softcap = None
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "softcap has no effect"
        ours.args.logit_softcap = 2.0
        for b in blocks:   # each layer the other type's RoPE table: a shape error or far off
            b.table = 1 - b.table
        try:
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "RoPE tables have no effect"
        except RuntimeError:   # (q and k of one size, the table of the other)
            pass
        for b in blocks:
            b.table = 1 - b.table
            b.layer_scalar.fill_(1.0)
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "layer_scalar has no effect"


def test_proportional_rope_matches_transformers():
    """The full layers' RoPE: 512-dim heads, a quarter of the frequencies (dims 0-63 and 256-319 rotate), theta 1e6,
    as the 31B; the sliding layers' default over 256, theta 1e4. cos/sin tables and the rotated q = transformers'."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding, apply_rotary_pos_emb

    from model.rope import Rotary, rope_tables

    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
               num_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=0)
    args = model.ModelArgs.from_config_dict({**T.Gemma4TextConfig(**cfg).to_dict(), "architectures": None})
    rot = Gemma4TextRotaryEmbedding(T.Gemma4TextConfig(**cfg))
    pos = torch.tensor([[0, 1, 7, 1000, 70000]])
    x = torch.randn(1, 5, 2, 512, generator=torch.Generator().manual_seed(0))
    (cos, lcos), (sin, lsin) = rope_tables(args, pos, torch.float32)
    for kind, c, s, hd in (("full_attention", cos, sin, 512), ("sliding_attention", lcos, lsin, 256)):
        rc, rs = rot(x, pos, kind)
        assert c.shape[-1] == hd and torch.equal(c, rc) and torch.equal(s, rs), kind
        want = apply_rotary_pos_emb(x[..., :hd], rc, rs, unsqueeze_dim=2)
        torch.testing.assert_close(Rotary()(x[..., :hd], None, c, s)[0], want, rtol=1e-6, atol=1e-6, msg=kind)
    moved = (apply_rotary_pos_emb(x, *rot(x, pos, "full_attention"), unsqueeze_dim=2) != x).any(-2).any(0).any(0)
    assert moved.nonzero().flatten().tolist() == list(range(64)) + list(range(256, 320)), "rotated dims"
    prefix = model.config.replace(args, rope_scaling={}, partial_rotary_factor=0.25)   # Qwen3.5's partial RoPE
    pc, ps = rope_tables(prefix, pos, torch.float32)[0][0], rope_tables(prefix, pos, torch.float32)[1][0]
    assert rel(Rotary()(x, None, pc, ps)[0], want := apply_rotary_pos_emb(x, *rot(x, pos, "full_attention"),
                                                                          unsqueeze_dim=2)) > 1e-2, "prefix RoPE"


def test_config_read_as_transformers_reads_it(ckpts):
    """The 31B's keys (global_head_dim, num_global_key_value_heads, k_eq_v) and transformers' own per_layer_config
    form give the same args; the last layer made full; n_params = our model's parameters; the refusals."""
    base = {**T.Gemma4TextConfig(**CONFIG, attention_k_eq_v=True).to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    a = model.ModelArgs.from_config_dict(base)
    assert [a.attn_dims(i) for i in range(4)] == [(4, 2, 16), (4, 1, 32)] * 2
    assert (a.attn_scale, a.norm_offset, a.tie_embeddings, a.sliding_window, a.logit_softcap) == (1.0, 0.0, True, 4,
                                                                                                 None)
    assert a.rope_parameters() == base["rope_parameters"]["full_attention"] and a.local_rope == {"rope_theta": 1e4}
    hub = {k: v for k, v in base.items() if k != "per_layer_config"}
    hub.update(global_head_dim=32, num_global_key_value_heads=1, final_logit_softcapping=30.0)
    b = model.ModelArgs.from_config_dict(hub)
    assert [b.attn_dims(i) for i in range(4)] == [a.attn_dims(i) for i in range(4)] and b.logit_softcap == 30.0
    odd = {**hub, "layer_types": TYPES[:3] + ["sliding_attention"]}   # transformers: the last layer full
    assert model.ModelArgs.from_config_dict(odd).layer_types == T.Gemma4TextConfig(
        **{**CONFIG, "layer_types": odd["layer_types"]}).layer_types == TYPES
    for kind, theta in (("full_attention", None), ("sliding_attention", 0)):   # (a float() traceback or NaN angles
        rope = {**base["rope_parameters"], kind: {**base["rope_parameters"][kind], "rope_theta": theta}}   # before
        with pytest.raises(ValueError, match=f"rope_theta {theta} must be a number above 0"):   # 2026-12-07)
            model.ModelArgs.from_config_dict({**base, "rope_parameters": rope})
    no_kv = model.ModelArgs.from_config_dict({**hub, "attention_k_eq_v": False})   # (num_global_* unread then)
    assert no_kv.attn_dims(1) == (4, 2, 32) and no_kv.has(1, "v_proj")
    for k_eq_v, path in ckpts.items():
        args = model.load.read_args(path)
        ours = model.from_pretrained(path)
        assert args.n_params == sum(p.numel() for n, p in ours.named_parameters() if "_norm." not in n
                                    or "layernorm" in n), k_eq_v
        assert args.has(1, "v_proj") != k_eq_v and args.has(0, "v_proj")
    for key, value in (("use_bidirectional_attention", "all"), ("hidden_activation", "gelu")):   # (E2B / E4B's
        with pytest.raises(ValueError, match=key):   # parts: tests/test_gemma4_small.py)
            model.ModelArgs.from_config_dict({**base, key: value})
    with pytest.raises(ValueError, match="rope-scaling"):
        a.with_rope_scaling("yarn:2")


def _lora_grads(path, targets, mem, labels_cap=None):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b, lora_grads_and_peft

    ids = _ids(29, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=targets, **mem))
    if labels_cap:
        ours.args.logit_softcap = labels_cap
    return lora_grads_and_peft(_hf(path, final_logit_softcapping=labels_cap), targets, ours, peft_model, ids, labels)


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpts, mem):
    """peft's LoRA on Gemma4ForCausalLM with our adapter's values, every projection named (v_proj too: the k_eq_v
    layers have none, in peft and here): the same loss and every LoRA gradient."""
    s, ref, mine, theirs = _lora_grads(ckpts[True], ALL, mem)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5, msg="loss")
    assert theirs.keys() == mine.keys() and len(mine) == (7 + 7 + 6 + 6) * 2, sorted(set(mine) ^ set(theirs))
    for k in mine:   # (relative to the gradient's norm: transformers' own float32 gradients lie 3e-5 from its
        assert rel(mine[k], theirs[k]) < 1e-4, f"grad {k}"   # float64 ones on this model, as ours do)


def test_softcapped_loss_matches_transformers(ckpts):
    s, ref, mine, theirs = _lora_grads(ckpts[True], ("q_proj", "v_proj"), dict(ac=False), labels_cap=30.0)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5, msg="loss")
    for k in mine:
        assert rel(mine[k], theirs[k]) < 1e-4, f"grad {k}"


# ----------------------------------------------------------------------------- the wrapper


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    cfg = T.Gemma4Config(text_config=dict(CONFIG, model_type="gemma4_text", attention_k_eq_v=True),
                         vision_config=VISION, audio_config=None)
    torch.manual_seed(0)
    m = T.Gemma4ForConditionalGeneration(cfg).float()
    _perturb(m)
    path = tmp_path_factory.mktemp("gemma4_wrapper")
    m.save_pretrained(path)
    return str(path)


def _peft_loaded(base, adapter):
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(T.Gemma4ForConditionalGeneration.from_pretrained(base), adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    return pm


def _ours(path):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    return build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ALL, seed=3))


def test_wrapper_logits_adapter_and_merge(wrapped, tmp_path):
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter
    from model.load import from_pretrained, read_args

    ref = T.Gemma4ForConditionalGeneration.from_pretrained(wrapped).eval()
    assert any("vision_tower" in n for n, _ in ref.named_parameters())
    ids = _ids(23)
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(wrapped)(ids), ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    args = read_args(wrapped)
    assert (args.wrapper, args.model_type, args.global_head_dim) == ("gemma4", "gemma4_text", 32)
    ours, peft_model = _ours(wrapped)
    export_adapter(peft_model, str(tmp_path / "a"), wrapped, quant="none")
    with torch.no_grad():
        want = ours(ids)
    pm = _peft_loaded(wrapped, str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert len(lora) == 7 + 7 + 6 + 6 and all(".language_model.layers." in n for n in lora), lora
    out = str(tmp_path / "merged")
    assert merge.main(["--model", wrapped, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    merged_ref = pm.merge_and_unload()
    got, info = T.Gemma4ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, merged_ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    stored, merged = (load_file(os.path.join(p, "model.safetensors")) for p in (wrapped, out))
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    kept = [k for k in stored if "vision" in k or k.endswith("layer_scalar")]
    assert len(kept) > 4 and all(torch.equal(merged[k], stored[k]) for k in kept)


# ----------------------------------------------------------------------------- runs


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="cannot reset VmHWM")
def test_mem_phases_hook_a_last_layer_without_v_proj(ckpts):
    """--mem-phases hooks the last block's q/k/v projections: a k_eq_v Gemma 4's last layer (always full) has no
    v_proj (AttributeError on None before); every phase fires, in the backward's order."""
    from parallel.parallelize import BuildOptions
    from parallel.phases import PhaseMeter
    from tests.helpers import build_nonzero_b
    from tests.test_phases import PHASES

    ours, _ = build_nonzero_b(BuildOptions(ckpts[True], quant="none", lora_r=4, lora_alpha=8, seed=3, ac=True))
    assert ours.model.layers[-1].self_attn.v_proj is None
    meter = PhaseMeter(ours, torch.device("cpu"))
    with meter.measuring(True):
        s, n = ours(_ids(29), labels=_ids(29))
        (s / n).backward()
    assert [name for name, _ in meter.phases] == PHASES, meter.phases


def test_train_runs_with_tiled_mlp_and_attention(assets, tmp_path):
    """train.py, 3 steps on the fixture tokenizer's chat records, a k_eq_v Gemma 4 (pad id 0, as Gemma's): with AC
    (the default), --tiled-mlp and --tiled-attn every step's loss, grad norm and the adapter = the run without AC's."""
    import train
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv
    from tests.test_train import _compare

    tok = make_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    cfg = {**CONFIG, "vocab_size": len(tok), "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 0,
           "bos_token_id": None}
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg, attention_k_eq_v=True)).float()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "model")
    a = {**assets, "model": str(tmp_path / "model")}
    with one_thread():
        for name, flags in (("plain", ["--no-ac"]), ("tiled", ["--tiled-mlp", "--tiled-attn"])):
            train.main(train_argv(a, str(tmp_path / name), *flags))
    _compare("Gemma 4 tiled", str(tmp_path / "tiled"), str(tmp_path / "plain"))
