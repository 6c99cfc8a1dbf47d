"""The memory plan's terms for GLM-4.5 / 4.6's MoE blocks (model/glm4_moe.py), in parallel/plan_moe.py's notation, S
the shared experts' width (moe_intermediate_size × n_shared_experts, `m.moe.shared`).

- Weights: the routed experts' Linears as Qwen3-MoE's and the shared experts' three Linears ([S, D], [S, D], [D, S];
  NF4 as the experts), in place of the dense MLP's (`shared_shapes`); the router [E, D] and its correction bias [E]
  in float32 (a float64 model's: float64), whole on every rank, outside FSDP2 (model/glm4_moe.py, parallel/fsdp.py):
  `routers(m, e)`, a term of its own, in no block's all-gather.
- Activations, `saved(m, T, e)`: the router's float32 sigmoid output [T, E] (4TE; the choice, indices only, runs
  without a graph), the gather's int64 indices (8Tk), with
  norm_topk_prob the division's float32 top k and sum (4Tk + 4T) (the router's weight is float32 in any dtype: no
  copy; tests/test_glm4_router_fp32.py checks bf16's); the slots' order and tokens (16Tk), each
  slot's gate, silu and up outputs (3e·Tk·I) and its down output with its float32 routing weight ((eD + 4)·Tk: the
  product is float32, rounded after); the shared experts' gate, silu and up outputs (3eTS). tests/test_glm4_moe.py pins
  them against autograd's (float32). LoRA on the routed experts (--lora-targets attn,experts): parallel/plan_moe.saved
  adds Qwen3-MoE's term, e·Tk·(D + I + 2r) (tests/test_glm4_moe_lora.py pins it); the shared experts take none. The
  block backward: Qwen3-MoE's terms with the shared experts' (parallel/plan_moe.backward).
"""

from __future__ import annotations


def shared_shapes(m) -> list:
    """The shared experts' frozen Linears (out, in): gate_proj, up_proj, down_proj of width S."""
    S, D = m.moe.shared, m.dim
    return [(S, D), (S, D), (D, S)] if S else []


def routers(m, e: int) -> int:
    """Bytes of every MoE block's router weight [E, D] and correction bias [E] per rank (float32, or e if finer)."""
    sparse = sum(m.moe.sparse(i) for i in range(m.n_layers))
    return sparse * m.moe.experts * (m.dim + 1) * max(e, 4)


def saved(m, T: int, e: int) -> float:
    """Bytes autograd keeps of one GLM-4.5 MoE block (untiled) beyond its input (module docstring)."""
    E, k, width, D, S = m.moe.experts, m.moe.top_k, m.moe.width, m.dim, m.moe.shared
    router = 4 * T * E + 8 * T * k + (4 * T * k + 4 * T) * m.moe.norm_topk   # (its float32 weight: no copy)
    return router + 16 * T * k + 3 * e * T * k * width + (e * D + 4) * T * k + 3 * e * T * S
