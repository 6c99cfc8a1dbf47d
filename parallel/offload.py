"""Activation-checkpoint offload to host memory (--offload-activations), used by `ac.apply_ac`.

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
- Host memory comes from `HostPool`: buffers of exactly the bytes asked, kept across steps and reused (a buffer at
  least as large, the smallest such); when none is free that fits, the free ones are dropped and one of the exact
  size is made, so the pool never holds more than the L - 1 inputs of the longest micro-batch so far (parallel/plan.py's
  host term). On CUDA each buffer is ordinary host memory page-locked in place (cudaHostRegister), not torch's
  pinned allocator, which rounds every request up to a power of two and caches it (a 3.76 GB input of 524,288 tokens
  x 3584 pins 4.29 GB; 18.9 GB at 2.6M tokens pins 34.4 GB; pytorch/pytorch#150517). A buffer goes back to the pool
  once its tensor is fetched (or its handle dies): its copy to the device, and the next copy into it, are both on
  the side stream, so they run in order; a buffer is unlocked and freed only once the side stream is idle. A
  longer micro-batch than any before replaces the buffers (a synchronize and new page-locking, once per new
  maximum), unless `HostOffload(reserve)` sized them (train.py: the plan's input at the data's longest row, the
  bytes its start-up check found free): then all of it is pinned in step 1 and never again. Without
  cudaHostRegister (a torch that lacks the binding), or where a registration fails (a sandboxed or capped host that
  refuses to lock memory in place), torch's pinned allocator is used from then on, said once. The failed call's error
  is first taken off the runtime, where torch's next kernel-launch check would raise it from an unrelated op; if the
  runtime still fails (the pinned allocator too: no host memory left to lock), the step stops naming the fixes.

Credit: offloading checkpoints to the host follows Arctic Long Sequence Training (Bekman et al., 2025).
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref

import torch
from torch import nn


def _pinned(nbytes: int) -> torch.Tensor:
    """torch's pinned allocator: rounds up to a power of two and caches what it frees (module docstring)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _take_last_error() -> bool:
    """Read (and so reset) a failed runtime call's error, which stays the thread's last error until read: torch's
    kernel-launch check reads it, so a throwaway launch that raises takes it. False if a second launch fails too."""
    for _ in range(2):
        try:
            torch.zeros(1, device="cuda").add_(1)
            return True
        except RuntimeError:
            pass
    return False


class _HostBuffer:
    """`nbytes` of host memory. With a (CUDA side) `stream`: an anonymous mapping of whole pages, page-locked in place
    (cudaHostRegister) from its first byte, so the tensor's storage starts at the registered address (torch's
    is_pinned asks about the storage's start); unlocked when dropped, once the stream's copies are done."""

    def __init__(self, nbytes: int, stream=None):
        self.nbytes, self.stream, self.registered = nbytes, stream, None
        if stream is None:
            self.data = torch.empty(nbytes, dtype=torch.uint8)
            return
        if HostPool.warned:   # no binding, or a registration failed before: torch's allocator from then on
            self.data = _pinned(nbytes)
            return
        span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        # page-aligned private anonymous memory (as malloc's), kept alive by the tensor (frombuffer holds a reference)
        mapped = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE)
        self.data = torch.frombuffer(mapped, dtype=torch.uint8)[:nbytes]
        try:
            rt = torch.cuda.cudart()
            register = rt.cudaHostRegister
        except (AttributeError, RuntimeError) as e:   # a torch without the binding: its pinned allocator instead
            self._fall_back(f"{type(e).__name__}: {e}")
            return
        err = register(self.data.data_ptr(), span, 0)
        if int(err) != 0:
            why = f"page-locking {span:,} bytes of host memory in place failed ({rt.cudaGetErrorString(err)})"
            if not _take_last_error():   # a sticky error: the device cannot go on
                raise RuntimeError(f"--offload-activations: {why}, and the device fails since; free host memory, "
                                   "lower --max-len or drop --offload-activations")
            try:
                self._fall_back(why)
            except RuntimeError as e:   # torch's allocator cannot lock it either: no host memory left to lock
                raise RuntimeError(f"--offload-activations: {why}, and so did torch's pinned allocator ({e}); free "
                                   "host memory, lower --max-len or drop --offload-activations") from None
            return
        self.registered = (rt, self.data.data_ptr())

    def _fall_back(self, why: str) -> None:
        del self.data   # (the mapping goes with it)
        self.data = _pinned(self.nbytes)
        if os.environ.get("LOCAL_RANK", "0") == "0":   # once per machine (torchrun's local rank), whose host it is
            warnings.warn(f"--offload-activations: host memory is pinned by torch's allocator, which rounds each "
                          f"buffer up to a power of two and keeps it cached ({why})", stacklevel=3)
        HostPool.warned = True

    def __del__(self):
        if self.registered is not None:
            rt, ptr = self.registered
            try:
                self.stream.synchronize()   # no copy on the side stream still uses these pages
                rt.cudaHostUnregister(ptr)
            except Exception:   # noqa: BLE001 (interpreter shutdown)
                pass


class HostPool:
    """Host buffers reused across steps (module docstring): `take(nbytes)` -> a buffer of at least nbytes, `give`
    it back. `made` counts the buffers made, `held` the bytes of all alive (given out and free)."""
    warned = False

    def __init__(self, stream=None, floor: int = 0):
        self.stream, self.free, self.made, self.held = stream, [], 0, 0   # stream: CUDA's side stream (pinned)
        self.floor = floor   # bytes of a new buffer at least: the plan's longest input, all pinned in step 1

    def take(self, nbytes: int) -> _HostBuffer:
        fits = [b for b in self.free if b.nbytes >= nbytes]
        if fits:
            b = min(fits, key=lambda b: b.nbytes)
            self.free.remove(b)
            return b
        dropped, self.free = self.free, []   # none fits: a larger input than before; the smaller ones go
        if dropped and self.stream is not None:
            self.stream.synchronize()        # once, not per buffer: no copy on the side stream still uses them
        self.held -= sum(b.nbytes for b in dropped)
        del dropped
        if self.stream is not None and HostPool.warned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()      # (torch's pinned allocator caches what it frees)
        b = _HostBuffer(max(nbytes, self.floor), self.stream)
        self.made, self.held = self.made + 1, self.held + b.nbytes
        return b

    def give(self, b: _HostBuffer) -> None:
        self.free.append(b)


def _view(b: _HostBuffer, like: torch.Tensor) -> torch.Tensor:
    return b.data[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


class _Offloaded:
    """One saved tensor living in host memory, with its optional prefetched device copy."""

    def __init__(self, t: torch.Tensor, stream, pool: HostPool):
        self.device, self.stream, self.used, self.prev, self.fetched, self.event = t.device, stream, False, \
            None, None, None
        self.pool, self.buffer = pool, None
        self.buffer = pool.take(t.numel() * t.element_size())
        self.host = _view(self.buffer, t)
        if stream is not None:   # CUDA: pinned host buffer, copied on the side stream
            stream.wait_stream(torch.cuda.current_stream(t.device))   # t is complete on the compute stream
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)   # the allocator keeps t's memory until the copy has read it
        else:
            self.host.copy_(t.detach())

    def _release(self) -> None:
        """The host copy is read (or never will be): its buffer back to the pool. The copies into and out of it are
        all on the side stream (CUDA), so a later one waits for this one's."""
        if self.buffer is not None:
            self.pool.give(self.buffer)
            self.buffer = self.host = None

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
        self._release()

    def fetch(self) -> torch.Tensor:
        self.prefetch()
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        t, self.fetched, self.event, self.used = self.fetched, None, None, True
        self._release()
        return t


class HostOffload:
    """saved_tensors_hooks that keep a checkpoint's activation-sized inputs in host memory (module docstring)."""

    def __init__(self, reserve: int = 0):
        self.stream, self.reserve = None, reserve   # reserve: bytes of each host buffer at least (HostPool's floor)
        # weak references: the saved graph alone keeps a handle; a forward dropped without backward leaves none
        self.last = None      # the most recently packed, not yet used handle: the next one's predecessor
        self.pending = None   # the next block's handle, fetched once this block's attention backward is done
        self.moved = 0        # tensors sent to the host (counted for tests and logs)
        self.pool = None      # HostPool, pinned on CUDA (made with the first tensor, which says the device)

    def _pack(self, min_numel):
        def pack(t):
            if isinstance(t, nn.Parameter) or t.numel() < min_numel:
                return t
            if t.is_cuda and self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            if self.pool is None:
                self.pool = HostPool(self.stream if t.is_cuda else None, self.reserve)
            h = _Offloaded(t, self.stream if t.is_cuda else None, self.pool)
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

        def run(x, cos, sin, core, meta, **kv):   # (kv: Gemma 4 E2B / E4B's shared keys and values)
            return forward(x, cos, sin, core_releasing(core), meta, **kv)
        return run
