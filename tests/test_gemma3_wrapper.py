"""Gemma 3 as published for 4B-27B: a multimodal `Gemma3ForConditionalGeneration` checkpoint (SigLIP vision tower)
whose language model (`gemma3_text`) trains here (model/wrapper.py; the Mistral 3 wrapper's tests: test_wrapper.py,
test_wrapper_write.py; the text model's: test_gemma3.py).

Pins (a tiny random Gemma 3 made and saved by transformers itself, float32, a sliding and a full layer with their
own RoPE tables, query_pre_attn_scalar != head_dim, norm weights off 0):
- our logits = transformers' `Gemma3ForConditionalGeneration(input_ids=...)` on text input (1e-5), tied head (the
  outer tie_word_embeddings, Gemma3Config's default) and untied;
- a published-style text_config that names only a few sizes (google/gemma-3-12b-it's form: no vocab_size, head_dim,
  rope_theta...) reads as transformers fills it from Gemma3TextConfig's defaults;
- the adapter we export (LoRA on every projection, --train-norms: Gemma's four block norms and q/k norms) loads in
  peft on the wrapper with no missing or unexpected key, no LoRA in the vision tower (SigLIP's attention is also
  q_proj/k_proj/v_proj), and gives our logits;
- `python -m model.merge` writes a whole Gemma 3 checkpoint: transformers loads it with no missing or unexpected key,
  its logits = peft's merge_and_unload, the vision tower and projector bit-equal to the base's.
  A --rope-scaling adapter's RoPE goes in as the full-attention layers' of the per-layer-type rope_parameters
  (transformers and our reading agree), the sliding layers' kept.
- `python -m data.demo_compare` rounds the language model's block weights to NF4 (a --quant nf4 run's base), only those.

Run: .venv/bin/python -m pytest -q tests/test_gemma3_wrapper.py
"""

import os
import warnings

import pytest
import torch
import transformers as T

from tests.test_gemma3 import CONFIG

VISION = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, image_size=32, patch_size=8)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
V = CONFIG["vocab_size"]


def _wrapper(path, tie):
    cfg = T.Gemma3Config(text_config=dict(CONFIG, model_type="gemma3_text"), vision_config=VISION,
                         mm_tokens_per_image=4, tie_word_embeddings=tie)
    torch.manual_seed(0)
    m = T.Gemma3ForConditionalGeneration(cfg).float()
    with torch.no_grad():   # transformers starts every norm weight at 0: the identity would hide a dropped offset
        for n, p in m.named_parameters():
            if "norm" in n and "language_model" in n:
                p.add_(torch.randn_like(p) * 0.3)
    m.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_wrapper")
    return {tie: _wrapper(d / tie, tie == "tied") for tie in ("tied", "untied")}


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, 23), generator=g)


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_logits_equal_transformers_gemma3(bases, tie):
    from model.load import CheckpointReader, from_pretrained, read_args

    ref = T.Gemma3ForConditionalGeneration.from_pretrained(bases[tie]).eval()
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = from_pretrained(bases[tie])(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    args = read_args(bases[tie])
    hf_tied = ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    assert (args.wrapper, args.model_type, args.tie_embeddings) == ("gemma3", "gemma3_text", hf_tied), args
    reader = CheckpointReader(bases[tie])
    text_only = set(T.Gemma3ForCausalLM(ref.config.text_config).state_dict())
    assert set(reader.where) == text_only - ({"lm_head.weight"} if hf_tied else set())
    reader.close()


def test_published_text_config_reads_as_transformers_fills_it():
    """google/gemma-3-12b-it's config.json names only these text_config keys; transformers fills the rest from
    Gemma3TextConfig's defaults (vocabulary 262,208, head_dim 256, RoPE 1e6 / 1e4, every 6th layer full...)."""
    from model.config import ModelArgs

    text = {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text", "num_attention_heads": 16,
            "num_hidden_layers": 48, "num_key_value_heads": 8, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
           "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelArgs.from_config_dict(cfg)
    want = T.Gemma3Config(text_config=dict(text), vision_config=cfg["vision_config"]).text_config
    assert (ours.vocab_size, ours.dim, ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.head_dim,
            ours.intermediate_size, ours.norm_eps, ours.sliding_window, ours.layer_types, ours.max_position_embeddings,
            ours.attn_scale) == (
        want.vocab_size, want.hidden_size, want.num_hidden_layers, want.num_attention_heads, want.num_key_value_heads,
        want.head_dim, want.intermediate_size, want.rms_norm_eps, want.sliding_window, want.layer_types,
        want.max_position_embeddings, want.query_pre_attn_scalar ** -0.5)
    full, local = want.rope_parameters["full_attention"], want.rope_parameters["sliding_attention"]
    assert ours.rope_parameters() == full and {"rope_type": "default", **ours.local_rope} == local, (full, local)
    assert ours.tie_embeddings and ours.wrapper == "gemma3"


def _ours(path):
    """Our model of the wrapper's language model: LoRA on every projection with B ~ N(0, 0.05), --train-norms with the
    norms moved off the base's."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    model, peft_model = build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ALL,
                                                     train_norms=True, seed=3))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model, peft_model


def _peft_loaded(base, adapter):
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(T.Gemma3ForConditionalGeneration.from_pretrained(base), adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    return pm


def test_exported_adapter_loads_in_peft_on_gemma3_with_our_logits(bases, tmp_path):
    from model.export import export_adapter

    model, peft_model = _ours(bases["tied"])
    export_adapter(peft_model, str(tmp_path / "a"), bases["tied"])
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
    pm = _peft_loaded(bases["tied"], str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert len(lora) == 7 * CONFIG["num_hidden_layers"] and all(".language_model.layers." in n for n in lora), lora
    saved = [n for n, m in pm.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    assert saved and all(".language_model." in n for n in saved), saved
    assert any(n.endswith("pre_feedforward_layernorm") for n in saved), saved


def test_merge_into_gemma3_is_the_wrapper_peft_merges(bases, tmp_path):
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter

    base = bases["untied"]
    _, peft_model = _ours(base)
    export_adapter(peft_model, str(tmp_path / "a"), base, quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a")).merge_and_unload()
    got, info = T.Gemma3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    stored, merged = (load_file(os.path.join(p, "model.safetensors")) for p in (base, out))
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    other = [k for k in stored if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert other and all(torch.equal(merged[k], stored[k]) for k in other)


def test_demo_compare_rounds_the_language_models_blocks_to_nf4(bases):
    """`python -m data.demo_compare`'s base of a --quant nf4 run on Gemma 3 (which AutoModelForCausalLM loads as the
    wrapper): each block Linear of the language model holds training's NF4 of its weight, nothing else changes (the
    SigLIP tower's q/k/v_proj, the projector) (review, helper 124: only text-only names matched: no round trip)."""
    from data.demo_compare import nf4_round_trip
    from model.nf4 import nf4_round_trip as nf4

    model = T.AutoModelForImageTextToText.from_pretrained(bases["untied"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nf4_round_trip(model)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    blocks = {f"model.language_model.layers.{i}.{'mlp' if p in ALL[4:] else 'self_attn'}.{p}.weight"
              for i in range(CONFIG["num_hidden_layers"]) for p in ALL}
    assert changed == blocks, sorted(changed ^ blocks)
    for n in blocks:
        assert torch.equal(model.get_parameter(n), nf4(before[n])), n


def test_merge_into_gemma3_writes_the_adapters_rope_as_its_full_layers(bases, tmp_path):
    """A --rope-scaling adapter's RoPE (base_config_overrides.json) merged into a Gemma 3 whose text_config holds
    transformers 5's per-layer-type rope_parameters: transformers reads it as the full-attention layers' RoPE, the
    sliding layers' kept, and so do we (review, helper 125: a flat dict was written there, which transformers reads
    as the full layers' default RoPE: the scaling the adapter learned with was lost)."""
    from model import merge
    from model.export import export_adapter
    from model.load import read_args

    base = bases["untied"]
    _, peft_model = _ours(base)
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    export_adapter(peft_model, str(tmp_path / "a"), base, rope_parameters=rope, quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    got = T.Gemma3Config.from_pretrained(out).text_config.rope_parameters
    assert {k: got["full_attention"].get(k) for k in rope} == rope, got
    assert got["sliding_attention"] == T.Gemma3Config.from_pretrained(base).text_config.rope_parameters[
        "sliding_attention"], got
    assert read_args(out).rope_parameters() == {**rope, "original_max_position_embeddings": 4096}, \
        read_args(out).rope_parameters()


def test_processor_chat_template_is_the_tokenizers_when_it_has_none(tmp_path):
    """Multimodal repos (Mistral Small 3.1, Gemma 3) may keep the chat template in the processor's chat_template.json
    only, which AutoTokenizer does not read: data.load.load_tokenizer takes it then, so chat data render as
    transformers renders them with that template; a chat_template.json without one is refused naming it."""
    import json

    from data.jsonl import DataError
    from data.load import load_tokenizer
    from tests.fixtures import make_tokenizer

    ref = make_tokenizer(tmp_path / "ref")
    want = ref.chat_template
    assert want, "the fixture tokenizer has a template"
    d = tmp_path / "proc"
    make_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.jinja"):
        f.unlink()
    assert T.AutoTokenizer.from_pretrained(str(d)).chat_template is None, "the template is still in the tokenizer"
    (d / "chat_template.json").write_text(json.dumps({"chat_template": want}))
    tok = load_tokenizer(d)
    msgs = [{"role": "user", "content": "how far is it"}, {"role": "assistant", "content": "two days on foot"}]
    assert tok.chat_template == want
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    (d / "chat_template.json").write_text(json.dumps({"other": 1}))
    with pytest.raises(DataError, match="chat_template.json holds no"):
        load_tokenizer(d)
