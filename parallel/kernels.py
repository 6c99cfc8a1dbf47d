"""Attention kernels with log-sum-exp over `[batch, seq, heads, head_dim]` tensors.

Contract:
- `forward(q, k, v, causal, scale) -> (out, lse)`: `out` [B, Sq, H, D] in q's dtype, `lse` [B, H, Sq]
  with lse[b, h, i] = log Σ_j exp(scale · q_i·k_j) over the keys query i sees. `lse` is float32
  (float64 for float64 inputs, so the reference stays exact).
- `backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)` in the input dtypes. `out` and
  `lse` may be the GLOBAL ones of a larger attention of which (k, v) is one block; the result is
  then that block's share of the gradients (ring attention sums them).
- GQA: k and v may have Hkv heads with H % Hkv == 0; query head h reads KV head h // (H // Hkv);
  dk, dv come back with Hkv heads.
- `causal` means query i sees keys j <= i and needs Sq == Sk. Backends disagree for Sq != Sk
  (flash-attn aligns bottom-right, torch top-left), so that case raises instead of picking one.
- Backends, picked from the device and dtype unless `backend=` names one: "flash_attn" (flash-attn 2,
  CUDA, fp16/bf16, native GQA), "sdpa_cuda" (torch's fused CUDA ops), "cpu" (torch's CPU flash op)
  and "reference" (float64 matmul + softmax, for tests). The torch ops take expanded K/V for GQA
  and the group is summed back in dk/dv.
- Masks: `forward`/`backward(..., mask=keep)`, keep bool [B or 1, Sq, Sk] from `parallel.masks`
  (ANDed with `causal`), run as an additive 0/-inf bias (a broadcast [B, Sq, Sk] view) through
  torch's CPU flash op or CUDA efficient op ("flash_attn" has no bias input and uses the latter):
  one Sq·Sk bias per call on top of the kernel, so callers mask only the blocks that need it. A row
  with every key masked gets out 0, lse -inf and no gradient (never an empty softmax in a kernel).
- `attention(q, k, v, causal, scale, docs=None, window=None)` is the differentiable wrapper. `docs`
  holds, per row, the document boundaries [0, s1, ..., S] of a packed row: tokens attend only inside
  their document (flash_attn_varlen on CUDA, one call per document elsewhere). `window` w: query i
  sees keys i - w < j <= i (transformers' sliding window); native in flash-attn, elsewhere queries
  are tiled by max(w, 64) rows, each tile masked against its own keys only: O(S·w), not O(S²).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from parallel import masks

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_interface as _fa
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    _fa = flash_attn_varlen_func = None

BACKENDS = ("flash_attn", "sdpa_cuda", "cpu", "reference")


def pick_backend(q: torch.Tensor) -> str:
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if _fa is not None and half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
            return "flash_attn"
        return "sdpa_cuda"
    if q.device.type == "cpu":
        return "cpu"
    return "reference"


def _check(q, k, causal):
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs equal q/kv lengths, got {q.shape[1]} and {k.shape[1]}")


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

def _cuda_forward(q, k, v, causal, scale, bias=None):
    h, sq = q.shape[2], q.shape[1]
    args = (_t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)))
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(*args, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            *args, bias, True, 0.0, causal, scale=scale)
    out, lse = res[0], res[1]
    return _t(out), lse[..., :sq].float()  # the efficient kernel pads lse to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    h, hkv, sq, sk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    args = [_t(x).contiguous() for x in (dout, q, _expand_kv(k, h), _expand_kv(v, h), out)]
    lse = lse.float().contiguous()
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0: never read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *args, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale)
    else:
        lse = F.pad(lse, (0, -sq % 32))  # the efficient kernel reads lse in tiles of 32 rows
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            *args[:4], bias, args[4], lse, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
    return _t(dq), _sum_groups(_t(dk), hkv), _sum_groups(_t(dv), hkv)


# --- flash-attn 2 (signatures moved between releases: pass by name what the installed one takes)

def _params(fn):
    try:
        return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    except (TypeError, ValueError):
        return None


def _fa_kwargs(fn, causal, scale):
    opts = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                return_softmax=False, deterministic=False, rng_state=None)
    names = _params(fn)
    if names is None:  # a compiled op without a Python signature: the 2.6+ layout
        names = {"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                 "softcap", "alibi_slopes", "return_softmax", "deterministic", "rng_state"}
    return {n: val for n, val in opts.items() if n in names}


def _fa_forward(q, k, v, causal, scale):
    fn = _fa._flash_attn_forward
    res = fn(q.contiguous(), k.contiguous(), v.contiguous(), **_fa_kwargs(fn, causal, scale))
    # 2.6+: (out, lse, S_dmask, rng_state); before: (out, q, k, v, out_padded, lse, S_dmask, rng)
    out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
    return out, lse


def _fa_backward(dout, q, k, v, out, lse, causal, scale):
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn = _fa._flash_attn_backward
    fn(dout, q, k, v, out, lse.float().contiguous(), dq, dk, dv, **_fa_kwargs(fn, causal, scale))
    return dq, dk, dv


_FORWARD = {"flash_attn": _fa_forward, "sdpa_cuda": _cuda_forward, "cpu": _cpu_forward,
            "reference": _ref_forward}
_BACKWARD = {"flash_attn": _fa_backward, "sdpa_cuda": _cuda_backward, "cpu": _cpu_backward,
             "reference": _ref_backward}
_MASKABLE = ("sdpa_cuda", "cpu", "reference")  # backends whose kernels take an additive bias


def _masked(q, k, causal, backend, mask):  # -> backend, bias, rows [B, Sq] with no visible key
    name = backend or pick_backend(q)
    if mask is None:
        return name, None, None
    if name not in _MASKABLE:
        name = "sdpa_cuda" if q.device.type == "cuda" else "reference"
    return (name, *masks.kernel_bias(mask, q, k, causal))


def forward(q, k, v, causal: bool, scale: float, backend: str | None = None, mask=None):
    """(out [B, Sq, H, D], lse [B, H, Sq]); see the module docstring."""
    _check(q, k, causal)
    name, bias, dead = _masked(q, k, causal, backend, mask)
    if bias is None:
        return _FORWARD[name](q, k, v, causal, scale)
    out, lse = _FORWARD[name](q, k, v, False, scale, bias)
    return out.masked_fill(dead[:, :, None, None], 0), lse.masked_fill(dead[:, None], float("-inf"))


def backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str | None = None, mask=None):
    """(dq, dk, dv) given possibly GLOBAL out/lse; see the module docstring."""
    _check(q, k, causal)
    name, bias, dead = _masked(q, k, causal, backend, mask)
    if bias is None:
        return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)
    # Rows with no key here: dout 0 and lse +inf make their probabilities and gradients exactly 0.
    dout = dout.masked_fill(dead[:, :, None, None], 0)
    lse = lse.masked_fill(dead[:, None], float("inf"))
    return _BACKWARD[name](dout, q, k, v, out, lse, False, scale, bias)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, mask=None):
        out, lse = forward(q, k, v, causal, scale, backend, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend, mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward(dout, q, k, v, out, lse, *ctx.args), None, None, None, None)


def _banded(q, k, v, scale, window, backend):
    """Causal attention with a sliding window over rows that are each one document."""
    n = q.shape[1]
    if window is None or window >= n:
        return _Attention.apply(q, k, v, True, scale, backend)
    tile, outs = max(window, 64), []
    for a in range(0, n, tile):
        e, ks = min(a + tile, n), max(0, a - window + 1)
        keep = masks.keep(torch.arange(a, e, device=q.device), torch.arange(ks, e, device=q.device),
                          window=window)                                     # [1, tile, keys]
        outs.append(_Attention.apply(q[:, a:e], k[:, ks:e], v[:, ks:e], False, scale, backend, keep))
    return torch.cat(outs, 1)


def attention(q, k, v, causal: bool = True, scale: float | None = None, docs=None, window=None,
              backend: str | None = None) -> torch.Tensor:
    """Differentiable attention; `docs[b]`: row b's document boundaries; `window`: see the top."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if window is not None and (not causal or int(window) != window or window < 1):
        raise ValueError(f"sliding window {window!r} needs causal attention and a positive integer size")
    if docs is None and window is None:
        return _Attention.apply(q, k, v, causal, scale, backend)
    if not causal:
        raise ValueError("document masking is only implemented for causal attention")
    b, s, h, d = q.shape
    if (backend or pick_backend(q)) == "flash_attn":
        # One varlen call over the flattened batch; cu_seqlens index rows back to back.
        docs = docs or [[0, s]] * b
        cu = torch.tensor([i * s + x for i, row in enumerate(docs) for x in row[:-1]] + [b * s],
                          dtype=torch.int32, device=q.device)
        longest = max(y - x for row in docs for x, y in zip(row[:-1], row[1:]))
        out = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, -1, d),
                                     v.reshape(b * s, -1, d), cu, cu, longest, longest,
                                     softmax_scale=scale, causal=True,
                                     window_size=(-1, -1) if window is None else (window - 1, 0))
        return out.view(b, s, h, d)
    if docs is None:
        return _banded(q, k, v, scale, window, backend)
    rows = []
    for i, row in enumerate(docs):
        pieces = [_banded(q[i:i + 1, x:y], k[i:i + 1, x:y], v[i:i + 1, x:y], scale, window, backend)
                  for x, y in zip(row[:-1], row[1:])]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)
