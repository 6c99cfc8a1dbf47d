"""`ModelArgs` read from a checkpoint's `config.json`, and the RoPE frequencies it implies.

Contract:
- `ModelArgs.from_config_dict(cfg)` accepts the classic hub format (top-level `rope_theta`,
  `rope_scaling`) and the newer `rope_parameters` format, for the Llama family: Llama 2/3
  (llama3 rope scaling), Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim) and Mistral.
  Anything else raises `ValueError` naming the supported architectures.
- `args.window(layer)`: that layer's sliding window (query i sees keys i - w < j <= i) or None, read
  as transformers reads it: Mistral's `sliding_window` on every layer; Qwen2/3's only with
  `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (derived from
  `max_window_layers` when absent: layers i >= max_window_layers slide); Llama has none.
- `flops_per_token(args, seq_len, causal=True)`: model FLOPs of one training token (forward +
  backward) for MFU, the standard count (no recomputation, no LoRA adapters); see its docstring.
- `inv_freq(args)` returns the float32 inverse frequencies [head_dim // 2] and the attention
  scaling factor applied to cos/sin (1.0 except for YaRN), for rope types default, linear, llama3
  and yarn — the same numbers transformers computes.
- `rope_scaling_flag(spec, args=None)` reads `--rope-scaling` (module-level docstring of the function);
  `args.with_rope_scaling(spec)` is `args` with it in place of config.json's scaling, checked by computing
  the frequencies once; `args.context` is the positions the model is made for (`max_position_embeddings`, or
  factor × the original length when scaled), `args.beyond_context(n)` the warning for rows longer than that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import torch

# model_type -> the architecture differences that matter here; a few explicit flags, no hierarchy.
SUPPORTED = {
    "llama": dict(qkv_bias=None, qk_norm=False),    # bias from `attention_bias` (q, k, v and o)
    "mistral": dict(qkv_bias=None, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),    # q/k/v always biased, o never
    "qwen3": dict(qkv_bias=None, qk_norm=True),     # RMSNorm over head_dim on q and k before RoPE
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # adaptable projections


@dataclass
class ModelArgs:
    model_type: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)   # includes "rope_type"; empty = default
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None   # keys a query sees on sliding layers, itself included
    layer_types: list | None = None     # per layer "sliding_attention" / "full_attention"; None: all
                                        # layers slide when sliding_window is set

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if self.sliding_window is not None and (int(self.sliding_window) != self.sliding_window
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window {self.sliding_window!r} must be a positive number of tokens")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of "
                                 f"the {self.n_layers} layers, got {len(self.layer_types)} entries {bad or ''}")
        rtype = self.rope_scaling.get("rope_type", "default")
        if rtype not in ROPE_TYPES:
            raise ValueError(f"rope type {rtype!r} is not supported; supported: {ROPE_TYPES}")

    @classmethod
    def from_config_dict(cls, cfg: dict) -> ModelArgs:
        mt = cfg.get("model_type")
        if mt not in SUPPORTED:
            archs = cfg.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={mt!r} (architectures={archs}); supported: "
                "Llama 2/3 (llama), Mistral (mistral), Qwen2/2.5 (qwen2), Qwen3 (qwen3)")
        flags = SUPPORTED[mt]
        # Newer configs nest theta and scaling in `rope_parameters`; classic ones keep them on top.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {}) or rope
        if "type" in scaling and "rope_type" not in scaling:   # very old spelling
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        attn_bias = bool(cfg.get("attention_bias", False))
        # Sliding windows as transformers applies them: Mistral on every layer (it ignores
        # layer_types); Qwen2/3 only with use_sliding_window, on the layers `layer_types` names or,
        # without it, from layer max_window_layers on; Llama never.
        window, layer_types = cfg.get("sliding_window"), None
        if mt == "llama":
            window = None
        if mt in ("qwen2", "qwen3"):
            window = window if cfg.get("use_sliding_window", False) else None
            layer_types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                for i in range(cfg["num_hidden_layers"])]
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"),
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias if flags["qkv_bias"] is None else flags["qkv_bias"],
            o_bias=attn_bias and mt != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            sliding_window=window,
            layer_types=layer_types if window is not None else None,
        )

    def with_rope_scaling(self, spec: str | None) -> ModelArgs:
        """These args with `--rope-scaling spec` in place of config.json's RoPE scaling (None: unchanged)."""
        sc = rope_scaling_flag(spec, self)
        if sc is None:
            return self
        out = replace(self, rope_scaling=sc)
        try:
            inv_freq(out)
        except KeyError as e:
            raise ValueError(f"--rope-scaling {spec}: rope type {sc['rope_type']!r} needs {e.args[0]!r}; pass a JSON "
                             "object with it") from None
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ValueError(f"--rope-scaling {spec}: {type(e).__name__}: {e}") from None
        return out

    def rope_parameters(self) -> dict:
        """The RoPE in transformers 5's config form: rope_theta and the scaling (rope_type "default": none)."""
        return {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}

    @property
    def context(self) -> int:
        """The positions the model is made for: factor × the original length when scaled, else the config's."""
        sc = self.rope_scaling
        if not sc.get("factor"):
            return self.max_position_embeddings
        orig = sc.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(sc["factor"] * orig))

    def beyond_context(self, max_len: int) -> str | None:
        """A warning when rows of `max_len` tokens reach past `context` (training there is allowed: it is how a
        context is extended, but the positions are new to the model)."""
        if max_len <= self.context:
            return None
        head = (f"warning: --max-len {max_len} reaches past the {self.context:,} positions this model is made for; "
                "positions beyond them are new to it. Extending the context? ")
        if not self.rope_scaling:
            return head + (f"Scale RoPE, e.g. --rope-scaling yarn:{math.ceil(max_len / self.max_position_embeddings)}"
                           " (see the model card for its factor and original length)")
        sc = self.rope_scaling
        return head + (f"RoPE is scaled ({sc['rope_type']}, factor {sc.get('factor')}); --rope-scaling replaces that "
                       "scaling, it does not add to it: the same type with a larger factor, per the model card")

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None for full causal attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return int(self.sliding_window)

    @property
    def n_params(self) -> int:
        d, h, kv, hd, f = self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate_size
        attn = d * h * hd * 2 + d * kv * hd * 2
        per_layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d


def matmul_params(args: ModelArgs) -> int:
    """Weights that multiply activations: every decoder projection plus lm_head (the embedding is
    a lookup and norms are elementwise, so neither counts; a tied lm_head still does a matmul)."""
    d, h, kv, hd, f = args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size
    per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f   # q, o; k, v; gate, up, down
    return args.n_layers * per_layer + args.vocab_size * d


def flops_per_token(args: ModelArgs, seq_len: int, causal: bool = True) -> int:
    """Model FLOPs per trained token, forward + backward (the convention MFU is quoted in):

        6 · P  +  6 · L · S · H · Hd          (causal; 12 · L · S · H · Hd without the mask)

    P = `matmul_params`: a weight used once per token costs 2·P forward and 4·P backward (input and
    weight gradients). Attention per layer, head and token: q·K^T over S keys and P·V are 2·S·Hd
    each forward; the causal mask halves the keys on average (S/2); backward is twice forward.
    Not counted: activation-checkpoint and flash-kernel recomputation (hardware, not model, FLOPs),
    LoRA adapter matmuls (6·r·(in + out) per projection, ~0.3% at r 16 on a 7B) and the saving of
    a frozen base (its weight gradients are never computed, so LoRA runs execute nearer 4·P).
    S is the attention span: the row length, or a document's length in packed rows."""
    attn = 12 * args.n_layers * seq_len * args.n_heads * args.head_dim
    return 6 * matmul_params(args) + (attn // 2 if causal else attn)


def rope_scaling_flag(spec: str | None, args: ModelArgs | None = None) -> dict | None:
    """`--rope-scaling`: None keeps config.json's scaling; "none" is plain RoPE ({}); "linear:F" or "yarn:F" scale
    by F, "yarn:F@N" with original length N (default: config.json's max_position_embeddings, as transformers takes
    it); a JSON object is transformers' rope_scaling form ({"rope_type": "llama3", "factor": 8, ...}): numbers
    finite and > 0 (a factor from 1 to 1024), `truncate` a bool, no other keys. Without `args` only the syntax is
    checked (start-up, before config.json is read); a bad value raises ValueError naming the forms."""
    if spec is None:
        return None
    forms = 'none, linear:F, yarn:F or yarn:F@N (F >= 1, N the original length) or a JSON object such as ' \
        '\'{"rope_type": "yarn", "factor": 4}\''
    if spec.strip() == "none":
        return {}
    if spec.lstrip().startswith("{"):
        try:
            sc = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--rope-scaling {spec}: not valid JSON ({e.msg}); pass {forms}") from None
        if not isinstance(sc, dict):
            raise ValueError(f"--rope-scaling {spec}: pass {forms}")
        sc = dict(sc)
        if "type" in sc and "rope_type" not in sc:
            sc["rope_type"] = sc.pop("type")
    else:
        kind, _, rest = spec.partition(":")
        factor, at, orig = rest.partition("@")
        try:
            sc = {"rope_type": kind.strip(), "factor": float(factor)}
            if at:
                sc["original_max_position_embeddings"] = int(orig)
        except ValueError:
            raise ValueError(f"--rope-scaling {spec}: pass {forms}") from None
        if at and sc["rope_type"] != "yarn":
            raise ValueError(f"--rope-scaling {spec}: @N (the original length) is YaRN's; pass {forms}")
        if sc["rope_type"] not in ("linear", "yarn"):
            raise ValueError(f"--rope-scaling {spec}: TYPE:F takes linear or yarn (other types: a JSON object); "
                             f"pass {forms}")
    if sc.get("rope_type") not in ROPE_TYPES:
        raise ValueError(f"--rope-scaling {spec}: rope type {sc.get('rope_type')!r} is not one of {ROPE_TYPES}")
    f = sc.get("factor")
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)   # noqa: E731
    if sc["rope_type"] != "default" and not (real(f) and 1 <= f <= 1024):
        raise ValueError(f"--rope-scaling {spec}: the factor must be a number from 1 to 1024, got {f!r}")
    keys = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim", "low_freq_factor", "high_freq_factor"}
    for k, v in sc.items():
        if k == "rope_type" or k == "truncate" and isinstance(v, bool):
            continue
        if k == "truncate":
            raise ValueError(f"--rope-scaling {spec}: truncate must be true or false, got {v!r}")
        if k not in keys:
            raise ValueError(f"--rope-scaling {spec}: unknown key {k!r}; known: rope_type, truncate, "
                             f"{', '.join(sorted(keys))}")
        if not (real(v) and v > 0):
            raise ValueError(f"--rope-scaling {spec}: {k} must be a finite number > 0, got {v!r}")
    if sc["rope_type"] == "default":
        return {}
    for k, v in sc.items():   # one spelling per value: 4 and 4.0 are the same factor
        if k not in ("rope_type", "truncate"):
            sc[k] = int(v) if k == "original_max_position_embeddings" and v == int(v) else float(v)
    if args is not None and sc["rope_type"] == "yarn":
        sc.setdefault("original_max_position_embeddings", args.max_position_embeddings)
    return sc


def inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies [head_dim // 2] (float32) and the cos/sin scaling factor."""
    d, base, sc = args.head_dim, args.rope_theta, args.rope_scaling
    freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rtype = sc.get("rope_type", "default")
    if rtype == "linear":
        return freq / sc["factor"], 1.0
    if rtype == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_ctx / lo, freq / factor, freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if rtype == "yarn":
        # YaRN (Peng et al., 2023): interpolate slow dims, extrapolate fast ones, ramp between.
        factor = sc["factor"]
        orig = sc.get("original_max_position_embeddings") or args.max_position_embeddings

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        attn = sc.get("attention_factor")
        if attn is None:
            m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def corr_dim(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(sc.get("beta_fast") or 32), corr_dim(sc.get("beta_slow") or 1)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        return (freq / factor) * (1 - extrap) + freq * extrap, float(attn)
    return freq, 1.0
