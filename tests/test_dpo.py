"""`--objective dpo`: preference pairs, the DPO loss against references nobody here wrote, every layout = 1 process.

Pins:
- the chunked loss with `per_token=True` = `F.cross_entropy(reduction="none")`, values and the hidden gradient
  under a different factor per row; refused with a `loss_fn` or a trainable head;
- a packed micro-batch of pairs through `parallel.preference.DPO` (the base with LoRA off as the reference, with
  and without AC + the tiled MLP; and another adapter as the reference) = the DPO formula on transformers' Qwen2 +
  peft's LoRA, each sequence alone, log-probabilities from `log_softmax`, the reference from peft's own
  `disable_adapter()` or a second peft model holding the reference adapter: the losses and every LoRA gradient;
  so too label-smoothed DPO, IPO + RPO (also with the adapter reference), hinge, SimPO and ORPO against each
  paper's formula (`_formula`), and on train.py IPO + RPO (cp 2 × dp 2 ring) and SimPO (cp 2 × dp 2 Ulysses), 2 pairs
  a micro-batch, and ORPO (cp 4 ring, 4 pairs a micro-batch) 4 ranks = 1 rank;
- a pair record's two sides are the samples its sides give as records of their own (prompt/completion, chat,
  text), side by side, but for a long prompt, cut once for both (the longer side's count); a pair with a side left
  without a target is dropped whole and counted once, one whose sides are the same tokens as tied; a token merging
  the prompt's end with one answer's start makes both sides' targets start there (TRL's prompt_len); `collate`
  restarts positions at the split and marks the sides;
- train.py (runs of 2 steps against 1-rank runs of 2, where nothing resumes from them and their reference is not
  resumed from: step 2 already runs after an update; the others 3): 1 rank = 4 ranks (cp 2 × dp 2 Ulysses, 1 pair a
  micro-batch; dp 4 unpacked, cp 4 ring with --micro-batch auto, the tiled MLP and offload; an eval of the first 5
  pairs each step) in losses, grad norms, reward accuracy and margin, eval loss and eval reward accuracy, adapter; two
  files with --data-weights 1 0.5 and --eval-split 2 (rotating shares of pairs, whole pairs held out) on cp 2 × dp 2
  ring with 2 pairs a micro-batch likewise (that layout's plain run: this one, the same flags on other data); on 1 rank,
  --ac-keep-attn (2 pairs a micro-batch) and --ac-group 2 with --tiled-attn and the tiled MLP, --tiled-attn with offload
  and --ac-blocks 1 train as the plain run; a resume from step 2 (of 3) = the uninterrupted step 3; step 1's loss is
  log 2 (the policy is the reference);
- DPO from --init-adapter (an adapter that prefers the chosen sides): that adapter is the reference, so step 1 is
  log 2 (fp32; bf16 without mixed precision, 4-bit and plain layers) and the eval loss falls; 4 ranks (cp 2 × dp 2 ring,
  2 pairs a micro-batch, tiled MLP, offload) = 1 rank; a resume = the uninterrupted step 3, refused without the
  adapter, with other bytes, or with one for a run whose reference was the base; config.json's dpo_reference; the
  plan adds the adapter;
- start-up refusals name the fix: pairs without --objective dpo, other records with it, a missing adapter, LOSS_FN,
  --dpo-beta 0, DPO's flags without it, label smoothing out of range or beside another loss, a negative RPO alpha
  (or any beside ORPO),
  --simpo-gamma without SimPO, the demo; the planner plans a pair as two sequences of --max-len.

Run: .venv/bin/python -m pytest -q tests/test_dpo.py
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.fixtures import make_pairs_jsonl
from tests.helpers import build_nonzero_b, one_thread, startup_error, tiny_checkpoint, train_argv
from tests.test_train import _adapter, _compare, _metrics

DPO = ["--objective", "dpo", "--dpo-beta", "0.5"]
# Runs nothing resumes from stop after step 2 (which already runs after an optimizer update: a 3rd step repeats its
# code), against 1-rank runs of 2 steps too (dpo_2 for the plain run)
TWO = ["--steps", "2"]
# (cp 2 × dp 2 ring with 2 pairs a micro-batch: the files run below, dpo_files_cp2_dp2_ring, checked for the same
# metrics: test_weighted_files_and_a_held_out_split_of_pairs_on_four_ranks_match_one_rank)
FOUR = {"dpo_cp2_dp2_ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--eval-every", "1", *TWO],
        "dpo_dp4_no_pack_mb2": ["--dp-shard", "4", "--no-pack", "--micro-batch", "2", "--eval-every", "1", *TWO],
        "dpo_cp4_ring_mb_auto": ["--cp", "4", "--cp-impl", "ring", "--micro-batch", "auto", "--eval-every", "1",
                                 "--tiled-mlp", "--offload-activations", *TWO]}
# The adapter after 3 AdamW steps within 5e-3 of the 1-rank one's (relative norm; losses and grad norms as tightly as
# test_train's): DPO's chosen and rejected push a shared prompt's activations in opposite directions, so a few LoRA
# gradient elements are near-cancelling sums, a few times AdamW's eps after clipping, whose float noise (their sums'
# order differs by layout) moves their update by ~1% (layer 0's gate_proj B here: 7e-4 of its norm)
ADAPTER_RTOL = 5e-3
FILES = ["--data-weights", "1", "0.5", "--eval-split", "2", "--eval-every", "1", *TWO]
# memory flags on 1 rank (the reference's no_grad forward beside AC's caches and recomputes): as the plain run
ONE = {"dpo_keep_attn_mb2": ["--ac-keep-attn", "--micro-batch", "2", *TWO],
       "dpo_group_tiled_attn": ["--ac-group", "2", "--tiled-attn", "--tiled-mlp", *TWO],
       "dpo_tiled_attn_offload": ["--tiled-attn", "--offload-activations", "--ac-blocks", "1", *TWO]}


# DPO after SFT: from an adapter (the first run's, trained on these pairs: it prefers their chosen sides), which is
# the reference too
FROM = lambda root: ["--init-adapter", os.path.join(root, "dpo", "adapter"), "--eval-every", "1"]


# other losses: 1 rank, then the layout on 4 (IPO + RPO average over each sequence's targets: counts over the cp group),
# 2 steps each, 2 or more micro-batches a step on each data rank of 4 (1 pair a micro-batch: the plain DPO Ulysses run)
LOSSES = {"dpo_ipo_rpo": (["--dpo-loss", "ipo", "--rpo-alpha", "0.5", "--eval-every", "1", *TWO],
                          ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2"]),
          "dpo_simpo": (["--dpo-loss", "simpo", "--dpo-beta", "2", "--simpo-gamma", "0.3", "--eval-every", "1", *TWO],
                        ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--micro-batch", "2"]),
          "dpo_orpo": (["--dpo-loss", "orpo", "--dpo-beta", "0.25", "--eval-every", "1", *TWO],
                       ["--cp", "4", "--cp-impl", "ring", "--micro-batch", "4"])}
# --dpo-share-prompt (each pair's prompt once, the rejected answer a branch): 1 rank and these layouts = the plain run
SHARED = {"dpo_shared": ["--dpo-share-prompt", "--eval-every", "1", *TWO],
          "dpo_shared_tiled_attn_offload": ["--dpo-share-prompt", "--eval-every", "1", "--tiled-attn", "--tiled-mlp",
                                            "--offload-activations", *TWO],
          "dpo_shared_keep_attn_mb2": ["--dpo-share-prompt", "--eval-every", "1", "--ac-keep-attn", "--micro-batch",
                                       "2", *TWO]}
# (shared prompts on Ulysses, with the tiled MLP and offload: the dpo_from_cached_cp2_dp2_ulysses_shared run below)
SHARED_FOUR = {"dpo_shared_cp2_dp2_ring_mb2": ["--dpo-share-prompt", "--eval-every", "1", "--cp", "2", "--dp-shard",
                                               "2", "--cp-impl", "ring", "--micro-batch", "2", *TWO],
               "dpo_shared_cp4_hybrid_auto": ["--dpo-share-prompt", "--eval-every", "1", "--cp", "4", "--cp-impl",
                                              "hybrid", "--ulysses-degree", "2", "--micro-batch", "auto", *TWO]}

# --dpo-cache-ref (each pair's reference log-probabilities kept from its first forward, read once every pair of a step
# or eval is known): on the first file's pairs, 3 steps of 8 are two epochs (the third step reads), = the plain run on
# 1 rank and cp 2 × dp 2 ring with 2 pairs a micro-batch; from an adapter (its reference) on Ulysses with shared
# prompts, the tiled MLP and offload, 2 pairs a micro-batch (one epoch: the evals after the first read) = that plain
# run, on fewer tokens
CACHED = ["--dpo-cache-ref", "--eval-every", "1"]
EPOCHS = lambda a: ["--data", a["parts"][0], "--eval-every", "1"]
CACHED_FOUR = {"dpo_a_cached_cp2_dp2_ring_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring",
                                                 "--micro-batch", "2"],
               "dpo_from_cached_cp2_dp2_ulysses_shared": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses",
                                                          "--dpo-share-prompt", "--micro-batch", "2", "--tiled-mlp",
                                                          "--offload-activations"]}


@pytest.fixture(scope="module")
def pairs(assets):
    d = assets["dir"]
    path = os.path.join(d, "pairs.jsonl")
    recs = make_pairs_jsonl(path, 30, seed=7)
    parts = [os.path.join(d, "pairs_a.jsonl"), os.path.join(d, "pairs_b.jsonl"), os.path.join(d, "pairs_eval.jsonl")]
    for p, rs in zip(parts, (recs[:12], recs[12:], recs[:EVAL_PAIRS])):
        with open(p, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    return {**assets, "data": path, "parts": parts[:2], "eval": parts[2]}


# the eval pairs: the first EVAL_PAIRS of the 30 (an evaluation of all 30 every step was ~60% of a run's time; of 10,
# ~45% of a 4-rank run's forwards). 5: a multiple of neither 2 nor 4 data ranks, 4 of them with
# a prompt (test_demo_compare_prompts_with_the_pairs' --n 4); after 3 steps their loss is ~0.07 below log 2
EVAL_PAIRS = 5


def _argv(a, out, *extra):
    return train_argv(a, out, *DPO, "--eval-data", a["eval"], *extra) if "--eval-split" not in extra else \
        train_argv(a, out, *DPO, *extra)


def _four(rank, world_size, a, root):
    import train

    for name, flags in FOUR.items():
        train.main(_argv(a, os.path.join(root, name), *flags))
    train.main(_argv(a, os.path.join(root, "dpo_files_cp2_dp2_ring"), "--cp", "2", "--dp-shard", "2", "--cp-impl",
                     "ring", "--micro-batch", "2", *FILES, "--data", *a["parts"]))
    train.main(_argv(a, os.path.join(root, "dpo_from_cp2_dp2_ring"), "--cp", "2", "--dp-shard", "2", "--cp-impl",
                     "ring", "--micro-batch", "2", "--tiled-mlp", "--offload-activations", *FROM(root)))
    for name, (flags, layout) in LOSSES.items():
        train.main(_argv(a, os.path.join(root, name + "_4"), *flags, *layout))
    for name, flags in SHARED_FOUR.items():
        train.main(_argv(a, os.path.join(root, name), *flags))
    for name, flags in CACHED_FOUR.items():
        train.main(_argv(a, os.path.join(root, name), *CACHED, *flags, *(FROM(root) if "from" in name else
                                                                           EPOCHS(a))))


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory):
    import train

    root = str(tmp_path_factory.mktemp("dpo_runs"))
    with one_thread():
        train.main(_argv(pairs, os.path.join(root, "dpo"), "--eval-every", "1", "--save-every", "2"))
        train.main(_argv(pairs, os.path.join(root, "dpo_2"), "--eval-every", "1", *TWO))
        train.main(_argv(pairs, os.path.join(root, "dpo_files"), *FILES, "--data", *pairs["parts"]))
        for name, flags in ONE.items():
            train.main(_argv(pairs, os.path.join(root, name), *flags))
        train.main(_argv(pairs, os.path.join(root, "dpo_resume"), "--eval-every", "1", "--resume",
                         os.path.join(root, "dpo", "ckpt", "step_000002")))
        train.main(_argv(pairs, os.path.join(root, "dpo_from"), *FROM(root), "--save-every", "2"))
        for name, (flags, _) in LOSSES.items():
            train.main(_argv(pairs, os.path.join(root, name), *flags))
        for name, flags in SHARED.items():
            train.main(_argv(pairs, os.path.join(root, name), *flags))
        with _counting_references() as calls:   # (the reference forwards each run made: (training, eval))
            for name, flags in (("dpo_a", []), ("dpo_a_cached", [*CACHED, "--save-every", "2"])):
                train.main(_argv(pairs, os.path.join(root, name), *EPOCHS(pairs), *flags))
                json.dump(calls, open(os.path.join(root, name, "reference_calls.json"), "w"))
                calls[:] = [0, 0]
        train.main(_argv(pairs, os.path.join(root, "dpo_from_resume"), *FROM(root), "--resume",
                         os.path.join(root, "dpo_from", "ckpt", "step_000002")))
    run_ranks(_four, 4, pairs, root, timeout=540, pg_timeout=120)
    return root


@contextlib.contextmanager
def _counting_references():
    """[reference forwards in training, in evaluation] of the in-process runs inside (`DPO.reference` wrapped)."""
    from parallel.preference import DPO as Step

    calls, real = [0, 0], Step.reference

    def counted(self, *a, **k):
        calls[0 if self.model.training else 1] += 1
        return real(self, *a, **k)

    Step.reference = counted
    try:
        yield calls
    finally:
        Step.reference = real


# ----------------------------------------------------------------------------- the loss


def test_per_token_loss_is_cross_entropy_per_row():
    from loss import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 16, generator=g)
    y = torch.randint(0, 50, (37,), generator=g)
    y[::4] = -100
    out, n = chunked_cross_entropy(h, w, y, chunk_size=5, per_token=True)
    want = F.cross_entropy(h @ w.t(), y, reduction="none", ignore_index=-100)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert int(n) == int((y != -100).sum()) and bool((out[::4] == 0).all())
    k = torch.randn(37, generator=g)   # a different factor per row, as DPO's per-sequence weights are
    (gh,) = torch.autograd.grad((out * k).sum(), h)
    h2 = h.detach().requires_grad_()
    (ref,) = torch.autograd.grad((F.cross_entropy(h2 @ w.t(), y, reduction="none", ignore_index=-100) * k).sum(), h2)
    torch.testing.assert_close(gh, ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="fused cross-entropy only"):
        chunked_cross_entropy(h, w.requires_grad_(), y, per_token=True)
    with pytest.raises(ValueError, match="fused cross-entropy only"):
        chunked_cross_entropy(h, w.detach(), y, per_token=True, loss_fn=lambda z, t: z.sum())


def _pair(g, lc, lr, prompt):
    """A pair sample: two sequences sharing a `prompt`-token start, targets after it."""
    share = torch.randint(0, 128, (prompt,), generator=g)
    seqs = [torch.cat([share, torch.randint(0, 128, (n - prompt,), generator=g)]) for n in (lc, lr)]
    labels = [torch.cat([s[1:], torch.tensor([-100])]) for s in seqs]
    for lab in labels:
        lab[:prompt - 1] = -100
    return {"input_ids": torch.cat(seqs), "labels": torch.cat(labels), "split": lc}, seqs, labels


def _formula(pref, pol, ref, n):
    """A pair's loss from its sequences' log-probabilities (chosen, rejected), as each paper writes it."""
    b, (pc, pr), (rc, rr), (nc, nr) = pref.beta, pol, ref, n
    if pref.loss == "simpo":   # Meng et al. 2024, eq. 6
        loss = -F.logsigmoid(b * pc / nc - b * pr / nr - pref.gamma)
    elif pref.loss == "ipo":   # Azar et al. 2023, eq. 17, on the per-token averages (TRL's)
        loss = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * b)) ** 2
    elif pref.loss == "orpo":   # Hong et al. 2024, eq. 6-8: the odds p / (1 - p) of the mean likelihood p, λ = beta
        p_c, p_r = torch.exp(pc / nc), torch.exp(pr / nr)
        loss = -pc / nc - b * F.logsigmoid(torch.log((p_c / (1 - p_c)) / (p_r / (1 - p_r))))
    elif pref.loss == "hinge":   # SLiC-HF, Zhao et al. 2023, on the reference-normalized log-ratio (TRL's)
        loss = torch.clamp(1 - b * ((pc - rc) - (pr - rr)), min=0)
    else:   # DPO, eq. 7; conservative DPO (label smoothing ε)
        z, e = b * ((pc - rc) - (pr - rr)), pref.label_smoothing
        loss = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)
    return loss + pref.rpo_alpha * -pc / nc   # RPO, Pang et al. 2024: the chosen side's NLL over its length


def _rewards(pref, pol, ref, n):
    """A pair's sides' rewards as TRL logs them: beta times the log-ratio to the reference, summed (averaged for IPO,
    whose loss averages), or without a reference beta times the mean log-probability (SimPO's, ORPO's)."""
    if pref.loss in ("simpo", "orpo"):
        return torch.stack([pref.beta * p / k for p, k in zip(pol, n)])
    k = n if pref.loss == "ipo" else (1, 1)
    return torch.stack([pref.beta * (p - r) / m for p, r, m in zip(pol, ref, k)])


VARIANTS = {"sigmoid": dict(), "ipo_rpo": dict(loss="ipo", rpo_alpha=0.5), "ipo": dict(loss="ipo"),
            "hinge": dict(loss="hinge"),
            "smoothed": dict(label_smoothing=0.2), "simpo": dict(loss="simpo", beta=2.0, gamma=0.3),
            "orpo": dict(loss="orpo", beta=0.25)}


@pytest.mark.parametrize("mem,reference,variant,shared,cached", [
    (dict(ac=False), False, "sigmoid", False, False), (dict(ac=True, tiled_mlp=True), False, "sigmoid", False, False),
    (dict(ac=True, tiled_mlp=True), True, "sigmoid", False, False),
    *((dict(ac=False), False, v, False, False) for v in list(VARIANTS)[1:]),
    (dict(ac=False), True, "ipo_rpo", False, False),
    (dict(ac=True, tiled_mlp=True), False, "sigmoid", True, False), (dict(ac=False), True, "simpo", True, False),
    (dict(ac=True, tiled_mlp=True), False, "sigmoid", False, True), (dict(ac=False), True, "ipo_rpo", True, True)],
    ids=["no_ac", "ac_tiled", "ac_tiled_reference_adapter", *list(VARIANTS)[1:], "ipo_rpo_reference_adapter",
         "ac_tiled_shared_prompt", "simpo_shared_prompt", "ac_tiled_cached",
         "ipo_rpo_reference_adapter_shared_cached"])
def test_dpo_equals_the_formula_on_transformers_and_peft(tmp_path, mem, reference, variant, shared, cached):
    """Our packed micro-batch of pairs (with `shared`: each pair's prompt once, the rejected answer a branch; with
    `cached`: the reference's log-probabilities kept by `RefCache` from forwards of the pairs in other rows, the
    step reading them and running no reference forward) = each sequence alone through transformers + peft and the
    loss's formula: losses, rewards, every LoRA gradient."""
    import transformers as T
    from peft import LoraConfig, get_peft_model

    from data.collate import collate
    from data.pairs import shared_start
    from model.lora_spec import LORA_TARGETS
    from parallel.cp import KernelAttention
    from parallel.parallelize import BuildOptions
    from parallel.preference import DPO as Step
    from parallel.preference import Preference

    ckpt = tiny_checkpoint(tmp_path / "ckpt", layers=3)
    g = torch.Generator().manual_seed(3)
    made = [_pair(g, 19, 13, 6), _pair(g, 9, 22, 4), _pair(g, 15, 15, 15 - 3)]
    beta = 0.7
    model, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3, **mem),
                                        attention=KernelAttention())
    rows = [m[0] for m in made]
    if shared:   # (data.pairs.Pairs(share=True)'s rows: the tokens both sides share before a target, once)
        rows = [{"input_ids": torch.cat([c, r[f:]]), "labels": torch.cat([lc, lr[f:]]), "split": len(c), "shared": f}
                for _, (c, r), (lc, lr) in made
                for f in [shared_start({"input_ids": c, "labels": lc}, {"input_ids": r, "labels": lr})]]
        assert [x["shared"] for x in rows] == [5, 3, 11]   # (the prompts but their last token: its label is a target)
    b = collate(rows, True, 1, 0, sides=True)
    ref_sd = None
    if reference:   # another adapter as the reference (DPO from --init-adapter), one projection without tensors
        gr = torch.Generator().manual_seed(11)
        ref_sd = {k.removeprefix("base_model.model."): torch.randn(p.shape, generator=gr) * 0.3
                  for k, p in peft_model.named_parameters() if p.requires_grad and "layers.2.mlp.down_proj" not in k}
        assert len(ref_sd) == 14 * 3 - 2
    pref = Preference(**{"beta": beta, **VARIANTS[variant]})
    step = Step(model, pref, reference=ref_sd)
    if cached:   # first the pairs in other rows (two, then one), their reference kept; then the step reads it
        from parallel.ref_cache import RefCache

        said = []
        step.cache["train"] = RefCache(len(made), "cpu", str(tmp_path / "ref.pt"), {"of": "this test"}, said.append)
        for part in ([0, 1], [2]):
            c = collate([rows[j] for j in part], True, 1, 0, sides=True)
            assert not step.known("train", range(len(made))) and not said
            step(c["input_ids"], c["position_ids"], c["labels"], c["sides"], len(part), part)
            step.sync("train", None)
        assert step.known("train", range(len(made))) and os.path.exists(tmp_path / "ref.pt")
        assert said == ["reference: all 3 pairs' log-probabilities of ref.pt are kept: the steps or evaluations of "
                        "those pairs run no reference forward from here"], said
        step.reference = None   # (a reference forward in the step would now fail)
    losses, rewards = step(b["input_ids"], b["position_ids"], b["labels"], b["sides"], len(made),
                           list(range(len(made))), known=cached)
    margins = rewards[:, 0] - rewards[:, 1]
    (losses.sum() / len(made)).backward()
    ours = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}

    hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32),
                        LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                                   init_lora_weights=False))
    assert not hf.load_state_dict({k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad},
                                  strict=False).unexpected_keys
    hf.train()
    hf_ref = None
    if reference:   # peft's model with the reference adapter: its B = 0 where the reference has no tensors
        hf_ref = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                                           init_lora_weights=False)).eval()
        with torch.no_grad():
            for k, p in hf_ref.named_parameters():
                if "lora_" in k:
                    p.copy_(ref_sd.get(k.removeprefix("base_model.model."), torch.zeros_like(p)))

    def logp(ids, lab, m=hf):   # each sequence alone, the whole logits
        z = m(input_ids=ids[None]).logits[0].float().log_softmax(-1)
        keep = lab != -100
        return z[keep].gather(1, lab[keep, None]).sum()

    want, want_rewards = [], []
    for _, seqs, labels in made:
        with torch.no_grad():
            if reference:
                ref = [logp(s, lab, hf_ref) for s, lab in zip(seqs, labels)]
            else:
                with hf.disable_adapter():
                    ref = [logp(s, lab) for s, lab in zip(seqs, labels)]
        pol = [logp(s, lab) for s, lab in zip(seqs, labels)]
        n = [(lab != -100).sum() for lab in labels]
        want.append(_formula(pref, pol, ref, n))
        want_rewards.append(_rewards(pref, [p.detach() for p in pol], ref, n))
        if pref.reference and not pref.rpo_alpha:   # the loss at the start (the policy its reference) is known
            assert pref.at_start() == pytest.approx(_formula(pref, ref, ref, n).item(), rel=1e-6)
        else:
            assert pref.at_start() is None
    want = torch.stack(want)
    torch.testing.assert_close(rewards.float(), torch.stack(want_rewards), rtol=1e-5, atol=5e-5)   # (of sums ~100)
    (want.sum() / len(made)).backward()
    torch.testing.assert_close(losses.float(), want.detach(), rtol=1e-5, atol=1e-6)
    assert bool((margins.abs() > 1e-4).all()), f"the policy should differ from the reference: margins {margins}"
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    assert theirs.keys() == ours.keys() and len(ours) == 14 * 3
    for k in ours:   # (float32 sums in another order: relative to the tensor's norm, elements near 0 included)
        rel = ((ours[k] - theirs[k]).norm() / theirs[k].norm()).item()
        assert theirs[k].norm() > 0 and rel < 1e-4, f"grad {k}: relative difference {rel:.2e}"


# ----------------------------------------------------------------------------- data


def test_a_pair_is_its_two_sides_as_records(assets):
    from transformers import AutoTokenizer

    from data.records import parse_record
    from data.tokens import tokenize_records

    tok = AutoTokenizer.from_pretrained(assets["model"])
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [{"prompt": "What is 2 and 2?", "chosen": " four", "rejected": " five, or so"},
             {"prompt": chat, "chosen": [{"role": "assistant", "content": "Paris."}], "rejected": "Rome."},
             {"chosen": "The fox ran over the hill.", "rejected": "The fox sat."},
             {"prompt": "a long question " * 40, "chosen": " yes", "rejected": " no " * 30}]
    sides = [[{"prompt": x["prompt"], "completion": x["chosen"]}, {"prompt": x["prompt"], "completion": x["rejected"]}]
             if isinstance(x.get("prompt"), str) else
             [{"messages": chat + [{"role": "assistant", "content": "Paris."}]},
              {"messages": chat + [{"role": "assistant", "content": "Rome."}]}] if "prompt" in x else
             [{"text": x["chosen"]}, {"text": x["rejected"]}] for x in lines]
    recs = [parse_record(json.dumps(x), "p.jsonl", n) for n, x in enumerate(lines, 1)]
    got, stats = tokenize_records(recs, tok, 96, "p.jsonl")
    want, _ = tokenize_records([parse_record(json.dumps(s), "s.jsonl", n) for n, pair in enumerate(sides, 1)
                                for s in pair], tok, 96, "s.jsonl")
    assert stats.pairs == 4 and stats.samples == 8 == len(got) and stats.records == 4
    for k in range(0, 6, 2):   # each side's tokens as alone; its targets too with a prompt (TRL's), but for a text
        # pair's shared start (no targets: TRL's implicit prompt)
        assert [g["input_ids"] for g in got[k:k + 2]] == [w["input_ids"] for w in want[k:k + 2]]
        a, b = (w["input_ids"] for w in want[k:k + 2])
        shared = next(t for t, (x, y) in enumerate(zip(a, b)) if x != y) if k == 4 else 1
        for g, w in zip(got[k:k + 2], want[k:k + 2]):
            assert g["labels"] == [-100] * (shared - 1) + w["labels"][shared - 1:]
    assert shared > 3   # ("The fox": the text pair's prompt)
    assert got[5]["labels"][:-3] != [-100] * (len(got[5]["labels"]) - 3)   # (text pair: its answers' tokens train)
    assert [s["line"] for s in got] == [1, 1, 2, 2, 3, 3, 4, 4]
    # record 4's prompt is cut once for both sides, by the longer (rejected) side's count: the rejected as it is alone,
    # the chosen with the same prompt tokens before its answer (alone, it would keep more of the prompt)
    first = lambda x: next(t for t, lab in enumerate(x["labels"]) if lab != -100) + 1   # the first target token
    chosen, rejected, alone = got[6], got[7], want[6]
    assert rejected == want[7] and len(alone["input_ids"]) > len(chosen["input_ids"])
    assert chosen["input_ids"][:first(chosen)] == rejected["input_ids"][:first(rejected)]
    assert chosen["input_ids"][first(chosen):] == alone["input_ids"][first(alone):]
    assert chosen["labels"][first(chosen) - 1:] == alone["labels"][first(alone) - 1:]
    # a pair whose chosen side has no target left within --max-len (six questions before its answer), though its
    # rejected side alone keeps one: dropped whole, counted once, named
    users = [{"role": "user", "content": f"And of the place number {i}?"} for i in range(6)]
    five = parse_record(json.dumps({"chosen": users + [{"role": "assistant", "content": "Madrid."}],
                                    "rejected": [{"role": "user", "content": "Spain?"},
                                                 {"role": "assistant", "content": "Rome."}]}), "p.jsonl", 5)
    assert [len(tokenize_records([side], tok, 64)[0]) for side in five["pair"]] == [0, 1]
    got5, stats5 = tokenize_records(recs + [five], tok, 96, "p.jsonl")
    assert got5 == got and stats5.dropped == 1 and stats5.dropped_lines == [5] and stats5.records == 5
    # sides that are the same tokens (written so, or alike within --max-len): dropped as tied, counted, said
    same = [{"prompt": "Q?", "chosen": " yes", "rejected": " yes"},
            {"chosen": "a shared start " * 20 + "then one end", "rejected": "a shared start " * 20 + "then another"}]
    got6, stats6 = tokenize_records([parse_record(json.dumps(x), "p.jsonl", n) for n, x in enumerate(same, 6)] + recs,
                                    tok, 96, "p.jsonl")
    assert got6 == got and stats6.tied == 2 and stats6.tied_lines == [6, 7] and stats6.dropped == 0
    assert "2 preference pairs whose chosen and rejected sides are the same tokens" in stats6.warning("--data", 96)
    assert tokenize_records([parse_record(json.dumps(same[1]), "p.jsonl", 7)], tok, 400)[1].pairs == 1   # (longer)
    # sides differing at their first token (a text pair, no BOS: nothing shared): each side exactly as alone (review,
    # helper 38: the shared start's mask cut such labels to one); sides differing in untrained tokens only: tied
    differ = parse_record(json.dumps({"chosen": "Paris is it.", "rejected": "Rome is it."}), "p.jsonl", 8)
    got8, stats8 = tokenize_records([differ], tok, 96)
    assert got8 == tokenize_records(differ["pair"], tok, 96)[0] and stats8.pairs == 1
    ask = [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": "Yes."}]
    untrained = parse_record(json.dumps({"chosen": ask, "rejected": ask + [{"role": "user", "content": "More?"}]}),
                             "p.jsonl", 9)
    assert tokenize_records([untrained], tok, 96)[1].tied_lines == [9]
    # answers sharing their start after a given prompt (a string, or messages): each side's answer trains whole, as
    # alone (TRL's; until 2026-12-05 the shared start was no target, which changed SimPO's and ORPO's means); a side
    # that ends where they part (all its targets the other's too): tied, not kept with no target (review, helper 42)
    alike = [{"prompt": "What is 2 and 2?", "chosen": " The answer is four.", "rejected": " The answer is five."},
             {"prompt": chat, "chosen": "Paris, of course.", "rejected": "Paris? No, Lyon."}]
    got10, stats10 = tokenize_records([parse_record(json.dumps(x), "p.jsonl", n) for n, x in enumerate(alike, 10)],
                                      tok, 96)
    want10 = [tokenize_records([side], tok, 96)[0][0] for x in alike
              for side in parse_record(json.dumps(x), "p.jsonl", 1)["pair"]]
    assert got10 == [dict(w, line=g["line"]) for g, w in zip(got10, want10)] and stats10.pairs == 2
    for g in got10[2:]:   # ("Paris" is a target on both sides)
        assert tok.decode([lab for lab in g["labels"] if lab != -100]).startswith("Paris")
    ends = parse_record(json.dumps({"chosen": ask, "rejected": ask + [{"role": "user", "content": "More?"},
                                                                      {"role": "assistant", "content": "No."}]}),
                        "p.jsonl", 12)
    got12, stats12 = tokenize_records([ends], tok, 96)
    assert got12 == [] and stats12.tied_lines == [12] and stats12.pairs == 0
    assert [len(tokenize_records([side], tok, 96)[0]) for side in ends["pair"]] == [1, 1]   # (each alone trains)
    # with a prompt of messages, TRL's completion is every answer message: earlier turns of a multi-turn answer train
    # on both sides, a pair whose rejected side goes on after the chosen's whole answer is kept; the prompt's own
    # assistant turns are no target (review, helper 43: the walk-back cut the answer at its last turn)
    def targets(x):
        return tok.decode([lab for lab in x["labels"] if lab != -100])
    check = [{"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "ok"}]
    multi = [{"prompt": [{"role": "user", "content": "Is it?"}], "chosen": check + [{"role": "assistant",
                                                                                      "content": "Yes."}],
              "rejected": check + [{"role": "assistant", "content": "No."}]},
             {"prompt": [{"role": "user", "content": "Is it?"}], "chosen": [{"role": "assistant", "content": "Yes."}],
              "rejected": [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Sure?"},
                           {"role": "assistant", "content": "No."}]},
             {"prompt": [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": "Earlier."},
                         {"role": "user", "content": "And now?"}], "chosen": "Yes.", "rejected": "No."}]
    got13, stats13 = tokenize_records([parse_record(json.dumps(x), "p.jsonl", n) for n, x in enumerate(multi, 13)],
                                      tok, 128)
    assert stats13.pairs == 3 and stats13.tied == 0, stats13
    assert [targets(x).count("Let me check.") for x in got13[:2]] == [1, 1]
    assert targets(got13[3]).count("Yes.") == 1 and "No." in targets(got13[3])
    assert "Earlier." not in targets(got13[4]) + targets(got13[5]) and "Yes." in targets(got13[4])
    alone = tokenize_records([{"line": 1, "messages": multi[0]["prompt"] + multi[0]["chosen"]}], tok, 128)[0][0]
    assert got13[0]["labels"] == alone["labels"]   # (a prompt with no assistant turn: each side as alone)
    for sample in got + got5 + got6 + got8 + got10 + got13:
        assert len(sample["labels"]) == len(sample["input_ids"])


def test_both_answers_are_scored_after_the_same_prompt_tokens(assets):
    """A token that merges the prompt's end with one answer's start (" cap" + "ital" -> " capital"): both sides'
    targets start where TRL's DPOTrainer starts the completion, the shorter common prefix of the prompt's tokens alone
    with each prompt + answer's (its `prompt_len`), so the two answers are scored after the same context; the other
    side's " cap" trains too (review, helper 85: each side's targets began at its own, the chosen's after "the", the
    rejected's after "the cap")."""
    from transformers import AutoTokenizer

    from data.records import parse_record
    from data.tokens import tokenize_records

    tok = AutoTokenizer.from_pretrained(assets["model"])
    x = {"prompt": "What is the cap", "chosen": "ital of France?", "rejected": "e of the hill?"}
    enc = lambda s: tok(s)["input_ids"]
    common = lambda a, b: next((t for t, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    prompt, sides = enc(x["prompt"]), [enc(x["prompt"] + x[k]) + [tok.eos_token_id] for k in ("chosen", "rejected")]
    n = min(common(prompt, s) for s in sides)   # (TRL's prompt_len)
    assert common(prompt, sides[0]) < len(prompt) == common(prompt, sides[1])   # (the merge, on the chosen side)
    got, stats = tokenize_records([parse_record(json.dumps(x), "p.jsonl", 1)], tok, 96)
    assert stats.pairs == 1 and [g["input_ids"] for g in got] == sides
    for g, s in zip(got, sides):
        assert g["labels"] == [-100] * (n - 1) + s[n:] + [-100], tok.decode([t for t in g["labels"] if t != -100])


def test_collate_makes_a_pair_two_documents_and_marks_the_sides():
    from data.collate import collate
    from data.pairs import PairRows, Pairs
    from data.samples import Samples

    a = {"input_ids": [5, 6, 7], "labels": [6, 7, -100], "line": 1}
    b = {"input_ids": [5, 8], "labels": [8, -100], "line": 1}
    c = {"input_ids": [9, 9, 9, 9], "labels": [-100, 9, 9, -100], "line": 2}
    d = {"input_ids": [9, 1], "labels": [1, -100], "line": 2}
    p = Pairs(Samples.from_lists([a, b, c, d]))
    assert len(p) == 2 and p.lengths.tolist() == [5, 6] and p.sample_lines().tolist() == [1, 2]
    assert p.sides(0) == (3, 2) and p.sides(1) == (4, 2)   # (the FLOPs count attention per sequence)
    # --dpo-share-prompt: the tokens both sides share before a target (2 here), once; the rejected's rest restarts
    # at position 2; its FLOPs are its whole sequence's less the prompt's (sides: 4, 5 and -2)
    e = {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 4, -100], "line": 3}
    f = {"input_ids": [1, 2, 3, 7, 8], "labels": [-100, -100, 7, 8, -100], "line": 3}
    s = Pairs(Samples.from_lists([a, b, e, f]), share=True)
    assert s.shared.tolist() == [0, 2] and s.lengths.tolist() == [5, 7] and s.sides(0) == (3, 2)
    assert s.sides(1) == (4, 5, -2) and {k: v.tolist() if hasattr(v, "tolist") else v for k, v in s[0].items()} == \
        {k: v.tolist() if hasattr(v, "tolist") else v for k, v in p[0].items()}
    row = collate([s[1]], True, 1, 0, sides=True)
    assert row["input_ids"].tolist() == [[1, 2, 3, 4, 3, 7, 8]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    assert row["labels"].tolist() == [[-100, -100, 4, -100, 7, 8, -100]]
    assert row["sides"].tolist() == [[0] * 4 + [1] * 3]
    out = collate([p[0], p[1]], True, 4, 0, sides=True)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert out["sides"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, -1]]
    assert out["labels"].tolist() == [[6, 7, -100, 8, -100, -100, 9, 9, -100, 1, -100, -100]]
    rows = collate([p[0], p[1]], False, 1, 0, sides=True)
    assert rows["sides"].tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, 3, 3]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    assert "sides" not in collate([p[0]], True, 1, 0)
    assert PairRows(lambda e: torch.tensor([2, 3, 0, 1, 2, 3]))(0).tolist() == [1, 0, 1]
    with pytest.raises(RuntimeError, match="part a preference pair"):
        PairRows(lambda e: torch.tensor([1, 2]))(0)


def test_the_planner_plans_a_pair_as_two_sequences():
    import argparse

    import train
    from model.load import read_args
    from parallel.mesh import ParallelDims
    from parallel.plan import memory_plan

    m = read_args("bench/configs/qwen2.5-7b")
    p = train.build_parser()
    base = p.parse_args(["--max-len", "8192", "--dtype", "bf16"])
    dpo = argparse.Namespace(**{**vars(base), "objective": "dpo"})
    two = argparse.Namespace(**{**vars(base), "max_len": 16384})
    dims = ParallelDims(world_size=1, dp_shard=1, cp=1)
    assert memory_plan(m, dims, dpo, "cuda", True).peak == memory_plan(m, dims, two, "cuda", True).peak
    assert memory_plan(m, dims, dpo, "cuda", True).peak > memory_plan(m, dims, base, "cuda", True).peak
    # --dpo-share-prompt: the attention phase plans the ring's float32 sums (the branches take its calls)
    shared = memory_plan(m, dims, argparse.Namespace(**{**vars(dpo), "dpo_share_prompt": True}), "cuda", True)
    attn = lambda plan: next(v for k, v in plan.terms.items() if k.startswith("| block attention"))
    assert any("kernel+ring" in k for k in shared.terms) and attn(shared) >= attn(memory_plan(m, dims, dpo, "cuda",
                                                                                              True))
    # --ac-keep-attn keeps each kernel call's output, and a branch's rows take two calls: twice a row's (helper 45)
    keep = lambda ns: next(v for k, v in memory_plan(m, dims, argparse.Namespace(**{**vars(dpo), "ac_keep_attn": True,
                                                                                     **ns}), "cuda", True).terms.items()
                           if "kept attention outputs" in k)
    assert keep({"dpo_share_prompt": True}) == 2 * keep({}), (keep({"dpo_share_prompt": True}), keep({}))
    # rows of several pairs share tiled calls under the ring (~3.5x, helper 47); on one process they run as one row
    unpacked = {"pack": False, "micro_batch": 2}
    assert keep({"dpo_share_prompt": True, **unpacked}) == 2 * keep(unpacked)
    ring2 = ParallelDims(world_size=2, dp_shard=1, cp=2, ulysses=1, ring=2)
    keep2 = lambda ns: next(v for k, v in memory_plan(m, ring2, argparse.Namespace(
        **{**vars(dpo), "ac_keep_attn": True, "cp": 2, **ns}), "cuda", True).terms.items() if "kept attention" in k)
    assert keep2({"dpo_share_prompt": True, **unpacked}) == 4 * keep2(unpacked), (keep2(unpacked),)
    # from --init-adapter: its tensors whole on the rank, bf16 (r 16 on all seven projections of 28 layers)
    ref = argparse.Namespace(**{**vars(dpo), "dpo_reference": "adapter sha256 0"})
    D, F_, kv = 3584, 18944, 4 * 128
    per_layer = 16 * ((D + D) * 2 + (D + kv) * 2 + (D + F_) * 3)
    got = memory_plan(m, dims, ref, "cuda", True).peak - memory_plan(m, dims, dpo, "cuda", True).peak
    assert got == 28 * per_layer * 2, (got, 28 * per_layer * 2)
    # the step time: a supervised step of two --max-len documents a row, plus the reference's forward
    from parallel.plan_speed import step_seconds
    t_dpo, _ = step_seconds(m, dims, dpo, "cuda", True)
    t_two, _ = step_seconds(m, dims, argparse.Namespace(**{**vars(base), "micro_batch": 2}), "cuda", True)
    assert 1.15 < t_dpo / t_two < 1.35, (t_dpo, t_two)
    t_simpo, _ = step_seconds(m, dims, argparse.Namespace(**{**vars(dpo), "dpo_loss": "simpo"}), "cuda", True)
    assert abs(t_simpo / t_two - 1) < 0.01, (t_simpo, t_two)   # (no reference forward)
    simpo_ref = argparse.Namespace(**{**vars(ref), "dpo_loss": "simpo"})   # (nor a reference adapter)
    assert memory_plan(m, dims, simpo_ref, "cuda", True).peak == memory_plan(m, dims, dpo, "cuda", True).peak


# ----------------------------------------------------------------------------- train.py


def test_a_dpo_run_learns_its_pairs_and_starts_at_log_2(runs):
    m = _metrics(os.path.join(runs, "dpo"))
    assert [r["step"] for r in m] == [1, 2, 3]
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6 and m[0]["reward_margin"] == 0 and m[0]["reward_acc"] == 0
    assert m[0]["reward_chosen"] == 0 == m[0]["reward_rejected"]   # (each side's reward is 0 at the reference)
    for r in m:   # the margin is the chosen's mean reward less the rejected's (each rounded to 6 places)
        assert abs(r["reward_margin"] - (r["reward_chosen"] - r["reward_rejected"])) <= 2e-6, r
    assert m[-1]["reward_chosen"] != 0 != m[-1]["reward_rejected"]
    assert all(0 <= r["reward_acc"] <= 1 and "eval_reward_acc" in r and "eval_reward_margin" in r for r in m)
    # the step line's columns in the README's order, as before DPO.step_metrics (review, helper 98)
    assert [k for k in m[0] if k.startswith("reward_")] == ["reward_acc", "reward_margin", "reward_chosen",
                                                            "reward_rejected"], list(m[0])
    assert m[-1]["eval_reward_margin"] > 0, m[-1]
    assert m[-1]["eval_loss"] < math.log(2), f"the eval pairs' DPO loss should fall below log 2: {m[-1]}"
    cfg = json.load(open(os.path.join(runs, "dpo", "config.json")))
    assert cfg["objective"] == "dpo" and cfg["dpo_beta"] == 0.5 and cfg["loss"] == "dpo"
    assert os.path.exists(os.path.join(runs, "dpo", "adapter", "adapter_model.safetensors"))


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks_match_one_rank(runs, name):
    _as_one_rank(name, os.path.join(runs, name), os.path.join(runs, "dpo_2"))


def _as_one_rank(name, out, ref):
    """A 4-rank run of 2 steps = its 1-rank run: losses, grad norms, tokens, adapter (`_compare`), and every step's
    reward and eval metrics."""
    _compare(name, out, ref, steps=(1, 2), adapter_rtol=ADAPTER_RTOL)
    for g, w in zip(_metrics(out), _metrics(ref)):
        for k in ("reward_acc", "reward_margin", "reward_chosen", "reward_rejected", "eval_loss", "eval_reward_acc",
                  "eval_reward_margin"):
            if k in g or k in w:
                assert k in g and k in w and abs(g[k] - w[k]) <= 1e-4, f"{name} step {g['step']}: {k} {g.get(k)} vs " \
                                                                        f"{w.get(k)}"


@pytest.mark.parametrize("name", [*SHARED, *SHARED_FOUR])
def test_a_shared_prompt_trains_as_the_plain_run_on_fewer_tokens(runs, name):
    """--dpo-share-prompt (1 rank, also with --ac-keep-attn and 2 pairs a micro-batch, and with --tiled-attn, the
    tiled MLP and offload; cp 2 × dp 2 ring with 2 pairs a micro-batch; the 2 × 2 hybrid with --micro-batch auto) =
    the plain 1-rank run of 2 steps: losses, grad norms, reward and eval metrics, adapter; on fewer tokens (the
    prompts once). Ulysses with the tiled MLP and offload: dpo_from_cached_cp2_dp2_ulysses_shared (3 steps, from an
    adapter), test_a_cached_reference_trains_as_the_plain_run."""
    out, ref = os.path.join(runs, name), os.path.join(runs, "dpo_2")
    got, want = _metrics(out), _metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for g, w in zip(got, want):
        assert g["tokens"] < 0.9 * w["tokens"], (g["tokens"], w["tokens"])   # (the prompts once)
        for k in ("loss", "reward_acc", "reward_margin", "reward_chosen", "reward_rejected", "eval_loss",
                  "eval_reward_acc", "eval_reward_margin"):
            assert abs(g[k] - w[k]) <= 1e-4, f"{name} step {g['step']}: {k} {g[k]} vs {w[k]}"
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * w["grad_norm"], (g["grad_norm"], w["grad_norm"])
    a, b = _adapter(out), _adapter(ref)
    assert sorted(a) == sorted(b)
    for k in b:
        rel = ((a[k] - b[k]).norm() / b[k].norm()).item()
        assert rel <= ADAPTER_RTOL, f"{name}: adapter {k} differs by {rel:.2e}"
    assert json.load(open(os.path.join(out, "config.json")))["dpo_share_prompt"] is True


@pytest.mark.parametrize("name", ["dpo_a_cached", *CACHED_FOUR])
def test_a_cached_reference_trains_as_the_plain_run(runs, name):
    """--dpo-cache-ref on 1 rank and on cp 2 × dp 2 ring with 2 pairs a micro-batch (two epochs: the third step reads
    the first epoch's values), and from an adapter (its reference) on cp 2 × dp 2 Ulysses with shared prompts (fewer
    tokens a step), the tiled MLP and offload, 2 pairs a micro-batch = the plain 1-rank run: losses, grad norms, reward
    and eval metrics, adapter; its files in OUT hold the values of every pair the run met (each below 0), kept for the
    run's reference; on 1 rank the run made 2 of the plain run's 3 steps' reference forwards and 1 of its 3
    evaluations'."""
    out = os.path.join(runs, name)
    ref = os.path.join(runs, "dpo_from" if "from" in name else "dpo_a")
    got, want = _metrics(out), _metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    assert "from" in name or [r["epoch"] for r in got] == [r["epoch"] for r in want] and got[-1]["epoch"] == 2, got
    for g, w in zip(got, want):
        for k in ("loss", "reward_acc", "reward_margin", "reward_chosen", "reward_rejected", "eval_loss",
                  "eval_reward_acc", "eval_reward_margin"):
            assert abs(g[k] - w[k]) <= 1e-4, f"{name} step {g['step']}: {k} {g[k]} vs {w[k]}"
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * w["grad_norm"], (g["grad_norm"], w["grad_norm"])
    assert got[0]["reward_acc"] == 0 and (got[0]["reward_margin"] == 0 or "from" in name), got[0]   # (step 1: ties)
    shared = json.load(open(os.path.join(out, "config.json")))["dpo_share_prompt"]
    assert shared == ("shared" in name) and all((g["tokens"] < 0.9 * w["tokens"]) == shared for g, w in zip(got, want))
    a, b = _adapter(out), _adapter(ref)
    assert sorted(a) == sorted(b)
    for k in b:
        rel = ((a[k] - b[k]).norm() / b[k].norm()).item()
        assert rel <= ADAPTER_RTOL, f"{name}: adapter {k} differs by {rel:.2e}"
    for f in ("reference_logps.pt", "reference_logps_eval.pt"):   # (from the adapter: 3 steps of 8 of the 29 pairs)
        kept = torch.load(os.path.join(out, f), weights_only=True)
        have = int(kept["have"].sum())
        assert have == (24 if "from" in name and f == "reference_logps.pt" else len(kept["have"])), (f, have)
        assert bool((kept["values"][kept["have"]] < 0).all()) and not kept["values"][~kept["have"]].any(), f
        assert kept["identity"]["dpo_reference"].startswith("adapter sha256" if "from" in name else "base"), f
    if name == "dpo_a_cached":
        plain, cached = (json.load(open(os.path.join(runs, r, "reference_calls.json"))) for r in ("dpo_a", name))
        assert plain[0] > 0 and plain[1] > 0 and cached[0] * 3 == plain[0] * 2 and cached[1] * 3 == plain[1], (
            plain, cached)


def test_a_cached_reference_is_read_back_on_resume(runs, pairs, tmp_path, capsys):
    """A resume in the run's folder reads OUT/reference_logps*.pt: step 3 runs no reference forward and equals the
    uninterrupted step (a tampered file changes it: it is read, not computed again); a file kept for other tokens is
    computed again, said, and equals too; --dpo-cache-ref with a loss without a reference, or on a supervised run, is
    refused."""
    import shutil

    import train

    want = _metrics(os.path.join(runs, "dpo_a_cached"))[2]
    step3 = {}
    from parallel.ref_cache import _digest
    for how in ("as_is", "tampered", "corrupt", "other_tokens"):
        out = str(tmp_path / how)
        shutil.copytree(os.path.join(runs, "dpo_a_cached"), out)
        path = os.path.join(out, "reference_logps.pt")
        kept = torch.load(path, weights_only=True)
        assert kept["sha256"] == _digest(kept["values"], kept["have"]), "written with its values' sha256"
        if how in ("tampered", "corrupt"):   # (tampered: with a sha256 that matches, so it is read)
            kept["values"] = kept["values"] * 1.01
            kept["sha256"] = _digest(kept["values"], kept["have"]) if how == "tampered" else kept["sha256"]
        if how == "other_tokens":
            kept["identity"]["tokens"] = kept["identity"]["tokens"].replace("sha256 ", "sha256 0")
        torch.save(kept, path)
        n = len(kept["have"])
        capsys.readouterr()
        with one_thread(), _counting_references() as calls:
            train.main(_argv(pairs, out, *EPOCHS(pairs), *CACHED, "--resume", os.path.join(out, "ckpt", "step_000002")))
        said = capsys.readouterr().out
        step3[how] = _metrics(out)[2]
        again = how in ("corrupt", "other_tokens")
        assert (f"reference: {n} of {n} pairs' log-probabilities read from {path}" in said) == (not again)
        assert f"pairs' log-probabilities read from {path[:-3]}_eval.pt" in said, said
        assert "reference: the base model (LoRA off) (each pair's kept: --dpo-cache-ref)" in said, said
        assert (f"note: {path} was kept for another model, reference or data: its values are computed again" in said
                ) == (how == "other_tokens"), said
        assert (f"note: {path}'s values do not match the sha256 written with them: they are computed again" in said
                ) == (how == "corrupt"), said
        assert calls[1] == 0 and (calls[0] == 0) == (not again), (how, calls)   # (the eval's: read)
    for how in ("as_is", "corrupt", "other_tokens"):
        for k in ("loss", "grad_norm", "reward_margin", "eval_loss"):
            assert abs(step3[how][k] - want[k]) <= 1e-5, f"{how}: step 3 {k}: {step3[how][k]} vs {want[k]}"
    assert abs(step3["tampered"]["reward_margin"] - want["reward_margin"]) > 1e-3, (step3["tampered"], want)
    out = str(tmp_path / "refused")
    said = startup_error(_argv(pairs, out, "--dpo-cache-ref", "--dpo-loss", "simpo", "--dpo-beta", "2"))
    assert "--dpo-loss simpo has no reference model: drop it" in said, said
    said = startup_error(train_argv(pairs, out, "--dpo-cache-ref"))
    assert "--dpo-cache-ref keeps a preference loss's reference log-probabilities, and this run is supervised: pass " \
           "--objective dpo" in said, said


@pytest.mark.parametrize("name", list(ONE))
def test_memory_flags_change_nothing_one_rank(runs, name):
    _compare(name, os.path.join(runs, name), os.path.join(runs, "dpo_2"), steps=(1, 2), adapter_rtol=ADAPTER_RTOL)


def test_weighted_files_and_a_held_out_split_of_pairs_on_four_ranks_match_one_rank(runs):
    """Two files with --data-weights 1 0.5 and --eval-split 2 on cp 2 × dp 2 ring, 2 pairs a micro-batch = 1 rank (as
    test_four_ranks_match_one_rank's layouts: this is that layout's run) in losses, grad norms, reward and eval
    metrics, adapter."""
    out, ref = os.path.join(runs, "dpo_files_cp2_dp2_ring"), os.path.join(runs, "dpo_files")
    _as_one_rank("dpo_files", out, ref)
    assert all("eval_reward_acc" in r for r in _metrics(out)), _metrics(out)   # (an eval each step)


def test_resume_gives_the_uninterrupted_step(runs):
    got, want = _metrics(os.path.join(runs, "dpo_resume")), _metrics(os.path.join(runs, "dpo"))
    assert [r["step"] for r in got] == [3]   # (a resume into another --out: its own metrics from there)
    for k in ("loss", "grad_norm", "reward_acc", "reward_margin", "eval_loss"):
        assert abs(got[0][k] - want[2][k]) <= 1e-5, f"step 3 {k}: {got[0][k]} vs {want[2][k]}"
    a, b = _adapter(os.path.join(runs, "dpo_resume")), _adapter(os.path.join(runs, "dpo"))
    for k in b:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


def test_dpo_from_an_adapter_has_that_adapter_as_its_reference(runs, pairs, tmp_path):
    """The policy starts from --init-adapter and the reference is that adapter held fixed: step 1's loss is log 2
    (with the base as the reference it would be below: the adapter already prefers the chosen sides, see the first
    run's last eval loss), and training moves the eval loss below log 2, lower after every step; 4 ranks (cp 2 x dp 2
    ring, tiled MLP, offload) = 1 rank; a resume = the uninterrupted step 3, and is refused without the adapter or with
    other bytes. (Each step's loss is a new batch's, 8 pairs not trained on yet: step 3's was 0.690 until the assets
    model's attention was sharpened (q and k x 14, 2026-12-07), 0.704 since, so the fall is the eval pairs', 0.687,
    0.665, 0.631.)"""
    m, first = _metrics(os.path.join(runs, "dpo_from")), _metrics(os.path.join(runs, "dpo"))
    assert first[-1]["eval_loss"] < math.log(2) - 0.02, f"the starting adapter should prefer the chosen sides (the " \
                                                         f"eval pairs are training pairs): {first[-1]}"
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6 and m[0]["reward_margin"] == 0, m[0]
    evals = [r["eval_loss"] for r in m]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2] and evals[2] < math.log(2) - 0.02, m
    cfg = json.load(open(os.path.join(runs, "dpo_from", "config.json")))
    from data.store import file_sha256
    assert cfg["dpo_reference"] == "adapter sha256 " + file_sha256(os.path.join(runs, "dpo", "adapter",
                                                                                 "adapter_model.safetensors"))
    assert json.load(open(os.path.join(runs, "dpo", "config.json")))["dpo_reference"] == "base"
    _compare("dpo_from_cp2_dp2_ring", os.path.join(runs, "dpo_from_cp2_dp2_ring"), os.path.join(runs, "dpo_from"),
             adapter_rtol=ADAPTER_RTOL)
    got = _metrics(os.path.join(runs, "dpo_from_resume"))
    assert [r["step"] for r in got] == [3]
    for k in ("loss", "grad_norm", "reward_margin", "eval_loss"):
        assert abs(got[0][k] - m[2][k]) <= 1e-5, f"step 3 {k}: {got[0][k]} vs {m[2][k]}"
    step2 = os.path.join(runs, "dpo_from", "ckpt", "step_000002")
    out = str(tmp_path / "again")
    said = startup_error(_argv(pairs, out, "--eval-every", "1", "--resume", step2))
    assert "DPO's reference: the checkpoint's run's was the adapter" in said and "pass --init-adapter" in said, said
    other = ["--init-adapter", os.path.join(runs, "dpo_from", "adapter")]   # (an adapter, other bytes)
    said = startup_error(_argv(pairs, out, *other, "--eval-every", "1", "--resume", step2))
    assert "this run's the adapter" in said and os.path.join(runs, "dpo", "adapter") in said, said
    said = startup_error(_argv(pairs, out, *FROM(runs), "--resume", os.path.join(runs, "dpo", "ckpt",
                                                                                 "step_000002")))
    assert "was the base model (LoRA off)" in said and "drop --init-adapter" in said, said
    said = startup_error(_argv(pairs, out, "--init-adapter", str(tmp_path), "--eval-every", "1", "--resume", step2))
    assert "no adapter_model.safetensors there" in said and "on a resume too" in said, said
    said = startup_error(_argv(pairs, out, *FROM(runs), "--dpo-loss", "simpo", "--resume", step2))
    assert "--dpo-loss: the checkpoint has 'sigmoid', this run 'simpo'" in said and "reference" not in said, said


def test_orpo_is_finite_where_a_side_is_certain():
    """ORPO's log(1 - p) at a side whose every target has -log p rounded to 0 (p = 1): a finite loss and gradient
    (review, helper 42: the chosen side's gave a NaN gradient, the rejected side's an infinite loss)."""
    from parallel.preference import Preference

    for pi in ([0.0, -5.0], [-5.0, 0.0], [0.0, 0.0]):
        x = torch.tensor(pi, dtype=torch.float64, requires_grad=True)
        losses, _ = Preference("orpo", 0.25)(x, None, torch.tensor([3.0, 4.0], dtype=torch.float64))
        (g,) = torch.autograd.grad(losses.sum(), x)
        assert bool(torch.isfinite(losses).all()) and bool(torch.isfinite(g).all()), (pi, losses, g)


@pytest.mark.parametrize("name", list(LOSSES))
def test_other_losses_on_four_ranks_match_one_rank(runs, name):
    """IPO + RPO on cp 2 × dp 2 ring and SimPO (no reference forward) on cp 2 × dp 2 Ulysses, 2 pairs a micro-batch,
    ORPO on cp 4 ring with 4: = 1 rank in losses, grad norms, reward and eval metrics, adapter, each of 2 steps; they
    learn (the eval loss after step 2 is below step 1's) and config.json records the loss."""
    out, ref = os.path.join(runs, name + "_4"), os.path.join(runs, name)
    _compare(name, out, ref, steps=(1, 2), adapter_rtol=ADAPTER_RTOL)
    got, want = _metrics(out), _metrics(ref)
    for g, w in zip(got, want):
        for k in ("reward_acc", "reward_margin", "reward_chosen", "reward_rejected", "eval_loss", "eval_reward_acc",
                  "eval_reward_margin"):
            assert abs(g[k] - w[k]) <= 1e-4, f"{name} step {g['step']}: {k} {g[k]} vs {w[k]}"
    assert want[-1]["eval_loss"] < want[0]["eval_loss"], [r["eval_loss"] for r in want]
    cfg = json.load(open(os.path.join(ref, "config.json")))
    flags = LOSSES[name][0]
    assert cfg["dpo_loss"] == flags[1] and cfg["dpo_reference"] == ("base" if flags[1] == "ipo" else "none")


def test_lora_dropout_in_dpo_and_simpo_with_a_small_beta_are_said(runs, pairs, tmp_path, capsys):
    """With --lora-dropout the policy's forward drops LoRA inputs and the reference's does not: said, not refused;
    so is SimPO with a beta below 1."""
    import train

    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "drop"), *FROM(runs), "--steps", "1", "--lora-dropout", "0.1",
                         "--eval-every", "0"))
    out = capsys.readouterr().out
    assert "note: --lora-dropout 0.1 drops LoRA inputs in the policy's forward, not in the reference's" in out, out
    assert "loss: DPO (--dpo-loss sigmoid), beta 0.5, reference: --init-adapter " in out, out
    # SimPO with a DPO-sized beta: said (its beta scales mean log-probabilities); the loss line names it and gamma
    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "simpo"), "--steps", "1", "--dpo-loss", "simpo", "--dpo-beta", "0.5",
                         "--eval-every", "0"))
    out = capsys.readouterr().out
    assert "loss: SimPO (--dpo-loss simpo), beta 0.5, gamma 0.5, reference: none" in out, out
    assert "note: --dpo-beta 0.5 with SimPO, whose beta scales mean log-probabilities: its paper and TRL use 2 to " \
           "2.5 (--dpo-beta 2)" in out, out


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_dpo_from_an_adapter_in_bf16_starts_at_log_2(runs, pairs, tmp_path, quant):
    """In bf16 with no mixed precision (the CPU's), LoRA computes in float32 through peft's own forward, which rounds
    a 4-bit layer's share before the sum and a plain layer's sum after it: the reference adapter rounds as each does,
    so step 1 is log 2 to the metric's 6 digits."""
    import train

    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "bf16"), *FROM(runs), "--steps", "1", "--dtype", "bf16", "--quant",
                         quant, "--eval-every", "0"))
    m = _metrics(str(tmp_path / "bf16"))
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6, m[0]


def test_dpo_from_a_dora_adapter_in_bf16_starts_at_log_2(pairs, tmp_path):
    """--dora in bf16 with no mixed precision (the CPU's): the reference adapter computes the policy's DoRA path
    (LoRA in float32, the sum rounded once), so DPO from a DoRA adapter starts at log 2 as a LoRA one does."""
    import train

    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "dora"), "--steps", "2", "--dora", "--quant", "nf4",
                         "--eval-every", "0"))
        train.main(_argv(pairs, str(tmp_path / "bf16"), "--init-adapter", str(tmp_path / "dora" / "adapter"), "--dora",
                         "--steps", "1", "--dtype", "bf16", "--quant", "nf4", "--eval-every", "0"))
    m = _metrics(str(tmp_path / "bf16"))
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6, m[0]


def test_dpo_with_trained_norms_starts_at_log_2_from_the_base_and_from_their_adapter(pairs, tmp_path):
    """--train-norms --train-embeddings through train.py: DPO from the base trains (step 1 log 2, step 2 moves off
    it), then DPO from that run's adapter (its LoRA, norms and embedding, read for the reference too) in bf16 without
    mixed precision (the float32 weights cast as the policy's are) starts at log 2 again. That the reference computes
    with the base's or the adapter's, not the policy's trained ones: test_norms.py's DPO test (these log 2s hold either
    way)."""
    import train

    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "base"), "--steps", "2", "--train-norms", "--train-embeddings", "--lr",
                         "5e-3", "--eval-every", "0"))
        train.main(_argv(pairs, str(tmp_path / "from"), "--init-adapter", str(tmp_path / "base" / "adapter"),
                         "--train-norms", "--train-embeddings", "--steps", "1", "--dtype", "bf16", "--eval-every",
                         "0"))
    m = _metrics(str(tmp_path / "base"))
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6 and abs(m[-1]["loss"] - math.log(2)) > 1e-4, m
    m = _metrics(str(tmp_path / "from"))
    assert abs(m[0]["loss"] - math.log(2)) < 1e-6, m[0]


def test_reference_free_dpo_trains_the_embedding(pairs, tmp_path):
    """--train-embeddings with a reference-free loss (SimPO: no reference model, which would need the base's
    embedding): the run trains and its adapter holds the embedding (peft's modules_to_save), moved off the base's."""
    from safetensors.torch import load_file

    import train
    from model.load import CheckpointReader

    with one_thread():
        train.main(_argv(pairs, str(tmp_path / "simpo"), "--steps", "2", "--train-embeddings", "--dpo-loss", "simpo",
                         "--dpo-beta", "2", "--lr", "1e-2", "--eval-every", "0"))
    m = _metrics(str(tmp_path / "simpo"))
    assert len(m) == 2 and all(math.isfinite(r["loss"]) for r in m), m
    emb = load_file(str(tmp_path / "simpo" / "adapter" / "adapter_model.safetensors"))[
        "base_model.model.model.embed_tokens.weight"]
    base = CheckpointReader(pairs["model"]).get("model.embed_tokens.weight").float()
    assert emb.shape == base.shape and (emb - base).abs().max() > 1e-4


def test_start_up_refusals_name_the_fix(pairs, assets, tmp_path):
    out = str(tmp_path / "err")
    said = startup_error(train_argv(pairs, out))   # pairs, no --objective dpo: from the first line, before tokenizing
    assert f"--data {pairs['data']} line 1 is a preference pair" in said and "pass --objective dpo" in said
    said = startup_error(train_argv(assets, out, *DPO))   # chat records with it
    assert f"--objective dpo: --data {assets['data']} line 1 is not a preference pair" in said
    said = startup_error(train_argv(pairs, out, *DPO, "--eval-data", assets["data"]))
    assert "--eval-data" in said and "give an eval file of pairs, or --eval-split" in said
    lines = open(pairs["data"]).read().splitlines(True)
    mixed = tmp_path / "mixed.jsonl"   # (a pair first, then a chat record: the whole file's count)
    mixed.write_text("".join(lines) + open(assets["data"]).readline())
    said = startup_error(train_argv({**pairs, "data": str(mixed)}, out, *DPO))   # (named before tokenizing)
    assert f"--objective dpo: --data {mixed} line 31 is not a preference pair: DPO trains on" in said, said
    assert "give the others in a file of their own" in said
    mixed.write_text(open(assets["data"]).readline() + "".join(lines[:3]))   # (a chat record first, then pairs)
    said = startup_error(train_argv({**pairs, "data": str(mixed)}, out))
    assert f"--data {mixed} line 2 is a preference pair (\"chosen\"/\"rejected\") (and 2 more of its 4 records)" in said
    tied = tmp_path / "tied.jsonl"
    tied.write_text(json.dumps({"prompt": "Q?", "chosen": " yes", "rejected": " yes"}) + "\n")
    said = startup_error(train_argv({**pairs, "data": str(tied)}, out, *DPO))
    assert "every preference pair is tied" in said and "a longer --max-len keeps them" in said, said
    said = startup_error(train_argv(pairs, out, *DPO, "--init-adapter", str(tmp_path)))
    assert f"--init-adapter {str(tmp_path)!r}: no adapter_config.json" in said, said
    for beta in ("0", "inf", "nan"):
        assert "--dpo-beta must be a finite number above 0" in startup_error(train_argv(pairs, out, "--objective",
                                                                                        "dpo", "--dpo-beta", beta))
    for flag, v, said in (("--dpo-beta", "0.5", "0.5"), ("--dpo-loss", "ipo", "ipo"), ("--rpo-alpha", "1", "1.0"),
                          ("--dpo-label-smoothing", "0.1", "0.1"), ("--simpo-gamma", "1", "1.0")):   # (SFT runs)
        assert f"{flag} {said} sets a preference loss (--objective dpo), and this run is supervised: pass " \
               f"--objective dpo to train on preference pairs, or drop {flag}" in startup_error(
                   train_argv(assets, out, flag, v))
    for flags, want in ((["--dpo-label-smoothing", "0.5"], "--dpo-label-smoothing must be in [0, 0.5)"),
                        (["--dpo-label-smoothing", "0.1", "--dpo-loss", "ipo"], "sigmoid only, not ipo: drop it"),
                        (["--rpo-alpha", "-1"], "--rpo-alpha must be a finite number of 0 or more"),
                        (["--rpo-alpha", "nan"], "--rpo-alpha must be a finite number of 0 or more"),
                        (["--dpo-loss", "orpo", "--rpo-alpha", "1"], "which --dpo-loss orpo has already"),
                        # (1e-200: its start loss 1 / (2 beta)^2 was a ZeroDivisionError once the weights were read)
                        (["--dpo-loss", "ipo", "--dpo-beta", "1e-200"], "--dpo-beta 1e-200 with --dpo-loss ipo: IPO's "
                                                                        "loss starts at 1 / (2·beta)², past float32's"),
                        (["--dpo-loss", "ipo", "--dpo-beta", "1e-25"], "past float32's range, where its gradients"),
                        (["--simpo-gamma", "1"], "--simpo-gamma 1: SimPO's target margin, a finite number of 0 or "
                                                 "more (typical: 0.5 to 1.6), with --dpo-loss simpo only"),
                        (["--dpo-loss", "simpo", "--simpo-gamma", "-0.5"], "--simpo-gamma -0.5: SimPO's target margin, "
                                                                          "a finite number of 0 or more")):
        assert want in startup_error(train_argv(pairs, out, *DPO, *flags)), flags
    assert "embedded demo is supervised" in startup_error(["--objective", "dpo", "--out", out])
    import train
    keep = train.LOSS_FN
    train.LOSS_FN = lambda z, y: F.cross_entropy(z, y, reduction="sum")
    try:
        assert "set LOSS_FN = None" in startup_error(train_argv(pairs, out, *DPO))
        train.LOSS_FN = lambda z, y: F.cross_entropy(z, y)   # a mean: still this (not "return the SUM", whose fix
        assert "set LOSS_FN = None" in startup_error(train_argv(pairs, out, *DPO))   # DPO then refused; helper 59)
    finally:
        train.LOSS_FN = keep
    bad = tmp_path / "bad.jsonl"
    for line, want in (({"prompt": "q", "chosen": " a"}, 'line 1: has "chosen" but no "rejected"'),
                       ({"prompt": "q", "chosen": " a", "rejected": " b", "tools": [{"type": "function"}]},
                        'line 1: "chosen" side: "tools" goes with a "messages" record'),
                       ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                         "rejected": "b"}, '"rejected" is a string and the other side a list of messages, with no '
                                           '"prompt"'),
                       ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}],
                         "chosen": " a", "rejected": " b"}, 'line 1: "prompt" ends with an assistant message, a '
                                                             "prefill that TRL has each side continue")):
        bad.write_text(json.dumps(line) + "\n")
        assert want in startup_error(train_argv({**pairs, "data": str(bad)}, out, *DPO))


def test_share_prompt_refusals_name_the_fix(pairs, assets, tmp_path):
    """--dpo-share-prompt is refused, before any weight, on a supervised run and on a model with a sliding window
    shorter than a row (a branch's distance to its prompt is its positions', not the row's)."""
    import train
    from model import ModelArgs
    from parallel.mesh import validate

    out = str(tmp_path / "err")
    said = startup_error(train_argv(assets, out, "--dpo-share-prompt"))
    assert "--dpo-share-prompt holds a preference pair's prompt once, and this run is supervised: pass --objective " \
           "dpo" in said, said
    args = train.build_parser().parse_args(["--objective", "dpo", "--dpo-share-prompt", "--max-len", "64"])
    model = lambda sliding, layers: ModelArgs(model_type="mistral", vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                              n_kv_heads=2, intermediate_size=48, sliding_window=sliding,
                                              layer_types=layers)
    for layers in (None, ["full_attention", "sliding_attention"]):
        for window in (6, 63):
            with pytest.raises(ValueError, match=f"a sliding window \\(this model's, {window} tokens, shorter than a "
                                                 "side's --max-len 64\\) would measure by the row"):
                validate(args, model(window, layers), 1)
    validate(args, model(6, ["full_attention"] * 2), 1)   # (no layer slides)
    validate(args, model(64, None), 1)   # (a window of --max-len cuts no side: none; review, helper 45: refused below
    # a pair's 2 × --max-len)
    # unpacked rows of several pairs are padded to the longest pair, and the padding joins the branch: 2 × --max-len
    # (review, helper 47: this passed start-up and crashed at step 1)
    unpacked = train.build_parser().parse_args(["--objective", "dpo", "--dpo-share-prompt", "--max-len", "64",
                                                "--no-pack", "--micro-batch", "2", "--global-batch", "8"])
    with pytest.raises(ValueError, match="shorter than an unpacked row padded to 128 tokens"):
        validate(unpacked, model(64, None), 1)
    validate(unpacked, model(128, None), 1)
    # --fast may choose --tiled-attn for a shared-prompt run, and the run takes it (review, helper 44: it chose it
    # when the two were refused together, and the run refused its own choice)
    import contextlib
    import io
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        train.main(["--plan", "--fast", "--model", "bench/configs/qwen2.5-7b", "--objective", "dpo",
                    "--dpo-share-prompt", "--max-len", "65536", "--global-batch", "1", "--dtype", "bf16",
                    "--gpu-mem", "47.6"])
    assert "--fast: --tiled-mlp --tiled-attn" in said.getvalue() and "fits:" in said.getvalue(), said.getvalue()[-800:]


def test_a_cache_file_that_cannot_be_written_is_a_warning(tmp_path):
    """--dpo-cache-ref's file is a cache: a write the disk refuses (torch.save says it as a RuntimeError, here a folder
    that is not there) is a warning, and the run goes on with the values kept in memory (review, helper 47: it
    stopped every rank with a traceback)."""
    from parallel.ref_cache import RefCache

    said = []
    cache = RefCache(2, "cpu", str(tmp_path / "gone" / "reference_logps.pt"), {}, said.append)
    cache.add([0, 1], torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64), 1.0)
    cache.sync(None, [1, 0, 1])
    assert cache.known([0, 1]) and cache.values.tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    assert said[0].startswith(f"warning: {tmp_path / 'gone' / 'reference_logps.pt'} could not be written ("), said
    assert not os.path.exists(tmp_path / "gone")


def test_a_cache_is_kept_for_the_rope_scaling_it_means(tmp_path):
    """The cache's identity holds --rope-scaling as a resume compares it: "yarn:2" and "yarn:2.0" (which a resume
    accepts as the same scaling) read each other's file; another factor does not (review, helper 51: a respelling
    computed every value again). A file kept by other code (model/, parallel/, loss.py; a fork's edit) is computed
    again, said as such."""
    from types import SimpleNamespace

    from parallel.ref_cache import ref_caches

    def cache(rope, said):
        args = SimpleNamespace(out=str(tmp_path), data_tokens="3 samples, 9 tokens, sha256 " + "a" * 64,
                               model_sha256="b" * 64, quant="nf4", dtype="bf16", rope_scaling=rope, max_len=64,
                               dpo_reference="base")
        dpo = SimpleNamespace(cache={})
        ref_caches(dpo, args, {"train": [0, 1, 2], "eval": None}, "cpu", said.append)
        return dpo.cache["train"]

    first = cache("yarn:2", [])
    first.add([0, 1, 2], torch.arange(-6.0, 0.0, dtype=torch.float64), 1.0)
    first.sync(None, [0, 1, 2])   # (all known: written)
    said = []
    again = cache("yarn:2.0", said)
    assert again.known([0, 1, 2]) and again.values.tolist() == first.values.tolist(), said
    said = []
    assert not cache("yarn:4", said).known([0]) and "was kept for another model, reference or data" in said[0], said
    # kept by other code (an edit in model/, parallel/ or loss.py, or another torch): computed again, said as such
    import shutil

    import parallel.ref_cache as pref
    root = os.path.dirname(os.path.dirname(os.path.abspath(pref.__file__)))
    copy = tmp_path / "code"
    for d in ("model", "parallel"):
        shutil.copytree(os.path.join(root, d), copy / d)
    shutil.copy(os.path.join(root, "loss.py"), copy / "loss.py")
    real = pref.code_digest()
    assert pref.code_digest(str(copy)) == real and len(real) == 64
    with open(copy / "parallel" / "ring.py", "a") as f:
        f.write("\n# a fork's edit\n")
    edited = pref.code_digest(str(copy))
    assert edited != real
    import unittest.mock
    said = []
    with unittest.mock.patch.object(pref, "code_digest", lambda: edited):
        assert not cache("yarn:2", said).known([0]), said
    assert "was kept by other code (model/, parallel/ or loss.py edited since, or another torch)" in said[0], said


def _two_window(rank, world_size, a, root):
    import train

    train.main(_argv(a, os.path.join(root, "shared_ulysses"), "--dpo-share-prompt", "--micro-batch", "2", "--cp", "2",
                     "--cp-impl", "ulysses", *TWO))


@pytest.mark.timeout(300)
def test_shared_prompts_train_under_a_window_that_cuts_no_side(pairs, tmp_path):
    """A model whose sliding window (on one layer) is --max-len: no side reaches past it, so --dpo-share-prompt runs
    (refused before: the check took a pair's 2 × --max-len) with 2 pairs a micro-batch, rows of four sides longer than
    the window (crashed at step 1 on one process and Ulysses: review, helper 45) = the plain run: losses, grad
    norms (2 steps), adapter."""
    import shutil

    import train

    model = str(tmp_path / "window64")
    shutil.copytree(pairs["window"], model)
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg["sliding_window"] = 64   # (= --max-len; layer 1 slides)
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    a = {**pairs, "model": model}
    root = str(tmp_path)
    with one_thread():
        train.main(_argv(a, os.path.join(root, "plain"), "--micro-batch", "2", *TWO))
        train.main(_argv(a, os.path.join(root, "shared"), "--dpo-share-prompt", "--micro-batch", "2", *TWO))
    run_ranks(_two_window, 2, a, root, timeout=240)
    for name in ("shared", "shared_ulysses"):
        got, want = _metrics(os.path.join(root, name)), _metrics(os.path.join(root, "plain"))
        assert [r["step"] for r in got] == [1, 2]
        for g, w in zip(got, want):
            assert abs(g["loss"] - w["loss"]) <= 1e-5 and abs(g.get("eval_loss", 0) - w.get("eval_loss", 0)) <= 1e-5, (
                name, g, w)
            assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * w["grad_norm"], (name, g, w)
            assert g["tokens"] < w["tokens"], (name, g["tokens"], w["tokens"])
        a_, b_ = _adapter(os.path.join(root, name)), _adapter(os.path.join(root, "plain"))
        assert max(((a_[k] - b_[k]).norm() / b_[k].norm()).item() for k in b_) <= ADAPTER_RTOL, name


def test_data_show_names_each_side(pairs, capsys):
    """`python -m data.show` on a pair file: each record's two samples headed chosen and rejected, in that order, as
    train.py tokenizes them."""
    from transformers import AutoTokenizer

    from data.jsonl import load_jsonl
    from data.show import main
    from data.tokens import tokenize_records

    assert main(["--model", pairs["model"], "--data", pairs["data"], "--n", "3", "--max-len", "64", "--no-color"]) == 0
    heads = [x for x in capsys.readouterr().out.splitlines() if x.startswith(pairs["data"] + ":")]
    tok = AutoTokenizer.from_pretrained(pairs["model"])
    want = []
    for rec in load_jsonl(pairs["data"])[:3]:
        samples, _ = tokenize_records([rec], tok, 64, pairs["data"])
        want += [f"{pairs['data']}:{rec['line']} {side}: {len(s['input_ids'])} tokens"
                 for side, s in zip(("chosen", "rejected"), samples)]
    assert len(heads) == len(want) == 6 and all(h.startswith(w) for h, w in zip(heads, want)), (heads, want)
    # a tied pair's reason, and "cut" on the side that lost tokens only (review, helper 38)
    path = os.path.join(os.path.dirname(pairs["data"]), "show_pairs.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "Q?", "chosen": " same", "rejected": " same"}) + "\n")
        f.write(json.dumps({"prompt": "Q?", "chosen": " short", "rejected": " long" * 40}) + "\n")
    assert main(["--model", pairs["model"], "--data", path, "--max-len", "24", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert f"{path}:1: tied: its chosen and rejected sides are the same tokens" in out
    assert re.search(f"{re.escape(path)}:2 chosen: \\d+ tokens, \\d+ targets\n", out), out
    assert re.search(f"{re.escape(path)}:2 rejected: 24 tokens, \\d+ targets \\(cut to --max-len\\)", out), out


def test_demo_compare_prompts_with_the_pairs(runs, pairs, capsys):
    """`python -m data.demo_compare` on a DPO run: its eval pairs that have a prompt, the chosen answer expected and
    the rejected one beside it (text pairs, with no prompt, are left out); the base's and the adapter's answers."""
    from data.demo_compare import main
    from data.jsonl import load_jsonl

    assert main([os.path.join(runs, "dpo"), "--n", "4", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    recs = [r for r in load_jsonl(pairs["data"]) if "text" not in r["pair"][0]][:4]
    want = [(r["pair"][0].get("completion") or r["pair"][0]["messages"][-1]["content"],
             r["pair"][1].get("completion") or r["pair"][1]["messages"][-1]["content"]) for r in recs]
    got = re.findall(r"expected: (.*)\n  rejected: (.*)\n  base: ", out)
    assert got == [(a.strip(), b.strip()) for a, b in want] and out.count("  tuned: ") == 4, out
