"""The memory plan's terms for Qwen3.5's linear-attention blocks (Gated DeltaNet, model/deltanet.py), in
parallel/plan.py's notation, plus Hk / Hv key / value heads of dk / dv dims, K the conv kernel, C = 2·Hk·dk + Hv·dv
conv channels, c the rule's chunk (model.deltanet.CHUNK, 64), rows the micro-batch's rows and Tp = rows · ceil(S/c) · c
the tokens the rule runs on (S a row's whole length: under CP the rule sees the whole sequence for Hv/cp heads,
parallel/cp_linear.py).
Functions of explicit sizes: ModelArgs does not carry the linear layers' sizes yet (the decoder's wiring of
GatedDeltaNet is still to land), so memory_plan does not call them; see "Left to hook in" below.

- Weights (terms 1, 5), `shapes(...)`: the frozen Linears in_proj_qkv [C, D], in_proj_z [Hv·dv, D], in_proj_b and
  in_proj_a [Hv, D], out_proj [D, Hv·dv], NF4 as the attention's projections (each with its quantization state);
  `dense(...)`: conv1d [C, 1, K], A_log [Hv], dt_bias [Hv], the gated norm's weight [dv], in the compute dtype, never
  quantized (sharded as the block norms are).
- Activations (term 4), `saved(...)`: what autograd keeps of the sublayer beyond its (normed) input, with frozen
  weights (CPU, measured with saved-tensor hooks: tests/test_plan_linear.py), f = 4 (float32: the rule's dtype):
    per token, all heads (the projections and the gated norm, on the rank's T tokens): beta's sigmoid e·Hv, softplus'
    float32 input 4·Hv, the gated norm's float32 input, rsqrt, z and silu(z) (3·4·Hv·dv + 4·Hv; the float32 input a
    view of the rule's padded output at e = 4, cp 1: Tp tokens) and weight·normed (e·Hv·dv); -exp(A_log) 4·Hv once;
    the conv (the rule's head range, C' channels: C at cp 1): its input and silu's input (e·C' a token, + e·C'·(K-1) a
    row) and its concatenated weight e·C'·K; l2 norm: q and k as float32 copies at Hv/cp heads (2·4·dk; at e = 4 with as
    many key as value heads no copy: views of silu's output, e·C' a token) and their rsqrt (2·4);
    the rule (per rule token and head): padded q, k, v, k·beta, w, q·decay, k·decay ((6·dk + 3·dv)·f with u and the
    per-chunk `fresh`), beta and two decays (3·f), five [c, c] blocks (k·kᵀ, q·kᵀ, decay, L, the intra-chunk scores:
    5·c·f), two bool [c, c] masks and two bool [c] ones per rule token (not per head), and the chunk-entry states
    [dk, dv] float32, one per chunk and head (N of them: the first is the zero state). With one chunk a row, w and
    q·decay are not kept (the zero state needs no gradient).
  LoRA's tensors follow parallel/plan.py's rule per target (A keeps its input: the block norm's output for in_proj_*,
  the gated norm's output, e·Hv·dv, for out_proj; B its [T, r] input); `lora_inputs` counts out_proj's.
  Packed rows of several documents keep more, not planned (a row is planned as one document, as attention's): the
  conv's scatter keeps its source and an int64 index, e·C + 8 a token, and K - 1 more conv columns a document.
- The block's backward (the phase that stands for attention's 7 and 9), `backward(...)`: the excess over the saved
  tensors, the larger of the rule's (4·Tp·(Hv/cp)·(5c + 3dk + 2dv): the [c, c] blocks' gradients with q, k, v's) and
  the conv's (4e·T·C: its input's and output's gradients around silu and the split); under CP plus the all-to-alls'
  send and receive copies of the q|k, v and g|beta gradients (2·(e·T·(2·max(Hk, cp)·dk + Hv·dv) + 8·T·Hv)). CPU,
  measured with the profiler's allocation events over the backward at 256 tokens (dk, dv from 8 to 128, Hv = Hk and
  2·Hk, float32 and bfloat16): 0.85-1.03 of the measured peak.
NOT measured against a GPU trace (2026-12): no GPU here. The saved tensors are pinned against autograd's on CPU; fla's
kernel (model/deltanet.py's CUDA path, when installed) saves different tensors and is not planned here.

Left to hook in (with ModelArgs' linear-layer sizes): memory_plan's per-layer terms by layer type (layer_saved: the
linear sublayer's `saved` in place of the attention's q/k/v/out/lse/gate, its LoRA targets' shapes in `shapes`,
`dense` in the block norms' term, the larger kind's block in FSDP2's), the block phases (block_terms: `backward` in
place of attention's 7 and 9 for a linear block) and plan_search's --max-len auto through them; --tiled-attn and
--ac-keep-attn have no linear counterpart.
"""

from __future__ import annotations

CHUNK = 64   # model.deltanet.CHUNK (not imported: the planner reads no model code)


def shapes(D: int, Hk: int, Hv: int, dk: int, dv: int) -> dict:
    """The frozen Linears of a linear-attention sublayer: {name: (out, in)}."""
    return {"in_proj_qkv": (2 * Hk * dk + Hv * dv, D), "in_proj_z": (Hv * dv, D), "in_proj_b": (Hv, D),
            "in_proj_a": (Hv, D), "out_proj": (D, Hv * dv)}


def dense(Hk: int, Hv: int, dk: int, dv: int, K: int) -> int:
    """Elements in the compute dtype, never quantized: conv1d, A_log, dt_bias, the gated norm's weight."""
    return (2 * Hk * dk + Hv * dv) * K + 2 * Hv + dv


def _rule_tokens(T: int, rows: int, cp: int) -> tuple[int, int]:
    """(Tp, chunks): the rule's padded tokens over the rows (whole rows under CP) and the chunks of one row."""
    n = -(-(T * cp // rows) // CHUNK)
    return rows * n * CHUNK, n


def saved(T: int, rows: int, Hk: int, Hv: int, dk: int, dv: int, K: int, e: int, cp: int = 1) -> int:
    """Bytes autograd keeps of one linear-attention sublayer with frozen weights, beyond its input (module docstring):
    T tokens on this rank in `rows` rows of one document each, e the compute dtype's bytes."""
    Tp, n = _rule_tokens(T, rows, cp)
    hv, hk = Hv // cp, max(Hk // cp, 1)    # the rule's heads on this rank (key heads replicated past Hk ranks)
    Tc, C = T * cp, 2 * hk * dk + hv * dv   # the conv's tokens (whole rows) and channels on this rank
    norm_in = Tp if e == 4 and cp == 1 else T   # the gated norm's float32 input: a view of the rule's padded output
    proj = e * T * Hv + 4 * T * Hv + 4 * Hv + 4 * norm_in * Hv * dv + 2 * 4 * T * Hv * dv + e * T * Hv * dv \
        + 4 * T * Hv
    conv = e * Tc * C + e * C * (Tc + rows * (K - 1)) + e * C * K
    l2 = (e * Tc * C if hv == hk and e == 4 else 2 * 4 * Tc * hv * dk) + 2 * 4 * Tc * hv
    rule = 4 * Tp * hv * (6 * dk + 3 * dv + 3 + 5 * CHUNK) + 2 * Tp * CHUNK + 2 * Tp \
        + 4 * hv * dk * dv * rows * n - 2 * 4 * Tp * hv * dk * (n == 1)
    return proj + conv + l2 + rule


def lora_inputs(targets, T: int, Hv: int, dv: int, e: int) -> int:
    """out_proj's LoRA A input (the gated norm's output, a tensor of its own) when out_proj is adapted; in_proj_*'s A
    keep the block norm's output, which the block's terms count as attention's q/k/v's."""
    return e * T * Hv * dv * ("out_proj" in targets)


def backward(T: int, rows: int, Hk: int, Hv: int, dk: int, dv: int, e: int, cp: int = 1) -> int:
    """The excess of a linear block's backward over its saved tensors at the sublayer (module docstring)."""
    Tp, _ = _rule_tokens(T, rows, cp)
    rule = 4 * Tp * (Hv // cp) * (5 * CHUNK + 3 * dk + 2 * dv)
    conv = 4 * e * T * (2 * Hk * dk + Hv * dv)
    a2a = 2 * (e * T * (2 * max(Hk, cp) * dk + Hv * dv) + 8 * T * Hv) if cp > 1 else 0
    return max(rule, conv) + a2a
