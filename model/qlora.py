"""4-bit NF4 base weights (bitsandbytes) and LoRA (peft) on the decoder.

Contract:
- `apply_nf4(model, storage_dtype)` swaps every `nn.Linear` inside the decoder blocks for `NF4Linear`
  (a bitsandbytes `Linear4bit`, so peft dispatches its 4-bit LoRA layer). Runs on the meta device:
  nothing is quantized until `quantize_weight` is given the real tensor at load time.
- The packed weight is a plain frozen `nn.Parameter` of shape [out·in / (2·itemsize), 1] typed as
  `storage_dtype` (bf16 on CUDA, equal to FSDP2's parameter dtype so mixed precision never casts
  the packed bits); FSDP2 shards it along dim 0 like any other parameter. The quantization state
  (absmax, code, shape) lives on the module, so it survives FSDP2 swapping the parameter object on
  every unshard; `NF4Linear.forward` always reads it from there.
- `apply_lora(model, ...)` wraps the model with `peft.get_peft_model`; only LoRA parameters are
  trainable and they are float32. `init_lora(model, seed)` sets every LoRA tensor from a generator
  seeded by (seed, parameter name), computed in full on every rank and sliced to the local shard,
  so the adapter init is identical for 1 process and for any mesh.
"""

from __future__ import annotations

import hashlib
import math

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.config import LORA_TARGETS
from model.llama import Transformer

BLOCKSIZE = 64


class NF4Linear(bnb.nn.Linear4bit):
    """Linear4bit whose quant state is owned by the module and whose weight is the packed tensor."""

    quant_state = None

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # bnb's autograd keeps only the packed weight for backward and dequantizes again there.
        return bnb.matmul_4bit(x, self.weight, quant_state=self.quant_state, bias=bias)

    def dequantized(self) -> torch.Tensor:
        w = self.weight.full_tensor() if isinstance(self.weight, DTensor) else self.weight
        return dequantize_4bit(w.detach(), self.quant_state)


def packed_rows(out_f: int, in_f: int, storage_dtype: torch.dtype) -> int:
    per_elem = 2 * torch.empty((), dtype=storage_dtype).element_size()   # 4-bit values per element
    if (out_f * in_f) % per_elem:
        raise ValueError(f"a {out_f}×{in_f} weight cannot be packed into {storage_dtype}")
    return out_f * in_f // per_elem


def apply_nf4(model: Transformer, storage_dtype: torch.dtype) -> None:
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                q = NF4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=None, compress_statistics=True, quant_type="nf4",
                              quant_storage=storage_dtype, device=lin.weight.device)
                if lin.bias is not None:
                    q.bias = nn.Parameter(lin.bias.detach(), requires_grad=False)
                setattr(parent, name, q)
    model.is_loaded_in_4bit = True   # peft reads this to pick its 4-bit LoRA layer


def pack_nf4_weights(model: nn.Module) -> None:
    """After peft saw the Params4bit weights: give each NF4Linear its packed-shape plain parameter."""
    for m in model.modules():
        if isinstance(m, NF4Linear):
            dt = m.quant_storage
            rows = packed_rows(m.out_features, m.in_features, dt)
            m.weight = nn.Parameter(torch.empty(rows, 1, dtype=dt, device=m.weight.device),
                                    requires_grad=False)


def quantize_weight(m: NF4Linear, full: torch.Tensor, device) -> torch.Tensor:
    """Quantize one full [out, in] weight on `device`; set the module's state; return packed bits."""
    # Always from float32: the bits then depend only on the checkpoint, not on the device or layout.
    packed, state = quantize_4bit(full.to(device=device, dtype=torch.float32), blocksize=BLOCKSIZE,
                                  compress_statistics=True, quant_type="nf4", quant_storage=m.quant_storage)
    # Dequantize (forward fallback and bnb's backward) straight into the storage/compute dtype: one
    # rounding either way, but no float32 [out, in] temporary on CUDA.
    state.dtype = m.quant_storage
    m.quant_state = state
    return packed.view(-1, 1)


def apply_lora(model: Transformer, r: int, alpha: float, dropout: float, targets=LORA_TARGETS):
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                     bias="none", init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
    return peft_model


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
