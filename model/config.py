"""`ModelArgs` read from a checkpoint's `config.json` as transformers reads it (a token's FLOPs: model/flops.py).

Contract:
- `ModelArgs.from_config_dict(cfg)`: config.json read as transformers 5 reads it, the architectures supported and
  the keys and checkpoints refused (`ValueError` naming them): model/config_read.py.
- `args.window(layer)`: that layer's sliding window (query i sees keys i - w < j <= i) or None, read
  as transformers reads it (4096 when the key is missing): Mistral's `sliding_window` on every layer, Ministral's
  (or a Mistral config.json with a `layer_types` key: transformers reads it as Ministral) on the layers
  `layer_types` names; Qwen2/3's only with `use_sliding_window`, on the layers `layer_types` marks
  "sliding_attention" (derived from `max_window_layers` when absent: layers i >= max_window_layers slide); Llama
  has none.
- RoPE: config.json's and `--rope-scaling`'s (`read_rope`, `rope_scaling_flag`) model/rope_read.py, `inv_freq` rope.py.
- `args.with_rope_scaling(spec)` is `args` with `--rope-scaling` in place of config.json's scaling, checked by computing
  the frequencies once; `args.context` is the positions the model is made for (`max_position_embeddings`, or
  factor × the original length when scaled), `args.beyond_context(n)` the warning for rows longer than that.
- What LoRA adapts (LORA_TARGETS, --lora-targets, --lora-layers): model/lora_spec.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from model.config_read import read_config
from model.gemma4_small import SmallSpec
from model.linear_layers import LinearSpec
from model.lora_spec import FUSED, sublayer
from model.moe import MoESpec
from model.rope import inv_freq
from model.rope_read import ROPE_TYPES, is_real, keep_temperature, rope_scaling_flag


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
    pad_token_id: int | None = None   # the embedding's padding_idx, as transformers': that row gets no gradient
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None   # keys a query sees on sliding layers, itself included
    layer_types: list | None = None     # per layer "sliding_attention" / "full_attention"; None: all
                                        # layers slide when sliding_window is set
    wrapper: str | None = None          # the multimodal checkpoint whose language model this is ("mistral3",
                                        # "gemma3"), stored under its keys (model/wrapper.py); None: text-only
    # Llama 4's attention temperature (Ministral 3): q times 1 + beta·log(1 + floor(position / length)), per token of
    # its global position (model.rope.cos_sin folds it into q's tables); None: none (every other model)
    attn_temperature_beta: float | None = None
    attn_temperature_length: int | None = None
    # Gemma 3 (model/gemma.py): RMSNorm weight an offset from 1 applied in float32 before the cast; norms on the
    # attention's and MLP's outputs too; gelu-tanh MLP; embedding × sqrt(dim); attention scale
    # query_pre_attn_scalar ** -0.5 (None: head_dim's); the sliding layers' own RoPE {"rope_theta", scaling...}
    norm_offset: float | None = None   # None: Llama's norm (cast, then weight); Gemma's 1.0, OLMo's 0.0
    sandwich_norms: bool = False
    act: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope: dict | None = None
    # OLMo 2/3 (model/gemma.py; norm_offset 0.0, local_rope for OLMo 3): norms on the sublayers' outputs only, none in
    # front of them; q_norm / k_norm over the whole projection (H·Hd, K·Hd), not per head
    post_norms: bool = False
    qk_norm_whole: bool = False
    # SmolLM3 (gemma.py): per layer 1 (RoPE) or 0 (NoPE: q, k unrotated), None: RoPE on all. Granite's: embedding output
    # × embed_multiplier, sublayer outputs × residual_multiplier, attention scale attention_multiplier, logits / scaling
    rope_layers: list | None = None
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    moe: MoESpec | None = None   # Qwen3-MoE's experts and router (model/moe.py); None: every MLP dense
    # Qwen3.5 (model/arch_fields.py's qwen35_fields; norm_offset 1.0): q_proj's output per head [query | gate], the
    # attention's output × sigmoid(gate) before o_proj; RoPE on the first int(head_dim · factor) dims of each head
    attn_gate: bool = False
    partial_rotary_factor: float = 1.0
    linear: LinearSpec | None = None   # the Gated DeltaNet layers' sizes (model/linear_layers.py)
    # Gemma 4 (arch_fields.gemma4_fields; Gemma's block, norm_offset 0.0): the full layers' own head size and KV heads
    # (attn_dims; None: the model's), k_proj's raw output as their v (`k_eq_v`: no v_proj there), a weightless norm on
    # every v, each block's output × its stored [1] layer_scalar, the logits c·tanh(logits / c) (`logit_softcap` c)
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    v_norm: bool = False
    layer_scalar: bool = False
    logit_softcap: float | None = None
    small: SmallSpec | None = None   # Gemma 4 E2B / E4B's per-layer embeddings, KV sharing, wide MLPs (gemma4_small)
    sinks: bool = False   # GPT-OSS: a learned logit per head in each row's softmax denominator (`self_attn.sinks` [H])
    fused: bool = False   # Phi-3: q, k, v in one qkv_proj, gate and up in one gate_up_proj (model/phi3.py; FUSED)

    def __post_init__(self):
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
                 "num_attention_heads": self.n_heads, "intermediate_size": self.intermediate_size}
        for key, v in {**sizes, "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim}.items():
            if (v is not None or key in sizes) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"config.json: {key} {v!r} must be a positive whole number (a broken or hand-edited "
                                 "config.json?)")
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if self.sliding_window is not None and (int(self.sliding_window) != self.sliding_window
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window {self.sliding_window!r} must be a positive number of tokens")
        if self.layer_types is not None:
            kinds = {"sliding_attention", "full_attention"} | ({"linear_attention"} if self.linear else set())
            bad = sorted(set(self.layer_types) - kinds)
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types must name {' or '.join(map(repr, sorted(kinds)))} for each of "
                                 f"the {self.n_layers} layers, got {len(self.layer_types)} entries {bad or ''}")
        beta, n = self.attn_temperature_beta, self.attn_temperature_length   # (numbers, or transformers' torch fails)
        if beta is not None and not all(is_real(v) and v == abs(v) for v in (beta, n)) or n == 0:
            raise ValueError(f"rope_parameters: llama_4_scaling_beta {beta!r} and original_max_position_embeddings "
                             f"{n!r} must be numbers >= 0 and > 0 (Ministral 3's attention temperature)")
        f = self.partial_rotary_factor
        if f == 1 and self.head_dim % 2:   # (every dim rotated, none set: it is head_dim that cannot be)
            raise ValueError(f"head_dim {self.head_dim} must be even: RoPE rotates its dims in pairs (config.json's "
                             "head_dim, or hidden_size / num_attention_heads: fix it in config.json)")
        if (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1 or self.rotary_dim < 2
                or self.rotary_dim % 2):
            raise ValueError(f"rope_parameters: partial_rotary_factor {f!r} must be a number in (0, 1] giving an even "
                             f"number of rotated dims of head_dim {self.head_dim} (int(head_dim · factor) = "
                             f"{int(self.head_dim * f) if isinstance(f, (int, float)) else '?'})")
        rtype = self.rope_scaling.get("rope_type", "default")
        if rtype not in ROPE_TYPES + ("proportional", "longrope"):   # (Gemma 4's full layers', Phi-3's: config.json's
            raise ValueError(f"rope type {rtype!r} is not supported; supported: {ROPE_TYPES}")

    @classmethod
    def from_config_dict(cls, cfg: dict) -> ModelArgs:
        """Read as transformers (5.x) reads the same config.json; keys that would change the math here and that this
        decoder does not implement are refused, naming the key (never silently ignored): model/config_read.py."""
        return read_config(cls, cfg)

    def with_rope_scaling(self, spec: str | None) -> ModelArgs:
        """These args with `--rope-scaling spec` in place of config.json's RoPE scaling (None: unchanged)."""
        sc = keep_temperature(rope_scaling_flag(spec, self), spec, self)
        if sc is None:
            return self
        if self.fused and sc:   # (Phi3Config refuses other types: base_config_overrides.json would not load)
            raise ValueError(f"--rope-scaling {spec}: transformers' Phi-3 reads only default RoPE and LongRoPE (its "
                             "config.json's own scaling), so an adapter trained with this would not load on its base: "
                             "drop --rope-scaling (or pass none for plain RoPE)")
        if self.rope_scaling.get("rope_type") == "proportional":
            raise ValueError(f"--rope-scaling {spec}: this {self.model_type} model's full layers use proportional RoPE "
                             "(a quarter of each head rotated, spread over it), which a scaling here would replace; "
                             "drop --rope-scaling (not yet supported for Gemma 4)")
        out = replace(self, rope_scaling=sc)
        try:
            inv_freq(out)
        except KeyError as e:
            raise ValueError(f"--rope-scaling {spec}: rope type {sc['rope_type']!r} needs {e.args[0]!r}; pass a JSON "
                             "object with it") from None
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ValueError(f"--rope-scaling {spec}: {type(e).__name__}: {e}") from None
        return out

    def local_args(self) -> ModelArgs:
        """These args with the sliding layers' RoPE (`local_rope`) as theirs: what their cos/sin are computed from."""
        sc = {k: v for k, v in self.local_rope.items() if k != "rope_theta"}   # (their head size: head_dim's)
        return replace(self, rope_theta=self.local_rope["rope_theta"], rope_scaling=sc, local_rope=None,
                       global_head_dim=None)

    @property
    def attn_scale(self) -> float:
        """The attention's softmax scale: Granite's attention_multiplier, query_pre_attn_scalar ** -0.5 (Gemma), else
        head_dim ** -0.5."""
        return self.attention_multiplier or (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): head_dim, or int(head_dim · partial_rotary_factor); the
        full layers' (Gemma 4's global_head_dim: proportional RoPE's zero frequencies pass the rest, rope.inv_freq)."""
        return int((self.global_head_dim or self.head_dim) * self.partial_rotary_factor)

    def rotates(self, layer: int) -> bool:
        """Whether decoder layer `layer` applies RoPE to q and k (not SmolLM3's NoPE layers)."""
        return self.rope_layers is None or bool(self.rope_layers[layer])

    def rope_parameters(self) -> dict:
        """The RoPE in transformers 5's config form: rope_theta and the scaling (rope_type "default": none)."""
        part = {"partial_rotary_factor": self.partial_rotary_factor} if self.partial_rotary_factor != 1 else {}
        return {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"}), **part}

    def rope_overrides(self) -> dict:
        """The RoPE as base_config_overrides.json records it, what `from_pretrained(DIR, rope_parameters=...)` takes:
        `rope_parameters()`, per layer type where the sliding layers have their own (Gemma 3, OLMo 3: transformers 5
        reads a flat dict there as the full layers' default RoPE, dropping the scaling)."""
        if self.local_rope is None:
            return self.rope_parameters()
        return {"full_attention": self.rope_parameters(), "sliding_attention": self.local_args().rope_parameters()}

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

    def attn_dims(self, layer: int) -> tuple[int, int, int]:
        """(H, K, Hd) of decoder layer `layer`'s attention: Gemma 4's full layers have their own K and Hd."""
        if self.global_head_dim is None or not self.layer_types or self.layer_types[layer] != "full_attention":
            return self.n_heads, self.n_kv_heads, self.head_dim
        return self.n_heads, self.global_kv_heads or self.n_kv_heads, self.global_head_dim

    @property
    def per_layer_attn(self) -> bool:
        """Whether the layers' attention shapes differ (Gemma 4; parallel/plan_layers.py plans each layer's own)."""
        return len({self.attn_dims(i) for i in range(self.n_layers)}) > 1 or self.k_eq_v

    def projections(self, layer: int | None = None) -> dict[str, tuple[int, int]]:
        """Each block projection LoRA may adapt (LORA_TARGETS): its (in_features, out_features) in block `layer` (None:
        the model's head_dim and KV heads; Gemma 4's full layers differ, `attn_dims`); with linear layers their
        linear_attn's too (LINEAR_TARGETS; model.lora_spec.sublayer: whose a name is; `has`: which blocks)."""
        h, k, hd = self.attn_dims(layer) if layer is not None else (self.n_heads, self.n_kv_heads, self.head_dim)
        d, q, kv, f = self.dim, h * hd, k * hd, self.intermediate_size
        if self.small is not None and layer is not None:   # (Gemma 4 E2B / E4B's KV-shared layers' double-wide MLP)
            f = self.small.width(layer, f)
        if self.fused:   # (Phi-3's two fused Linears in place of q/k/v_proj and gate/up_proj)
            return {"qkv_proj": (d, q + 2 * kv), "o_proj": (q, d), "gate_up_proj": (d, 2 * f), "down_proj": (f, d)}
        return {"q_proj": (d, q * (2 if self.attn_gate else 1)), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),   # (Qwen3.5's q_proj: query and gate)
                **(self.linear.projections(d) if self.linear else {})}

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet one (Qwen3.5's linear_attention)."""
        return self.linear is not None and bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def has(self, layer: int, name: str) -> bool:
        """Whether block `layer` holds projection `name` (attention ones in full layers, linear_attn's in linear; no
        v_proj where k_proj's output is v: Gemma 4's full layers with attention_k_eq_v)."""
        if (name in FUSED) != self.fused and (name in FUSED or any(name in p for p in FUSED.values())):
            return False   # (Phi-3: its fused Linears in place of their parts; other models: no fused ones)
        if name == "v_proj" and self.shares_kv(layer) or name in ("k_proj", "v_proj") and self.small is not None \
                and self.small.reuses(layer):   # (Gemma 4 E2B / E4B: reuse layers take an earlier layer's k, v)
            return False
        return (kind := sublayer(name)) == "mlp" or (kind == "linear_attn") == self.is_linear(layer)

    def shares_kv(self, layer: int) -> bool:
        """Whether decoder layer `layer` takes k_proj's output (before k_norm and RoPE) as v (Gemma 4's k_eq_v)."""
        return self.k_eq_v and bool(self.layer_types) and self.layer_types[layer] == "full_attention"

    @property
    def named(self) -> str:
        """model_type as --plan and the start-up log say it: a wrapper's language model names the checkpoint too."""
        return self.model_type + (f" (the language model of a {self.wrapper} checkpoint)" if self.wrapper else "")

    @property
    def n_params(self) -> int:
        d, h, kv, hd, f = self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate_size
        attn = d * h * hd * (3 if self.attn_gate else 2) + d * kv * hd * 2   # (Qwen3.5's gate: q_proj's other half)
        per_layer = attn + 3 * d * f + (4 if self.sandwich_norms else 2) * d + self.layer_scalar + (
            h * hd + 2 * kv * hd) * self.qkv_bias + d * self.o_bias + h * self.sinks   # (Qwen2's, GPT-OSS's biases)
        extra = sum(d * (h * (2 * e - 2 * hd) + k * e * (1 + (not self.shares_kv(i))) - 2 * kv * hd)
                    for i in range(self.n_layers) for h, k, e in [self.attn_dims(i)]
                    ) if self.per_layer_attn else 0   # (Gemma 4's full layers: their own K, Hd; no v_proj with k_eq_v)
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        moe, sparse = self.moe, sum(self.moe.sparse(i) for i in range(self.n_layers)) if self.moe else 0
        beside = 4 * d + moe.experts if moe and moe.beside else 3 * d * (moe.shared - f) if moe and moe.groups else \
            -3 * d * f * (not moe.shared) + d * bool(moe.shared) if moe else 0   # (GLM-4.5: its shared experts' width,
        # its correction bias a buffer there, uncounted; Qwen3.5-MoE's shared expert: the dense MLP's size, + its gate;
        # Gemma 4's experts beside the dense MLP: + the router's two scales and the MoE's three norms)
        moe_extra = sparse * (moe.experts * (3 * d * moe.width + d + (2 * moe.width + d + 1) * bool(moe.clamp))
                              + beside) if sparse else 0   # experts, router (GPT-OSS: + their biases, the router's)
        linear = sum(map(self.is_linear, range(self.n_layers)))   # (their linear_attn in place of the attention)
        lin_extra = linear * (self.linear.n_params(d) - attn) if linear else 0
        small = self.small.n_params(self) if self.small else 0   # (Gemma 4 E2B / E4B: model/gemma4_small.py)
        return self.n_layers * per_layer + emb + d + moe_extra + lin_extra + extra + small
