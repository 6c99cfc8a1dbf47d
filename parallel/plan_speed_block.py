"""Per-block terms of parallel/plan_speed.py's step-time model (its docstring's notation), kept apart so that model
reads in one sitting: the elementwise bytes of a block's two halves, and an MoE block's own work beside its GEMMs
(which model/flops.py's `block_matmuls` counts, a token's k experts and the router, for the MFU column too).

Contract:
- `elementwise_bytes(m, e, fused_norm, rope, layer)` -> (attention half, MLP module) bytes per token of one forward:
  eager kernels' reads and writes (RMSNorm in float32: ~6 passes of 4-byte temporaries, fused: 4e per element; RoPE
  `rope`·e per q/k element: 5 since model.llama's multiply-adds, ~9 for the formula before; the gated activation 5e
  per element of the MLP's width; the residual 3e per D), block `layer`'s own heads (Gemma 4's full layers) and MLP
  width: a dense MLP's intermediate_size; an MoE MLP's (Qwen3-MoE) a token's k experts' k·I, + the shared expert's
  (Qwen3.5-MoE) and the dispatch below; Gemma 4's dense MLP's F (its experts beside it: `moe_bytes`).
- `moe_bytes(m, layer, e)` -> (bytes per token of one forward, bytes of one pass's dequantization) of block `layer`'s
  experts: the dispatch (model.moe.dispatch: each of a token's k slots gathered, weighted and index_put_-summed,
  ~8e·D a slot) and the router's float32 softmax and top k (~12 bytes an expert); Gemma 4's, beside its dense MLP,
  also the experts' GeGLU (5e·k·I) and their three norms (4e·D each, fused). The dequantization: every expert's NF4
  weights, E·3·I·D (each expert with a token dequantizes all of its weight: at T·k >> E, every one), 0.5 byte read
  and e written a weight. A dense block's (one weight to every token) is in RATES' REST, measured; an MoE block's is
  E/k times more weight a token than its GEMMs read, so it is counted here. Not measured on a GPU (2026-12), nor
  the per-expert kernel launches (3 GEMMs and ~6 small kernels an expert a pass).
"""

from __future__ import annotations


def elementwise_bytes(m, e: int, fused_norm: bool, rope: float = 5, layer: int = 0) -> tuple[float, float]:
    """(attention half, MLP module) bytes per token of one forward of block `layer` (module docstring)."""
    D, F, moe = m.dim, m.intermediate_size, m.moe
    H, K, hd = m.attn_dims(layer)
    inner = moe is not None and moe.sparse(layer) and not moe.beside   # (the MoE is the block's MLP module)
    width = (F if moe.shared else 0) + moe.top_k * moe.width if inner else F
    norm = (4 * e if fused_norm else 2 * e + 24 + 2 * e) * D
    mlp = norm + 5 * e * width + 3 * e * D + (moe_bytes(m, layer, e)[0] if inner else 0)
    return norm + rope * e * (H + K) * hd + 3 * e * D, mlp


def moe_bytes(m, layer: int, e: int) -> tuple[float, float]:
    """(bytes per token of one forward, bytes of one pass's dequantization) of block `layer`'s experts (module
    docstring); (0, 0) for a block without."""
    moe, D = m.moe, m.dim
    if moe is None or not moe.sparse(layer):
        return 0, 0
    per_token = 8 * e * moe.top_k * D + 12 * moe.experts
    if moe.beside:   # (Gemma 4: its experts' GeGLU and the three norms of the MoE branch; the dense MLP: the other's)
        per_token += 5 * e * moe.top_k * moe.width + 3 * 4 * e * D
    return per_token, (0.5 + e) * moe.experts * 3 * moe.width * D
