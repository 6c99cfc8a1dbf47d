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
- Backends: "cudnn" (torch's cuDNN attention op: Hopper/Blackwell, fp16/bf16, head_dim <= 128,
  native GQA; the fastest on an H200), "flash_attn" (flash-attn 2, CUDA, fp16/bf16, native GQA),
  "sdpa_cuda" (torch's flash op, native GQA; its memory-efficient op for float32, expanded K/V),
  "cpu" (torch's CPU flash op, expanded K/V, the group summed back in dk/dv) and "reference"
  (float64 matmul + softmax, for tests). The CUDA ops get [B, H, S, D] views of the [B, S, H, D]
  tensors and ring blocks are slices of them: no layout copies (float32 and CPU still expand K/V).
- Choice: `backend=` names one (no fallback, what the tests pin); otherwise `backend_order` ranks
  the backends that accept this device, dtype, head dim and shape, and a backend that raises at
  run time for a shape is skipped for that shape from then on (logged once, rank 0).
- `attention(q, k, v, causal, scale, docs=None)` is the differentiable wrapper. `docs` holds, per
  batch row, the document boundaries [0, s1, ..., S] of a packed row; tokens then attend only inside
  their own document (flash_attn_varlen when flash-attn is installed, `pick_backend(varlen=True)`;
  one kernel call per document elsewhere).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_interface as _fa
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    _fa = flash_attn_varlen_func = None

BACKENDS = ("cudnn", "flash_attn", "sdpa_cuda", "cpu", "reference")


def backend_order(device_type: str, dtype, head_dim: int, sq: int, sk: int, capability=(0, 0),
                  cudnn: bool = False, flash_attn: bool = False, varlen: bool = False) -> list[str]:
    """Backends that accept this case, fastest first (a pure function: the facts are arguments).

    cuDNN: sm90+ (on an H200 at 32k tokens, 28/4 heads, head_dim 128, bf16: fwd+bwd 49.5 ms against
    82.6 ms for torch's flash op), head_dim a multiple of 8 up to 128, and no length = 64 mod 128:
    there the SM90 backward leaves the zero-filled K/V tail tile unmasked, so rows with
    lse < -88.7 get NaN gradients (pytorch#196678, cudnn-frontend#628). flash-attn 2 next (also
    the one kernel here with a varlen entry, preferred first for packed rows), torch's op last."""
    if device_type == "cpu":
        return ["cpu"]
    if device_type != "cuda":
        return ["reference"]
    half = dtype in (torch.float16, torch.bfloat16)
    order = []
    if (cudnn and half and tuple(capability) >= (9, 0) and head_dim % 8 == 0 and head_dim <= 128
            and sq % 128 != 64 and sk % 128 != 64):
        order.append("cudnn")
    if flash_attn and half and head_dim % 8 == 0 and head_dim <= 256:
        order.insert(0 if varlen else len(order), "flash_attn")
    return order + ["sdpa_cuda"]


def _capability(device):
    return torch.cuda.get_device_capability(device)


def _cudnn_usable() -> bool:
    """The op exists in this torch, cuDNN 9+ is loaded and nobody switched cuDNN SDPA off."""
    return (hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
            and torch.backends.cuda.cudnn_sdp_enabled())


def candidates(q, k=None, varlen: bool = False) -> list[str]:
    k = q if k is None else k
    cuda = q.device.type == "cuda"
    return backend_order(q.device.type, q.dtype, q.shape[-1], q.shape[1], k.shape[1],
                         _capability(q.device) if cuda else (0, 0), cuda and _cudnn_usable(),
                         _fa is not None, varlen)


def pick_backend(q: torch.Tensor, k: torch.Tensor | None = None, varlen: bool = False) -> str:
    return candidates(q, k, varlen)[0]


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

def _ref_probs(q, k, causal, scale, lse=None):
    qf, kf = _t(q).double(), _t(_expand_kv(k, q.shape[2])).double()
    s = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.double()[..., None]), lse


def _ref_forward(q, k, v, causal, scale):
    p, lse = _ref_probs(q, k, causal, scale)
    out = p @ _t(_expand_kv(v, q.shape[2])).double()
    return _t(out).to(q.dtype), lse.to(_lse_dtype(q))


def _ref_backward(dout, q, k, v, out, lse, causal, scale):
    p, _ = _ref_probs(q, k, causal, scale, lse)
    do, o = _t(dout).double(), _t(out).double()
    kf, vf = (_t(_expand_kv(x, q.shape[2])).double() for x in (k, v))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vf.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ _t(q).double()) * scale
    hkv = k.shape[2]
    return (_t(dq).to(q.dtype), _sum_groups(_t(dk), hkv).to(k.dtype), _sum_groups(_t(dv), hkv).to(v.dtype))


# --- torch CPU flash op ------------------------------------------------------------------------

def _cpu_forward(q, k, v, causal, scale):
    h = q.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), 0.0, causal, scale=scale)
    return _t(out), lse.to(_lse_dtype(q))


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    h, hkv = q.shape[2], k.shape[2]
    # The op only reads lse (and out, for rowsum(dout·out)), so global ones from a ring work.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _t(dout), _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), _t(out),
        lse.to(_lse_dtype(q)).contiguous(), 0.0, causal, scale=scale)
    return _t(dq), _sum_groups(_t(dk), hkv), _sum_groups(_t(dv), hkv)


# --- torch fused CUDA ops ----------------------------------------------------------------------

def _cuda_forward(q, k, v, causal, scale):
    sq = q.shape[1]
    if q.dtype in (torch.float16, torch.bfloat16):  # the flash op takes GQA as is (FA2 kernel)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            _t(q), _t(k), _t(v), 0.0, causal, False, scale=scale)[:2]
    else:
        h = q.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            _t(q), _t(_expand_kv(k, h)), _t(_expand_kv(v, h)), None, True, 0.0, causal, scale=scale)[:2]
    return _t(out), lse[..., :sq].float()  # the efficient kernel pads lse to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    h, hkv, sq, sk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    lse = lse.float().contiguous()
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0: never read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    if q.dtype in (torch.float16, torch.bfloat16):
        # [B, H, S, D] views of [B, S, H, D] storage: the op turns them back into BSHD, which is
        # what the kernel wants, so no copy is made here (ring blocks are slices of one tensor).
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _t(dout), _t(q), _t(k), _t(v), _t(out), lse, None, None, sq, sk, 0.0, causal, seed, offset,
            scale=scale)
        return _t(dq), _t(dk), _t(dv)
    args = [_t(x).contiguous() for x in (dout, q, _expand_kv(k, h), _expand_kv(v, h), out)]
    lse = F.pad(lse, (0, -sq % 32))  # the efficient kernel reads lse in tiles of 32 rows
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        *args[:4], None, args[4], lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
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


_FORWARD = {"cudnn": _cudnn_forward, "flash_attn": _fa_forward, "sdpa_cuda": _cuda_forward,
            "cpu": _cpu_forward, "reference": _ref_forward}
_BACKWARD = {"cudnn": _cudnn_backward, "flash_attn": _fa_backward, "sdpa_cuda": _cuda_backward,
             "cpu": _cpu_backward, "reference": _ref_backward}
_refused: set = set()   # (phase, backend, case) that raised once: not tried again for that case
_logged: set = set()


def _log_once(key, msg):
    if key in _logged:
        return
    _logged.add(key)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_rank() != 0):
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _dispatch(phase, table, q, k, causal, args, backend):
    if backend is not None:
        return table[backend](*args)
    names = candidates(q, k)
    case = (q.device, q.dtype, tuple(q.shape), tuple(k.shape), causal)
    for i, name in enumerate(names):
        if (phase, name, case) in _refused and i + 1 < len(names):
            continue
        try:
            return table[name](*args)
        except torch.OutOfMemoryError:
            raise   # another kernel would not fit either; the fix is elsewhere
        except RuntimeError as e:   # a backend refusing a shape: try the next one
            if i + 1 == len(names):
                raise
            _refused.add((phase, name, case))
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            _log_once((phase, name), f"attention {phase}: backend {name!r} failed for q {tuple(q.shape)}, "
                      f"k {tuple(k.shape)}, {q.dtype} ({first}); using {names[i + 1]!r} for this shape")
    raise AssertionError("unreachable")


def forward(q, k, v, causal: bool, scale: float, backend: str | None = None):
    """(out [B, Sq, H, D], lse [B, H, Sq]); see the module docstring."""
    _check(q, k, causal)
    return _dispatch("forward", _FORWARD, q, k, causal, (q, k, v, causal, scale), backend)


def backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str | None = None):
    """(dq, dk, dv) given possibly GLOBAL out/lse; see the module docstring."""
    _check(q, k, causal)
    return _dispatch("backward", _BACKWARD, q, k, causal, (dout, q, k, v, out, lse, causal, scale), backend)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        out, lse = forward(q, k, v, causal, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward(dout, q, k, v, out, lse, *ctx.args), None, None, None)


def attention(q, k, v, causal: bool = True, scale: float | None = None, docs=None,
              backend: str | None = None) -> torch.Tensor:
    """Differentiable attention; `docs[b]` = boundaries [0, ..., S] of row b's documents."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if docs is None:
        return _Attention.apply(q, k, v, causal, scale, backend)
    if not causal:
        raise ValueError("document masking is only implemented for causal attention")
    b, s, h, d = q.shape
    if (backend or pick_backend(q, varlen=True)) == "flash_attn":
        # One varlen call over the flattened batch; cu_seqlens index rows back to back.
        cu = torch.tensor([i * s + x for i, row in enumerate(docs) for x in row[:-1]] + [b * s],
                          dtype=torch.int32, device=q.device)
        longest = max(y - x for row in docs for x, y in zip(row[:-1], row[1:]))
        out = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, -1, d),
                                     v.reshape(b * s, -1, d), cu, cu, longest, longest,
                                     softmax_scale=scale, causal=True)
        return out.view(b, s, h, d)
    rows = []
    for i, row in enumerate(docs):
        pieces = [_Attention.apply(q[i:i + 1, x:y], k[i:i + 1, x:y], v[i:i + 1, x:y], True, scale,
                                   backend) for x, y in zip(row[:-1], row[1:])]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)
