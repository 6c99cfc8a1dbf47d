"""The attention backends behind `parallel.kernels`: each a forward -> (out, lse) and a backward that
accepts a GLOBAL out/lse, over [B, S, H, D] tensors (see kernels.py for the contract, kernel_choice.py for the choice).

- "reference": float64 matmul + softmax (tests). "cpu": torch's CPU flash op. "sdpa_cuda": torch's flash op (fp16/
  bf16, GQA as is) or memory-efficient op (float32, a bias, heads over 256: Gemma 4's 512; `cuda_op`). "cudnn":
  torch's cuDNN attention op. "flash_attn": flash-attn 2 when installed. The ops that need it get
  expanded K/V, and the group's gradients are summed back in dk/dv.
- `bias`: an additive 0/-inf [B, H, Sq, Sk] mask, taken by "reference", "cpu" and "sdpa_cuda".
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_interface as _fa
except ImportError:  # pragma: no cover - depends on the install
    _fa = None


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _expand_kv(x, n_heads):
    """[B, S, Hkv, D] -> [B, S, H, D]; a view when Hkv == H, one copy otherwise."""
    b, s, hkv, d = x.shape
    g = n_heads // hkv
    return x if g == 1 else x[:, :, :, None].expand(b, s, hkv, g, d).reshape(b, s, n_heads, d)


def _sum_groups(dx, n_kv_heads):
    """[B, S, H, D] -> [B, S, Hkv, D]: gradients of a KV head summed over its query group."""
    b, s, h, d = dx.shape
    return dx if h == n_kv_heads else dx.view(b, s, n_kv_heads, h // n_kv_heads, d).sum(3)


def _t(x):
    return x.transpose(1, 2)  # [B, S, H, D] <-> [B, H, S, D], a view


# --- float64 reference -------------------------------------------------------------------------

def _ref_probs(q, k, causal, scale, lse=None, bias=None):
    qf, kf = _t(q).double(), _t(_expand_kv(k, q.shape[2])).double()
    s = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if bias is not None:
        s = s + bias.double()
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.double()[..., None]), lse


def _ref_forward(q, k, v, causal, scale, bias=None):
    p, lse = _ref_probs(q, k, causal, scale, bias=bias)
    out = p @ _t(_expand_kv(v, q.shape[2])).double()
    return _t(out).to(q.dtype), lse.to(_lse_dtype(q))


def _ref_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    p, _ = _ref_probs(q, k, causal, scale, lse, bias)
    do, o = _t(dout).double(), _t(out).double()
    kf, vf = (_t(_expand_kv(x, q.shape[2])).double() for x in (k, v))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vf.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ _t(q).double()) * scale
    hkv = k.shape[2]
    return (_t(dq).to(q.dtype), _sum_groups(_t(dk), hkv).to(k.dtype), _sum_groups(_t(dv), hkv).to(v.dtype))


# --- torch CPU flash op ------------------------------------------------------------------------

def _cpu_forward(q, k, v, causal, scale, bias=None):
    h = q.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), 0.0, causal, attn_mask=bias, scale=scale)
    return _t(out), lse.to(_lse_dtype(q))


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    h, hkv = q.shape[2], k.shape[2]
    # The op only reads lse (and out, for rowsum(dout·out)), so global ones from a ring work.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _t(dout), _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), _t(out),
        lse.to(_lse_dtype(q)).contiguous(), 0.0, causal, attn_mask=bias, scale=scale)
    return _t(dq), _sum_groups(_t(dk), hkv), _sum_groups(_t(dv), hkv)


# --- torch fused CUDA ops ----------------------------------------------------------------------

FLASH_HEAD_DIM = 256   # torch's flash op (and flash-attn 2) refuse larger heads


def cuda_op(dtype, head_dim: int, bias=None) -> str:
    """"sdpa_cuda"'s op: "flash" (fp16/bf16, no bias, head_dim <= 256: GQA as is), else "efficient" (float32, a bias, or
    Gemma 4's 512-wide heads: K/V expanded, [B, S, H, Hd] each; 256 MiB at 8k tokens of the 31B's 32 heads in bf16)."""
    half = dtype in (torch.float16, torch.bfloat16)
    return "flash" if bias is None and half and head_dim <= FLASH_HEAD_DIM else "efficient"


def _cuda_forward(q, k, v, causal, scale, bias=None):
    sq = q.shape[1]
    if cuda_op(q.dtype, q.shape[-1], bias) == "flash":  # the flash op takes GQA as is
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            _t(q), _t(k), _t(v), 0.0, causal, False, scale=scale)[:2]
    else:
        h = q.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), bias, True, 0.0, causal, scale=scale)[:2]
    return _t(out), lse[..., :sq].float()  # the efficient kernel pads lse to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    h, hkv, sq, sk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    lse = lse.float().contiguous()
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0: never read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    if cuda_op(q.dtype, q.shape[-1], bias) == "flash":
        # [B, H, S, D] views of [B, S, H, D] storage: the op turns them back into BSHD, which is
        # what the kernel wants, so no copy is made here (ring blocks are slices of one tensor).
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _t(dout), _t(q), _t(k), _t(v), _t(out), lse, None, None, sq, sk, 0.0, causal, seed, offset,
            scale=scale)
        return _t(dq), _t(dk), _t(dv)
    # [B, S, H, D]-contiguous, then viewed as [B, H, S, D]: the CUDA kernel reads `out` assuming that
    # layout (its row stride is not passed), so a [B, H, S, D]-contiguous copy gave wrong half-precision dq
    args = [_t(x.contiguous()) for x in (dout, q, _expand_kv(k, h), _expand_kv(v, h), out)]
    lse = F.pad(lse, (0, -sq % 32))  # the efficient kernel reads lse in tiles of 32 rows
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        *args[:4], bias, args[4], lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return _t(dq), _sum_groups(_t(dk), hkv), _sum_groups(_t(dv), hkv)


# --- cuDNN attention through torch (GQA native; out/lse may be global: torch's own ring CP does it)

def _cudnn_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _t(q), _t(k), _t(v), None, True, 0.0, causal, False, scale=scale)[:2]
    # out is allocated in q's memory layout (BSHD here); lse is [B, H, S, 1] (older torch: [B, H, S])
    return _t(out), (lse.squeeze(-1) if lse.dim() == 4 else lse).float()


def _like(ref, x):
    """x with ref's strides (a copy only when they differ on a dim longer than 1)."""
    same = all(a == b for n, a, b in zip(ref.shape, ref.stride(), x.stride()) if n > 1)
    return x if same else torch.empty_strided(ref.shape, ref.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # torch caches the cuDNN graph by q/k/v layout, so o and dO always get q's strides; lse is
    # always a fresh contiguous [B, H, S, 1] (ring passes slices of the global one).
    out, dout = _like(q, out), _like(q, dout)
    lse = lse.float().contiguous().unsqueeze(-1)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout seed/offset, dropout is 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _t(dout), _t(q), _t(k), _t(v), _t(out), lse, unused, unused, None, None, None,
        q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return _t(dq), _t(dk), _t(dv)


# --- causal backward of long rows in blocks (kernels.BACKWARD_BLOCK)

def blocked_backward(backward, dout, q, k, v, out, lse, scale, backend, n, spare=frozenset()):
    """Causal backward over n x n blocks of queries x keys (the diagonal causal, the rest whole): with the
    global out/lse each call gives its block's exact share, as in ring attention, and every kernel's own
    buffers (float32 dq accumulators, GQA-expanded dk/dv) are block-sized, not row-sized. dq per query block
    and dk, dv per key block are summed in float32 (float64 for float64). `backward`: kernels.backward.
    `spare`: which of "q", "k", "v", "out" may take results in their own storage (kernels' `spare_q`). Query
    block a's rows of q and out are read only by its own calls, k and v by every later query block:
    - dq goes into q's rows once query block a is done;
    - key block c's float32 dk/dv sums (first touched by query block c) go into out's rows of query block
      c - 1, done by then: a one-row batch, with room for 2·K' float32 heads in H of out's (4·K' <= H in bf16);
    - the final dk, dv go into k's, v's storage after the last query block.
    With all four nothing row-sized is allocated: key block 0's sums and one call's buffers.
    Credit: the blockwise backward with global statistics is ring attention's (Liu et al., 2023) on one device."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s, (b, _, kh, d) = q.shape[1], k.shape
    room = "out" in spare and b == 1 and 2 * kh * d * acc.itemsize <= out.shape[2] * out.shape[3] * out.element_size()
    dq = q.detach() if "q" in spare else torch.empty_like(q)   # detach: the same storage and version counter
    sums = []   # per key block: its float32 [2 (dk, dv), B, rows, K', d]
    for a in range(0, s, n):
        e, g = min(a + n, s), None
        shape = (2, b, e - a, kh, d)
        if room and a:   # out's rows of query block a - n, read for the last time
            free = out.detach()[0, a - n:a].reshape(-1).view(acc)
            sums.append(free[:2 * b * (e - a) * kh * d].view(shape).zero_())
        else:
            sums.append(torch.zeros(shape, dtype=acc, device=k.device))
        for i, c in enumerate(range(0, e, n)):
            f = min(c + n, e)
            gq, gk, gv = backward(dout[:, a:e], q[:, a:e], k[:, c:f], v[:, c:f], out[:, a:e], lse[:, :, a:e],
                                  c == a, scale, backend)
            g = gq.to(acc) if g is None else g.add_(gq)
            sums[i][0] += gk
            sums[i][1] += gv
        dq[:, a:e] = g
    dk, dv = ((x.detach() if name in spare else torch.empty_like(x)) for name, x in (("k", k), ("v", v)))
    for i, c in enumerate(range(0, s, n)):   # k's and v's rows are read by no call from here on
        dk[:, c:c + n], dv[:, c:c + n] = sums[i]
    return dq, dk, dv


# --- flash-attn 2 (signatures moved between releases: pass by name what the installed one takes)

def _fa_kwargs(fn, causal, scale):
    opts = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                return_softmax=False, deterministic=False, rng_state=None)
    try:
        names = set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    except (TypeError, ValueError):  # a compiled op without a Python signature: the 2.6+ layout
        names = {"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                 "softcap", "alibi_slopes", "return_softmax", "deterministic", "rng_state"}
    return {n: val for n, val in opts.items() if n in names}


def _fa_forward(q, k, v, causal, scale):
    fn = _fa._flash_attn_forward
    res = fn(q.contiguous(), k.contiguous(), v.contiguous(), **_fa_kwargs(fn, causal, scale))
    # 2.6+: (out, lse, S_dmask, rng_state); before: (out, q, k, v, out_padded, lse, S_dmask, rng)
    return res[0], res[1 if len(res) == 4 else 5]


def _fa_backward(dout, q, k, v, out, lse, causal, scale):
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn = _fa._flash_attn_backward
    fn(dout, q, k, v, out, lse.float().contiguous(), dq, dk, dv, **_fa_kwargs(fn, causal, scale))
    return dq, dk, dv


# --- torch's own flash-attention 2 kernel over packed documents (cu_seqlens): CUDA without flash-attn

# the ops by name, looked up per call (tests put a CPU emulation here to check the plumbing around them)
VARLEN_OPS = {"forward": lambda *a, **kw: torch.ops.aten._flash_attention_forward(*a, **kw),
              "backward": lambda *a, **kw: torch.ops.aten._flash_attention_backward(*a, **kw)}


def _varlen_window(window):
    # transformers' window w (keys i - w < j <= i) is flash's (left w - 1, right 0); no window: no kwargs,
    # so a torch without the window arguments still runs the plain case
    return {} if window is None else dict(window_size_left=window - 1, window_size_right=0)


class TorchVarlen(torch.autograd.Function):
    """Causal attention inside each document of packed rows in one launch: q [N, H, D], k/v [N, Hkv, D]
    (GQA native), `cu` int32 [docs + 1] offsets of the documents back to back, `longest` their longest."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest, scale, window):
        out, lse, seed, offset, _ = VARLEN_OPS["forward"](
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale, **_varlen_window(window))
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.args = (longest, scale, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        longest, scale, window = ctx.args
        dq, dk, dv = VARLEN_OPS["backward"](
            dout.contiguous(), q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, seed, offset,
            scale=scale, **_varlen_window(window))
        return dq, dk, dv, None, None, None, None


def varlen_mismatch(q, k, window, per_document):
    """None, or how TorchVarlen's ops differ from `per_document(q, k, v, dout, scale, window) -> (out, dq,
    dk, dv)` on two documents of q's dtype and head counts. Plain op calls, nothing saved for autograd."""
    g = torch.Generator(device=q.device).manual_seed(0)
    lens, h, hkv, d = (100, 156), q.shape[2], k.shape[2], q.shape[3]
    x = [torch.randn(1, sum(lens), n, d, generator=g, device=q.device, dtype=q.dtype) for n in (h, hkv, hkv, h)]
    scale, w, n = d ** -0.5, None if window is None else min(window, 64), max(lens)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=q.device)
    with torch.no_grad():
        out, lse, seed, offset, _ = VARLEN_OPS["forward"](
            *(t[0] for t in x[:3]), cu, cu, n, n, 0.0, True, False, scale=scale, **_varlen_window(w))
        got = [out, *VARLEN_OPS["backward"](
            x[3][0], *(t[0] for t in x[:3]), out, lse, cu, cu, n, n, 0.0, True, seed, offset, scale=scale,
            **_varlen_window(w))]
        parts = [per_document(*(t[:, a:e] for t in x), scale, w) for a, e in ((0, lens[0]), (lens[0], sum(lens)))]
    for name, a, pieces in zip(("out", "dq", "dk", "dv"), got, zip(*parts)):
        b = torch.cat([t[0] for t in pieces]).float()
        rel = ((a.float() - b).norm() / b.norm().clamp(min=1e-6)).item()
        if not rel < 2e-2:
            return f"{name} differs by {rel:.3g} (relative norm)"
    return None
