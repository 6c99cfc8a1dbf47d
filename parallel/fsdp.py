"""FSDP2 on the LoRA-wrapped decoder and the global gradient norm.

Contract:
- `apply_fsdp(model, mesh, mp)`: `fully_shard` each decoder block, then the root, over the 2-D
  (dp_replicate, dp_shard·cp) mesh (HSDP; plain FSDP when dp_replicate is 1). CP ranks hold the same
  weights, so sharding over them too saves memory. The root's frozen parameters (embeddings, final norm,
  lm_head) are left out (`ignored_params`): FSDP2 would keep them unsharded from the forward to the end of
  the backward anyway (the root is never resharded after forward), so sharding them only added a second
  copy, the 1/W shard, and an all-gather of (V·D·2 + D) elements every step; plain whole tensors on every
  rank hold (V·D·2 + D)·e bytes all step instead of that times 1 + 1/W. Gemma 4 E2B / E4B's per-layer table is
  one of them, and stays in host memory (parallel/host_table.py: FSDP2 moves only the states it manages). FSDP2's
  own gradient division is switched off (divide factor 1, sum-only reductions, which gloo also supports): the loss
  is already divided by the global target count, so the reduced gradients equal one process's gradient on the
  global batch.
- A block module marked `KEEP_FLOAT32` (GLM-4.5's router, model/glm4_moe.py: float32 as transformers holds it) is
  left out of its block's FSDP2 unit (`ignored_params`): plain float32 tensors whole on every rank (GLM-4.5-Air: 46
  blocks of [128, 4096] + [128], 96 MB), which no MixedPrecisionPolicy casts to the compute dtype for forward;
  materialised by the model's to_empty and filled whole by the loader, as the root's.
- Weights are streamed after `fully_shard` by `model.weights.load_weights` (the one loading path,
  also `model.from_pretrained`'s): each rank reads only its shard of every tensor.
- `clip_grad_norm_(params, max_norm)` returns the true global norm over all shards and ranks.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(model, mesh, mp: MixedPrecisionPolicy | None = None):
    kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    blocks = list(model.model.layers)
    for i, block in enumerate(blocks):
        fp32 = {p for m in block.modules() if getattr(m, "KEEP_FLOAT32", False) for p in m.parameters()}
        # The last block is needed again right away by backward: keep it unsharded after forward.
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, ignored_params=fp32 or None, **kw)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    frozen = {p for p in model.parameters() if id(p) not in in_blocks and not p.requires_grad}
    # the root: embeddings, final norm and lm_head (their frozen weights whole on every rank); the loss runs
    # inside its forward
    fully_shard(model, ignored_params=frozen, **kw)
    for m in [*blocks, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):          # partial sums over shards -> the global norm
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
