"""Qwen3.5 (`model_type: qwen3_5_text`, Qwen3_5ForCausalLM; the multimodal `qwen3_5`, Qwen3_5ForConditionalGeneration,
the form Qwen/Qwen3.5-9B, -27B ... ship in) with every layer `full_attention` compute what transformers does (with its
Gated DeltaNet layers, `linear_attention`: tests/test_qwen3_5_hybrid.py).

Pins (CPU, float32, tiny random checkpoints saved by transformers itself, every norm weight drawn away from 0, the
zero-centred norms' identity; 6 query / 2 KV heads of 16):
- the text model (attention_bias true, partial RoPE 0.5 with mrope keys): logits = transformers' on rows far from
  position 0 and on a packed row of two documents (each as transformers computes it alone); the output gate, the
  partial RoPE and the offset norms each matter there;
- partial RoPE: model.rope's tables and Rotary (eager chunks, the formula) = transformers' Qwen3_5TextRotaryEmbedding
  and apply_rotary_pos_emb, values and gradients;
- config.json read as Qwen3_5TextConfig reads it (0.25 factor and layer types by default, the factor at the top
  level, a classic rope_scaling); a layer type Qwen3.5 has not refused naming it;
- LoRA's loss and every LoRA gradient = peft's on Qwen3_5ForCausalLM, plain and under AC + tiled MLP + tiled attention
  (the tiles recompute the gate with q);
- one process = cp 2 Ulysses = cp 2 ring (2 ranks, gloo);
- the wrapper: our logits = Qwen3_5ForConditionalGeneration's on text (tied by the outer tie_word_embeddings, untied),
  mtp.* tensors in the weights ignored as transformers ignores them; our exported adapter loads in peft on the wrapper
  with no key warning, no LoRA in the vision tower (its qkv/proj Linears), our logits; `python -m model.merge` = peft's
  merge_and_unload, the vision tower and mtp tensors bit-equal.

Run: .venv/bin/python -m pytest -q tests/test_qwen3_5.py
"""

import json
import os
import warnings

import pytest
import torch
import transformers as T

import model
from tests.dist import run_ranks

ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2],
        "mrope_interleaved": True}
SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, layer_types=["full_attention"] * 2)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _offset_norms(m, where=""):
    with torch.no_grad():   # transformers starts these norms at 0 (the identity): a dropped offset would not show
        for n, p in m.named_parameters():
            if "norm" in n and where in n:
                p.add_(torch.randn_like(p) * 0.3)


def _add_mtp(path):
    """Multi-token-prediction tensors beside the model's, as the Hub's checkpoints store them (transformers ignores
    them: _keys_to_ignore_on_load_unexpected)."""
    from safetensors.torch import load_file, save_file

    fn = os.path.join(path, "model.safetensors")
    save_file({**load_file(fn), "mtp.fc.weight": torch.randn(48, 96), "mtp.norm.weight": torch.randn(48)}, fn,
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    torch.manual_seed(0)
    hf = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**SIZES, attention_bias=True, rope_parameters=dict(ROPE))).float()
    _offset_norms(hf)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "bias" in n:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(out.setdefault("text", str(tmp_path_factory.mktemp("qwen3_5_text"))))
    _add_mtp(out["text"])
    for tie in ("tied", "untied"):   # the wrapper: Qwen3_5TextConfig's default RoPE (theta 1e4, factor 0.25)
        cfg = T.Qwen3_5Config(text_config=dict(SIZES, model_type="qwen3_5_text"), vision_config=VISION,
                              tie_word_embeddings=tie == "tied")
        torch.manual_seed(1)
        m = T.Qwen3_5ForConditionalGeneration(cfg).float()
        _offset_norms(m, "language_model")
        m.save_pretrained(out.setdefault(tie, str(tmp_path_factory.mktemp(f"qwen3_5_{tie}"))))
        _add_mtp(out[tie])
    return out


def _hf(path):
    cls = T.Qwen3_5ForCausalLM if "text" in os.path.basename(path) else T.Qwen3_5ForConditionalGeneration
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(path, dtype=torch.float32).eval()


def _ids(s=37, seed=1):
    return torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(ckpts, monkeypatch):
    hf, ours = _hf(ckpts["text"]), model.from_pretrained(ckpts["text"]).eval()
    a = ours.args
    assert (a.attn_gate, a.rotary_dim, a.norm_offset, a.sliding_window, a.o_bias) == (True, 8, 1.0, None, True)
    ids, pos = _ids(), torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]   # two documents, each alone in transformers
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"
    monkeypatch.setattr("model.llama.gated", lambda out, g: out)   # without the output gate: far off
    with torch.no_grad():
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "the gate changes nothing here"

def test_partial_rope_matches_transformers(monkeypatch):
    """Our tables and Rotary (eager: _RopeFn in sequence chunks; the formula, as compiled code runs it) = transformers'
    rotary embedding and apply_rotary_pos_emb: the first int(Hd·f) dims rotate, the rest pass; gradients too."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as Q

    from model import rope
    from model.config import ModelArgs

    cfg = {"model_type": "qwen3_5_text", **SIZES, "rope_parameters": dict(ROPE, rope_theta=5e5)}
    a = ModelArgs.from_config_dict(cfg)
    hf = Q.Qwen3_5TextRotaryEmbedding(T.Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    pos = torch.arange(40).expand(2, 40) + torch.tensor([[7], [300]])
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 40, 6, 16, generator=g), torch.randn(2, 40, 2, 16, generator=g)
    cos, sin = rope.cos_sin(a, pos, torch.float32)
    hcos, hsin = hf(q, pos[None].expand(3, -1, -1))   # (the grids' positions, text's on each: as Qwen3_5TextModel
    # hands them; transformers 5.17's rotary takes no [B, S] form)
    torch.testing.assert_close(cos, hcos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hsin, rtol=0, atol=1e-6)
    assert cos.shape[-1] == a.rotary_dim == 8
    monkeypatch.setattr(rope, "ROPE_CHUNK", 6 * 16 * 2 * 7)   # several sequence chunks
    for label, c in (("eager", cos), ("formula", cos.clone().requires_grad_())):   # (grad tables: the formula)
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        qr, kr = rope.Rotary()(qa, ka, c, sin)
        qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
        wq, wk = Q.apply_rotary_pos_emb(qb.transpose(1, 2), kb.transpose(1, 2), hcos, hsin)
        torch.testing.assert_close(qr, wq.transpose(1, 2), rtol=1e-6, atol=1e-6, msg=f"{label}: q")
        torch.testing.assert_close(kr, wk.transpose(1, 2), rtol=1e-6, atol=1e-6, msg=f"{label}: k")
        assert torch.equal(qr[..., 8:], q[..., 8:]), "the unrotated dims pass"
        dy = torch.randn(qr.shape, generator=g), torch.randn(kr.shape, generator=g)
        torch.autograd.backward((qr, kr), dy)
        torch.autograd.backward((wq.transpose(1, 2), wk.transpose(1, 2)), dy)
        torch.testing.assert_close(qa.grad, qb.grad, rtol=1e-6, atol=1e-6, msg=f"{label}: dq")
        torch.testing.assert_close(ka.grad, kb.grad, rtol=1e-6, atol=1e-6, msg=f"{label}: dk")


def test_config_read_as_transformers_reads_it():
    """Qwen3_5TextConfig's defaults (factor 0.25, theta 1e4, 4 KV heads, head_dim 256, untied, no window), the factor
    from the top level or a classic rope_scaling, mrope's keys; rope_parameters() hands transformers the factor."""
    from model.config import ModelArgs

    bare = {k: v for k, v in SIZES.items() if k not in ("num_key_value_heads", "head_dim")} | {"num_attention_heads": 8}
    for extra in ({}, {"partial_rotary_factor": 0.5, "rope_theta": 1e6},
                  {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.125}},
                  {"rope_parameters": dict(ROPE)}):
        ours = ModelArgs.from_config_dict({"model_type": "qwen3_5_text", **bare, **extra})
        want = T.Qwen3_5TextConfig(**bare, **extra)
        rp = {k: v for k, v in want.rope_parameters.items() if k not in ("mrope_section", "mrope_interleaved")}
        assert ours.rope_parameters() == rp, (extra, ours.rope_parameters(), rp)
        assert (ours.n_kv_heads, ours.head_dim, ours.rotary_dim, ours.tie_embeddings, ours.sliding_window,
                ours.norm_eps, ours.qkv_bias) == (want.num_key_value_heads, want.head_dim,
                                                  int(want.head_dim * rp["partial_rotary_factor"]),
                                                  want.tie_word_embeddings, None, want.rms_norm_eps, False), extra
    assert model.ModelArgs.from_config_dict({"model_type": "qwen3_5_text", **SIZES}).projections()["q_proj"] == \
        (48, 2 * 6 * 16), "q_proj holds the query and the gate"
    with pytest.raises(ValueError, match="partial_rotary_factor"):   # other families: refused as before
        ModelArgs.from_config_dict({"model_type": "qwen3", **bare, "partial_rotary_factor": 0.5})


def test_layer_types_other_than_qwen35s_are_refused():
    """A layer type Qwen3.5 has not (sliding_attention): refused naming it (its linear_attention layers are read:
    tests/test_qwen3_5_hybrid.py)."""
    from model.config import ModelArgs

    with pytest.raises(ValueError, match="sliding_attention"):
        ModelArgs.from_config_dict({"model_type": "qwen3_5_text", **SIZES,
                                    "layer_types": ["full_attention", "sliding_attention"]})


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpts, mem):
    """peft's LoRA on Qwen3_5ForCausalLM with our adapter's values: the same loss and every LoRA gradient (q_proj's
    LoRA B spans query and gate)."""
    from peft import LoraConfig, get_peft_model

    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = _ids(29, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(12), torch.arange(17)]).expand(2, 29)   # packed: two documents a row
    ours, peft_model = build_nonzero_b(BuildOptions(ckpts["text"], quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=ALL, **mem))
    s, n = ours(ids, position_ids=pos, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = get_peft_model(_hf(ckpts["text"]), LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL),
                                                       lora_dropout=0.0, init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    hf.train()
    logits = torch.cat([hf(input_ids=ids[:, :12]).logits, hf(input_ids=ids[:, 12:]).logits], 1)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    assert theirs.keys() == mine.keys() and len(mine) == 14 * 2
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=f"grad {k}")


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    from tests.test_qlora import _cases, layout

    cases = {"Qwen3.5, plain weights, cp 2 Ulysses": layout("none", 2, family="text"),
             "Qwen3.5, nf4, cp 2 ring": layout("nf4", 2, "ring", family="text")}
    assert run_ranks(_cases, 2, ckpts, cases, timeout=280) == [len(cases)] * 2


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_wrapper_logits_equal_transformers(ckpts, tie):
    from model.load import CheckpointReader, read_args

    ref = _hf(ckpts[tie])
    with torch.no_grad():
        want, got = ref(input_ids=_ids()).logits, model.from_pretrained(ckpts[tie])(_ids())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    args = read_args(ckpts[tie])
    hf_tied = ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    assert (args.wrapper, args.model_type, args.tie_embeddings, hf_tied) == ("qwen3_5", "qwen3_5_text", tie == "tied",
                                                                             tie == "tied"), args
    from model.load_checks import check_config_shapes
    assert check_config_shapes(ckpts[tie], args) is None   # train.py's start-up check: q_proj [2·H·Hd, D], no note
    reader = CheckpointReader(ckpts[tie])   # the language model's tensors only: no model.visual.*, no mtp.*
    text_only = set(T.Qwen3_5ForCausalLM(ref.config.text_config).state_dict())
    assert set(reader.where) == text_only - ({"lm_head.weight"} if hf_tied else set())
    reader.close()


def _ours(path):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    return build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ALL,
                                        train_norms=True, seed=3))


def _peft_loaded(base, adapter):
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(_hf(base), adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    return pm


def test_exported_adapter_loads_in_peft_on_the_wrapper_with_our_logits(ckpts, tmp_path):
    from model.export import export_adapter

    ours, peft_model = _ours(ckpts["tied"])
    export_adapter(peft_model, str(tmp_path / "a"), ckpts["tied"])
    with open(tmp_path / "a" / "adapter_config.json") as f:
        assert "language_model" in json.load(f)["target_modules"]
    with torch.no_grad():
        mine = ours(_ids())
    pm = _peft_loaded(ckpts["tied"], str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=_ids()).logits, mine, rtol=1e-5, atol=1e-5)
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert len(lora) == 7 * 2 and all(".language_model.layers." in n for n in lora), lora
    saved = [n for n, m in pm.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    assert saved and all(".language_model." in n for n in saved), saved


def test_merge_into_the_wrapper_is_what_peft_merges(ckpts, tmp_path):
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter

    base = ckpts["untied"]
    _, peft_model = _ours(base)
    export_adapter(peft_model, str(tmp_path / "a"), base, quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a")).merge_and_unload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, info = T.Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= {"mtp.fc.weight", "mtp.norm.weight"}, info
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)
    stored, merged = (load_file(os.path.join(p, "model.safetensors")) for p in (base, out))
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    other = [k for k in stored if k.startswith(("model.visual.", "mtp."))]
    assert len(other) > 2 and all(torch.equal(merged[k], stored[k]) for k in other)


@pytest.mark.parametrize("flags", [[], ["--lora-targets", "k_proj,down_proj"], ["--lora-targets", "q_proj,v_proj"],
                                   ["--tiled-mlp", "--tiled-attn"], ["--lora-targets", "o_proj,gate_proj,up_proj"]],
                         ids=["all", "k_down", "q_v", "tiled_both", "o_gate_up"])
def test_planned_activations_match_autograd(ckpts, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms = the bytes autograd keeps for backward (unique
    storages, parameters excluded). The gated attention keeps sigmoid(gate) [T, H·Hd] and, for o_proj's LoRA A, the
    gated product (o_proj's input is no view of the core's output); partial RoPE's tables are [T, R]; the tiles keep
    neither (they recompute the gate with q)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts["text"], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            *flags])
    ours, _ = build_model(BuildOptions(ckpts["text"], quant="nf4", ac=False, lora_dropout=0.0,
                                       tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn,
                                       lora_targets=tuple(args.lora_targets.split(","))), device="cpu")
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


def test_planned_weights_are_the_models(ckpts):
    """One process, fp32, nf4: the plan's base weights (NF4 codes of every block Linear: q_proj's [2·H·Hd, D] with its
    gate half) and LoRA terms (16 bytes an element) = the built model's parameters."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(["--model", ckpts["text"], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32"])
    ours, _ = build_model(BuildOptions(ckpts["text"], quant="nf4", lora_targets=tuple(args.lora_targets.split(","))),
                          device="cpu")
    dims, pack = validate(args, ours.args, 1)
    terms = memory_plan(ours.args, dims, args, "cpu", pack).terms
    nbytes = lambda key: sum(p.numel() * p.element_size() for n, p in ours.named_parameters()
                             if ".layers." in n and key(n))
    assert next(v for k, v in terms.items() if k.startswith("base weights")) == nbytes(
        lambda n: n.endswith("base_layer.weight"))
    assert next(v for k, v in terms.items() if k.startswith("LoRA params")) == 4 * nbytes(lambda n: "lora_" in n)
