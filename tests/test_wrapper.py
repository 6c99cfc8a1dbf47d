"""Multimodal wrapper checkpoints (Mistral 3, `Mistral3ForConditionalGeneration`) train their language model: the
read side (model/wrapper.py, model/config.py, model/load.py).

Pins (a tiny random Mistral 3 made and saved by transformers itself: Pixtral vision tower of 1 layer, float32):
- our `from_pretrained` logits equal transformers' `Mistral3ForConditionalGeneration(input_ids=...)` on text input
  (1e-5) for the keys save_pretrained writes (`language_model.model.*`), tied (outer tie_word_embeddings true, the
  text_config's false: transformers obeys the outer one) and untied, sharded (index.json), the transformers-5 module
  names (`model.language_model.*`, `lm_head.*`, renamed in a copy), an outer tie_word_embeddings left out with the
  head stored (transformers' default, true, and a stored head unties it) and not
  stored (tied), and the outer key false under a text_config true; the tensors indexed are the text-only
  MistralForCausalLM's names, no vision tower's or projector's;
- a train.py run on the wrapper has the per-step losses of the same run on its language model saved alone by
  transformers' MistralForCausalLM (the same weights), and `--plan` plans it as that text-only model; both say
  "mistral (the language model of a mistral3 checkpoint)" where the text-only model's say "mistral";
  `python -m data.demo_compare` on a --quant nf4 run of each gives the same base and peft logits and answers;
  on a --rope-scaling run of each, its base and peft logits are transformers' with the adapter's RoPE overrides;
- a bitsandbytes 4-bit wrapper (quantized and saved by transformers + bitsandbytes): every language-model weight
  read is bitsandbytes' dequantization of transformers' loaded Linear4bit, bit for bit;
- refusals naming the fix: another multimodal model_type (paligemma, llava, qwen2_vl), a classifier (architectures not
  the generation class, or a text-only *ForSequenceClassification), a mistral3 without text_config, a wrapper whose
  language-model keys are missing (the error names them and the prefixes looked for).
(The write side, adapters and the merge: tests/test_wrapper_write.py.)

Run: .venv/bin/python -m pytest -q tests/test_wrapper.py
"""

import contextlib
import io
import json
import os
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
VISION = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=32, patch_size=8, head_dim=8)
RENAME5 = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
           ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def _wrapper(path, vocab, tie, seed=0, **save):
    cfg = T.Mistral3Config(text_config=dict(TEXT, vocab_size=vocab), vision_config=VISION, image_token_index=5,
                           tie_word_embeddings=tie)
    torch.manual_seed(seed)
    T.Mistral3ForConditionalGeneration(cfg).float().save_pretrained(path, **save)
    return str(path)


def _edit_config(path, edit):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _renamed(src, dst, renames):
    """A copy of the single-file checkpoint `src` whose keys are renamed by prefix."""
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v for k, v in sd.items()}
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("wrapper")
    out = {"tied": _wrapper(d / "tied", 64, True), "untied": _wrapper(d / "untied", 64, False),
           "sharded": _wrapper(d / "sharded", 64, False, max_shard_size="20KB")}
    out["module_names"] = _renamed(out["untied"], d / "module_names", RENAME5)
    out["module_names_tied"] = _renamed(out["tied"], d / "module_names_tied", RENAME5)
    out["no_outer_tie"] = str(shutil.copytree(out["untied"], d / "no_outer_tie"))
    _edit_config(out["no_outer_tie"], lambda c: c.pop("tie_word_embeddings"))
    out["no_outer_tie_tied"] = str(shutil.copytree(out["tied"], d / "no_outer_tie_tied"))
    _edit_config(out["no_outer_tie_tied"], lambda c: c.pop("tie_word_embeddings"))
    out["outer_false_text_true"] = str(shutil.copytree(out["untied"], d / "outer_false_text_true"))
    _edit_config(out["outer_false_text_true"], lambda c: c["text_config"].update(tie_word_embeddings=True))
    return out


@pytest.mark.parametrize("case", ["tied", "untied", "sharded", "module_names", "module_names_tied", "no_outer_tie",
                                  "no_outer_tie_tied", "outer_false_text_true"])
def test_logits_equal_transformers_mistral3(ckpts, case):
    from model.load import CheckpointReader, from_pretrained, read_args

    path = ckpts[case]
    ref = T.Mistral3ForConditionalGeneration.from_pretrained(path).eval()
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    ids[0, 3] = 5   # the image token, in text input: no image, so an ordinary token to both
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = from_pretrained(path)(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{case}: logits")
    args = read_args(path)
    hf_tied = ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    assert (args.wrapper, args.tie_embeddings) == ("mistral3", hf_tied), f"{case}: {args}"
    # the tensors indexed: the text-only model's names (transformers'), nothing of the vision tower or projector
    text_only = set(T.MistralForCausalLM(ref.config.text_config).state_dict())
    reader = CheckpointReader(path)
    assert set(reader.where) == text_only - ({"lm_head.weight"} if hf_tied else set()), f"{case}: indexed"
    reader.close()


def _text_only(wrapper_path, dst):
    """The wrapper's language model saved alone by transformers' MistralForCausalLM, the same weights."""
    ref = T.Mistral3ForConditionalGeneration.from_pretrained(wrapper_path)
    cfg = ref.config.text_config
    cfg.tie_word_embeddings = ref.config.tie_word_embeddings
    lm = T.MistralForCausalLM(cfg).float()
    lm.model.load_state_dict(ref.model.language_model.state_dict())
    lm.lm_head.load_state_dict(ref.lm_head.state_dict())
    lm.save_pretrained(dst)
    return str(dst)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_train_run_on_wrapper_equals_text_only_model_and_plans_alike(assets, tmp_path, tie, capsys):
    """A run on the wrapper has the text-only model's losses and plan; its `model:` start-up line and `--plan`'s first
    line name the wrapper beside its language model's type (review, helper 125: they said "mistral", as the text-only
    model's do)."""
    import train
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv

    tok = make_tokenizer(tmp_path / "wrapper")
    wrapper = _wrapper(tmp_path / "wrapper", len(tok), tie)
    text = _text_only(wrapper, tmp_path / "text")
    make_tokenizer(tmp_path / "text")
    losses, said = {}, {"wrapper": "mistral (the language model of a mistral3 checkpoint) ", "text": "mistral 0."}
    for name, path in (("wrapper", wrapper), ("text", text)):
        out = str(tmp_path / f"run_{name}")
        with one_thread():
            train.main(train_argv({**assets, "model": path}, out))
        assert f"\nmodel: {said[name]}" in capsys.readouterr().out, name
        with open(os.path.join(out, "metrics.jsonl")) as f:
            losses[name] = [m["loss"] for m in map(json.loads, f) if "loss" in m]
    assert len(losses["text"]) == 3 and losses["wrapper"] == losses["text"], losses
    plans = {}
    for name, path in (("wrapper", wrapper), ("text", text)):
        with contextlib.redirect_stdout(printed := io.StringIO()):
            plans[name] = train.main(["--plan", "--model", path, "--data", assets["data"], "--max-len", "64",
                                      "--global-batch", "8", "--quant", "none", "--dtype", "fp32"])
        assert f"plan: {said[name]}" in printed.getvalue(), (name, printed.getvalue())
    assert plans["wrapper"] == plans["text"], plans


def test_demo_compare_on_wrapper_run_equals_text_only_run(assets, tmp_path, monkeypatch):
    """`python -m data.demo_compare` on a --quant nf4 run on the wrapper: transformers' wrapper class is loaded (not
    AutoModelForCausalLM, which maps no Mistral 3), its language model's block weights NF4 round-tripped as training's,
    and the base's and peft's logits on each prompt, and the answers, are the same run's on the text-only model
    (review, helper 124: it failed to load; the round trip matched only text-only names, and was skipped)."""
    import data.demo_compare as dc
    import train
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv

    tok = make_tokenizer(tmp_path / "wrapper")
    wrapper = _wrapper(tmp_path / "wrapper", len(tok), False)
    text = _text_only(wrapper, tmp_path / "text")
    make_tokenizer(tmp_path / "text")
    seen, plain = [], dc.generate

    def spy(model, tok, prompt, *a):   # (a: max_new_tokens, stop, day, tools)
        with torch.no_grad():
            seen[-1].append(model(**dc.encode(tok, prompt, a[2], a[3])).logits)
        return plain(model, tok, prompt, *a)

    monkeypatch.setattr(dc, "generate", spy)
    rows = {}
    for name, path in (("wrapper", wrapper), ("text", text)):
        out = str(tmp_path / f"run_{name}")
        with one_thread():
            train.main(train_argv({**assets, "model": path}, out, "--quant", "nf4", "--eval-split", "0.1"))
        seen.append([])
        rows[name] = dc.compare(out, n=2, max_new_tokens=4)
    assert rows["wrapper"] == rows["text"] and len(rows["text"]) == 2, rows
    assert len(seen[0]) == len(seen[1]) == 4, "a base and a tuned forward per prompt"
    for got, want in zip(*seen):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_demo_compare_runs_the_rope_a_run_trained_with(assets, tmp_path, monkeypatch, capsys):
    """`python -m data.demo_compare` on a `--rope-scaling linear:4` run, on the text-only model and on its Mistral 3
    wrapper: the base's and the tuned model's logits on each prompt are transformers' text-only model loaded with the
    adapter's base_config_overrides.json (`from_pretrained(DIR, rope_parameters=...)`), without and with peft's
    adapter, which differ from config.json's RoPE's; the header line says which RoPE ran (review, helper 125: the
    overrides were never read: both columns ran config.json's RoPE, so the "tuned" answers were not the trained
    model's)."""
    from peft import PeftModel

    import data.demo_compare as dc
    import train
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv

    tok = make_tokenizer(tmp_path / "wrapper")
    wrapper = _wrapper(tmp_path / "wrapper", len(tok), False)
    text = _text_only(wrapper, tmp_path / "text")
    make_tokenizer(tmp_path / "text")
    seen, plain = [], dc.generate

    def spy(model, tok, prompt, *a):   # (a: max_new_tokens, stop, day, tools)
        with torch.no_grad():
            ids = dc.encode(tok, prompt, a[2], a[3])["input_ids"]
            seen[-1].append((ids, model(input_ids=ids).logits))
        return plain(model, tok, prompt, *a)

    monkeypatch.setattr(dc, "generate", spy)
    for name, path in (("text", text), ("wrapper", wrapper)):
        out = str(tmp_path / f"run_{name}")
        with one_thread():
            train.main(train_argv({**assets, "model": path}, out, "--rope-scaling", "linear:4", "--eval-split", "0.1"))
        seen.append([])
        assert dc.main([out, "--n", "2", "--max-new-tokens", "2"]) == 0
        assert "both with the RoPE the run trained with, {'rope_theta'" in capsys.readouterr().out
    with open(tmp_path / "run_text" / "adapter" / "base_config_overrides.json") as f:
        over = json.load(f)
    assert over["rope_parameters"]["rope_type"] == "linear", over
    ref = T.AutoModelForCausalLM.from_pretrained(text, **over).eval()
    plain_rope = T.AutoModelForCausalLM.from_pretrained(text).eval()
    with torch.no_grad():
        base = [ref(input_ids=ids).logits for ids, _ in seen[0][:2]]
        unscaled = [plain_rope(input_ids=ids).logits for ids, _ in seen[0][:2]]
        tuned = PeftModel.from_pretrained(ref, str(tmp_path / "run_text" / "adapter")).eval()
        want = base + [tuned(input_ids=ids).logits for ids, _ in seen[0][2:]]
    assert all((u - b).abs().max() > 1e-3 for u, b in zip(unscaled, base)), "the RoPE makes no visible difference"
    for name, got in zip(("text", "wrapper"), seen):
        assert len(got) == 4, f"{name}: a base and a tuned forward per prompt"
        for i, ((_, g), w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, at=f"{name} forward {i}": f"{at}: {m}")


def _cfg(**kw):
    return {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
            "text_config": dict(TEXT, vocab_size=64), "vision_config": VISION, **kw}


@pytest.mark.parametrize("cfg, said", [
    ({"model_type": "paligemma", "architectures": ["PaliGemmaForConditionalGeneration"], "text_config": {}},
     "model_type 'paligemma' is a multimodal model"),
    ({"model_type": "llava", "text_config": {"model_type": "llama"}, "vision_config": {}},
     "model_type 'llava' is a multimodal model"),
    ({"model_type": "qwen2_vl", "vision_config": {}, "hidden_size": 32},
     "only the language model of gemma3, gemma4, mistral3"),
    (_cfg(architectures=["Mistral3ForSequenceClassification"]), "is not a causal language model"),
    (dict(TEXT, vocab_size=64, architectures=["MistralForSequenceClassification"]), "is not a causal language model"),
    (_cfg(text_config=None), "model_type 'mistral3' without a text_config"),
    (_cfg(text_config=dict(TEXT, model_type="falcon", vocab_size=64)),
     "model_type='falcon' (the text_config of a mistral3)"),
], ids=["paligemma", "llava", "qwen2_vl", "wrapper_classifier", "text_classifier", "no_text_config",
        "other_text_model"])
def test_refusals_name_what_is_supported(cfg, said):
    from model.config import ModelArgs

    with pytest.raises(ValueError) as e:
        ModelArgs.from_config_dict(cfg)
    assert said in str(e.value), str(e.value)


def test_wrapper_without_language_model_keys_names_them_and_the_prefixes(ckpts, tmp_path):
    from model.load import from_pretrained, read_args
    from model.load_checks import check_config_shapes

    bad = _renamed(ckpts["untied"], tmp_path / "bad", (("language_model.model.", "text_model.model."),))
    for check in (lambda: from_pretrained(bad), lambda: check_config_shapes(bad, read_args(bad))):
        with pytest.raises(ValueError) as e:
            check()
        msg = str(e.value)
        assert "model.embed_tokens.weight" in msg and "language_model.model.*" in msg \
            and "model.language_model.*" in msg, msg


def test_bnb_4bit_wrapper_reads_the_weights_transformers_loads(tmp_path):
    """A Mistral 3 quantized by transformers + bitsandbytes (nf4, double quantization; quantization_config on the outer
    config.json, the vision tower quantized too) and saved sharded: every language-model weight we read is bitsandbytes'
    `dequantize_4bit` of transformers' loaded Linear4bit, bit for bit (compared before any forward: bitsandbytes' CPU
    forward repacks the codes in place); the vision tower's packed weights are not indexed."""
    import bitsandbytes.functional as F

    from model.load import CheckpointReader, read_args

    text = dict(TEXT, vocab_size=64, hidden_size=64, intermediate_size=128, head_dim=16)   # rows of whole 64-blocks
    cfg = T.Mistral3Config(text_config=text, vision_config=dict(VISION, hidden_size=64, intermediate_size=128),
                           image_token_index=5, tie_word_embeddings=False)
    torch.manual_seed(0)
    T.Mistral3ForConditionalGeneration(cfg).float().save_pretrained(tmp_path / "src")
    q = T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    T.Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "src", device_map="cpu", dtype=torch.float32,
                                                       quantization_config=q).save_pretrained(tmp_path / "q",
                                                                                              max_shard_size="60KB")
    path = str(tmp_path / "q")
    assert read_args(path).wrapper == "mistral3"
    hf = dict(T.Mistral3ForConditionalGeneration.from_pretrained(path, device_map="cpu", dtype=torch.float32
                                                                 ).named_modules())
    reader = CheckpointReader(path)
    blocks = [f"model.layers.{i}.{b}.{p}.weight" for i in range(2) for b, ps in
              (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
              for p in ps]
    assert sorted(reader.packed) == sorted(blocks), sorted(reader.packed)
    for n in blocks:
        w = hf[n.removesuffix(".weight").replace("model.", "model.language_model.", 1)].weight
        assert torch.equal(reader.get(n), F.dequantize_4bit(w.data, w.quant_state).float()), n
    reader.close()



def test_ministral3_in_a_mistral3_wrapper_equals_transformers(tmp_path):
    """Ministral 3 ships as a Mistral 3 wrapper whose text_config is `ministral3` (YaRN and Llama 4's attention
    temperature): past the temperature's original length (8 here, rows of 40) our logits equal transformers' wrapper's;
    the temperature is read from the text_config's RoPE."""
    from model.load import from_pretrained, read_args

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3,
            "max_position_embeddings": 4096}
    text = dict(TEXT, model_type="ministral3", vocab_size=64, max_position_embeddings=4096, rope_parameters=rope)
    cfg = T.Mistral3Config(text_config=text, vision_config=VISION, image_token_index=5, tie_word_embeddings=False)
    torch.manual_seed(0)
    T.Mistral3ForConditionalGeneration(cfg).float().save_pretrained(tmp_path)
    ref = T.Mistral3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert type(ref.model.language_model).__name__ == "Ministral3Model", type(ref.model.language_model)
    args = read_args(str(tmp_path))
    assert (args.wrapper, args.model_type, args.attn_temperature_beta) == ("mistral3", "ministral3", 0.3), args
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = from_pretrained(str(tmp_path))(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
