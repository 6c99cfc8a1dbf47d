"""GLM-4.5 (model/glm4_moe.py) through train.py end to end (the decoder itself: tests/test_glm4_moe.py).

Pins (CPU, gloo; one tiny random Glm4MoeForCausalLM saved by transformers 5 with the fixture tokenizer and an MTP
layer's tensors in the checkpoint: tests/test_glm4_moe.py's sizes, a dense block then two MoE blocks with the group-
limited router, shared experts, q/k/v biases and q/k norm; embeddings and head × 30 so the logits are far from uniform):
- train.py, 2 steps of --global-batch 8 (nothing resumes), nf4, no --lora-targets (the attention's, said at
  start-up): 1 rank = 4 ranks as cp 2 ring × dp_shard 2 (packed, --micro-batch 2: 2 accumulated a step, --tiled-mlp,
  --offload-activations): every step's loss and grad norm and the adapter (test_train's tolerances); the run's
  adapter loads in peft on transformers' model.

Run: .venv/bin/python -m pytest -q tests/test_glm4_moe_run.py
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers as T

from tests.dist import run_ranks
from tests.helpers import one_thread, train_argv
from tests.test_glm4_moe import SIZES, save_checkpoint
from tests.test_train import _compare

FOUR = ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", "--tiled-mlp",
        "--offload-activations", "--quant", "nf4", "--steps", "2"]


def _train(rank, world_size, assets, out):
    import train

    train.main(train_argv(assets, out, *FOUR))
    return True


def make_assets(d) -> tuple[dict, int]:
    """The checkpoint (module docstring) beside the fixture tokenizer and chat data in folder `d`: ({"data": path,
    "model": path}, the vocabulary size)."""
    from tests.fixtures import make_chat_jsonl, make_tokenizer

    assets = {"data": str(d / "chat.jsonl"), "model": str(d / "glm")}
    make_chat_jsonl(assets["data"], 40, seed=1)
    tok = make_tokenizer(d / "glm")
    save_checkpoint(d / "glm", dict(SIZES, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id), scale_embeddings=30.0)
    return assets, len(tok)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The checkpoint and data, the 1-rank run and the 4-rank one: (assets, root, the 1-rank run's start-up output)."""
    import train

    d = tmp_path_factory.mktemp("glm_run")
    assets, _ = make_assets(d)
    root = str(d / "runs")
    with one_thread():
        train.main(train_argv(assets, os.path.join(root, "plain"), "--quant", "nf4", "--steps", "2"))
    assert run_ranks(_train, 4, assets, os.path.join(root, "four"), timeout=400, pg_timeout=60) == [True] * 4
    return assets, root


@pytest.mark.timeout(600)
def test_four_ranks_train_as_one_rank_and_the_adapter_loads_in_peft(runs):
    import json

    from peft import PeftModel

    assets, root = runs
    _compare("cp2 ring x dp_shard2", os.path.join(root, "four"), os.path.join(root, "plain"), steps=(1, 2))
    adapter = os.path.join(root, "plain", "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    pm = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32),
                                   adapter)
    lora = [n for n, _ in pm.named_parameters() if "lora_A" in n]
    assert len(lora) == 3 * 4 and all(".self_attn." in n for n in lora), lora
