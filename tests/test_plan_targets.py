"""The memory plan's saved tensors (parallel/plan_saved.py) under --lora-targets that adapt only some projections.

Pins: on a tiny Qwen2-shaped (Llama's layout, q/k/v bias) checkpoint, fp32 compute, one process, 128 tokens, the
plan's activation terms = the bytes autograd keeps for backward in a real forward (tests.helpers'
planned_and_saved_activations: unique storages, parameters excluded) for each projection adapted alone, attention
only, MLP only, o_proj,gate_proj,up_proj and the default seven, with no AC, --tiled-mlp, --tiled-attn, LoRA dropout,
--dora, the CPU's bf16 (LoRA in float32) and --ac-blocks with --lora-layers (the lowest adapted block kept whole).

The block the plan gets wrong without targets on q/k/v is the lowest adapted one (block lo, layer 0 here), whose
input needs no grad: only what an adapted projection makes needs grad there. With gate_proj alone its attention
kernel keeps nothing (planned: q, k, v, out, lse, 100,352 bytes at these sizes), the MLP's norm nothing (its
rsqrt, 512) and silu(gate) is not kept (up needs no grad: one [T, F] fewer, 49,152): 150,016 bytes over before
2026-12-07; o_proj alone: the kernel's tensors but out, which o_proj's LoRA A keeps (67,584 over). With
--lora-layers 1 of 2 and --ac-blocks 1 (block 1 the only one with a backward, kept whole) and neither q_proj nor k_proj
adapted, no RoPE multiply keeps cos/sin (16,384 over before), but for --tiled-attn's tiles, where the sublayer's
output needs grad.

Run: .venv/bin/python -m pytest -q tests/test_plan_targets.py
"""

from __future__ import annotations

import pytest
import torch

import train
from parallel.parallelize import BuildOptions, build_model
from tests.helpers import planned_and_saved_activations, tiny_checkpoint

P = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN, MLP, OGU = P[:4], P[4:], ("o_proj", "gate_proj", "up_proj")
EVERY = [(p,) for p in P] + [ATTN, MLP, OGU, P]   # each alone, attention, MLP, the three, the default
SOME = [("o_proj",), ("gate_proj",), ("up_proj",), ("down_proj",), MLP, OGU]   # the cases block lo differs in


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128,
                           inter=96, max_shard_size="50MB")


@pytest.mark.parametrize("flags,cases", [
    (["--no-ac"], EVERY), (["--no-ac", "--tiled-mlp"], SOME + [ATTN]), (["--no-ac", "--tiled-attn"], SOME + [ATTN]),
    (["--no-ac", "--lora-dropout", "0.1"], SOME + [ATTN]), (["--no-ac", "--dora"], SOME),
    (["--no-ac", "--dora", "--lora-dropout", "0.1"], [("o_proj",), ("gate_proj",), ("down_proj",)]),
    (["--no-ac", "--dtype", "bf16"], [("o_proj",), ("up_proj",), ("down_proj",), OGU]),
    (["--ac-blocks", "1", "--lora-layers", "1"], [("k_proj",), ("v_proj",), ("o_proj",), ("gate_proj",),
                                                  ("down_proj",), MLP]),
    (["--ac-blocks", "1", "--lora-layers", "1", "--tiled-mlp", "--tiled-attn"], [("v_proj",), ("gate_proj",), OGU])],
    ids=["no_ac", "tiled_mlp", "tiled_attn", "dropout", "dora", "dora_dropout", "bf16", "ac_blocks_lora_layers",
         "ac_blocks_lora_layers_tiled_both"])
def test_partial_targets_activations_match_autograd(ckpt, flags, cases):
    """Each case of `cases` (the --lora-targets) under `flags`: planned = saved, to the byte (labelled per case)."""
    bad = {}
    for targets in cases:
        args = train.build_parser().parse_args(["--model", ckpt, "--max-len", "128", "--global-batch", "1",
                                                "--quant", "nf4", "--dtype", "fp32", "--lora-targets",
                                                ",".join(targets), *flags])
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        model, _ = build_model(BuildOptions.from_args(args, dtype), device="cpu")
        planned, saved, terms = planned_and_saved_activations(model, args)
        if planned != saved:
            bad[",".join(targets)] = (planned, saved, planned - saved)
    assert not bad, bad   # {targets: (planned, saved, planned - saved)}
