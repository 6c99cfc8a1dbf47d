"""Qwen3-MoE (model/moe.py) through the rest of the trainer: train.py end to end, FSDP2 with experts no token reaches,
DPO, a bitsandbytes 4-bit upload (the decoder itself: tests/test_qwen3_moe.py).

Pins (CPU, gloo; one tiny random Qwen3MoeForCausalLM saved by transformers 5 with the fixture tokenizer: 4 experts, top
2, norm_topk_prob, 3 blocks of which block 1 is dense through mlp_only_layers; routers drawn large so the top 2 are
decided, norms off 1, embeddings and head × 30; LoRA on the attention, --lora-targets attn):
- train.py, 2 steps of --global-batch 4 (`SHORT`: nothing resumes): 1 rank = cp2 × dp_shard2 ring (packed, --micro-batch
  2: one micro-batch a step) = Ulysses (two, accumulated), both with --tiled-mlp --offload-activations, nf4: every
  step's loss and grad norm and the adapter (test_train's tolerances);
- FSDP2 over 4 ranks (each block sharded with its experts' NF4 codes, --train-norms, AC) where one rank's micro-batch
  routes no token to half the experts of each MoE block and the others' reach all: no collective hangs, and the grad
  norm and every trained gradient = one process on the four micro-batches;
- DPO (the reference: adapters off, routing with the base) on a packed micro-batch of two pairs = the DPO formula on
  log_softmax of peft's Qwen3MoeForCausalLM holding our LoRA (the policy) and transformers' base model, losses and
  every LoRA gradient;
- a -bnb-4bit save of the model (transformers 5 + bitsandbytes: the attention and the dense MLP 4-bit, the experts,
  fused 3-D parameters in transformers, left in float and written split): --quant none builds every weight as
  bitsandbytes' dequantize_4bit of the stored codes, the experts and routers as stored; the start-up note under nf4
  counts the float expert projections it quantizes and not the routers, which stay in the compute dtype;
- no --lora-targets: trains as --lora-targets attn (3 steps of --global-batch 4; said once, recorded, resumed from
  step 2 with and without the flag), the adapter in peft on transformers' model;
- --plan with --tiled-mlp and nf4: the tiled MLP phase's dequantized weights = the bytes model.nf4.dequant_once holds
  at most in a real forward and backward (the MoE block's 4 experts of 64, not 4 times the dense block's 128).

Run: .venv/bin/python -m pytest -q tests/test_qwen3_moe_run.py
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import transformers as T

from tests.dist import run_ranks
from tests.helpers import one_thread, train_argv
from tests.test_train import _compare

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
CONFIG = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=4096, rope_theta=3e4, bos_token_id=None)
SHORT = ["--steps", "2", "--global-batch", "4"]   # the runs of `runs`
MEM = ["--tiled-mlp", "--offload-activations", "--quant", "nf4", "--lora-targets", "attn"]
FOUR = {"ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *MEM],
        "ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *MEM]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("moe_run"))


def make_assets(d) -> dict:
    """The checkpoint (module docstring; the dense MLP twice an expert's width; widths whole 64-blocks: bitsandbytes
    0.50's CPU dequantize_4bit takes the wrong block scales on rows that are not, tests/test_prequant.py) beside the
    fixture tokenizer and chat data, in folder `d`: {"data": path, "model": path}."""
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    out = {"data": str(d / "chat.jsonl"), "model": str(d / "moe")}
    make_chat_jsonl(out["data"], 40, seed=1)
    tok = make_tokenizer(d / "moe")
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.Qwen3MoeConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                                             eos_token_id=tok.eos_token_id, **CONFIG)).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:   # transformers starts them at 1: a dropped one would hide
                p.add_(torch.randn_like(p) * 0.3)
            elif "embed" in n or "lm_head" in n:   # logits far from uniform
                p.mul_(30)
            elif n.endswith("mlp.gate.weight"):   # (std 0.02 routes by a hair)
                p.normal_(0, 0.5)
    hf.save_pretrained(d / "moe")
    return out


def _labels(ids):
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)


def _micro_batches():
    """Four ranks' micro-batches: rank 0's one token twice (one target; the second position attends to two equal values,
    v is not rotated: both tokens' hidden states and so routes are equal, 2 of each MoE block's 4 experts hit)."""
    g = torch.Generator().manual_seed(11)
    return [torch.tensor([[7, 7]])] + [torch.randint(0, 400, (1, n), generator=g) for n in (29, 17, 23)]


def _hit(model, ids) -> list[set]:
    """Each MoE block's experts that `ids` reach."""
    from model.moe import MoE

    hit = []
    record = lambda m, i, o: hit.append(set(m.route(i[0].flatten(0, -2))[1].flatten().tolist()))
    hooks = [b.mlp.register_forward_hook(record) for b in model.model.layers if isinstance(b.mlp, MoE)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return hit


def _four_ranks(rank, world_size, assets, root):
    """train.py's two layouts (module docstring), then FSDP2 over the 4 ranks with rank 0's micro-batch missing experts:
    (the experts each rank's micro-batch hit, the number of trained gradients compared)."""
    import train
    from parallel.fsdp import clip_grad_norm_
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, lora_parameters
    from tests.helpers import build_nonzero_b

    for layout, flags in FOUR.items():
        train.main(train_argv(assets, os.path.join(root, layout), *SHORT, *flags))
    cfg = BuildOptions(assets["model"], quant="nf4", lora_r=4, lora_alpha=8, ac=True, seed=3, lora_targets=ATTN,
                       train_norms=True)
    mbs = _micro_batches()
    n = sum(b.shape[1] - 1 for b in mbs)
    ref, _ = build_nonzero_b(cfg)
    hit = _hit(ref, mbs[rank])
    for b in mbs:
        s, _ = ref(b, labels=_labels(b))
        (s / n).backward()
    ref_norm = clip_grad_norm_(lora_parameters(ref), 1e9)
    ours, _ = build_nonzero_b(cfg, fsdp_mesh=ParallelDims(world_size).build_mesh("cpu").fsdp)
    s, _ = ours(mbs[rank], labels=_labels(mbs[rank]))
    (s / n).backward()
    torch.testing.assert_close(clip_grad_norm_(lora_parameters(ours), 1e9), ref_norm, msg="grad norm")
    want = dict(ref.named_parameters())
    trained = [(k, p) for k, p in ours.named_parameters() if p.requires_grad]
    for k, p in trained:
        torch.testing.assert_close(p.grad.full_tensor(), want[k].grad, rtol=1e-5, atol=1e-6, msg=f"grad {k}")
    return hit, len(trained)


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The 1-rank run here, the 4-rank ones and the FSDP2 check in one spawn: (root, each rank's result). One test
    reads them (one xdist worker runs it)."""
    import train

    root = str(tmp_path_factory.mktemp("moe_runs"))
    with one_thread():
        train.main(train_argv(assets, os.path.join(root, "plain"), *SHORT, "--quant", "nf4", "--lora-targets", "attn"))
    return root, run_ranks(_four_ranks, 4, assets, root, timeout=400, pg_timeout=60)


@pytest.mark.timeout(600)
def test_four_ranks_train_as_one_rank_and_experts_one_rank_never_reaches(runs):
    """train.py's two 4-rank layouts = 1 rank; the FSDP2 comparisons ran on the ranks (a mismatch raised there, a hang
    timed out): rank 0's micro-batch missed experts in both MoE blocks, every other rank's reached all four; 3 blocks'
    LoRA and norms and the final norm trained."""
    root, results = runs
    for layout in FOUR:
        _compare(layout, os.path.join(root, layout), os.path.join(root, "plain"), steps=(1, 2))
    hits = [h for h, _ in results]
    assert all(len(e) < 4 for e in hits[0]) and all(e == {0, 1, 2, 3} for h in hits[1:] for e in h), hits
    assert [k for _, k in results] == [3 * (2 * 4 + 4) + 1] * 4, results


@pytest.fixture(scope="module")
def bnb_upload(assets, tmp_path_factory):
    from tests.helpers import bnb_checkpoint

    return bnb_checkpoint(assets["model"], tmp_path_factory.mktemp("moe_bnb") / "dq", bnb_4bit_quant_type="nf4",
                          bnb_4bit_use_double_quant=True)


def test_bnb_4bit_upload_reads_as_bitsandbytes_dequantizes_it(bnb_upload):
    """transformers 5 + bitsandbytes quantize the attention and the dense block's MLP (Linear4bit), not the experts
    (fused 3-D parameters) nor the routers; save_pretrained writes the experts split, in float. --quant none builds
    every weight as bitsandbytes' dequantize_4bit of the codes transformers holds, or the stored float tensor; the
    nf4 start-up note counts the 24 expert projections it quantizes, not the 2 routers (which stay float Linears)."""
    import copy

    from bitsandbytes.functional import dequantize_4bit
    from safetensors.torch import load_file

    from model.load import read_args
    from model.load_checks import check_config_shapes
    from parallel.parallelize import BuildOptions, build_model

    stored = {k: v for f in glob.glob(os.path.join(bnb_upload, "*.safetensors")) for k, v in load_file(f).items()}
    want = {k: v for k, v in stored.items() if k.endswith("weight") and v.is_floating_point()}
    assert len([k for k in want if ".experts." in k]) == 2 * 4 * 3
    hf = T.AutoModelForCausalLM.from_pretrained(bnb_upload, device_map="cpu", dtype=torch.float32)
    for n, m in hf.named_modules():
        if hasattr(getattr(m, "weight", None), "quant_state"):
            st = copy.copy(m.weight.quant_state)
            st.dtype = torch.float32
            want[f"{n}.weight"] = dequantize_4bit(m.weight.data, st)
    assert sorted(want) == sorted(k for k in stored if k.endswith(".weight")), "every weight: stored or dequantized"
    ours, _ = build_model(BuildOptions(bnb_upload, quant="none", lora_targets=ATTN, ac=False), device="cpu")
    got = {k.replace(".base_layer", ""): v for k, v in ours.state_dict().items() if "lora_" not in k}
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    note = check_config_shapes(bnb_upload, read_args(bnb_upload), "nf4")
    assert "24 block projections stored unquantized (model.layers.0.mlp.experts." in note, note
    assert "mlp.gate." not in note, note


def _hf(path):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")


def test_dpo_equals_the_formula_on_transformers(assets):
    """parallel.preference.DPO on a packed micro-batch of two pairs, LoRA B != 0 on the attention: the losses = the DPO
    formula on log_softmax of peft's Qwen3MoeForCausalLM holding our LoRA (the policy) and of transformers' base model
    (the reference: routing with the base's hidden states), each sequence alone; every LoRA gradient = peft's; with B
    = 0 (step 0) every loss is log 2."""
    import math

    from peft import LoraConfig, get_peft_model

    from data.collate import collate
    from parallel.cp import KernelAttention
    from parallel.parallelize import BuildOptions
    from parallel.preference import DPO, Preference
    from tests.helpers import build_nonzero_b
    from tests.test_dpo import _formula, _pair

    path = assets["model"]
    g = torch.Generator().manual_seed(3)
    made = [_pair(g, 19, 13, 6), _pair(g, 9, 22, 4)]
    b = collate([m[0] for m in made], True, 1, 0, sides=True)
    pref = Preference(beta=0.7)
    for b_std in (0.0, 0.2):
        model, peft_model = build_nonzero_b(BuildOptions(path, quant="none", lora_r=4, lora_alpha=8, seed=3, ac=False,
                                                         lora_targets=ATTN), b_std=b_std)
        model.attention = KernelAttention()
        losses, _ = DPO(model, pref, base=path)(b["input_ids"], b["position_ids"], b["labels"], b["sides"], len(made),
                                                [0, 1])
        if not b_std:
            torch.testing.assert_close(losses.detach().float(), torch.full((2,), math.log(2)), msg="step 0: log 2")
    (losses.sum() / len(made)).backward()
    mine = {k: p for k, p in peft_model.named_parameters() if p.requires_grad}
    ref_model = get_peft_model(_hf(path), LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTN), lora_dropout=0.0,
                                                     init_lora_weights=False))
    assert not ref_model.load_state_dict({k: p.detach() for k, p in mine.items()}, strict=False).unexpected_keys
    theirs = {k: p for k, p in ref_model.named_parameters() if p.requires_grad}
    base = _hf(path).eval()
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
    assert bool((want.detach() - math.log(2)).abs().min() > 1e-3), "the policy is the reference"
    assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 4 * 3
    for k in mine:
        rel = ((mine[k].grad - theirs[k].grad).norm() / theirs[k].grad.norm()).item()
        assert theirs[k].grad.norm() > 0 and rel < 1e-4, f"grad {k}: relative difference {rel:.2e}"


def test_planned_tiled_mlp_dequantized_weights_are_what_dequant_once_holds(assets, monkeypatch):
    """--tiled-mlp with nf4 dequantizes a block's MLP weights once for all its tiles (model.nf4.dequant_once): the
    plan's tiled MLP phase holds, beyond --quant none's, the most bytes that cache held in a forward and backward of
    the model (every expert of an MoE block, E·3·I·D, here above the dense block's 3·F·D; it planned E·3·F·D)."""
    import model.nf4 as nf4
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    most, leave = [0], nf4.dequant_once.__exit__

    def exit_(self, *exc):
        most[0] = max(most[0], sum(w.untyped_storage().nbytes() for w in nf4._once.weights.values()))
        return leave(self, *exc)

    monkeypatch.setattr(nf4.dequant_once, "__exit__", exit_)
    ours, _ = build_model(BuildOptions(assets["model"], quant="nf4", ac=False, tiled_mlp=True, lora_targets=ATTN),
                          device="cpu")
    ids = torch.randint(0, 400, (1, 128), generator=torch.Generator().manual_seed(2))
    assert all(len(e) == 4 for e in _hit(ours, ids)), "every expert reached"
    s, n = ours(ids, labels=_labels(ids))
    (s / n).backward()
    phase = {}
    for quant in ("nf4", "none"):
        args = train.build_parser().parse_args(["--model", assets["model"], "--max-len", "128", "--global-batch", "1",
                                                "--quant", quant, "--dtype", "fp32", "--no-ac", "--tiled-mlp",
                                                "--lora-targets", "attn"])
        dims, pack = validate(args, ours.args, 1)
        phase[quant] = next(v for k, v in memory_plan(ours.args, dims, args, "cpu", pack).terms.items()
                            if k.startswith("| block backward at the tiled MLP"))
    assert most[0] == 4 * 3 * 64 * 64 * 4, most   # (fp32)
    assert phase["nf4"] - phase["none"] == most[0], (phase, most)


def test_default_targets_train_the_attention(assets, tmp_path, capsys):
    """No --lora-targets on this model (its MLP names are the experts'): the run trains the attention's four, said once
    at start-up, as --lora-targets attn does (every step's loss and grad norm and the adapter: test_train's tolerances,
    3 steps of --global-batch 4); config.json and the checkpoint record the four; resumed after step 2, without the flag
    and with attn, = the uninterrupted run's step 3; the adapter's target_modules are the four, and peft loads it on
    transformers' Qwen3MoeForCausalLM: LoRA on each block's q/k/v/o and nothing else, every tensor as saved."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    import train
    from parallel import checkpoint_folders

    flags = ["--steps", "3", "--global-batch", "4", "--save-every", "2"]
    out = {k: str(tmp_path / k) for k in ("run", "attn", "res", "res2")}
    step2 = os.path.join(out["run"], "ckpt", "step_000002")
    with one_thread():
        train.main(train_argv(assets, out["run"], *flags))
        said = [ln for ln in capsys.readouterr().out.splitlines() if "--lora-targets" in ln]
        train.main(train_argv(assets, out["attn"], *flags, "--lora-targets", "attn"))
        train.main(train_argv(assets, out["res"], *flags, "--resume", step2))
        train.main(train_argv(assets, out["res2"], *flags, "--resume", step2, "--lora-targets", "attn"))
    assert len(said) == 1 and said[0].startswith("--lora-targets not given: LoRA on q_proj,k_proj,v_proj,o_proj, "
                                                 "this qwen3_moe model's default"), said
    _compare("default = attn", out["run"], out["attn"], steps=(1, 2, 3))
    for res in ("res", "res2"):
        _compare(f"{res} = the run", out[res], out["run"], steps=(3,))
    with open(os.path.join(out["run"], "config.json")) as f:
        assert json.load(f)["lora_targets"] == ",".join(ATTN)
    assert checkpoint_folders.read_meta(step2)["args"]["lora_targets"] == ",".join(ATTN)
    adapter = os.path.join(out["run"], "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(ATTN)
    pm = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32),
                                   adapter)
    got = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    assert {n.split(".lora_")[0].split("layers.")[1] for n in got} == {f"{i}.self_attn.{t}" for i in range(3)
                                                                       for t in ATTN}, sorted(got)
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(saved) == len(got) == 3 * 4 * 2
    for k, v in saved.items():
        torch.testing.assert_close(got[k.replace(".weight", ".default.weight")], v, rtol=0, atol=0, msg=k)
