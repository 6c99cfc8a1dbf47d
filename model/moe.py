"""Qwen3-MoE's sparse MLP (`model_type: qwen3_moe`, transformers' Qwen3MoeForCausalLM: Qwen3-30B-A3B, 235B-A22B,
Qwen3-Coder-30B-A3B), chosen per block by `ModelArgs.moe` (model/llama.py's Block); the rest of the model is Qwen3's.
Qwen3.5-MoE's (`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM; the rest of the model Qwen3.5's) adds a shared expert.

Contract:
- `moe_fields(cfg)`: `ModelArgs.moe` of a config.json as transformers 5's Qwen3MoeConfig reads it (num_experts, also
  stored as num_local_experts; num_experts_per_tok; moe_intermediate_size; norm_topk_prob; decoder_sparse_step;
  mlp_only_layers; qwen3_5_moe_text as Qwen3_5MoeTextConfig reads it: every block MoE, renormalised always, its
  shared_expert_intermediate_size as `shared`, none of Qwen3MoeConfig's other keys read). `MoESpec.sparse(layer)`:
  whether that block's MLP is the MoE block (not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0), else
  Qwen3's dense MLP of intermediate_size. The load-balancing loss
  (router_aux_loss_coef) trains the router, which stays frozen here: config.json's output_router_logits true (the loss
  transformers would add to the training loss) is refused naming the fix.
- `MoE`: the router `gate` (a Linear [E, D], no bias: `mlp.gate.weight`, in the compute dtype, never quantized nor
  adapted) and `experts`, a ModuleList of SwiGLU MLPs of moe_intermediate_size under the names the Hub checkpoints and
  transformers 5's save_pretrained store (`mlp.experts.{e}.gate_proj.weight`, ...). Per token: softmax of the router
  logits in float32, top k, renormalised to sum 1 with norm_topk_prob, cast back to the compute dtype; each expert runs
  on the tokens routed to it only (gathered by index, no [T, E, ...] tensor), its output times the token's weight,
  summed per token in expert order (index_put_ accumulating: index_add_'s sums, as transformers' eager experts, without
  keeping each expert's weighted output for backward). With `shared` (Qwen3.5-MoE): `shared_expert`, one more SwiGLU MLP
  of that width on every token, times sigmoid(`shared_expert_gate`, a Linear [1, D]), added to the experts' sum (as
  Qwen3_5MoeSparseMoeBlock; both quantized as transformers + bitsandbytes quantize every Linear). No state passes
  between tokens, so a sequence shard (context parallelism) or a tile of tokens (--tiled-mlp) routes each token as the
  whole sequence does.
- `expert_targets(args, targets)`: the refusal of MLP targets on a model with MoE blocks (None when there is none to
  refuse). Here the MLP names (gate_proj, up_proj, down_proj) match each expert's projections; peft 0.21 on transformers
  5's model turns them into target_parameters on the experts' fused 3-D parameters (`experts.gate_up_proj`,
  `experts.down_proj`: another adapter format) and adapts no dense block's MLP then, so neither an expert's LoRA nor a
  dense block's (mlp_only_layers) would load there as trained. The attention's projections are the targets, and
  `experts` (model/expert_lora.py: LoRA on the routed experts in that target_parameters format; the shared expert
  never).
  Qwen3.5-MoE: peft on transformers' model adapts the shared expert's projections alone under these names (its
  experts are fused parameters, no modules), while our per-expert modules would take LoRA on every expert: refused
  too, until LoRA here is kept to the shared expert. Gemma 4's (`beside`: model/gemma4_moe.py): none refused, the
  names are its dense MLP's there as in peft.
- `dispatch(experts, x, w, idx)`: the routed sum above, for any router's weights and experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    experts: int          # E: experts per MoE block
    top_k: int            # experts each token runs through
    width: int            # moe_intermediate_size: each expert's MLP width
    norm_topk: bool       # the top k weights renormalised to sum 1
    step: int = 1         # decoder_sparse_step: blocks (i + 1) % step == 0 are MoE ...
    dense: tuple = ()     # ... unless in mlp_only_layers (Qwen3's dense MLP there)
    shared: int = 0       # Qwen3.5-MoE's shared expert's width (shared_expert_intermediate_size); 0: none
    beside: bool = False  # Gemma 4's: the experts run beside the dense MLP in every block (model/gemma4_moe.py)
    clamp: tuple | None = None   # GPT-OSS's (swiglu_limit, swiglu_alpha): its experts and router (model/gpt_oss.py)
    groups: tuple | None = None  # GLM-4.5's (n_group, topk_group, routed_scaling_factor): its sigmoid router, `shared`
                                 # its shared experts' width, no gate (model/glm4_moe.py)

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense and (layer + 1) % self.step == 0


def moe_fields(cfg: dict) -> dict:
    """{"moe": MoESpec} of a qwen3_moe config.json (module docstring), Qwen3MoeConfig's defaults for missing keys."""
    if cfg.get("output_router_logits"):
        raise ValueError(f"config.json: output_router_logits true adds the router's load-balancing loss "
                         f"(router_aux_loss_coef {cfg.get('router_aux_loss_coef', 0.001)}) to the training loss; it "
                         "trains the router, which (Q)LoRA here keeps frozen: set output_router_logits to false")
    q35 = cfg.get("model_type") == "qwen3_5_moe_text"   # (Qwen3_5MoeTextConfig's defaults, keys: module docstring)
    e = cfg.get("num_experts", 256) if q35 else cfg.get("num_experts", cfg.get("num_local_experts", 128))
    k, width, step = cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 512 if q35 else 768), \
        1 if q35 else cfg.get("decoder_sparse_step", 1)
    shared = cfg.get("shared_expert_intermediate_size", 512) if q35 else 0
    for key, v in (("num_experts", e), ("num_experts_per_tok", k), ("moe_intermediate_size", width),
                   ("decoder_sparse_step", step), *((("shared_expert_intermediate_size", shared),) if q35 else ())):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.json: {key} {v!r} must be a positive whole number")
    if k > e:
        raise ValueError(f"config.json: num_experts_per_tok {k} is more than num_experts {e}")
    dense = () if q35 else tuple(cfg.get("mlp_only_layers") or ())
    return {"moe": MoESpec(e, k, width, q35 or bool(cfg.get("norm_topk_prob", False)), step, dense, shared)}


def expert_targets(args, targets) -> str | None:
    """Why `targets` (LoRA's projection names) cannot be adapted on this model (module docstring), else None."""
    mlp = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
    sparse = [i for i in range(args.n_layers) if args.moe is not None and args.moe.sparse(i)]
    if not mlp or not sparse or args.moe.beside:   # (Gemma 4: the names are its dense MLP's, as peft reads them)
        return None
    why = ("peft on transformers' model adapts only the shared expert's under these names (its experts are fused "
           "parameters), so an adapter of every expert's would not load there as trained" if args.moe.shared and not
           args.moe.groups else   # (GLM-4.5: peft reads them as Qwen3-MoE's, its shared experts and dense MLPs left)
           "peft on transformers 5 adapts them as fused 3-D parameters, another adapter format, and reads these "
           "names so on the dense blocks too")
    return (f"--lora-targets {','.join(targets)}: on this {args.model_type} model {','.join(mlp)} name the experts' "
            f"projections in its MoE blocks ({len(sparse)} of {args.n_layers}); LoRA on them under these names is not "
            f"supported ({why}): pass --lora-targets attn (q_proj,k_proj,v_proj,o_proj)"
            + ", or attn,experts for LoRA on the routed experts too (peft's target_parameters format)"
            + ", or leave the flag out: the default adapts the attention")


class Expert(nn.Module):
    """One expert: silu(gate_proj(x)) · up_proj(x) -> down_proj, no biases (transformers' expert math)."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)

    def act(self, gate, up):   # (model/expert_lora.py adds LoRA to gate's and up's outputs, then calls this)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    def __init__(self, dim: int, spec: MoESpec):
        super().__init__()
        self.top_k, self.norm_topk = spec.top_k, spec.norm_topk
        self.gate = nn.Linear(dim, spec.experts, bias=False)   # the router
        self.experts = nn.ModuleList(Expert(dim, spec.width) for _ in range(spec.experts))
        if spec.shared:   # (Qwen3.5-MoE: every token's, scaled per token by sigmoid(shared_expert_gate(x)))
            self.shared_expert = Expert(dim, spec.shared)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the compute dtype, experts [T, k]) of tokens flat [T, D]: transformers' router."""
        logits = self.gate(flat)                                            # [T, E], compute dtype
        top, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), self.top_k, dim=-1)   # [T, k]
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return top.to(logits.dtype), idx

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                   # [T, D]
        out = dispatch(self.experts, flat, *self.route(flat), getattr(self, "experts_lora", None))
        if hasattr(self, "shared_expert"):   # added after the experts' sum, as transformers adds it
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)


def dispatch(experts, flat: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, lora=None) -> torch.Tensor:
    """Σ over each token's k experts of weight · expert(token), [T, D] in flat's dtype: each expert on its tokens only
    (module docstring). The product is rounded to flat's dtype after the multiply (float32 weights, Gemma 4's: as
    transformers casts it). `lora`: the experts' LoRA (model.expert_lora.ExpertLoRA), expert e run by its `run`."""
    # the T·k (token, slot) pairs grouped by expert, token order within: one host sync for the counts
    order = idx.flatten().argsort(stable=True)
    counts = torch.bincount(idx.flatten(), minlength=len(experts)).tolist()
    tokens, w = order // idx.shape[-1], w.flatten()
    out = torch.zeros_like(flat)
    start = 0
    for e, (expert, n) in enumerate(zip(experts, counts)):
        if n:
            t = tokens[start:start + n]
            x = flat.index_select(0, t)                                     # [n, D]
            y = expert(x) if lora is None else lora.run(e, expert, x)         # [n, D]
            y = y * w.index_select(0, order[start:start + n])[:, None]
            # in expert order, as transformers sums; index_put_ keeps only t for backward (index_add_ keeps y
            out.index_put_((t,), y.to(out.dtype), accumulate=True)   # too: [T·k, D] beside the mul's down outputs)
        start += n
    return out
