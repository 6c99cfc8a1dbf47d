"""Which calls of a block need which values: the recompute flag, and linear bases whose outputs nobody reads.

Contract:
- `recomputing()`: True inside a block checkpoint's recompute (`recompute_context`, entered through checkpoint's
  `context_fn` by parallel/ac.apply_ac). A group checkpoint's recompute (`--ac-group`) sets it False:
  there each block's output is the next block's input. The tiled MLP (parallel/memory.py) skips its forward
  tiles inside it.
- `grads_only()`: True inside `grads_only_context`, around calls whose outputs are only differentiated (the
  tiled MLP's and the tiled attention's backward tiles).
- `apply_unread_outputs(model)` (always on, parallel/parallelize.build_model): two linear bases run only what
  autograd needs where nobody reads their output values (`mlp_output_read(block)`: whether a recompute reads the MLP's).
  - The MLP's down projection in a block recompute: the residual add saves nothing, and the checkpoint stops
    after the LoRA path's last saved tensor and drops the block's output (not in a block whose `outputs_saved`:
    Gemma's, where a norm after the MLP saves its output), so its base returns zeros instead of
    its GEMM (for Qwen2.5-7B 68M of a block's 233M weights: ~29% of the recompute's matmul FLOPs). Only where
    the base saves no tensor through autograd's saved-tensor hooks (bitsandbytes keeps its weight on ctx; an
    nn.Linear saves its weight and is left alone), probed once on one row in the first forward: the recompute
    must save exactly what the forward saved, which torch checks.
  - Under `grads_only()`, the down projection (tiled MLP tiles) and o_proj (tiled attention tiles): the base
    returns zeros carrying its input gradient (dy @ W, bitsandbytes' own backward formula), so its forward
    GEMM never runs; a base with a trainable parameter runs as usual.
  LoRA's A and B always run.
- `spare(x)`: x's storage may take results in backward (the blocked attention backward's dq, dk, dv and float32
  sums in q, k, v, out; the tiled MLP's input gradient in its input), where the caller's contract says nothing
  reads x after. Only that contract protects a tensor someone else saved too: without AC torch's version check
  refuses the second reader, but AC's checkpoint unpacks through saved-tensor hooks, which skip that check.
  `spare_storages(named)`: the names whose tensors are spare and share their storage with no other of them.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

_state = threading.local()   # backward may run on autograd's device threads


def recomputing() -> bool:
    return getattr(_state, "recompute", False)


class recompute_context:
    """Sets `recomputing()` to `on` while entered, inside `inner` when given. Re-entrant: a checkpoint enters its
    recompute context once per recompute, and a graph kept with retain_graph is recomputed again."""

    def __init__(self, on: bool = True, inner=None):
        self.on, self.inner, self.prev = on, inner, []

    def __enter__(self):
        if self.inner is not None:
            self.inner.__enter__()
        self.prev.append(recomputing())
        _state.recompute = self.on

    def __exit__(self, *exc):
        _state.recompute = self.prev.pop()
        return self.inner.__exit__(*exc) if self.inner is not None else None


def grads_only() -> bool:
    return getattr(_state, "grads_only", False)


class grads_only_context:
    """Sets `grads_only()` while entered (re-entrant): the unread-output bases give only their input gradient."""

    def __init__(self):
        self.prev = []

    def __enter__(self):
        self.prev.append(grads_only())
        _state.grads_only = True

    def __exit__(self, *exc):
        _state.grads_only = self.prev.pop()


class _InputGradOnly(torch.autograd.Function):
    """A frozen linear base whose output is never read: zeros forward, its input gradient backward."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x.new_zeros(*x.shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx, dy):
        m = ctx.module   # bitsandbytes' MatMul4Bit.backward: dy @ dequantize(W), in dy's dtype
        w = m.dequantized() if hasattr(m, "dequantized") else m.weight
        return torch.matmul(dy, w.to(dy.dtype)), None


class _UnreadOutput:
    """A block linear base's forward (module docstring): zeros in a block recompute (`in_recompute`, where safe),
    zeros with the input gradient under `grads_only()`, else the forward itself."""

    def __init__(self, module: nn.Module, in_recompute: bool):
        self.module, self.forward, self.in_recompute, self.safe = module, module.forward, in_recompute, None

    def __call__(self, x):
        if grads_only() and not any(p.requires_grad for p in self.module.parameters()):
            if x.requires_grad:
                return _InputGradOnly.apply(x, self.module)
            return x.new_zeros(*x.shape[:-1], self.module.out_features)   # nothing to differentiate
        if not self.in_recompute:
            return self.forward(x)
        if self.safe and recomputing():
            return x.new_zeros(*x.shape[:-1], self.module.out_features)
        if torch.is_grad_enabled() and not recomputing():
            if self.safe is None:
                self.safe = _saves_nothing(self.forward, x)
            if self.safe:   # the recompute's op, empty, in forward too: newer torch's selective-AC cache (
                x.new_zeros(0)   # --ac-keep-attn) records every forward op and refuses a recompute op forward lacked
        return self.forward(x)


def _saves_nothing(forward, x) -> bool:
    """Whether `forward` on x's first row (needing grad, as x does) packs no tensor through saved-tensor hooks."""
    packed = []
    row = x.detach().reshape(-1, x.shape[-1])[:1].requires_grad_(x.requires_grad)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        forward(row)
    return not packed


def mlp_output_read(block) -> bool:
    """Whether a block (or its class) reads its MLP's output in its recompute: where it says `outputs_saved` (Gemma's
    and OLMo's SandwichBlock: the norm after the MLP saves it). There the down projection's base runs its GEMM in a
    recompute and parallel/memory.py's tiled MLP its forward tiles; parallel/plan_speed.py times them by this too."""
    return getattr(block, "outputs_saved", False)


def apply_unread_outputs(model) -> None:
    """Wrap every block's down-projection base (recompute and tiled-MLP tiles) and o_proj base (tiled-attention
    tiles) as described above; a LoRA layer's base is its `base_layer`."""
    for block in model.model.layers:
        read = mlp_output_read(block)
        downs = [(block.mlp.down_proj, not read)] if hasattr(block.mlp, "down_proj") else []   # (an MoE block's
        attn = [(block.self_attn.o_proj, False)] if hasattr(block, "self_attn") else []   # (not a linear block's:
        for lin, in_recompute in (*downs, *attn):   # no tiled attention there; experts' outputs: read, weighted)
            if any(getattr(lin, "lora_variant", None) or ()):   # e.g. DoRA reads the base output: left alone
                continue
            base = getattr(lin, "base_layer", lin)
            base.forward = _UnreadOutput(base, in_recompute)


def spare(x: torch.Tensor) -> bool:
    """May x's storage take results in backward (the caller's contract: nothing reads x after)? Only an
    intermediate (a leaf is its owner's), the whole of its storage (not a slice, whose neighbours others may
    read), contiguous, and outside create_graph (in-place writes would be recorded)."""
    return (x.grad_fn is not None and not torch.is_grad_enabled() and x.is_contiguous()
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


def spare_storages(named: dict) -> set:
    """The names of `named`'s tensors that are spare and alone on their storage among them (k is v: neither)."""
    ptrs = [x.untyped_storage().data_ptr() for x in named.values()]
    return {n for (n, x), p in zip(named.items(), ptrs) if ptrs.count(p) == 1 and spare(x)}
