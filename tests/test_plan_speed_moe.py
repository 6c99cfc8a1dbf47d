"""The step-time model (parallel/plan_speed.py) on MoE blocks: the GEMMs it times are model/flops.py's, which are
torch's FlopCounterMode's over transformers' own model, and the experts recompute, tile and dequantize as they run.

Pins:
- one source of truth: with no recompute (--no-ac) and no quantization, the matmul category is two passes (forward,
  input gradient) of `matmul_params` weights a token at MATMUL, for Qwen3-MoE (decoder_sparse_step 2: dense blocks
  among the MoE ones), Qwen3.5-MoE (shared expert) and Gemma 4 MoE (experts beside the dense MLP); and that count is
  FlopCounterMode's forward GEMMs (mm/addmm) over transformers' Qwen3MoeForCausalLM and Gemma4ForCausalLM a token
  (eager experts: each on its routed tokens). Until 2026-12-07 the model timed a dense MLP of intermediate_size in
  every block: no router, no shared expert, no Gemma 4 experts;
- AC recomputes an MoE block's experts whole (no down_proj base to skip: their outputs are read, weighted) and
  Gemma 4's experts even with --tiled-mlp (which tiles its dense MLP only, whose forward tiles its recompute runs);
- NF4: every expert's weights dequantized a pass, (0.5 + e)·E·3·I·D bytes at ELEMENTWISE: forward and backward, + the
  AC recompute; with --tiled-mlp the tiles' one dequantization serves their recompute (Qwen3-MoE).

Run: .venv/bin/python -m pytest -q tests/test_plan_speed_moe.py
"""

import os

import pytest
import torch
import transformers as T
from torch.utils.flop_counter import FlopCounterMode

import train
from model.flops import block_matmuls, matmul_params
from model.load import read_args
from parallel.mesh import validate
from parallel.plan_speed import RATES, step_seconds
from tests import test_gemma4_moe, test_qwen3_moe

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
TOKENS = 32768


def timed(m, *flags):
    """step_seconds' {category: seconds} for one row of TOKENS, bf16, attention LoRA."""
    args = train.build_parser().parse_args(["--max-len", str(TOKENS), "--dtype", "bf16", "--global-batch", "1",
                                            "--lora-targets", "attn", *flags])
    dims, pack = validate(args, m, 1)
    return step_seconds(m, dims, args, "cuda", pack)[1]


def gemm_weights(m, *flags):
    """The weights a token the matmul category times, from its seconds: a pass is 2·T·P / MATMUL."""
    return timed(m, *flags)["matmul"] * RATES["MATMUL"] / (2 * TOKENS)


@pytest.mark.parametrize("name, cls, config, cfg", [
    ("qwen3_moe", T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(test_qwen3_moe.SIZES, num_hidden_layers=4,
                                                               decoder_sparse_step=2, mlp_only_layers=[])),
    ("gemma4_moe", T.Gemma4ForCausalLM, T.Gemma4TextConfig, test_gemma4_moe.CONFIG)])
def test_timed_gemms_are_flops_and_the_counters(name, cls, config, cfg, tmp_path):
    c = config(**cfg, experts_implementation="eager")
    c._attn_implementation = "eager"
    c.save_pretrained(tmp_path)
    m = read_args(str(tmp_path))
    torch.manual_seed(0)
    hf, (b, s) = cls(c).float(), (2, 40)
    with FlopCounterMode(display=False) as counter:
        hf(torch.randint(0, m.vocab_size, (b, s)))
    gemm = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in (torch.ops.aten.mm,
                                                                                     torch.ops.aten.addmm))
    assert gemm == 2 * b * s * matmul_params(m), f"{name}: the counter's GEMMs vs flops.py's"
    assert gemm_weights(m, "--no-ac", "--quant", "none") == pytest.approx(2 * matmul_params(m), rel=1e-12), name


@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "qwen3.5-35b-a3b", "gemma-4-26b-a4b"])
def test_bench_configs_time_flops_gemms(config):
    m = read_args(os.path.join(BENCH, config))
    assert m.moe is not None
    assert gemm_weights(m, "--no-ac", "--quant", "none") == pytest.approx(2 * matmul_params(m), rel=1e-12), config


def test_ac_recomputes_the_experts_whole():
    """Qwen3-30B-A3B, nf4: the AC recompute of every block is a whole block's forward (experts' down included: the
    skip is the dense down_proj's); Gemma 4 26B-A4B with --tiled-mlp: the recompute runs the attention alone (the
    feed-forward unit, dense MLP, router, experts and norms, is skipped there: parallel/memory.py; until 2026-12-07
    the experts stayed outside the tiles and were recomputed), and the backward tiles run the unit's GEMMs, down's
    too (its post norm reads it in the tile), x TILE."""
    q = read_args(os.path.join(BENCH, "qwen3-30b-a3b"))
    per_block = sum(sum(block_matmuls(q, i).values()) for i in range(q.n_layers))
    ac = gemm_weights(q, "--quant", "nf4") - gemm_weights(q, "--quant", "nf4", "--no-ac")
    assert ac == pytest.approx(per_block, rel=1e-12)
    g = read_args(os.path.join(BENCH, "gemma-4-26b-a4b"))
    bm = [block_matmuls(g, i) for i in range(g.n_layers)]
    attention = sum(b["q"] + b["kv"] + b["o"] for b in bm)
    tiles = RATES["TILE"] * sum(b["gate_up"] + b["down"] + b["beside"] for b in bm)
    ac = gemm_weights(g, "--quant", "nf4", "--tiled-mlp") - gemm_weights(g, "--quant", "nf4", "--tiled-mlp", "--no-ac")
    assert ac == pytest.approx(attention, rel=1e-12)
    assert gemm_weights(g, "--quant", "nf4", "--tiled-mlp", "--no-ac") - gemm_weights(
        g, "--quant", "nf4", "--no-ac") == pytest.approx(tiles, rel=1e-12)


@pytest.mark.parametrize("flags, passes", [(("--no-ac",), 2), ((), 3), (("--tiled-mlp",), 2),
                                           (("--tiled-mlp", "--no-ac"), 2)])
def test_nf4_dequantizes_every_expert_a_pass(flags, passes):
    m = read_args(os.path.join(BENCH, "qwen3-30b-a3b"))
    moe, e = m.moe, 2
    dq = (0.5 + e) * moe.experts * 3 * moe.width * m.dim / RATES["ELEMENTWISE"]
    extra = timed(m, "--quant", "nf4", *flags)["elementwise"] - timed(m, "--quant", "none", *flags)["elementwise"]
    assert extra == pytest.approx(m.n_layers * passes * dq, rel=1e-9), flags
