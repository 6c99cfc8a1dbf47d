"""Model FLOPs of a training token, for MFU: the standard count of the model's math, not of what runs.

Contract:
- `matmul_params(args)` (a model.config.ModelArgs): the weights that multiply activations (block projections and
  lm_head; not the embedding lookup or the norms); in an MoE block (Qwen3-MoE) a token's: its k experts' and the
  router's (Qwen3.5-MoE: + the shared expert's and its gate's; Gemma 4's: beside the dense MLP's); in Qwen3.5's
  linear layers their linear_attn's projections; each layer's attention at its own (H, K, Hd) (Gemma 4's full
  layers: global_head_dim, num_global_key_value_heads, no v_proj with attention_k_eq_v: ModelArgs.attn_dims,
  shares_kv).
- `block_matmuls(args, i)`: those of block i a token, {q, kv, o, gate_up, down, beside} in that order, by where they
  run: parallel/plan_speed.py times these GEMMs (one count for the MFU column and the step-time model).
- `flops_per_token(args, seq_len, causal=True)`: forward + backward FLOPs of one token in a sequence (or packed
  document) of `seq_len` tokens, 6·P plus the attention's, with each layer's sliding window; no recomputation, no
  LoRA adapters, no saving for a frozen base (its docstring). tests/test_flops.py: = torch's FlopCounterMode.
- `linear_flops_per_token(D, Hk, Hv, dk, dv, K)`: a Qwen3.5 linear-attention (Gated DeltaNet) sublayer's, forward +
  backward, at any length (its docstring): `flops_per_token` counts each linear layer (`ModelArgs.is_linear`) so, in
  place of its attention's projections and core. `linear_core_flops(spec)`: its core's forward a token (the conv and
  the chunked rule, a third of the rest): parallel/plan_speed.py times a linear layer's core by it.
Checked against torch's FlopCounterMode over our model (tests/test_flops.py) and transformers' (tests/test_flops_hf.py:
forward + backward exactly, Gemma 4 and the MoE blocks too; what it counts of attention and DeltaNet: its docstring).
"""

from __future__ import annotations

from model.config import ModelArgs


def matmul_params(args: ModelArgs) -> int:
    """Weights that multiply activations: every decoder projection plus lm_head (the embedding is
    a lookup and norms are elementwise, so neither counts; a tied lm_head still does a matmul)."""
    ple = args.dim * args.n_layers * args.small.ple if args.small else 0   # (per_layer_model_projection: D -> L·P)
    return sum(sum(block_matmuls(args, i).values()) for i in range(args.n_layers)) + args.vocab_size * args.dim + ple


def block_matmuls(args: ModelArgs, i: int) -> dict[str, int]:
    """Block i's weights that multiply each token, by where they run (parallel/plan_speed.py recomputes and tiles them
    by these): `q` (+ Qwen3.5's gate half; a linear layer's in_proj_qkv, _z, _b, _a), `kv` (k_proj, v_proj but where
    k_proj's output is v), `o` (o_proj; out_proj), `gate_up` and `down`: the block's MLP module's (a dense MLP's; an
    MoE block's (Qwen3-MoE) router [E, D] and a token's k experts' gate + up, their down; Qwen3.5-MoE: + its shared
    expert's, intermediate_size wide, and its gate [1, D]), `beside`: what runs beside the MLP module, outside its tiles
    and in the AC recompute: Gemma 4's router and a token's k experts beside its dense MLP; Gemma 4 E2B / E4B's
    per_layer_input_gate and per_layer_projection (D·P each). The MLP at block i's own width (E2B's KV-shared layers:
    twice intermediate_size), no k/v projections where the block reuses an earlier one's K/V."""
    d, f, moe, small = args.dim, args.projections(i)["down_proj"][0], args.moe, args.small
    out = dict(q=0, kv=0, o=0, gate_up=2 * d * f, down=d * f, beside=2 * d * small.ple if small else 0)
    if args.is_linear(i):   # (Qwen3.5's linear layers: linear_attn's five in place of the attention's)
        proj = args.linear.projections(d)
        out.update(q=sum(a * b for n, (a, b) in proj.items() if n != "out_proj"), o=d * proj["out_proj"][0])
    else:   # each at the layer's own (H, K, Hd): Gemma 4's full layers theirs, no v_proj where k_proj's output is v
        h, kv, hd = args.attn_dims(i)
        out.update(q=d * h * hd * (2 if args.attn_gate else 1), kv=d * kv * hd * (2 if args.fused else args.has(
                   i, "k_proj") + args.has(i, "v_proj")), o=d * h * hd)   # (Phi-3: qkv_proj's k and v rows)
    if moe and moe.sparse(i):
        experts = dict(gate_up=d * moe.experts + moe.top_k * 2 * d * moe.width, down=moe.top_k * d * moe.width)
        if moe.beside:
            out["beside"] += sum(experts.values())
        else:   # (Qwen3.5-MoE: the shared expert is the dense MLP's shapes, intermediate_size its width, + its gate;
            sh, w = bool(moe.shared), moe.shared   # GLM-4.5's shared experts: their own width, no gate)
            out.update(gate_up=experts["gate_up"] + sh * (2 * d * w + d * (not moe.groups)), down=experts["down"] + sh
                       * d * w)
    return out


def _linear_layers(args: ModelArgs) -> int:
    return sum(map(args.is_linear, range(args.n_layers)))


def _linear_proj(args: ModelArgs) -> int:   # a linear layer's projection weights (in_proj_qkv, _z, _b, _a, out_proj)
    return sum(i * o for i, o in args.linear.projections(args.dim).values()) if args.linear else 0


def flops_per_token(args: ModelArgs, seq_len: int, causal: bool = True) -> int:
    """Model FLOPs per trained token, forward + backward (the convention MFU is quoted in):

        6 · P  +  6 · L · S · H · Hd          (causal; 12 · L · S · H · Hd without the mask)

    P = `matmul_params`: a weight used once per token costs 2·P forward and 4·P backward (input and
    weight gradients). Attention per layer, head and token: q·K^T over S keys and P·V are 2·S·Hd
    each forward; the causal mask halves the keys on average (S/2); backward is twice forward.
    Not counted: activation-checkpoint and flash-kernel recomputation (hardware, not model, FLOPs),
    LoRA adapter matmuls (6·r·(in + out) per projection, ~0.3% at r 16 on a 7B) and the saving of
    a frozen base (its weight gradients are never computed, so LoRA runs execute nearer 4·P).
    S is the attention span: the row length, or a document's length in packed rows. H·Hd is each layer's own (Gemma
    4's full layers: 32 heads of 512, the sliding ones' of 256; until 2026-12-07 every layer counted as a sliding one).
    Elementwise work is not counted: Gemma's final_logit_softcapping (a few FLOPs a logit) neither. On a sliding-window
    layer (`args.window`) a query sees at most w keys: S/2 on average becomes w - w²/(2·S) once S > w (until 2026-12-06
    S/2 on every layer: Mistral 7B v0.1, w 4,096, at 32k counted 4.3× its attention FLOPs, its mfu ~1.4× too high)."""
    full = [i for i in range(args.n_layers) if not args.is_linear(i)]   # (Qwen3.5's linear layers attend to nothing:
    s = args.linear   # their conv and chunked rule, linear_flops_per_token less its projections, counted in 6·P)
    rule = _linear_layers(args) * (linear_flops_per_token(args.dim, s.k_heads, s.v_heads, s.k_dim, s.v_dim,
                                                          s.conv_kernel) - 6 * _linear_proj(args)) if s else 0
    heads = lambda i: args.attn_dims(i)[0] * args.attn_dims(i)[2]   # H·Hd of layer i (Gemma 4's full layers: theirs)
    if not causal:
        return 6 * matmul_params(args) + 12 * seq_len * sum(map(heads, full)) + rule
    twice_keys = lambda i: seq_len if (w := args.window(i)) is None or seq_len <= w else 2 * w - w * w / seq_len
    # each layer's keys a query sees, S/2 or less, doubled
    return 6 * matmul_params(args) + round(6 * sum(twice_keys(i) * heads(i) for i in full)) + rule


def linear_flops_per_token(D: int, Hk: int, Hv: int, dk: int, dv: int, K: int, chunk: int = 64) -> int:
    """Model FLOPs per trained token of one Gated DeltaNet sublayer (model/deltanet.py), forward + backward = 3 ·
    forward, as `flops_per_token` counts:

        6 · (D·C + 2·D·Hv·dv + 2·D·Hv)  +  6·K·C  +  3 · Hv · (c·(5·dk + 3·dv) + 6·dk·dv)

    C = 2·Hk·dk + Hv·dv. The projections (in_proj_qkv, in_proj_z, out_proj, in_proj_b/a) cost 2 per weight forward;
    the depthwise conv 2·K a channel. The chunked rule (chunk c), per token and value head forward, as it runs: k·kᵀ
    and q·kᵀ within the chunk (2c·dk each), the scores times `fresh` (2c·dv), the two unit-triangular solves (c·dv,
    c·dk: c²·d per chunk, half a dense product's), and three products with the [dk, dv] state (w·M, q·M, kᵀ·fresh:
    2·dk·dv each). So its cost grows with the tokens, not their square: no sequence-length term. The intra-chunk
    products are dense (the causal half is masked after, not skipped), so they count whole. Not counted, as for
    attention: the l2 norms, gates, decays, the gated norm (elementwise), fla's kernel's own schedule on CUDA."""
    C = 2 * Hk * dk + Hv * dv
    proj = D * C + 2 * D * Hv * dv + 2 * D * Hv
    return 6 * proj + 3 * _core(Hk, Hv, dk, dv, K, chunk)


def linear_core_flops(s, chunk: int = 64) -> int:
    """Forward FLOPs a token of the core of a Gated DeltaNet sublayer of LinearSpec `s` (model/deltanet_core.py: the
    depthwise conv and the chunked rule), as `linear_flops_per_token` counts them: 2·K·C + Hv·(c·(5·dk + 3·dv) +
    6·dk·dv); backward counted as twice that there."""
    return _core(s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel, chunk)


def _core(Hk: int, Hv: int, dk: int, dv: int, K: int, chunk: int) -> int:
    return 2 * K * (2 * Hk * dk + Hv * dv) + Hv * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)
