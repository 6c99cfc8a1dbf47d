"""The memory plan's terms for Qwen3-MoE's blocks (model/moe.py), in parallel/plan.py's notation, plus E experts per
MoE block, k of them per token, I their width (moe_intermediate_size); Qwen3.5-MoE's shared expert, S wide
(shared_expert_intermediate_size: F, m.intermediate_size, there), and its gate [1, D].

- Weights (terms 1, 5): an MoE block's frozen Linears are the attention's four and 3·E expert projections ([I, D],
  [I, D], [D, I]; NF4 as the dense ones, with their quantization state each), and its router [E, D] in the compute
  dtype, never quantized (sharded as the norms are); a shared expert's three Linears and its gate [1, D] beside them,
  frozen and NF4 as the experts. `kinds(m, shapes)`: (blocks, frozen Linear shapes, router rows)
  for the dense blocks and the MoE blocks (mlp_only_layers, decoder_sparse_step); FSDP2's unsharded block is the
  larger kind's.
- Activations (term 4), `saved(m, T, e)`: what autograd keeps of an MoE MLP beyond its input (its norm's, counted as
  the dense MLP's): the router's float32 softmax [T, E] (4TE), top k's int64 indices (8Tk), with norm_topk_prob the
  division's float32 top k and sum (4Tk + 4T); the slots' expert order and their tokens, int64 (16Tk: every expert's
  index_select / index_add index is a slice of these); per expert its tokens' gate output (silu's input), silu's
  output and up's output (3e·Tk·I over all experts: each token's k slots), and its down output with the slot's
  routing weight (e·Tk·(D + 1): the weight's gradient reaches the router logits, hence the hidden states); the
  experts' frozen projections save no input, nor the sum into the output (index_put_: its index only); LoRA on the
  experts (`expert_lora`, --lora-targets experts; GPT-OSS's and GLM-4.5's too) keeps per slot its gathered input [D]
  and SwiGLU product [I] (the A's inputs) and the two [r] products (the B's), e·Tk·(D + I + 2r). A shared
  expert: its gate, silu and up outputs (3eTS), its down output and the gate's sigmoid for their product (eT·(D + 1)).
  --tiled-mlp:
  the tiles keep only the input, as the dense MLP's; with nf4 its phase holds every expert's weights dequantized
  (`held`: E·3·I·D, the dense blocks' 3·F·D where larger).
- The MLP phase of a block backward (term 6), `backward(m, T, e)`: the incoming gradient, the input gradient summed
  over the experts and one expert's index_select backward [T, D] (3eTD), the router's float32 gradients (8TE), one
  expert's backward with every token routed to it at worst (e·T·(2I + D)). Not measured against a GPU trace (2026-12):
  the saved tensors are pinned against autograd's (tests/test_qwen3_moe.py).
- Gemma 4's MoE block (`beside`: model/gemma4_moe.py) keeps the dense MLP (its Linears, saved tensors, tiles and phase
  as the dense block's) and adds the experts beside it: their Linears, the router [E, D] (never quantized), its scale
  [D] and per_expert_scale [E] and the three norms [D] with the block norms; saved (untiled): the router's weightless
  norm's rsqrt and one-element weight (4T + 4), float32 softmax (4TE), top k (8Tk int64, 4Tk float32), the
  renormalisation's sum (4T), the per_expert_scale picks (4Tk), the slots' order and
  tokens (16Tk), each expert's gate, gelu and up outputs (3e·Tk·I) and its down output with its float32 routing weight
  ((eD + 4)·Tk), pre_feedforward_layernorm_2's rsqrt (its input is the MLP norm's) and post_feedforward_layernorm_1's
  and _2's inputs and rsqrt (2·(eTD + 4T)); tests/test_gemma4_moe.py pins them against autograd's. The block backward
  (parallel/plan_block.py) runs the experts first (made last: `backward` + the dense branch's waiting gradient, eTD),
  then the dense MLP's phase with the experts' tensors freed; the attention's phases after both are gone. Not
  modelled: the float32 product of an expert's output and its routing weight in that expert's backward.
  --tiled-mlp runs the block's whole feed-forward side as one tiled unit (parallel.memory._tiled_unit): none of the
  above is saved, nor post_feedforward_layernorm's input (parallel/plan.py: the block keeps r, the MLP norm's input);
  its phase (`unit`): the incoming gradient and one backward tile of E·D/k tokens (the dense MLP's tile terms, these
  saved tensors and `backward` at its size, post_feedforward_layernorm's input), with nf4 the dense MLP's and every
  expert's weights dequantized at once (`held`: (F + E·I)·D a projection).
- GPT-OSS's MoE block (`clamp`: model/gpt_oss.py): the router [E, D] with its bias, the experts' biases and the
  attention sinks (`extras`) beside the router; saved: the softmax over the top k in the compute dtype (eTk), top k
  (8Tk), the slots' order and tokens (16Tk), per slot six [I] of the clamped SwiGLU (6e·Tk·I) and the down output
  with its routing weight (e·Tk·(D + 1)); tests/test_gpt_oss.py pins them against autograd's. Its block backward: the
  Qwen3-MoE's terms (the router's float32 gradients [T, E] over-count its [T, k] in the compute dtype).
- GLM-4.5's MoE block (`groups`: model/glm4_moe.py): parallel/plan_glm4.py.
"""

from __future__ import annotations

from parallel import plan_glm4 as glm4

MLP = ("gate_proj", "up_proj", "down_proj")


def kinds(m, shapes: dict) -> list[tuple[int, list, int]]:
    """[(blocks of a kind, their frozen Linears' (out, in), router rows)]: the dense blocks' and the MoE ones'."""
    if m.moe is None:
        return [(m.n_layers, list(shapes.values()), 0)]
    sparse = sum(m.moe.sparse(i) for i in range(m.n_layers))
    width, D = m.moe.width, m.dim
    experts = [(width, D), (width, D), (D, width)] * m.moe.experts + ([(1, D)] * bool(m.moe.shared) if not m.moe.groups
                                                                      else glm4.shared_shapes(m))   # (+ its gate)
    keep = lambda t: t not in MLP or m.moe.shared and not m.moe.groups or m.moe.beside   # (the shared expert: F, the
    # MLP's shapes; Gemma 4's dense MLP beside the experts; GLM-4.5's shared experts: their own, parallel/plan_glm4)
    return [k for k in ((m.n_layers - sparse, list(shapes.values()), 0),   # (GLM-4.5's router: outside FSDP2, 0 rows)
                        (sparse, [s for t, s in shapes.items() if keep(t)] + experts, 0 if m.moe.groups
                         else m.moe.experts)) if k[0]]


def extras(m) -> list:
    """GPT-OSS's MoE block's frozen tensors beside its Linears and router weight, (dim 0, elements) in the compute
    dtype, never quantized: the experts' biases [E, 2I] and [E, D], the router's bias [E], the attention sinks [H]."""
    if m.moe is None or not m.moe.clamp:   # (GLM-4.5's router and its correction bias: parallel/plan_glm4.routers)
        return []
    E = m.moe.experts
    return [(E, E * 2 * m.moe.width), (E, E * m.dim), (E, E), (m.n_heads, m.n_heads)]


def held(m, shapes: dict) -> dict:
    """{projection: weights --tiled-mlp / --tiled-attn dequantize at once in a block (model.nf4.dequant_once)}: an MoE
    block's every expert of moe_intermediate_size (E·I·D), not E of the dense MLP's intermediate_size; the larger kind's
    where dense blocks are there too; + the shared expert's (S·D); Gemma 4's: the dense MLP's and every expert's,
    (F + E·I)·D (its tiled unit runs both)."""
    n = {x: o * i for x, (o, i) in shapes.items()}
    if m.moe is not None and m.moe.beside:   # Gemma 4's tiled unit: the dense MLP's and every expert's at once
        for x in MLP:
            n[x] += m.moe.experts * m.moe.width * m.dim
    if m.moe is not None and not m.moe.beside and (sparse := sum(m.moe.sparse(i) for i in range(m.n_layers))):
        for x in MLP:
            n[x] = max(n[x] if sparse < m.n_layers else 0, (m.moe.experts * m.moe.width + m.moe.shared) * m.dim)
    return n


def expert_lora(m, args) -> list:
    """--lora-targets experts (model/expert_lora.py): an MoE block's LoRA tensors (dim 0, elements), gate_up_proj's
    A [E·r, D] and B [2I, E·r], down_proj's A [E·r, I] and B [D, E·r]; [] without."""
    if "experts" not in args.lora_targets.split(",") or m.moe is None:
        return []
    Er, width, D = m.moe.experts * args.lora_r, m.moe.width, m.dim
    return [(Er, Er * D), (2 * width, 2 * width * Er), (Er, Er * width), (D, D * Er)]


def saved(m, T: int, e: int, r: int = 0) -> float:
    """Bytes autograd keeps of one MoE MLP (untiled) beyond its input (module docstring); Gemma 4's beside the dense
    MLP's (--tiled-mlp: none, kept a tile at a time, `unit`). `r`: the experts' LoRA rank (0: none), whose A's keep
    each slot's gathered input [D] and SwiGLU product [I], and B's the two [r] products (e·Tk·(D + I + 2r))."""
    E, k, width, D, S = m.moe.experts, m.moe.top_k, m.moe.width, m.dim, m.moe.shared
    lora = e * T * k * (D + width + 2 * r) * bool(r)   # (the experts' LoRA: Qwen3-MoE's, GPT-OSS's, GLM's)
    if m.moe.clamp:   # GPT-OSS (model/gpt_oss.py): softmax over the top k logits in the compute dtype (its output),
        # the top k's int64 indices, the slots' order and tokens; per slot the clamped SwiGLU's six [I]: gate's and up's
        # outputs (the clamps' inputs), the clamped gate, its sigmoid, up + 1 and gate·sigmoid (the product's two
        # factors); its down output and routing weight
        return e * T * k + 8 * T * k + 16 * T * k + 6 * e * T * k * width + e * T * k * (D + 1) + lora
    if m.moe.groups:   # (GLM-4.5: parallel/plan_glm4.py)
        return glm4.saved(m, T, e) + lora
    if m.moe.beside:
        return 4 * T + 4 + 4 * T * E + 8 * T * k + 4 * T * k + 4 * T + 4 * T * k + 16 * T * k \
            + 3 * e * T * k * width + (e * D + 4) * T * k + 4 * T + 2 * (e * T * D + 4 * T)
    return 4 * T * E + 8 * T * k + (4 * T * k + 4 * T) * m.moe.norm_topk + 16 * T * k \
        + 3 * e * T * k * width + e * T * k * (D + 1) + (3 * e * T * S + e * T * (D + 1)) * (S > 0) + lora


def backward(m, T: int, e: int) -> float:
    """An MoE block's MLP phase of the backward, less the dequantized weight (module docstring)."""
    S = m.moe.shared
    return 3 * e * T * m.dim + 8 * T * m.moe.experts + e * T * (2 * m.moe.width + m.dim) + e * T * (2 * S + m.dim) * (
        S > 0)


def unit(m, T: int, e: int) -> tuple[int, float]:
    """Gemma 4's MoE block under --tiled-mlp (parallel.memory._tiled_unit): (tokens t of a tile, E·D/k; the bytes of
    one backward tile: the dense MLP's recomputed tensors and gradients e·t·(6F + D), as a tiled MLP's; the experts'
    side's saved tensors and backward at t tokens, `saved` + `backward`; post_feedforward_layernorm's input, rsqrt)."""
    from parallel.memory import tile_tokens
    t = min(T, tile_tokens(m.dim, None, (m.moe.experts, m.moe.top_k)))
    return t, e * t * (6 * m.intermediate_size + m.dim) + saved(m, t, e) + backward(m, t, e) + e * t * m.dim + 4 * t
