"""DoRA (weight-decomposed LoRA, `--dora`) on our LoRA layers, computing what peft's `use_dora=True` computes.

Contract:
- A DoRA layer's output is m ⊙ (W x + s·B A x) / ‖W + s·B A‖ + bias, the norm taken over each output row of the
  base weight W as training computes with it (the NF4 layer's dequantized weight), `m` the trainable magnitude
  vector (peft's `lora_magnitude_vector`, one number per output feature) and the norm held constant in backward
  (DoRA's section 4.3, as peft does). With LoRA dropout active in training the base's share of the rescaling reads
  the dropped input, as peft's: W x + bias + (m/‖·‖ − 1) W drop(x) + m/‖·‖ · s·B A drop(x).
- `rescale(layer, name, out)`: the DoRA output from the fused LoRA output `out` = W x + bias + s·B A x
  (model.qlora's fused forward): one [T, out] multiply-add on top (`_Rescale`), which saves `out` for the
  magnitude's gradient (peft saves the base output and LoRA's output apart: two [T, out]) and sums that gradient
  over row chunks in backward (no [T, out] product).
- `forward(layer, name, x)`: peft's formula term by term, for what the fused path does not take (dropout in
  training, LoRA in another dtype than x), rounded as peft's (`peft_sum`); the base's share on the dropped input
  through `_FrozenLinear`, which keeps no dequantized weight for backward.
- `row_norms`: ‖W + s·B A‖ per row in row chunks (no second [out, in] temporary beside W's).
- `unset_magnitudes()`: while entered, peft builds DoRA layers without computing their magnitude from the base
  weight (our model is on the meta device then, its NF4 weights not yet packed); `init_magnitudes(model)` sets
  each to peft's start, ‖W + s·B A‖ of its row (‖W‖ with B = 0: the function is the base's), on every rank from
  the full tensors (FSDP2 shards all-gathered, one layer at a time), so it is the same for every layout.
- `fold(w, a, b, scale, m)`: the merged weight m/‖W + s·B A‖ ⊙ (W + s·B A) (peft's merge for DoRA), for
  `python -m model.merge`.

Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation" (arXiv 2402.09353).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

ROWS = 2**24   # elements of one row chunk of W + s·B A in row_norms


def is_dora(layer: nn.Module, name: str) -> bool:
    return name in getattr(layer, "lora_magnitude_vector", {})


def base_weight(base: nn.Module) -> torch.Tensor:
    """The weight the base layer computes with: an NF4 layer's dequantized (full, also outside FSDP2's forward)."""
    if hasattr(base, "dequantized"):
        return base.dequantized()
    w = base.weight
    return (w.full_tensor() if hasattr(w, "full_tensor") else w).detach()


@torch.no_grad()
def row_norms(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """‖W + scale · B @ A‖ of each output row, computed in `dtype` (B @ A in the LoRA dtype first, as peft)."""
    out = torch.empty(w.shape[0], dtype=dtype, device=w.device)
    n = max(1, ROWS // w.shape[1])
    for i in range(0, w.shape[0], n):
        rows = w[i:i + n].to(dtype) + scale * (b[i:i + n] @ a).to(dtype)
        out[i:i + n] = torch.linalg.norm(rows, dim=1)
    return out


def _scale(layer: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """m / ‖W + s·B A‖ per output feature, in `dtype`: the magnitude's gradient flows through it, the norm's not.
    Inside model.nf4.dequant_once (the tiled MLP's tiles) the norm is computed once per layer, not per tile."""
    from model.nf4 import _once

    cache = getattr(_once, "weights", None)
    key = (layer, name, dtype)
    norm = cache.get(key) if cache is not None else None
    if norm is None:
        norm = row_norms(base_weight(layer.base_layer), layer.lora_A[name].weight, layer.lora_B[name].weight,
                         layer.scaling[name], dtype)
        if cache is not None:
            cache[key] = norm
    return (layer.lora_magnitude_vector[name].weight / norm).to(dtype)


def rescale(layer: nn.Module, name: str, out: torch.Tensor) -> torch.Tensor:
    """DoRA's output from the fused LoRA output `out` = W x + bias + s·B A x."""
    return apply_scale(out, _scale(layer, name, out.dtype), layer.base_layer.bias)


def apply_scale(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """scale ⊙ (out − bias) + bias, as scale ⊙ out + bias ⊙ (1 − scale): one [T, out] op (_Rescale)."""
    return _Rescale.apply(out, scale, None if bias is None else bias.to(out.dtype))


class _Rescale(torch.autograd.Function):
    """y = scale ⊙ out + bias ⊙ (1 − scale), scale and bias [out] over out's rows. Saves out, as autograd's multiply
    would; backward sums the scale's gradient, Σ_t g_t ⊙ (out_t − bias), over row chunks (float32 sums), where
    autograd's would first hold the whole [T, out] product g ⊙ out beside g and its input gradient: at 128k tokens
    one more [T, intermediate] in gate's and up's backward (~5 GB for a 7B MLP)."""

    @staticmethod
    def forward(ctx, out, scale, bias):
        ctx.save_for_backward(out, scale, bias)
        return out * scale if bias is None else torch.addcmul(bias * (1 - scale), out, scale)

    @staticmethod
    def backward(ctx, g):
        out, scale, bias = ctx.saved_tensors
        d_scale = None
        if ctx.needs_input_grad[1]:
            g2, o2 = g.reshape(-1, g.shape[-1]), out.reshape(-1, out.shape[-1])
            acc = torch.promote_types(g.dtype, torch.float32)   # (bf16's sums in float32)
            d_scale = torch.zeros(g2.shape[1], dtype=acc, device=g.device)
            g_sum = torch.zeros_like(d_scale) if bias is not None else None
            n = max(1, ROWS // g2.shape[1])
            for i in range(0, g2.shape[0], n):
                d_scale += (g2[i:i + n] * o2[i:i + n]).sum(0, dtype=acc)
                if g_sum is not None:
                    g_sum += g2[i:i + n].sum(0, dtype=acc)
            if g_sum is not None:
                d_scale -= bias.to(acc) * g_sum
            d_scale = d_scale.to(scale.dtype)
        return g * scale if ctx.needs_input_grad[0] else None, d_scale, None


def forward(layer: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """peft's DoRA forward term by term (module docstring), LoRA computing in its own dtype, rounded as peft rounds."""
    a_lin, b_lin, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    result = layer.base_layer(x)
    xl = x.to(a_lin.weight.dtype)
    base = None   # (no dropout: the base's own output less its bias)
    if layer.training and not isinstance(dropout, nn.Identity):
        xl = dropout(xl)
        base = _FrozenLinear.apply(xl, layer.base_layer)
    return peft_sum(result, layer.base_layer.bias, _scale(layer, name, xl.dtype), b_lin(a_lin(xl)), layer.scaling[name],
                    base)


class _FrozenLinear(torch.autograd.Function):
    """x @ W^T for a frozen base layer's weight (peft's F.linear on the dropped input), saving nothing: backward
    dequantizes W again, as bitsandbytes' own matmul does, where autograd would keep the dequantized [out, in]
    weight of every such layer until its backward (an NF4 block's whole weight in each block recompute)."""

    @staticmethod
    def forward(ctx, x, base):
        ctx.base = base
        return nn.functional.linear(x, base_weight(base).to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        return g.matmul(base_weight(ctx.base).to(g.dtype)), None


def peft_sum(result: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, lora: torch.Tensor, s: float,
             base: torch.Tensor | None = None) -> torch.Tensor:
    """result + (scale − 1)·base + scale·lora·s as peft's DoRA sums it: `base` (unless given: W drop(x)) is
    result − bias in result's dtype, the share in the LoRA dtype, and the sum cast back to result's dtype once
    (rounding the share first moved a quarter of bf16 outputs by an ulp)."""
    if base is None:
        base = result if bias is None else result - bias
    return (result + ((scale - 1) * base + scale * lora * s)).to(result.dtype)


@contextlib.contextmanager
def unset_magnitudes():
    """peft's DoRA layers built with an empty magnitude vector (set later by init_magnitudes)."""
    from peft.tuners.lora.dora import DoraLinearLayer

    def update_layer(self, *, base_layer, lora_A, **kwargs):
        self.weight = nn.Parameter(torch.empty(base_layer.out_features, dtype=lora_A.dtype, device=lora_A.device))

    own = DoraLinearLayer.update_layer
    DoraLinearLayer.update_layer = update_layer
    try:
        yield
    finally:
        DoraLinearLayer.update_layer = own


def init_magnitudes(model: nn.Module) -> None:
    """Every DoRA magnitude = ‖W + s·B A‖ of its row, in float32, from the full tensors (a collective per layer
    under FSDP2: every rank calls this in the same order)."""
    from model.nf4 import _full
    from model.qlora import set_param

    for layer in (m for m in model.modules() if getattr(m, "lora_magnitude_vector", None)):
        for name, mag in layer.lora_magnitude_vector.items():
            norms = row_norms(base_weight(layer.base_layer).float(), _full(layer.lora_A[name].weight).float(),
                              _full(layer.lora_B[name].weight).float(), layer.scaling[name], torch.float32)
            set_param(mag.weight, norms.to(mag.weight.dtype))


def fold(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, m: torch.Tensor) -> torch.Tensor:
    """The merged DoRA weight m / ‖W + s·B A‖ ⊙ (W + s·B A), row-wise, in W's dtype (computed in float32)."""
    v = w.float() + scale * (b.float() @ a.float())
    return (v * (m.float() / torch.linalg.norm(v, dim=1)).unsqueeze(1)).to(w.dtype)
