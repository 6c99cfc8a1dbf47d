"""LoRA on the routed experts of Qwen3-MoE's and Qwen3.5-MoE's blocks (model/moe.py; not Qwen3.5-MoE's shared expert),
GLM-4.5's (model/glm4_moe.py; not its shared experts nor its dense blocks' MLPs) and GPT-OSS's (model/gpt_oss.py), in
peft's `target_parameters` format: what peft 0.21 makes of
`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])` on transformers 5's
Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM and Glm4MoeForCausalLM (their experts: fused 3-D parameters gate_up_proj
[E, 2I, D], down_proj [E, D, I], out x in) and GptOssForCausalLM (gate_up_proj [E, D, 2I], down_proj [E, I, D], in x
out: its experts' `is_transposed`, which peft reads), and the adapter format that loads there. `--lora-targets
experts` (EXPERTS) names it.

Contract:
- peft's ParamWrapper on a 3-D parameter of E experts, `in` inputs and `out` outputs holds lora_A [E·r, in] (expert
  e's A: rows e·r .. e·r + r) and lora_B [out, E·r] (viewed [out, r, E]: expert e's B is every E-th column from e),
  and adds scaling · B_e A_e to expert e's [out, in] weight (transposed for an in x out parameter; scaling = alpha /
  r, or alpha / sqrt(r) with rslora). `ParamLoRA` holds those two tensors in that layout, so export is a rename.
  gate_up_proj's A is shared by gate and up (one fused parameter); B_e's rows are its outputs': Qwen3-MoE's first I
  gate's, the rest up's (GLM-4.5's as Qwen3-MoE's); GPT-OSS's alternate, gate's at the even rows (as its fused
  columns). `ExpertLoRA` (an MoE block's `experts_lora`) holds gate_up_proj's and down_proj's and `run(e, expert, x)`
  computes expert e on its routed tokens x [n, D] as
      gate = W_g x + s · B_e[gate's rows] (A_e x),  up = W_u x + s · B_e[up's rows] (A_e x),  h = act(gate, up),
      out = W_d h + s · Bd_e (Ad_e h)
  (biases, GPT-OSS's, in W x; act the expert's own: silu(gate) · up, GPT-OSS's clamped SwiGLU; the same function as
  peft's W + s · B_e A_e; no dense delta weight, no [T, E, ...] tensor: model.moe.dispatch runs each expert on its own
  tokens). LoRA's tensors compute in x's dtype (peft's fold is in the parameter's).
- `attach(model, r, alpha, rslora)`: one ExpertLoRA on every MoE block of these models (on the meta device when
  the model is; model.qlora.apply_lora makes it float32 and trainable, as every "lora_" tensor), from `peft_wrap`,
  peft's wrapping of the rest; `model.qlora.init_lora` draws A and B per parameter name, as for every LoRA
  tensor (A ~ U(±1/sqrt(in)): peft's kaiming-uniform on its [E·r, in] Linear). `refusal(margs, args)`: why a run
  cannot adapt the experts (another MoE kind, options peft's ParamWrapper refuses, --lora-layers), else None.
- `peft_keys(tensors)`: our names ("model.layers.0.mlp.experts_lora.gate_up_proj.lora_A.weight") -> peft's keys
  (nested ParamWrappers: gate_up_proj, wrapped first, is the inner one, "...mlp.experts.base_layer.lora_A.weight";
  down_proj "...mlp.experts.lora_A.weight"); `PEFT_PARAMS`: adapter_config.json's target_parameters; `expert_dims`:
  the (out, in) of the fused parameter one of our tensors adapts (parallel/checkpoint_export.py's shape check);
  `per_expert(lora, params, margs)`: an adapter's fused LoRA as per-expert pairs of our projections (model/merged.py
  folds them into each expert's weights, = peft's merge_and_unload).
- A ParamLoRA's `_disable_adapters` (model.qlora.adapters_off: DPO's reference model) runs the expert without it;
  `_as_reference` (model.qlora.reference_adapter: DPO from an --init-adapter) with that adapter's tensors
  (`take_reference`), or without LoRA where it has none. `ours(sd, params)`: an adapter's expert tensors under our
  names (model.adapter_read.read_init_adapter: --init-adapter).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

EXPERTS = "experts"   # --lora-targets' name of the routed experts' fused parameters
PEFT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")   # peft's target_parameters for EXPERTS
EXPERT_KEY = ".experts_lora."   # in the name of each ExpertLoRA tensor of ours


class _Weight(nn.Module):
    """A `weight` alone: LoRA's tensors named "...lora_A.weight", as peft's (what checkpoints and init read)."""

    def __init__(self, rows: int, cols: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device))


class ParamLoRA(nn.Module):
    """peft ParamWrapper's LoRA of one fused [E, out, in] expert parameter (module docstring)."""

    def __init__(self, experts: int, inp: int, out: int, r: int, scaling: float, device=None):
        super().__init__()
        self.experts, self.r, self.scaling = experts, r, scaling
        self._disable_adapters = self._as_reference = False   # (model.qlora's adapters_off, reference_adapter)
        self._ref = None   # reference_adapter's (A, B) while `_as_reference`: `take_reference`
        self.lora_A = _Weight(experts * r, inp, device)    # [E·r, in]
        self.lora_B = _Weight(out, experts * r, device)   # [out, E·r], viewed [out, r, E]

    def off(self) -> bool:
        return self._disable_adapters or self._as_reference and self._ref is None

    def pair(self, e: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (A [r, in], B [out, r]) in `dtype` (a reference adapter's while one is entered)."""
        a, b = self._ref if self._as_reference else (self.lora_A.weight, self.lora_B.weight)
        return a[e * self.r:(e + 1) * self.r].to(dtype), b[:, e::self.experts].to(dtype)


class ExpertLoRA(nn.Module):
    def __init__(self, experts: int, dim: int, width: int, r: int, scaling: float, interleaved: bool, device=None):
        super().__init__()
        self.gate_up_proj = ParamLoRA(experts, dim, 2 * width, r, scaling, device)
        self.down_proj = ParamLoRA(experts, width, dim, r, scaling, device)
        # gate's and up's rows of gate_up_proj's B: GPT-OSS's fused columns alternate (gate even), Qwen3-MoE's halves
        self.rows = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, width), slice(width, None))

    def run(self, e: int, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Expert e (model.moe.Expert) with its LoRA on its tokens x [n, D] -> [n, D]."""
        gu, dn, (g_rows, u_rows) = self.gate_up_proj, self.down_proj, self.rows
        gate, up = expert.gate_proj(x), expert.up_proj(x)   # [n, I] each (with their biases: GPT-OSS's)
        if not gu.off():
            a, b = gu.pair(e, x.dtype)
            xa = F.linear(x, a)                                                  # [n, r], gate's and up's
            gate = torch.addmm(gate, xa, b[g_rows].t(), alpha=gu.scaling)
            up = torch.addmm(up, xa, b[u_rows].t(), alpha=gu.scaling)
        h = expert.act(gate, up)                                                 # [n, I]
        out = expert.down_proj(h)                                                # [n, D]
        if dn.off():
            return out
        a, b = dn.pair(e, h.dtype)
        return torch.addmm(out, F.linear(h, a), b.t(), alpha=dn.scaling)


def peft_wrap(model: nn.Module, cfg, wrap):
    """`wrap(model, cfg)` (peft's get_peft_model) with `cfg`'s target_parameters (PEFT_PARAMS: the experts') left to
    `attach`: our per-expert modules hold no fused parameter for peft to find; the config keeps them for export."""
    cfg.target_parameters, params = None, cfg.target_parameters
    peft_model = wrap(model, cfg)
    peft_model.peft_config["default"].target_parameters = params
    if params:
        attach(model, cfg.r, cfg.lora_alpha, cfg.use_rslora)
    return peft_model


def attach(model: nn.Module, r: int, alpha: float, rslora: bool = False) -> int:
    """An ExpertLoRA on each of `model`'s Qwen3-MoE, GLM-4.5 or GPT-OSS MoE blocks (module docstring); returns how
    many."""
    from model.glm4_moe import Glm4MoE
    from model.gpt_oss import GptOssMoE
    from model.moe import MoE

    scaling = alpha / (math.sqrt(r) if rslora else r)
    blocks = [b.mlp for b in model.model.layers if type(getattr(b, "mlp", None)) in (MoE, Glm4MoE, GptOssMoE)]
    for moe in blocks:
        gate = moe.experts[0].gate_proj   # (nn.Linear, or NF4's Linear4bit: its features as declared)
        moe.experts_lora = ExpertLoRA(len(moe.experts), gate.in_features, gate.out_features, r, scaling,
                                      isinstance(moe, GptOssMoE), gate.weight.device)
    return len(blocks)


def refusal(margs, targets, dropout: float = 0.0, dora: bool = False, layers=None) -> str | None:
    """Why `targets` (EXPERTS among them) cannot run on the model of ModelArgs `margs` with these options, else None."""
    moe = margs.moe
    if moe is None or not any(moe.sparse(i) for i in range(margs.n_layers)):
        return (f"--lora-targets {EXPERTS}: this {margs.model_type} model has no MoE experts; drop {EXPERTS} from "
                "--lora-targets")
    if moe.beside:   # (Gemma 4 MoE's: its blocks take no ExpertLoRA yet)
        return (f"--lora-targets {EXPERTS}: LoRA on the experts is supported on Qwen3-MoE, Qwen3.5-MoE, GLM-4.5 / 4.6 "
                f"and GPT-OSS, not yet on this {margs.model_type} model: drop {EXPERTS} from --lora-targets (attn "
                "adapts the attention)")
    if not [t for t in targets if t != EXPERTS]:   # (peft wraps our modules and finds no fused parameter to wrap)
        return (f"--lora-targets {EXPERTS}: LoRA on the experts alone is not supported here: name a projection "
                f"beside it, e.g. --lora-targets attn,{EXPERTS}")
    if dropout:   # (peft's ParamWrapper: B A cannot be factored out of B A dropout(x) over the fused weight)
        return (f"--lora-dropout {dropout:g} with --lora-targets {EXPERTS}: peft's LoRA on the experts' fused "
                "parameters has no dropout, so the adapter would not load as trained: pass --lora-dropout 0")
    if dora:
        return (f"--dora with --lora-targets {EXPERTS}: peft's LoRA on the experts' fused parameters has no DoRA: "
                f"drop --dora, or drop {EXPERTS} from --lora-targets")
    if layers is not None:   # (peft matches target_parameters by name in every block: layers_to_transform is unread)
        return (f"--lora-layers with --lora-targets {EXPERTS}: peft adapts the experts of every MoE block by name, so "
                "an adapter of some blocks' would not load as trained: drop --lora-layers, or drop "
                f"{EXPERTS} from --lora-targets")
    return None


def expert_dims(margs, name: str) -> tuple[int, int] | None:
    """(out, in) of the fused parameter whose LoRA tensor `name` (ours) is, for the model of ModelArgs `margs`; None
    for a name of no ExpertLoRA (its A is [E·r, in], its B [out, E·r])."""
    if EXPERT_KEY not in name or margs.moe is None:
        return None
    width, dim = margs.moe.width, margs.dim
    return (2 * width, dim) if ".gate_up_proj." in name else (dim, width)


def per_expert(lora: dict, params, margs) -> dict:
    """An adapter's tensors (peft's keys, `params` its target_parameters) with each fused parameter's LoRA split into
    the per-expert pairs of the projections it fuses ("...mlp.experts.{e}.gate_proj.lora_A.weight": A_e, and B_e's
    rows of that projection), whose B @ A is peft's delta of that expert's part (the merge folds them as any pair's);
    the rest as given. peft nests the wrappers in parameter order: with both, gate_up_proj's is `base_layer`'s."""
    names = sorted(p.rsplit(".", 1)[-1] for p in params or ())   # (down_proj before gate_up_proj)
    out, E = {}, margs.moe.experts if margs.moe is not None else 0
    for k, v in lora.items():
        head, sep, tail = k.partition(".mlp.experts.")
        which = tail.removeprefix("base_layer.")   # lora_A.weight | lora_B.weight
        if not sep or which not in ("lora_A.weight", "lora_B.weight"):
            out[k] = v
            continue
        param = names[-1] if tail.startswith("base_layer.") or len(names) == 1 else names[0]
        width = margs.moe.width
        rows = {"down_proj": ((slice(None), "down_proj"),)}.get(param) or (
            ((slice(0, None, 2), "gate_proj"), (slice(1, None, 2), "up_proj")) if margs.moe.clamp else
            ((slice(0, width), "gate_proj"), (slice(width, None), "up_proj")))
        r = v.shape[0] // E if which == "lora_A.weight" else v.shape[1] // E
        for e in range(E):
            for pick, proj in rows:
                part = v[e * r:(e + 1) * r] if which == "lora_A.weight" else v[:, e::E][pick]
                out[f"{head}.mlp.experts.{e}.{proj}.{which}"] = part.contiguous()
    return out


def ours(sd: dict, params) -> dict:
    """An adapter's tensors (peft's keys, less "base_model.model."; `params` its target_parameters) with the experts'
    under our names (`peft_keys`' inverse: with both parameters gate_up_proj's is `base_layer`'s); the rest as given."""
    names = sorted(p.rsplit(".", 1)[-1] for p in params or ())   # (down_proj before gate_up_proj)
    out = {}
    for k, v in sd.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if sep and tail.removeprefix("base_layer.") in ("lora_A.weight", "lora_B.weight"):
            param = names[-1] if tail.startswith("base_layer.") or len(names) == 1 else names[0]
            k = f"{head}.mlp{EXPERT_KEY}{param}.{tail.removeprefix('base_layer.')}"
        out[k] = v
    return out


def take_reference(model: nn.Module, left: dict, device=None) -> None:
    """model.qlora.reference_adapter's part for the experts: each ParamLoRA's (A, B) popped from `left` (our names,
    `ours`) onto `device`, or None (the expert alone) where the adapter has none."""
    for n, m in model.named_modules():
        if isinstance(m, ParamLoRA):
            ab = [left.pop(f"{n}.lora_{x}.weight", None) for x in "AB"]
            if (ab[0] is None) != (ab[1] is None):
                raise ValueError(f"the reference adapter has only one of {n}'s lora_A and lora_B")
            m._ref = None if ab[0] is None else tuple(t.detach().to(device) for t in ab)


def peft_keys(tensors: dict) -> dict:
    """Our ExpertLoRA tensors (names under the model, as a checkpoint holds them) under peft's adapter keys (module
    docstring); other names are left out."""
    out = {}
    for k, v in tensors.items():
        if EXPERT_KEY not in k:
            continue
        block, _, rest = k.partition(EXPERT_KEY)
        param, _, which = rest.partition(".")   # gate_up_proj | down_proj, lora_A.weight | lora_B.weight
        out[f"base_model.model.{block}.experts.{'base_layer.' if param == 'gate_up_proj' else ''}{which}"] = v
    return out
