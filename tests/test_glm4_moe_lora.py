"""LoRA on GLM-4.5 / 4.6's routed experts (`--lora-targets attn,experts` on glm4_moe: model/glm4_moe.py's Glm4MoE
with model/expert_lora.py's ExpertLoRA) is peft 0.21's `LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])` on transformers 5's Glm4MoeForCausalLM: the same function, gradients and adapter format.

Pins (CPU; tests/test_glm4_moe.py's tiny checkpoint: 3 blocks, block 0 dense, 8 experts in 4 groups, top 3, 2 shared
experts, an MTP layer's tensors in the checkpoint):
- the loss and every LoRA gradient (the experts' A and B too, B != 0) = peft's on transformers' model, plain and under
  AC + tiled MLP (float64); the trained tensors are peft's exactly: none on the dense block's MLP nor the shared
  experts (peft adapts neither);
- the adapter we export loads in peft with our logits (adapter_config.json naming the two target_parameters, 8
  expert tensors), the experts' share in them (zeroed, the logits differ); `python -m model.merge` of it = peft's
  merge_and_unload (transformers loads it); --init-adapter of it gives the exporting model's logits;
- the memory plan: activations with the experts' LoRA = autograd's saved bytes, the LoRA term = 16 bytes per trained
  element (nf4 and none);
- refused naming the fix: lora_dropout > 0, DoRA, --lora-layers, experts alone; MLP names name attn,experts;
- one process = cp 2 Ulysses (nf4) = cp 2 ring (2 gloo ranks, FSDP2): loss, grad norm, every LoRA gradient on every
  rank (tests/test_qwen3_moe.py's harness);
- train.py, 2 steps of --global-batch 4: --cp 2 --dp-shard 2 ring (4 gloo ranks) = 1 rank (every step's loss and grad
  norm, the adapter: test_train's tolerances; Ulysses on this model: the harness above); the adapter it writes loads
  in peft giving our logits.

Run: .venv/bin/python -m pytest -q tests/test_glm4_moe_lora.py
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
import transformers as T

import model
from tests.helpers import one_thread, train_argv
from tests.test_glm4_moe import ATTN, MTP, SIZES, _hf, _ids, rel, save_checkpoint
from tests.test_moe_lora import PARAMS, _ours, assert_grads_match_peft

EXPERTS = (*ATTN, "experts")
TRAIN = ["--steps", "2", "--global-batch", "4", "--lora-targets", "attn,experts"]
KEYS = 3 * 4 * 2 + 2 * 2 * 2   # the attention's A and B in 3 blocks, the experts' two pairs in the 2 MoE blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("glm"), SIZES)


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True)], ids=["plain", "ac_tiled_mlp"])
def test_lora_grads_match_peft_on_transformers(ckpt, mem):
    """Loss and every LoRA gradient = peft's ParamWrapper on Glm4MoeExperts' fused parameters holding our tensors
    (float64); the trained tensors are peft's: none on the dense block's MLP nor the shared experts."""
    names = assert_grads_match_peft(ckpt, *_ours(ckpt, **mem), KEYS, 1e-6)
    assert not [k for k in names if "shared_experts" in k or "layers.0.mlp" in k], "dense MLP / shared experts adapted"


def test_adapter_merge_and_init_adapter_as_peft(ckpt, tmp_path):
    """The exported adapter loads in peft with our logits and its merge = peft's merge_and_unload (tests/helpers.py,
    float32; the MTP layer's tensors copied, unread); its config and keys are peft's; without the experts' B the
    logits differ; --init-adapter of it gives the exporting model's logits (float64)."""
    from safetensors.torch import load_file

    from model.qlora import adapters_off
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import assert_adapter_and_merge_match_peft

    mtp = [f"model.layers.3.{k}" for k in MTP]
    _, adapter = assert_adapter_and_merge_match_peft(ckpt, T.Glm4MoeForCausalLM, tmp_path, _ids(19), EXPERTS, mtp)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert sorted(cfg["target_parameters"]) == sorted(PARAMS) and sorted(cfg["target_modules"]) == sorted(ATTN), cfg
    keys = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(keys) == KEYS and "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in keys, \
        sorted(keys)
    with warnings.catch_warnings(record=True) as caught:   # (peft's word on keys it did not place)
        warnings.simplefilter("always")
        from peft import PeftModel
        pm = PeftModel.from_pretrained(_hf(ckpt), adapter).to(torch.float64).eval()
    assert not [str(w.message) for w in caught if "key" in str(w.message).lower()]
    opts = BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3, dtype=torch.float64, ac=False,
                        lora_targets=EXPERTS, init_adapter=adapter)
    started, _ = build_model(opts, device="cpu")
    ids = _ids(23, 4)
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        assert rel(started(ids), want) < 1e-6, "--init-adapter"   # (float32 LoRA tensors in a float64 model)
        with adapters_off(started):   # (DPO's reference model: the base, the experts' LoRA off too)
            assert rel(started(ids), _hf(ckpt, torch.float64)(input_ids=ids).logits) < 1e-12, "adapters off"
        for n, p in started.named_parameters():
            if ".experts_lora." in n and "lora_B" in n:
                p.zero_()
        assert rel(started(ids), want) > 1e-3, "the experts' LoRA changes nothing"


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_planned_activations_and_lora_bytes_match_autograd(ckpt, quant):
    """No AC, fp32, one process: the plan's activation terms with the experts' LoRA (parallel/plan_moe.saved: each
    slot's gathered input, SwiGLU product and two [r] products on GLM's terms) = the bytes autograd keeps; its LoRA
    term = 16 bytes per trained element (parameter, gradient, AdamW's two), the experts' included."""
    import train
    from parallel.flags import check_model_flags
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpt, "--max-len", "128", "--global-batch", "1", "--quant",
                                            quant, "--dtype", "fp32", "--no-ac", "--lora-targets", "attn,experts"])
    check_model_flags(args, model.load.read_args(ckpt))
    ours, _ = build_model(BuildOptions(ckpt, quant=quant, ac=False, lora_targets=tuple(args.lora_targets.split(","))),
                          device="cpu")
    assert sum(".experts_lora." in n for n, _ in ours.named_parameters()) == 2 * 4
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)
    dims, pack = validate(args, ours.args, 1)
    lora = next(v for k, v in memory_plan(ours.args, dims, args, "cpu", pack).terms.items() if k.startswith("LoRA"))
    assert lora == 16 * sum(p.numel() for p in ours.parameters() if p.requires_grad), lora


def test_refusals_name_the_value_and_the_fix(ckpt):
    import train
    from parallel.flags import check_model_flags

    margs = model.ModelArgs.from_config_dict(json.load(open(os.path.join(ckpt, "config.json"))))
    parse = lambda flags: train.build_parser().parse_args(["--model", ckpt, *flags])

    def refused(flags):
        with pytest.raises(ValueError) as e:
            check_model_flags(parse(flags), margs)
        return str(e.value)

    for flags, want in ((["--lora-dropout", "0.1"], "--lora-dropout 0.1 .* pass --lora-dropout 0"),
                        (["--dora"], "--dora .* drop --dora"),
                        (["--lora-layers", "2"], "--lora-layers .* drop --lora-layers"),
                        (["--lora-targets", "experts"], "experts alone .* --lora-targets attn,experts")):
        flags = flags if "--lora-targets" in flags else ["--lora-targets", "attn,experts", *flags]
        assert re.search(want, refused(flags)), flags
    assert "or attn,experts for LoRA on the routed experts" in refused(["--lora-targets", "attn,mlp"])
    check_model_flags(parse(["--lora-targets", "attn,experts"]), margs)   # (accepted)


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpt):
    """LoRA on the attention and the experts, AC, FSDP2 over 2 ranks: loss, grad norm and every LoRA gradient (the
    experts' sharded A and B gathered) = one process, on every rank (tests/test_qwen3_moe.py's harness)."""
    from tests.dist import run_ranks
    from tests.test_qwen3_moe import _cp_equals_one_process

    cases = {"nf4, experts, cp 2 Ulysses": ("nf4", "ulysses", EXPERTS),
             "plain weights, experts, cp 2 ring": ("none", "ring", EXPERTS)}
    assert run_ranks(_cp_equals_one_process, 2, ckpt, cases, timeout=280) == [len(cases)] * 2


def _train_four(rank, world_size, assets, root):
    import train

    train.main(train_argv(assets, os.path.join(root, "ring"), *TRAIN, "--cp", "2", "--dp-shard", "2", "--cp-impl",
                          "ring"))
    return True


@pytest.mark.timeout(600)
def test_train_four_ranks_as_one_and_the_adapter_gives_our_logits_in_peft(tmp_path_factory):
    """train.py, 2 steps of --global-batch 4, LoRA on the attention and the experts: --cp 2 --dp-shard 2 ring on 4 gloo
    ranks (2 micro-batches a data rank) = 1 rank (every step's loss and grad norm, the adapter: test_train's
    tolerances); the 1-rank adapter (experts' B trained) loads in peft on transformers' model with no key warning and
    gives the logits of our model started from it (float64)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.dist import run_ranks
    from tests.test_glm4_moe_run import make_assets
    from tests.test_train import _compare

    d = tmp_path_factory.mktemp("glm_lora_run")
    assets, vocab = make_assets(d)
    with one_thread():
        train.main(train_argv(assets, str(d / "one"), *TRAIN))
    assert run_ranks(_train_four, 4, assets, str(d), timeout=500, pg_timeout=60) == [True] * 4
    _compare("cp 2 x dp_shard 2 ring", str(d / "ring"), str(d / "one"), steps=(1, 2))
    adapter = str(d / "one" / "adapter")
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(saved) == KEYS and any(v.any() for k, v in saved.items() if ".experts." in k and "lora_B" in k), \
        "the experts' B trained"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(_hf(assets["model"]), adapter).to(torch.float64).eval()
    assert not [str(w.message) for w in caught if "key" in str(w.message).lower()]
    ours, _ = build_model(BuildOptions(assets["model"], quant="none", lora_r=4, lora_alpha=32.0, dtype=torch.float64,
                                       ac=False, lora_targets=EXPERTS, init_adapter=adapter), device="cpu")
    ids = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel(ours(ids), pm(input_ids=ids).logits) < 1e-6, "the run's adapter in peft"
