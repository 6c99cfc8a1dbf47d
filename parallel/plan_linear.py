"""The memory plan's terms for Qwen3.5's linear-attention blocks (Gated DeltaNet, model/deltanet.py), in
parallel/plan.py's notation, plus Hk / Hv key / value heads of dk / dv dims, K the conv kernel, C = 2·Hk·dk + Hv·dv
conv channels, c the rule's chunk (model.deltanet.CHUNK, 64), rows the micro-batch's rows and Tp = rows · ceil(S/c) · c
the tokens the rule runs on (S a row's whole length: under CP the rule sees the whole sequence for Hv/cp heads,
parallel/cp_linear.py).
Functions of explicit sizes; parallel/plan.py's memory_plan calls them through the hooks at the end (`block_shapes`,
`dense_shapes`, `kinds`, `sublayer_saved`, `phase`: ModelArgs.linear's sizes, the layers ModelArgs.is_linear names).

- Weights (terms 1, 5), `shapes(...)`: the frozen Linears in_proj_qkv [C, D], in_proj_z [Hv·dv, D], in_proj_b and
  in_proj_a [Hv, D], out_proj [D, Hv·dv], NF4 as the attention's projections (each with its quantization state);
  `dense(...)`: conv1d [C, 1, K], A_log [Hv], dt_bias [Hv], the gated norm's weight [dv], in the compute dtype, never
  quantized (sharded as the block norms are).
- Activations (term 4), `saved(...)`: what autograd keeps of the sublayer beyond its (normed) input, with frozen
  weights (CPU, measured with saved-tensor hooks: tests/test_plan_linear.py):
    per token, all heads (the projections and the gated norm, on the rank's T tokens): beta's sigmoid e·Hv, softplus'
    float32 input 4·Hv, the gated norm's inputs x (the core's output) and z (in_proj_z's) and its float32 rsqrt
    (2·e·Hv·dv + 4·Hv: model/deltanet.py's `_GatedNormFn`, which recomputes the rest); -exp(A_log) 4·Hv once;
    the core (model/deltanet_core.py's `_Segmented`: conv, l2 norm and rule in segments of s = SEGMENT chunks,
    recomputed in backward) keeps only its inputs, C' = 2·hk·dk + hv·dv channels of the rule's head range (C at
    cp 1): q, k, v (e·C' a token; views of in_proj_qkv's output at cp 1), g (4·Hv; under CP the all-to-all's float32
    g|beta, 8·hv, and beta cast back, e·hv, unless e = 4), the concatenated conv weight e·C'·K once, and a float32
    state [dk, dv] per head, row and segment after the first: 4·hv·dk·dv·rows·(ceil(N/s) - 1) for N chunks a row.
    Packed rows of several documents keep no more (their conv's scatter runs inside the segments).
  LoRA's tensors follow parallel/plan.py's rule per target (A keeps its input: the block norm's output for in_proj_*,
  the gated norm's output, e·Hv·dv, for out_proj; B its [T, r] input); `lora_inputs` counts out_proj's.
- The block's backward (the phase that stands for attention's 7 and 9), `backward(...)`: the excess over the saved
  tensors, the largest of
    the gated norm's: its output's gradient and x's and z's (3·e·T·Hv·dv), and one chunk's float32 temporaries, 3
    (e = 4) or 5 of its GATED_CHUNK elements (or of all T·Hv·dv when fewer): (12 + 8·(e < 4))·min(T·Hv·dv, GATED_CHUNK);
    the core's: its whole input and output gradients (e·Tc·(C' + hv·dv) + 4·Tc·hv + e·Tc·hv, Tc = T·cp) plus ONE
    segment recomputed (Ts = rows·min(s, N)·c tokens): what it keeps (the conv window's input and silu's input,
    e·C'·(2·Ts + 3·rows·(K-1)); the l2 norm's float32 q, k copies and rsqrt, 2·4·Ts·hv·(dk + 1), views of silu's
    output at e = 4 with hk = hv; the rule's padded q, k, v, k·beta, w, q·decay, k·decay, u and `fresh`, beta and two
    decays, five [c, c] blocks, (6·dk + 3·dv + 3 + 5c)·4 a token and head, two bool [c, c] masks and two bool [c] a
    token, a chunk-entry state 4·hv·dk·dv a chunk and row) and its backward's transients (the larger of the rule's
    4·Ts·hv·(5c + 3dk + 2dv) and the conv's 4e·Ts·C', + the state's gradient in and out, 2·4·hv·dk·dv·rows);
    q, k, v's gradients with their concatenation for in_proj_qkv (2·e·Tc·C');
  under CP plus the all-to-alls' send and receive copies of the q|k, v and g|beta gradients
  (2·(e·T·(2·max(Hk, cp)·dk + Hv·dv) + 8·T·Hv)). CPU, measured with the profiler's allocation events over the backward
  (256 to 2,500 tokens, one and several segments, dk, dv from 8 to 128, Hv = Hk and 2·Hk, float32 and bfloat16):
  0.8-1.03 of the measured peak, the core's term the largest; 1.00-1.01 where the gated norm's is (one- and two-chunk
  segments, dv 64 and 128: whole and in 32 chunks). At Qwen3.5-9B's sizes (bf16) the gated norm's (24 KiB a token +
  160 MiB) is never the peak: the core's is to ~64k tokens (36.8 KiB a token at 32k), q, k, v's gradients past it
  (32 KiB).
NOT measured against a GPU trace (2026-12): no GPU here. The saved tensors are pinned against autograd's on CPU; fla's
kernel (model/deltanet_core.py's CUDA path, when installed) saves different tensors and is not planned here.

Hooked in (memory_plan, by layer type): a linear block's frozen Linears are linear_attn's five and the MLP's, its LoRA
its targets among those (in_proj_*'s A keep the block norm's input, as q/k/v's), `dense` joins the block norms' term,
FSDP2's unsharded block is the larger kind's; its saved tensors are `sublayer_saved` in place of the attention's
q/k/v/out/lse/gate (the lowest adapted block, whose input needs no grad: only what its targets need); its backward
phase is `phase` (`backward`) in place of attention's 7 and 9, over the freed MLP with dh (parallel/plan_block.py), and
the peak block is the worse kind's; --max-len auto searches through them. --tiled-attn (full layers only),
--ac-keep-attn (nothing kept: no attention kernel) and the offload's prefetch (after a full layer's attention) leave
linear blocks as they are. Not in the linear phase: LoRA dropout's and DoRA's transients on in_proj_* / out_proj (term
4 counts their saved tensors as for the attention's projections; not pinned for linear blocks).
"""

from __future__ import annotations

CHUNK = 64     # model.deltanet.CHUNK (not imported: the planner reads no model code)
SEGMENT = 16   # model.deltanet.SEGMENT: chunks a segment of the core
GATED_CHUNK = 2**23   # model.deltanet.GATED_CHUNK: elements a chunk of the gated norm


def shapes(D: int, Hk: int, Hv: int, dk: int, dv: int) -> dict:
    """The frozen Linears of a linear-attention sublayer: {name: (out, in)}."""
    return {"in_proj_qkv": (2 * Hk * dk + Hv * dv, D), "in_proj_z": (Hv * dv, D), "in_proj_b": (Hv, D),
            "in_proj_a": (Hv, D), "out_proj": (D, Hv * dv)}


def dense(Hk: int, Hv: int, dk: int, dv: int, K: int) -> int:
    """Elements in the compute dtype, never quantized: conv1d, A_log, dt_bias, the gated norm's weight."""
    return (2 * Hk * dk + Hv * dv) * K + 2 * Hv + dv


def _sizes(T: int, rows: int, Hk: int, Hv: int, dk: int, dv: int, cp: int, segment: int):
    """(Tc, hv, hk, C', segments, Ts, its chunks): the core's tokens (whole rows under CP), heads and conv channels
    on this rank, a row's segments, and the tokens and chunks of the largest segment (all rows)."""
    S = T * cp // rows
    n = -(-S // CHUNK)                                   # a row's chunks
    hv, hk = Hv // cp, max(Hk // cp, 1)                  # key heads replicated past Hk ranks
    ns, nc = -(-n // segment), min(n, segment)
    return T * cp, hv, hk, 2 * hk * dk + hv * dv, ns, rows * nc * CHUNK, nc


def saved(T: int, rows: int, Hk: int, Hv: int, dk: int, dv: int, K: int, e: int, cp: int = 1,
          segment: int = SEGMENT) -> int:
    """Bytes autograd keeps of one linear-attention sublayer with frozen weights, beyond its input (module docstring):
    T tokens on this rank in `rows` rows of one document each, e the compute dtype's bytes."""
    Tc, hv, hk, C, ns, _, _ = _sizes(T, rows, Hk, Hv, dk, dv, cp, segment)
    proj = e * T * Hv + 4 * T * Hv + 4 * Hv + 2 * e * T * Hv * dv + 4 * T * Hv
    if cp == 1:   # q, k, v: views of in_proj_qkv's output; g the module's; beta its sigmoid's output (proj's)
        core = e * T * C + 4 * T * Hv
    else:         # the all-to-alls' outputs: q|k, v, g|beta (float32; beta cast back unless e = 4)
        core = e * Tc * C + 8 * Tc * hv + e * Tc * hv * (e != 4)
    return proj + core + e * C * K + 4 * hv * dk * dv * rows * (ns - 1)


def _segment(Ts: int, nc: int, rows: int, hv: int, hk: int, C: int, dk: int, dv: int, K: int, e: int) -> int:
    """What autograd keeps of one recomputed segment of Ts tokens (the rule's chunks, all rows): the conv window's
    input and silu's input, the l2 norm's float32 copies (views of silu's output at e = 4 with hk = hv), the rule's
    float32 blocks and its chunk-entry states."""
    conv = e * C * (2 * Ts + 3 * rows * (K - 1))
    l2 = (e * Ts * C if hv == hk and e == 4 else 2 * 4 * Ts * hv * dk) + 2 * 4 * Ts * hv
    return conv + l2 + 4 * Ts * hv * (6 * dk + 3 * dv + 3 + 5 * CHUNK) + 2 * Ts * CHUNK + 2 * Ts \
        + 4 * hv * dk * dv * rows * nc


def lora_inputs(targets, T: int, Hv: int, dv: int, e: int) -> int:
    """out_proj's LoRA A input (the gated norm's output, a tensor of its own) when out_proj is adapted; in_proj_*'s A
    keep the block norm's output, which the block's terms count as attention's q/k/v's."""
    return e * T * Hv * dv * ("out_proj" in targets)


def backward(T: int, rows: int, Hk: int, Hv: int, dk: int, dv: int, e: int, cp: int = 1, K: int = 4,
             segment: int = SEGMENT) -> int:
    """The excess of a linear block's backward over its saved tensors at the sublayer (module docstring)."""
    Tc, hv, hk, C, _, Ts, nc = _sizes(T, rows, Hk, Hv, dk, dv, cp, segment)
    grads = e * Tc * C + 4 * Tc * hv + e * Tc * hv + e * Tc * hv * dv   # the core's input gradients, its output's
    seg = _segment(Ts, nc, rows, hv, hk, C, dk, dv, K, e) + max(4 * Ts * hv * (5 * CHUNK + 3 * dk + 2 * dv),
                                                                 4 * e * Ts * C) + 2 * 4 * hv * dk * dv * rows
    split = 2 * e * Tc * C                                           # q, k, v's gradients and their concatenation
    a2a = 2 * (e * T * (2 * max(Hk, cp) * dk + Hv * dv) + 8 * T * Hv) if cp > 1 else 0
    norm = 3 * e * T * Hv * dv + (12 + 8 * (e < 4)) * min(T * Hv * dv, GATED_CHUNK)   # the gated norm's
    return max(norm, grads + seg, split) + a2a


# --- memory_plan's hooks: its per-layer terms for a model with linear layers (ModelArgs.linear, layer_types)
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")   # fed by the block's input norm (as q/k/v)


def block_shapes(m, mlp: dict) -> dict:
    """A linear block's frozen Linears, {name: (out, in)}: linear_attn's five and the MLP's (`mlp`)."""
    s = m.linear
    return {**shapes(m.dim, s.k_heads, s.v_heads, s.k_dim, s.v_dim), **mlp}


def dense_shapes(m) -> list:
    """`dense`'s parameters as (dim 0, elements), each FSDP2-sharded on dim 0: conv1d, A_log, dt_bias, the norm's."""
    s = m.linear
    C = 2 * s.k_heads * s.k_dim + s.v_heads * s.v_dim
    return [(C, C * s.conv_kernel), (s.v_heads, s.v_heads), (s.v_heads, s.v_heads), (s.v_dim, s.v_dim)]


def kinds(m, kinds: list, lin: dict, attn: list) -> list:
    """memory_plan's block kinds [(blocks, frozen Linears' (out, in), never-quantized (dim 0, elements), linear)]: the
    linear blocks a kind of their own, out of the one kind a model with linear layers has (Qwen3.5's dense blocks,
    or Qwen3.5-MoE's, every one an MoE block): that kind's Linears with linear_attn's (`lin`'s) in place of the
    attention's (`attn`: its four shapes), so an MoE block's experts, shared expert and router stay; + `dense_shapes`.
    (Until 2026-12-07 a linear block took the dense MLP's shapes: Qwen3.5-MoE's 30 of 40 were planned without their
    experts.)"""
    n = sum(map(m.is_linear, range(m.n_layers)))
    if not n:
        return kinds
    (c, ws, x, _), = kinds
    rest = list(ws)
    for s in attn:
        rest.remove(s)
    own = [s for t, s in lin.items() if t in shapes(m.dim, 1, 1, 1, 1)]   # linear_attn's five
    return [k for k in ((c - n, ws, x, False), (n, own + rest, x + dense_shapes(m), True)) if k[0]]


def sublayer_saved(m, T: int, rows: int, e: int, cp: int, tg, first: bool, direct: bool) -> int:
    """What a linear block's linear_attn keeps (`saved`), with LoRA on the block's targets `tg` (out_proj's A input
    when handed it directly, `lora_inputs`). `first`: its input needs no grad (the lowest adapted block's, layer 0's),
    so only what a target needs: the core (its inputs, states) when any of in_proj_qkv/_b/_a is adapted, the gate's
    softplus input and -exp(A_log) only with in_proj_a; the gated norm (model.deltanet._GatedNormFn) keeps its x, z
    and rsqrt whenever any of them needs a gradient, so with in_proj_z alone those three; nothing with none. (Until
    2026-12-07 the norm's autograd kept z's float32 copy and weight·normed only with in_proj_z.)"""
    s = m.linear
    Hk, Hv, dk, dv, K = s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel
    out = lora_inputs(tg, T, Hv, dv, e) * direct
    if not first:
        return saved(T, rows, Hk, Hv, dk, dv, K, e, cp) + out
    if any(t in tg for t in ("in_proj_qkv", "in_proj_b", "in_proj_a")):
        return saved(T, rows, Hk, Hv, dk, dv, K, e, cp) + out - (4 * T * Hv + 4 * Hv) * ("in_proj_a" not in tg)
    return (2 * e * T * Hv * dv + 4 * T * Hv) * ("in_proj_z" in tg) + out   # the gated norm's x, z and rsqrt


def phase(m, T: int, rows: int, e: int, cp: int) -> int:
    """A linear block's backward at its sublayer, beyond its saved tensors (`backward`)."""
    s = m.linear
    return backward(T, rows, s.k_heads, s.v_heads, s.k_dim, s.v_dim, e, cp, s.conv_kernel)
