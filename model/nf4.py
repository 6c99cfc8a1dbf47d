"""4-bit NF4 base weights (bitsandbytes) on the decoder; LoRA on top of them: model/qlora.py.

Contract:
- `apply_nf4(model, storage_dtype)` swaps every `nn.Linear` inside the decoder blocks for `NF4Linear` (but an MoE
  block's router, `mlp.gate`: kept in the compute dtype, as transformers 5's bitsandbytes loading keeps its router,
  no nn.Linear there)
  (a bitsandbytes `Linear4bit`, so peft dispatches its 4-bit LoRA layer). Runs on the meta device:
  nothing is quantized until `quantize_weight` is given the real tensor at load time.
- The packed weight is a plain frozen `nn.Parameter` of shape [out·in / 64, 64 / (2·itemsize)] typed as
  `storage_dtype` (bf16 on CUDA, equal to FSDP2's parameter dtype so mixed precision never casts
  the packed bits): one row per 64-weight NF4 block, so FSDP2's dim-0 shards hold whole blocks. The
  per-block absmax, itself quantized to uint8 (bitsandbytes' nested statistics), is a second frozen
  parameter `absmax` ([ceil(blocks / itemsize), 1], the uint8 codes viewed as `storage_dtype`), so
  FSDP2 shards and all-gathers it with the codes. Only the small rest of the state (code books, the
  offset, one fp32 scale per 256 blocks) stays on the module, replicated; `NF4Linear.state()` joins
  it with the (all-gathered) absmax for bitsandbytes, in forward and backward alike.
- Quantization state is never in a training checkpoint: both parameters are frozen and re-made from
  the safetensors at load. `quantize_blocks` + `nest_absmax` equal one whole-tensor
  `quantize_4bit(compress_statistics=True)` bit for bit but for the nested offset, absmax's mean, taken in float64
  (`nested_state`: the same bits on CPU and CUDA), and let each rank quantize its own blocks. `nf4_round_trip(w)`
  is the weight training computes with, what `python -m model.merge` folds the adapter into.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from model.bnb import QuantState, bnb, dequantize, get_4bit_type, quantize_4bit, quantize_blockwise
from model.llama import Transformer

BLOCKSIZE = 64


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


_once = threading.local()   # dequant_once's weights (backward runs on autograd's device threads)


class dequant_once:
    """While entered, each NF4Linear dequantizes its weight once and keeps it (plain GEMMs after that) instead of
    once per call: for loops that run the same layers over tiles of tokens (parallel/memory.py's tiled MLP and
    parallel/tiled_attention.py). Re-entrant; the weights go when the outermost exits."""

    def __enter__(self):
        self.prev = getattr(_once, "weights", None)
        _once.weights = {} if self.prev is None else self.prev

    def __exit__(self, *exc):
        _once.weights = self.prev


class NF4Linear(bnb.nn.Linear4bit):
    """Linear4bit whose packed codes and absmax codes are parameters; the rest of the state is here."""

    quant_state = None   # QuantState with absmax=None: code book, offset, nested fp32 scales (state2)

    def state(self) -> QuantState:
        """The full QuantState: inside forward FSDP2 has all-gathered `absmax`; outside it is gathered."""
        st = copy.copy(self.quant_state)
        st.absmax = _full(self.absmax).view(torch.uint8).view(-1)[: self.weight.shape[0]]
        return st

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if getattr(_once, "weights", None) is not None:   # bitsandbytes' own path past 1,536 rows on CUDA: the
            return nn.functional.linear(x, self.dequantized().to(x.dtype), bias)   # dequantized weight, a GEMM
        # bnb's autograd keeps only the packed weight (and the state's views) and dequantizes again
        # in backward; FSDP2 re-gathers into the same storage, so the absmax view is valid there too.
        if x.device.type == "cpu":   # (its CPU kernel misreads a 2-D state: model/bnb.dequantize)
            return _MatMul4bit.apply(x, self.weight, self.state(), bias)
        return bnb.matmul_4bit(x, self.weight.view(-1, 1), quant_state=self.state(), bias=bias)

    def dequantized(self) -> torch.Tensor:
        cache = getattr(_once, "weights", None)
        if cache is not None and self in cache:
            return cache[self]
        w = dequantize(_full(self.weight), self.state())
        if cache is not None:
            cache[self] = w
        return w


class _MatMul4bit(torch.autograd.Function):
    """bnb.matmul_4bit's CPU math (dequantize into x's dtype, one F.linear with the bias; backward: dy @ W in dy's
    dtype), with model/bnb.dequantize: like bnb's, it keeps the packed weight and state on ctx, no tensor saved
    (parallel/recompute probes that), and no dequantized weight between forward and backward."""

    @staticmethod
    def forward(ctx, x, packed, state, bias):
        ctx.packed, ctx.state, ctx.has_bias = packed, state, bias is not None
        return nn.functional.linear(x, dequantize(packed, state, x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):
        dx = torch.matmul(dy, dequantize(ctx.packed, ctx.state).to(dy.dtype)) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return dx, None, None, db


def packed_shape(out_f: int, in_f: int, storage_dtype: torch.dtype) -> tuple[int, int]:
    """[blocks, 4-bit values of one 64-block per storage element]: FSDP2 then shards whole blocks."""
    per_elem = 2 * torch.empty((), dtype=storage_dtype).element_size()   # 4-bit values per element
    if (out_f * in_f) % BLOCKSIZE:
        raise ValueError(f"a {out_f}×{in_f} weight is not a whole number of {BLOCKSIZE}-weight NF4 blocks; "
                         "use --quant none for this checkpoint")
    return out_f * in_f // BLOCKSIZE, BLOCKSIZE // per_elem


def absmax_rows(blocks: int, storage_dtype: torch.dtype) -> int:
    return -(-blocks // torch.empty((), dtype=storage_dtype).element_size())


def apply_nf4(model: Transformer, storage_dtype: torch.dtype) -> None:
    for block in model.model.layers:   # (an MoE block's experts, not its router: model/moe.py)
        mixer = getattr(block, "self_attn", None) or block.linear_attn   # (Qwen3.5's linear blocks: its Linears only)
        experts, shared = getattr(block.mlp, "experts", None), getattr(block.mlp, "shared_expert", None)
        glm = getattr(block.mlp, "shared_experts", None)   # (GLM-4.5's shared experts: no gate, model/glm4_moe.py)
        parents = (mixer, *(experts or (block.mlp,)), *([shared] if shared else []), *([glm] if glm else []),
                   *(getattr(block, "experts", None) or ()))   # (Gemma 4's beside its dense MLP: gemma4_moe.py)
        # (Qwen3.5-MoE's shared expert and its gate, a Linear [1, D]: transformers + bnb quantize both)
        for parent, name in [(p, n) for p in parents for n, _ in p.named_children()] + [
                (block.mlp, "shared_expert_gate")] * bool(shared):
            lin = getattr(parent, name)
            if not isinstance(lin, nn.Linear):
                continue
            packed_shape(lin.out_features, lin.in_features, storage_dtype)   # refuse before any work
            q = NF4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          compute_dtype=None, compress_statistics=True, quant_type="nf4",
                          quant_storage=storage_dtype, device=lin.weight.device)
            if lin.bias is not None:
                q.bias = nn.Parameter(lin.bias.detach(), requires_grad=False)
            setattr(parent, name, q)
    model.is_loaded_in_4bit = True   # peft reads this to pick its 4-bit LoRA layer


def pack_nf4_weights(model: nn.Module) -> None:
    """After peft saw the Params4bit weights: give each NF4Linear its packed codes and absmax parameters."""
    for m in model.modules():
        if isinstance(m, NF4Linear):
            dt, dev = m.quant_storage, m.weight.device
            blocks, cols = packed_shape(m.out_features, m.in_features, dt)
            m.weight = nn.Parameter(torch.empty(blocks, cols, dtype=dt, device=dev), requires_grad=False)
            m.absmax = nn.Parameter(torch.empty(absmax_rows(blocks, dt), 1, dtype=dt, device=dev),
                                    requires_grad=False)


def quantize_blocks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes (uint8, two per byte) and fp32 absmax of whole 64-blocks; blocks are independent."""
    # Always from float32: the bits then depend only on the checkpoint, not on the device or layout.
    packed, st = quantize_4bit(flat.reshape(-1).float(), blocksize=BLOCKSIZE, compress_statistics=False,
                               quant_type="nf4", quant_storage=torch.uint8)
    return packed.view(-1), st.absmax


def nested_state(absmax: torch.Tensor, shape, dtype: torch.dtype) -> tuple[torch.Tensor, QuantState]:
    """bitsandbytes' nested statistics over a layer's whole fp32 absmax (what quantize_4bit does with
    compress_statistics=True): the uint8 absmax codes and the QuantState without them (absmax=None), dequantizing
    to `dtype`. The offset, absmax's mean, is taken in float64: bitsandbytes' float32 mean rounds by the device's
    reduction order (CPU and CUDA differ in its last bit, for most layers), and a last-bit move of the offset moves
    absmax codes near their boundaries, so `python -m model.merge` on the CPU would fold its adapter into a base that
    differs, in some blocks per layer, from the one training quantized on the GPU. In float64 both round alike."""
    offset = absmax.double().mean().float()
    qabsmax, state2 = quantize_blockwise(absmax - offset, blocksize=256)
    return qabsmax, QuantState(absmax=None, shape=torch.Size(shape), dtype=dtype, blocksize=BLOCKSIZE,
                               quant_type="nf4", offset=offset, state2=state2,
                               code=get_4bit_type("nf4", device=absmax.device))


def nest_absmax(m: NF4Linear, absmax: torch.Tensor) -> torch.Tensor:
    """`nested_state` for module `m`: sets its replicated state, returns the uint8 absmax codes."""
    # Dequantize (forward fallback and bnb's backward) straight into the storage/compute dtype: one
    # rounding either way, but no float32 [out, in] temporary on CUDA.
    qabsmax, m.quant_state = nested_state(absmax, (m.out_features, m.in_features), m.quant_storage)
    return qabsmax


def nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight an NF4 layer computes with (quantize_blocks, nested_state, dequantized): training's base
    for that checkpoint tensor, the same bits on any device (model.merge folds adapters into it)."""
    codes, absmax = quantize_blocks(w)
    qabsmax, st = nested_state(absmax, w.shape, torch.float32)
    st.absmax = qabsmax
    return dequantize(codes, st)


def quantize_weight(m: NF4Linear, full: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one full [out, in] weight on `device`: (packed codes, absmax codes) in the parameters'
    global shapes; sets the module's state. The whole-tensor path, kept for load_weights(lean=False)."""
    codes, absmax = quantize_blocks(full.to(device))
    q = nest_absmax(m, absmax)
    return codes.view(m.quant_storage).view(m.weight.shape), pad_absmax(m, q)


def pad_absmax(m: NF4Linear, qabsmax: torch.Tensor) -> torch.Tensor:
    rows = m.absmax.shape[0]
    isz = torch.empty((), dtype=m.quant_storage).element_size()
    out = torch.zeros(rows * isz, dtype=torch.uint8, device=qabsmax.device)
    out[: qabsmax.numel()] = qabsmax
    return out.view(m.quant_storage).view(rows, 1)
