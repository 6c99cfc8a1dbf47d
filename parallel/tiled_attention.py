"""Query-tiled attention sublayer (--tiled-attn): no [tokens, heads·head_dim] tensor but the attention output is kept.

Contract:
- `apply_tiled_attention(model, tile=None)` makes each block's attention sublayer (the input norm when handed its
  output tagged by parallel.memory.apply_norm_rebuild, q/k/v with their LoRA, q/k norms, RoPE, the attention,
  o_proj with its LoRA) run over tiles of query rows, one process (refused under CP: parallel.mesh.validate).
  Forward, per tile in order: the norm, q, k and v of the tile's tokens (k, v written into row-long buffers),
  the tile's attention against the keys up to its end, o_proj written into one [B, S, D] output. The causal
  attention of a tile is its diagonal block (causal) plus the earlier keys in key blocks of the tile's size
  (non-causal), merged by log-sum-exp; packed rows are split at document boundaries (a tile's piece of a
  document sees that document's keys only); a sliding window masks sub-tiles of masks.band_rows(window) queries against
  their own keys, as parallel.kernels does. Attention sinks (GPT-OSS) join each piece's final out, lse
  (`kernels.with_sinks`), which backward takes as the global ones. Every call goes through parallel.kernels (its
  backend choice).
  Saved: the sublayer's input (the norm's input), k and v after RoPE, the attention output and its lse: not
  q, no LoRA intermediate, no norm output (nor Qwen3.5's output gate: recomputed with q, before o_proj there, whose
  input it scales). Backward, per tile: o_proj recomputed from the saved output tile
  and differentiated (its input gradient is the kernel's incoming gradient), the kernels' backward with the
  global out/lse (dq for the tile; dk, dv summed over the row in float32), q's chain recomputed and
  differentiated into the input gradient; then per tile k/v's chain with its slice of dk, dv, added in.
  Parameter gradients are summed over tiles in float32 and returned through autograd, as the tiled MLP does.
- Tile (`tile=None`, `kernels.tile_rows`): an eighth of the row in multiples of 128, at least 256 and at most
  kernels.BACKWARD_BLOCK // 4 = 16,384 query rows (the key blocks too). Rows of several documents call the kernels
  with one shape per piece: on a GPU where cuDNN leads they take flash-attn or torch's flash op. At 16,384 a call's
  buffers are those of one blocked-backward call past 262,144 tokens and each call is still ~4 TFLOP of attention;
  the eighth keeps the tile's transients (its norm output, q, the kernel's incoming gradient, dq, a call's buffers)
  well under the row's on short rows.
- Peak of a block's backward (AC): the recompute keeps x, k, v, out, lse (eT·(D + H·hd + 2K·hd) + 4TH): q (eT·H·hd),
  the norm's rsqrt and the four projections' LoRA intermediates are not kept; the attention phase holds dh, dx and
  float32 dk, dv over the row plus one tile's tensors, instead of the kernel's incoming gradient and dh over the row
  beside the recompute's q and out (parallel/plan_block.py). Cost: the four projections' forward runs once more per
  step, in backward, the input norm once more (model.llama.Block hands the sublayer `memory.norm_stand_in`, not
  the norm's [T, D] output: forward and recompute run it in the tiles only; backward twice per tile); the kernels
  do not.
- With --offload-activations the next block's input is fetched once the query tiles' backward is done
  (HostOffload.after_attention's `release`) and k, v, out, lse are freed (under AC the checkpoint's unpack
  leaves the backward the only reference): the k/v phase then holds x, dh, dx, float32 dk/dv and that input.
- With LoRA dropout each tile's q, k/v and o_proj draws are replayed from the RNG states of forward. Per token the
  math is the untiled sublayer's; the attention's partial results and the parameter gradients are summed in another
  order.

Credit: tiling a sublayer over the sequence with per-tile recompute follows Arctic Long Sequence Training
(Bekman et al., 2025); the log-sum-exp merge of key blocks is ring attention's (Liu et al., 2023).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from model.gemma import gated
from model.gemma4_small import refuse_tiled_attn
from model.nf4 import dequant_once
from parallel import kernel_choice, kernels, masks
from parallel.memory import norm_stand_in
from parallel.recompute import grads_only_context
from parallel.ring import _merge


def _document_backend(x, head_dim: int) -> str | None:
    """Packed rows cut the tiles at documents: calls of many (queries, keys) shapes. cuDNN builds a graph per new
    shape (parallel/kernel_choice.py), so where it would lead those calls take flash-attn, else torch's flash op."""
    if not x.is_cuda:
        return None
    order = kernel_choice.backend_order("cuda", x.dtype, head_dim, 128, 128, kernel_choice._capability(x.device),
                                        kernel_choice._cudnn_usable(), kernel_choice._fa is not None)
    return ("flash_attn" if kernel_choice._fa is not None else "sdpa_cuda") if order[0] == "cudnn" else None


def _rng_state(device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _Spec:
    """What one sublayer call needs besides tensors: its module, the norm run per tile, tiles, documents."""

    def __init__(self, attn, pre, tile, docs, release):
        self.attn, self.pre, self.tile_arg, self.docs, self.release = attn, pre, tile, docs, release
        self.scale, self.window, self.backend = attn.scale, attn.window, None
        self.sinks = getattr(attn, "sinks", None)   # (GPT-OSS: merged into each piece's final out, lse)
        self.rng = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in attn.modules())

    def units(self, b, s):
        """(rows, a, e, (the rows' document bounds, their branches)): every row together unless rows differ in
        documents."""
        bounds, branches = (self.docs.bounds, self.docs.branches) if hasattr(self.docs, "branches") else \
            (self.docs, None)
        rows = [(slice(None), None, ())] if bounds is None else [
            (slice(i, i + 1), d, {x[0]: x[2:] for x in branches[i]} if branches else {}) for i, d in enumerate(bounds)]
        return [(r, a, min(a + self.tile, s), (d or [0, s], br)) for r, d, br in rows for a in range(0, s, self.tile)]


def _pieces(spec, a, e, doc):
    """(pa, pe, keys from, mask or None, prefix or None): the tile's queries [a, e) cut at documents, windows and key
    blocks; a branch's piece (shared-prompt pairs: model.attention) sees its parent's first p keys too, the prefix
    (from, to)."""
    bounds, branches = doc
    w = spec.window
    for ds, de in zip(bounds[:-1], bounds[1:]):
        pa, pe = max(a, ds), min(e, de)
        if pa >= pe:
            continue
        pre = (branches[ds][0], branches[ds][0] + branches[ds][1]) if ds in branches else None
        if w is not None and w < pe - ds:   # the window binds: sub-tiles masked against their own keys
            if pre is not None:   # (refused at start-up: parallel.mesh.validate)
                raise ValueError("a sliding window with shared-prompt pairs (branched documents) is not supported")
            for sa in range(pa, pe, masks.band_rows(w)):
                se, ks = min(sa + masks.band_rows(w), pe), max(ds, sa - w + 1)
                dev = spec.device
                yield sa, se, ks, masks.keep(torch.arange(sa, se, device=dev), torch.arange(ks, se, device=dev),
                                             window=w), None
        else:
            yield pa, pe, ds, None, pre


def _blocks(spec, pa, pe, ks, pre=None):
    """(key from, key to, causal): the diagonal block, then the earlier keys in blocks of the tile's size (a branch's
    prefix first)."""
    yield pa, pe, True
    for c in range(*pre, spec.tile) if pre else ():
        yield c, min(c + spec.tile, pre[1]), False
    for c in range(ks, pa, spec.tile):
        yield c, min(c + spec.tile, pa), False


def _attend(spec, q, k, v, a, bounds, out, lse):
    """q [R, n, H, hd] (queries a..a+n) against the row's k, v: writes out [R, n, H, hd], lse [R, H, n]."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    for pa, pe, ks, keep, pre in _pieces(spec, a, a + q.shape[1], bounds):
        qp = q[:, pa - a:pe - a]
        if keep is not None:
            o, lp = kernels.forward(qp, k[:, ks:pe], v[:, ks:pe], False, spec.scale, spec.backend, mask=keep)
            out[:, pa - a:pe - a], lse[:, :, pa - a:pe - a] = kernels.with_sinks(o, lp, spec.sinks)
            continue
        o = lp = None
        for c, f, causal in _blocks(spec, pa, pe, ks, pre):
            bo, bl = kernels.forward(qp, k[:, c:f], v[:, c:f], causal, spec.scale, spec.backend)
            if o is None:
                o, lp = bo.to(acc, copy=True), bl.to(acc, copy=True)
            else:
                _merge(o, lp, bo, bl)
        out[:, pa - a:pe - a], lse[:, :, pa - a:pe - a] = kernels.with_sinks(o, lp, spec.sinks)


def _attend_backward(spec, dout, q, k, v, out, lse, a, bounds, dk, dv):
    """dq [R, n, H, hd] (float32) of the tile's queries; adds the tile's share into dk, dv (row-long, float32)."""
    dq = torch.zeros(q.shape, dtype=dk.dtype, device=q.device)
    for pa, pe, ks, keep, pre in _pieces(spec, a, a + q.shape[1], bounds):
        i, j = pa - a, pe - a
        args = (dout[:, i:j], q[:, i:j])
        calls = [(ks, pe, False)] if keep is not None else _blocks(spec, pa, pe, ks, pre)
        for c, f, causal in calls:
            gq, gk, gv = kernels.backward(*args, k[:, c:f], v[:, c:f], out[:, i:j], lse[:, :, i:j], causal,
                                          spec.scale, spec.backend, mask=keep)
            dq[:, i:j] += gq
            dk[:, c:f] += gk
            dv[:, c:f] += gv
    return dq


def _queries(spec, xt, cos, sin, state):
    """q's chain (the norm, q_proj, q norm, RoPE; Qwen3.5's gate) recomputed from the tile's input xt with grad,
    replaying forward's dropout draws."""
    with torch.enable_grad():
        if spec.rng:
            _set_rng(state, xt.device)
        return spec.attn.queries(spec.pre(xt), cos, sin)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, x, cos, sin, *params):
        attn, (b, s, _) = spec.attn, x.shape
        spec.device, spec.tile = x.device, kernels.tile_rows(s, spec.tile_arg)
        if spec.docs is not None:
            spec.backend = _document_backend(x, attn.head_dim)
        h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        lse_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        k, v = (x.new_empty(b, s, kv, hd) for _ in range(2))
        out, lse, o = x.new_empty(b, s, h, hd), torch.empty(b, h, s, dtype=lse_dtype, device=x.device), None
        states = []
        with dequant_once():   # NF4 weights dequantized once for all tiles, not once a tile
            for r, a, e, bounds in spec.units(b, s):
                st = [_rng_state(x.device) if spec.rng else None]
                y = spec.pre(x[r, a:e])
                q, g = attn.queries(y, cos[r, a:e], sin[r, a:e])   # (g: Qwen3.5's output gate, else None)
                st.append(_rng_state(x.device) if spec.rng else None)
                k[r, a:e], v[r, a:e] = attn.keys_values(y, cos[r, a:e], sin[r, a:e])
                del y
                _attend(spec, q, k[r], v[r], a, bounds, out[r, a:e], lse[r, :, a:e])
                del q
                st.append(_rng_state(x.device) if spec.rng else None)
                ot = attn.o_proj(gated(out[r, a:e].flatten(2), g))
                del g
                if o is None:
                    o = ot.new_empty(b, s, ot.shape[-1])
                o[r, a:e] = ot
                states.append(st)
        ctx.spec, ctx.params, ctx.states = spec, params, states
        ctx.save_for_backward(x, cos, sin, k, v, out, lse)
        return o

    @staticmethod
    @once_differentiable   # (the recompute inside is differentiated once, here)
    def backward(ctx, do):
        x, cos, sin, k, v, out, lse = ctx.saved_tensors
        spec, params, attn = ctx.spec, list(ctx.params), ctx.spec.attn
        need_x = ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need_x else None
        acc = [None] * len(params)   # float32 sums over tiles: bf16 grads summed tile by tile would round
        dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (k, v))
        units = spec.units(*x.shape[:2])

        def grad(outputs, xt, grads):   # the input gradient (or None) and the parameters' sums
            pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]   # (a LoRA-free chain needs none)
            if not pairs:
                return None
            wrt = ([xt] if need_x else []) + params
            got = torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            for j, g in enumerate(got[need_x:]):
                if g is not None:
                    acc[j] = g.float() if acc[j] is None else acc[j].add_(g)
            return got[0] if need_x else None

        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else [], enabled=spec.rng), dequant_once():
            for (r, a, e, bounds), st in zip(units, ctx.states):   # o_proj, the kernels, q's chain
                xt = x[r, a:e].detach().requires_grad_(need_x)
                chain = (spec, xt, cos[r, a:e], sin[r, a:e], st[0])   # q's chain recomputed (_queries)
                q, gate = _queries(*chain) if attn.gate else (None, None)   # (a gate: first, o_proj's input needs it)
                gd = None if gate is None else gate.detach().requires_grad_()   # (its gradient goes to q's chain)
                ot_in = out[r, a:e].detach().flatten(2).requires_grad_()
                with torch.enable_grad(), grads_only_context():   # ot is only differentiated: no base GEMM
                    if spec.rng:
                        _set_rng(st[2], x.device)
                    ot = attn.o_proj(gated(ot_in, gd))
                dout = torch.autograd.grad(ot, [ot_in] + ([gd] if gd is not None else []) + params, do[r, a:e],
                                           allow_unused=True)
                dgate, dout = (dout[1], dout[:1] + dout[2:]) if gd is not None else (None, dout)
                for j, g in enumerate(dout[1:]):
                    if g is not None:
                        acc[j] = g.float() if acc[j] is None else acc[j].add_(g)
                dout = dout[0].view(out[r, a:e].shape)
                del ot, ot_in, gd
                if q is None:
                    q, gate = _queries(*chain)
                dq = _attend_backward(spec, dout, q.detach(), k[r], v[r], out[r, a:e], lse[r, :, a:e], a, bounds,
                                      dk[r], dv[r])
                del dout
                g = grad((q, gate) if gate is not None else (q,), xt,
                         (dq.to(q.dtype), dgate) if gate is not None else (dq.to(q.dtype),))
                if need_x:
                    dx[r, a:e] = g
                del q, dq, g, gate, dgate
            # k, v, out and lse are done with (k/v's chain is recomputed from x): under AC the checkpoint's unpack
            # left these names the only references, so they go before the next block's input comes back
            del k, v, out, lse
            if spec.release is not None:   # the query tiles' backward is done: the next block's input may come
                spec.release()
            for (r, a, e, _), st in zip(units, ctx.states):   # k/v's chain with its slice of dk, dv
                xt = x[r, a:e].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    if spec.rng:
                        _set_rng(st[1], x.device)
                    kt, vt = attn.keys_values(spec.pre(xt), cos[r, a:e], sin[r, a:e])
                g = grad((kt, vt), xt, (dk[r, a:e].to(kt.dtype), dv[r, a:e].to(vt.dtype)))
                if need_x:
                    dx[r, a:e] += g
        pgrads = [None if g is None else g.to(p.dtype) for g, p in zip(acc, params)]
        return (None, dx, None, None, *pgrads)


def _tiled(attn, tile: int | None):
    def run(y, cos, sin, core, meta):
        if meta is not None and not isinstance(meta, list) and getattr(meta, "branches", None) is None:
            raise ValueError("--tiled-attn runs the attention on one process (document bounds per row); this "
                             f"attention core hands it {type(meta).__name__}: drop --tiled-attn or use --cp 1")
        # the trainable parameters are inputs, read per call (FSDP2 swaps sharded and unsharded ones)
        params = [p for p in attn.parameters() if p.requires_grad]
        src = getattr(y, "_norm_output", None)   # (the norm that made y, its input): the tiles run the norm
        pre, x = (lambda t: t, y) if src is None else (src[0].forward, src[1])
        if src is not None:
            params += src[0].params
        spec = _Spec(attn, pre, tile, meta, getattr(core, "release", None))
        return _TiledAttention.apply(spec, x, cos, sin, *params)
    return run


def apply_tiled_attention(model, tile: int | None = None) -> None:
    """Tile every block's attention sublayer over query rows (module docstring); parameter names are unchanged."""
    refuse_tiled_attn(model.args)   # (Gemma 4 E2B / E4B's KV-shared layers)
    for block in (b for b in model.model.layers if hasattr(b, "self_attn")):   # (not Qwen3.5's linear blocks)
        block.self_attn.forward = _tiled(block.self_attn, tile)
        block.self_attn.takes_norm = norm_stand_in   # model.llama.Block hands it this, not the norm's output
