"""The token-mixing core of Qwen3.5's Gated DeltaNet layers (model/deltanet.py's contract names its interface): the
causal depthwise conv + silu per document, the l2 norm of q and k, and the gated delta rule, run in segments.

Contract:
- `local_linear_core(q, k, v, g, beta, conv_w, meta)`: model/deltanet.py's `core` on one process, the whole sequence
  (a context-parallel core hands it a head range: parallel/cp_linear.py); `Docs` the packed rows' documents
  (model.deltanet.prepare_linear's meta); `causal_conv`, `gated_delta_rule`, `l2norm` its pieces, whole-row calls.
- The rule is computed in float32 (as transformers does) in chunks of CHUNK tokens: a Python loop over chunks, none
  over tokens, no [S, S] tensor; autograd differentiates it. Document starts inside a chunk are exact: the
  decay is summed per document inside each chunk (no "very negative log decay" stand-in), pairs across documents are
  masked out, and the state entering a chunk reaches only the tokens before the chunk's first document start.
- With `fla` (flash-linear-attention) importable and CUDA tensors, its `chunk_gated_delta_rule` (cu_seqlens for the
  documents) replaces the torch rule. UNTESTED here (fla is not installed): set FLA = False to rule it out.
- Memory of the torch core: it runs in segments of SEGMENT chunks (`_Segmented`); autograd keeps its inputs and one
  float32 state [B, Hv, dk, dv] per segment after the first, and backward recomputes one segment at a time (one more
  forward of the core), not the conv's output, the l2 norm's float32 copies and the rule's float32 blocks of the whole
  sequence (~300 KB a token at Qwen3.5-9B's sizes; parallel/plan_linear.py). Outputs and gradients = one pass of plain
  autograd within float32 rounding (bitwise within one segment). Nested in a block checkpoint (parallel/ac.py) it is
  an op like any other. torch.compile would unroll the chunk loop and the segments:
  `local_linear_core` is torch.compiler.disable'd (at its first use, not import: `__getattr__`), and
  parallel/compile.py compiles only elementwise modules (a linear block's norms and SwiGLU), never a core.

Notation: model/deltanet.py's. Algorithm: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (2024), chunkwise form
with the WY / UT transform.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64
# chunks a segment of the core (1,024 tokens). At Qwen3.5-9B's sizes a segment's recompute holds ~400 KB a token and
# each segment keeps a 2 MB state: their sum is least near 13 chunks at 128k tokens (6 at 32k), flat around it and
# under 1% of the layer's peak either way; 16 keeps a segment's batched pre-loop ops (16·Hv chunks) GPU-sized
SEGMENT = 16
FLA = True   # use fla's kernel when importable and on CUDA (untested here)
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_rule
except ImportError:
    _fla_rule = None


class Docs(NamedTuple):
    """Packed rows' documents, for the linear layers (model/deltanet.py's docstring)."""
    starts: torch.Tensor   # bool [B, S]: a document starts here
    seg: torch.Tensor      # int64 [B, S]: the token's document number in its row, 1-based
    most: int              # the most documents in one row


def causal_conv(x: torch.Tensor, w: torch.Tensor, meta: Docs | None) -> torch.Tensor:
    """silu(causal depthwise conv) of x [B, S, C] with w [C, K], per document: [B, S, C] in x's dtype.
    Packed rows are spread out with K-1 zeros before each document, so one conv1d sees each document alone."""
    B, S, C = x.shape
    K = w.shape[1]
    conv = lambda t: F.conv1d(t.transpose(1, 2).to(w.dtype), w[:, None], padding=K - 1, groups=C)  # [B, C, S' + K-1]
    if meta is None:
        return F.silu(conv(x)[..., :S]).transpose(1, 2).to(x.dtype)
    W = S + (K - 1) * meta.most   # a row's spread-out length
    at = (torch.arange(B, device=x.device)[:, None] * W + torch.arange(S, device=x.device)
          + (K - 1) * meta.seg).flatten()   # token t of row b sits at b·W + t + (K-1)·(its document number)
    spread = x.new_zeros(B * W, C).index_copy(0, at, x.reshape(B * S, C)).view(B, W, C)
    y = conv(spread)[..., :W].transpose(1, 2).reshape(B * W, C)   # (a copy: the index_select below wants rows)
    return F.silu(y.index_select(0, at)).view(B, S, C).to(x.dtype)


def gated_delta_rule(q, k, v, g, beta, meta: Docs | None, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over chunks, states restarting at documents: q, k [B, S, H, dk] (l2-normed, q scaled),
    v [B, S, H, dv], g, beta [B, S, H] -> [B, S, H, dv] float32 (float64 for float64 inputs: references).
    Per token, with a state M [dk, dv] (zero at a document start): M = exp(g)·M; M += k·(beta·(v - kᵀM))ᵀ; out = qᵀM."""
    seg = torch.ones(k.shape[:2], dtype=torch.long, device=q.device) if meta is None else meta.seg
    return _rule(q, k, v, g, beta, torch.cat([seg[:, :1] - 1, seg], 1), _zero_state(q, v), chunk)[0]


def _rule(q, k, v, g, beta, seg, M, chunk: int = CHUNK):
    """`gated_delta_rule` on a stretch of a row entered with the state M [B, H, dk, dv] (float32): seg [B, 1 + S], the
    tokens' document numbers after that of the token before the stretch (M reaches the tokens that continue it).
    -> (out [B, S, H, dv] float32, the state after the stretch)."""
    B, S, H, dk = k.shape
    dv = v.shape[-1]
    pad = -S % chunk
    N = (S + pad) // chunk
    f = torch.promote_types(q.dtype, torch.float32)
    # [B, H, N, chunk, d]; the padded tail has beta = g = 0: it neither writes nor decays the state. Contiguous: at
    # S a multiple of chunk F.pad is a strided view, and the matmuls below copied q, kᵀ (twice) and k·beta, keeping
    # 4 more [B, S, H, dk] float32 copies for backward than at any other S
    q, k, v = (F.pad(t.to(f).transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, chunk, -1).contiguous()
               for t in (q, k, v))
    g, beta = (F.pad(t.to(f).transpose(1, 2), (0, pad)).reshape(B, H, N, chunk) for t in (g, beta))
    before, seg = seg[:, :1], seg[:, 1:]
    seg = torch.cat([seg, seg[:, -1:].expand(B, pad)], 1).view(B, 1, N, chunk)   # padding continues the last document
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & tril                      # [B, 1, N, c, c]: j <= i, one document
    # the state entering a chunk reaches token i iff no document starts in the chunk up to i
    prev = torch.cat([before.view(B, 1, 1, 1), seg[..., :-1, -1:]], 2)          # the previous chunk's last document
    carry = seg == prev                                                         # [B, 1, N, c]
    last = same[..., -1, :]                                                     # tokens of the chunk's last document
    # log decay summed per document within the chunk: differences only ever within one document (no very negative
    # log decay at a start standing in for the reset, whose size would swamp the float32 sums after it)
    gam = (g[..., None, :] * same).sum(-1)                                      # [B, H, N, c]
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~same, float("-inf")).exp()   # [B, H, N, c, c]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # WY form: (I + L) u = beta·v, (I + L) w = beta·k·exp(gam) with L the strictly lower beta·k_i·k_j·decay
    L = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    into = torch.where(carry, gam, float("-inf")).exp()[..., None]              # decay from the chunk start
    u = torch.linalg.solve_triangular(L, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(L, kb * into, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                                    # within the chunk, diagonal included
    qd = q * into
    kd = k * (gam[..., -1:] - gam).masked_fill(~last, float("-inf")).exp()[..., None]   # decay to the chunk end
    keep = into[..., -1, :, None]                                              # [B, H, N, 1, 1]: the state survives
    out = []
    for n in range(N):
        fresh = u[:, :, n] - w[:, :, n] @ M                                     # what the state does not yet predict
        out.append(qd[:, :, n] @ M + attn[:, :, n] @ fresh)
        M = M * keep[:, :, n] + kd[:, :, n].transpose(-1, -2) @ fresh
    return torch.stack(out, 2).reshape(B, H, N * chunk, dv)[:, :, :S].transpose(1, 2), M


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _local_linear_core(q, k, v, g, beta, conv_w, meta, segment: int | None = None):
    """conv + silu, l2 norm, gated delta rule on the whole sequence (model/deltanet.py's `core`): [B, S, Hv, dv] in
    v's dtype. The torch rule runs in segments of `segment` chunks (SEGMENT by default; _Segmented): the same
    numbers."""
    B, S, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    w = torch.cat([c.flatten(0, 1) for c in conv_w])                            # [C, K]
    if FLA and _fla_rule is not None and q.is_cuda:   # untested here: fla is not installed
        x = causal_conv(torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), w, meta)
        q, k, v = _heads(x, Hk, dk, Hv, dv)
        cu = None
        if meta is not None:   # fla takes packed documents as one row with cu_seqlens
            ends = torch.tensor([B * S], device=q.device)
            cu = torch.cat([meta.starts.flatten().nonzero().flatten(), ends])
            q, k, v, g, beta = (t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g, beta))
        out, _ = _fla_rule(q, k, v, g=g, beta=beta, scale=dk ** -0.5, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return out.reshape(B, S, Hv, dv).to(v.dtype)
    span = (segment or SEGMENT) * CHUNK
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, w)):
        return _Segmented.apply(q, k, v, g, beta, w, meta, span)
    return _segments(q, k, v, g, beta, w, meta, span)[0]   # no grad: the same loop, one segment's temporaries


def __getattr__(name: str):
    """`local_linear_core`: `_local_linear_core` under torch.compiler.disable, made at the name's first use and kept.
    Never traced by torch.compile, which would unroll the chunk loop: parallel/compile.py compiles elementwise modules
    only, and this keeps any wider compile (a whole block's) from taking the core in (a graph break there instead).
    Not at import: the decorator imports torch._dynamo, ~0.9 s of every process that imports model/ (half of
    `import train`), though only a process that runs the core can need it. Callers look it up on this module at call
    time (a compile tracing that lookup runs this too, and sees the same disabled function)."""
    if name != "local_linear_core":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    fn = torch.compiler.disable(_local_linear_core)
    fn.__name__ = fn.__qualname__ = name   # pickled by name (an argument to spawned ranks): found as itself
    return globals().setdefault(name, fn)


def _heads(x, Hk: int, dk: int, Hv: int, dv: int):
    """The conv's output [B, S, C] -> q, k [B, S, Hv, dk], v [B, S, Hv, dv]."""
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(x.split([Hk * dk, Hk * dk, Hv * dv], -1), (dk, dk, dv)))
    if Hv != Hk:   # value head j reads key head j // (Hv / Hk)
        q, k = (t.repeat_interleave(Hv // Hk, 2) for t in (q, k))
    return q, k, v


def _stretch(q, k, v, g, beta, w, docs, seg, M):
    """The core on one stretch of a row entered with the state M: q, k, v [B, s + S, H, d] with the s = K - 1 tokens
    before the stretch (the conv's reach; none at the row's start), g, beta [B, S, Hv], w [C, K], docs the Docs of those
    s + S tokens (None: one document), seg as `_rule`'s -> (out [B, S, Hv, dv] float32, the state after)."""
    Hk, dk, (Hv, dv) = q.shape[2], q.shape[3], v.shape[2:]
    x = causal_conv(torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), w, docs)[:, -g.shape[1]:]
    q, k, v = _heads(x, Hk, dk, Hv, dv)
    f = torch.promote_types(q.dtype, torch.float32)
    return _rule(l2norm(q.to(f)) * dk ** -0.5, l2norm(k.to(f)), v, g, beta, seg, M)


def _windows(B: int, S: int, K: int, meta: Docs | None, span: int, device):
    """Per segment [lo, hi) of `span` tokens: (lo, hi, a = its conv window's first token, the window's Docs, `_rule`'s
    seg). The windows' document counts (their conv's spread-out lengths) come to the host in one transfer."""
    edges = [(lo, min(lo + span, S), max(lo - K + 1, 0)) for lo in range(0, S, span)]
    seg = torch.ones(B, S, dtype=torch.long, device=device) if meta is None else meta.seg
    before = torch.cat([seg[:, :1] - 1, seg], 1)                   # column j + 1: token j's document; column 0: none
    if meta is None:
        return [(lo, hi, a, None, before[:, lo:hi + 1]) for lo, hi, a in edges]
    first, last = (torch.tensor(i, device=device) for i in zip(*[(a, hi - 1) for _, hi, a in edges]))
    most = (seg[:, last] - seg[:, first] + 1).amax(0).tolist()
    return [(lo, hi, a, Docs(meta.starts[:, a:hi], seg[:, a:hi] - seg[:, a:a + 1] + 1, m), before[:, lo:hi + 1])
            for (lo, hi, a), m in zip(edges, most)]


def _zero_state(q, v):   # [B, Hv, dk, dv] in the rule's dtype
    f = torch.promote_types(q.dtype, torch.float32)
    return q.new_zeros(v.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=f)


def _segments(q, k, v, g, beta, w, meta, span):
    """The core over segments, no graph: (out [B, S, Hv, dv] in v's dtype, the states entering segments 1, 2, ...)."""
    out, states, M = torch.empty_like(v, memory_format=torch.contiguous_format), [], _zero_state(q, v)
    for i, (lo, hi, a, docs, seg) in enumerate(_windows(*v.shape[:2], w.shape[1], meta, span, v.device)):
        if i:
            states.append(M)
        o, M = _stretch(q[:, a:hi], k[:, a:hi], v[:, a:hi], g[:, lo:hi], beta[:, lo:hi], w, docs, seg, M)
        out[:, lo:hi] = o
    return out, states


class _Segmented(torch.autograd.Function):
    """The core in segments of `span` tokens (a multiple of the chunk: the chunks of one pass, the same numbers),
    recomputed one at a time in backward as a non-reentrant checkpoint per segment would, into one gradient buffer per
    input (no slice-and-add of whole-sequence gradients per segment). Autograd keeps the core's inputs and a float32
    state [B, Hv, dk, dv] per segment after the first, not the rule's float32 blocks (~200 KB a token at Qwen3.5-9B's 32
    value heads of 128), the conv's output or the l2 norm's copies; backward holds one segment's worth at a time. The
    gradients are autograd's (torch.autograd.grad through each recomputed segment, the state's gradient carried to the
    one before): no formula derived here. All it keeps goes through save_for_backward, so a block checkpoint around it
    (parallel/ac.py) drops it in forward and recomputes it as any op's. Cost: one more forward of the core."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, w, meta, span):
        out, states = _segments(q, k, v, g, beta, w, meta, span)
        ctx.save_for_backward(q, k, v, g, beta, w, *states)
        ctx.meta, ctx.span = meta, span
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, g, beta, w, *states = ctx.saved_tensors
        need = ctx.needs_input_grad[:6]
        grads = [torch.zeros_like(t) if n else None for t, n in zip((q, k, v, g, beta, w), need)]
        dM = None
        for i, (lo, hi, a, docs, seg) in reversed(list(enumerate(
                _windows(*v.shape[:2], w.shape[1], ctx.meta, ctx.span, v.device)))):
            at = [(slice(None), slice(a, hi))] * 3 + [(slice(None), slice(lo, hi))] * 2 + [()]   # q, k, v with the
            # conv's reach (their gradients there add to the segment before's), g, beta, the whole conv weight
            parts = [t[s].detach().requires_grad_(n) for t, s, n in zip((q, k, v, g, beta, w), at, need)]
            M = states[i - 1].detach().requires_grad_() if i else _zero_state(q, v)
            with torch.enable_grad():
                o, after = _stretch(*parts, docs, seg, M)
            outs, douts = [o], [dout[:, lo:hi].to(o.dtype)]   # (the cast: .to's backward)
            if dM is not None:
                outs, douts = [o, after], [douts[0], dM]
            wrt = [t for t in parts + [M] if t.requires_grad]
            got = dict(zip(map(id, wrt), torch.autograd.grad(outs, wrt, douts, allow_unused=True)))
            for grad, t, s in zip(grads, parts, at):
                if grad is not None and got[id(t)] is not None:
                    grad[s] += got[id(t)]
            dM = got.get(id(M))
        return (*grads, None, None)
