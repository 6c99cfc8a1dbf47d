"""The step-time model (parallel/plan_speed.py) on Qwen3.5's Gated DeltaNet layers (`layer_types`
"linear_attention"): their core is timed from model/flops.py's count of it, not as S² softmax attention.

Pins:
- one source of truth: with no recompute (--no-ac), the attention category of a model of linear layers only is each
  core's forward, T · (flops_per_token - 6 · matmul_params) / 3 (flops.py: the cores' FLOPs a token, forward +
  backward = 3 forwards) at LINEAR, and LINEAR_BWD times it for the backward (the core's segments recomputed and
  differentiated, model/deltanet_core.py); so it grows with the tokens, not their square. Until 2026-12-07 each linear
  layer was timed as a full attention layer's S² kernel (Qwen3.5-35B-A3B at 128k: ~45 s of "attention" over 40
  layers, 10 of them full attention);
- AC recomputes the core (one forward) and --ac-keep-attn keeps none of it: none of the ops the real core runs is
  in parallel.ac.ATTENTION_OPS, the selective checkpoint's list;
- --tiled-attn tiles the full layers only (parallel/memory.py): a linear layer's projections get no tile recompute;
- a linear layer's elementwise work has no RoPE (the full layers' head shapes do not enter it), and --dora on q_proj
  adds nothing on a layer without one.

Run: .venv/bin/python -m pytest -q tests/test_plan_speed_linear.py
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from model.config import ModelArgs
from model.flops import flops_per_token, matmul_params
from model.linear_layers import LinearSpec
from parallel.mesh import validate
from parallel.plan_speed import RATES, step_seconds

LINEAR = ["linear_attention"] * 3


def tiny(types=LINEAR, **kw) -> ModelArgs:
    return ModelArgs(**{**dict(model_type="qwen3_5_text", vocab_size=96, dim=48, n_layers=len(types), n_heads=4,
                                n_kv_heads=2, head_dim=16, intermediate_size=80, qk_norm=True, norm_offset=1.0,
                                attn_gate=True, partial_rotary_factor=0.25, linear=LinearSpec(2, 4, 16, 8, 4),
                                layer_types=list(types)), **kw})


def timed(m, tokens, *flags):
    """step_seconds' {category: seconds} for one row of `tokens`, bf16, NF4."""
    args = train.build_parser().parse_args(["--max-len", str(tokens), "--dtype", "bf16", "--global-batch", "1",
                                            "--quant", "nf4", *flags])
    dims, pack = validate(args, m, 1)
    return step_seconds(m, dims, args, "cuda", pack)[1]


@pytest.mark.parametrize("tokens", [4096, 16384])
def test_linear_core_is_timed_from_flops_rule_count(tokens):
    m = tiny()
    cores = (flops_per_token(m, tokens) - 6 * matmul_params(m)) / 3   # flops.py: the cores' forward FLOPs a token
    assert cores > 0
    got = timed(m, tokens, "--no-ac")["attention"]
    assert got == pytest.approx(tokens * cores / RATES["LINEAR"] * (1 + RATES["LINEAR_BWD"]), rel=1e-12)
    # (the S² term it was: 4·T·(T/2)·H·hd at ATTN, x (1 + BWD), a layer)
    assert got != pytest.approx(len(LINEAR) * 2 * tokens ** 2 * 4 * 16 / RATES["ATTN"] * (1 + RATES["BWD"]),
                                rel=0.5)


def test_full_layers_keep_the_attention_term():
    """A hybrid (3 linear, 1 full): its attention category = the linear-only model's + one full layer's kernel."""
    T = 8192
    hybrid = timed(tiny(LINEAR + ["full_attention"]), T, "--no-ac")["attention"]
    full = 4 * T * (T / 2) * 4 * 16 / RATES["ATTN"] * (1 + RATES["BWD"])
    assert hybrid == pytest.approx(timed(tiny(), T, "--no-ac")["attention"] + full, rel=1e-12)


def test_the_core_is_recomputed_under_ac_even_with_keep_attn():
    m, T = tiny(), 8192
    cores = (flops_per_token(m, T) - 6 * matmul_params(m)) / 3
    none, ac, keep = (timed(m, T, *f)["attention"] for f in (("--no-ac",), (), ("--ac-keep-attn",)))
    assert ac - none == pytest.approx(T * cores / RATES["LINEAR"], rel=1e-9)
    assert keep == pytest.approx(ac, rel=1e-12)


def test_no_op_of_the_core_is_kept_by_ac_keep_attn():
    """What `kept` False rests on: the ops the torch core runs, forward and backward, none in ATTENTION_OPS."""
    from model.deltanet_core import local_linear_core
    from parallel.ac import ATTENTION_OPS

    class Ops(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    B, S, Hk, Hv, d = 1, 80, 1, 2, 8
    q, k, v = torch.randn(B, S, Hk, d), torch.randn(B, S, Hk, d), torch.randn(B, S, Hv, d)
    g, beta = -torch.rand(B, S, Hv), torch.rand(B, S, Hv)
    conv = tuple(torch.randn(h, d, 4) for h in (Hk, Hk, Hv))
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, *conv)]
    with Ops() as ops:
        local_linear_core(*leaves[:5], tuple(leaves[5:]), None).sum().backward()
    assert "aten.linalg_solve_triangular" in ops.seen and "aten.bmm" in ops.seen   # (it saw the rule)
    assert not ops.seen & ATTENTION_OPS


def test_tiled_attn_leaves_linear_layers_alone():
    m = tiny()
    assert timed(m, 8192, "--tiled-mlp", "--tiled-attn") == timed(m, 8192, "--tiled-mlp")


def test_linear_elementwise_has_no_rope_and_no_q_proj():
    """The full attention's head shapes (absent from these layers) change nothing; --dora on q_proj neither."""
    m = tiny()
    wide = dataclasses.replace(m, n_heads=8, n_kv_heads=8, head_dim=32)
    assert timed(wide, 8192) == timed(m, 8192)
    assert timed(m, 8192, "--dora", "--lora-targets", "q_proj") == timed(m, 8192, "--lora-targets", "q_proj")
    assert timed(m, 8192, "--dora", "--lora-targets", "in_proj_qkv")["matmul"] > timed(
        m, 8192, "--lora-targets", "in_proj_qkv")["matmul"]   # (its own projections: DoRA's B A there)
