"""GLM-4.5 / GLM-4.6's MoE decoder (`model_type: glm4_moe`, transformers' Glm4MoeForCausalLM: GLM-4.5-Air, GLM-4.5,
GLM-4.6): Llama's block with q/k/v biases (attention_bias; o_proj none), optional per-head q/k RMSNorm (use_qk_norm),
partial rotate-half RoPE (the first int(head_dim · partial_rotary_factor) dims of each head, 0.5 without the key), the
first `first_k_dense_replace` blocks' MLPs dense (intermediate_size), every later one this module's `Glm4MoE`.

Contract:
- `glm4_moe_fields(cfg, max_pos)`: the ModelArgs fields of a glm4_moe config.json as transformers 5's Glm4MoeConfig
  reads it (its defaults for missing keys; partial_rotary_factor from the RoPE dict, then the top level, then 0.5);
  n_group must divide n_routed_experts into groups of at least 2 (transformers sums each group's best two), topk_group
  <= n_group, and num_experts_per_tok fit in topk_group groups, else ValueError naming the keys.
- `Router` (`mlp.gate.weight` [E, D] and `mlp.gate.e_score_correction_bias` [E], both frozen, never quantized nor
  adapted) holds both in float32 whatever the model's dtype, as transformers' `_keep_in_fp32_modules_strict` does
  (a cast to bf16 / fp16 stops at float32; float64 stays: references): a bias of order 1 rounded to bf16 would choose
  other experts than transformers and vLLM for many tokens. `KEEP_FLOAT32` marks the module for parallel/fsdp.py (left
  out of FSDP2: whole on every rank, never cast by its mixed precision). It is transformers' Glm4MoeTopkRouter
  (DeepSeek-V3's routing): s = sigmoid(x·Wᵀ) in float32; the correction bias is added for the choice only (indices:
  no graph): each group scored by the sum of its two best s + bias, the topk_group best groups kept, the top k of
  s + bias among their experts chosen; each chosen expert's weight is its s (bias-free), renormalised to sum 1
  (+1e-20) with norm_topk_prob, × routed_scaling_factor; the weights stay float32 (model.moe.dispatch rounds each
  weighted output to the compute dtype, as transformers).
- `Glm4MoE`: the router `gate`, the routed `experts` (model.moe.Expert SwiGLUs of moe_intermediate_size, stored per
  expert as the Hub's checkpoints and transformers 5's save_pretrained store them: `mlp.experts.{e}.gate_proj.weight`)
  and `shared_experts`, one SwiGLU of moe_intermediate_size × n_shared_experts on every token, added after the routed
  sum, no gate (transformers' Glm4MoeMoE). Per token only: a sequence shard or a tile routes each token as the whole.
- The checkpoint's multi-token-prediction layers (num_nextn_predict_layers, model.layers.{num_hidden_layers + i}.*),
  which transformers does not load, are never read: the loader reads the tensors the model names only.
- LoRA: the attention's projections, and with `--lora-targets attn,experts` the routed experts (`experts_lora`,
  model/expert_lora.py's ExpertLoRA, run by model.moe.dispatch). peft 0.21's `target_parameters=
  ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]` on transformers 5's Glm4MoeExperts (checked on a tiny
  Glm4MoeForCausalLM): gate_up_proj [E, 2I, D] (out x in, gate's rows first: forward's chunk(2)), down_proj [E, D, I],
  not transposed, as Qwen3-MoE's; the adapter's keys "...mlp.experts.base_layer.lora_A.weight" (gate_up_proj's) and
  "...mlp.experts.lora_A.weight" (down_proj's) in the MoE blocks only; neither the dense blocks' MLPs nor the shared
  experts adapted (nor here). MLP names are refused (model.moe's expert_targets): peft reads gate_proj / up_proj /
  down_proj as those target_parameters, while ours would take LoRA on every expert's Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.moe import Expert, MoESpec, dispatch, moe_fields
from model.rope_read import read_rope


def _whole(key: str, v, least: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"config.json: {key} {v!r} must be a whole number >= {least}")
    return v


def glm4_moe_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a glm4_moe config.json (module docstring)."""
    e = _whole("n_routed_experts", cfg.get("n_routed_experts", 128))
    first = _whole("first_k_dense_replace", cfg.get("first_k_dense_replace", 1), 0)
    spec = moe_fields({"num_experts": e, "num_experts_per_tok": cfg.get("num_experts_per_tok", 8),
                       "moe_intermediate_size": cfg.get("moe_intermediate_size", 1408),
                       "norm_topk_prob": cfg.get("norm_topk_prob", True), "mlp_only_layers": list(range(first)),
                       "output_router_logits": cfg.get("output_router_logits")})["moe"]
    groups, topk_group = _whole("n_group", cfg.get("n_group", 1)), _whole("topk_group", cfg.get("topk_group", 1))
    shared = _whole("n_shared_experts", cfg.get("n_shared_experts", 1), 0)
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"config.json: routed_scaling_factor {scale!r} must be a positive number")
    if e % groups or e // groups < 2 or topk_group > groups or spec.top_k > topk_group * (e // groups):
        raise ValueError(f"config.json: n_routed_experts {e}, n_group {groups}, topk_group {topk_group}, "
                         f"num_experts_per_tok {spec.top_k}: the experts must split into n_group groups of at least 2, "
                         "topk_group <= n_group, and the top k fit in topk_group groups (transformers' router)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    part = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    theta, scaling = read_rope({**cfg, key: rope or None}, max_pos)
    moe = MoESpec(e, spec.top_k, spec.width, spec.norm_topk, dense=spec.dense, shared=spec.width * shared,
                  groups=(groups, topk_group, float(scale)))
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=part, moe=moe, o_bias=False,
                qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
                sliding_window=None, layer_types=None)


ROUTER_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")   # (name suffixes: what `Router` holds)


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class Router(nn.Module):
    """transformers' Glm4MoeTopkRouter (module docstring): (weights [T, k] float32, experts [T, k]) of x [T, D]."""

    KEEP_FLOAT32 = True   # (module docstring: parallel/fsdp.py leaves its tensors out of FSDP2)

    def _apply(self, fn, recurse=True):
        # .to(bf16), .half(): the router stays float32 as transformers keeps it; moves and to_empty as any module's
        return super()._apply(lambda t: _at_least_float32(fn(t)), recurse)

    def __init__(self, dim: int, spec: MoESpec):
        super().__init__()
        self.top_k, self.norm_topk = spec.top_k, spec.norm_topk
        self.n_group, self.topk_group, self.scale = spec.groups
        self.weight = nn.Parameter(torch.empty(spec.experts, dim), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.experts), requires_grad=False)

    def forward(self, x):
        s = torch.sigmoid(F.linear(x.float(), self.weight.float()))                          # [T, E] float32
        with torch.no_grad():   # the choice gives indices only: no graph, nothing saved for it
            by_group = (s + self.e_score_correction_bias.float()).view(len(x), self.n_group, -1)   # [T, G, E / G]
            best = by_group.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]      # [T, topk_group]
            keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best, True)   # [T, G]
            choice = by_group.masked_fill(~keep[..., None], float("-inf")).view_as(s)
            idx = choice.topk(self.top_k, dim=-1)[1]                                        # [T, k]
        w = s.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, idx


class Glm4MoE(nn.Module):
    """The router, the routed experts and the shared experts of one MoE block (module docstring)."""

    def __init__(self, dim: int, spec: MoESpec):
        super().__init__()
        self.gate = Router(dim, spec)
        self.experts = nn.ModuleList(Expert(dim, spec.width) for _ in range(spec.experts))
        self.shared_experts = Expert(dim, spec.shared) if spec.shared else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                   # [T, D]
        out = dispatch(self.experts, flat, *self.gate(flat), getattr(self, "experts_lora", None))
        if self.shared_experts is not None:   # after the routed sum, as transformers adds it
            out = out + self.shared_experts(flat)
        return out.view(x.shape)
