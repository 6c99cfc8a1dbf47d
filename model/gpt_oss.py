"""GPT-OSS (`model_type: gpt_oss`, transformers' GptOssForCausalLM: openai/gpt-oss-20b, gpt-oss-120b; the BF16 form,
transformers' own save_pretrained of the dequantized model, e.g. unsloth/gpt-oss-20b-BF16).

Contract:
- `gpt_oss_fields(cfg, max_pos)`: the ModelArgs fields of a gpt_oss config.json as GptOssConfig (transformers 5)
  reads it: q, k, v and o biases (attention_bias, default true: model/arch_fields.py's SUPPORTED), attention sinks
  (`self_attn.sinks` [H]: model/attention.py, parallel/kernels.py's with_sinks), the norm's weight applied before the
  cast (`norm_offset` 0, OLMo's), layer_types (default: sliding, full, sliding, ...) with sliding_window (default
  128), YaRN by default (factor 32 from 4096, beta 32 / 1, truncate false; rope_theta 150000), and `moe`: every block's
  MLP is this module's `GptOssMoE`, num_local_experts (as num_experts too) experts of intermediate_size, top
  num_experts_per_tok, the SwiGLU's `clamp` (swiglu_limit 7.0, swiglu_alpha 1.702: transformers 5.17 fixes both at
  these values). output_router_logits true is refused (model/moe.py: it trains the frozen router).
- `GptOssMoE` (transformers' GptOssMLP): the router `mlp.router` (a Linear [E, D] with bias, in the compute dtype,
  never quantized nor adapted), top k of its logits, softmax over those k in the compute dtype; experts
  `mlp.experts.{e}.{gate_proj,up_proj,down_proj}` (nn.Linear with biases: NF4, FSDP2 and model.moe.dispatch treat them
  as Qwen3-MoE's) computing (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = clamp(gate, max=limit), then
  down_proj. LoRA: the attention's projections (model.moe.expert_targets refuses MLP targets, as for Qwen3-MoE: peft on
  transformers' model adapts no expert module), and with `experts` the experts' fused parameters in peft's
  target_parameters format (model/expert_lora.py; gate_up_proj's LoRA rows interleaved as its columns).
- The checkpoint stores each block's experts fused: `mlp.experts.gate_up_proj` [E, D, 2I] (in x out; gate and up
  INTERLEAVED in the last dim: gate at even columns), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, D] (in x out)
  and `down_proj_bias` [E, D]. Expert e's part of each is one contiguous slab; `expert_views(meta)` maps our
  per-expert names to (stored name, first element, our shape, slab elements, `take`, `put`): model.load's
  CheckpointReader reads the slab (each rank only its experts') and `take` de-interleaves and transposes it to our
  weight; the merge writes our weights fused back through `put` (model/merged.py).
- The MXFP4 release (openai/gpt-oss-20b, 120b as shipped: quantization_config quant_method mxfp4) stores each fused
  weight W [E, in, out] as `W_blocks` uint8 [E, out, in/32, 16] (e2m1 codes, two a byte, the low nibble first, 32 of
  one row a block) and `W_scales` uint8 [E, out, in/32] (e8m0: 2^(s - 127) a block), the biases and every other
  tensor bf16 (transformers' integrations/mxfp4.py: convert_moe_packed_tensors, then the transpose to [E, in, out]).
  `mxfp4_tensors(meta)` names them as W, of the BF16 form's shape and dtype (a bad dtype or shape, or a blocks
  tensor without its scales, is refused naming it); `read_mxfp4(reader, W, first, count)` reads the experts
  holding W's elements [first, first + count) and dequantizes them (exact in bf16), so the loader reads (and NF4
  quantizes) an MXFP4 checkpoint as its BF16 form, each rank its own experts' bytes, and the merge writes that form.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from model.moe import MoESpec, dispatch, moe_fields
from model.rope_read import read_rope

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
MXFP4 = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)   # e2m1's 16 codes
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}   # GptOssConfig's default RoPE (rope_theta 150000)


def gpt_oss_fields(cfg: dict, max_pos: int) -> dict:
    """ModelArgs fields of a gpt_oss config.json (module docstring)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 150000.0))
    theta, scaling = read_rope({**cfg, "rope_parameters": {**(rope or YARN), "rope_theta": theta}}, max_pos)
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    for key, v in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"config.json: {key} {v!r} must be a positive number")
    spec = moe_fields({**cfg, "num_experts": cfg.get("num_local_experts", cfg.get("num_experts", 128)),
                       "num_experts_per_tok": cfg.get("num_experts_per_tok", 4),
                       "moe_intermediate_size": cfg.get("intermediate_size", 2880), "norm_topk_prob": False})["moe"]
    window = cfg.get("sliding_window", 128)
    return dict(rope_theta=theta, rope_scaling=scaling, sinks=True, norm_offset=0.0, layer_types=types,
                sliding_window=window, moe=MoESpec(spec.experts, spec.top_k, spec.width, False,
                                                   clamp=(float(limit), float(alpha))))


class Expert(nn.Module):
    """One expert with biases and the clamped SwiGLU (module docstring)."""

    def __init__(self, dim: int, width: int, clamp: tuple):
        super().__init__()
        self.limit, self.alpha = clamp
        self.gate_proj = nn.Linear(dim, width)
        self.up_proj = nn.Linear(dim, width)
        self.down_proj = nn.Linear(width, dim)

    def act(self, gate, up):   # (model/expert_lora.py adds LoRA to gate's and up's outputs, then calls this)
        g, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (g * torch.sigmoid(g * self.alpha))

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class GptOssMoE(nn.Module):
    def __init__(self, dim: int, spec: MoESpec):
        super().__init__()
        self.top_k = spec.top_k
        self.router = nn.Linear(dim, spec.experts)
        self.experts = nn.ModuleList(Expert(dim, spec.width, spec.clamp) for _ in range(spec.experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                   # [T, D]
        top, idx = torch.topk(self.router(flat), self.top_k, dim=-1)        # [T, k] logits, compute dtype
        return dispatch(self.experts, flat, torch.softmax(top, -1), idx, getattr(self, "experts_lora", None)).view(
            x.shape)


# expert e's slab of a fused tensor -> our part: gate at the even columns of gate_up_proj, up at the odd ones (its
# bias likewise), down_proj whole; a weight's slab is in x out, transposed to nn.Linear's out x in
_PICK = {"gate_proj": lambda s: s[..., 0::2], "up_proj": lambda s: s[..., 1::2], "down_proj": lambda s: s}


def _take(part):
    def take(slab):
        w = _PICK[part](slab)
        return w.mT if w.dim() == 2 else w
    return take


def _put(part):
    def put(slab, w):   # the inverse: our weight (or bias) written into its slab of the fused tensor, in place
        _PICK[part](slab).copy_(w.mT if w.dim() == 2 else w)
    return put


def expert_views(meta: dict) -> dict:
    """{our per-expert name: (stored name, first element, our shape, slab shape, take, put)} of every fused GPT-OSS
    experts tensor in `meta` ({name: (dtype, shape, ...)}, a checkpoint's headers): module docstring."""
    out = {}
    for name, (_, shape, *_) in meta.items():
        if not (m := FUSED.match(name)):
            continue
        slab = tuple(shape[1:])
        for part in ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",):
            ours = tuple(_take(part)(torch.empty(slab, device="meta")).shape)
            for e in range(shape[0]):
                out[f"{m.group(1)}.{e}.{part}.{'bias' if m.group(3) else 'weight'}"] = (
                    name, e * torch.Size(slab).numel(), ours, slab, _take(part), _put(part))
    return out


def stored_shapes(a, layer: int) -> dict:
    """{stored name: shape} of block `layer`'s MoE tensors, as config.json implies them."""
    p, m = f"model.layers.{layer}.mlp", a.moe
    return {f"{p}.router.weight": (m.experts, a.dim), f"{p}.router.bias": (m.experts,),
            f"{p}.experts.gate_up_proj": (m.experts, a.dim, 2 * m.width),
            f"{p}.experts.gate_up_proj_bias": (m.experts, 2 * m.width),
            f"{p}.experts.down_proj": (m.experts, m.width, a.dim), f"{p}.experts.down_proj_bias": (m.experts, a.dim)}


def mxfp4_tensors(meta: dict) -> dict:
    """{W: (W_blocks, W_scales, W's BF16 shape [E, in, out])} of the MXFP4 experts in `meta` (module docstring)."""
    out = {}
    for name in meta:
        if not (m := MXFP4.match(name)):
            continue
        blocks, scales = (f"{m.group(1)}_{k}" for k in ("blocks", "scales"))
        bad = next((f"{n} {meta[n][0]} {list(meta[n][1])}" for n in (blocks, scales) if n in meta and (
            meta[n][0] != torch.uint8 or len(meta[n][1]) != (4 if n == blocks else 3))), None)
        if bad or blocks not in meta or scales not in meta or meta[blocks][1][-1] != 16 or \
                tuple(meta[blocks][1][:-1]) != tuple(meta[scales][1]):
            what = bad or (f"{blocks} {list(meta[blocks][1])}" if blocks in meta else f"{blocks} missing") + ", " + (
                f"{scales} {list(meta[scales][1])}" if scales in meta else f"{scales} missing")
            raise ValueError(f"MXFP4 experts: {what}; GPT-OSS's are {m.group(1)}_blocks uint8 [experts, out, in/32, "
                             "16] (two e2m1 codes a byte) beside _scales uint8 [experts, out, in/32] (one e8m0 scale a "
                             "block of 32): the checkpoint is corrupt or not GPT-OSS's MXFP4 form; re-download it")
        E, rows, groups, _ = meta[blocks][1]
        out[m.group(1)] = (blocks, scales, (E, groups * 32, rows))
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """[..., out, in/32, 16] e2m1 codes (low nibble first) and [..., out, in/32] e8m0 scales -> [..., in, out]."""
    lut = torch.tensor(FP4)
    w = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], -1).flatten(-2)   # [..., out, in/32, 32]
    return torch.ldexp(w, scales.int()[..., None] - 127).flatten(-2).mT.to(dtype)


def read_mxfp4(reader, name: str, first: int, count: int) -> torch.Tensor:
    """Elements [first, first + count) of W's BF16 form (flattened [E, in, out]): the experts holding them read
    (their blocks' and scales' byte ranges, contiguous) and dequantized."""
    blocks, scales, shape = reader.mxfp4[name]
    per = shape[1] * shape[2]   # (one expert's elements; its blocks hold per / 2 bytes, its scales per / 32)
    e0, e1 = first // per, -(-(first + count) // per)
    b = reader.get_bytes(blocks, e0 * per // 2, e1 * per // 2).view(e1 - e0, shape[2], shape[1] // 32, 16)
    s = reader.get_bytes(scales, e0 * per // 32, e1 * per // 32).view(e1 - e0, shape[2], shape[1] // 32)
    return dequantize(b, s).reshape(-1)[first - e0 * per:first - e0 * per + count]
