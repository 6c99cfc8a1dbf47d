"""OLMo 3, SmolLM3 and Granite (model/gemma.py, model/arch_fields.py) through the rest of the trainer: train.py end to
end, eval, DPO, the merge and --compile (the decoders themselves: tests/test_olmo.py, tests/test_smollm3_granite.py).

Pins (CPU, gloo, tiny random checkpoints made by transformers with the fixture tokenizer: 2 layers, 6 query / 2 KV heads
under hidden 48; OLMo 3 sliding (a window shorter than the rows) then full with its two RoPE tables, SmolLM3 a RoPE
then a NoPE layer, Granite tied with its multipliers far from 1; norm weights drawn off their identity and the
embeddings and head × 30, so the logits are far from uniform and Granite's logits scale shows):
- train.py, 2 steps of --global-batch 4 (`SHORT`: nothing resumes): 1 rank = cp2 × dp_shard2 ring (2 packed documents
  a row, --micro-batch 2: one micro-batch a step) and Ulysses (two, accumulated), with --tiled-mlp
  --offload-activations, in every step's loss and grad norm and the adapter (test_train's tolerances): OLMo 3 (the
  tiled MLP with no norm in front of it; its sliding window) under both, SmolLM3 (the NoPE layer) under ring, Granite
  (its multipliers, elementwise: nothing of CP's) under Ulysses (`FOUR_OF`);
- Granite (its logits scaled in place on the final norm's output): a run with --train-norms --sft-loss dft and
  --eval-data: the last step's eval_loss and eval_token_acc = transformers' GraniteForCausalLM with peft's load of the
  saved adapter on the same records (F.cross_entropy, argmax); DPO with --train-norms (the final norm's reference
  weight) on a packed micro-batch of pairs = the DPO formula on transformers' + peft's logits and transformers' base
  model's, losses and every trained gradient; under --ac, --no-ac and --compile with the tiled MLP and attention (with
  --train-embeddings, the tied
  head the embedding) no tensor autograd saved shares the final norm's output (the in-place scale would corrupt it,
  and autograd's version counter raises), and the loss and every gradient = peft's;
- `model.merge` of an OLMo 3 and a Granite adapter with --train-norms (--quant none and nf4) = peft's merge_and_unload
  on transformers' model, tensor by tensor, and transformers on the merged folder gives peft's logits;
- --compile on OLMo 3 (its GemmaRMSNorm offset 0, whole-width q/k norms) = eager, loss and every gradient, with the
  tiled MLP and attention and --train-norms (Granite's compiled build, tiled too: against peft, above).

Run: .venv/bin/python -m pytest -q tests/test_olmo_smollm3_granite_run.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from tests.dist import run_ranks
from tests.helpers import one_thread, train_argv
from tests.test_train import _compare, _metrics

TYPES = ["sliding_attention", "full_attention"]
ROPE3 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
SIZES = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=4096, bos_token_id=None)
MULT = dict(embedding_multiplier=7.0, residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=4.0)
CONFIGS = {"olmo3": (T.Olmo3Config, dict(SIZES, sliding_window=16, layer_types=TYPES, rope_parameters=ROPE3)),
           "smollm3": (T.SmolLM3Config, dict(SIZES, no_rope_layer_interval=2, rope_theta=3e4)),
           "granite": (T.GraniteConfig, dict(SIZES, **MULT, rope_theta=3e4, tie_word_embeddings=True))}
SHORT = ["--steps", "2", "--global-batch", "4"]   # the runs of `runs`
MEM = ["--tiled-mlp", "--offload-activations"]
FOUR = {"ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *MEM],
        "ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *MEM]}
FOUR_OF = {"olmo3": ("ring_pack_mb2", "ulysses"), "smollm3": ("ring_pack_mb2",), "granite": ("ulysses",)}
EVAL = ["--train-norms", "--sft-loss", "dft", "--eval-every", "1"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The three checkpoints (module docstring) beside the fixture tokenizer, chat data and held-out chat records."""
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    d = tmp_path_factory.mktemp("arch_run")
    out = {"data": str(d / "chat.jsonl"), "eval": str(d / "eval.jsonl")}
    make_chat_jsonl(out["data"], 40, seed=1)
    make_chat_jsonl(out["eval"], 6, seed=9)
    for name, (cls, cfg) in CONFIGS.items():
        tok = make_tokenizer(d / name)
        torch.manual_seed(0)
        hf = T.AutoModelForCausalLM.from_config(cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                                    eos_token_id=tok.eos_token_id, **cfg)).float()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:   # transformers starts them at 1: a dropped one would hide
                    p.add_(torch.randn_like(p) * 0.3)
                elif "embed" in n or "lm_head" in n:   # logits far from uniform (init 0.02: all ~0)
                    p.mul_(30)
        hf.save_pretrained(d / name)
        out[name] = str(d / name)
    return out


def _argv(assets, name, out, *flags):
    return train_argv({"model": assets[name], "data": assets["data"]}, out, *flags)


def _four_ranks(rank, world_size, assets, root):
    import train

    for name, layouts in FOUR_OF.items():
        for layout in layouts:
            train.main(_argv(assets, name, os.path.join(root, f"{name}_{layout}"), *SHORT, *FOUR[layout]))


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The 1-rank runs in this process, the 4-rank ones in one spawn (one test reads them: one xdist worker runs it)."""
    import train

    root = str(tmp_path_factory.mktemp("arch_runs"))
    with one_thread():
        for name in CONFIGS:
            train.main(_argv(assets, name, os.path.join(root, f"{name}_plain"), *SHORT))
    run_ranks(_four_ranks, 4, assets, root, timeout=540, pg_timeout=120)
    return root


@pytest.mark.timeout(900)
def test_four_ranks_with_tiled_mlp_and_offload_train_as_one_rank(runs):
    assert set(FOUR_OF) == set(CONFIGS) and {la for v in FOUR_OF.values() for la in v} == set(FOUR)
    for name, layouts in FOUR_OF.items():
        for layout in layouts:
            _compare(f"{name} {layout}", os.path.join(runs, f"{name}_{layout}"), os.path.join(runs, f"{name}_plain"),
                     steps=(1, 2))


@pytest.mark.timeout(300)
def test_granite_eval_loss_and_accuracy_are_transformers_with_the_saved_adapter(assets, tmp_path):
    """The last step's eval (after its update: the saved adapter) of a --train-norms --sft-loss dft run = transformers'
    GraniteForCausalLM (logits / logits_scaling) with peft's load of the adapter: the mean F.cross_entropy over every
    held-out target and the share whose argmax is the target."""
    import math

    from peft import PeftModel

    import train
    from data.load import load_samples, load_tokenizer

    out = str(tmp_path / "run")
    with one_thread():
        train.main(_argv(assets, "granite", out, *EVAL, "--eval-data", assets["eval"]))
    last = _metrics(out)[-1]
    tok = load_tokenizer(assets["granite"])
    samples, _ = load_samples(assets["eval"], tok, 64, len(tok), flag="--eval-data")
    base = T.AutoModelForCausalLM.from_pretrained(assets["granite"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    loss = hits = n = 0
    o = samples.offsets
    with torch.no_grad():
        for i in range(len(o) - 1):
            ids, lab = samples.ids[o[i]:o[i + 1]].long(), samples.labels[o[i]:o[i + 1]].long()
            z = peft(input_ids=ids[None]).logits[0]
            keep = lab != -100
            loss += F.cross_entropy(z[keep], lab[keep], reduction="sum").item()
            hits, n = hits + (z[keep].argmax(-1) == lab[keep]).sum().item(), n + keep.sum().item()
    assert n > 20 and abs(loss / n - math.log(len(tok))) > 0.5, (loss / n, n)   # (not uniform logits: the scale shows)
    assert abs(last["eval_loss"] - loss / n) < 1e-4, (last, loss / n)
    assert abs(last["eval_token_acc"] - hits / n) < 1e-9, (last, hits / n)


# ----------------------------------------------------------------------------- DPO, saved tensors, merge, compile


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [dict(ac=True), dict(ac=False), dict(ac=True, compile=True, tiled_mlp=True,
                                                                       tiled_attn=True)],
                         ids=["ac", "no_ac", "ac_compile_tiled"])
def test_granites_in_place_logits_scale_touches_nothing_autograd_saved(assets, mode):
    """Granite with --train-norms --train-embeddings (tied: the head is the trained embedding): no tensor autograd saved
    in the forward shares the final norm's output, which the loss path divides by logits_scaling in place; the backward
    runs (autograd's version counters) and the loss and every trained gradient = peft's on transformers' model."""
    from tests.test_norms import _batch, _ours, _peft_twin

    model, _ = _ours(assets["granite"], emb=True, **mode)
    ref, mine, theirs = _peft_twin(assets["granite"], "none", model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and "model.norm.weight" in mine
    out, saved = [], []
    model.model.norm.register_forward_hook(lambda m, i, o: out.append(o))

    def pack(t):
        saved.append(t)
        return t

    ids, labels, pos = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours, _ = model(ids, position_ids=pos, labels=labels)
    ptr = out[0].untyped_storage().data_ptr()
    assert len(out) == 1 and out[0]._version > 0 and len(saved) > 10, (len(out), len(saved))   # (scaled in place)
    assert not [t.shape for t in saved if t.numel() and t.untyped_storage().data_ptr() == ptr]
    ours.backward()
    want = F.cross_entropy(ref(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="sum")
    want.backward()
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg="summed loss")
    for n, p in mine.items():
        assert theirs[n].grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad {n}")


def test_granite_dpo_with_trained_norms_equals_the_formula_on_transformers(assets):
    """parallel.preference.DPO on a packed micro-batch of two pairs, Granite's policy with --train-norms (the final
    norm's reference weight: the base's) moved off the base, LoRA B != 0: the losses = the DPO formula on log_softmax
    of peft's model holding our tensors (the policy) and of transformers' base model (the reference), each sequence
    alone, both through logits / logits_scaling; every trained gradient = peft's."""
    from data.collate import collate
    from parallel.cp import KernelAttention
    from parallel.preference import DPO, Preference
    from tests.test_dpo import _formula, _pair
    from tests.test_norms import _ours, _peft_twin

    path = assets["granite"]
    model, _ = _ours(path)
    model.attention = KernelAttention()
    ref_model, mine, theirs = _peft_twin(path, "none", model)
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
    assert bool((want.detach() - torch.log(torch.tensor(2.0))).abs().min() > 1e-3), "the policy is the reference"
    for k in mine:
        rel = ((mine[k].grad - theirs[k].grad).norm() / theirs[k].grad.norm()).item()
        assert theirs[k].grad.norm() > 0 and rel < 1e-4, f"grad {k}: relative difference {rel:.2e}"


def _tensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in os.listdir(folder) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, f)).items()}


@pytest.mark.parametrize("quant", ["none", "nf4"])
@pytest.mark.parametrize("name", ["olmo3", "granite"])
def test_merge_with_trained_norms_equals_peft_merge_and_unload(assets, tmp_path, name, quant):
    """`python -m model.merge` (its main) of our --train-norms adapter (Granite's with its tied embedding trained too):
    peft's merge_and_unload on transformers' model (nf4: holding the weights our NF4 layers compute with), tensor by
    tensor; transformers on the merged folder gives peft's logits, ours."""
    from peft import PeftModel

    from model.export import export_adapter
    from model.merge import main as merge_main
    from tests.helpers import hf_as_trained
    from tests.test_norms import _batch, _ours

    path, emb = assets[name], name == "granite"
    ours, peft_model = _ours(path, quant, emb=emb)
    export_adapter(peft_model, str(tmp_path / "adapter"), path)
    ids, _, pos = _batch()
    peft = PeftModel.from_pretrained(hf_as_trained(path, quant), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want_logits = peft(input_ids=ids).logits
        torch.testing.assert_close(ours(ids, position_ids=pos), want_logits, rtol=1e-5, atol=1e-5, msg="ours = peft")
    want = peft.merge_and_unload().state_dict()
    assert merge_main(["--model", path, "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"),
                       "--quant", quant, "--dtype", "fp32"]) == 0
    got, base = _tensors(tmp_path / "merged"), _tensors(path)
    no_head = {"lm_head.weight"} if emb else set()   # (tied: no head stored)
    assert set(got) == set(want) - no_head, sorted(set(got) ^ set(want))
    moved = [k for k in got if ("norm" in k or "embed" in k) and not torch.equal(got[k], base[k])]
    assert len(moved) == (4 if name == "olmo3" else 2) * 2 + 1 + emb, moved
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=f"merged {k}")
    merged = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want_logits, rtol=1e-5, atol=5e-5,
                                   msg=lambda m: "transformers on the merged folder: " + m)


@pytest.mark.timeout(300)
def test_olmo3_compile_equals_eager(assets):
    """--compile (parallel/compile.py: OLMo's GemmaRMSNorm, offset 0, its whole-width q/k norms, SwiGLU) with AC, the
    tiled MLP (its norm rebuild with no norm in front) and attention and --train-norms: the loss and every gradient =
    the eager build's (Granite's compiled run against peft: above)."""
    from model.gemma import GemmaRMSNorm
    from model.llama import SwiGLU
    from model.rmsnorm import RMSNorm
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b, step_of

    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, ac=True, train_norms=True)
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))
    ref = step_of(build_nonzero_b(BuildOptions(assets["olmo3"], **opts))[0], ids)
    model, _ = build_nonzero_b(BuildOptions(assets["olmo3"], compile=True, tiled_mlp=True, tiled_attn=True, **opts))
    pieces = [m for m in model.modules() if isinstance(m, (GemmaRMSNorm, RMSNorm, SwiGLU))]
    forwards = [getattr(m.forward, "norm_forward", m.forward) for m in pieces]   # (block norms: apply_norm_rebuild)
    assert len(pieces) == 2 * 5 + 1 and all(
        hasattr(getattr(f, "compiled", f), "_torchdynamo_orig_callable") for f in forwards), forwards
    loss, grads = step_of(model, ids)
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-6, msg="loss")
    assert grads.keys() == ref[1].keys() and len(grads) == 14 * 2 + 4 * 2 + 1, len(grads)
    for k in grads:   # (relative to the tensor's norm: the × 30 head makes single elements' rounding larger)
        rel = ((grads[k] - ref[1][k]).norm() / ref[1][k].norm()).item()
        assert ref[1][k].norm() > 0 and rel < 1e-5, f"grad {k}: relative difference {rel:.2e}"
