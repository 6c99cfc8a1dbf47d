"""Multimodal wrapper checkpoints (Mistral 3, `Mistral3ForConditionalGeneration`), the write side: the adapters we
export load in peft on the wrapper, --init-adapter reads peft's own, the merge writes a whole wrapper checkpoint
(model/wrapper.py's to_peft / to_ours / peft_targets; the read side: tests/test_wrapper.py).

Pins (a tiny random Mistral 3 made by transformers itself, Pixtral vision tower of 1 layer, float32; LoRA r 4 alpha 8,
B non-zero, trained norms and embedding moved off the base's):
- `export_adapter` on a wrapper base: `peft.PeftModel.from_pretrained(Mistral3ForConditionalGeneration, adapter)`
  loads it with no missing or unexpected key, its keys are what peft saves on the wrapper, no LoRA module lands in
  the vision tower or projector, and its text logits equal ours: plain LoRA, DoRA, --train-norms with --lora-layers,
  --train-embeddings tied and untied; `python -m parallel.checkpoint`'s export writes the same adapter; the card's
  (README.md's) load lines, run as written, give peft's model on the wrapper, and its pipeline_tag is the
  transformers pipeline whose model class they load it with (image-text-to-text);
- --init-adapter: ours and one peft made on the wrapper itself (a language-model-only regex, random B) rebuild
  peft's logits in our model; a text-only model's adapter starts a wrapper run and the reverse (the same language
  model: mapped); one adapting the vision tower is refused naming it; peft's with exclude_modules in the wrapper's
  names (regex, names) is started from, and with the text-only model's names (not what peft excluded) refused;
- `python -m model.merge` into a wrapper: transformers loads the output as Mistral3ForConditionalGeneration, its text
  logits equal peft's merge_and_unload of the same adapter on the base (quant none; nf4: the base's block weights
  NF4 round-tripped), vision tower and projector tensors bit-equal to the base's, the processor files copied, a
  --rope-scaling adapter's RoPE in text_config; a bitsandbytes 4-bit wrapper is refused before writing.

Run: .venv/bin/python -m pytest -q tests/test_wrapper_write.py
"""

import json
import os
import warnings

import pytest
import torch
import transformers as T

from tests.test_wrapper import _wrapper

R, ALPHA = 4, 8.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("wrapper_write")
    out = {tie: _wrapper(d / tie, 64, tie == "tied") for tie in ("tied", "untied")}
    for path in out.values():   # the processor's files, which the merge copies beside the weights
        for fn in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
            with open(os.path.join(path, fn), "w") as f:
                f.write(json.dumps({"made_for": fn}) if fn.endswith(".json") else "{{ messages }}")
    return out


def _ours(path, dora=False, norms=False, emb=False, layers=None):
    """Our model of the wrapper's language model, LoRA B ~ N(0, 0.05), trained norms and embedding × (1 + 0.1·N)."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    model, peft_model = build_nonzero_b(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, lora_targets=ALL,
                                                     dora=dora, train_norms=norms, train_embeddings=emb,
                                                     lora_layers=layers, seed=3))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and (n.endswith("norm.weight") or "embed_tokens" in n):
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model, peft_model


def _ids():
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
    ids[0, 3] = 5   # the image token, in text input: an ordinary token to both
    return ids


def _peft_loaded(base, adapter):
    """peft's model of `adapter` on transformers' wrapper, failing on a missing or unexpected key."""
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(T.Mistral3ForConditionalGeneration.from_pretrained(base), adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    if not pm.peft_config["default"].ensure_weight_tying:   # (a second adapter's tying finds the first's wrapper)
        again = pm.load_adapter(adapter, adapter_name="again")   # the load result peft only warns about
        assert not again.missing_keys and not again.unexpected_keys, again
        pm.delete_adapter("again")
        pm.set_adapter("default")
    return pm


CASES = {"lora": dict(), "dora": dict(dora=True), "norms_layers": dict(norms=True, layers=(1,)),
         "emb_untied": dict(emb=True, norms=True), "emb_tied": dict(emb=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_adapter_loads_in_peft_on_the_wrapper_with_our_logits(bases, case, tmp_path):
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    from model.export import export_adapter

    kw = CASES[case]
    base = bases["tied" if case == "emb_tied" else "untied"]
    model, peft_model = _ours(base, **kw)
    export_adapter(peft_model, str(tmp_path / "a"), base)
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
    pm = _peft_loaded(base, str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5, msg=f"{case}: peft's logits")
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert lora and all(".language_model.layers." in n for n in lora), f"{case}: LoRA on {lora}"
    assert len(lora) == 7 * (1 if kw.get("layers") else 2), (case, lora)
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    want = set(get_peft_model_state_dict(pm, adapter_name="default"))
    assert keys == want, f"{case}: extra {sorted(keys - want)[:4]}, missing {sorted(want - keys)[:4]}"
    saved = [n for n, m in pm.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    assert all(".language_model." in n or n.endswith("lm_head") for n in saved), f"{case}: saved {saved}"
    if kw.get("emb"):
        assert any(n.endswith("embed_tokens") for n in saved), saved
    if case == "emb_tied":   # peft's head is the trained embedding, as ours
        assert pm.base_model.model.lm_head.weight is pm.base_model.model.model.language_model.embed_tokens.weight


def test_adapter_cards_load_lines_give_peft_model_on_the_wrapper(bases, tmp_path):
    """README.md's lines that load the adapter, run as written (the folder for THIS_FOLDER_OR_REPO), give peft's
    model on the wrapper, its logits (review, helper 124: they were AutoPeftModelForCausalLM's, whose
    AutoModelForCausalLM has no Mistral 3: a ValueError); its pipeline_tag, as huggingface_hub reads it, is the
    transformers pipeline whose model class the lines load the base with, which maps the base's config (review,
    helper 125: it was text-generation, whose AutoModelForCausalLM cannot load a Mistral 3)."""
    from huggingface_hub import ModelCard
    from transformers.pipelines import SUPPORTED_TASKS

    from model.export import export_adapter

    base, out = bases["untied"], str(tmp_path / "a")
    model, peft_model = _ours(base)
    export_adapter(peft_model, out, base)
    with open(os.path.join(out, "README.md")) as f:
        code = "\n".join(line[4:] for line in f.read().splitlines() if line.startswith("    "))
    scope = {}
    exec(code.replace("THIS_FOLDER_OR_REPO", out), scope)
    with torch.no_grad():
        torch.testing.assert_close(scope["model"].eval()(input_ids=_ids()).logits, model(_ids()), rtol=1e-5, atol=1e-5)
    tag = ModelCard.load(os.path.join(out, "README.md")).data.pipeline_tag
    auto = SUPPORTED_TASKS[tag]["pt"][0]
    assert auto.__name__ in code and type(scope["base"].config) in auto._model_mapping, (tag, auto)


def test_checkpoint_export_of_a_wrapper_run_is_the_runs_adapter(assets, tmp_path):
    """`python -m parallel.checkpoint` writes a wrapper run's adapter as train.py's end does (the wrapper's names,
    meta.json's "wrapper"), which peft loads on the wrapper; also for a checkpoint from before meta.json named it."""
    from safetensors.torch import load_file

    import train
    from parallel.checkpoint_export import export
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv

    tok = make_tokenizer(tmp_path / "base")
    base = _wrapper(tmp_path / "base", len(tok), False)
    out = str(tmp_path / "run")
    with one_thread():
        train.main(train_argv({**assets, "model": base}, out, "--train-norms", "--lora-layers", "1",
                              "--save-every", "3"))
    ckpt = os.path.join(out, "ckpt")
    with open(os.path.join(ckpt, "step_000003", "meta.json")) as f:
        meta = json.load(f)
    assert meta["wrapper"] == "mistral3", meta.get("wrapper")
    export(ckpt, str(tmp_path / "exported"))
    del meta["wrapper"]   # a checkpoint from before the key: the base's config.json says it
    with open(os.path.join(ckpt, "step_000003", "meta.json"), "w") as f:
        json.dump(meta, f)
    export(ckpt, str(tmp_path / "exported_old"))
    want = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        want_cfg = json.load(f)
    assert want_cfg["target_modules"].startswith("model\\.language_model\\.layers\\.(1)\\."), want_cfg
    for d in ("exported", "exported_old"):
        got = load_file(str(tmp_path / d / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), d
        with open(tmp_path / d / "adapter_config.json") as f:
            cfg = json.load(f)
        assert {k: cfg[k] for k in ("target_modules", "modules_to_save", "layers_to_transform")} == \
            {k: want_cfg[k] for k in ("target_modules", "modules_to_save", "layers_to_transform")}, d
    _peft_loaded(base, str(tmp_path / "exported"))


def _built(path, adapter, **kw):
    """Our model of `path` started from --init-adapter `adapter` (its config checked as a run checks it)."""
    from model.adapter_fit import init_adapter_fits
    from model.adapter_read import check_init_adapter
    from model.load import read_args
    from parallel.parallelize import BuildOptions, build_model

    m = read_args(path)
    check_init_adapter(adapter, R, ALPHA, ALL, **kw)
    init_adapter_fits(adapter, m.projections(), R, m.n_layers, None, m.tie_embeddings)
    model, _ = build_model(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, lora_targets=ALL, seed=5,
                                        init_adapter=adapter, **kw))
    return model


def _peft_made(model, target_modules, out, **kw):
    """peft's own adapter on transformers' `model` (random B: init_lora_weights False), saved to `out`."""
    import peft

    pm = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=target_modules,
                                                    init_lora_weights=False, **kw)).eval()
    torch.manual_seed(8)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "modules_to_save" in n:
                p.mul_(1 + 0.1 * torch.randn(p.shape))
    pm.save_pretrained(out)
    return pm


def test_init_adapter_reads_ours_and_peft_own_on_the_wrapper_and_maps_text_only_ones(bases, tmp_path):
    """--init-adapter on a wrapper base: our export (tied, trained embedding) and peft's own adapter made on the wrapper
    (a language-model-only regex, a trained final norm by its full name) give peft's logits in our model; a text-only
    model's adapter starts a wrapper run and a wrapper's adapter a text-only run, with peft's logits on each."""
    from model.export import export_adapter
    from tests.test_wrapper import _text_only

    ids = _ids()
    model, peft_model = _ours(bases["tied"], emb=True, norms=True)
    export_adapter(peft_model, str(tmp_path / "ours"), bases["tied"])
    with torch.no_grad():
        want = _peft_loaded(bases["tied"], str(tmp_path / "ours"))(input_ids=ids).logits
        got = _built(bases["tied"], str(tmp_path / "ours"), train_norms=True, train_embeddings=True)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="ours")

    base = bases["untied"]
    regex = r"model\.language_model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj|down_proj)"
    pm = _peft_made(T.Mistral3ForConditionalGeneration.from_pretrained(base), regex, str(tmp_path / "peft"),
                    modules_to_save=["model.language_model.norm"])
    assert not [n for n, _ in pm.named_modules() if "vision_tower" in n and n.endswith("lora_A")]
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        got = _built(base, str(tmp_path / "peft"), train_norms=True)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="peft's on the wrapper")

    text = _text_only(base, tmp_path / "text")   # the same language model, saved alone by transformers
    with torch.no_grad():
        got = _built(text, str(tmp_path / "peft"), train_norms=True)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="a wrapper's adapter on the text-only model")
    pm = _peft_made(T.MistralForCausalLM.from_pretrained(text), ["q_proj", "gate_proj"], str(tmp_path / "text_lora"))
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        got = _built(base, str(tmp_path / "text_lora"))(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="a text-only model's adapter on the wrapper")


def test_init_adapter_adapting_the_vision_tower_is_refused_naming_it(bases, tmp_path):
    """peft's adapter on the wrapper with a plain name list adapts the vision tower's q_proj too: refused before the
    model is built, naming the key and the fix (a regex of the language model's modules)."""
    from model.adapter_fit import init_adapter_fits
    from model.load import read_args

    base = bases["untied"]
    _peft_made(T.Mistral3ForConditionalGeneration.from_pretrained(base), ["q_proj"], str(tmp_path / "all"))
    m = read_args(base)
    with pytest.raises(ValueError) as e:
        init_adapter_fits(str(tmp_path / "all"), m.projections(), R, m.n_layers, None, m.tie_embeddings)
    assert "vision_tower.transformer.layers.0.attention.q_proj" in str(e.value) and "regex" in str(e.value), e.value


@pytest.mark.parametrize("exclude", ["regex", "names"])
def test_init_adapter_with_exclude_modules_made_on_the_wrapper(bases, tmp_path, exclude):
    """peft's adapter on the wrapper with a name list of targets and exclude_modules (the vision tower's, and block
    1's q_proj) in the wrapper's names: started from, peft's logits (it was refused: its exclude_modules were matched
    against our text-only names, so block 1's q_proj seemed cut); the same exclude_modules naming the text-only
    model's module, which peft on the wrapper would not have excluded, is a cut adapter: refused (review, helper
    124)."""
    from model.adapter_fit import init_adapter_fits
    from model.load import read_args

    base, out = bases["untied"], str(tmp_path / "peft")
    ex = {"regex": r"model\.vision_tower\..*|model\.language_model\.layers\.1\.self_attn\.q_proj",
          "names": [f"model.vision_tower.transformer.layers.0.attention.{p}" for p in ("q_proj", "v_proj")]
          + ["model.language_model.layers.1.self_attn.q_proj"]}[exclude]
    pm = _peft_made(T.Mistral3ForConditionalGeneration.from_pretrained(base), ["q_proj", "v_proj"], out,
                    exclude_modules=ex)
    assert sorted(n for n, _ in pm.named_modules() if n.endswith("lora_A")) == [
        f"base_model.model.model.language_model.layers.{i}.self_attn.{p}.lora_A" for i, p in
        ((0, "q_proj"), (0, "v_proj"), (1, "v_proj"))]
    with torch.no_grad():
        torch.testing.assert_close(_built(base, out)(_ids()), pm(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    text_only = lambda e: e.replace("language_model\\.", "").replace("language_model.", "")
    cfg["exclude_modules"] = text_only(ex) if exclude == "regex" else [text_only(e) for e in ex]
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    m = read_args(base)
    with pytest.raises(ValueError, match=r"holds no tensors for 1 of those projections \(layer 1 q_proj\)"):
        init_adapter_fits(out, m.projections(), R, m.n_layers, None, m.tie_embeddings)


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("case,quant", [("lora", "none"), ("dora", "none"), ("emb_tied", "none"),
                                        ("norms_layers", "nf4")])
def test_merge_into_a_wrapper_is_the_wrapper_peft_merges(bases, case, quant, tmp_path):
    """`python -m model.merge` into a Mistral 3 base: transformers loads the output as Mistral3ForConditionalGeneration
    (no missing or unexpected key), its logits are peft's merge_and_unload of the adapter on the base (nf4: on the
    base whose language model's block Linears hold `nf4_round_trip(W)`, the weights trained against), the vision tower
    and projector are the base's bit for bit, under the stored keys; the processor files travel with it."""
    from model import merge
    from model.export import export_adapter
    from model.nf4 import nf4_round_trip

    base = bases["tied" if case == "emb_tied" else "untied"]
    _, peft_model = _ours(base, **CASES[case])
    export_adapter(peft_model, str(tmp_path / "a"), base, quant=quant)
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a"))
    if quant == "nf4":
        with torch.no_grad():
            for n, m in ref.named_modules():
                if type(m) is torch.nn.Linear and ".language_model.layers." in n and ".lora_" not in n:
                    m.weight.copy_(nf4_round_trip(m.weight))
    ref = ref.merge_and_unload()
    got, info = T.Mistral3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5,
                                   msg=f"{case}: merged logits")
    stored, merged = _tensors(base), _tensors(out)
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    other = [k for k in stored if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert other and all(torch.equal(merged[k], stored[k]) for k in other), case
    for fn in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
        with open(os.path.join(out, fn)) as f, open(os.path.join(base, fn)) as g:
            assert f.read() == g.read(), fn
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "mistral3" and cfg["architectures"] == ["Mistral3ForConditionalGeneration"], cfg


def test_merge_into_a_wrapper_writes_the_adapters_rope_into_text_config(bases, tmp_path):
    """A --rope-scaling adapter's RoPE (base_config_overrides.json) goes into the merged wrapper's text_config, which
    is what its language model runs with: our reading of the merged config.json and transformers' agree on it."""
    from model import merge
    from model.export import OVERRIDES, export_adapter
    from model.load import read_args

    base = bases["untied"]
    _, peft_model = _ours(base)
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    export_adapter(peft_model, str(tmp_path / "a"), base, rope_parameters=rope, quant="none")
    assert os.path.isfile(tmp_path / "a" / OVERRIDES)
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    text = T.Mistral3Config.from_pretrained(out).text_config
    assert (text.rope_parameters["rope_type"], text.rope_parameters["factor"]) == ("linear", 4.0), text
    assert read_args(out).rope_parameters() == rope, read_args(out).rope_parameters()


def test_merge_into_a_4bit_wrapper_is_refused_before_writing(bases, tmp_path, capsys):
    """A bitsandbytes 4-bit Mistral 3 (quantization_config on its config.json): its vision tower is stored packed,
    which a float merge cannot copy: refused naming it and the fix, no --out made."""
    import shutil

    from model import merge
    from tests.test_wrapper import _edit_config

    q = str(shutil.copytree(bases["untied"], tmp_path / "q"))
    _edit_config(q, lambda c: c.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}))
    _, peft_model = _ours(bases["untied"])
    from model.export import export_adapter
    export_adapter(peft_model, str(tmp_path / "a"), bases["untied"], quant="none")
    code = merge.main(["--model", q, "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and "stored 4-bit" in err and "unquantized checkpoint" in err, err
    assert not os.path.exists(tmp_path / "m")
