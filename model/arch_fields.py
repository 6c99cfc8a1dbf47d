"""The config.json keys of the architectures whose differences model/gemma.py implements, read into ModelArgs fields
as transformers (5.x) reads them.

Contract: `SUPPORTED[model_type]`: the few flags every supported architecture has (biases, q/k norms, transformers'
defaults for missing keys); `FIELDS[model_type](cfg, max_pos)` -> the ModelArgs fields that differ from Llama's
(`rope_theta` and `rope_scaling` among them where the model reads its RoPE its own way); a model_type not in FIELDS
has none.
- `gemma_fields`: gemma3_text (RoPE per layer type, layer types from sliding_window_pattern, query_pre_attn_scalar);
  Gemma 2's soft-capping and bidirectional attention are refused naming the key.
- `olmo_fields`: olmo2 / olmo3 (OLMo 3: RoPE per layer type, YaRN in rope_scaling on the full layers; layer types every
  fourth full without layer_types).
- `typed_rope`: the per-layer-type RoPE of both.
- `smollm3_fields`: SmolLM3's NoPE layers (`rope_layers`, from no_rope_layers or every no_rope_layer_interval-th layer
  without RoPE) and its sliding window (use_sliding_window: on the layers layer_types marks, by default the NoPE ones),
  its RoPE theta 2e6 without one.
- `granite_fields`: Granite's four multipliers (`embed_multiplier`, `residual_multiplier`, `attention_multiplier`,
  `logits_scaling`).
- Qwen3-MoE's (`moe`, its experts and router): model/moe.py's `moe_fields`; Qwen3.5-MoE's (`qwen3_5_moe_text`):
  `qwen35_fields` and `moe_fields` (every block MoE, with a shared expert).
- `gemma4_fields`: gemma4_text (Gemma 4's language model, the dense decoder of google/gemma-4-31B): Gemma 3's block
  with OLMo's norm (weight itself, `norm_offset` 0), attention scale 1, the full layers' own head size and KV heads
  (global_head_dim / num_global_key_value_heads, or transformers' per_layer_config), k_eq_v, v_norm, layer_scalar,
  proportional RoPE on the full layers, final_logit_softcapping; enable_moe_block's experts beside the MLP (26B-A4B:
  model/gemma4_moe.py); E2B / E4B's per-layer embeddings, KV sharing and double-wide MLPs (`small`:
  model/gemma4_small.py).
- `gpt_oss_fields` (model/gpt_oss.py): gpt_oss's sinks, layer types, YaRN default and its MoE MLP.
- `glm4_moe_fields` (model/glm4_moe.py): GLM-4.5's q/k/v biases, q/k norm, partial RoPE and MoE blocks.
- `qwen35_fields`: qwen3_5_text (Qwen3.5's language model): zero-centred norms (Gemma's, `norm_offset` 1), the gated
  attention (`attn_gate`), partial RoPE (`partial_rotary_factor`, 0.25 without one), mrope's keys accepted; the
  Gated DeltaNet layers (`linear_attention` in layer_types, from full_attention_interval without it): `layer_types`
  and `linear` (model.linear_layers.linear_spec, the linear_* keys).
"""

from __future__ import annotations

import math

from model import gemma4_moe
from model.gemma4_small import small_fields
from model.glm4_moe import glm4_moe_fields
from model.gpt_oss import gpt_oss_fields
from model.linear_layers import linear_spec
from model.moe import moe_fields
from model.phi3 import phi3_fields
from model.rope_read import read_rope, rope_theta

GELU_TANH = ("gelu_pytorch_tanh",)   # transformers' ACT2FN name of F.gelu(approximate="tanh")


# model_type -> the architecture differences that matter here; a few explicit flags, no hierarchy.
# qkv_bias: True always (q, k, v; o never), None from `attention_bias` (q, k, v and o), False never (transformers
# ignores the key there); mlp_bias: read from `mlp_bias` or never; max_pos, kv, head_dim: transformers' defaults for a
# config.json without max_position_embeddings (the original length of a YaRN/llama3 scaling without its own),
# num_key_value_heads, head_dim (None: num_attention_heads, hidden_size / num_attention_heads); qk_norm: RMSNorm over
# head_dim on q and k (Qwen3); eps: rms_norm_eps when missing (1e-6 without). Ministral is Mistral with `layer_types`;
# Ministral 3 (ministral3) is Mistral with YaRN by default (rope.MINISTRAL3_ROPE) and Llama 4's attention temperature.
SUPPORTED = {
    "llama": dict(qkv_bias=None, mlp_bias=True, qk_norm=False, max_pos=2048, kv=None, head_dim=None),
    "mistral": dict(qkv_bias=False, mlp_bias=False, qk_norm=False, max_pos=131072, kv=8, head_dim=None),
    "ministral": dict(qkv_bias=False, mlp_bias=False, qk_norm=False, max_pos=131072, kv=8, head_dim=None),
    "qwen2": dict(qkv_bias=True, mlp_bias=False, qk_norm=False, max_pos=32768, kv=32, head_dim=None),
    "qwen3": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=32768, kv=32, head_dim=128),
    "ministral3": dict(qkv_bias=False, mlp_bias=False, qk_norm=False, max_pos=262144, kv=8, head_dim=128, eps=1e-5),
    "gemma3_text": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=131072, kv=4, head_dim=256),   # + gemma.py
    "olmo2": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=2048, kv=None, head_dim=None, eps=1e-5),
    "olmo3": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=2048, kv=None, head_dim=None, eps=1e-5),
    "smollm3": dict(qkv_bias=None, mlp_bias=True, qk_norm=False, max_pos=32768, kv=4, head_dim=None),   # + gemma.py
    "granite": dict(qkv_bias=None, mlp_bias=True, qk_norm=False, max_pos=2048, kv=None, head_dim=None),   # + gemma.py
    "qwen3_moe": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=32768, kv=4, head_dim=None),   # + moe.py
    "gemma4_text": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=131072, kv=4, head_dim=256),   # + below
    "qwen3_5_text": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=32768, kv=4, head_dim=256),   # + below
    "qwen3_5_moe_text": dict(qkv_bias=None, mlp_bias=False, qk_norm=True, max_pos=32768, kv=2, head_dim=256),
    "gpt_oss": dict(qkv_bias=None, mlp_bias=False, qk_norm=False, max_pos=131072, kv=8, head_dim=64, eps=1e-5),
    "phi3": dict(qkv_bias=False, mlp_bias=False, qk_norm=False, max_pos=4096, kv=None, head_dim=None, eps=1e-5),
    "glm4_moe": dict(qkv_bias=False, mlp_bias=False, qk_norm=False, max_pos=131072, kv=8, head_dim=None, eps=1e-5),
}
MROPE = ("mrope_section", "mrope_interleaved")   # Qwen3.5's multimodal RoPE axes (text rows: plain RoPE, qwen35_fields)
SLIDING_WINDOW = 4096   # transformers' Mistral, Ministral and Qwen2/3 default when config.json names none


def gemma_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a gemma3_text config.json (module docstring), defaults as Gemma3TextConfig's."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported (Gemma 2's soft-capping; Gemma 3 sets "
                             f"it null): the attention kernels here do not cap scores; the loss caps Gemma 4's only")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention true is not supported (an embedding model's "
                         "attention): this decoder is causal; pass a causal Gemma 3 checkpoint")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GELU_TANH:
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported: Gemma's MLP here is "
                         f"gelu_pytorch_tanh (gelu, tanh approximation)")
    # transformers' Gemma3TextConfig.convert_rope_params_to_dict: a classic rope_scaling updates the full layers'
    rope = typed_rope(cfg, max_pos, cfg.get("rope_theta", 1e6), cfg.get("rope_local_base_freq", 1e4))
    pattern = cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return dict(**rope, sliding_window=cfg.get("sliding_window", 4096), layer_types=types, norm_offset=1.0,
                sandwich_norms=True, act="gelu_tanh", embed_scale=True,
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256))


def olmo_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of an olmo2 / olmo3 config.json (module docstring), defaults as Olmo2Config's / Olmo3Config's
    (olmo2: one RoPE, read by the caller)."""
    olmo = dict(norm_offset=0.0, post_norms=True, qk_norm_whole=True)
    if cfg["model_type"] == "olmo2":   # full attention on every layer
        return dict(olmo, sliding_window=None, layer_types=None)
    # Olmo3Config: the full layers' theta is config.json's rope_theta (500000 without), the sliding layers' 500000
    # unless rope_parameters names it (transformers 5 pops rope_theta for the full layers first; 4.57 gave both it)
    sliding = ((cfg.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta")
    if sliding is None and cfg.get("rope_theta", 5e5) != 5e5:
        raise ValueError(f"config.json: olmo3 rope_theta {cfg['rope_theta']} and no sliding_attention rope_theta: "
                         "transformers 5 gives the sliding layers 500000, 4.57 gave them rope_theta; name it in "
                         "rope_parameters.sliding_attention.rope_theta")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return dict(olmo, **typed_rope(cfg, max_pos, cfg.get("rope_theta", 5e5), 5e5), layer_types=types,
                sliding_window=cfg.get("sliding_window", 4096))


def smollm3_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a smollm3 config.json (module docstring), as SmolLM3Config.__post_init__ fills them."""
    n = cfg["num_hidden_layers"]
    rope = cfg.get("no_rope_layers")
    if rope is None:   # every interval-th layer (the 4th, 8th... by default) has no RoPE
        interval = cfg.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json: no_rope_layer_interval {interval!r} must be a positive whole number")
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(rope, list) or len(rope) < n or any(v not in (0, 1) for v in rope[:n]):
        raise ValueError(f"config.json: no_rope_layers {rope!r} must hold 1 (RoPE) or 0 (no RoPE) for each of the {n} "
                         "layers")
    rope = [int(v) for v in rope[:n]]   # (transformers reads the first n)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types") or ["sliding_attention" if window is not None and not r else "full_attention"
                                       for r in rope]
    if "sliding_attention" in types and window is None:   # (transformers' sdpa mask would slide, its flash path not)
        raise ValueError(f"config.json: layer_types names sliding layers but use_sliding_window is "
                         f"{cfg.get('use_sliding_window', False)} and sliding_window {cfg.get('sliding_window')}: set "
                         "both (use_sliding_window true and the window), or mark those layers full_attention")
    theta, scaling = read_rope({"rope_theta": 2e6, **cfg}, max_pos)   # (SmolLM3Config.default_theta)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_layers=rope, sliding_window=window,
                layer_types=types if window is not None else None)


def granite_fields(cfg: dict) -> dict:
    """ModelArgs fields of a granite config.json: its multipliers (GraniteConfig's defaults 1.0), positive numbers."""
    keys = dict(embedding_multiplier="embed_multiplier", residual_multiplier="residual_multiplier",
                attention_multiplier="attention_multiplier", logits_scaling="logits_scaling")
    out = {}
    for key, field in keys.items():
        v = cfg.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"config.json: {key} {v!r} must be a positive number (Granite's; 1.0 without it)")
        out[field] = float(v)
    return out


def typed_rope(cfg: dict, max_pos: int, theta: float, local_theta: float) -> dict:
    """rope_theta, rope_scaling and local_rope of a config.json with RoPE per layer type (rope_parameters
    {"full_attention": {...}, "sliding_attention": {...}}, or the classic top-level keys) as transformers 5's
    Gemma3TextConfig and Olmo3Config read it: a classic rope_scaling updates the full layers', a type's missing theta
    is `theta` (full) or `local_theta` (sliding)."""
    params = cfg.get("rope_parameters") or {}
    if params and not all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: {cfg['model_type']} rope_parameters {params} must be per layer type "
                         "({'full_attention': {...}, 'sliding_attention': {...}}), as transformers writes them")
    full = dict(params.get("full_attention") or {"rope_type": "default"}, **(cfg.get("rope_scaling") or {}))
    full.setdefault("rope_theta", theta)
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", local_theta)
    orig = {k: cfg[k] for k in ("original_max_position_embeddings",) if k in cfg}
    (theta, scaling), (ltheta, lscaling) = (read_rope({"rope_parameters": d, **orig}, max_pos) for d in (full, local))
    return dict(rope_theta=rope_theta(theta, scaling), rope_scaling=scaling,   # (numbers above 0: rope_read)
                local_rope={"rope_theta": rope_theta(ltheta, lscaling), **lscaling})


GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},   # (Gemma4TextConfig's)
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}


def gemma4_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a gemma4_text config.json, read as Gemma4TextConfig.__post_init__ fills them (module
    docstring); bidirectional attention and another activation refused naming the key."""
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):   # ("vision": text rows causal, transformers'
        raise ValueError(f"config.json: use_bidirectional_attention "   # mask; images do not run here)
                         f"{cfg['use_bidirectional_attention']!r} is not supported: this decoder is causal")
    if (act := cfg.get("hidden_activation", "gelu_pytorch_tanh")) not in GELU_TANH:
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported: Gemma's MLP here is "
                         "gelu_pytorch_tanh (gelu, tanh approximation)")
    n, hd, kv = cfg["num_hidden_layers"], cfg.get("head_dim", 256), cfg.get("num_key_value_heads", 4)
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if types:   # transformers makes the last layer full whatever config.json says (with a warning)
        types[-1] = "full_attention"
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per = cfg.get("per_layer_config")   # transformers' own form (save_pretrained's); else from the global_* keys
    if per is None:
        over = {"head_dim": cfg.get("global_head_dim", 512)}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per = {i: over for i, t in enumerate(types) if t == "full_attention"}
    per = {int(i): v for i, v in per.items()}
    dims = [(per.get(i, {}).get("head_dim", hd), per.get(i, {}).get("num_key_value_heads", kv)) for i in range(n)]
    full = {d for d, t in zip(dims, types) if t == "full_attention"}
    if any(set(v) - {"head_dim", "num_key_value_heads"} for v in per.values()) or len(full) > 1 or any(
            d != (hd, kv) for d, t in zip(dims, types) if t != "full_attention"):
        raise ValueError(f"config.json: per_layer_config {per} is not supported: the full layers' head_dim and "
                         "num_key_value_heads (one pair for all of them) are what this decoder varies by layer")
    rope = cfg.get("rope_parameters") or GEMMA4_ROPE
    if not isinstance(rope, dict) or not all(isinstance(rope.get(t), dict) for t in set(types)):
        raise ValueError(f"config.json: gemma4_text rope_parameters {rope} must hold a RoPE for each layer type "
                         "({'full_attention': {...}, 'sliding_attention': {...}}), as transformers writes them")
    g, loc = rope.get("full_attention", GEMMA4_ROPE["full_attention"]), rope.get("sliding_attention", {})
    if g.get("rope_type", "default") not in ("default", "proportional") or loc.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: gemma4_text rope_parameters {rope}: the full layers' default or proportional "
                         "RoPE and the sliding layers' default are supported")
    scaling = {k: v for k, v in g.items() if k != "rope_theta"} if g.get("rope_type") == "proportional" else {}
    softcap = cfg.get("final_logit_softcapping")
    return dict(rope_theta=rope_theta(g.get("rope_theta", 1e6), scaling), rope_scaling=scaling,
                local_rope={"rope_theta": rope_theta(loc.get("rope_theta", 1e4), {})},
                sliding_window=cfg.get("sliding_window", 512),
                layer_types=types, norm_offset=0.0, sandwich_norms=True, act="gelu_tanh", embed_scale=True,
                attention_multiplier=1.0, global_head_dim=next(iter(full), (hd, kv))[0],
                global_kv_heads=next(iter(full), (hd, kv))[1], k_eq_v=k_eq_v, v_norm=True, layer_scalar=True,
                logit_softcap=None if softcap is None else float(softcap),
                **(gemma4_moe.moe_fields(cfg) if cfg.get("enable_moe_block") else {}),   # (26B-A4B: gemma4_moe.py)
                **small_fields(cfg, types))   # (E2B / E4B: per-layer embeddings, KV sharing; gemma4_small.py)


def qwen35_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a qwen3_5_text config.json, defaults as Qwen3_5TextConfig's (module docstring)."""
    n = cfg["num_hidden_layers"]
    every = cfg.get("full_attention_interval", 4)   # (Qwen3_5TextConfig: layer_types from it when missing)
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if types and not set(types) <= {"full_attention", "linear_attention"}:
        raise ValueError(f"config.json: layer_types {sorted(set(types) - {'full_attention', 'linear_attention'})} are "
                         "not Qwen3.5's (full_attention, linear_attention)")
    linear = linear_spec(cfg) if "linear_attention" in types else None   # (Gated DeltaNet: model/linear_layers.py)
    # transformers reads a classic rope_scaling in place of rope_parameters; the factor from that dict, then the top
    # level, then Qwen3_5TextConfig's 0.25. mrope_section / mrope_interleaved place the temporal, height and width
    # axes' frequencies; on text rows the three position axes are equal, so that placing changes nothing: plain RoPE
    # (images, whose axes differ, are out of scope: the vision tower does not run here)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    part = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    drop = ("partial_rotary_factor", *MROPE)
    theta, scaling = read_rope({k: {n: v for n, v in d.items() if n not in drop} if isinstance(d, dict) and k in (
        "rope_parameters", "rope_scaling") else d for k, d in cfg.items()}, max_pos)
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=part, norm_offset=1.0, attn_gate=True,
                layer_types=types if linear else None, linear=linear)


FIELDS = {"gemma3_text": gemma_fields, "gemma4_text": gemma4_fields, "olmo2": olmo_fields, "olmo3": olmo_fields,
          "smollm3": smollm3_fields, "phi3": phi3_fields, "glm4_moe": glm4_moe_fields,
          "granite": lambda cfg, max_pos: granite_fields(cfg), "qwen3_moe": lambda cfg, max_pos: moe_fields(cfg),
          "qwen3_5_text": qwen35_fields, "gpt_oss": gpt_oss_fields, "qwen3_5_moe_text": lambda cfg, max_pos: {
              **qwen35_fields(cfg, max_pos), **moe_fields(cfg)}}
