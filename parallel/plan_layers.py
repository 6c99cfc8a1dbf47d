"""The memory plan's per-layer attention shapes (Gemma 4, gemma4_text): each decoder layer's attention planned with its
own (H, K, hd) (ModelArgs.attn_dims: the sliding layers' head_dim and num_key_value_heads, the full layers'
global_head_dim and num_global_key_value_heads), in parallel/plan.py's notation. Functions of ModelArgs; memory_plan
calls them through the hooks below (`key`, `attn_shapes`, `kinds`, `v_norm_saved`, `rope_bytes`).

- Weights (terms 1, 5): a block's frozen Linears are its own q_proj [H·hd, D], k_proj [K·hd, D], v_proj [K·hd, D]
  (none where attention_k_eq_v makes k_proj's output v: ModelArgs.shares_kv) and o_proj [D, H·hd]; the blocks of one
  shape a kind of their own (`kinds`), FSDP2's unsharded block the largest kind's. layer_scalar: a frozen [1]
  parameter per block, with the norms (padded to W by FSDP2 as they are); the q/k norms' weights [hd] (every model's
  with qk_norm: until 2026-12-07 left out of term 1) at the layer's hd, with them.
- LoRA (term 3): each block's targets at its own shapes (a k_eq_v layer has no v_proj to adapt: ModelArgs.has), and
  --train-norms' q/k norms [hd] at the layer's hd.
- Activations (term 4): the kernel's q, k, v, out, lse, the q/k norms' inputs and o_proj's LoRA at the layer's hd and
  K; v_norm (a weightless RMSNorm on v: model.gemma.UnitRMSNorm) keeps its input (v_proj's output, eT·K·hd; on a k_eq_v
  layer k_proj's output, which k_norm keeps already: no bytes), its float32 rsqrt (4T·K) and its one-element float32
  weight (4 bytes, made per call) wherever v needs a gradient (`v_norm_saved`). cos/sin: the full layers' table
  (rotary_dim, hd of those) and the sliding layers' (their head_dim): 2eT·(hd_full + hd_sliding) (`rope_bytes`).
- The block phases (6, 7, 9, 10) of parallel/plan_block.py: each kind's at its (K', hd); the peak block the worst.
- The loss phase (8): final_logit_softcapping's second float32 block (parallel/plan_block.loss_terms).
- The efficient op's K/V expanded in the full layers' forward on CUDA (plan_block's term 11; its backward's: term 7).
Not modelled: v_norm's backward ([T, K·hd] more in the q/k/v phase while dv waits for its chain), the efficient
kernel's own workspace (a float32 dq accumulator, if it keeps one at a head size of 512: not measured on a GPU).
Not measured against a GPU trace (2026-12): the saved tensors are pinned against autograd's (tests/test_plan_layers.py).
"""

from __future__ import annotations

from argparse import Namespace
from collections import Counter
from dataclasses import replace

from model.lora_spec import FUSED


def unfused(m, args):
    """(m, args) as the plan takes them: Phi-3's fused Linears (model/phi3.py) as their parts, the same weights and
    activations (qkv_proj's output cut into q, k, v; gate_up_proj's into gate and up), and --lora-targets' fused
    names as their parts; `doubled` names the parts whose LoRA A the plan then leaves out."""
    if not m.fused:
        return m, args
    names = [t for n in args.lora_targets.split(",") for t in FUSED.get(n, (n,))]
    return replace(m, fused=False), Namespace(**{**vars(args), "lora_targets": ",".join(names), "fused": True})


def doubled(args, targets) -> tuple:
    """The parts in `targets` past the first of each fused Linear (`unfused`'s args): the LoRA A, its input and output
    that one pair on the fused Linear has once, not once a part."""
    if not getattr(args, "fused", False):
        return ()
    return tuple(t for parts in FUSED.values() if all(p in targets for p in parts) for t in parts[1:])


def key(m, i: int) -> tuple:
    """Block i's kind for the plan: (linear, (H, K, hd), shares k_proj's output as v, has k_proj, MLP width)."""
    return m.is_linear(i), m.attn_dims(i), m.shares_kv(i), m.has(i, "k_proj"), m.projections(i)["up_proj"][1]


def attn_shapes(m, i: int) -> dict:
    """Block i's attention Linears {name: (out, in)} (Qwen3.5's q_proj gives each head its gate too; Gemma 4 E2B /
    E4B's reuse layers: no k_proj, v_proj), and with per-layer MLP widths (Gemma 4 E2B / E4B) its MLP's."""
    H, K, hd = m.attn_dims(i)
    kv = {t: (K * hd, m.dim) for t in ("k_proj", "v_proj") if m.has(i, t)}
    return {"q_proj": (H * hd * (1 + m.attn_gate), m.dim), **kv, "o_proj": (m.dim, H * hd), **mlp_shapes(m, i)}


def mlp_shapes(m, i: int) -> dict:
    """Block i's MLP Linears at its own width where widths differ by layer (Gemma 4 E2B / E4B), else {}."""
    f = m.projections(i)["up_proj"][1]
    return {"gate_proj": (f, m.dim), "up_proj": (f, m.dim), "down_proj": (m.dim, f)} if m.small is not None else {}


def kinds(m, kinds: list, attn: list) -> list:
    """memory_plan's block kinds [(blocks, frozen Linears' (out, in), never-quantized, key)] keyed by `key`: a model
    whose attention shapes differ by layer (ModelArgs.per_layer_attn) has one dense kind (`kinds`' non-linear one),
    split here by attention shape, each with its own attention Linears in place of `attn` (the model-wide four); Gemma
    4 E2B / E4B's by KV sharing and MLP width too (the reuse layers: no k/v, E2B's a 2F MLP: parallel/plan_small.py)."""
    first = lambda lin: next(i for i in range(m.n_layers) if m.is_linear(i) == lin)
    if not m.per_layer_attn and m.small is None:
        return [(c, ws, x + qk_norms(m, first(lin)), key(m, first(lin))) for c, ws, x, lin in kinds]
    if (m.moe is not None and not m.moe.beside) or m.linear is not None:   # (no such model: Gemma 4's only, its MoE
        raise ValueError(f"{m.named}: per-layer attention shapes with MoE or linear blocks are not planned")
    (c, ws, x, _), = kinds
    rest = list(ws)
    f = m.intermediate_size   # (Gemma 4 E2B / E4B: the MLP at each kind's own width, attn_shapes')
    for s in attn + [(f, m.dim), (f, m.dim), (m.dim, f)] * (m.small is not None):
        rest.remove(s)
    count = Counter(key(m, i) for i in range(m.n_layers))
    at = {key(m, i): i for i in reversed(range(m.n_layers))}   # each kind's first layer
    return [(n, list(attn_shapes(m, at[k]).values()) + rest, x + qk_norms(m, at[k]), k) for k, n in count.items()]


def qk_norms(m, i: int) -> list:
    """Block i's q/k norm weights as (dim 0, elements), frozen, never quantized: [hd] each (OLMo's over the projection:
    [H·hd], [K·hd]); none in a linear block or without qk_norm."""
    H, K, hd = m.attn_dims(i)
    widths = [hd * n for n in ((H, K) if m.qk_norm_whole else (1, 1))][:1 + m.has(i, "k_proj")]   # (a reuse layer:
    return [] if not m.qk_norm or m.is_linear(i) else [(w, w) for w in widths]                  # no k_norm)


def v_norm_saved(m, i: int, T: int, e: int, v_grad: bool) -> int:
    """Bytes Gemma 4's v_norm keeps in block i (module docstring): its input (unless k_proj's output, kept by k_norm),
    its rsqrt and its one-element weight, when v needs a gradient (`v_grad`); 0 without v_norm."""
    if not (m.v_norm and v_grad and m.has(i, "k_proj")):   # (Gemma 4 E2B / E4B's reuse layers: no v_norm)
        return 0
    _, K, hd = m.attn_dims(i)
    return e * T * K * hd * (not m.shares_kv(i)) + 4 * T * K + 4


def rope_bytes(m, T: int, e: int, kept=lambda i: True) -> int:
    """cos and sin (term 4): rotary_dim wide (Ministral 3: q's own beside them), and with local_rope the sliding
    layers' too, at their own width (Gemma 4: head_dim, the full layers' global_head_dim); each table where `kept`
    holds for a layer taking it (model.gemma.SandwichBlock's table; linear layers take none)."""
    local = lambda i: bool(m.local_rope and m.layer_types and m.layer_types[i] == "sliding_attention")
    full, loc = (any(kept(i) for i in range(m.n_layers) if local(i) == s and not m.is_linear(i)) for s in (0, 1))
    return 2 * e * T * (m.rotary_dim * (1 + (m.attn_temperature_beta is not None)) * full
                        + (m.local_args().rotary_dim if m.local_rope else 0) * loc)
