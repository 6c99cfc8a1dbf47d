"""A run's lifecycle on the multimodal wrappers and Qwen3-MoE: resume, mid-run checkpoint export, --save-every and
--keep-best folders, --push-to-hub (the decoders themselves: test_gemma3_wrapper.py, test_qwen3_moe.py; their train.py
runs: test_gemma3_run.py, test_qwen3_moe_run.py).

Pins (CPU, 1 rank, 2 steps of --global-batch 4; a tiny Gemma3ForConditionalGeneration saved by transformers in shards,
its SigLIP tower in shards of its own, under a Hub cache path (models--org--gemma3/snapshots/<commit>), --train-norms;
a tiny Qwen3-MoE, --quant nf4 on the attention):
- stopped after step 1 (its --save-every 1 folder) and resumed, each run logs step 2 and ends with the adapter
  (and, the Gemma 3 run, OUT/adapter_best) of the uninterrupted run, bit for bit;
- `python -m parallel.checkpoint` of each --save-every folder: step 2's is OUT/adapter, file for file (tensors, the
  adapter_config.json with the wrapper's regex targets or MoE's attention targets, the card); every folder's, and
  OUT/adapter_best, loads in peft on transformers' model (Gemma3ForConditionalGeneration; Qwen3MoeForCausalLM) as
  written: peft's get_peft_model_state_dict is the file's tensors, no LoRA in the vision tower nor on an expert;
- --push-to-hub with the stand-in HfApi of test_hub.py: OUT/adapter_best's files, all four, whose card names the
  wrapper's Hub id as base_model and pipeline_tag image-text-to-text;
- the local fingerprint a resume compares (model.hub.model_fingerprint) covers the wrapper's whole checkpoint: a copy
  elsewhere is the same base, a changed tensor of the vision tower alone (in a shard without the language model's)
  another one.

Run: .venv/bin/python -m pytest -q tests/test_lifecycle_new_archs.py
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tests.helpers import one_thread, train_argv
from tests.test_gemma3 import CONFIG as GEMMA
from tests.test_gemma3_wrapper import VISION
from tests.test_qwen3_moe_run import CONFIG as MOE

SNAP = os.path.join("hub", "models--org--gemma3", "snapshots", "c0ffee" + "0" * 34)
GEMMA_FLAGS = ["--train-norms", "--keep-best", "--eval-split", "0.2", "--eval-every", "1"]
MOE_FLAGS = ["--quant", "nf4", "--lora-targets", "attn", "--train-norms"]
SHORT = ["--steps", "2", "--global-batch", "4"]   # every run: resumed after step 1


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """{name: OUT} of the uninterrupted runs (`gemma`, `moe`: --save-every 1) and their resumes from step 1 (`*_res`),
    with the bases and the stand-in Hub's state."""
    import huggingface_hub
    from huggingface_hub import constants

    import train
    from tests.fixtures import make_tokenizer
    from tests.test_hub import _Api

    d = tmp_path_factory.mktemp("lifecycle")
    bases = {"gemma": str(d / SNAP), "moe": str(d / "moe_base")}
    tok = make_tokenizer(bases["gemma"])
    cfg = T.Gemma3Config(text_config=dict(GEMMA, model_type="gemma3_text", vocab_size=len(tok), sliding_window=16,
                                          pad_token_id=tok.pad_token_id),
                         vision_config=VISION, mm_tokens_per_image=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    T.Gemma3ForConditionalGeneration(cfg).float().save_pretrained(bases["gemma"], max_shard_size="20KB")
    make_tokenizer(bases["moe"])
    torch.manual_seed(0)
    moe = T.AutoModelForCausalLM.from_config(T.Qwen3MoeConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                                              eos_token_id=tok.eos_token_id, **MOE)).float()
    with torch.no_grad():
        for n, p in moe.named_parameters():
            if n.endswith("mlp.gate.weight"):   # (std 0.02 routes by a hair)
                p.normal_(0, 0.5)
    moe.save_pretrained(bases["moe"])
    out = {k: str(d / k) for k in ("gemma", "gemma_res", "moe", "moe_res")}
    hub = {"calls": [], "fail": None}
    with one_thread(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Api, "state", hub)
        mp.setattr(huggingface_hub, "HfApi", _Api)
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setenv("HF_TOKEN", "hf_stand_in")
        for arch, flags in (("gemma", GEMMA_FLAGS), ("moe", MOE_FLAGS)):
            a = {**assets, "model": bases[arch]}
            train.main(train_argv(a, out[arch], *SHORT, *flags, "--save-every", "1", "--keep-ckpts", "3",
                                  *(["--push-to-hub", "org/lora"] if arch == "gemma" else [])))
            train.main(train_argv(a, out[arch + "_res"], *SHORT, *flags, "--resume",
                                  os.path.join(out[arch], "ckpt", "step_000001")))
    return {**out, "bases": bases, "hub": hub, "tmp": str(d)}


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "step" in r}


def _files(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["gemma", "moe"])
def test_resumed_after_step_1_is_the_uninterrupted_run_bit_for_bit(runs, arch):
    ref, res = _metrics(runs[arch]), _metrics(runs[arch + "_res"])
    assert sorted(res) == [2], sorted(res)
    for s in (2,):
        assert {k: res[s][k] for k in ("loss", "grad_norm", "tokens")} == \
            {k: ref[s][k] for k in ("loss", "grad_norm", "tokens")}, (arch, s, res[s], ref[s])
    for folder in ("adapter", "adapter_best") if arch == "gemma" else ("adapter",):
        a, b = (load_file(os.path.join(runs[k], folder, "adapter_model.safetensors")) for k in (arch, arch + "_res"))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), (arch, folder)


def _peft_state(arch, base, adapter):
    """peft's own state dict of the adapter loaded on transformers' model of `base`, and its LoRA module names."""
    from peft import PeftModel, get_peft_model_state_dict

    hf = T.Gemma3ForConditionalGeneration if arch == "gemma" else T.AutoModelForCausalLM
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(hf.from_pretrained(base), adapter)
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    # (save_embedding_layers: peft's "auto" looks the base id up on the Hub; no embedding is trained here)
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    return get_peft_model_state_dict(pm, save_embedding_layers=False), lora


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["gemma", "moe"])
def test_each_save_every_folder_exports_the_adapter_peft_loads(runs, arch):
    from parallel.checkpoint import main

    ckpt = os.path.join(runs[arch], "ckpt")
    folders = []
    for s in (1, 2):
        folders.append(os.path.join(runs["tmp"], f"{arch}_step{s}"))
        assert main([os.path.join(ckpt, f"step_00000{s}"), "--out", folders[-1]]) == 0, s
    end = _files(os.path.join(runs[arch], "adapter"))
    got = _files(folders[-1])
    assert sorted(got) == sorted(end) and all(got[f] == end[f] for f in end if f != "adapter_model.safetensors"), \
        sorted(got)
    a, b = (load_file(os.path.join(f, "adapter_model.safetensors")) for f in (folders[-1], os.path.join(runs[arch],
                                                                                                      "adapter")))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b), "step 2's export is not OUT/adapter"
    cfg = json.loads(end["adapter_config.json"])
    if arch == "gemma":
        assert cfg["target_modules"].startswith("model\\.language_model\\.layers\\."), cfg["target_modules"]
        folders.append(os.path.join(runs[arch], "adapter_best"))
    else:
        assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"], cfg["target_modules"]
    for folder in folders:
        want = load_file(os.path.join(folder, "adapter_model.safetensors"))
        got, lora = _peft_state(arch, runs["bases"][arch], folder)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), folder
        assert lora and all(".self_attn." in n or ".mlp." in n for n in lora), lora
        assert not [n for n in lora if "vision" in n or ".experts." in n], lora


@pytest.mark.timeout(300)
def test_push_to_hub_of_a_wrapper_run_names_the_wrapper(runs):
    calls = [c[0] for c in runs["hub"]["calls"]]
    assert calls == ["create_repo", "upload_folder"], calls
    best = os.path.join(runs["gemma"], "adapter_best")
    assert runs["hub"]["calls"][-1][2]["folder_path"] == best
    repo = runs["hub"]["repo"]
    assert sorted(repo) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "trained_on.json"], \
        sorted(repo)
    assert repo == _files(best), "the uploaded bytes are not OUT/adapter_best's"
    head = repo["README.md"].decode().split("---")[1].splitlines()
    assert 'base_model: "org/gemma3"' in head and "pipeline_tag: image-text-to-text" in head, head
    cfg = json.loads(repo["adapter_config.json"])
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == ("org/gemma3", os.path.basename(SNAP)), cfg


@pytest.mark.timeout(300)
def test_model_fingerprint_covers_the_vision_tower_shard(runs, tmp_path):
    from model.hub import model_fingerprint, same_model

    src = runs["bases"]["gemma"]
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    lm = {f for k, f in wmap.items() if "language_model" in k}
    vision = sorted({f for k, f in wmap.items() if "vision_tower" in k} - lm)
    assert vision, "no shard holds the vision tower alone: the test would not isolate it"
    copy = str(tmp_path / "copy")
    shutil.copytree(src, copy)
    assert same_model(copy, model_fingerprint(src)), "a copy elsewhere is the same base"
    t = load_file(os.path.join(copy, vision[0]))
    k = sorted(t)[0]
    t[k] = t[k] + 1
    save_file(t, os.path.join(copy, vision[0]), metadata={"format": "pt"})
    assert not same_model(copy, model_fingerprint(src)), f"a changed {k} (vision tower) is the same base"
