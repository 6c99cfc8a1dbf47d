"""Activation-checkpoint offload to host memory (--offload-activations), used by `parallelize.apply_ac`.

Contract:
- `HostOffload.saving(x)`: saved_tensors_hooks placed around a block's non-reentrant checkpoint call, so
  they see only what the checkpoint itself saves, its inputs (everything the block saves inside goes
  through the checkpoint's own hooks). Activation-sized inputs (at least the block input's elements;
  parameters never) are copied to host memory at pack time: on CUDA into pinned memory on a side stream,
  the compute stream not waiting for it; on CPU as a host-to-host copy, so the same path is tested.
- In backward, unpacking block i's input fetches it (already in flight if prefetched). Block i-1's input is
  fetched next, but only once block i's attention backward is done (`HostOffload.after_attention` wraps a
  block's attention so a hook on the attention core's q gradient releases it): block i's peak, in its MLP
  and attention backward, holds one offloaded block input, not two; the copy then overlaps block i's
  q/k/v projection and norm backward. A release that never comes (a model whose q needs no grad) only
  costs the overlap: the unpack fetches it then.
- Correctness never depends on the timing: a handle is fetched by its own unpack whether or not it was
  prefetched. Handles link to their predecessor by weak reference (a forward dropped without a backward
  leaves nothing to prefetch later), and a prefetched handle that dies unfetched keeps its device buffer
  from reuse until the side stream's copy into it is done.

Credit: offloading checkpoints to the host follows Arctic Long Sequence Training (Bekman et al., 2025).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


class _Offloaded:
    """One saved tensor living in host memory, with its optional prefetched device copy."""

    def __init__(self, t: torch.Tensor, stream):
        self.device, self.stream, self.used, self.prev, self.fetched, self.event = t.device, stream, False, \
            None, None, None
        if stream is not None:   # CUDA: pinned host buffer, copied on the side stream
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))   # t is complete on the compute stream
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)   # the allocator keeps t's memory until the copy has read it
        else:
            self.host = t.detach().to("cpu", copy=True)

    def prefetch(self) -> None:
        if self.fetched is not None:
            return
        if self.stream is None:
            self.fetched = self.host.to(self.device, copy=True)
            return
        current = torch.cuda.current_stream(self.device)
        self.fetched = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self.stream.wait_stream(current)   # earlier users of that memory are done before the copy writes
        with torch.cuda.stream(self.stream):
            self.fetched.copy_(self.host, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def __del__(self):   # prefetched, never fetched: the side stream's copy may still be writing that memory
        if self.fetched is not None and self.stream is not None:
            self.fetched.record_stream(self.stream)

    def fetch(self) -> torch.Tensor:
        self.prefetch()
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        t, self.fetched, self.event, self.used = self.fetched, None, None, True
        return t


class HostOffload:
    """saved_tensors_hooks that keep a checkpoint's activation-sized inputs in host memory (module docstring)."""

    def __init__(self):
        self.stream = None
        # weak references: the saved graph alone keeps a handle; a forward dropped without backward leaves none
        self.last = None      # the most recently packed, not yet used handle: the next one's predecessor
        self.pending = None   # the next block's handle, fetched once this block's attention backward is done
        self.moved = 0        # tensors sent to the host (counted for tests and logs)

    def _pack(self, min_numel):
        def pack(t):
            if isinstance(t, nn.Parameter) or t.numel() < min_numel:
                return t
            if t.is_cuda and self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            h = _Offloaded(t, self.stream if t.is_cuda else None)
            last = self.last() if self.last is not None else None
            h.prev = weakref.ref(last) if last is not None and not last.used else None
            self.last = weakref.ref(h)
            self.moved += 1
            return h
        return pack

    def _unpack(self, h):
        if not isinstance(h, _Offloaded):
            return h
        t = h.fetch()
        self.pending = h.prev   # the block before this one runs its backward next: released by after_attention
        h.prev = None
        if self.last is not None and self.last() is h:
            self.last = None
        return t

    def saving(self, block_input: torch.Tensor):
        """Hooks for one checkpointed block call whose first input is `block_input`."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack(block_input.numel()), self._unpack)

    def release(self, grad=None) -> None:
        """This block's attention backward is done (its peak is past): start fetching the next block's input."""
        h, self.pending = (self.pending() if self.pending is not None else None), None
        if h is not None and not h.used:
            h.prefetch()

    def after_attention(self, forward):
        """A block attention's forward whose core, in a graph-building call, releases the next block's input
        from a hook on its q: the hook runs once the core's backward has given q its gradient."""
        def core_releasing(core):
            def run(q, *args, **kwargs):
                if torch.is_grad_enabled() and q.requires_grad:   # a recompute's hook never runs: harmless
                    q.register_hook(self.release)
                return core(q, *args, **kwargs)
            run.release = self.release   # for a sublayer that runs no core (parallel/tiled_attention.py)
            return run

        def run(x, cos, sin, core, meta):
            return forward(x, cos, sin, core_releasing(core), meta)
        return run
