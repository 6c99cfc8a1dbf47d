"""Zigzag ring attention: causal attention over a sequence sharded across the ranks of one group.

Contract:
- Layout: the sequence is cut into 2P chunks and ring rank r holds chunks r and 2P-1-r back to back,
  so q, k, v are [B, 2c, H, D] / [B, 2c, Hkv, D] per rank. `ring_attention(q, k, v, scale, group)`
  returns this rank's rows of full causal attention over the whole sequence, in q's dtype, and is
  differentiable w.r.t. q, k, v.
- K/V travel around the ring (rank r sends to r+1, receives from r-1) with P2P ops that are posted
  before the current block is computed, so transfer overlaps compute. Backward sends dK/dV along
  with them; after P hops every rank holds the gradients of its own K/V.
- Balance (the zigzag trick): step 0 is the causal diagonal; at step i > 0 the block from rank
  j = r-i either lies wholly before both local chunks (j < r: all queries × the first half of K/V)
  or only before the second one (j > r: the second half of the queries × all of K/V). Every rank
  does c·2c query-key pairs per step.
- Partial outputs are merged with their log-sum-exp in float32 (Liu et al., "Ring Attention with
  Blockwise Transformers", 2023; zigzag layout as in zhuzilin/ring-flash-attention).
- The group may be a sub-group of the world (hybrid CP); P2P peers are translated to global ranks.
- Packed rows and sliding windows: `docs` (`parallel.masks.Documents` of the GLOBAL row: document ids and
  bounds) and `window` restrict each block by the global indices of its rows and columns. `masks.calls`
  decides on the host, from the bounds, which calls cover exactly what the block sees: none for a block
  nothing sees (same P2P traffic on every rank), one plain call for a block no boundary or window edge
  cuts, else tile × tile pieces (`tile`, default masks.MASK_TILE) of which only those a boundary or edge
  crosses run the masked kernel, with a mask of their own size built when called. The zigzag layout and
  the block shapes above are unchanged, so no rank ever does more than c·2c pairs a step; how much less
  depends on where the documents and windows fall.
- `sinks` [H] (GPT-OSS, this rank's heads): merged into the final (out, lse) after the last block
  (`kernels.with_sinks`), which backward's calls then take as the global (out, lse).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import kernels, masks


class RingComm:
    """Send to the next rank and receive from the previous one, asynchronously."""

    def __init__(self, group, tag: int = 0):
        self.group, self.tag = group, tag
        if group is None:   # one process (`ring_attention` without a group): no hop
            self.rank, self.size = 0, 1
            return
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._reqs, self._sends = [], []

    def send_recv(self, tensors):
        """Post the transfers and return the receive buffers; they are valid after `wait()`."""
        self._sends = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        recvs = [torch.empty_like(t) for t in self._sends]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, self.tag) for t in self._sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, self.tag) for t in recvs]
        self._reqs = dist.batch_isend_irecv(ops)
        return recvs

    def wait(self):
        for req in self._reqs:
            req.wait()
        self._reqs, self._sends = [], []


def _merge(out, lse, block_out, block_lse):
    """Fold a partial into the running result, in place: out [B, S, H, D], lse [B, H, S] (f32/f64).
    Rows that have seen no key yet (lse -inf on both sides) stay out 0, lse -inf: never NaN."""
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - ref).transpose(1, 2)[..., None])
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - ref).transpose(1, 2)[..., None])
    lse.copy_(new)


def _acc_dtype(q):  # partial results and gradients are summed in float32 (float64 for float64 inputs)
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _plan(group, n, docs, window, tile=None) -> list:
    """Per step, the kernel calls of its block (`masks.calls`): made once per attention call on the host and
    used by forward and backward. A rank's local rows are two runs of global indices: chunks r and 2P-1-r (no group:
    one process, its rows the whole sequence)."""
    if group is None and docs is not None and docs.branches is not None and len(docs.bounds) == 1 and \
            window is None:   # one process, one row: exact calls (several rows share calls: their tiles below)
        return [masks.exact_calls(docs.bounds[0], docs.branches[0])]
    r, p, c = (dist.get_rank(group), dist.get_world_size(group), n // 2) if group is not None else (0, 1, n)
    spans = (lambda x: [masks.Span(0, x * c, c), masks.Span(c, (2 * p - 1 - x) * c, c)]) if group is not None else \
        (lambda x: [masks.Span(0, 0, n)])
    bounds, branches = (docs.bounds, docs.branches) if docs is not None else (None, None)
    return [masks.calls(spans(r), spans((r - step) % p), bounds, window, tile, branches) for step in range(p)]


def _keep(call, docs, window, device):
    return masks.piece_keep(call, docs.ids if docs is not None else None, window, device,
                            docs.pre if docs is not None else None) if call[4] == "masked" else None


def _ring_forward(q, k, v, scale, group, plan, docs, window):
    comm, acc = RingComm(group), _acc_dtype(q)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    # Each hop is posted before the kernel of the current block runs, so the two overlap; every rank
    # makes the same hops whatever blocks its masks skip, so the ring never hangs.
    nxt = comm.send_recv([k, v]) if comm.size > 1 else None
    for step in range(comm.size):
        if step:
            comm.wait()
            k, v = nxt
            if step + 1 < comm.size:
                nxt = comm.send_recv([k, v])
        for call in plan[step]:
            qa, qe, ka, ke, kind = call[:5]
            _merge(out[:, qa:qe], lse[:, :, qa:qe], *kernels.forward(q[:, qa:qe], k[:, ka:ke], v[:, ka:ke],
                   kind == "causal", scale, mask=_keep(call, docs, window, q.device)))
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, group, plan, docs, window):
    kv_comm, grad_comm = RingComm(group, tag=0), RingComm(group, tag=1)
    dq, dk, dv = (torch.zeros(x.shape, dtype=_acc_dtype(q), device=x.device) for x in (q, k, v))
    nxt = kv_comm.send_recv([k, v]) if kv_comm.size > 1 else None
    for step in range(kv_comm.size):
        if step:  # dK/dV of the block we hold travel with it: send ours on, receive the next block's
            dkv = grad_comm.send_recv([dk, dv])
            kv_comm.wait()
            k, v = nxt
            if step + 1 < kv_comm.size:
                nxt = kv_comm.send_recv([k, v])
        # every call sees the GLOBAL out and lse of its rows; the K/V gradients of the block wait for the dK/dV that
        # travel with it: one call's as they are, several summed in float32 first
        span = grads = None
        for call in plan[step]:
            qa, qe, ka, ke, kind = call[:5]
            dq_b, dk_b, dv_b = kernels.backward(dout[:, qa:qe], q[:, qa:qe], k[:, ka:ke], v[:, ka:ke],
                                                out[:, qa:qe], lse[:, :, qa:qe], kind == "causal", scale,
                                                mask=_keep(call, docs, window, q.device))
            dq[:, qa:qe] += dq_b
            if len(plan[step]) == 1:
                span, grads = (ka, ke), (dk_b, dv_b)
                continue
            if span is None:
                span, grads = (0, k.shape[1]), (torch.zeros_like(dk), torch.zeros_like(dv))
            grads[0][:, ka:ke] += dk_b
            grads[1][:, ka:ke] += dv_b
        if step:
            grad_comm.wait()
            dk, dv = dkv
        if span is not None:
            dk[:, span[0]:span[1]] += grads[0]
            dv[:, span[0]:span[1]] += grads[1]
    if grad_comm.size > 1:  # one last hop brings every block's gradients home
        dkv = grad_comm.send_recv([dk, dv])
        grad_comm.wait()
        dk, dv = dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group, docs, window, tile, sinks=None):
        plan = _plan(group, q.shape[1], docs, window, tile)   # host arithmetic only; reused in backward
        out, lse = kernels.with_sinks(*_ring_forward(q, k, v, scale, group, plan, docs, window), sinks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, group, plan, docs, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_ring_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group,
                   docs: masks.Documents | None = None, window: int | None = None, tile: int | None = None,
                   sinks: torch.Tensor | None = None):
    """Causal attention over the zigzag-sharded sequence of `group`; see the module docstring. `group` None: one
    process's whole rows, the same calls planned from `docs` (what shared-prompt pairs' branches take)."""
    if q.shape[1] % 2 and group is not None:
        raise ValueError(f"zigzag ring attention needs an even local length, got {q.shape[1]}")
    whole = q.shape[1] * (dist.get_world_size(group) if group is not None else 1)
    if docs is not None and docs.ids.shape[1] != whole:
        raise ValueError(f"document ids cover {docs.ids.shape[1]} tokens, the ring holds {whole}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be a positive number of tokens")
    if window is not None and window >= whole:
        window = None  # covers the whole sequence: plain causal attention
    return _RingAttention.apply(q, k, v, scale, group, docs, window, tile, sinks)
