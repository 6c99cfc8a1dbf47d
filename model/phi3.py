"""Phi-3 / Phi-4 (`model_type: phi3`, transformers' Phi3ForCausalLM): Llama with fused projections, partial RoPE and
LongRoPE, read from config.json as transformers 5's Phi3Config reads it.

Contract:
- `phi3_fields(cfg, max_pos)` -> the ModelArgs fields that differ from Llama's: `fused` (q, k, v rows stacked in one
  `self_attn.qkv_proj` [(H + 2K)·Hd, D]; gate rows then up rows in one `mlp.gate_up_proj` [2F, D]: HF's names, so the
  checkpoint loads with no renames and NF4 / LoRA / peft see the same two Linears transformers has),
  `partial_rotary_factor` (Phi-4-mini: 0.75), the RoPE (default or `longrope`: `read_longrope`), `sliding_window` on
  every layer (None without one). Non-zero dropouts (resid_pdrop, embd_pdrop; attention_dropout: config_read) are
  refused naming the key: training here runs without dropout, and transformers applies them in train mode.
- `read_longrope` checks short_factor / long_factor (rotary_dim / 2 numbers each) and fills `factor` and
  `attention_factor` as transformers' _compute_longrope_parameters does; model/rope.py computes both frequency sets and
  picks per row (the row's largest position + 1 above original_max_position_embeddings: long), from the positions
  of the whole row (`model.attention.AttentionCore.row_span`: under context parallelism the max over the cp ranks).
- `pad_restart(margs)`: LongRoPE's original length, where data.collate restarts a row's padding that would carry its
  last document past it (so padding never switches a document's factors: any packing, --no-pack row, CP divisor).
- `project(attn, x, i)`: q_proj's, k_proj's or v_proj's output (i = 0, 1, 2): the model's own Linear, or the rows of
  qkv_proj (x the input, or `Split`: the fused output computed once for all three).
- `mlp_inputs(a, f)` makes an MLP's gate and up Linears or its fused one; `gate_up(mlp, x)`: (gate, up) of an MLP:
  its two Linears, or gate_up_proj's halves. `NORM_FED`: the Linears a block's norms feed (parallel/memory.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.rope_read import read_rope

PHI3_DROPOUTS = ("resid_pdrop", "embd_pdrop")   # (attention_dropout: refused for every model, model/config_read.py)


def read_longrope(sc: dict, rotary: int, max_pos: int) -> dict:
    """A longrope scaling with its factors checked (numbers, rotary / 2 of each) and `factor` (max_position_embeddings
    / the original length without one) and `attention_factor` (sqrt(1 + ln f / ln original) for f > 1) filled as
    transformers computes them."""
    orig = sc["original_max_position_embeddings"]
    for key in ("short_factor", "long_factor"):
        v = sc.get(key)
        if not (isinstance(v, list) and len(v) == rotary // 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)):
            raise ValueError(f"config.json: longrope {key} must be a list of {rotary // 2} positive numbers (half the "
                             f"{rotary} rotated dims of each head), got {v if not isinstance(v, list) else len(v)} "
                             "(a broken or hand-edited config.json?)")
    factor = sc.get("factor") or max_pos / orig
    attn = sc.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {**sc, "factor": float(factor), "attention_factor": float(attn)}


def phi3_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a phi3 config.json (module docstring), as Phi3Config.convert_rope_params_to_dict reads it:
    rope_scaling in place of rope_parameters, theta and partial_rotary_factor from the top level where the dict has
    none, the old types "su" and "yarn" meaning longrope, the original length the top-level key's (4096 without)."""
    for key in PHI3_DROPOUTS:
        if cfg.get(key):
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported (training here runs without dropout; "
                             f"transformers would apply it in train mode): set it to 0.0 in config.json")
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    part = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = rope.pop("type", None)
    kind = rope.setdefault("rope_type", kind or "default")
    if kind in ("su", "yarn"):   # (Phi-3's first configs' names for LongRoPE)
        kind = rope["rope_type"] = "longrope"
    if kind not in ("default", "longrope"):
        raise ValueError(f"config.json: phi3 rope type {kind!r} is not supported (Phi3Config takes default or "
                         "longrope)")
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if kind == "longrope":
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings", 4096)
    theta, scaling = read_rope({"rope_parameters": rope}, max_pos)
    if kind == "longrope":
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        scaling = read_longrope(scaling, int(hd * part), max_pos)
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=part, fused=True,
                sliding_window=cfg.get("sliding_window"), layer_types=None)


NORM_FED = (("self_attn.qkv_proj",), ("mlp.gate_up_proj",))   # the Linears a block's two norms feed (norm rebuild)


def mlp_inputs(a, f: int) -> tuple:
    """An MLP's (gate_proj, up_proj, gate_up_proj) [F, D], [F, D], [2F, D]: the first two, or (Phi-3) the third."""
    if a.fused:
        return None, None, nn.Linear(a.dim, 2 * f, bias=a.mlp_bias)
    return nn.Linear(a.dim, f, bias=a.mlp_bias), nn.Linear(a.dim, f, bias=a.mlp_bias), None


def pad_restart(margs) -> int | None:
    """LongRoPE's original length, where a document's factors change: a row's padding that would carry its last
    document past it restarts its positions instead (data.collate's `restart`); None for every other RoPE."""
    rope = margs.rope_scaling
    return rope.get("original_max_position_embeddings") if rope.get("rope_type") == "longrope" else None


class Split(tuple):
    """qkv_proj's output cut into (q, k, v) [B, S, n·Hd] views, computed once for the three (`project`)."""


def split(attn, x) -> Split:
    y = attn.qkv_proj(x)                                                   # [B, S, (H + 2K)·Hd]
    q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    return Split(y.split([q, kv, kv], dim=-1))                             # [B, S, H·Hd], [B, S, K·Hd] x 2


def project(attn, x, i: int) -> torch.Tensor:
    """Projection i (0 q, 1 k, 2 v) of x (module docstring): a tile of parallel/tiled_attention.py, which asks for q
    and for k, v apart, runs qkv_proj for each (the rows it does not need cost a third more of that matmul)."""
    if attn.qkv_proj is None:
        return (attn.q_proj, attn.k_proj, attn.v_proj)[i](x)
    y = (x if isinstance(x, Split) else split(attn, x))[i]
    # v, which the kernel saves, as its own tensor: a view would keep the whole [T, (H + 2K)·Hd] output alive to
    # backward (q and k are rotated into new tensors: their rows die with it)
    return y.contiguous() if i == 2 else y


def gate_up(mlp, x) -> tuple[torch.Tensor, torch.Tensor]:
    if mlp.gate_up_proj is None:
        return mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.gate_up_proj(x).chunk(2, dim=-1)                            # [B, S, F] each
