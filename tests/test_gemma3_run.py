"""Gemma 3 text models (`gemma3_text`, model/gemma.py) through the rest of the trainer: train.py end to end, the merge,
DPO, --compile, bf16 and NEFTune (the decoder itself: tests/test_gemma3.py); Gemma 4's dense model (`gemma4_text`:
tests/test_gemma4.py's 4 layers, per-layer head sizes, attention_k_eq_v, v_norm, layer_scalar, its logits pushed into
final_logit_softcapping) through the merge, DPO, --compile, bf16 and eval (its layouts: tests/test_gemma4_layouts.py).

Pins (CPU, gloo, tiny random Gemma3ForCausalLM made by transformers: 2 layers, sliding (a window shorter than the rows)
then full, 6 query / 2 KV heads of 16 under hidden 48, query_pre_attn_scalar 24, both RoPE tables, tied embeddings,
every norm weight drawn away from 0, the offset's identity; pad id 0, as Gemma's):
- train.py, 2 steps of --global-batch 4 (`SHORT`: nothing resumes; accumulation over 2 and 4 micro-batches a step
  remains, in the micro-batch 1 runs; DPO's runs 3 steps) on the fixture tokenizer's chat records: 1 rank = cp2 ×
  dp_shard2 Ulysses and ring (2 packed documents a row) with --tiled-mlp --offload-activations = 1 rank with those and
  --tiled-attn = 1 rank with --micro-batch 2 --no-pack (padding with id 0) in every step's loss and grad norm and the
  adapter (test_train's tolerances); --train-norms --train-embeddings (the tied, scaled embedding) on cp2 × dp2 ring = 1
  rank; --neftune-alpha on cp2 × dp2 ring = 1 rank, and its losses differ from the plain run's (the ring run with 2
  packed documents a row and the memory flags is this one: one run for both claims); --objective dpo
  --train-norms starts at log 2 and cp2 × dp2 ring = 1 rank (step 1 exactly, later losses within 1e-3); --dtype bf16
  trains within bf16's rounding;
- `model.merge` of a Gemma adapter (plain LoRA with --quant none and nf4; --train-norms, whose norm weights are offsets
  from 1 in the checkpoint) = peft's merge_and_unload on transformers' model, tensor by tensor, and transformers'
  Gemma3ForCausalLM on the merged folder gives peft's logits;
- DPO with --train-norms (and --train-embeddings on an untied Gemma: the reference's embedding scaled too) on a packed
  micro-batch of pairs = the DPO formula on transformers' + peft's logits (the policy) and transformers' base model's
  (the reference): losses and every trained gradient;
- --compile (GemmaRMSNorm and GeGLU compiled) = eager: loss and every gradient, also with the tiled MLP and attention
  and --train-norms;
- bf16 weights, no mixed precision: our logits within bf16's rounding of transformers' bf16 model, and no farther from
  the float64 model's than transformers' own.
Gemma 4 (soft-capped at 5): the merge with --quant nf4 --train-norms --train-embeddings (the norms it trains: each
block's four, q_norm, k_norm; layer_scalar as stored); DPO's losses, per-token log-probs (of the capped logits) and
gradients; --compile (v_norm compiled too) with the tiled MLP and attention; bf16; and a train.py run's eval_loss and
eval_token_acc (ties on saturated capped logits count) = transformers + peft on its saved adapter.

Run: .venv/bin/python -m pytest -q tests/test_gemma3_run.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from tests.dist import run_ranks
from tests.helpers import one_thread, train_argv
from tests.test_gemma3 import CONFIG, TYPES
from tests.test_gemma4 import CONFIG as G4_CONFIG
from tests.test_gemma4 import _perturb
from tests.test_train import _compare, _metrics

E2E = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
           head_dim=16, query_pre_attn_scalar=24, sliding_window=16, layer_types=TYPES, max_position_embeddings=4096,
           pad_token_id=0, eos_token_id=0, bos_token_id=None)
SHORT = ["--steps", "2", "--global-batch", "4"]   # the runs of `runs` (each compared with another of them)
MEM = ["--tiled-mlp", "--offload-activations"]
NEF = ["--neftune-alpha", "5"]
NORMS = ["--train-norms", "--train-embeddings"]
ONE = {"plain": [], "tiled_attn_mem": ["--tiled-attn", *MEM], "no_pack_mb2": ["--micro-batch", "2", "--no-pack"],
       "neftune": NEF, "norms": NORMS}
# (ring with 2 packed documents a row and MEM: the NEFTune run, against the 1-rank NEFTune run without MEM, which
# changes no number (tiled_attn_mem = plain): a fault of either shows there)
FOUR = {"mem_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *MEM],
        "norms_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", *MEM, *NORMS],
        "neftune_mem_cp2_dp2_ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch",
                                              "2", *NEF, *MEM]}
# --objective dpo with --train-norms (the reference's norms: the base's, through GemmaRMSNorm.reference)
# 3 steps (of 4 pairs): the last step's loss two updates off log 2
DPO = ["--objective", "dpo", "--dpo-beta", "0.5", "--train-norms", "--steps", "3"]
FOUR_DPO = {"dpo_norms_cp2_dp2_ring": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", *DPO]}
SAME_AS = {"mem_cp2_dp2_ulysses": "plain", "tiled_attn_mem": "plain", "no_pack_mb2": "plain",
           "norms_cp2_dp2_ring": "norms", "neftune_mem_cp2_dp2_ring_pack_mb2": "neftune"}


def _drawn(hf):
    """transformers starts every norm weight at 0 (the identity of Gemma's offset): a dropped offset would hide."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return hf


def _four_ranks(rank, world_size, assets, root):
    import train

    for name, flags in FOUR.items():
        train.main(train_argv(assets, os.path.join(root, name), *SHORT, *flags))
    for name, flags in FOUR_DPO.items():
        train.main(train_argv({**assets, "data": assets["pairs"]}, os.path.join(root, name), *SHORT, *flags))


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The 1-rank runs in this process, the 4-rank ones in one spawn, on a Gemma 3 checkpoint with the fixture
    tokenizer (its pad id 0, as Gemma's)."""
    import train
    from tests.fixtures import make_pairs_jsonl, make_tokenizer

    d = tmp_path_factory.mktemp("gemma3_run")
    tok = make_tokenizer(d / "model")
    assert tok.pad_token_id == 0
    torch.manual_seed(0)
    _drawn(T.Gemma3ForCausalLM(T.Gemma3TextConfig(vocab_size=len(tok), **E2E)).float()).save_pretrained(d / "model")
    make_pairs_jsonl(d / "pairs.jsonl", 30, seed=7)
    a = {**assets, "model": str(d / "model"), "pairs": str(d / "pairs.jsonl")}
    root = str(d / "runs")
    with one_thread():
        for name, flags in ONE.items():
            train.main(train_argv(a, os.path.join(root, name), *SHORT, *flags))
        train.main(train_argv(a, os.path.join(root, "bf16"), *SHORT, "--dtype", "bf16"))
        train.main(train_argv({**a, "data": a["pairs"]}, os.path.join(root, "dpo_norms"), *SHORT, *DPO))
    run_ranks(_four_ranks, 4, a, root, timeout=540, pg_timeout=120)
    return root


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SAME_AS))
def test_every_layout_and_memory_step_trains_as_one_rank(runs, name):
    _compare(f"Gemma 3 {name}", os.path.join(runs, name), os.path.join(runs, SAME_AS[name]), steps=(1, 2))


@pytest.mark.timeout(900)
def test_dpo_with_trained_norms_starts_at_log_2_and_trains_as_one_rank_on_four(runs):
    """Step 1 of DPO from the base is log 2 (the policy, its norms the base's, is the reference) and later steps move
    off it; on cp2 × dp2 ring step 1's loss and grad norm are 1 rank's, later losses within 1e-3. (Not test_train's 1e-4
    after step 1: AdamW's first update is about lr·sign(g), and DPO's chosen-minus-rejected gradient here holds
    elements near cancelling, whose sign is float noise of the summation order: at --lr 5e-3 on one rank --micro-batch 2
    moves step 2's loss by 1.6e-4 and a layer-0 B by 0.6% too.)"""
    one, four = (_metrics(os.path.join(runs, n)) for n in ("dpo_norms", "dpo_norms_cp2_dp2_ring"))
    assert abs(one[0]["loss"] - math.log(2)) < 1e-6 and abs(one[-1]["loss"] - math.log(2)) > 1e-2, one
    assert [m["tokens"] for m in four] == [m["tokens"] for m in one], (four, one)
    assert abs(four[0]["loss"] - one[0]["loss"]) < 1e-6, (four[0], one[0])
    assert abs(four[0]["grad_norm"] - one[0]["grad_norm"]) < 1e-5 * one[0]["grad_norm"], (four[0], one[0])
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(four, one)) < 1e-3, (four, one)


@pytest.mark.timeout(900)
def test_bf16_run_trains_as_the_float32_one_within_its_rounding(runs):
    """--dtype bf16 (weights bf16, CPU: no mixed precision) on Gemma: step 1's loss (the same weights) within bf16's
    rounding of the float32 run's, grad norms close, every step finite."""
    got, want = _metrics(os.path.join(runs, "bf16")), _metrics(os.path.join(runs, "plain"))
    assert all(math.isfinite(g["loss"]) and math.isfinite(g["grad_norm"]) for g in got), got
    assert abs(got[0]["loss"] - want[0]["loss"]) < 2e-2 * want[0]["loss"], (got[0], want[0])
    assert abs(got[0]["grad_norm"] - want[0]["grad_norm"]) < 5e-2 * want[0]["grad_norm"], (got[0], want[0])


@pytest.mark.timeout(900)
def test_neftune_and_the_trained_norms_change_the_run(runs):
    """The runs compared above are not the plain one again: the noise, the norms and the embedding move the losses."""
    plain = _metrics(os.path.join(runs, "plain"))
    for name in ("neftune", "norms"):
        other = _metrics(os.path.join(runs, name))
        assert abs(other[-1]["loss"] - plain[-1]["loss"]) > 1e-4, (name, other, plain)
    from safetensors.torch import load_file

    ad = load_file(os.path.join(runs, "norms", "adapter", "adapter_model.safetensors"))
    assert sum(k.endswith("norm.weight") for k in ad) == 6 * 2 + 1 and "base_model.model.model.embed_tokens.weight" \
        in ad, sorted(ad)


# ----------------------------------------------------------------------------- merge, DPO, compile, bf16 (no train.py)


# Gemma 4 (tests/test_gemma4.py's: sliding layers of 16-dim heads, full ones of 32 with attention_k_eq_v: no v_proj,
# v_norm, layer_scalar drawn off 1), its tied embedding × 30 so the logits reach final_logit_softcapping 5: the cap acts
G4 = dict(G4_CONFIG, final_logit_softcapping=5.0, attention_k_eq_v=True)
# each checkpoint's transformers class, --train-norms' tensors (the four block norms, q_norm and k_norm of every block,
# the final norm: Gemma 4's v_norm has no weight), LoRA's adapted modules (Gemma 4's full layers: no v_proj) and the
# modules --compile compiles (the norms, v_norms and GeGLUs)
FAMILY = {"tied": ("Gemma3ForCausalLM", 6 * 2 + 1, 7 * 2, 2 * (6 + 1) + 1),
          "untied": ("Gemma3ForCausalLM", 6 * 2 + 1, 7 * 2, 2 * (6 + 1) + 1),
          "gemma4": ("Gemma4ForCausalLM", 6 * 4 + 1, 7 * 2 + 6 * 2, 4 * (6 + 1 + 1) + 1)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """tests/test_gemma3.py's checkpoint (window 4, theta 1e6 scaled linear x8 / 1e4), the same untied, and Gemma 4
    (G4)."""
    out = {}
    for name, tie in (("tied", True), ("untied", False), ("gemma4", True)):
        torch.manual_seed(0)
        if name == "gemma4":
            hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**G4)).float().eval()
            _perturb(hf)
            with torch.no_grad():
                hf.model.embed_tokens.weight.mul_(30)
        else:
            hf = _drawn(T.Gemma3ForCausalLM(T.Gemma3TextConfig(**CONFIG, tie_word_embeddings=tie)).float().eval())
        path = tmp_path_factory.mktemp(f"gemma3_{name}")
        hf.save_pretrained(path, max_shard_size="60KB")
        out[name] = str(path)
    return out


def _tensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in os.listdir(folder) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, f)).items()}


@pytest.mark.parametrize("family,quant,norms", [("tied", "none", False), ("tied", "nf4", False), ("tied", "none", True),
                                               ("gemma4", "nf4", True)],
                         ids=["lora", "lora_nf4", "train_norms_and_embedding", "gemma4_nf4_train_norms_and_embedding"])
def test_merge_equals_peft_merge_and_unload(ckpts, tmp_path, family, quant, norms):
    """`python -m model.merge` (its main) of our adapter: peft's merge_and_unload on transformers' model (nf4: holding
    the weights our NF4 layers compute with), tensor by tensor; a trained norm is the adapter's offset as it is (peft's
    module's weight), not 1 + it (Gemma 4's: the weight itself), and the trained tied embedding its unscaled weight;
    transformers' Gemma3ForCausalLM / Gemma4ForCausalLM on the merged folder gives peft's logits, ours. Gemma 4: the
    norms trained are each block's four, q_norm and k_norm (v_norm has no weight) and the final one; layer_scalar is
    written as stored."""
    from peft import PeftModel

    from model.export import export_adapter
    from model.merge import main as merge_main
    from tests.helpers import hf_as_trained
    from tests.test_norms import _batch, _ours

    path, (cls, n_norms, _, _) = ckpts[family], FAMILY[family]
    ours, peft_model = _ours(path, quant, norms=norms, emb=norms)
    export_adapter(peft_model, str(tmp_path / "adapter"), path)
    ids, _, pos = _batch()
    peft = PeftModel.from_pretrained(hf_as_trained(path, quant), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want_logits = peft(input_ids=ids).logits
        # (float32 round-off grows with the logits' size: Gemma 4's reach 5, the others' 0.5; 1.4e-5 on an Intel AVX-512
        # machine, 2026-12-07)
        scale = want_logits.abs().max().item()
        torch.testing.assert_close(ours(ids, position_ids=pos), want_logits, rtol=1e-5, atol=1e-5 * scale,
                                   msg="ours = peft")
    want = peft.merge_and_unload().state_dict()
    assert merge_main(["--model", path, "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"),
                       "--quant", quant, "--dtype", "fp32"]) == 0
    got = _tensors(tmp_path / "merged")
    assert set(got) == set(want) - {"lm_head.weight"}, sorted(set(got) ^ set(want))   # (tied: no head stored)
    base = _tensors(path)
    moved = [k for k in got if ("norm" in k or "embed" in k) and not torch.equal(got[k], base[k])]
    assert len(moved) == (n_norms + 1) * norms, moved
    kinds = {k.split(".")[-2] for k in moved if ".layers." in k}   # (the norms of every block: the same kinds)
    assert kinds == {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "q_norm", "k_norm"} or not norms, kinds
    scalars = [k for k in base if k.endswith("layer_scalar")]   # (Gemma 4's, drawn off 1: as stored)
    assert len(scalars) == 4 * (family == "gemma4") and all(torch.equal(got[k], base[k]) for k in scalars), scalars
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=f"merged {k}")
    merged = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert type(merged).__name__ == cls
    with torch.no_grad():   # (W + s·B A summed once: float32's rounding of logits up to Gemma 4's cap of 5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want_logits, rtol=1e-5,
                                   atol=1e-5 * max(1.0, want_logits.abs().max().item()),
                                   msg="transformers on the merged folder")


@pytest.mark.parametrize("family,emb", [("tied", False), ("untied", True), ("gemma4", False)],
                         ids=["train_norms", "norms_embedding", "gemma4_softcap_train_norms"])
def test_dpo_with_trained_norms_equals_the_formula_on_transformers(ckpts, family, emb):
    """parallel.preference.DPO on a packed micro-batch of two pairs, the policy with --train-norms (and on an untied
    Gemma --train-embeddings: the reference's embedding is the base's, scaled as the policy's), its norms and embedding
    moved off the base's, LoRA B != 0: the losses = the DPO formula on log_softmax of peft's model holding our tensors
    (the policy) and of transformers' base model (the reference), each sequence alone; every trained gradient =
    peft's. The policy's per-token log-probs (DPO's per_token path) = transformers' log_softmax, Gemma 4's of its
    soft-capped logits."""
    from data.collate import collate
    from parallel.cp import KernelAttention
    from parallel.preference import DPO, Preference
    from tests.test_dpo import _formula, _pair
    from tests.test_norms import _ours, _peft_twin

    path = ckpts[family]
    model, _ = _ours(path, emb=emb)
    model.attention = KernelAttention()
    ref_model, mine, theirs = _peft_twin(path, "none", model)
    assert sum("norm" in k for k in mine) == FAMILY[family][1] and ("model.embed_tokens.weight" in mine) == emb, \
        sorted(mine)
    g = torch.Generator().manual_seed(3)
    made = [_pair(g, 19, 13, 6), _pair(g, 9, 22, 4)]
    b = collate([m[0] for m in made], True, 1, 0, sides=True)
    pref = Preference(beta=0.7)
    losses, _ = DPO(model, pref, base=path)(b["input_ids"], b["position_ids"], b["labels"], b["sides"], len(made),
                                            [0, 1])
    (losses.sum() / len(made)).backward()
    base = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref_model.train()

    def logp(m, ids, lab):
        z = m(input_ids=ids[None]).logits[0].log_softmax(-1)
        keep = lab != -100
        return z[keep].gather(1, lab[keep, None]).sum()

    want = []
    for _, seqs, labels in made:
        with torch.no_grad():
            ref = [logp(base, s, lab) for s, lab in zip(seqs, labels)]
        pol = [logp(ref_model, s, lab) for s, lab in zip(seqs, labels)]
        want.append(_formula(pref, pol, ref, [(lab != -100).sum() for lab in labels]))
    want = torch.stack(want)
    (want.sum() / len(made)).backward()
    torch.testing.assert_close(losses.detach().float(), want.detach(), rtol=1e-5, atol=1e-6, msg="losses")
    with torch.no_grad():   # each target's -log p on the packed row (the sequences in order) = transformers' alone
        per, _ = model(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"], per_token=True)
        mine_lp = -per[b["labels"].reshape(-1) != -100]
        theirs_lp = torch.cat([ref_model(input_ids=s[None]).logits[0].log_softmax(-1)[lab != -100].gather(
            1, lab[lab != -100, None])[:, 0] for _, seqs, labels in made for s, lab in zip(seqs, labels)])
    torch.testing.assert_close(mine_lp.float(), theirs_lp, rtol=1e-5, atol=1e-5, msg="per-token log-probs")
    assert bool((want.detach() - torch.log(torch.tensor(2.0))).abs().min() > 1e-3), "the policy is the reference"
    for k in mine:
        rel = ((mine[k].grad - theirs[k].grad).norm() / theirs[k].grad.norm()).item()
        assert theirs[k].grad.norm() > 0 and rel < 1e-4, f"grad {k}: relative difference {rel:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,tiled", [("tied", False), ("gemma4", True)],
                         ids=["train_norms", "gemma4_tiled_mlp_and_attn_train_norms"])
def test_compile_equals_eager(ckpts, family, tiled):
    """--compile (parallel/compile.py: GemmaRMSNorm, GeGLU and RoPE compiled; Gemma 4's weightless v_norm, of each
    head of either size, too), nf4 with AC, --train-norms: the loss (Gemma 4's soft-capped) and every gradient = the
    eager build's; Gemma 3 calls the compiled pieces from its blocks, Gemma 4 (the same GemmaRMSNorm and GeGLU classes)
    with the tiled MLP and attention from the tiles. (Two variants: each compile costs seconds; frozen norms compile
    the same pieces, tests/test_compile.py's Qwen rows.)"""
    from model.gemma import GeGLU, GemmaRMSNorm, UnitRMSNorm
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b, step_of

    path, (_, norms, lora, compiled) = ckpts[family], FAMILY[family]
    opts = dict(quant="nf4", lora_r=4, lora_alpha=8, seed=3, ac=True, train_norms=True)
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))
    ref = step_of(build_nonzero_b(BuildOptions(path, **opts))[0], ids)
    model, _ = build_nonzero_b(BuildOptions(path, compile=True, tiled_mlp=tiled, tiled_attn=tiled, **opts))
    pieces = [m for m in model.modules() if isinstance(m, (GemmaRMSNorm, UnitRMSNorm, GeGLU))]
    forwards = [getattr(m.forward, "norm_forward", m.forward) for m in pieces]   # (block norms: apply_norm_rebuild)
    assert len(pieces) == compiled and all(
        hasattr(getattr(f, "compiled", f), "_torchdynamo_orig_callable") for f in forwards), forwards
    loss, grads = step_of(model, ids)
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-6, msg="loss")
    assert grads.keys() == ref[1].keys() and len(grads) == lora * 2 + norms, len(grads)
    for k in grads:
        torch.testing.assert_close(grads[k], ref[1][k], rtol=1e-4, atol=1e-6, msg=f"grad {k}")


@pytest.mark.parametrize("family", ["tied", "gemma4"], ids=["gemma3", "gemma4_softcap"])
def test_bf16_logits_are_transformers_bf16_and_no_farther_from_float64(ckpts, family):
    """bf16 weights, no mixed precision: our logits within bf16's rounding of transformers' bf16 model, and no farther
    from the float64 model's logits (the same bf16 weights in float64) than transformers' own in the mean over 24 rows
    of 64 tokens at positions up to 3000 (one row's mean moves either way by a few percent: both round the same formula
    in bf16). Gemma 3: within a few ulps of the largest logit. Gemma 4 (soft-capped at 5): its 4 layers carry the two
    bf16 roundings as far apart as either lies from float64 (transformers' own block outputs 1% off float64's at layer
    0, 6% at layer 3; ours 1% and 6%), so the mean difference within twice transformers' error."""
    import model

    path = ckpts[family]
    ids = torch.randint(0, 128, (24, 64), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64).expand(24, 64) + torch.tensor([0, 100, 700, 3000] * 6)[:, None]
    hf = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    exact = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).double().eval()
    ours = model.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert ours.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        x = exact(input_ids=ids, position_ids=pos).logits
        theirs, got = hf(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos)
    assert got.dtype == torch.bfloat16
    err, ref_err = (got.double() - x).abs().mean().item(), (theirs.double() - x).abs().mean().item()
    if family == "gemma4":
        assert x.abs().max() > 4.9, "the cap does not act"   # (transformers' float64 logits reach c = 5)
        apart = (got.double() - theirs.double()).abs().mean().item()
        assert apart < 2 * ref_err, (apart, ref_err)
    else:
        torch.testing.assert_close(got.float(), theirs.float(), rtol=0, atol=8 * 2 ** -8 * x.abs().max().item(),
                                   msg="ours vs transformers' bf16")   # (a few ulps of the largest logit)
    assert err <= ref_err, (err, ref_err)


# ----------------------------------------------------------------------------- Gemma 4: eval under the cap


@pytest.mark.timeout(300)
def test_gemma4_eval_loss_and_accuracy_are_transformers_on_the_capped_logits(assets, tmp_path):
    """The last step's eval (after its update: the saved adapter) of a Gemma 4 --train-norms run, --eval-positions 56
    (each target's loss and hit: the loss' per-token path), final_logit_softcapping 0.3 over logits of std ~4 (the
    embedding × 30): those past ~2.7 are exactly 0.3 in float32. eval_loss, eval_token_acc and each bucket's =
    transformers' Gemma4ForCausalLM with peft's load of the adapter: the mean F.cross_entropy of its capped logits over
    every held-out target, and the share whose capped logit is its row's largest (a tie counts: eval_token_acc's rule).
    Saturated ties are most of the hits (argmax, or hits on uncapped logits, would count none)."""
    from peft import PeftModel

    import train
    from data.load import load_samples
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    tok = make_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    cfg = {**G4, "vocab_size": len(tok), "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 0,
           "bos_token_id": None, "final_logit_softcapping": 0.3}
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg)).float()
    _perturb(hf)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(30)
    hf.save_pretrained(tmp_path / "model")
    make_chat_jsonl(tmp_path / "eval.jsonl", 6, seed=9)
    out = str(tmp_path / "run")
    with one_thread():
        train.main(train_argv({**assets, "model": str(tmp_path / "model")}, out, "--steps", "2", "--global-batch", "4",
                              "--train-norms", "--eval-every", "1",
                              "--eval-data", str(tmp_path / "eval.jsonl"), "--eval-positions", "56"))
    last = _metrics(out)[-1]
    samples, _ = load_samples(str(tmp_path / "eval.jsonl"), tok, 64, len(tok), flag="--eval-data")
    peft = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"),
                                                                            dtype=torch.float32), out + "/adapter")
    sums = torch.zeros(2, 4, dtype=torch.float64)   # per bucket (position < 56, >= 56): loss, targets, hits, argmaxes
    o = samples.offsets
    with torch.no_grad():
        for i in range(len(o) - 1):
            ids, lab = samples.ids[o[i]:o[i + 1]].long(), samples.labels[o[i]:o[i + 1]].long()
            z = peft.eval()(input_ids=ids[None]).logits[0]
            keep = lab != -100
            z, lab, at = z[keep], lab[keep], (torch.arange(len(keep)) + 1)[keep] >= 56   # (a target's position: +1)
            top = z.gather(1, lab[:, None])[:, 0] == z.max(-1).values
            row = torch.stack([F.cross_entropy(z, lab, reduction="none").double(), torch.ones_like(top).double(),
                               top.double(), (z.argmax(-1) == lab).double()], 1)
            sums.index_add_(0, at.long(), row)
    tot = sums.sum(0)
    assert tot[1] > 20 and tot[2] > 5 * tot[3] and tot[2] > 0.1 * tot[1], sums   # (the saturated ties count)
    assert abs(last["eval_loss"] - tot[0] / tot[1]) < 1e-5, (last, sums)
    assert abs(last["eval_token_acc"] - tot[2] / tot[1]) < 1e-6, (last, sums)
    for span, s in zip(("0-55", "56+"), sums):
        assert s[1] > 0 and abs(last[f"eval_token_acc@{span}"] - s[2] / s[1]) < 1e-6, (span, last, sums)
        assert abs(last[f"eval_loss@{span}"] - s[0] / s[1]) < 1e-5, (span, last, sums)
