"""The decoder reproduces transformers' logits on the same checkpoint, and loading fails clearly.

Pins: for a tiny random checkpoint of each supported family (Llama 3 with llama3 rope scaling,
Llama 2, Qwen2 with q/k/v bias, Qwen3 with q/k norm and explicit head_dim, Mistral, a YaRN Qwen2,
a tied-embedding model), saved sharded by transformers, `model.from_pretrained` gives logits within
1e-5 relative norm (float32) of transformers' own model, with position ids far from 0 so rope
scaling matters; both config formats (classic `rope_theta`/`rope_scaling` and `rope_parameters`)
load; missing directory / config / tensors and unsupported architectures raise clear errors, and so does a
checkpoint with no language-model head (a classifier's or reward model's score head, an embedding *Model).

config.json keys read as transformers 5 reads them, its `from_pretrained` of the edited file the reference: a
Mistral config.json with `layer_types` (transformers: Ministral) and Ministral itself, a missing `sliding_window`
(4096), `max_position_embeddings` (the family's default, YaRN's original length), `head_dim` (Qwen3's 128) or
`num_key_value_heads` (Mistral's 8, Qwen2's 32), a null YaRN factor, llama3
without (or with a top-level) original length, both RoPE forms agreeing, bias keys the class ignores; keys this
decoder lacks (another hidden_act, attention dropout, per-layer-type RoPE, disagreeing RoPE forms, a RoPE that
cannot be computed) are refused at read time, and so are RoPE values no model runs on (a rope_theta or scaling factor
not a number above 0, a rope_scaling or rope_parameters that is no JSON object), naming the key and its value.

Also a single-file checkpoint (model.safetensors without an index), and sliding windows shorter
than the row (Mistral; Qwen2 with max_window_layers; Qwen3 with layer_types; Qwen with the window
switched off) give transformers' logits within 1e-5, whole rows and packed ones.

The eager RMSNorm over row chunks (uneven, several; model.rmsnorm.NORM_CHUNK made small) gives transformers'
Qwen2RMSNorm output bit for bit in float32 and bfloat16, and its autograd input and weight gradients; so
does the CUDA path's wiring of aten's fused kernels (the real forward; the backward from the formula).

Run: .venv/bin/python -m pytest -q tests/test_model.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=4096)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0}

FAMILIES = {
    "llama3": lambda: T.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, attention_bias=True),
    "llama2": lambda: T.LlamaConfig(**COMMON),
    "qwen2": lambda: T.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2_yarn": lambda: T.Qwen2Config(**COMMON, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e6}),
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=24),
    "mistral": lambda: T.MistralConfig(**COMMON, sliding_window=None),
    "tied": lambda: T.Qwen2Config(**COMMON, tie_word_embeddings=True),
}
# Sliding windows shorter than the 37-token rows: family -> (config, the window of each layer).
WINDOWED = {
    "mistral_window8": (lambda: T.MistralConfig(**COMMON, sliding_window=8), [8, 8]),
    "qwen2_max_window_layers": (lambda: T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                                      max_window_layers=1), [None, 5]),
    "qwen3_layer_types": (lambda: T.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=7,
                                                layer_types=["sliding_attention", "full_attention"]), [7, None]),
    "qwen2_window_off": (lambda: T.Qwen2Config(**COMMON, use_sliding_window=False, sliding_window=5,
                                               max_window_layers=0), [None, None]),
}


def save_checkpoint(cfg, path, classic=False):
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():   # non-trivial norms and biases, so a skipped one shows
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, max_shard_size="40KB")   # several shards + index.json
    if classic:   # rewrite to the classic hub format: top-level rope_theta / rope_scaling
        p = os.path.join(path, "config.json")
        c = json.load(open(p))
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        json.dump(c, open(p, "w"))
    return hf


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = save_checkpoint(FAMILIES[family](), tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json"), "checkpoint should be sharded"
    ours = model.from_pretrained(str(tmp_path)).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 37))
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [3000]])   # far from 0
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        out = ours(ids, position_ids=pos)
    assert out.shape == ref.shape
    assert rel(out, ref) < 1e-5, f"{family}: relative error {rel(out, ref):.2e}"


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_logits_match_transformers(family, tmp_path):
    """Per-layer windows read like transformers (Mistral's sliding_window; Qwen's use_sliding_window
    with max_window_layers or layer_types) and the logits match it, in a whole row and in a packed one."""
    make, windows = WINDOWED[family]
    hf = save_checkpoint(make(), tmp_path)
    ours = model.from_pretrained(str(tmp_path)).eval()
    assert [blk.self_attn.window for blk in ours.model.layers] == windows, family
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref, out = hf(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos)
        assert rel(out, ref) < 1e-5, f"{family}: relative error {rel(out, ref):.2e}"
        if any(windows):   # the window matters here: full attention would be far off
            for blk in ours.model.layers:
                blk.self_attn.window = None
            assert rel(ours(ids, position_ids=pos), ref) > 1e-3, f"{family}: window has no effect"
            for blk, w in zip(ours.model.layers, windows):
                blk.self_attn.window = w
        # Packed row: two documents, each as transformers computes it alone.
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        got = ours(ids[:1], position_ids=packed)
        assert rel(got, want) < 1e-5, f"{family} packed: relative error {rel(got, want):.2e}"


def test_window_config_errors():
    with pytest.raises(ValueError, match="sliding_window 0 must be a positive number of tokens"):
        model.ModelArgs(sliding_window=0)
    with pytest.raises(ValueError, match="layer_types must name .* each of the 2 layers, got 1 entries"):
        model.ModelArgs(n_layers=2, sliding_window=4, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match=r"got 2 entries \['chunked_attention'\]"):
        model.ModelArgs(n_layers=2, sliding_window=4, layer_types=["chunked_attention", "full_attention"])


@pytest.mark.parametrize("family", ["llama3", "qwen2_yarn"])
def test_classic_config_format(family, tmp_path):
    hf = save_checkpoint(FAMILIES[family](), tmp_path, classic=True)
    cfg = json.load(open(tmp_path / "config.json"))
    assert "rope_parameters" not in cfg and "rope_scaling" in cfg
    args = model.read_args(str(tmp_path))
    assert args.rope_scaling["rope_type"] == FAMILIES[family]().rope_parameters["rope_type"]
    ours = model.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 96, (1, 20))
    pos = torch.arange(20)[None] + 2000
    with torch.no_grad():
        assert rel(ours(ids, position_ids=pos), hf(input_ids=ids, position_ids=pos).logits) < 1e-5


def test_loss_path_matches_cross_entropy(tmp_path):
    save_checkpoint(FAMILIES["qwen2"](), tmp_path)
    ours = model.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 96, (2, 16))
    labels = torch.randint(0, 96, (2, 16))
    labels[0, :5] = -100
    loss_sum, n = ours(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(ours(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    assert int(n) == 27
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=1e-5)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        model.from_pretrained(str(tmp_path))
    json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
              open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match=r"unsupported architecture.*gpt2.*Qwen3"):
        model.read_args(str(tmp_path))
    good = tmp_path / "good"
    save_checkpoint(FAMILIES["llama2"](), good)
    # drop one shard's entries from the index: the error names the missing tensors
    idx = json.load(open(good / "model.safetensors.index.json"))
    gone = sorted(k for k in idx["weight_map"] if "layers.1.mlp" in k)
    for k in gone:
        del idx["weight_map"][k]
    json.dump(idx, open(good / "model.safetensors.index.json", "w"))
    with pytest.raises(ValueError, match=r"lacks 3 tensors.*model\.layers\.1\.mlp\.down_proj\.weight"):
        model.from_pretrained(str(good))


def _drop(*keys):
    return lambda c: [c.pop(k, None) for k in keys]


def _set(**kv):
    return lambda c: c.update(kv)


def _no_lengths(c):   # (transformers saves the original length inside rope_parameters)
    c.pop("max_position_embeddings")
    c["rope_parameters"].pop("original_max_position_embeddings")


# config.json keys read as transformers reads them (its AutoConfig and class defaults), each case a config, an edit
# of the saved config.json, the windows per layer expected, and the row length (long enough for a default window).
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
READ_AS_TRANSFORMERS = {
    # a Mistral config.json with a layer_types key is read as Ministral: the window only where it says so
    "mistral_layer_types": (lambda: T.MistralConfig(**COMMON, sliding_window=6),
                            _set(layer_types=["full_attention", "sliding_attention"]), [None, 6], 37),
    "mistral_layer_types_null": (lambda: T.MistralConfig(**COMMON, sliding_window=6), _set(layer_types=None),
                                 [6, 6], 37),
    "ministral": (lambda: T.MinistralConfig(**COMMON, head_dim=16, sliding_window=6,   # (its class needs head_dim)
                                            layer_types=["sliding_attention", "full_attention"]), None, [6, None], 37),
    # no sliding_window key: transformers' 4096, which a 4,200-token row reaches past
    "mistral_no_window_key": (lambda: T.MistralConfig(**COMMON), _drop("sliding_window"), [4096, 4096], 4200),
    "qwen2_no_window_key": (lambda: T.Qwen2Config(**COMMON, use_sliding_window=True, max_window_layers=0),
                            _drop("sliding_window"), [4096, 4096], 4200),
    # no max_position_embeddings: the family's default is YaRN's original length (Qwen2 32768, Mistral 131072)
    "qwen2_yarn_no_max_pos": (lambda: T.Qwen2Config(**COMMON, rope_parameters=dict(YARN)), _no_lengths,
                              [None, None], 37),
    "mistral_yarn_no_max_pos": (lambda: T.MistralConfig(**COMMON, sliding_window=None, rope_parameters=dict(YARN)),
                                _no_lengths, [None, None], 37),
    # a null YaRN factor: max_position_embeddings / the original length (4096 / 512 = 8)
    "yarn_factor_null": (lambda: T.Qwen2Config(**COMMON, rope_parameters={**YARN,
                                                                         "original_max_position_embeddings": 512}),
                         lambda c: c["rope_parameters"].update(factor=None), [None, None], 37),
    # llama3 without its original length: max_position_embeddings; a top-level one goes first
    "llama3_no_original": (lambda: T.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE)),
                           lambda c: c["rope_parameters"].pop("original_max_position_embeddings"), [None, None], 37),
    "llama3_top_level_original": (lambda: T.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE)),
                                  _set(original_max_position_embeddings=1024), [None, None], 37),
    # both RoPE forms, saying the same: accepted
    "rope_both_forms_agree": (lambda: T.Qwen2Config(**COMMON, rope_parameters={
        **YARN, "original_max_position_embeddings": 512}), _set(rope_theta=1e6, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}), [None, None], 37),
    # bias keys the family's transformers class ignores
    "mistral_attention_bias": (lambda: T.MistralConfig(**COMMON, sliding_window=None), _set(attention_bias=True),
                               [None, None], 37),
    "qwen2_mlp_bias": (lambda: T.Qwen2Config(**COMMON), _set(mlp_bias=True), [None, None], 37),
    "qwen3_mlp_bias": (lambda: T.Qwen3Config(**COMMON), _set(mlp_bias=True), [None, None], 37),
    # no head_dim or num_key_value_heads: the class's default, not hidden_size / heads or the heads (until 2026-12-06
    # refused as "tensor shapes disagree with config.json (wrong config.json for these weights?)"): Qwen3's head_dim
    # 128, Mistral's 8 KV heads, Qwen2's 32
    "qwen3_no_head_dim": (lambda: T.Qwen3Config(**COMMON), _drop("head_dim"), [None, None], 37),
    "mistral_no_kv_heads": (lambda: T.MistralConfig(**{**COMMON, "num_attention_heads": 16, "num_key_value_heads": 8},
                                                    sliding_window=None), _drop("num_key_value_heads"), [None] * 2, 37),
    "qwen2_no_kv_heads": (lambda: T.Qwen2Config(**{**COMMON, "hidden_size": 128, "num_attention_heads": 64,
                                                   "num_key_value_heads": 32}),
                          _drop("num_key_value_heads"), [None] * 2, 37),
}


@pytest.mark.parametrize("case", sorted(READ_AS_TRANSFORMERS))
def test_config_keys_read_as_transformers_reads_them(case, tmp_path):
    """The saved config.json edited, then transformers' own `from_pretrained` of it is the reference: our logits
    within 1e-5, and each layer's window as it applies it."""
    make, edit, windows, n = READ_AS_TRANSFORMERS[case]
    save_checkpoint(make(), tmp_path)
    if edit is not None:
        c = json.load(open(tmp_path / "config.json"))
        edit(c)
        json.dump(c, open(tmp_path / "config.json", "w"))
    hf = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = model.from_pretrained(str(tmp_path)).eval()
    assert [blk.self_attn.window for blk in ours.model.layers] == windows, case
    ids = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)[None] + (30000 if n < 1000 else 0)   # far out: the RoPE cases differ there most
    with torch.no_grad():
        ref, out = hf(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos)
    assert rel(out, ref) < 1e-5, f"{case}: relative error {rel(out, ref):.2e}"


@pytest.mark.parametrize("edit, phrase", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters per layer type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
      "rope_scaling": {"type": "yarn", "factor": 4.0}}, r"both rope_scaling .* and they disagree.*\(10000\.0\)"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, r"RoPE .* cannot be computed \(KeyError"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),   # (until 2026-12-04 ignored
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     r"rope_parameters\.partial_rotary_factor 0\.25 is not supported"),   # inside the RoPE too: a whole-head RoPE)
], ids=["hidden_act", "attention_dropout", "nested_rope", "rope_forms_disagree", "rope_missing_factor", "partial_rope",
        "partial_rope_inside"])
def test_config_keys_this_decoder_lacks_are_refused(edit, phrase):
    with pytest.raises(ValueError, match=phrase):
        model.ModelArgs.from_config_dict({**COMMON, "model_type": "qwen3", **edit})


@pytest.mark.parametrize("edit, phrase", [
    ({"rope_theta": 0}, r"rope_theta 0 must be a number above 0"),
    ({"rope_theta": -5.0}, r"rope_theta -5\.0 must be a number above 0"),
    ({"rope_theta": None}, r"rope_theta None must be a number above 0"),
    ({"rope_theta": "abc"}, r"rope_theta 'abc' must be a number above 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, r"rope_theta 0\.0 must be a number above 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"factor 0 must be a number above 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0}}, r"factor -2\.0 must be a number above 0"),
    ({"rope_scaling": "yarn"}, r"rope_scaling 'yarn' must be an object"),
    ({"rope_scaling": [2.0]}, r"rope_scaling \[2\.0\] must be an object"),
    ({"rope_parameters": "default"}, r"rope_parameters 'default' must be an object"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps -1e-06 must be a small number >= 0"),   # (not RoPE's: read alike)
], ids=["theta_0", "theta_negative", "theta_null", "theta_string", "theta_0_inside", "linear_0", "yarn_negative",
        "scaling_string", "scaling_list", "parameters_string", "norm_eps_negative"])
def test_rope_values_no_model_can_run_are_refused(edit, phrase):
    """A RoPE (or norm eps) config.json value that no model runs on is refused at read time, naming the key, its value
    and the file to fix. Until 2026-12-07 a rope_theta of 0 or below, or a scaling factor of 0, trained every step to a
    NaN loss and the run ended "done" (exit 0, a NaN adapter written); a null or string rope_theta, or a rope_scaling /
    rope_parameters that is no JSON object, was a traceback once the process group was up."""
    with pytest.raises(ValueError, match=phrase) as e:
        model.ModelArgs.from_config_dict({**COMMON, "model_type": "qwen2", **edit})
    assert "config.json" in str(e.value) and "fix it" in str(e.value), str(e.value)


def test_an_odd_head_dim_is_named_not_a_partial_rope_factor_never_set():
    """An odd head_dim (RoPE rotates pairs) is said as head_dim's, not as a partial_rotary_factor 1.0 the config.json
    never set (until 2026-12-07); with a factor set, the factor's words stay."""
    with pytest.raises(ValueError, match=r"^head_dim 7 must be even: RoPE rotates its dims in pairs.*config\.json"):
        model.ModelArgs.from_config_dict({**COMMON, "model_type": "qwen3", "head_dim": 7})
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5 must be a number in \(0, 1\] giving an even"):
        model.ModelArgs.from_config_dict({**COMMON, "model_type": "qwen3_5_text", "head_dim": 6,
                                          "partial_rotary_factor": 0.5, "layer_types": ["full_attention"] * 2})


def test_a_run_directory_or_an_adapter_as_model_is_named_so(tmp_path):
    """--model given train.py's OUT or OUT/adapter (JSON no checkpoint has): said so, with the flags to use."""
    run, adapter = tmp_path / "run", tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "/ckpt/base", "global_batch": 8, "lora_r": 16}))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x"}))
    with pytest.raises(ValueError, match=r"is a train.py run directory, not a model: its base was --model "
                                         r"'/ckpt/base'; its adapter is .*run/adapter' \(--init-adapter\)"):
        model.read_args(str(run))
    with pytest.raises(ValueError, match=r"is a PEFT adapter, not a model: pass its base as --model .* and the "
                                         r"adapter as --init-adapter"):
        model.read_args(str(adapter))


@pytest.mark.parametrize("cls", ["Qwen2ForSequenceClassification", "Qwen2Model"])
def test_a_model_without_a_language_model_head_is_refused(cls, tmp_path):
    """A reward or classifier checkpoint (transformers' own *ForSequenceClassification save: a `score` head) or an
    embedding model's (*Model: no head, no `model.` prefix) is refused at config.json, naming its architectures.
    Until 2026-12-06 a tied one loaded silently, its score head dropped and the embedding taken as the LM head; an
    untied one failed after tokenizing ("lacks lm_head.weight"), a *Model one as "not these weights' config.json"."""
    torch.manual_seed(0)
    getattr(T, cls)(T.Qwen2Config(**COMMON, tie_word_embeddings=True, num_labels=1)).save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json"))["architectures"] == [cls]
    with pytest.raises(ValueError, match=rf"architectures \['{cls}'\] is not a causal language model"):
        model.from_pretrained(str(tmp_path))


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        model.ModelArgs.from_config_dict({**COMMON, "model_type": "llama",
                                          "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_single_file_checkpoint(tmp_path):
    """A checkpoint saved as one model.safetensors (no index) loads the same way."""
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(FAMILIES["qwen3"]()).float().eval()
    hf.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = model.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():
        assert rel(ours(ids), hf(input_ids=ids).logits) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 6 * 16 * 7])
def test_rope_chunks_match_transformers(dtype, chunk, monkeypatch):
    """Eager RoPE (model.rope._RopeFn: sequence chunks both ways, a multiply and a fused multiply-add per half)
    against transformers' apply_rotary_pos_emb on the same inputs: outputs and the q and k gradients (autograd
    through transformers' formula) within one rounding of the dtype, and no farther from the float64 result of
    that formula than transformers' own, in the mean and at the worst element; in one chunk and in chunks of 672
    elements (100 tokens: q in 3-token chunks, the last of 1; k in 10-token ones), GQA (6 query, 2 KV heads), two
    rows."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    import model.llama as llama
    import model.rope as rope

    if chunk:
        monkeypatch.setattr(rope, "ROPE_CHUNK", chunk)   # elements per chunk
    torch.manual_seed(0)
    args = model.ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, rope_theta=1e6)
    holder = type("M", (), {"args": args})()   # Transformer.rope reads only self.args
    cos, sin = llama.Transformer.rope(holder, torch.arange(100).expand(2, 100), dtype)   # [2, 100, 16]
    q, k = torch.randn(2, 100, 6, 16).to(dtype), torch.randn(2, 100, 2, 16).to(dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def hf(x, c, s, g):   # transformers' formula in x's dtype: (outputs, input gradients), back in [B, S, H, hd]
        ref = [t.transpose(1, 2).clone().requires_grad_() for t in x]   # transformers: [B, H, S, hd]
        out = apply_rotary_pos_emb(*ref, c, s, unsqueeze_dim=1)
        torch.autograd.backward(out, [t.transpose(1, 2) for t in g])
        return [t.detach().transpose(1, 2) for t in out] + [t.grad.transpose(1, 2) for t in ref]

    ours = [x.clone().requires_grad_() for x in (q, k)]
    oq, ok = rope.Rotary()(*ours, cos, sin)
    assert oq.grad_fn.name().endswith("_RopeFnBackward"), oq.grad_fn.name()
    torch.autograd.backward((oq, ok), (gq, gk))
    got = [oq.detach(), ok.detach(), ours[0].grad, ours[1].grad]
    ref = hf((q, k), cos, sin, (gq, gk))
    exact = hf([x.double() for x in (q, k)], cos.double(), sin.double(), [g.double() for g in (gq, gk)])
    eps, c, s = torch.finfo(dtype).eps, cos.double()[:, :, None], sin.double()[:, :, None]
    for name, a, b, x, t in zip(("q", "k", "dq", "dk"), got, ref, exact, (q, k, gq, gk)):
        torch.testing.assert_close(a, b, rtol=2 * eps, atol=4 * eps, msg=name)   # one rounding apart at most
        err, ref_err = (a.double() - x).abs(), (b.double() - x).abs()
        # two roundings of at most half an ulp each, of terms no larger than |x·cos| + |rotate_half(x·sin)|
        bound = eps * ((t.double() * c).abs() + rope.rotate_half(t.double() * s).abs())
        assert (err <= bound).all(), (name, (err - bound).max().item())
        assert err.mean() <= ref_err.mean(), (name, err.mean().item(), ref_err.mean().item())


def norm_vs_transformers(dtype):
    """transformers' Qwen2RMSNorm and ours, same weight, on the same x [3, 100, 64] and gradient: the outputs must
    be equal bit for bit; returns the two inputs (with their grads), ref and ours (with their weights' grads)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    import model.rmsnorm as rmsnorm

    torch.manual_seed(0)
    x, g = (torch.randn(3, 100, 64) * 3).to(dtype), torch.randn(3, 100, 64).to(dtype)
    ref, ours = Qwen2RMSNorm(64, eps=1e-6).to(dtype), rmsnorm.RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(64) + 0.5)
        ours.weight.copy_(ref.weight)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [m(xi) for m, xi in zip((ref, ours), xs)]
    assert torch.equal(ys[0], ys[1])
    for y in ys:
        y.backward(g)
    return xs, ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 64 * 7])
def test_rmsnorm_row_chunks_match_transformers(dtype, chunk, monkeypatch):
    import model.rmsnorm as rmsnorm

    if chunk:
        monkeypatch.setattr(rmsnorm, "NORM_CHUNK", chunk)   # 7 rows a chunk: 43 chunks, the last of 2 rows
    xs, ref, ours = norm_vs_transformers(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert rel(xs[1].grad.float(), xs[0].grad.float()) < tol
    assert rel(ours.weight.grad.float(), ref.weight.grad.float()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fused_path_matches_transformers(dtype, monkeypatch):
    """The CUDA path (aten's `_fused_rms_norm` forward and `_fused_rms_norm_backward`) wired as on CUDA, here on
    CPU: the forward is aten's real CPU kernel and must give transformers' Qwen2RMSNorm bit for bit; the backward
    has no CPU kernel in torch, so one is registered for this test from the float64 formula, which pins what our
    code hands it (the incoming gradient, the forward's rstd, the weight) against transformers' autograd.
    The CUDA kernels themselves: tests/gpu::test_cuda_fused_rmsnorm_matches_the_formula."""
    import model.rmsnorm as rmsnorm

    calls = []

    def backward(g, x, shape, rstd, weight, mask):   # aten's contract: dx of x·rstd·weight, and its weight's
        calls.append((g.dtype, tuple(rstd.shape), weight.shape, list(mask)))   # gradient where mask[1] asks for it
        xf, gf, r = x.double(), g.double() * weight.double(), rstd.double()
        dx = r * gf - r.pow(3) * xf * (gf * xf).mean(-1, keepdim=True)
        dw = (g.double() * xf * r).reshape(-1, xf.shape[-1]).sum(0) if mask[1] else torch.empty(0)
        return dx.to(x.dtype), dw.to(weight.dtype)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm_backward", backward, "CPU")
    try:
        monkeypatch.setattr(rmsnorm, "_fused", lambda x, w: w.dtype == x.dtype)
        xs, ref, ours = norm_vs_transformers(dtype)
    finally:
        lib._destroy()
    assert calls == [(dtype, (3, 100, 1), (64,), [True, True])], calls   # (the weight trains here: its gradient
    tol = 1e-5 if dtype == torch.float32 else 1e-2   # asked of the kernel, as --train-norms' on CUDA)
    assert rel(xs[1].grad.float(), xs[0].grad.float()) < tol
    assert rel(ours.weight.grad.float(), ref.weight.grad.float()) < tol   # the weight's: from the kernel
