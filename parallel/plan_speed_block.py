"""Per-block terms of parallel/plan_speed.py's step-time model (its docstring's notation), kept apart so that model
reads in one sitting: a block's token mixing (attention kernel or linear core), the elementwise bytes of its two
halves, and an MoE block's own work beside its GEMMs (which model/flops.py's `block_matmuls` counts, a token's k
experts and the router, for the MFU column too).

Contract:
- `mixing_seconds(m, layer, T, Sd, rates, tiled_attn)` -> (forward, backward, kept): seconds of block `layer`'s token
  mixing over T tokens of documents of Sd. A full layer's attention kernel: 4·T·S'·H·hd at ATTN (S' the keys a
  query sees: Sd/2 causal, less in a window), backward BWD times it, x TILED_ATTN under --tiled-attn; --ac-keep-attn
  keeps its output (`kept`). A Qwen3.5 linear layer's core (model/deltanet_core.py: conv, l2 norms, chunked rule):
  T·model.flops.linear_core_flops at LINEAR (its cost grows with the tokens, not their square), backward LINEAR_BWD
  times it (its segments' recompute, one more forward, and autograd's backward through them); not a kernel
  --ac-keep-attn keeps (parallel/ac.ATTENTION_OPS: the recompute runs it again), nor one --tiled-attn tiles.
  LINEAR 2.8e12 and LINEAR_BWD 6 are NOT measured on a GPU (2026-12): the torch core (fla's kernel, untested, would
  be far faster) at Qwen3.5's shapes (16 key and 32 value heads of 128, both bench configs), per token and layer
  forward 5.3 MFLOP of float32 GEMM-shaped work (no TF32: torch's default; ~0.13 µs at ~40 TFLOP/s) and ~1.24 MB of
  elementwise reads and writes (counted per aten op on CPU: ~0.56 µs at ELEMENTWISE), but ~44 aten ops per 64-token
  chunk issued from its Python loop (~13 kernels, ~31 views): dispatch-bound at ~1.9 µs a token (a CPU core ran a
  tiny-shape core, its math nothing, at 1.8-1.9 µs a token), 5.3 MFLOP / 1.9 µs ~ 2.8 TFLOP/s; backward, dispatch-
  bound too, took 5.8-6.7x the forward on that CPU. Fewer heads are timed at the same rate, though the dispatch
  would not shrink with them (an underestimate there); the GPU's own work is ~0.7 µs a token at these shapes.
- `mlp_read(m, layer)`: whether block `layer`'s recompute reads its MLP's output (parallel.recompute.mlp_output_read
  of the class model/llama.py's Decoder builds there: Gemma's and OLMo's SandwichBlock). There a 4-bit down_proj's
  GEMM runs in the recompute and --tiled-mlp's forward tiles run in it too (parallel/memory.py); elsewhere neither.
- `experts_tiled(m, layer)`: whether --tiled-mlp tiles block `layer`'s experts: an MoE MLP module's (Qwen3-MoE,
  Qwen3.5-MoE) yes; Gemma 4's, beside its dense MLP, not (memory.py tiles block.mlp): they stay in the AC recompute.
- `elementwise_bytes(m, e, fused_norm, rope, layer)` -> (attention half, MLP module) bytes per token of one forward:
  eager kernels' reads and writes (RMSNorm in float32: ~6 passes of 4-byte temporaries, fused: 4e per element; RoPE
  `rope`·e per q/k element: 5 since model.llama's multiply-adds, ~9 for the formula before; the gated activation 5e
  per element of the MLP's width; the residual 3e per D), block `layer`'s own heads (Gemma 4's full layers) and MLP
  width: a dense MLP's intermediate_size; an MoE MLP's (Qwen3-MoE) a token's k experts' k·I, + the shared expert's
  (Qwen3.5-MoE) and the dispatch below; Gemma 4's dense MLP's F (its experts beside it: `moe_bytes`). A Qwen3.5
  linear layer's attention half: no RoPE; its gated norm (model.deltanet._GatedNormFn, eager: the float32 norm's
  passes and silu(z)'s, ~4e + 40 bytes per element of Hv·dv), its norm and residual; the gates over [T, Hv] are
  left out (Hv << D), the core's own elementwise work is in LINEAR (`mixing_seconds`).
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

from model.flops import linear_core_flops


def mixing_seconds(m, layer: int, T: int, Sd: int, r: dict, tiled_attn: bool) -> tuple[float, float, bool]:
    """(forward, backward, kept by --ac-keep-attn): seconds of block `layer`'s attention kernel or linear core over
    T tokens, documents of Sd (module docstring); `r` parallel.plan_speed.RATES."""
    if m.is_linear(layer):
        f = T * linear_core_flops(m.linear) / r["LINEAR"]
        return f, f * r["LINEAR_BWD"], False
    H, _, hd = m.attn_dims(layer)
    w = m.window(layer) if hasattr(m, "window") else None
    span = Sd / 2 if w is None or w >= Sd else w * (1 - w / (2 * Sd))   # keys per query, on average
    a = 4 * T * span * H * hd / r["ATTN"] * (r["TILED_ATTN"] if tiled_attn else 1)
    return a, a * r["BWD"], True


def mlp_read(m, layer: int) -> bool:
    """Whether block `layer`'s recompute reads its MLP's output (module docstring)."""
    from model.llama import Block, SandwichBlock
    from parallel.recompute import mlp_output_read
    sandwich = not m.is_linear(layer) and (m.sandwich_norms or m.post_norms)   # (Decoder's choice; a LinearBlock
    return mlp_output_read(SandwichBlock if sandwich else Block)   # reads it no more than a Block)


def unit_read(m, layer: int) -> bool:
    """Whether block `layer`'s recompute runs --tiled-mlp's feed-forward tiles (parallel/memory.py): where the block
    reads their output there, Gemma 4 E2B / E4B's per-layer input branch."""
    return getattr(m, "small", None) is not None and bool(m.small.ple) and not m.is_linear(layer)


def experts_tiled(m, layer: int) -> bool:
    """Whether --tiled-mlp tiles block `layer`'s experts (module docstring): the one place that rule lives. Every MoE
    block's: Qwen3-MoE's are the MLP module, Gemma 4's run in the block's feed-forward unit (parallel/memory.py)."""
    return m.moe is not None and m.moe.sparse(layer)


def elementwise_bytes(m, e: int, fused_norm: bool, rope: float = 5, layer: int = 0) -> tuple[float, float]:
    """(attention half, MLP module) bytes per token of one forward of block `layer` (module docstring)."""
    D, F, moe = m.dim, m.intermediate_size, m.moe
    H, K, hd = m.attn_dims(layer)
    inner = moe is not None and moe.sparse(layer) and not moe.beside   # (the MoE is the block's MLP module)
    width = (F if moe.shared else 0) + moe.top_k * moe.width if inner else F
    norm = (4 * e if fused_norm else 2 * e + 24 + 2 * e) * D
    mlp = norm + 5 * e * width + 3 * e * D + (moe_bytes(m, layer, e)[0] if inner else 0)
    if m.is_linear(layer):   # (Qwen3.5's linear layer: its gated norm in place of RoPE)
        return norm + (4 * e + 40) * m.linear.v_heads * m.linear.v_dim + 3 * e * D, mlp
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
