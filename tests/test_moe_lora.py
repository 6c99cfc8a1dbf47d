"""LoRA on the routed experts (`--lora-targets ...,experts`, model/expert_lora.py) is peft 0.21's
`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])` on transformers 5's
Qwen3MoeForCausalLM, GptOssForCausalLM and Qwen3_5MoeForCausalLM: the same function, gradients and adapter format.

Pins (CPU; the tiny checkpoints of tests/test_qwen3_moe.py, 4 experts, top 2, 3 blocks of which block 1 is dense;
tests/test_gpt_oss.py's, 6 experts with biases and the clamped SwiGLU, interleaved gate_up; tests/test_qwen3_5_moe.py's
text model, 3 linear-attention blocks and a full one, a shared expert, and its multimodal form for the export):
- the adapter we export (LoRA B != 0 on the attention and the experts) loads in peft on transformers' model with no
  key warning, its adapter_config.json naming the two target_parameters, and gives our logits (float64); with the
  experts' LoRA zeroed the logits differ (the experts' share is in the comparison); adapters_off and an empty
  reference_adapter (DPO's reference models) give transformers' base logits;
- the loss and every LoRA gradient (the experts' A and B too) = peft's on transformers' model, plain and under AC +
  tiled MLP (float64);
- the init is the same per parameter name on every build (deterministic), A ~ U(±1/sqrt(in)), B = 0;
- refused at start-up naming the value and the fix: lora_dropout > 0, DoRA, --lora-layers, experts alone, a model
  with no experts or Gemma 4's MoE; MLP names on the three name `experts` as the fix;
  --init-adapter reads an adapter of the experts where the run targets them (else refused), and DPO's reference
  adapter of it computes its function (Qwen3-MoE, GPT-OSS, Qwen3.5-MoE's multimodal form: its regex target_modules);
- `python -m model.merge` folds it as peft's merge_and_unload does (transformers loads the merge: its logits);
- one process = cp 2 Ulysses = cp 2 ring (2 gloo ranks, FSDP2): loss, grad norm, every LoRA gradient on every rank
  (tests/test_qwen3_moe.py's harness; GPT-OSS: ring, nf4);
- the memory plan: activations with the experts' LoRA = autograd's saved bytes, the LoRA term = 16 bytes per trained
  element (Qwen3-MoE nf4 and none, GPT-OSS, Qwen3.5-MoE);
- train.py, 2 steps of --global-batch 4: --cp 2 --dp-shard 2 (4 gloo ranks) = 1 rank = 1 rank resumed after step 1
  (every step's loss and grad norm and the adapter: test_train's tolerances), and the adapter it writes loads in peft;
  `python -m parallel.checkpoint`'s export of its checkpoint (with --model: the shape check) writes the same adapter.

Run: .venv/bin/python -m pytest -q tests/test_moe_lora.py
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import transformers as T

import model
from tests.helpers import one_thread, train_argv
from tests.test_gpt_oss import clamp_as_configured  # noqa: F401 - autouse: the reference clamp as configured
from tests.test_qwen3_moe import ATTN, CONFIGS, _hf, rel, save_checkpoint

EXPERTS = (*ATTN, "experts")
TRAIN = ["--steps", "2", "--global-batch", "4", "--quant", "nf4", "--lora-targets", "attn,experts"]
PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# adapter tensors: the attention's four in every full-attention block, the experts' in the MoE blocks (the Qwen3-MoE
# model's block 1 is dense; the Qwen3.5-MoE model's 3 linear-attention blocks have no q/k/v/o)
KEYS = {"renorm": 3 * 4 * 2 + 2 * 2 * 2, "gpt_oss": 2 * 4 * 2 + 2 * 2 * 2, "q35": 1 * 4 * 2 + 4 * 2 * 2,
        "q35_wrapper": 1 * 4 * 2 + 4 * 2 * 2}
# logits' relative difference in float64: GPT-OSS's bases are 2e-7 apart there with no LoRA at all, Qwen3.5-MoE's
# 7e-8 (something float32 in one of the two: the delta rule's reference, RoPE tables); a wrong expert LoRA: ~1e-2
TOL = {"renorm": 1e-9, "gpt_oss": 1e-6, "q35": 1e-6, "q35_wrapper": 1e-6}
GTOL = {"renorm": 1e-6, "gpt_oss": 1e-6, "q35": 3e-5}   # each LoRA gradient's: Qwen3.5-MoE's are 2e-6 to 8e-6 apart,
# the attention's as the experts' (the float32 loss and delta rule; a wrong one is ~1e-1 off)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.test_gpt_oss import _save
    from tests.test_qwen3_5_moe import SIZES, VISION, _perturb

    torch.manual_seed(0)
    q35 = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**SIZES)).float()
    _perturb(q35)
    q35.save_pretrained(path := tmp_path_factory.mktemp("q35"))
    torch.manual_seed(1)   # (the multimodal form, as the Hub ships Qwen3.5-MoE: its language model's names)
    wrapper = T.Qwen3_5MoeForConditionalGeneration(T.Qwen3_5MoeConfig(text_config=dict(
        SIZES, model_type="qwen3_5_moe_text"), vision_config=VISION, tie_word_embeddings=False)).float()
    _perturb(wrapper)
    wrapper.save_pretrained(wrapped := tmp_path_factory.mktemp("q35_wrapper"))
    return {"renorm": save_checkpoint(tmp_path_factory.mktemp("renorm"), CONFIGS["renorm"]),
            "gpt_oss": _save(tmp_path_factory.mktemp("gpt_oss")), "q35": str(path), "q35_wrapper": str(wrapped)}


def _hf_of(path):
    """transformers' model of a checkpoint (the wrapper's class for the multimodal one)."""
    if "q35_wrapper" not in path:
        return _hf(path)
    return T.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                experts_implementation="eager").eval()


def _ours(path, b_std=0.2, dtype=torch.float64, **mem):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    mem = dict(ac=False) | mem
    ours, peft_model = build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8, seed=3, dtype=dtype,
                                                    lora_targets=EXPERTS, **mem), b_std=b_std)
    for p in ours.parameters():   # (LoRA is float32 by default: float64 throughout where the model is)
        p.data = p.data.to(dtype)
    return ours, peft_model


def _peft(path, dtype=torch.float64):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_hf(path).to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTN),
                                                          target_parameters=PARAMS, init_lora_weights=False))


def _peft_names(ours: dict) -> dict:
    """Our trained tensors under peft's parameter names on transformers' model (the adapter keys, .default. added)."""
    from model.export import peft_keys

    return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
            for k, v in peft_keys({n.removeprefix("base_model.model."): t for n, t in ours.items()}).items()}


@pytest.mark.parametrize("name", ["renorm", "gpt_oss", "q35", "q35_wrapper"])
def test_exported_adapter_loads_in_peft_with_our_logits(ckpts, tmp_path, name):
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file

    from model.export import export_adapter
    from model.qlora import adapters_off, reference_adapter

    ours, peft_model = _ours(ckpts[name])
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[name], quant="none")
    with open(tmp_path / "a" / "adapter_config.json") as f:
        cfg = json.load(f)
    mods = cfg["target_modules"]   # (the wrapper's: a regex over its language model's names, model/wrapper.py)
    assert sorted(cfg["target_parameters"]) == sorted(PARAMS) and (
        sorted(mods) == sorted(ATTN) if isinstance(mods, list) else "language_model" in mods), cfg
    keys = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert f"base_model.model.model.{'language_model.' * ('wrapper' in name)}layers.0.mlp.experts.base_layer.lora_A" \
        ".weight" in keys, sorted(keys)
    assert len(keys) == KEYS[name], sorted(keys)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(_hf_of(ckpts[name]), str(tmp_path / "a")).to(torch.float64).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(ids)
        assert rel(pm(input_ids=ids).logits, want) < TOL[name], "logits"
        with adapters_off(ours):   # (DPO's reference model: the base, the experts' LoRA off too)
            base = _hf_of(ckpts[name]).to(torch.float64)(input_ids=ids).logits
            assert rel(ours(ids), base) < TOL[name], "adapters off"
        with reference_adapter(ours, {}):   # (an --init-adapter holding no LoRA at all: the base again)
            assert rel(ours(ids), base) < TOL[name], "reference adapter"
        for n, p in ours.named_parameters():
            if ".experts_lora." in n and "lora_B" in n:
                p.zero_()
        assert rel(ours(ids), want) > 1e-3, "the experts' LoRA changes nothing"


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True)], ids=["plain", "ac_tiled_mlp"])
@pytest.mark.parametrize("name", ["renorm", "gpt_oss", "q35"])
def test_lora_grads_match_peft_on_transformers(ckpts, mem, name):
    """Loss and every LoRA gradient = peft's ParamWrapper on transformers' fused experts holding our tensors."""
    assert_grads_match_peft(ckpts[name], *_ours(ckpts[name], **mem), KEYS[name], GTOL[name])


def assert_grads_match_peft(path, ours, peft_model, keys: int, gtol: float) -> list:
    """Our loss and every LoRA gradient (`keys` tensors, each within `gtol`) = peft's on transformers' model of `path`
    holding our tensors (float64); returns the gradients' adapter names."""
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    s, n = ours(ids, labels=labels)
    (s / n).backward()
    trained = {k: p for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = _peft(path)
    state = _peft_names({k: p.detach() for k, p in trained.items()})
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    logits = hf.train()(input_ids=ids).logits.flatten(0, 1)   # [B·S, V]
    ref = torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum", ignore_index=-100)
    (ref / n).backward()
    # (loss.py sums the loss in float32, its gradient too: float32 round-off (~1e-7) on a float64 model)
    torch.testing.assert_close(s.detach().double(), ref.detach(), rtol=1e-6, atol=1e-6, msg="loss")
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    mine = _peft_names({k: p.grad for k, p in trained.items()})
    assert theirs.keys() == mine.keys() and len(mine) == keys, sorted(set(mine) ^ set(theirs))
    for k in mine:
        assert theirs[k].norm() > 0, f"grad {k} is zero"
        assert rel(mine[k], theirs[k]) < gtol, f"grad {k}: relative difference {rel(mine[k], theirs[k]):.2e}"
    return list(mine)


def test_init_is_deterministic_and_peft_shaped(ckpts):
    """A ~ U(±1/sqrt(in)) and B = 0 (peft's LoRA init on its [E·r, in] and [out, E·r] Linears), drawn per name: two
    builds hold the same tensors."""
    a, _ = _ours(ckpts["renorm"], b_std=0.0, dtype=torch.float32)
    b, _ = _ours(ckpts["renorm"], b_std=0.0, dtype=torch.float32)
    got = {n: p for n, p in a.named_parameters() if ".experts_lora." in n}
    assert len(got) == 2 * 2 * 2
    other = dict(b.named_parameters())
    for n, p in got.items():
        assert p.dtype == torch.float32 and p.requires_grad, n
        assert torch.equal(p, other[n]), f"{n}: another build drew another init"
        if "lora_A" in n:
            assert 0 < p.abs().max() <= 1 / p.shape[1] ** 0.5, n
        else:
            assert not p.any(), f"{n}: B starts at zero"
    moe = a.model.layers[0].mlp.experts_lora
    gu, dn = moe.gate_up_proj, moe.down_proj
    assert tuple(gu.lora_A.weight.shape) == (4 * 4, 48) and tuple(gu.lora_B.weight.shape) == (64, 16)
    assert tuple(dn.lora_A.weight.shape) == (4 * 4, 32) and tuple(dn.lora_B.weight.shape) == (48, 16)


def _gemma4_moe(tmp_path) -> str:
    """A config.json folder of a tiny Gemma 4 MoE (the flag checks read no weight)."""
    from tests.test_gemma4_moe import CONFIG

    cfg = {**T.Gemma4TextConfig(**CONFIG).to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def test_refusals_name_the_value_and_the_fix(ckpts, tmp_path):
    import train
    from parallel.flags import check_model_flags

    def refused(path, flags):
        margs = model.ModelArgs.from_config_dict(json.load(open(os.path.join(path, "config.json"))))
        args = train.build_parser().parse_args(["--model", path, *flags])
        with pytest.raises(ValueError) as e:
            check_model_flags(args, margs)
        return str(e.value)

    path = ckpts["renorm"]
    for flags, want in ((["--lora-dropout", "0.1"], "--lora-dropout 0.1 .* pass --lora-dropout 0"),
                        (["--dora"], "--dora .* drop --dora"),
                        (["--lora-layers", "2"], "--lora-layers .* drop --lora-layers"),
                        (["--lora-targets", "experts"], "experts alone .* --lora-targets attn,experts")):
        flags = flags if "--lora-targets" in flags else ["--lora-targets", "attn,experts", *flags]
        assert __import__("re").search(want, refused(path, flags)), flags
    for p in (path, ckpts["gpt_oss"], ckpts["q35"]):
        assert "or attn,experts for LoRA on the routed experts" in refused(p, ["--lora-targets", "attn,mlp"]), p
        check_model_flags(train.build_parser().parse_args(["--model", p, "--lora-targets", "attn,experts"]),
                          model.ModelArgs.from_config_dict(json.load(open(os.path.join(p, "config.json")))))
    said = refused(_gemma4_moe(tmp_path), ["--lora-targets", "attn,experts"])
    assert "supported on Qwen3-MoE, Qwen3.5-MoE, GLM-4.5 / 4.6 and GPT-OSS, not yet on this gemma4_text" in said \
        and "drop experts from --lora-targets" in said, said
    dense = str(tmp_path / "dense")
    from tests.helpers import tiny_checkpoint
    tiny_checkpoint(dense)
    assert "has no MoE experts" in refused(dense, ["--lora-targets", "attn,experts"])


@pytest.mark.parametrize("name", ["renorm", "gpt_oss", "q35_wrapper"])
def test_init_adapter_and_dpo_reference_read_an_experts_adapter(ckpts, tmp_path, name):
    """--init-adapter of an adapter with the experts' LoRA: accepted with experts among this run's --lora-targets
    (refused without, naming the fix); the build starting from it gives the exporting model's logits; DPO's
    reference_adapter of it on a model with B = 0 gives them too (float64)."""
    from model.adapter_read import check_init_adapter, read_init_adapter
    from model.export import export_adapter
    from model.qlora import reference_adapter
    from parallel.parallelize import BuildOptions, build_model

    trained, peft_model = _ours(ckpts[name])
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[name], quant="none")
    with pytest.raises(ValueError, match="target_parameters .*pass --lora-targets with experts"):
        check_init_adapter(str(tmp_path / "a"), 4, 8, ATTN)
    check_init_adapter(str(tmp_path / "a"), 4, 8, EXPERTS)
    opts = BuildOptions(ckpts[name], quant="none", lora_r=4, lora_alpha=8, seed=3, dtype=torch.float64, ac=False,
                        lora_targets=EXPERTS)
    started, _ = build_model(replace(opts, init_adapter=str(tmp_path / "a")), device="cpu")
    fresh, _ = build_model(opts, device="cpu")   # (B = 0: the base)
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = trained(ids)
        assert rel(started(ids), want) < 1e-6, "--init-adapter"   # (float32 LoRA tensors in a float64 model)
        assert rel(fresh(ids), want) > 1e-3, "the adapter changes nothing"
        with reference_adapter(fresh, read_init_adapter(str(tmp_path / "a"))):
            assert rel(fresh(ids), want) < 1e-6, "DPO's reference adapter"


@pytest.mark.parametrize("name", ["renorm", "gpt_oss", "q35"])
def test_merge_is_what_peft_merges(ckpts, tmp_path, name):
    """`python -m model.merge` of an adapter with the experts' LoRA (quant none, float32): transformers loads the merge
    with no missing or unexpected key and gives peft's merge_and_unload logits (float64), the experts' weights
    changed (GPT-OSS's written fused back, gate and up interleaved)."""
    import warnings

    from peft import PeftModel

    from model import merge
    from model.export import export_adapter

    _, peft_model = _ours(ckpts[name], dtype=torch.float32)
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[name], quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", ckpts[name], "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = PeftModel.from_pretrained(_hf(ckpts[name]), str(tmp_path / "a")).merge_and_unload().to(torch.float64)
        merged, info = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True,
                                                              experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys")), info
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref.eval()(input_ids=ids).logits
        assert rel(merged.to(torch.float64).eval()(input_ids=ids).logits, want) < 1e-6, "merged logits"
        assert rel(_hf(ckpts[name]).to(torch.float64)(input_ids=ids).logits, want) > 1e-3, "the merge changed nothing"
    experts = [k for k, _ in merged.named_parameters() if ".experts." in k]
    base = dict(_hf(ckpts[name]).named_parameters())
    assert experts and all(not torch.equal(dict(merged.named_parameters())[k], base[k]) for k in experts
                           if "bias" not in k), experts


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    """LoRA on the attention and the experts, AC, FSDP2 over 2 ranks: loss, grad norm and every LoRA gradient (the
    experts' sharded A and B gathered) = one process, on every rank (tests/test_qwen3_moe.py's harness)."""
    from tests.dist import run_ranks
    from tests.test_qwen3_moe import _cp_equals_one_process

    cases = {"nf4, experts, cp 2 Ulysses": ("nf4", "ulysses", EXPERTS),
             "plain weights, experts, cp 2 ring": ("none", "ring", EXPERTS)}
    assert run_ranks(_cp_equals_one_process, 2, ckpts["renorm"], cases, timeout=280) == [len(cases)] * 2
    cases = {"GPT-OSS, nf4, experts, cp 2 ring": ("nf4", "ring", EXPERTS)}
    assert run_ranks(_cp_equals_one_process, 2, ckpts["gpt_oss"], cases, timeout=280) == [len(cases)] * 2


def _train_four(rank, world_size, assets, out):
    import train

    train.main(train_argv(assets, out, *TRAIN, "--cp", "2", "--dp-shard", "2", "--cp-impl", "ring"))


@pytest.mark.timeout(600)
def test_train_four_ranks_as_one_and_the_adapter_loads_in_peft(tmp_path_factory):
    """train.py, 2 steps, LoRA on the attention and the experts (nf4, AC): --cp 2 --dp-shard 2 ring on 4 gloo ranks =
    1 rank, and a resume from its step 1 checkpoint = the run (every step's loss and grad norm, the adapter:
    test_train's tolerances); the adapter names the two target_parameters and loads in peft on transformers' model
    with no key warning, every tensor as saved; the checkpoint's export (python -m parallel.checkpoint) = it."""
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file

    import train
    from parallel.checkpoint_export import export
    from tests.dist import run_ranks
    from tests.test_qwen3_moe_run import make_assets
    from tests.test_train import _compare, _metrics

    root = tmp_path_factory.mktemp("moe_lora_runs")
    assets = make_assets(root)
    with one_thread():
        train.main(train_argv(assets, str(root / "one"), *TRAIN, "--save-every", "1"))
        train.main(train_argv(assets, str(root / "resumed"), *TRAIN, "--save-every", "1", "--resume",
                              str(root / "one" / "ckpt" / "step_000001")))
    run_ranks(_train_four, 4, assets, str(root / "four"), timeout=500, pg_timeout=60)
    _compare("cp 2 x dp_shard 2 ring", str(root / "four"), str(root / "one"), steps=(1, 2))
    _compare("resumed after step 1", str(root / "resumed"), str(root / "one"), steps=(2,))
    adapter = str(root / "one" / "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_parameters"]) == sorted(PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32),
                                       adapter)
    assert not [str(w.message) for w in caught if "key" in str(w.message).lower()]
    got = {n.replace(".default.weight", ".weight"): p for n, p in pm.named_parameters() if "lora_" in n}
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert sorted(got) == sorted(saved) and len(saved) == 3 * 4 * 2 + 2 * 2 * 2, sorted(set(got) ^ set(saved))
    for k, v in saved.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    assert any(v.any() for k, v in saved.items() if ".experts." in k and "lora_B" in k), "the experts' B trained"
    export(str(root / "one" / "ckpt"), str(root / "from_ckpt"), model=assets["model"])   # (its shape check too)
    again = load_file(str(root / "from_ckpt" / "adapter_model.safetensors"))
    assert sorted(again) == sorted(saved), "python -m parallel.checkpoint's adapter: the run's keys"
    for k, v in saved.items():
        torch.testing.assert_close(again[k], v, rtol=0, atol=0, msg=f"from the checkpoint: {k}")
    with open(root / "from_ckpt" / "adapter_config.json") as f:
        assert sorted(json.load(f)["target_parameters"]) == sorted(PARAMS)
    with one_thread():   # train.py from it (--init-adapter: the start-up checks and the build read the experts' LoRA)
        train.main(train_argv(assets, str(root / "init"), *TRAIN, "--steps", "1", "--init-adapter", adapter))
    first = lambda run: _metrics(str(root / run))[0]["loss"]
    assert abs(first("init") - first("one")) > 1e-3, "started from the adapter: another step-1 loss"


@pytest.mark.parametrize("name,quant", [("renorm", "nf4"), ("renorm", "none"), ("gpt_oss", "nf4"), ("q35", "nf4")])
def test_planned_activations_and_lora_bytes_match_autograd(ckpts, name, quant, tmp_path):
    """No AC, fp32, one process: the plan's activation terms with the experts' LoRA (each slot's gathered input, SwiGLU
    product and two [r] products: parallel/plan_moe.saved) = the bytes autograd keeps; its LoRA term = 16 bytes per
    trained element (parameter, gradient, AdamW's two), the experts' included."""
    import train
    from parallel.cp import KernelAttention
    from parallel.flags import check_model_flags
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan
    from tests.helpers import planned_and_saved_activations
    from tests.test_gpt_oss import _save

    path, core = ckpts[name], None
    if name == "gpt_oss":   # (as tests/test_gpt_oss.py plans it: full attention through the kernel core)
        path, core = _save(tmp_path / "m", intermediate_size=32, sliding_window=None,
                           layer_types=["full_attention"] * 2), KernelAttention()
    args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1",
                                            "--quant", quant, "--dtype", "fp32", "--no-ac", "--lora-targets",
                                            "attn,experts"])
    check_model_flags(args, model.load.read_args(path))   # (--lora-targets as the run takes it: attn's names here)
    ours, _ = build_model(BuildOptions(path, quant=quant, ac=False, lora_targets=tuple(args.lora_targets.split(","))),
                          device="cpu", attention=core)
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)
    dims, pack = validate(args, ours.args, 1)
    lora = next(v for k, v in memory_plan(ours.args, dims, args, "cpu", pack).terms.items() if k.startswith("LoRA"))
    assert lora == 16 * sum(p.numel() for p in ours.parameters() if p.requires_grad), lora
