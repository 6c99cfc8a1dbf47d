"""Gemma 4 E2B / E4B's per-layer-embedding table in host memory (the default; --ple-on-device keeps it on the device).

Contract:
- `apply_host_table(model)` (parallel/parallelize.py, after the memory steps, before fully_shard, on the meta
  skeleton): the decoder's `embed_tokens_per_layer` [V', L·P] (model/gemma4_small.py) becomes a `HostEmbedding`,
  the same frozen `weight` under the same name, so loading (model/weights.py streams its rows into host memory),
  `named_parameters`, the adapter export and `python -m model.merge` (which read the checkpoint, not this module) see
  it as before. Nothing else changes; a model without the table is left alone. Returns whether it applied.
- `HostEmbedding`: device moves and materialisation skip its weight (`_apply`): `to_empty(device)` gives it ordinary
  host memory of its dtype, `.to(device)` / `.cuda()` leave it there; so FSDP2 (which moves the states it manages; the
  frozen root parameters are not among them, parallel/fsdp.py) and the model's materialisation never put it on the
  accelerator. Its forward reads the step's token ids on the host (a device-to-host copy of T int64: on CUDA it waits
  for the queued work, and the GPU idles while the host gathers), gathers the rows of its U distinct tokens into one
  reused pinned buffer of the longest micro-batch's T rows (torch's pinned allocator: a power of two; before it is
  written again the last copy out of it has finished, a CUDA event), copies them to the ids' device without blocking
  and expands them there to [..., L·P] in the table's dtype (the compute dtype): the same values the device table's
  lookup gives. On CPU the same path runs, the copy a no-op. Under context parallelism the ids are the rank's shard:
  each rank moves only its own tokens' rows.
- The table itself is not pinned: the copy reads the gathered rows, never the table, and page-locking 5.6 GB (E4B,
  bf16) per rank would cost seconds at start-up and memory the OS may not page out, for nothing.
- Cost per micro-batch: U·L·P·e bytes gathered on the host and copied, U <= T (E4B, bf16: 21,504 bytes a distinct
  token; text repeats its tokens, so U is below T); the device holds the U rows and the expanded [T, L·P]
  for a moment at the forward's start, before any activation is saved. Measured on this project's 2-core CPU machine
  (shared), one thread (torchrun's default per rank), E4B's table (`.venv/bin/python bench/host_table.py`): the gather
  of 32,768 random ids (~30,800 distinct, 662 MB) 109-122 ms into a reused buffer, of 32,768 ids over 8k distinct
  tokens (170 MB) 17-40 ms. The memory plan counts the table as host memory and the pinned rows beside it
  (parallel/plan_small.py).
"""

from __future__ import annotations

import torch
from torch import nn


class HostEmbedding(nn.Embedding):
    """A frozen embedding whose weight stays in host memory; its lookups land on the ids' device (module docstring)."""

    def _apply(self, fn, recurse=True):
        if self.weight.is_meta:   # to_empty's materialisation: host memory, whatever the device asked for
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="cpu"), requires_grad=False)
        return self   # (moves and casts skip the table: it is read row by row, in the dtype it was built in)

    rows, copied = None, None   # the pinned rows buffer, reused; the CUDA event of the last copy out of it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # each distinct token's row once: text repeats its tokens, so the host reads and copies U <= T rows
        uniq, inv = torch.unique(ids.reshape(-1).to("cpu"), return_inverse=True)   # [U], [T]
        rows = self._buffer(ids)[: uniq.numel()]
        torch.index_select(self.weight, 0, uniq, out=rows)                          # [U, L·P]
        moved = rows.to(ids.device, non_blocking=True)
        if ids.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return moved[inv.to(ids.device)].view(*ids.shape, -1)   # [B, S, L·P] (a new tensor: the buffer is reused)

    def _buffer(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, L·P] rows, T of the longest micro-batch so far, pinned on CUDA: one buffer, so the host memory pinned is
        one micro-batch's rows (as torch's pinned allocator rounds it: a power of two), not a cache of past sizes."""
        if self.copied is not None:
            self.copied.synchronize()   # the last copy out of it is done (a micro-batch ago: no wait in practice)
        n, pin = ids.numel(), ids.is_cuda
        if self.rows is None or self.rows.shape[0] < n or self.rows.is_pinned() != pin:
            self.rows = None
            if pin and hasattr(torch._C, "_host_emptyCache"):   # the smaller one unpinned, not cached beside it
                torch._C._host_emptyCache()
            self.rows = torch.empty(n, self.weight.shape[1], dtype=self.weight.dtype, pin_memory=pin)
        return self.rows


def apply_host_table(model) -> bool:
    """Swap the decoder's per-layer-embedding table for a HostEmbedding holding the same weight (module docstring)."""
    old = getattr(model.model, "embed_tokens_per_layer", None)
    if old is None:
        return False
    if old.weight.requires_grad:
        raise ValueError("the per-layer embedding table is frozen (it never trains); a fork that trains it must "
                         "keep it on the device: --ple-on-device")
    new = HostEmbedding(old.num_embeddings, old.embedding_dim, device="meta", dtype=old.weight.dtype)
    new.weight = old.weight
    model.model.embed_tokens_per_layer = new
    return True

