"""RoPE as transformers computes it from a `ModelArgs`' theta and scaling: the inverse frequencies, the cos/sin tables,
and their application to q and k (HF's rotate-half).

Contract:
- config.json's RoPE and `--rope-scaling` (`read_rope`, `read_ministral3`, `rope_scaling_flag`, `keep_temperature`,
  `ROPE_TYPES`): model/rope_read.py; ModelArgs holds what they read (rope_theta, rope_scaling).
- `inv_freq(args)` (a model.config.ModelArgs) returns the float32 inverse frequencies [rotary_dim // 2] and the
  attention scaling factor applied to cos/sin (1.0 except for YaRN), for rope types default, linear, llama3 and
  yarn: the same numbers transformers computes; `cos_sin(args, position_ids, dtype)` the cos, sin [B, S, R] of
  global positions from them. With an attention temperature (`args.attn_temperature_beta`: Ministral 3, transformers'
  get_llama_4_attn_scale) they are [B, S, 2·Hd]: k's tables, then q's times each token's temperature (a function of
  its global position, so every layout and tile computes one process' value), and `tables(cos, sin, hd, q)` is the
  half for k or q: folded so, the scale costs no pass over q and keeps no [T, H, Hd] for backward.
- Partial RoPE (`args.partial_rotary_factor` f < 1, Qwen3.5's 0.25): R = `args.rotary_dim` = int(Hd·f) dims rotate,
  the tables are [.., R] (frequencies over R, as transformers' `dim`), `Rotary` passes the other Hd - R dims.
- LongRoPE (rope_type "longrope", Phi-3 / Phi-4: model/phi3.py): frequencies divided by a factor each, the short set
  or, in documents whose largest position + 1 passes original_max_position_embeddings, the long one; cos/sin times
  its attention_factor. The choice is per document (`span`, which the model takes from its attention core: the whole
  row's documents on every cp rank), as transformers chooses for a document run alone (for a batch it takes the
  largest position of all its rows: a packed row or a micro-batch would change a document's numbers).
- Proportional RoPE (rope_type "proportional", Gemma 4's full layers): frequencies over the whole head (its own,
  global_head_dim), the first int(f·Hd/2) as default RoPE's, the rest 0: dims [0, f·Hd/2) and [Hd/2, Hd/2 + f·Hd/2)
  rotate, not a prefix (rotate_half pairs i with i + Hd/2); the tables are [.., Hd], Rotary rotates the whole head.
- `Rotary()(q, k, cos, sin)` -> (q, k) rotated (k may be None): transformers' `apply_rotary_pos_emb` within one
  rounding (tests/test_model.py), in eager mode over sequence chunks of ROPE_CHUNK elements both ways (`_RopeFn`:
  a chunk's temporaries, not q's), in compiled code the formula. A module so that parallel/compile.py can compile it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.attention import document_spans

ROPE_CHUNK = 2**26   # elements per sequence chunk in eager RoPE (_RopeFn: temporaries of a chunk, not of q)


def inv_freq(args, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies [rotary_dim // 2] (float32) and the cos/sin scaling factor; every type computes them
    over the rotated dims alone (transformers' `dim = int(head_dim * partial_rotary_factor)`). LongRoPE: the short
    factors', or with `long` the long factors' (model/phi3.py fills its factor and attention_factor)."""
    d, base, sc = args.rotary_dim, args.rope_theta, args.rope_scaling
    freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rtype = sc.get("rope_type", "default")
    if rtype == "longrope":   # LongRoPE (Ding et al., 2024): a searched factor per frequency divides it
        ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), sc["attention_factor"]
    if rtype == "linear":
        return freq / sc["factor"], 1.0
    if rtype == "proportional":   # Gemma 4's full layers: a d-dim RoPE's first int(f·d/2) frequencies, the rest 0
        n = int(sc.get("partial_rotary_factor", 1.0) * d // 2)   # (cos 1, sin 0: those dims pass), all / factor
        return torch.cat((freq[:n], torch.zeros(d // 2 - n))) / sc.get("factor", 1.0), 1.0
    if rtype == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_ctx / lo, freq / factor, freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if rtype == "yarn":
        # YaRN (Peng et al., 2023): interpolate slow dims, extrapolate fast ones, ramp between.
        factor = sc["factor"]
        orig = sc.get("original_max_position_embeddings") or args.max_position_embeddings

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        attn = sc.get("attention_factor")
        if attn is None:
            m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def corr_dim(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(sc.get("beta_fast") or 32), corr_dim(sc.get("beta_slow") or 1)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        interp = 1.0 / (factor * base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))   # (not freq / factor:
        return interp * (1 - extrap) + freq * extrap, float(attn)   # transformers' rounding, bit for bit)
    return freq, 1.0


def cos_sin(args, position_ids, dtype, span=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, R] (R = args.rotary_dim: Hd, or a partial RoPE's first dims) for global positions, computed in
    float32 as transformers does ([B, S, 2·R] with q's own, scaled by the attention temperature: module docstring).
    LongRoPE: a token whose `span` [B, S] (its document's largest position + 1 in the whole row,
    model.attention.document_spans; of the given rows without it) passes the original length takes the long factors
    (transformers' longrope_frequency_update on that document alone)."""
    freq, scale = inv_freq(args)
    freq = freq.to(position_ids.device)
    if args.rope_scaling.get("rope_type") == "longrope":
        span = document_spans(position_ids) if span is None else span
        long = (span > args.rope_scaling["original_max_position_embeddings"])[..., None]   # [B, S, 1]
        freq = torch.where(long, inv_freq(args, True)[0].to(freq.device), freq)           # [B, S, Hd/2]
    ang = position_ids.float()[..., None] * freq                           # [B, S, Hd/2]
    ang = torch.cat((ang, ang), dim=-1)                                    # [B, S, Hd]
    cos, sin = ang.cos() * scale, ang.sin() * scale
    if args.attn_temperature_beta is not None:   # 1 + beta·log(1 + floor(pos / n)), as transformers computes it
        t = 1 + args.attn_temperature_beta * torch.log(1 + torch.floor(position_ids / args.attn_temperature_length))
        cos, sin = torch.cat((cos, cos * t[..., None]), -1), torch.cat((sin, sin * t[..., None]), -1)
    return cos.to(dtype), sin.to(dtype)


def rope_tables(args, position_ids, dtype, span=None):
    """cos, sin [B, S, Hd] for global positions (cos_sin; q's own beside them: [B, S, 2·Hd] with Ministral 3's
    temperature; `span`: LongRoPE's, cos_sin); with `local_rope` (Gemma, OLMo 3) the pairs (full layers', sliding
    layers') of each, which model.gemma.SandwichBlock picks from (model.llama.Transformer.rope)."""
    cos, sin = cos_sin(args, position_ids, dtype, span)
    if args.local_rope is None:
        return cos, sin
    lcos, lsin = cos_sin(args.local_args(), position_ids, dtype)
    return (cos, lcos), (sin, lsin)


def tables(cos, sin, hd: int, q: bool):
    """The cos, sin to rotate k (or q, `q`) with: cos_sin's whole tables, or their half when they hold q's own (`hd`:
    the rotated dims, args.rotary_dim)."""
    if cos.shape[-1] == hd:
        return cos, sin
    return (cos[..., hd:], sin[..., hd:]) if q else (cos[..., :hd], sin[..., :hd])


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_rows(x, cos, sin, transpose: bool):
    """x·cos + rotate_half(x)·sin (or its transpose, the backward: x·cos - rotate_half(x·sin), since
    rotate_half^T = -rotate_half) over chunks of the sequence, each written into one output: the temporaries
    are a chunk's, not x's. Per half, one multiply and one fused multiply-add into the output (y1 = x1·c - x2·s,
    y2 = x2·c + x1·s; transposed: x1·c + x2·s, x2·c - x1·s): 4 kernels moving ~5 of x's size, where the formula
    (x·c, a negated half, a cat, ·s, the sum) moves ~10. The add is not rounded to the dtype between product
    and sum, so in bf16 it is closer to the exact value than transformers' formula, not bit-equal to it."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows, h = max(1, ROPE_CHUNK // max(1, x[:, :1].numel())), x.shape[-1] // 2
    sign = -1 if transpose else 1
    for a in range(0, x.shape[1], rows):
        xc, c, s, o = x[:, a:a + rows], cos[:, a:a + rows], sin[:, a:a + rows], out[:, a:a + rows]
        s1, s2 = (s[..., h:], s[..., :h]) if transpose else (s[..., :h], s[..., h:])
        torch.mul(xc[..., :h], c[..., :h], out=o[..., :h]).addcmul_(xc[..., h:], s1, value=-sign)
        torch.mul(xc[..., h:], c[..., h:], out=o[..., h:]).addcmul_(xc[..., :h], s2, value=sign)
    return out


class _RopeFn(torch.autograd.Function):
    """RoPE saving only cos, sin (autograd's formula saves those too) and, unlike it, running in sequence
    chunks both ways: the whole-tensor formula holds x·cos, the rotated half, its product and the sum at
    once (~4 of x's size; 3 more in backward), which at 512k tokens is 15 GB for q in each block's forward."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_rows(x, cos, sin, False)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_rows(g, cos, sin, True), None, None


class Rotary(nn.Module):
    """HF's rotate-half RoPE on q [B, S, H, Hd] and k [B, S, K, Hd] with cos, sin [B, S, R]: R < Hd (a partial RoPE,
    Qwen3.5's partial_rotary_factor) rotates the first R dims of each head (rotate_half within them) and passes the
    rest, as transformers' apply_rotary_pos_emb. A module (no parameters) so that `parallel.compile.apply_compile` can
    fuse it from outside; eager mode runs it in sequence chunks (_RopeFn), compiled code as one fused formula."""

    def forward(self, q, k, cos, sin):   # k may be None (the query tiles of parallel/tiled_attention.py)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)                     # [B, S, 1, R]
        if (torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad   # _RopeFn: constant tables
                or cos.dtype != q.dtype or sin.dtype != q.dtype):                            # in q's dtype
            rope = lambda x: x * cos + rotate_half(x) * sin
        else:
            rope = lambda x: _RopeFn.apply(x, cos, sin)
        r = cos.shape[-1]
        if r < q.shape[-1]:   # partial: [rotated R | passed Hd - R]
            whole = rope
            rope = lambda x: torch.cat((whole(x[..., :r]), x[..., r:]), dim=-1)   # noqa: E731
        return rope(q), None if k is None else rope(k)
