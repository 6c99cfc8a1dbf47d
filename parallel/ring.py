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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import kernels


class RingComm:
    """Send to the next rank and receive from the previous one, asynchronously."""

    def __init__(self, group, tag: int = 0):
        self.group, self.tag = group, tag
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
    """Fold a partial into the running result, in place: out [B, S, H, D] f32, lse [B, H, S] f32."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).transpose(1, 2)[..., None])
    out.add_(block_out.float() * torch.exp(block_lse - new).transpose(1, 2)[..., None])
    lse.copy_(new)


def _past(comm, step) -> bool:
    """Whether the K/V held at `step` (from rank r-step) lie wholly before both local chunks."""
    return (comm.rank - step) % comm.size < comm.rank


def _ring_forward(q, k, v, scale, group):
    comm, c = RingComm(group), q.shape[1] // 2
    # Each hop is posted before the kernel of the current block runs, so the two overlap.
    nxt = comm.send_recv([k, v]) if comm.size > 1 else None
    out, lse = kernels.forward(q, k, v, True, scale)  # step 0: the causal diagonal
    out, lse = out.float(), lse.float().contiguous()
    for step in range(1, comm.size):
        comm.wait()
        k, v = nxt
        if step + 1 < comm.size:
            nxt = comm.send_recv([k, v])
        if _past(comm, step):  # every query sees the first chunk of the block
            _merge(out, lse, *kernels.forward(q, k[:, :c], v[:, :c], False, scale))
        else:  # only the second local chunk sees the block, all of it
            _merge(out[:, c:], lse[:, :, c:], *kernels.forward(q[:, c:], k, v, False, scale))
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, group):
    kv_comm, grad_comm, c = RingComm(group, tag=0), RingComm(group, tag=1), q.shape[1] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    nxt = kv_comm.send_recv([k, v]) if kv_comm.size > 1 else None
    dq_b, dk_b, dv_b = kernels.backward(dout, q, k, v, out, lse, True, scale)
    dq += dq_b
    dk, dv = dk_b.float(), dv_b.float()
    for step in range(1, kv_comm.size):
        # dK/dV of the block we hold travel with it: send ours on, receive the block we get next.
        dkv = grad_comm.send_recv([dk, dv])
        kv_comm.wait()
        k, v = nxt
        if step + 1 < kv_comm.size:
            nxt = kv_comm.send_recv([k, v])
        if _past(kv_comm, step):
            dq_b, dk_b, dv_b = kernels.backward(dout, q, k[:, :c], v[:, :c], out, lse, False, scale)
            dq += dq_b
        else:
            dq_b, dk_b, dv_b = kernels.backward(dout[:, c:], q[:, c:], k, v, out[:, c:],
                                                lse[:, :, c:], False, scale)
            dq[:, c:] += dq_b
        grad_comm.wait()
        dk, dv = dkv
        n = dk_b.shape[1]
        dk[:, :n] += dk_b
        dv[:, :n] += dv_b
    if grad_comm.size > 1:  # one last hop brings every block's gradients home
        dkv = grad_comm.send_recv([dk, dv])
        grad_comm.wait()
        dk, dv = dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        out, lse = _ring_forward(q, k, v, scale, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_ring_backward(dout, q, k, v, out, lse, ctx.scale, ctx.group), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group) -> torch.Tensor:
    """Causal attention over the zigzag-sharded sequence of `group`; see the module docstring."""
    if q.shape[1] % 2:
        raise ValueError(f"zigzag ring attention needs an even local length, got {q.shape[1]}")
    return _RingAttention.apply(q, k, v, scale, group)
