"""Qwen3.5's linear_attention decoder layers around the Gated DeltaNet sublayer (model/deltanet.py).

Contract:
- model/llama.py builds these for `ModelArgs.layer_types` "linear_attention"): `LinearSpec`, the
  sizes config.json gives (`linear_spec(cfg)`, Qwen3_5TextConfig's defaults); `LinearBlock`, transformers'
  Qwen3_5DecoderLayer of that type (input_layernorm -> `linear_attn` -> + residual, post_attention_layernorm -> the
  MLP -> + residual); `LocalLinear`, the model's default core (`prepare` = prepare_linear, the call =
  local_linear_core). The Transformer calls `prepare` once per forward (a model with linear layers only) and hands
  every block a sixth argument `linear` = (core, meta) or None, which attention blocks ignore: a block call's
  arguments are all a checkpoint's recompute, the offload and FSDP's hooks see, so the linear blocks compose with them
  as the others do. Every parallel/ step that touches the attention skips linear blocks (--tiled-attn tiles the full
  layers only; the offload's prefetch release hooks the attention's q: a linear block's input is fetched by its own
  unpack); their pre-norms feed `norm_fed` (parallel/memory.py's norm rebuild).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model import deltanet_core
from model.deltanet import GatedDeltaNet, prepare_linear
from model.gemma import normed


@dataclass(frozen=True)
class LinearSpec:
    """The Gated DeltaNet layers' sizes (config.json's linear_* keys)."""
    k_heads: int        # linear_num_key_heads
    v_heads: int        # linear_num_value_heads
    k_dim: int          # linear_key_head_dim
    v_dim: int          # linear_value_head_dim
    conv_kernel: int    # linear_conv_kernel_dim

    def projections(self, dim: int) -> dict[str, tuple[int, int]]:
        """linear_attn's Linears: (in_features, out_features) each."""
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        return {"in_proj_qkv": (dim, 2 * kd + vd), "in_proj_z": (dim, vd), "in_proj_b": (dim, self.v_heads),
                "in_proj_a": (dim, self.v_heads), "out_proj": (vd, dim)}

    def n_params(self, dim: int) -> int:   # the Linears, the conv, A_log, dt_bias, the gated norm
        conv = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        return sum(i * o for i, o in self.projections(dim).values()) + conv * self.conv_kernel + 2 * self.v_heads \
            + self.v_dim


def linear_spec(cfg: dict) -> LinearSpec:
    """The LinearSpec of a qwen3_5_text config.json, Qwen3_5TextConfig's defaults for missing keys."""
    keys = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4)
    got = {k: cfg.get(k, d) for k, d in keys.items()}
    for k, v in got.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.json: {k} {v!r} must be a positive whole number")
    if got["linear_num_value_heads"] % got["linear_num_key_heads"]:
        raise ValueError(f"config.json: linear_num_value_heads {got['linear_num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads {got['linear_num_key_heads']} (each key head serves a group of value "
                         "heads)")
    return LinearSpec(*got.values())


class LocalLinear:
    """The model's default linear core: one process, the whole sequence (parallel/cp_linear.py's replaces it)."""

    def prepare(self, position_ids):
        return prepare_linear(position_ids)

    def __call__(self, q, k, v, g, beta, conv_w, meta):
        return deltanet_core.local_linear_core(q, k, v, g, beta, conv_w, meta)   # (looked up here: made at first use)


class LinearBlock(nn.Module):
    """A linear_attention decoder layer (module docstring); `norm()` makes the model's RMSNorm (Qwen3.5's zero-centred
    one), `mlp` its MLP. Takes the Block's arguments and `linear` = (core, meta)."""
    pre_norms = ("input_layernorm", "post_attention_layernorm")
    # the projections each pre-norm feeds (parallel/memory.apply_norm_rebuild: their LoRA A keep the norm's input)
    norm_fed = (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a"),
                ("mlp.gate_proj", "mlp.up_proj"))

    def __init__(self, a, norm, mlp: nn.Module):
        super().__init__()
        s = a.linear
        self.linear_attn = GatedDeltaNet(a.dim, s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel, a.norm_eps)
        self.mlp = mlp
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()

    def forward(self, x, cos, sin, core, meta, linear):
        lcore, lmeta = linear
        x = x + self.linear_attn(self.input_layernorm(x), lmeta, lcore)
        return x + self.mlp(normed(self.post_attention_layernorm, self.mlp, x))
