"""LoRA (peft) on the decoder, over its NF4 base layers (model/nf4.py) or plain ones.

Contract:
- `apply_lora(model, ...)` wraps the model with `peft.get_peft_model`; only LoRA parameters are
  trainable and they are float32. `init_lora(model, seed)` sets every LoRA tensor from a generator
  seeded by (seed, parameter name), computed in full on every rank and sliced to the local shard,
  so the adapter init is identical for 1 process and for any mesh.
- `fuse_lora(model)` runs each LoRA layer's forward as base(x) + scaling · B(A(x)) with the scaled add fused
  into B's GEMM where peft would run its plain path (peft's forward elsewhere); `adapters_off(model)` and
  `reference_adapter(model, tensors)` switch every layer to the base alone or to a fixed adapter's tensors
  (DPO's reference model, no second copy of any weight).
"""

from __future__ import annotations

import hashlib
import math
import types
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model import dora as dora_math
from model.bnb import bnb
from model.expert_lora import EXPERTS, PEFT_PARAMS, ParamLoRA, peft_wrap, refusal, take_reference
from model.llama import Transformer
from model.lora_spec import LORA_TARGETS, model_targets
from model.moe import expert_targets
from model.norms import train_embeddings, train_norms

if TYPE_CHECKING:
    from peft import LoraConfig


def lora_config(r: int, alpha: float, dropout: float, targets=LORA_TARGETS, rslora: bool = False,
                dora: bool = False, layers=None) -> LoraConfig:
    """The peft config of a run's LoRA (also what `parallel.checkpoint_export.export` writes for a checkpoint);
    `rslora`: scale alpha / sqrt(r), not alpha / r (peft computes it; the fused forward reads peft's `scaling`);
    `dora`: DoRA (peft's use_dora; model/dora.py computes it); `layers`: the blocks adapted (peft's
    layers_to_transform; None: all); EXPERTS among `targets`: the experts' fused parameters as peft's
    target_parameters (model/expert_lora.py)."""
    from peft import LoraConfig  # here, after model.bnb imported bitsandbytes (peft imports it): see model/bnb.py

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=[t for t in targets if t != EXPERTS],
                      bias="none", init_lora_weights=False, use_rslora=rslora, use_dora=dora,
                      layers_to_transform=None if layers is None else list(layers),
                      target_parameters=list(PEFT_PARAMS) if EXPERTS in targets else None)


def apply_lora(model: Transformer, r: int, alpha: float, dropout: float, targets=LORA_TARGETS, rslora: bool = False,
               dora: bool = False, layers=None, norms: bool = False, embeddings: bool = False):
    from peft import get_peft_model  # (as lora_config's)

    targets = model_targets(targets, model.args)   # (no linear-layer names on a model without them)
    if why := expert_targets(model.args, targets):   # (also at start-up: parallel/flags.py)
        raise ValueError(why)
    if EXPERTS in targets and (why := refusal(model.args, targets, dropout, dora, layers)):   # (model/expert_lora.py)
        raise ValueError(why)
    with dora_math.unset_magnitudes():   # (init_lora sets them, from the loaded weights)
        peft_model = peft_wrap(model, lora_config(r, alpha, dropout, targets, rslora, dora, layers), get_peft_model)
    for n, p in peft_model.named_parameters():   # only LoRA trains, in float32
        if "lora_" in n:
            p.data = p.data.float()
        p.requires_grad_("lora_" in n)
    if norms:   # --train-norms (model/norms.py)
        train_norms(model, layers)
    if embeddings:   # --train-embeddings
        train_embeddings(model)
    return peft_model


class _BaseAndA(torch.autograd.Function):
    """(base(x), x @ A^T) for a frozen base: backward builds x's gradient in ONE buffer, dy @ W with d_a @ A added
    in place row chunk by row chunk. Autograd would hold the base's and A's [T, in] gradients at once before
    summing them: at 512k tokens o_proj's pair is 7.5 GB, the largest transient of a long row's block backward.
    Saves what A's nn.Linear saved (x, A); the base's forward runs as usual under no_grad (bitsandbytes saves
    nothing then)."""

    @staticmethod
    def forward(ctx, x, a_weight, base):
        ctx.base = base
        ctx.save_for_backward(x, a_weight)
        y = base(x)
        # the base's output as a tensor, not a view made in here (bitsandbytes views its GEMM's [T, out]), so the
        # caller may add LoRA B's share and the residual into it in place (autograd refuses that on such views)
        root = y if y._base is None else y._base
        return (root if root.numel() == y.numel() and root.is_contiguous() else y), nn.functional.linear(x, a_weight)

    @staticmethod
    def backward(ctx, dy, da):
        x, a_weight = ctx.saved_tensors
        da2 = da.reshape(-1, da.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:   # bitsandbytes' MatMul4Bit.backward: dy @ dequantize(W), in dy's dtype
            w = ctx.base.dequantized() if hasattr(ctx.base, "dequantized") else ctx.base.weight
            dx = torch.matmul(dy.reshape(-1, dy.shape[-1]), w.to(dy.dtype)).view(x.shape)
            flat, aw = dx.view(-1, dx.shape[-1]), a_weight.to(dx.dtype)
            n = max(1, ROW_CHUNK // flat.shape[1])   # A's share in row chunks: a 32-64 MB temporary, not [T, in];
            for i in range(0, flat.shape[0], n):   # added as autograd sums (base's first), the same rounding
                flat[i:i + n] += da2[i:i + n].mm(aw)
        if ctx.needs_input_grad[1]:
            dw = da2.t().mm(x.reshape(-1, x.shape[-1]))
        return dx, dw, None


SOLE_INPUT = ("o_proj", "down_proj")   # the decoder's projections whose input no other layer reads
ROW_CHUNK = 2**24                      # elements of one chunk of LoRA A's share in _BaseAndA's backward


def _one_input_grad(self, x, a_lin, dropout) -> bool:
    """_BaseAndA's case: a layer whose input is its own (SOLE_INPUT: q/k/v and gate/up share theirs, whose several
    gradients autograd sums anyway), A reads x itself (no dropout, no bias), the base is frozen, and
    parallel.recompute does not skip its GEMM in a block recompute (down_proj there: left as it was)."""
    return (getattr(self, "_sole_input", False) and isinstance(dropout, nn.Identity) and a_lin.bias is None
            and torch.is_grad_enabled() and not getattr(self.base_layer.forward, "in_recompute", False)
            and not any(p.requires_grad for p in self.base_layer.parameters()))


def _fused_forward(self, x, *args, **kwargs):
    """A LoRA layer's forward with the scaled add in lora_B's GEMM (fuse_lora); peft's own where that differs."""
    if getattr(self, "_as_reference", False):
        return _reference_forward(self, x)
    names, slow = self.active_adapters, self._peft_forward
    dora = len(names) == 1 and dora_math.is_dora(self, names[0]) and not self.disable_adapters
    if dora:   # never peft's own DoRA (it would dequantize our NF4 layers wrongly): the fused path, or peft's formula
        if args or kwargs:
            raise TypeError(f"a DoRA layer takes no forward arguments beside x (got {len(args)} more and "
                            f"{sorted(kwargs)})")
        a_lin, b_lin, dropout = self.lora_A[names[0]], self.lora_B[names[0]], self.lora_dropout[names[0]]
        if (torch.is_autocast_enabled(x.device.type) or torch.is_autocast_enabled() or b_lin.bias is not None
                or a_lin.weight.dtype != x.dtype or self.training and not isinstance(dropout, nn.Identity)):
            return dora_math.forward(self, names[0], x)   # (under autocast: autocast casting its ops)
    if (args or kwargs or self.disable_adapters or self.merged or len(names) != 1
            or names[0] not in self.lora_A or names[0] in getattr(self, "lora_variant", {}) and not dora
            or torch.is_autocast_enabled()   # (and with a LoRA bias, or LoRA in another dtype than x: peft casts x)
            or self.lora_B[names[0]].bias is not None or self.lora_A[names[0]].weight.dtype != x.dtype):
        return slow(x, *args, **kwargs)
    a_lin, b_lin, dropout = self.lora_A[names[0]], self.lora_B[names[0]], self.lora_dropout[names[0]]
    # Otherwise LoRA A before the base layer: backward then runs the base's (bitsandbytes') node first. Autograd
    # sums a second gradient in place only into the one that arrived first, and only if that one is not a view:
    # bitsandbytes' is fresh, A's (nn.Linear on [B, S, in]) a view, so in the other order the sum was a third
    # [T, in] tensor. (A plain nn.Linear base also returns a view: no gain with --quant none.)
    one = _one_input_grad(self, x, a_lin, dropout)
    if one:   # x's gradient in one buffer (_BaseAndA)
        result, a = _BaseAndA.apply(x, a_lin.weight, self.base_layer)
    else:
        a = a_lin(dropout(x))
        result = self.base_layer(x)
    if result.dtype != a.dtype:   # not met by our layers (x, base and LoRA share a dtype)
        raise TypeError(f"LoRA output {a.dtype} differs from the base layer's {result.dtype}")
    # result + scaling · (a @ B^T) in one GEMM (its epilogue reads result): one [T, out] write instead of
    # peft's clone, B's output, the scaled copy and the sum; backward has no [T, out] scaling either. Into
    # _BaseAndA's output itself (read by nothing else): no second [T, out], and the caller may sum into it too
    # In place, the reshapes are _unsafe_view (no autograd view: autograd would record an in-place op on a view as
    # CopySlices, whose backward allocates the base's gradient and clones the slice, 2 [T, out] per op beside dh;
    # nothing saved `result`, so its version counter has nothing to guard)
    one = one and result.is_contiguous()
    reshape = torch.ops.aten._unsafe_view if one else torch.reshape
    args = (a.reshape(-1, a.shape[-1]), b_lin.weight.t())
    flat = reshape(result, (-1, result.shape[-1]))
    out = (flat.addmm_ if one else flat.addmm)(*args, alpha=self.scaling[names[0]])
    out = reshape(out, (*x.shape[:-1], out.shape[-1]))
    if dora:   # m / ‖W + s·B A‖ ⊙ (W x + s·B A x) + bias, from this sum (saved for the magnitude's gradient)
        out = dora_math.rescale(self, names[0], out)
    out._sum_in_place = one   # Block adds the residual into it
    return out


class adapters_off:
    """While entered, every LoRA layer of `model` computes its base layer alone (peft's `disable_adapters`, set on the
    layers themselves: peft's own switch also flips the adapters' requires_grad, which FSDP2 has already recorded).
    DPO's reference model is the base this way, with no second copy of any weight."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if hasattr(m, "_disable_adapters") and hasattr(m, "lora_A")]

    def __enter__(self):
        self.prev = [m._disable_adapters for m in self.layers]
        for m in self.layers:
            m._disable_adapters = True

    def __exit__(self, *exc):
        for m, p in zip(self.layers, self.prev):
            m._disable_adapters = p


class reference_adapter:
    """While entered, every LoRA layer of `model` computes base(x) + scaling · B_ref(A_ref(x)) with a fixed adapter's
    tensors (`tensors`: our parameter names -> full tensors, `model.adapter_read.read_init_adapter`'s), and the base
    alone where it has none: DPO's reference model when the policy starts from that adapter (--init-adapter), with no
    second copy of the base. The tensors are not parameters: FSDP2, the optimizer and checkpoints never see them;
    each rank holds them whole (an adapter is small), in `dtype`: the dtype the layer's own LoRA computes in (FSDP2's
    param dtype; checked, and cast to, on first use), so at the start the reference and the policy compute the same
    numbers. No dropout (a frozen model, as a separate reference model in eval mode). Only for layers fuse_lora
    wrapped."""

    def __init__(self, model: nn.Module, tensors: dict, device=None, dtype=None):
        layers = {n: m for n, m in model.named_modules() if hasattr(m, "_peft_forward") and hasattr(m, "lora_A")}
        left = dict(tensors)
        for n, m in layers.items():
            name = m.active_adapters[0]
            ab = [left.pop(f"{n}.lora_{x}.{name}.weight", None) for x in "AB"]
            mag = left.pop(f"{n}.lora_magnitude_vector.{name}.weight", None)   # (a DoRA adapter's)
            if (ab[0] is None) != (ab[1] is None) or (mag is None) != (ab[0] is None or not dora_math.is_dora(m, name)):
                raise ValueError(f"the reference adapter has only some of {n}'s lora_A, lora_B" + (
                    " and lora_magnitude_vector" if dora_math.is_dora(m, name) else "") + (
                    " (a DoRA adapter: this run has no --dora)" if mag is not None and not dora_math.is_dora(m, name)
                    else ""))
            m._ref_weights = None if ab[0] is None else tuple(t.detach().to(device, dtype) for t in ab + [mag]
                                                              if t is not None)
        take_reference(model, left, device)   # (the experts': model/expert_lora.py)
        if left:
            raise ValueError(f"the reference adapter's tensor {next(iter(left))} names no LoRA layer of this model "
                             f"({len(left)} such)")
        self.layers = list(layers.values()) + [m for m in model.modules() if isinstance(m, ParamLoRA)]

    def __enter__(self):
        for m in self.layers:
            m._as_reference = True

    def __exit__(self, *exc):
        for m in self.layers:
            m._as_reference = False


def _reference_forward(self, x):
    """reference_adapter's layer: as the fused forward (or peft's, where the LoRA dtype is not x's) computes it."""
    result = self.base_layer(x)
    if self._ref_weights is None:
        return result
    name = self.active_adapters[0]
    want, s = self.lora_A[name].weight.dtype, self.scaling[name]
    if self._ref_weights[0].dtype != want:   # (once: FSDP2's param dtype is only known inside forward)
        self._ref_weights = tuple(t.to(want) for t in self._ref_weights)
    a, b, *mag = self._ref_weights
    if mag:   # DoRA: m / ‖W + s·B A‖ with the reference's m, A and B, as the policy's DoRA computes it
        scale = (mag[0] / dora_math.row_norms(dora_math.base_weight(self.base_layer), a, b, s, want)).to(want)
    if want != x.dtype:   # peft's path for such a layer (LoRA in its own dtype), rounded as it rounds: a 4-bit
        lora = nn.functional.linear(nn.functional.linear(x.to(want), a), b)   # layer casts LoRA's share back
        if mag:   # (model.dora.forward: the sum cast back, for either kind of layer)
            return dora_math.peft_sum(result, self.base_layer.bias, scale, lora, s)
        lora = lora * s   # before the sum, a plain one casts the sum
        four = isinstance(self.base_layer, bnb.nn.Linear4bit)
        return result + lora.to(result.dtype) if four else (result + lora).to(result.dtype)
    flat = nn.functional.linear(x, a).reshape(-1, a.shape[0])
    out = torch.addmm(result.reshape(-1, result.shape[-1]), flat, b.t(), alpha=s).view(*x.shape[:-1], -1)
    return dora_math.apply_scale(out, scale, self.base_layer.bias) if mag else out


def fuse_lora(model: nn.Module) -> int:
    """Every peft LoRA layer's forward as base(x) + scaling · lora_B(lora_A(dropout(x))) with the scaled add
    fused into B's GEMM (torch.addmm), where peft would run its own plain path: one adapter, no variant but DoRA
    (model/dora.py rescales the sum), no autocast, LoRA in x's dtype (CUDA bf16 under FSDP2, CPU float32);
    elsewhere peft's forward (DoRA's: model.dora.forward).
    The same sum, rounded once instead of at each step; where `_one_input_grad`, x's gradient is built in
    one buffer (`_BaseAndA`: o_proj's). Returns the number of layers wrapped."""
    from peft.tuners.lora import LoraLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")]
    for n, m in layers:   # bound methods: a deep copy of the model rebinds them to the copy
        m._peft_forward, m.forward = m.forward, types.MethodType(_fused_forward, m)
        m._sole_input = n.rsplit(".", 1)[-1] in SOLE_INPUT
    return len(layers)


def _generator(seed: int, name: str) -> torch.Generator:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**62 - 1)
    return torch.Generator().manual_seed(h)


def set_param(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard when it is a DTensor."""
    with torch.no_grad():
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()   # slices locally, no comms
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def init_lora(model: nn.Module, seed: int, b_std: float = 0.0) -> None:
    """LoRA A ~ U(±1/sqrt(fan_in)) (peft's default, kaiming-uniform a=√5), B = 0 (or N(0, b_std) in tests)."""
    for n, p in model.named_parameters():
        if "lora_A" in n:
            full = torch.rand(p.shape, generator=_generator(seed, n), dtype=torch.float64)
            full = (full * 2 - 1) / math.sqrt(p.shape[1])
        elif "lora_B" in n:
            full = torch.randn(p.shape, generator=_generator(seed, n), dtype=torch.float64) * b_std
        else:
            continue
        set_param(p, full.to(p.dtype))
    dora_math.init_magnitudes(model)   # DoRA's m = ‖W + s·B A‖ per row: from the weights, A and B just set
