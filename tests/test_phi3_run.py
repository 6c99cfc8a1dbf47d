"""Phi-3 / Phi-4 (model/phi3.py) through train.py end to end: 4 gloo ranks train as 1 (the decoder itself:
tests/test_phi3.py).

Pins (CPU, gloo, a tiny random Phi-4-mini-form checkpoint made by transformers with the fixture tokenizer: 2 layers,
6 query / 2 KV heads under hidden 48, partial RoPE 0.75, LongRoPE from original_max_position_embeddings ORIG, tied
embeddings; norm weights drawn off 1, the embedding × 30 so the logits are far from uniform):
- train.py, 2 steps of --global-batch 4 at --max-len 160, --seed 2 (`LEN`; default --lora-targets: qkv_proj, o_proj,
  gate_up_proj, down_proj): 1 rank = cp 2 × dp_shard 2 ring (packed rows of several documents, --micro-batch 2) and
  Ulysses, both with --tiled-mlp --offload-activations, in every step's loss and grad norm and the adapter (test_train's
  tolerances). Documents on both sides of ORIG train together (the 8 samples of --seed 2's 2 steps hold both, and one of
  ORIG tokens: checked on data.batches' order): each takes its own factors (model.attention.document_spans), one of
  exactly ORIG tokens too, whose CP padding must not give it the long ones; and 1 rank with --no-pack --micro-batch 2
  (rows padded to the longer sample: padding restarts where it would pass ORIG, data.collate) = the plain run;
- the same run with the short factors as its long ones differs in its first loss (the long factors mattered);
- --compile = eager (loss and every LoRA gradient) on a row past the original length.

Run: .venv/bin/python -m pytest -q tests/test_phi3_run.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as T

from tests.dist import run_ranks
from tests.helpers import one_thread, train_argv
from tests.test_train import _compare, _metrics

# 2 steps of 4 (nothing resumes); --seed 2 puts documents on both sides of ORIG and one of ORIG into them (the test
# checks it)
ORIG, LEN = 141, ["--max-len", "160", "--steps", "2", "--global-batch", "4", "--seed", "2"]
# documents of 62..146 tokens and truncated ones of 160; one of 141 (odd):
# Ulysses pads it to 142, which would pass ORIG had its padding continued its positions (data.collate restarts it)
ROPE = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.5, 4.0, 9.0]}
SIZES = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=4096, bos_token_id=None, tie_word_embeddings=True)
MEM = ["--tiled-mlp", "--offload-activations"]
FOUR = {"ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *MEM, *LEN],
        "ulysses": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", *MEM, *LEN]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    d = tmp_path_factory.mktemp("phi3_run")
    out = {"data": str(d / "chat.jsonl")}
    make_chat_jsonl(out["data"], 40, seed=1)
    for name, rope in (("model", ROPE), ("short", dict(ROPE, long_factor=ROPE["short_factor"]))):
        tok = make_tokenizer(d / name)
        torch.manual_seed(0)
        hf = T.Phi3ForCausalLM(T.Phi3Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                            eos_token_id=tok.eos_token_id, original_max_position_embeddings=ORIG,
                                            **SIZES, rope_parameters=rope)).float()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:   # transformers starts them at 1: a dropped one would hide
                    p.add_(torch.randn_like(p) * 0.3)
                elif "embed" in n:   # logits far from uniform (init 0.02: all ~0)
                    p.mul_(30)
        hf.save_pretrained(d / name)
        out[name] = str(d / name)
    return out


def _four_ranks(rank, world_size, assets, root):
    import train

    for layout, flags in FOUR.items():
        train.main(train_argv(assets, os.path.join(root, layout), *flags))


@pytest.mark.timeout(900)
def test_four_ranks_train_as_one_rank(assets, tmp_path):
    import train
    from data.batches import GlobalBatches
    from data.load import load_samples, load_tokenizer

    root = str(tmp_path)
    tok = load_tokenizer(assets["model"])
    samples, _ = load_samples(assets["data"], tok, 160, len(tok))
    n = torch.diff(torch.as_tensor(samples.offsets)).tolist()
    flag = lambda name: int(LEN[LEN.index(name) + 1])
    order = GlobalBatches(len(n), flag("--global-batch"), flag("--seed")).permutation(0)   # (one epoch holds them)
    trained = [n[i] for i in order[:flag("--steps") * flag("--global-batch")]]
    assert min(trained) <= ORIG < max(trained) and ORIG in trained, f"{ORIG} vs {sorted(trained)}"
    with one_thread():
        train.main(train_argv(assets, os.path.join(root, "plain"), *LEN))
        train.main(train_argv({**assets, "model": assets["short"]}, os.path.join(root, "short"), *LEN))
        train.main(train_argv(assets, os.path.join(root, "no_pack_mb2"), "--no-pack", "--micro-batch", "2", *LEN))
    run_ranks(_four_ranks, 4, assets, root, timeout=540, pg_timeout=120)
    with open(os.path.join(root, "plain", "adapter", "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    for layout in [*FOUR, "no_pack_mb2"]:
        _compare(f"phi3 {layout}", os.path.join(root, layout), os.path.join(root, "plain"), steps=(1, 2))
    assert _metrics(os.path.join(root, "short"))[0]["loss"] != _metrics(os.path.join(root, "plain"))[0]["loss"], \
        "the long factors changed nothing"


@pytest.mark.timeout(600)
def test_compile_equals_eager(assets):
    """--compile (RMSNorm, the partial RoPE and SwiGLU compiled; qkv_proj's split outside them) = eager on a row past
    the original length (long factors), nf4, AC: the loss and every LoRA gradient."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = torch.randint(0, 100, (1, ORIG + 9), generator=torch.Generator().manual_seed(4))
    got = {}
    for compiled in (False, True):
        ours, peft_model = build_nonzero_b(BuildOptions(assets["model"], quant="nf4", lora_r=4, lora_alpha=8, seed=3,
                                                        ac=True, compile=compiled))
        s, n = ours(ids, labels=ids)
        (s / n).backward()
        got[compiled] = s.detach(), {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5, msg="loss")
    assert len(got[False][1]) == 4 * 2 * 2
    for k, g in got[False][1].items():
        torch.testing.assert_close(got[True][1][k], g, rtol=1e-4, atol=1e-6, msg=f"grad {k}")
