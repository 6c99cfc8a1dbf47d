"""Gemma 4's MoE block (`enable_moe_block` in a gemma4_text config.json: google/gemma-4-26B-A4B), beside the dense MLP
of every block (model/gemma.py's SandwichBlock runs it); the rest of the model is Gemma 4's dense decoder.

Contract:
- `moe_fields(cfg)`: `ModelArgs.moe` as Gemma4TextConfig reads it (num_experts, top_k_experts, moe_intermediate_size:
  positive whole numbers, required: transformers has no default), `beside` set: every block keeps its dense MLP.
- The block (transformers' Gemma4TextDecoderLayer): with r the residual after attention,
  y = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(r))) + post_feedforward_layernorm_2(
  experts(pre_feedforward_layernorm_2(r), router(r))), then r + post_feedforward_layernorm(y), × layer_scalar.
- `Router` (`router.proj` [E, D] in the compute dtype, never quantized nor adapted; `router.scale` [D] and
  `router.per_expert_scale` [E], frozen as stored): on r itself, not a normed r: a weightless RMSNorm, × scale ×
  D^-0.5, proj, softmax in float32, top k, renormalised to sum 1, × per_expert_scale of each chosen expert: the
  weights stay float32 (model.moe.dispatch rounds each weighted output to the compute dtype, as transformers).
- `Experts`: a GeGLU (gelu tanh) MLP of moe_intermediate_size per expert, nn.Linear modules `experts.{e}.gate`, `.up`,
  `.down` (so NF4, FSDP2 and model.moe.dispatch treat them as Qwen3-MoE's experts). Not named gate_proj / up_proj /
  down_proj: peft on transformers' Gemma4 model adapts those names in the dense MLP only (its experts are fused
  parameters, no modules), and peft matches target names by suffix here too, so an MLP target adapts the dense MLP,
  as there, and the adapter loads in peft as trained.
- The checkpoint stores each block's experts fused: `experts.gate_up_proj` [E, 2·I, D] (expert e's gate rows, then
  its up rows) and `experts.down_proj` [E, D, I]. Each expert's weight is one contiguous byte range of them:
  `expert_views(meta)` maps our per-expert names to (stored name, first element, shape), which model.load's
  CheckpointReader reads in their place (each rank only its shard's range); the merge writes them fused back
  (model/merged.py); `stored_shapes(args, layer)`: the MoE tensors a block's checkpoint holds, for the start-up checks.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from model.moe import MoESpec, dispatch

FUSED = re.compile(r"^(model\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$")


def moe_fields(cfg: dict) -> dict:
    """{"moe": MoESpec} of a gemma4_text config.json with enable_moe_block (module docstring)."""
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    for key in keys:
        if isinstance(v := cfg.get(key), bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.json: enable_moe_block true needs {key} (a positive whole number), got {v!r}")
    e, k, width = (cfg[key] for key in keys)
    if k > e:
        raise ValueError(f"config.json: top_k_experts {k} is more than num_experts {e}")
    return {"moe": MoESpec(e, k, width, norm_topk=True, beside=True)}


class Router(nn.Module):
    """transformers' Gemma4TextRouter (module docstring): (weights [T, k] float32, experts [T, k]) of r [T, D]."""

    def __init__(self, dim: int, spec: MoESpec, norm: nn.Module):
        super().__init__()
        self.top_k, self.root = spec.top_k, dim ** -0.5
        self.norm = norm   # weightless (model.gemma.UnitRMSNorm)
        self.proj = nn.Linear(dim, spec.experts, bias=False)
        self.scale = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(spec.experts), requires_grad=False)

    def forward(self, r):
        logits = self.proj(self.norm(r) * self.scale * self.root)                               # [T, E]
        top, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), self.top_k, dim=-1)   # [T, k]
        return top / top.sum(-1, keepdim=True) * self.per_expert_scale[idx], idx


class Expert(nn.Module):
    """gelu_tanh(gate(x)) · up(x) -> down: one expert of the fused tensors (module docstring: its names)."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.gate = nn.Linear(dim, width, bias=False)
        self.up = nn.Linear(dim, width, bias=False)
        self.down = nn.Linear(width, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class Experts(nn.ModuleList):
    """The block's E experts (`experts.{e}`): their weighted sum per token, model.moe.dispatch."""

    def __init__(self, dim: int, spec: MoESpec):
        super().__init__(Expert(dim, spec.width) for _ in range(spec.experts))

    def forward(self, x, w, idx):
        return dispatch(self, x, w, idx)


def expert_views(meta: dict) -> dict:
    """{our per-expert weight name: (stored fused name, first element, shape)} of every fused experts tensor in `meta`
    ({name: (dtype, shape, ...)}, a checkpoint's headers): expert e's gate, up, down (module docstring)."""
    out = {}
    for name, (_, shape, *_) in meta.items():
        if not (m := FUSED.match(name)) or len(shape) != 3:
            continue
        n, rows, cols = shape
        for e in range(n):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down.weight"] = (name, e * rows * cols, (rows, cols))
            else:   # gate rows first, then up: transformers' .chunk(2, dim=-1) of gate_up_proj[e]'s output
                for half, part in enumerate(("gate", "up")):
                    out[f"{m.group(1)}.{e}.{part}.weight"] = (name, (e * rows + half * rows // 2) * cols,
                                                              (rows // 2, cols))
    return out


def stored_shapes(a, layer: int) -> dict:
    """{stored name: shape} of block `layer`'s MoE tensors, as config.json implies them."""
    p, m = f"model.layers.{layer}", a.moe
    return {f"{p}.router.proj.weight": (m.experts, a.dim), f"{p}.router.scale": (a.dim,),
            f"{p}.router.per_expert_scale": (m.experts,), f"{p}.experts.gate_up_proj": (m.experts, 2 * m.width, a.dim),
            f"{p}.experts.down_proj": (m.experts, a.dim, m.width)}
