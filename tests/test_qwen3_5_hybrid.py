"""Qwen3.5 as published: Gated DeltaNet (`linear_attention`, model/deltanet.py) and full-attention layers in one model,
computing and training what transformers and peft do.

Pins (CPU, float32, tiny random checkpoints saved by transformers itself: layers linear, linear, linear, full; 2 key /
4 value heads of 16 in the linear layers; every norm weight, A_log and dt_bias drawn away from their defaults):
- config.json read as Qwen3_5TextConfig reads it (layer types from full_attention_interval, the linear_* sizes and
  their defaults); n_params = transformers' parameter count (less the q/k norms, which it leaves out for every model);
- the start-up shape check passes (attention projections in the full layers, linear_attn's in the others);
- logits = Qwen3_5ForCausalLM's on whole rows (more than one 64-token chunk) and on a packed row, each document as
  transformers computes it alone (the recurrent state and the convolution must not cross documents);
- LoRA on every linear of the language model (all-linear: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
  too): the loss and every LoRA gradient = peft's on Qwen3_5ForCausalLM on packed rows, plain and under AC + tiled MLP
  + tiled attention (full layers only) + host offload; --compile = eager;
- cp 2 (Ulysses, ring) under FSDP with train.py's cores (parallel/cp_linear.py for the linear layers) = one process;
- NF4: the Linears transformers + bitsandbytes quantize (every nn.Linear of the language model but lm_head; conv1d,
  A_log, dt_bias and the gated norm stay in the compute dtype), the logits those NF4 weights give;
- the exported adapter loads in peft on Qwen3_5ForCausalLM and on the multimodal wrapper with our logits; `python -m
  model.merge` = peft's merge_and_unload;
- --train-norms trains the linear layers' gated norms too (linear_attn.norm): loss and every LoRA and norm gradient =
  peft's modules_to_save on Qwen3_5ForCausalLM, the adapter in peft (text, wrapper), the merge, DPO's reference norms;
- --lora-targets: the default and attn adapt in_proj_qkv, in_proj_z, out_proj; a model without linear layers drops
  those names (its recorded targets are the seven, as before);
- start-up refusals before any weight is read: --dpo-share-prompt, a --cp the linear heads cannot take;
- train.py on the hybrid checkpoint (4 steps of --global-batch 4): the loss falls; resumed after step 2 = the
  uninterrupted run; on 2 gloo ranks (its blocks' output projections × 100, so the blocks move the logits), cp 2 ring
  (2 packed documents a row, tiled MLP, offload) and cp 2 Ulysses (--ac-keep-attn), all-linear LoRA and --train-norms,
  train as 1 rank (every step's loss and grad norm, the adapter);
- the memory plan by layer type (parallel/plan_linear.py hooked into parallel/plan.py): planned activations = the bytes
  autograd keeps (fp32, nf4; the default targets, all-linear, in_proj_b + o_proj, mlp, q + v, tiled MLP + attention,
  --ac-blocks 2 and 3), planned base weights, block norms (+ linear_attn's conv1d, A_log, dt_bias, gated norm), LoRA
  and FSDP2's unsharded block = the model's parameters; --plan on bench/configs/qwen3.5-9b counts 24 linear and 8 full
  layers' weights and LoRA, and --max-len auto's length fits where 1,024 more do not.

Run: .venv/bin/python -m pytest -q tests/test_qwen3_5_hybrid.py
"""

import json
import os
import re
import warnings

import pytest
import torch
import transformers as T

import model
from tests.helpers import one_thread, train_argv

TYPES = ["linear_attention"] * 3 + ["full_attention"]
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=4096, layer_types=TYPES, **LINEAR)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
       "in_proj_b", "in_proj_a", "out_proj")
N_LORA = 3 * 8 + 7   # LoRA layers: 3 linear blocks (5 + MLP's 3), 1 full block (4 + 3)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _perturb(m):
    with torch.no_grad():   # norms (zero-centred: 0 is the identity; the gated norm's 1), A_log, dt_bias off defaults
        for n, p in m.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n:
                p.add_(torch.randn_like(p) * 0.3)
            elif "embed" in n or "lm_head" in n:   # logits far from uniform, so a few steps show
                p.mul_(10)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    d = tmp_path_factory.mktemp("qwen3_5_hybrid")
    out = {"text": str(d / "text"), "wrapper": str(d / "wrapper"), "data": str(d / "chat.jsonl")}
    make_chat_jsonl(out["data"], 40, seed=1)
    tok = make_tokenizer(out["text"])
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**SIZES, **ids)).float()
    _perturb(hf)
    hf.save_pretrained(out["text"])
    cfg = T.Qwen3_5Config(text_config=dict(SIZES, **ids, model_type="qwen3_5_text"), vision_config=VISION,
                          tie_word_embeddings=False)
    torch.manual_seed(1)
    w = T.Qwen3_5ForConditionalGeneration(cfg).float()
    _perturb(w)
    w.save_pretrained(out["wrapper"])
    out["vocab"] = len(tok)
    return out


def _hf(path):
    cls = T.Qwen3_5ForCausalLM if os.path.basename(path) == "text" else T.Qwen3_5ForConditionalGeneration
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(path, dtype=torch.float32).eval()


def _ids(s, seed=1, b=2):
    return torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(seed))


def test_config_read_as_transformers_reads_it():
    from model.config import ModelArgs
    from model.linear_layers import LinearSpec

    bare = {k: v for k, v in SIZES.items() if k != "layer_types" and k not in LINEAR}
    for extra in ({}, {"full_attention_interval": 2}, {"layer_types": TYPES, **LINEAR}):
        cfg = {"model_type": "qwen3_5_text", "vocab_size": 128, **bare, **extra}
        ours, want = ModelArgs.from_config_dict(cfg), T.Qwen3_5TextConfig(**cfg)
        assert ours.layer_types == want.layer_types, extra
        assert ours.linear == LinearSpec(want.linear_num_key_heads, want.linear_num_value_heads,
                                         want.linear_key_head_dim, want.linear_value_head_dim,
                                         want.linear_conv_kernel_dim), extra
        assert [ours.is_linear(i) for i in range(4)] == [t == "linear_attention" for t in want.layer_types]
        hf = T.Qwen3_5ForCausalLM(want)   # (n_params leaves q_norm / k_norm out, for every model)
        assert ours.n_params == sum(p.numel() for n, p in hf.named_parameters() if "q_norm" not in n
                                    and "k_norm" not in n), extra
    full = ModelArgs.from_config_dict({"model_type": "qwen3_5_text", "vocab_size": 128, **bare,
                                       "layer_types": ["full_attention"] * 4})
    assert full.linear is None and full.layer_types is None
    with pytest.raises(ValueError, match="linear_num_key_heads 0"):
        ModelArgs.from_config_dict({"model_type": "qwen3_5_text", "vocab_size": 128, **bare,
                                    "linear_num_key_heads": 0})
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelArgs.from_config_dict({"model_type": "qwen3_5_text", "vocab_size": 128, **bare,
                                    "layer_types": TYPES[:3] + ["sliding_attention"]})


def test_logits_whole_and_packed_rows_match_transformers(ckpts):
    from model.load_checks import check_config_shapes

    hf, ours = _hf(ckpts["text"]), model.from_pretrained(ckpts["text"]).eval()
    assert [type(b).__name__ for b in ours.model.layers] == ["LinearBlock"] * 3 + ["Block"]
    for path in (ckpts["text"], ckpts["wrapper"]):   # train.py's start-up shape check: each block's own projections
        assert check_config_shapes(path, model.load.read_args(path)) is None
    ids = _ids(150)
    with torch.no_grad():
        assert rel(ours(ids), hf(input_ids=ids).logits) < 1e-5, "whole rows"
        lens = (70, 5, 75)   # the first and last documents cross the 64-token chunks' edges
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        cut = torch.tensor((0,) + lens).cumsum(0).tolist()
        want = torch.cat([hf(input_ids=ids[:1, a:e]).logits for a, e in zip(cut, cut[1:])], 1)
        assert rel(ours(ids[:1], position_ids=pos), want) < 1e-5, "packed row, each document alone"


def _build(path, fsdp_mesh=None, attention=None, linear=None, **kw):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ALL) | kw
    return build_nonzero_b(BuildOptions(path, **opts), fsdp_mesh=fsdp_mesh, attention=attention, linear=linear)


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True,
                                                      offload_activations=True)], ids=["plain", "ac_tiled_offload"])
def test_lora_grads_match_peft_on_transformers(ckpts, mem):
    from peft import LoraConfig, get_peft_model

    ids = _ids(90, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(20), torch.arange(70)]).expand(2, 90)   # packed: two documents a row
    ours, peft_model = _build(ckpts["text"], **mem)
    s, n = ours(ids, position_ids=pos, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = get_peft_model(_hf(ckpts["text"]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       lora_dropout=0.0, init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    hf.train()
    logits = torch.cat([hf(input_ids=ids[:, :20]).logits, hf(input_ids=ids[:, 20:]).logits], 1)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    assert theirs.keys() == mine.keys() and len(mine) == N_LORA * 2, sorted(set(theirs) ^ set(mine))
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=f"grad {k}")


@pytest.mark.timeout(600)
def _cp_equals_one_process(rank, world_size, path):
    """cp 2 (Ulysses, then ring) under FSDP with train.py's cores (cp_attention, cp_linear) on packed rows whose
    documents cross the shards: the global loss and every LoRA gradient = one process's."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.cp_linear import ContextParallelLinear, cp_linear
    from parallel.mesh import ParallelDims

    ids = _ids(84, 9)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.cat([torch.arange(30), torch.arange(54)]).expand(2, 84)
    ref, _ = _build(path, ac=True)
    s, n = ref(ids, position_ids=pos, labels=labels)
    (s / n).backward()
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    for impl in ("ulysses", "ring"):
        dims = ParallelDims.from_args(world_size, 1, -1, 2, impl, None, n_heads=4, n_kv_heads=2)
        meshes = dims.build_mesh("cpu")
        linear = cp_linear(meshes, dims)
        assert isinstance(linear, ContextParallelLinear)
        model, _ = _build(path, ac=True, fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims), linear=linear)
        cr = meshes.cp.get_local_rank()
        ls, ln = model(shard_sequence(ids, dims, cr, 0), position_ids=shard_sequence(pos, dims, cr, None),
                       labels=shard_sequence(labels, dims, cr, -100))
        total = ln.detach().clone()
        dist.all_reduce(total, group=meshes.cp.get_group())
        (ls / total).backward()
        got = ls.detach().clone()
        dist.all_reduce(got, group=meshes.cp.get_group())
        torch.testing.assert_close(got / total, s.detach() / n, rtol=1e-5, atol=1e-6, msg=f"{impl}: loss")
        grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for k, p in model.named_parameters() if p.requires_grad}
        assert grads.keys() == want.keys() and len(grads) == N_LORA * 2
        for k in grads:
            assert rel(grads[k], want[k]) < 1e-5, f"{impl}: grad {k}"
    return True


@pytest.mark.timeout(300)
def test_cp_ulysses_and_ring_equal_one_process(ckpts):
    from tests.dist import run_ranks

    assert run_ranks(_cp_equals_one_process, 2, ckpts["text"], timeout=280) == [True, True]


@pytest.mark.timeout(600)
def test_compile_equals_eager(ckpts):
    """--compile (its norms, RoPE, SwiGLU; the DeltaNet core left out: torch.compiler.disable) with AC and the tiled
    MLP: the loss and every gradient = the eager build's."""
    from tests.helpers import step_of

    ids = _ids(80, 7)
    ref = step_of(_build(ckpts["text"], ac=True)[0], ids)
    loss, grads = step_of(_build(ckpts["text"], ac=True, tiled_mlp=True, compile=True)[0], ids)
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6, msg="loss")
    assert grads.keys() == ref[1].keys() and len(grads) == N_LORA * 2
    for k in grads:
        assert rel(grads[k], ref[1][k]) < 1e-5, k


def test_nf4_quantizes_what_bitsandbytes_would(ckpts):
    """Every nn.Linear of transformers' language model but lm_head is NF4 (linear_attn's five too); conv1d, A_log,
    dt_bias, the gated norm stay float32; the logits = the plain model's with those weights through bitsandbytes'
    NF4 (tests.helpers.bnb_nf4)."""
    from bitsandbytes.functional import dequantize_4bit

    from model.nf4 import NF4Linear
    from tests.helpers import bnb_nf4

    q, _ = _build(ckpts["text"], quant="nf4", lora_targets=("q_proj",), ac=False)
    hf = _hf(ckpts["text"])
    linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    nf4 = {n.replace("base_layer", "").replace("..", ".").rstrip(".") for n, m in q.named_modules()
           if isinstance(m, NF4Linear)}
    assert nf4 == linears and any("linear_attn.in_proj_a" in n for n in nf4)
    kept = {n: p.dtype for n, p in q.named_parameters() if n.rsplit(".", 1)[-1] in ("A_log", "dt_bias")
            or "conv1d" in n or "linear_attn.norm" in n}
    assert len(kept) == 3 * 4 and set(kept.values()) == {torch.float32}, kept
    plain, _ = _build(ckpts["text"], lora_targets=("q_proj",), ac=False)
    with torch.no_grad():
        for n, m in plain.named_modules():
            if n.replace("base_layer", "").replace("..", ".").rstrip(".") in linears and isinstance(m, torch.nn.Linear):
                m.weight.copy_(dequantize_4bit(*bnb_nf4(m.weight)).view_as(m.weight))
        ids = _ids(40, 2)
        torch.testing.assert_close(q(ids), plain(ids), rtol=1e-5, atol=1e-5)


def _peft_loaded(base, adapter):
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(_hf(base), adapter).eval()
    said = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not said, f"peft warned {said}"
    return pm


@pytest.mark.parametrize("which", ["text", "wrapper"])
def test_exported_adapter_loads_in_peft_with_our_logits(ckpts, tmp_path, which):
    from model.export import export_adapter

    ours, peft_model = _build(ckpts[which], ac=False)
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[which])
    with open(tmp_path / "a" / "adapter_config.json") as f:
        targets = json.load(f)["target_modules"]
    assert ("linear_attn" in targets) if which == "wrapper" else "in_proj_a" in targets, targets
    with torch.no_grad():
        mine = ours(_ids(70))
    pm = _peft_loaded(ckpts[which], str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=_ids(70)).logits, mine, rtol=1e-5, atol=1e-5)
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert len(lora) == N_LORA and sum(".linear_attn." in n for n in lora) == 15, lora


def test_merge_is_what_peft_merges(ckpts, tmp_path):
    from model import merge
    from model.export import export_adapter

    base = ckpts["text"]
    _, peft_model = _build(base, ac=False)
    export_adapter(peft_model, str(tmp_path / "a"), base, quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", base, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    ref = _peft_loaded(base, str(tmp_path / "a")).merge_and_unload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, info = T.Qwen3_5ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=_ids(70)).logits, ref(input_ids=_ids(70)).logits, rtol=1e-5,
                                   atol=1e-5)
        for n, p in ref.named_parameters():   # (the linear layers' projections moved: the adapter is in them)
            torch.testing.assert_close(got.get_parameter(n), p, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("which", ["text", "wrapper"])
def test_train_norms_train_the_gated_norms_as_peft_modules_to_save(ckpts, tmp_path, which):
    """--train-norms: every block's two norms, the linear layers' gated norm (linear_attn.norm, [dv]), the full layer's
    q/k norms and the final norm train; the loss and every LoRA and norm gradient = peft's with those modules_to_save on
    Qwen3_5ForCausalLM; the adapter names them (full names) and loads in peft with our logits (text and wrapper); the
    merge = merge_and_unload; DPO's reference (model.norms.reference_trained) computes with the base's norms."""
    from peft import LoraConfig, get_peft_model

    from model import merge
    from model.export import export_adapter
    from model.norms import modules_to_save, reference_trained

    ours, peft_model = _build(ckpts[which], ac=False, train_norms=True)
    with torch.no_grad():
        base_logits = ours(_ids(70))
        g = torch.Generator().manual_seed(1)
        for n, p in ours.named_parameters():   # moved off the checkpoint's: an adapter without them would show
            if p.requires_grad and n.endswith("norm.weight"):
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    norms = sorted(n for n in mine if n.endswith("norm.weight"))
    assert len(norms) == 3 * 3 + 4 + 1 and sum(".linear_attn.norm." in n for n in norms) == 3, norms
    with torch.no_grad(), reference_trained(ours, ckpts[which]):
        torch.testing.assert_close(ours(_ids(70)), base_logits, rtol=0, atol=0, msg="DPO's reference norms")
    export_adapter(peft_model, str(tmp_path / "a"), ckpts[which], quant="none")
    with open(tmp_path / "a" / "adapter_config.json") as f:
        saved = json.load(f)["modules_to_save"]
    assert sum(m.endswith(".linear_attn.norm") for m in saved) == 3 and len(saved) == len(norms), saved
    with torch.no_grad():
        logits = ours(_ids(70))
    pm = _peft_loaded(ckpts[which], str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=_ids(70)).logits, logits, rtol=1e-5, atol=1e-5, msg="peft's logits")
    if which == "wrapper":
        return
    out = str(tmp_path / "merged")
    assert merge.main(["--model", ckpts[which], "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = T.Qwen3_5ForCausalLM.from_pretrained(out)
    want = pm.merge_and_unload()
    for i in range(3):
        n = f"model.layers.{i}.linear_attn.norm.weight"
        torch.testing.assert_close(got.get_parameter(n), want.get_parameter(n), rtol=0, atol=0, msg=f"merged {n}")
    # gradients: peft on transformers' model with the same LoRA tensors and these norms as modules_to_save
    ref = get_peft_model(_hf(ckpts[which]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                                       init_lora_weights=False, modules_to_save=modules_to_save(mine)))
    theirs = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", ""): p
              for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(mine), sorted(set(theirs) ^ set(mine))
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(mine[n])
    ref.train()
    ids = _ids(90, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    s, count = ours(ids, position_ids=torch.arange(90).expand(2, 90), labels=labels)
    (s / count).backward()
    want = torch.nn.functional.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.reshape(-1),
                                             reduction="sum", ignore_index=-100)
    (want / count).backward()
    torch.testing.assert_close(s.detach(), want.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    for n in mine:
        assert theirs[n].grad.abs().sum() > 0, n
        torch.testing.assert_close(mine[n].grad, theirs[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad {n}")


def test_lora_targets_per_model():
    from model.config import ModelArgs
    from model.lora_spec import DEFAULT_TARGETS, lora_targets_arg, model_targets

    hybrid = ModelArgs.from_config_dict({"model_type": "qwen3_5_text", "vocab_size": 128, **SIZES})
    llama = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, intermediate_size=128)
    assert model_targets(lora_targets_arg("attn").split(","), hybrid) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")
    assert model_targets(lora_targets_arg("all-linear").split(","), hybrid) == ALL
    assert set(model_targets(DEFAULT_TARGETS, hybrid)) == set(ALL) - {"in_proj_a", "in_proj_b"}
    for spec, want in (("all-linear", ALL[:7]), ("attn", ALL[:4]), (",".join(DEFAULT_TARGETS), ALL[:7])):
        assert model_targets(lora_targets_arg(spec).split(","), llama) == want, spec
    with pytest.raises(ValueError, match="no linear-attention layers"):
        model_targets(["in_proj_qkv"], llama)
    assert [hybrid.has(i, "q_proj") for i in range(4)] == [False] * 3 + [True]
    assert [hybrid.has(i, "in_proj_z") for i in range(4)] == [True] * 3 + [False]


@pytest.mark.parametrize("flags", [[], ["--lora-targets", "all-linear"], ["--lora-targets", "in_proj_b,o_proj"],
                                   ["--lora-targets", "mlp"], ["--lora-targets", "q_proj,v_proj"],
                                   ["--tiled-mlp", "--tiled-attn"], ["--ac", "--ac-blocks", "2"],
                                   ["--ac", "--ac-blocks", "3", "--lora-targets", "all-linear"],
                                   ["--lora-targets", "down_proj"], ["--lora-targets", "out_proj,up_proj"]],
                         ids=["default", "all_linear", "b_o", "mlp", "q_v", "tiled_both", "ac_blocks_2", "ac_blocks_3",
                              "down", "out_up"])
def test_planned_activations_match_autograd(ckpts, flags):
    """fp32, one process, nf4: the plan's activation terms = the bytes autograd keeps for backward (unique storages,
    parameters excluded), each layer planned as its type: the linear layers' Gated DeltaNet sublayer
    (parallel/plan_linear.py; layer 0's, whose input needs no grad, keeps only what its targets need), the full
    layer's gated attention; LoRA's tensors by the targets each layer holds; --tiled-attn tiles the full layer only.
    Under AC (--ac-blocks) the checkpointed inputs and the last blocks' saved tensors (a linear and the full one)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts["text"], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--lora-dropout", "0", "--lora-r",
                                            "4", *(["--no-ac"] * ("--ac" not in flags)), *flags])
    ours, _ = build_model(BuildOptions(ckpts["text"], quant="nf4", lora_r=4, ac=args.ac, ac_blocks=args.ac_blocks,
                                       lora_dropout=0.0, tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn,
                                       lora_targets=tuple(args.lora_targets.split(","))), device="cpu")
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


def test_planned_weights_are_the_models(ckpts):
    """One process, fp32, nf4, LoRA on every linear: each of the plan's weight terms = the built model's parameters,
    every layer as its type: base weights (NF4 codes of linear_attn's five Linears in the linear layers, the gated
    attention's four in the full one, the MLP's in all), the block norms' term (+ linear_attn's conv1d, A_log, dt_bias
    and gated norm), LoRA (16 bytes an element, each layer's own targets) and FSDP2's unsharded block (the larger
    kind's: every parameter of one block, its LoRA too; the full layers' q/k norms, [hd] each, with the block norms)."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(["--model", ckpts["text"], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--lora-targets", "all-linear",
                                            "--lora-r", "4"])
    ours, _ = build_model(BuildOptions(ckpts["text"], quant="nf4", lora_r=4, lora_targets=ALL), device="cpu")
    dims, pack = validate(args, ours.args, 1)
    terms = memory_plan(ours.args, dims, args, "cpu", pack).terms
    term = lambda key: next(v for k, v in terms.items() if k.startswith(key))
    params = [(n, p.numel() * p.element_size()) for n, p in ours.named_parameters() if ".layers." in n]
    nbytes = lambda key: sum(b for n, b in params if key(n))
    assert term("base weights") == nbytes(lambda n: n.endswith("base_layer.weight"))
    assert term("block norms") == nbytes(lambda n: "lora_" not in n and "base_layer" not in n) > 0
    assert term("LoRA params") == 4 * nbytes(lambda n: "lora_" in n)
    per_layer = [nbytes(lambda n, i=i: f".layers.{i}." in n) for i in range(len(TYPES))]
    assert term("FSDP2: 2 unsharded blocks") == 2 * max(per_layer), per_layer


def test_plan_reads_the_9b_config():
    """--plan on bench/configs/qwen3.5-9b (Qwen3_5TextConfig's defaults: 24 linear and 8 full layers): the weights by
    layer type (NF4 half a byte a weight: linear_attn's in_proj_qkv [8192, 4096], in_proj_z, out_proj [4096, 4096],
    in_proj_b/a [32, 4096]; the gated attention's q_proj [8192, 4096], k/v [1024, 4096], o [4096, 4096]; the MLP's
    3 x 12288 x 4096), the default targets' LoRA where each layer holds them; --max-len
    auto finds a length that fits and 1,024 more that do not."""
    import contextlib
    import io

    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs", "qwen3.5-9b")
    m = read_args(path)
    assert sum(map(m.is_linear, range(m.n_layers))) == 24 and m.n_layers == 32
    out = io.StringIO()
    argv = ["--plan", "--model", path, "--max-len", "32768", "--global-batch", "1", "--gpu-mem", "141"]
    with contextlib.redirect_stdout(out):
        train.main(argv)
    # (the printed block phases are the worse kind's: at 32k the attention block's since the gated norm's memory cut,
    # 2026-12-07; before it, the linear block's backward line)
    assert "| block recompute" in out.getvalue() and "fits:" in out.getvalue(), out.getvalue()
    args = train.build_parser().parse_args(argv[1:7])
    dims, pack = validate(args, m, 1)
    p = memory_plan(m, dims, args, "cuda", pack)
    term = lambda key: next(v for k, v in p.terms.items() if k.startswith(key))
    D, mlp = 4096, 3 * 12288 * 4096
    lin, full = 8192 * D + 2 * D * D + 2 * 32 * D, 8192 * D + 2 * 1024 * D + D * D
    assert term("base weights") == (24 * (lin + mlp) + 8 * (full + mlp)) // 2
    r, both = 16, lambda o, i: 16 * (o + i)   # LoRA A [r, in] + B [out, r], 16 bytes an element
    mlp_lora = 2 * both(12288, D) + both(D, 12288)
    lin_lora = both(8192, D) + both(D, D) + both(D, D)                       # in_proj_qkv, in_proj_z, out_proj
    full_lora = both(8192, D) + 2 * both(1024, D) + both(D, D)               # q (with its gate), k, v, o
    assert term("LoRA params") == r * (24 * (lin_lora + mlp_lora) + 8 * (full_lora + mlp_lora))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(argv[:4] + ["auto"] + argv[5:])
    n = int(re.fullmatch(r"max_len (\d+)", out.getvalue().strip().splitlines()[-1]).group(1))

    def total(k):
        a = train.build_parser().parse_args(["--model", path, "--max-len", str(k), "--global-batch", "1"])
        return memory_plan(m, *validate(a, m, 1)[:1], a, "cuda", True).total
    assert n > 32768 and total(n) <= 141e9 < total(n + 1024), n


@pytest.mark.parametrize("flags,match", [(["--objective", "dpo", "--dpo-share-prompt"], "--dpo-share-prompt"),
                                         (["--cp", "3"], "linear-attention key heads")])
def test_start_up_refusals_before_any_weight(ckpts, tmp_path, flags, match):
    from parallel.mesh import validate
    from train import build_parser

    argv = train_argv({"model": ckpts["text"], "data": ckpts["data"]}, str(tmp_path / "o"), *flags)
    args = build_parser().parse_args(argv)
    margs = model.load.read_args(ckpts["text"])
    with pytest.raises(ValueError, match=match):
        validate(args, margs, 3 if "--cp" in flags else 1)


@pytest.mark.timeout(600)
def test_train_py_trains_and_resumes(ckpts, tmp_path):
    import train

    a = {"model": ckpts["text"], "data": ckpts["data"]}
    flags = ["--steps", "4", "--global-batch", "4", "--lr", "1e-2", "--save-every", "2", "--seed", "1"]
    with one_thread():
        train.main(train_argv(a, str(tmp_path / "run"), *flags))
        train.main(train_argv(a, str(tmp_path / "res"), *flags, "--resume",
                              str(tmp_path / "run" / "ckpt" / "step_000002")))

    def metrics(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return {r["step"]: r for r in map(json.loads, f) if "step" in r}
    run, res = metrics(str(tmp_path / "run")), metrics(str(tmp_path / "res"))
    assert run[4]["loss"] < run[1]["loss"], run
    assert sorted(res) == [3, 4] and all(res[s]["loss"] == run[s]["loss"] for s in (3, 4)), (res, run)
    with open(tmp_path / "run" / "adapter" / "adapter_config.json") as f:
        cfg = json.load(f)
    assert sorted(cfg["target_modules"]) == sorted(set(ALL) - {"in_proj_a", "in_proj_b"}), cfg["target_modules"]


def _loud(src, dst, k=100.0):
    """`src` with every block's output projection (linear_attn.out_proj, self_attn.o_proj) × `k`, its tokenizer beside
    it: the fixture's embedding and head × 10 drown the blocks' share of the logits (a linear core that restarted
    its recurrence at each cp shard moved step 1's loss by under 1e-4 there)."""
    import shutil

    hf = _hf(src)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(("out_proj.weight", "o_proj.weight")):
                p.mul_(k)
    hf.save_pretrained(dst)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".index.json", "config.json")) or f == "tokenizer_config.json":
            shutil.copy(os.path.join(src, f), dst)
    return dst


def _train_ranks(rank, world_size, runs):
    import train

    for argv in runs:
        train.main(argv)
    return True


@pytest.mark.timeout(600)
def test_train_py_on_two_cp_ranks_trains_as_one(ckpts, tmp_path):
    """train.py on the hybrid checkpoint, 2 steps of --global-batch 4 with --lora-targets all-linear (in_proj_b and
    in_proj_a's LoRA feed the core's g|beta all-to-all) and --train-norms (the gated norms): cp 2 ring with 2 packed
    documents a row, the tiled MLP and offload, and cp 2 Ulysses with --ac-keep-attn (the linear core recomputed, its
    all-to-alls again), each on 2 gloo ranks, train as 1 rank (every step's loss and grad norm, the adapter:
    test_train's tolerances). The model-level check above holds the cores; this one train.py's wiring of cp_linear,
    its sharded batches and its global token count."""
    import train
    from tests.dist import run_ranks
    from tests.test_train import _compare

    a = {"model": _loud(ckpts["text"], str(tmp_path / "model")), "data": ckpts["data"]}
    flags = ["--steps", "2", "--global-batch", "4", "--lora-targets", "all-linear", "--train-norms"]
    layouts = {"ring": ["--cp", "2", "--cp-impl", "ring", "--micro-batch", "2", "--tiled-mlp", "--offload-activations"],
               "ulysses": ["--cp", "2", "--cp-impl", "ulysses", "--ac-keep-attn"]}
    with one_thread():
        train.main(train_argv(a, str(tmp_path / "one"), *flags))
    runs = [train_argv(a, str(tmp_path / name), *flags, *extra) for name, extra in layouts.items()]
    assert run_ranks(_train_ranks, 2, runs, timeout=540, pg_timeout=120) == [True, True]
    for name in layouts:
        _compare(f"Qwen3.5 hybrid cp 2 {name}", str(tmp_path / name), str(tmp_path / "one"), steps=(1, 2))
