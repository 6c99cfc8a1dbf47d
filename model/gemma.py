"""Gemma 3's, OLMo 2/3's, SmolLM3's and Granite's differences from the Llama decoder (`model_type: gemma3_text`,
transformers' Gemma3ForCausalLM; `olmo2` / `olmo3`, Olmo2ForCausalLM / Olmo3ForCausalLM; `smollm3`, SmolLM3ForCausalLM;
`granite`, GraniteForCausalLM), chosen by ModelArgs flags that model/llama.py reads: no subclass of its model, the
Llama path's code unchanged.

Contract:
- Their config.json keys, read into those flags: model/arch_fields.py.
- `scaled_embedding(x, args)`: the embedding output scaled, Gemma's (`scale_embedding` below) or Granite's (x · m, a
  Python float as transformers multiplies: computed in float32, rounded once to x's dtype).
- `add_residual(x, y, m)`: x + y · m (Granite's residual_multiplier; y · m rounded to y's dtype, then the add, as
  transformers), into y itself where it says nothing else reads it (model.qlora's `_sum_in_place`: o_proj's output).
- `GemmaRMSNorm` (`norm_offset`): x / rms(x) · (offset + weight), the weight applied in float32 BEFORE the cast back
  (Llama casts, then multiplies): transformers' Gemma3RMSNorm (offset 1: the weight an offset from 1) and
  Olmo2RMSNorm / Olmo3RMSNorm (offset 0). Every norm of the model, q_norm/k_norm too.
- `split_heads` (`qk_norm_whole`): q and k into heads through their norms, per head (Qwen3, Gemma) or, OLMo's, over
  the whole projection (H·Hd, K·Hd) before the split.
- `gated(out, g)` (`attn_gate`): Qwen3.5's attention output gate (its docstring).
- `UnitRMSNorm` (`v_norm`): Gemma 4's weightless norm on v. `layer_scalar`: Gemma 4's block output scale. Gemma 4's
  MoE block beside the MLP (`moe`: its router and experts; its three norms made here): model/gemma4_moe.py.
- `GeGLU` (`act` "gelu_tanh"): gelu(gate, tanh approximation) · up, hidden_activation gelu_pytorch_tanh.
- `scale_embedding(x, dim)` (`embed_scale`): the embedding output × sqrt(dim), the scale rounded to x's dtype first
  (in bf16 sqrt(3840) = 61.97 is 62.0: transformers' Gemma3TextScaledWordEmbedding multiplies so).
- `SandwichBlock` (`sandwich_norms`): input_layernorm -> attention -> post_attention_layernorm (on the attention's
  OUTPUT) -> + residual; pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> + residual (`feed_forward`,
  Gemma 4's MoE inside: one unit, which --tiled-mlp runs whole over token tiles, parallel/memory.py). The input norm
  goes through `takes_norm` as Llama's (the tiled attention runs it over its tiles): `pre_norms` names the pre-sublayer
  norms for parallel/memory.py. With `post_norms` (OLMo) there are none: the sublayers take x itself, `pre_norms` is
  empty, input_layernorm and pre_feedforward_layernorm are None. Each block picks its RoPE table: Transformer.rope
  hands (full, sliding) pairs when `local_rope` is set (Gemma's sliding layers: rope_local_base_freq, 10000; OLMo 3's:
  500000; full ones: rope_theta with its scaling).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model import gemma4_small

NORM_CHUNK = 2**26   # elements per chunk (model/rmsnorm.py: float32 temporaries of a chunk, not of x)
def _normalize(x, weight, eps, offset):
    """(x / rms(x) · (offset + weight) cast to x's dtype, rsqrt): transformers' order, all in float32 before the cast
    (offset 0: the weight itself, exactly)."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * (offset + weight.float())).to(x.dtype), r


class _GemmaNormFn(torch.autograd.Function):
    """Gemma's RMSNorm saving its input and rsqrt [..., 1] (not the float32 upcast), over row chunks of NORM_CHUNK
    elements both ways, as model.rmsnorm._RMSNormFn. No CUDA fused path: aten's _fused_rms_norm applies the weight
    after the cast to the compute dtype, and Gemma applies (1 + weight) in float32 before it."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        flat = x.reshape(-1, x.shape[-1])
        rows = max(1, min(flat.shape[0], NORM_CHUNK // x.shape[-1]))
        out, rstd = torch.empty_like(x, memory_format=torch.contiguous_format), flat.new_empty(flat.shape[0], 1,
                                                                                                dtype=torch.float32)
        for i in range(0, flat.shape[0], rows):
            out.view(-1, x.shape[-1])[i:i + rows], rstd[i:i + rows] = _normalize(flat[i:i + rows], weight, eps, offset)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x, weight, rstd)
        ctx.rows, ctx.offset = rows, offset
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        flat, gflat, rows = x.reshape(-1, x.shape[-1]), g.reshape(-1, x.shape[-1]), ctx.rows
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        w1 = ctx.offset + weight.float()
        for i in range(0, flat.shape[0], rows):
            xf, r, gc = flat[i:i + rows].float(), rstd[i:i + rows], gflat[i:i + rows].float()
            if dw is not None:
                dw += (gc * (xf * r)).sum(0)
            if dx is not None:   # n = x·r, dn = g·(offset + w):  dx = r·dn - r³·x·mean(dn·x)
                dn = gc * w1
                dx.view(-1, x.shape[-1])[i:i + rows] = r * dn - r.pow(3) * xf * (dn * xf).mean(-1, keepdim=True)
        return dx, (None if dw is None else dw.to(weight.dtype)), None, None


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm (module docstring), or with `offset` 0 Olmo2RMSNorm / Olmo3RMSNorm (the weight
    itself, applied in float32 before the cast); the weight starts at the identity (1 - offset) and trains in float32
    as --train-norms keeps it (no cast: the formula upcasts it anyway)."""
    reference = None   # DPO's reference weight while set (model.norms.reference_trained)

    def __init__(self, dim: int, eps: float, offset: float = 1.0):
        super().__init__()
        self.eps, self.offset = eps, float(offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))

    def forward(self, x):
        w = self.weight if self.reference is None else self.reference
        if torch.compiler.is_compiling():   # the formula, fused and differentiated by the compiler
            return _normalize(x, w, self.eps, self.offset)[0]
        return _GemmaNormFn.apply(x, w, self.eps, self.offset)


class UnitRMSNorm(nn.Module):
    """x / rms(x), no weight (Gemma 4's v_norm, Gemma4RMSNorm with_scale=False): GemmaRMSNorm's math with weight 1."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        one = x.new_ones((), dtype=torch.float32).expand(x.shape[-1])
        if torch.compiler.is_compiling():
            return _normalize(x, one, self.eps, 0.0)[0]
        return _GemmaNormFn.apply(x, one, self.eps, 0.0)


class GeGLU(nn.Module):
    """gelu(gate, tanh approximation) · up (Gemma's MLP); a module for parallel/compile.py, as model.llama.SwiGLU."""

    def forward(self, gate, up):
        return F.gelu(gate, approximate="tanh") * up


def scale_embedding(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x · sqrt(dim), the scale rounded to x's dtype first, as transformers (module docstring)."""
    return x * torch.tensor(math.sqrt(dim), dtype=x.dtype)


def scaled_embedding(x: torch.Tensor, a) -> torch.Tensor:
    """The embedding output x [B, S, D] scaled as the architecture does (module docstring), or x itself."""
    if a.embed_scale:   # Gemma: × sqrt(D) rounded to the compute dtype
        return scale_embedding(x, a.dim)
    return x * a.embed_multiplier if a.embed_multiplier != 1 else x   # Granite: × m, a float (a new tensor, as Gemma's)


def add_residual(x: torch.Tensor, y: torch.Tensor, m: float, into: bool = True) -> torch.Tensor:
    """x + y · m (module docstring): into y where it says so (`_sum_in_place`: no third [T, D] beside it and x) and
    `into` allows (the MLP's residual: a new tensor, as Llama's)."""
    if into and getattr(y, "_sum_in_place", False):
        return (y if m == 1 else y.mul_(m)).add_(x)
    return x + (y if m == 1 else y * m)


class SandwichBlock(nn.Module):
    """Gemma's decoder block (module docstring) over the Llama block's attention and MLP modules; with `post_norms`
    OLMo 2/3's: the same with no norm in front of the sublayers (they take x itself)."""
    # the post norms save the attention's and the MLP's outputs: a block recompute must compute them (the down
    # projection's base skips that where nothing reads them: recompute.py; --tiled-mlp runs the post norm in the tiles)
    outputs_saved = True
    # the modules of `feed_forward` (its trainable parameters: parallel/memory.py's tiled unit)
    FEED_FORWARD = ("mlp", "pre_feedforward_layernorm", "post_feedforward_layernorm", "router", "experts",
                    "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")

    def __init__(self, a, layer: int, attention: nn.Module, mlp: nn.Module, moe: tuple | None = None):
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        norm = lambda: None if a.post_norms else GemmaRMSNorm(a.dim, a.norm_eps, a.norm_offset)   # (a pre-norm)
        self.input_layernorm = norm()
        self.post_attention_layernorm = GemmaRMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = GemmaRMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.experts = None   # Gemma 4's MoE block beside the MLP: (router, experts), model/gemma4_moe.py
        if moe is not None:
            self.router, self.experts = moe
            for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
                setattr(self, n, GemmaRMSNorm(a.dim, a.norm_eps, a.norm_offset))
        # the norms in front of attention and MLP (parallel/memory.py, phases.py): none in OLMo's block
        self.pre_norms = () if a.post_norms else ("input_layernorm", "pre_feedforward_layernorm")
        # which of Transformer.rope's (full, sliding) tables this layer takes
        self.table = int(a.local_rope is not None and bool(a.layer_types)
                         and a.layer_types[layer] == "sliding_attention")
        # Gemma 4: the block's output × its stored [1] scale (a frozen parameter: the loader, FSDP and the merge treat
        # it as every other base weight; None elsewhere)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False) if a.layer_scalar else None
        gemma4_small.add_block_parts(self, a, layer)   # (Gemma 4 E2B / E4B: per-layer input, KV sharing role)

    def forward(self, x, cos, sin, core, meta, linear=None, ple=None, **kv):   # (linear: Qwen3.5's linear blocks'
        if isinstance(cos, tuple):   # core and meta; ple, kv: Gemma 4 E2B / E4B's, model/gemma4_small.py)
            cos, sin = cos[self.table], sin[self.table]
        a = self.self_attn(normed(self.input_layernorm, self.self_attn, x), cos, sin, core, meta, **kv)
        a, kv = a if kv.get("store") else (a, None)
        x = x + self.post_attention_layernorm(a)   # (not into o_proj's output: the norm reads it, model.qlora)
        x = x + self.feed_forward(x)
        x = x if ple is None else gemma4_small.add_per_layer(self, x, ple)
        x = x if self.layer_scalar is None else x.mul_(self.layer_scalar)   # (the sum: a new tensor, nothing saved)
        return x if kv is None else (x, kv)

    def feed_forward(self, x):
        """post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))), Gemma 4's MoE beside the MLP (gemma4_moe's
        docstring): per token, one unit that parallel/memory.py's --tiled-mlp runs over token tiles (FEED_FORWARD)."""
        y = self.mlp(normed(self.pre_feedforward_layernorm, self.mlp, x))
        if self.experts is not None:   # (Gemma 4's MoE: routed on x itself, its experts fed their own norm of x)
            flat = x.reshape(-1, x.shape[-1])                                                        # [T, D]
            e = self.experts(self.pre_feedforward_layernorm_2(flat), *self.router(flat)).view(x.shape)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(e)
        return self.post_feedforward_layernorm(y)


def gated(out: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """Qwen3.5's gated attention: the core's output [B, S, H·Hd] × sigmoid(gate) in the compute dtype, as transformers
    (`out` itself without a gate). The gate is the second half of each head's q_proj output, reshaped into a copy of
    its own (model.llama.Attention.queries), so q's storage, which a core may reuse in backward, is not the gate's;
    the product reads the core's output before the kernel's backward does (its gradient comes from here)."""
    return out if g is None else out * torch.sigmoid(g)


def normed(norm: nn.Module | None, sublayer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x), or what a sublayer that runs the norm itself takes instead (its `takes_norm`): Attention's runs
    it and lets its output go after q, k, v; parallel/'s tiled MLP and attention over their own tiles, so the
    norm's [T, D] output is never computed whole. No norm (OLMo's blocks): x itself."""
    take = getattr(sublayer, "takes_norm", None)
    return x if norm is None else norm(x) if take is None else take(norm, x)


def split_heads(y: torch.Tensor, n: int, hd: int, norm: nn.Module | None, whole: bool) -> torch.Tensor:
    """A projection's output y [..., n·hd] as [..., n, hd], through its q/k norm if any: per head after the split
    (Qwen3's, Gemma's), or over the whole width before it (`whole`: OLMo's q_norm / k_norm of H·Hd and K·Hd).
    Per token either way: the sequence may be sharded or tiled."""
    if norm is not None and whole:
        y = norm(y)
    y = y.view(*y.shape[:-1], n, hd)
    return y if norm is None or whole else norm(y)
