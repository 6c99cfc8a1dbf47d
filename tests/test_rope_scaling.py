"""`--rope-scaling`: RoPE scaling in place of config.json's, as transformers computes it, recorded for inference.

Pins:
- YaRN's inverse frequencies and factor equal transformers' bit for bit (factors 3, 5.5, 16, 40; truncate, mscale,
  betas; head_dim 16 and 128);
- a checkpoint without scaling, loaded with `yarn:4`, `linear:2` or a llama3 JSON object, gives the logits of
  transformers' model loaded with the same `rope_parameters` (within 1e-5, positions far from 0, where the
  scaling moves the logits by more than 1e-4); `none` on a YaRN checkpoint gives transformers' plain RoPE;
- bad values are refused before anything is read, naming the value and the accepted forms; `context` and the
  warning for rows past it (naming the scaling in use when config.json scales); `yarn:F@N` sets the original
  length; resume compares the scaling meant (`yarn:4` = `yarn:4.0` = its JSON), and a checkpoint from before the
  flag counts as config.json's own;
- `train.py --rope-scaling yarn:4` on a plain checkpoint trains exactly as the same weights whose config.json
  carries that YaRN (losses and adapter equal); its adapter folder holds `base_config_overrides.json`, with which
  transformers + peft give the logits of peft on the YaRN config; `model.merge` writes that RoPE into the merged
  config.json (classic form), whose transformers logits equal them; `parallel.checkpoint_export.export` of its
  checkpoint writes the same overrides file; a resume with another value is refused.

Run: .venv/bin/python -m pytest -q tests/test_rope_scaling.py
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers as T

import model
from tests.helpers import one_thread, startup_error, train_argv
from tests.test_model import COMMON, rel, save_checkpoint

THETA = 1e6
CASES = {   # flag -> transformers' rope_parameters for the same RoPE
    "yarn:4": {"rope_type": "yarn", "factor": 4.0},
    "linear:2": {"rope_type": "linear", "factor": 2.0},
    '{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, '
    '"original_max_position_embeddings": 256}': {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    # without its original length: config.json's max_position_embeddings, as transformers reads the same JSON (until
    # 2026-12-04 the flag refused what config.json accepts)
    '{"rope_type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 32}':
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0},
}


def _logits(m, pos):
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(input_ids=ids, position_ids=pos)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("flag", list(CASES))
def test_flag_gives_transformers_logits_for_the_same_rope(flag, tmp_path):
    torch.set_num_threads(1)
    plain = save_checkpoint(T.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": THETA}),
                            tmp_path)
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={**CASES[flag], "rope_theta": THETA}).eval()
    ours = model.from_pretrained(str(tmp_path), rope_scaling=flag).eval()
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [3000]])
    want = _logits(ref, pos)
    assert rel(_logits(ours, pos), want) < 1e-5, f"{flag}: {rel(_logits(ours, pos), want):.2e}"
    assert rel(_logits(plain, pos), want) > 1e-4, f"{flag}: the scaling does not move these logits"


@pytest.mark.parametrize("extra", [{}, {"truncate": False}, {"mscale": 0.707, "mscale_all_dim": 1.0},
                                   {"beta_fast": 8.0, "beta_slow": 2.0}],
                         ids=["plain", "no_truncate", "mscale", "betas"])
@pytest.mark.parametrize("factor", [3.0, 5.5, 16.0, 40.0])
def test_yarn_frequencies_equal_transformers_bit_for_bit(factor, extra):
    """YaRN's inverse frequencies and cos/sin factor equal transformers' own (its Qwen2 rotary embedding) exactly,
    head_dim 16 and 128, with its optional keys. Until 2026-12-06 the interpolated ones were freq / factor, where
    transformers takes 1 / (factor · base^(i/d)): an ulp apart for a factor that is not a power of two."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from model.rope import inv_freq

    rope = {"rope_type": "yarn", "rope_theta": THETA, "factor": factor, "original_max_position_embeddings": 16384,
            **extra}
    for hd in (16, 128):
        cfg = {**COMMON, "model_type": "qwen2", "hidden_size": 4 * hd}   # (4 heads of hd)
        ref = Qwen2RotaryEmbedding(T.Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"},
                                                 rope_parameters=dict(rope)))
        freq, scale = inv_freq(model.ModelArgs.from_config_dict({**cfg, "rope_parameters": dict(rope)}))
        assert torch.equal(freq, ref.inv_freq) and scale == ref.attention_scaling, (hd, factor, extra)


def test_a_llama3_flag_without_its_original_length_keeps_the_models():
    """On a config.json that scales with llama3 already (Llama 3.1: original 8,192 under 131,072 positions), the same
    llama3 numbers as a flag without `original_max_position_embeddings` give the model's own frequencies: the
    original length comes from config.json's scaling, not from max_position_embeddings (which moved 20 of 64
    frequencies of Llama 3.1's and made its context 8× longer, unsaid)."""
    from model.rope import inv_freq

    cfg = {**COMMON, "model_type": "llama", "head_dim": 128, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, "rope_theta": 500000.0}
    own = model.ModelArgs.from_config_dict(cfg)
    flagged = own.with_rope_scaling('{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, '
                                    '"high_freq_factor": 4}')
    assert torch.equal(inv_freq(flagged)[0], inv_freq(own)[0]) and flagged.context == own.context == 131072
    plain = model.ModelArgs.from_config_dict({k: v for k, v in cfg.items() if k != "rope_scaling"})
    assert plain.with_rope_scaling('{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, '
                                   '"high_freq_factor": 4}').rope_scaling["original_max_position_embeddings"] == 131072


def test_a_yarn_flag_without_its_original_length_keeps_the_models():
    """On a config.json that scales with YaRN already (factor 4 over an original 32,768, max_position_embeddings
    131,072), `yarn:4` is the model's own RoPE and `yarn:8` doubles its factor over the same original length, as the
    start-up warning advises ("the same type with a larger factor"): it took 131,072 for the original length, a
    context of 1M, unsaid (review, helper 84). `yarn:8@N` still sets N; a plain config.json's is its
    max_position_embeddings."""
    from model.rope import inv_freq

    cfg = {**COMMON, "model_type": "qwen2", "max_position_embeddings": 131072, "rope_theta": THETA,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    own = model.ModelArgs.from_config_dict(cfg)
    same = own.with_rope_scaling("yarn:4")
    assert torch.equal(inv_freq(same)[0], inv_freq(own)[0]) and inv_freq(same)[1] == inv_freq(own)[1]
    assert same.context == own.context == 131072
    more = own.with_rope_scaling("yarn:8")
    assert more.rope_scaling["original_max_position_embeddings"] == 32768 and more.context == 262144
    assert own.with_rope_scaling("yarn:8@65536").context == 524288
    plain = model.ModelArgs.from_config_dict({k: v for k, v in cfg.items() if k != "rope_scaling"})
    assert plain.with_rope_scaling("yarn:4").rope_scaling["original_max_position_embeddings"] == 131072


def test_none_drops_the_configs_scaling(tmp_path):
    torch.set_num_threads(1)
    save_checkpoint(T.Qwen2Config(**COMMON, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": THETA}),
                    tmp_path)
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": THETA}).eval()
    pos = torch.arange(37).expand(2, 37) + 2000
    ours, yarn = (model.from_pretrained(str(tmp_path), rope_scaling=f).eval() for f in ("none", None))
    assert rel(_logits(ours, pos), _logits(ref, pos)) < 1e-5
    assert rel(_logits(yarn, pos), _logits(ref, pos)) > 1e-3


@pytest.mark.parametrize("bad,phrase", [("yarn", "pass none, linear:F, yarn:F"), ("yarn:0.5", "factor must be"),
                                        ("yarn:nan", "factor must be"), ("ntk:2", "TYPE:F takes linear or yarn"),
                                        ("{oops", "not valid JSON"), ('{"rope_type": "longrope", "factor": 2}',
                                                                      "'longrope' is not one of"),
                                        ('{"rope_type": "llama3", "factor": 8}', "needs 'low_freq_factor'"),
                                        ("linear:1e308", "from 1 to 1024"), ("linear:2@4096", "@N (the original"),
                                        ('{"rope_type": "yarn", "factor": 4, "beta_fast": "32"}', "beta_fast must be"),
                                        ('{"rope_type": "yarn", "factor": true}', "factor must be"),
                                        ('{"rope_type": "yarn", "factor": 4, "fcator": 2}', "unknown key 'fcator'")])
def test_bad_values_are_refused_before_anything(assets, tmp_path, bad, phrase):
    msg = startup_error(train_argv(assets, str(tmp_path / "out"), "--rope-scaling", bad))
    assert f"--rope-scaling {bad}" in msg and phrase in msg, msg
    assert not os.path.exists(tmp_path / "out")


def test_context_and_the_warning_past_it():
    a = model.ModelArgs(max_position_embeddings=32768)
    assert a.context == 32768 and a.beyond_context(32768) is None
    msg = a.beyond_context(131072)
    assert "--max-len 131072 reaches past the 32,768 positions" in msg and "--rope-scaling yarn:4" in msg, msg
    y = a.with_rope_scaling("yarn:4")
    assert y.context == 131072 and y.beyond_context(131072) is None and y.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    llama31 = model.ModelArgs(max_position_embeddings=131072, rope_scaling=dict(CASES[list(CASES)[2]]))
    assert llama31.context == 131072
    assert "RoPE is scaled (llama3, factor 8.0); --rope-scaling replaces that" in llama31.beyond_context(262144)
    q3 = model.ModelArgs(max_position_embeddings=40960).with_rope_scaling("yarn:4@32768")
    assert q3.rope_scaling["original_max_position_embeddings"] == 32768 and q3.context == 131072


def test_resume_compares_the_scaling_meant():
    from parallel.resume import check_resume

    for same in ("yarn:4.0", '{"type": "yarn", "factor": 4}'):
        check_resume({"rope_scaling": "yarn:4"}, {"rope_scaling": same})
    for old, new in (({"rope_scaling": "yarn:4"}, {"rope_scaling": None}), ({}, {"rope_scaling": "yarn:4"})):
        with pytest.raises(ValueError, match="--rope-scaling: the checkpoint has"):
            check_resume(old, new)
    check_resume({}, {"rope_scaling": None})


@pytest.mark.timeout(300)
def test_training_with_the_flag_equals_the_scaled_config_and_inference_gets_it(assets, tmp_path):
    from peft import PeftModel

    import train
    from model.merged import merge

    yarn = str(tmp_path / "yarn_model")   # the same weights, YaRN in config.json (the classic hub form)
    shutil.copytree(assets["model"], yarn)
    cfg = json.load(open(os.path.join(yarn, "config.json")))
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    json.dump(cfg, open(os.path.join(yarn, "config.json"), "w"))
    flag, conf = str(tmp_path / "flag"), str(tmp_path / "conf")
    with one_thread():
        train.main(train_argv(assets, flag, "--rope-scaling", "yarn:4"))
        train.main(train_argv({**assets, "model": yarn}, conf))
    losses = [[json.loads(line)["loss"] for line in open(os.path.join(d, "metrics.jsonl"))] for d in (flag, conf)]
    assert losses[0] == losses[1], losses
    from safetensors.torch import load_file
    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (flag, conf))
    assert all(torch.equal(a[k], b[k]) for k in b)
    over = json.load(open(os.path.join(flag, "adapter", "base_config_overrides.json")))
    assert over == {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 4096}}, over
    assert not os.path.exists(os.path.join(conf, "adapter", "base_config_overrides.json"))
    from parallel import checkpoint_folders
    from parallel.checkpoint_export import export  # the adapter of its checkpoint carries the same RoPE
    export(os.path.join(flag, "ckpt"), str(tmp_path / "exported"))
    assert json.load(open(tmp_path / "exported" / "base_config_overrides.json")) == over
    moved = tmp_path / "moved" / "step_000002"   # the run's base moved since: --model names where it is now
    shutil.copytree(checkpoint_folders.resolve(os.path.join(flag, "ckpt")), moved)
    meta = json.load(open(moved / "meta.json"))
    meta["args"]["model"] = str(tmp_path / "gone")
    json.dump(meta, open(moved / "meta.json", "w"))
    with pytest.raises(ValueError, match=r"is gone, and its --rope-scaling .* pass --model DIR"):
        export(str(moved), str(tmp_path / "e2"))
    with pytest.raises(ValueError, match=r"is not the base this run trained on"):   # (another config.json)
        export(str(moved), str(tmp_path / "e2"), model=yarn)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--out '.*afile' is a file: pass a new directory"):
        export(str(moved), str(tmp_path / "afile"), model=assets["model"])
    export(str(moved), str(tmp_path / "e2"), model=assets["model"])
    assert json.load(open(tmp_path / "e2" / "base_config_overrides.json")) == over
    assert json.load(open(tmp_path / "e2" / "adapter_config.json"))["base_model_name_or_path"] == \
        os.path.abspath(assets["model"])

    pos = torch.arange(37).expand(2, 37) + torch.tensor([[100], [3000]])
    ids = torch.randint(0, 40, (2, 37), generator=torch.Generator().manual_seed(3))
    run = lambda m: m(input_ids=ids, position_ids=pos).logits.detach()   # noqa: E731
    want = run(PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(yarn), os.path.join(conf, "adapter")))
    base = T.AutoModelForCausalLM.from_pretrained(assets["model"], **over)
    got = run(PeftModel.from_pretrained(base, os.path.join(flag, "adapter")))
    assert rel(got, want) < 1e-5, rel(got, want)
    unscaled = run(PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(assets["model"]),
                                             os.path.join(flag, "adapter")))
    assert rel(unscaled, want) > 1e-4, "the overrides change nothing here: the test shows nothing"
    merged = str(tmp_path / "merged")
    merge(assets["model"], os.path.join(flag, "adapter"), merged, quant="none", dtype=torch.float32)
    mcfg = json.load(open(os.path.join(merged, "config.json")))
    assert mcfg["rope_parameters"]["rope_type"] == "yarn", mcfg
    assert rel(run(T.AutoModelForCausalLM.from_pretrained(merged)), want) < 1e-5
    both = str(tmp_path / "both")   # a base config with rope_parameters AND a top-level rope_scaling, which would win
    shutil.copytree(assets["model"], both)
    cfg = json.load(open(os.path.join(both, "config.json")))
    json.dump({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, open(os.path.join(both, "config.json"),
                                                                                   "w"))
    merge(both, os.path.join(flag, "adapter"), str(tmp_path / "merged2"), quant="none", dtype=torch.float32)
    assert rel(run(T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged2"))), want) < 1e-5

    msg = startup_error(train_argv(assets, flag, "--rope-scaling", "yarn:2", "--resume", os.path.join(flag, "ckpt")))
    assert "--rope-scaling: the checkpoint has 'yarn:4', this run 'yarn:2'" in msg, msg
