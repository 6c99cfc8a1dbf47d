"""Attention kernels with log-sum-exp over `[batch, seq, heads, head_dim]` tensors.

Contract:
- `forward(q, k, v, causal, scale) -> (out, lse)`: `out` [B, Sq, H, D] in q's dtype, `lse` [B, H, Sq]
  with lse[b, h, i] = log Σ_j exp(scale · q_i·k_j) over the keys query i sees. `lse` is float32
  (float64 for float64 inputs, so the reference stays exact).
- `backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)` in the input dtypes. `out` and
  `lse` may be the GLOBAL ones of a larger attention of which (k, v) is one block; the result is
  then that block's share of the gradients (ring attention sums them).
- GQA: k and v may have Hkv heads, H % Hkv == 0; query head h reads KV head h // (H // Hkv); dk, dv have Hkv.
- `causal` means query i sees keys j <= i and needs Sq == Sk. Backends disagree for Sq != Sk
  (flash-attn aligns bottom-right, torch top-left), so that case raises instead of picking one.
- Backends: "cudnn" (torch's cuDNN attention op: Hopper/Blackwell, fp16/bf16, head_dim <= 128,
  native GQA; the fastest on an H200), "flash_attn" (flash-attn 2, CUDA, fp16/bf16, native GQA),
  "sdpa_cuda" (torch's flash op, native GQA; its memory-efficient op for float32, masks and heads over 256,
  expanded K/V: `backends.cuda_op`), "cpu" (torch's CPU flash op, expanded K/V, the group summed back in dk/dv)
  and "reference" (float64 matmul + softmax, for tests). The CUDA ops get [B, H, S, D] views of the [B, S, H, D]
  tensors and ring blocks are slices of them: no layout copies (float32 and CPU still expand K/V).
- Choice (`parallel.kernel_choice`): `backend=` names one (no fallback); otherwise the fastest backend that
  accepts the case, and the next for a shape where one raises at run time.
- Masks: `forward`/`backward(..., mask=keep)`, keep bool [B or 1, Sq, Sk] from `parallel.masks` (ANDed
  with `causal`), an additive 0/-inf bias through torch's CPU flash op or CUDA efficient op (the others
  take no bias): one Sq·Sk bias per call, so callers mask only the blocks that need it. A row with every
  key masked gets out 0, lse -inf and no gradient (never an empty softmax in a kernel).
- `attention(q, k, v, causal, scale, docs=None, window=None)` is the differentiable wrapper. `docs`
  holds, per row, the document boundaries [0, s1, ..., S] of a packed row: tokens attend only inside
  their document: flash_attn_varlen when flash-attn is installed; else on CUDA (fp16/bf16) torch's own
  flash varlen op (one launch, GQA native; cuDNN per document would build a graph per new length),
  once it has passed a one-time check against per-document calls; one call per document elsewhere.
  `window` w: query i sees keys i - w < j <= i (transformers' sliding window); native in flash-attn,
  elsewhere queries are tiled by `masks.band_rows(w)` rows (w, at least 64; fewer where a tile's bias would
  pass masks.BAND_ELEMS), each tile masked against its own keys only: O(S·w). A masked CUDA call of 2^31 or
  more query-key pairs raises: torch's efficient kernel indexes its bias in 32 bits (pytorch#187227, #147585).
  GQA/MQA rows longer than BACKWARD_BLOCK run the causal backward in `backward_block(row)`-token blocks
  (`backends.blocked_backward`; not with as many KV heads as query heads: float32 dk/dv over the row would cost
  more than it saves). `spare_q` (the decoder's cores: q, k, v its own, out read by o_proj only) lets it put dq,
  dk, dv and float32 sums in q's, k's, v's, out's storage where `recompute.spare_storages` allows: none row-sized.
- Attention sinks (GPT-OSS: `sinks` [H], one learned logit per head in every row's softmax denominator, with value
  0): `with_sinks(out, lse, sinks)` merges the sink into a row's FINAL (out, lse) as one more block of output 0 and
  lse s: out·sigmoid(lse - s), logaddexp(lse, s). The backward of the whole is the kernels' backward given that
  (out', lse'): it rebuilds the probabilities from lse' (the sink's share in it) and D = rowsum(dout·out') sums over
  the sink column too, whose dP is dout·0 = 0; only the sink's own gradient is left out, so the sinks are frozen
  (one that requires grad is refused). `attention(..., sinks=)`, `ring.ring_attention` and the tiled sublayer apply
  it where each query's row is complete (a call here: a whole row, a window tile or a document; the ring after its
  last merge) and save (out', lse') for backward; the varlen launches (which keep their own lse) are not taken.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from parallel import backends, masks, recompute
from parallel.kernel_choice import _dispatch, _log_once, pick_backend

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None


def _check(q, k, causal):
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs equal q/kv lengths, got {q.shape[1]} and {k.shape[1]}")


_FORWARD = {"cudnn": backends._cudnn_forward, "flash_attn": backends._fa_forward,
            "sdpa_cuda": backends._cuda_forward, "cpu": backends._cpu_forward, "reference": backends._ref_forward}
_BACKWARD = {"cudnn": backends._cudnn_backward, "flash_attn": backends._fa_backward,
             "sdpa_cuda": backends._cuda_backward, "cpu": backends._cpu_backward,
             "reference": backends._ref_backward}
_MASKABLE = ("sdpa_cuda", "cpu", "reference")  # backends whose kernels take an additive bias


MASKED_LIMIT = 1 << 31   # a masked CUDA call's Sq·Sk: torch's efficient kernel indexes its bias in 32 bits


def _masked(q, k, causal, backend, mask):  # -> backend, bias, rows [B, Sq] with no visible key
    name = backend or pick_backend(q)
    if name not in _MASKABLE:
        name = "sdpa_cuda" if q.device.type == "cuda" else "reference"
    if name == "sdpa_cuda" and q.shape[1] * (-(-k.shape[1] // 16) * 16) >= MASKED_LIMIT:   # (bias rows padded to 16)
        raise ValueError(f"a masked attention call of {q.shape[1]} x {k.shape[1]} queries x keys: torch's CUDA "
                         "efficient kernel indexes such a bias in 32 bits (forward: wrong rows, pytorch#187227; "
                         "backward: pytorch#147585); cut the call into pieces (parallel.masks.calls, band_rows) as "
                         "the callers here do")
    return (name, *masks.kernel_bias(mask, q, k, causal))


def forward(q, k, v, causal: bool, scale: float, backend: str | None = None, mask=None):
    """(out [B, Sq, H, D], lse [B, H, Sq]); see the module docstring."""
    _check(q, k, causal)
    if mask is None:
        return _dispatch("forward", _FORWARD, q, k, causal, (q, k, v, causal, scale), backend)
    name, bias, dead = _masked(q, k, causal, backend, mask)
    out, lse = _FORWARD[name](q, k, v, False, scale, bias)
    return out.masked_fill(dead[:, :, None, None], 0), lse.masked_fill(dead[:, None], float("-inf"))


def backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str | None = None, mask=None):
    """(dq, dk, dv) given possibly GLOBAL out/lse; see the module docstring."""
    _check(q, k, causal)
    if mask is None:
        return _dispatch("backward", _BACKWARD, q, k, causal, (dout, q, k, v, out, lse, causal, scale), backend)
    name, bias, dead = _masked(q, k, causal, backend, mask)
    # Rows with no key here: dout 0 and lse +inf make their probabilities and gradients exactly 0.
    dout = dout.masked_fill(dead[:, :, None, None], 0)
    lse = lse.masked_fill(dead[:, None], float("inf"))
    return _BACKWARD[name](dout, q, k, v, out, lse, False, scale, bias)


BACKWARD_BLOCK = 65536   # causal GQA/MQA rows longer than this run their backward in blocks of this many tokens


def backward_block(row: int) -> int:
    """A `row`-token row's backward block: BACKWARD_BLOCK, a quarter past four of them (262,144 tokens): a call's
    buffers scale with it (1/8 of the row's gradients at 512k, 1/32 in 16k blocks: ~8-10 TFLOP per full call)."""
    return BACKWARD_BLOCK if row <= 4 * BACKWARD_BLOCK else max(1, BACKWARD_BLOCK // 4)


def tile_rows(s: int, tile: int | None = None) -> int:
    """--tiled-attn's query rows per tile of an s-token row: `tile` if given, else an eighth of the row rounded up
    to a multiple of 128 (at least 256) up to BACKWARD_BLOCK // 4 (parallel/tiled_attention.py's docstring): short
    rows get several tiles too, so no tile's transients approach the row's, and no tile is 64 mod 128 long (cuDNN
    refuses those). Here, not there, so that the planner imports no peft."""
    return max(1, tile or min(BACKWARD_BLOCK // 4, max(256, -(-s // 1024) * 128)))


def with_sinks(out, lse, sinks):
    """(out', lse') of rows whose attention over the real keys is (out [B, S, H, D], lse [B, H, S]), with the sinks
    [H] merged in (module docstring). A row with no key (lse -inf) keeps out 0 and gets lse' = s."""
    if sinks is None:
        return out, lse
    if sinks.requires_grad:
        raise ValueError("attention sinks are frozen base weights here (their gradient is not computed): "
                         "set requires_grad False on them")
    s = sinks.detach().to(lse.dtype)[None, :, None]                        # [1, H, 1]
    return out * torch.sigmoid(lse - s).transpose(1, 2)[..., None].to(out.dtype), torch.logaddexp(lse, s)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, mask=None, spare_q=False, sinks=None):
        out, lse = with_sinks(*forward(q, k, v, causal, scale, backend, mask), sinks)
        # the mask is saved as a tensor, not held on ctx: AC's hooks then drop it with q, k, v (a sliding window's
        # band masks, S·2w bytes a layer, were kept by every checkpointed block from forward to its backward)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        ctx.args, ctx.spare_q = (causal, scale, backend), spare_q
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        (causal, scale, backend), mask = ctx.args, (mask or [None])[0]
        if causal and mask is None and q.shape[1] > BACKWARD_BLOCK and k.shape[2] < q.shape[2]:
            spare = recompute.spare_storages(dict(q=q, k=k, v=v, out=out)) if ctx.spare_q else set()
            grads = backends.blocked_backward(backward, dout, q, k, v, out, lse, scale, backend, backward_block(
                q.shape[1]), spare)
        else:
            grads = backward(dout, q, k, v, out, lse, causal, scale, backend, mask)
        return (*grads, None, None, None, None, None, None)


_varlen_checked: dict = {}   # (device, dtype, heads, kv heads, head dim, windowed) -> torch varlen passed


def _varlen_eligible(q) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward"))


def _torch_varlen_ok(q, k, window) -> bool:
    """torch's flash varlen op for packed rows (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256), after a
    one-time check per case (two documents, forward and backward, against per-document calls; plain op calls,
    nothing saved under AC's hooks). A failure or mismatch keeps the per-document path (logged once)."""
    if not _varlen_eligible(q):
        return False
    key = (q.device, q.dtype, q.shape[2], k.shape[2], q.shape[3], window is not None)
    if key not in _varlen_checked:
        try:   # outside dispatch modes: a selective-AC cache (--ac-keep-attn) must not queue the check's ops,
            with _disable_current_modes():   # which its recompute would then hand to the real calls
                err = backends.varlen_mismatch(q, k, window, _per_document)
        except (RuntimeError, TypeError) as e:   # an op or argument this torch does not have
            err = f"{type(e).__name__}: {str(e).strip()[:200]}"
        _varlen_checked[key] = err is None
        if err is not None:
            _log_once(("varlen", key), f"attention: torch's flash varlen op failed its check for {key} ({err}); "
                      "packed rows use one call per document")
    return _varlen_checked[key]


def _per_document(q, k, v, dout, scale, window):   # (out, dq, dk, dv) of one document: the varlen check
    keep = None if window is None else masks.keep(torch.arange(q.shape[1], device=q.device),
                                                  torch.arange(q.shape[1], device=q.device), window=window)
    out, lse = forward(q, k, v, keep is None, scale, mask=keep)
    return (out, *backward(dout, q, k, v, out, lse, keep is None, scale, mask=keep))


def _banded(q, k, v, scale, window, backend, spare_q=False, sinks=None):
    """Causal attention with a sliding window over rows that are each one document."""
    n = q.shape[1]
    if window is None or window >= n:
        return _Attention.apply(q, k, v, True, scale, backend, None, spare_q, sinks)
    tile, outs = masks.band_rows(window), []
    for a in range(0, n, tile):
        e, ks = min(a + tile, n), max(0, a - window + 1)
        keep = masks.keep(torch.arange(a, e, device=q.device), torch.arange(ks, e, device=q.device),
                          window=window)                                     # [1, tile, keys]
        outs.append(_Attention.apply(q[:, a:e], k[:, ks:e], v[:, ks:e], False, scale, backend, keep, False, sinks))
    return torch.cat(outs, 1)


_last_offsets: list = [None]   # (docs, S, device, cu, longest) of the last call


def _offsets(docs, s, device):
    """int32 offsets of every document of every row back to back, and the longest document. Every layer
    (and its recompute) passes the same `docs` object: the host-to-device copy is made once per batch."""
    last = _last_offsets[0]
    if last is not None and last[0] is docs and last[1:3] == (s, device):
        return last[3:]
    cu = torch.tensor([i * s + x for i, row in enumerate(docs) for x in row[:-1]] + [len(docs) * s],
                      dtype=torch.int32).to(device, non_blocking=True)
    longest = max(y - x for row in docs for x, y in zip(row[:-1], row[1:]))
    _last_offsets[0] = (docs, s, device, cu, longest)
    return cu, longest


def attention(q, k, v, causal: bool = True, scale: float | None = None, docs=None, window=None,
              backend: str | None = None, spare_q: bool = False, sinks=None) -> torch.Tensor:
    """Differentiable attention; `docs[b]`: row b's document boundaries; `window`, `spare_q`, `sinks` [H]: see the
    top."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if window is not None and (not causal or int(window) != window or window < 1):
        raise ValueError(f"sliding window {window!r} needs causal attention and a positive integer size")
    if docs is None and window is None:
        return _Attention.apply(q, k, v, causal, scale, backend, None, spare_q, sinks)
    if not causal:
        raise ValueError("document masking is only implemented for causal attention")
    b, s, h, d = q.shape
    fa = sinks is None and (backend or pick_backend(q, varlen=True)) == "flash_attn"
    if fa or (sinks is None and docs is not None and backend is None and _torch_varlen_ok(q, k, window)):
        # One varlen call over the flattened batch; cu_seqlens index rows back to back.
        cu, longest = _offsets(docs or [[0, s]] * b, s, q.device)
        flat = (q.reshape(b * s, h, d), k.reshape(b * s, -1, d), v.reshape(b * s, -1, d))
        out = flash_attn_varlen_func(*flat, cu, cu, longest, longest, softmax_scale=scale, causal=True,
                                     window_size=(-1, -1) if window is None else (window - 1, 0)) if fa \
            else backends.TorchVarlen.apply(*flat, cu, longest, scale, window)
        return out.view(b, s, h, d)
    if docs is None:
        return _banded(q, k, v, scale, window, backend, spare_q, sinks)
    rows = []
    for i, row in enumerate(docs):
        pieces = [_banded(q[i:i + 1, x:y], k[i:i + 1, x:y], v[i:i + 1, x:y], scale, window, backend, sinks=sinks)
                  for x, y in zip(row[:-1], row[1:])]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)
