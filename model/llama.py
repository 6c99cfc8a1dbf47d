"""A compact Llama-family decoder with Hugging Face parameter names.

Contract:
- Parameter names equal transformers' (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
  `model.layers.{i}.mlp.gate_proj`, `model.norm`, `lm_head`), so checkpoints load without a rename
  table and saved LoRA adapters load in peft on the transformers model.
- `Transformer(input_ids, position_ids=None)` returns logits [B, S, V] (float32 upcast not applied;
  the compute dtype). With `labels` it returns `(loss_sum, n_tokens)` from the chunked loss
  (`loss.chunked_cross_entropy`, with `loss_fn` if given; `dft`: --sft-loss dft's weighting; `per_token=True`: each
  token's loss, for DPO; `hits`: an integer tensor the count of targets predicted right is added to, or [B * S] each
  target's 1 or 0; `noise`: a callable given the embedding output in the compute dtype, before block 0, to add to in
  place: --neftune-alpha's, parallel/neftune.py), computed here in the root forward so FSDP2 keeps lm_head unsharded
  while it is used (DESIGN.md step 4).
- The attention core is `self.attention`, any `model.attention.AttentionCore`: torch SDPA by default; the trainer
  sets the kernel or context-parallel one (Qwen3.5's linear layers': `self.linear`, model/linear_layers.py). Each layer
  passes it its own sliding window (`ModelArgs.window(layer)`, None for full causal attention). Everything else acts
  per token, so a local sequence shard plus its global `position_ids` is all a rank needs.
- Math only: activation checkpointing, offload, compile and sharding are applied from outside
  (`parallel/parallelize.py`), by wrapping each block's forward.

Notation: B batch, S (local) sequence, D model dim, H query heads, K KV heads, Hd head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loss import chunked_cross_entropy
from model import gemma, gemma4_moe, gemma4_small, phi3
from model.attention import SDPAAttention
from model.config import ModelArgs
from model.gemma import GeGLU, GemmaRMSNorm, SandwichBlock, add_residual, gated, normed, scaled_embedding, split_heads
from model.glm4_moe import Glm4MoE
from model.gpt_oss import GptOssMoE
from model.linear_layers import LinearBlock, LocalLinear
from model.moe import MoE
from model.rmsnorm import RMSNorm
from model.rope import Rotary, rope_tables, tables


def _norm(a: ModelArgs, dim: int) -> nn.Module:
    """The architecture's RMSNorm: Gemma's or OLMo's where the weight applies before the cast (model/gemma.py)."""
    return RMSNorm(dim, a.norm_eps) if a.norm_offset is None else GemmaRMSNorm(dim, a.norm_eps, a.norm_offset)


class SwiGLU(nn.Module):
    """silu(gate) * up; a module (no parameters) for the same reason as Rotary (model/rope.py)."""

    def forward(self, gate, up):
        return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0):
        super().__init__()
        self.window = a.window(layer)   # this layer's sliding window (None: full causal attention)
        self.scale = a.attn_scale
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd = a.attn_dims(layer)   # (Gemma 4's full layers': own)
        self.gate, self.rot = a.attn_gate, int(hd * a.partial_rotary_factor)   # Qwen3.5: q_proj [query | gate]; partial
        # Phi-3: q, k, v rows of one qkv_proj (model/phi3.py: `project` takes each), no q/k/v_proj (`a.has`)
        self.qkv_proj = nn.Linear(a.dim, (h + 2 * kv) * hd, bias=a.qkv_bias) if a.has(layer, "qkv_proj") else None
        self.q_proj = nn.Linear(a.dim, h * hd * (2 if a.attn_gate else 1), bias=a.qkv_bias) if a.has(
            layer, "q_proj") else None
        # Gemma 4 E2B / E4B's reuse layers: an earlier layer's k, v (model/gemma4_small.py), no k/v projections or norms
        self.k_proj = nn.Linear(a.dim, kv * hd, bias=a.qkv_bias) if a.has(layer, "k_proj") else None
        # Gemma 4's k_eq_v layers: v is k_proj's output before k_norm and RoPE (no v_proj); v_norm: a weightless norm
        self.v_proj = nn.Linear(a.dim, kv * hd, bias=a.qkv_bias) if a.has(layer, "v_proj") else None
        self.v_norm = gemma.UnitRMSNorm(a.norm_eps) if a.v_norm and self.k_proj is not None else None
        self.o_proj = nn.Linear(h * hd, a.dim, bias=a.o_bias)
        self.q_norm = self.k_norm = None   # per head (Qwen3, Gemma) or over the projection (OLMo: H·Hd, K·Hd)
        if a.qk_norm:
            width = lambda n: hd * (n if a.qk_norm_whole else 1)
            self.q_norm, self.k_norm = _norm(a, width(h)), _norm(a, width(kv)) if self.k_proj is not None else None
        self.whole = a.qk_norm_whole
        self.rotary = Rotary()
        self.rope = a.rotates(layer)   # False: SmolLM3's NoPE layers, q and k unrotated (the tables serve the others)
        # GPT-OSS: a frozen logit per head in every softmax denominator, handed to the core (model/attention.py)
        self.sinks = nn.Parameter(torch.zeros(h), requires_grad=False) if a.sinks else None

    def forward(self, x, cos, sin, core, meta, kv=None, store=False):
        """The sublayer's output; Gemma 4 E2B / E4B's (model/gemma4_small.py): `kv` a storing layer's k, v to use in
        place of this layer's own, `store`: (output, (k, v))."""
        q, k, v, g = self.projections(x, cos, sin, kv)   # x: the block's stand-in (takes_norm) or the normed input
        B, S = q.shape[:2]
        out = core(q, *gemma4_small.core_kv(k, v, kv is not None or store), meta, self.scale, window=self.window,
                   **({} if self.sinks is None else {"sinks": self.sinks}))   # [B, S, H, Hd]
        out = self.o_proj(gated(out.reshape(B, S, self.n_heads * self.head_dim), g))   # -> [B, S, D]
        return (out, (k, v)) if store else out

    def projections(self, x, cos, sin, kv=None):
        """q, k, v with RoPE, and the output gate (or None: `queries`). Given `takes_norm`'s stand-in, the norm runs
        here, so its [T, D] output dies when this returns, before the kernel and o_proj (an argument the caller made
        lives until the sublayer returns)."""
        if (src := getattr(x, "_norm_of", None)) is not None:
            norm, h = src
            x = norm(h)
        if self.qkv_proj is not None and kv is None:   # (Phi-3: the fused projection once for q, k and v)
            x = phi3.split(self, x)
        # k, v before q: backward runs the latest-made nodes first, so q's [T, H·Hd] chain (RoPE, q_proj) runs
        # before the input norm's gradient and its rebuilt output exist, not on top of them
        k, v = self.keys_values(x, cos, sin) if kv is None else kv        # [B, S, K, Hd]
        q, g = self.queries(x, cos, sin)                                  # [B, S, H, Hd], [B, S, H·Hd]
        return q, k, v, g

    @staticmethod
    def takes_norm(norm, x):
        """What Block hands forward in place of norm(x): an empty tensor naming the norm and its input."""
        y = x.new_empty(0)
        y._norm_of = (norm, x)
        return y

    # the two halves of the projections, also run tile by tile by parallel/tiled_attention.py
    def queries(self, x, cos, sin):
        """(q [B, S, H, Hd] with RoPE, Qwen3.5's output gate [B, S, H·Hd] or None): model.gemma.gated."""
        y, g = phi3.project(self, x, 0), None
        if self.gate:
            y, g = y.view(*y.shape[:-1], self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)   # [B, S, H, Hd] each
            y, g = y.reshape(*x.shape[:2], -1), g.reshape(*x.shape[:2], -1)
        q = split_heads(y, self.n_heads, self.head_dim, self.q_norm, self.whole)   # [B, S, H, Hd]
        return (self.rotary(q, None, *tables(cos, sin, self.rot, True))[0] if self.rope else q), g

    def keys_values(self, x, cos, sin):
        y = phi3.project(self, x, 1)
        k = split_heads(y, self.n_kv_heads, self.head_dim, self.k_norm, self.whole)   # [B, S, K, Hd]
        v = (y if self.v_proj is self.qkv_proj is None else phi3.project(self, x, 2)).view(
            *y.shape[:2], self.n_kv_heads, self.head_dim)   # (v_proj None alone: Gemma 4's k_eq_v)
        if self.v_norm is not None:   # (Gemma 4)
            v = self.v_norm(v)
        return (self.rotary(k, None, *tables(cos, sin, self.rot, False))[0] if self.rope else k), v


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, layer: int | None = None):
        super().__init__()
        f = a.projections(layer)["down_proj"][0]   # intermediate_size (Gemma 4 E2B / E4B's reuse layers: maybe twice)
        self.gate_proj, self.up_proj, self.gate_up_proj = phi3.mlp_inputs(a, f)   # (Phi-3's: one fused Linear)
        self.down_proj = nn.Linear(f, a.dim, bias=a.mlp_bias)
        self.act = GeGLU() if a.act == "gelu_tanh" else SwiGLU()

    def forward(self, x):
        return self.down_proj(self.act(*phi3.gate_up(self, x)))


class Block(nn.Module):
    pre_norms = ("input_layernorm", "post_attention_layernorm")   # the norms in front of attention and MLP

    def __init__(self, a: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = ((GptOssMoE if a.moe.clamp else Glm4MoE if a.moe.groups else MoE)(a.dim, a.moe) if a.moe and
                    a.moe.sparse(layer) else MLP(a))   # (Qwen3-MoE: moe.py; GPT-OSS, GLM-4.5: gpt_oss.py, glm4_moe.py)
        self.input_layernorm, self.post_attention_layernorm = _norm(a, a.dim), _norm(a, a.dim)
        self.residual = a.residual_multiplier   # each sublayer's output × this before the add (Granite's; else 1)
        self.norm_fed = phi3.NORM_FED if a.fused else None   # (Phi-3: what its norms feed, parallel/memory.py)

    def forward(self, x, cos, sin, core, meta, linear=None):   # (linear: the linear blocks' core and meta, unused)
        a = self.self_attn(normed(self.input_layernorm, self.self_attn, x), cos, sin, core, meta)
        # into o_proj's output where it says so (model.qlora: read by nothing else): no third [T, D] beside it and x
        x = add_residual(x, a, self.residual)
        return add_residual(x, self.mlp(normed(self.post_attention_layernorm, self.mlp, x)), self.residual, False)


def beside(a: ModelArgs) -> tuple | None:
    """Gemma 4's MoE block's (router, experts), beside every block's MLP (model/gemma4_moe.py), else None."""
    if a.moe is None or not a.moe.beside:
        return None
    return gemma4_moe.Router(a.dim, a.moe, gemma.UnitRMSNorm(a.norm_eps)), gemma4_moe.Experts(a.dim, a.moe)


class Decoder(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        pad = a.pad_token_id if a.pad_token_id is not None and 0 <= a.pad_token_id < a.vocab_size else None
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim, pad)   # (padding_idx: --train-embeddings never trains
        # that row, as transformers' embedding and peft's modules_to_save copy of it)
        mlp = lambda i: MoE(a.dim, a.moe) if a.moe and a.moe.sparse(i) else MLP(a)   # (MoE: model/moe.py)
        self.layers = nn.ModuleList(  # (Qwen3.5's linear_attention layers: model/linear_layers.py)
            LinearBlock(a, lambda: _norm(a, a.dim), mlp(i)) if a.is_linear(i) else SandwichBlock(a, i, Attention(a, i),
            MLP(a, i), beside(a)) if a.sandwich_norms or a.post_norms else Block(a, i) for i in range(a.n_layers))
        self.norm = _norm(a, a.dim)
        gemma4_small.add_decoder_parts(self, a)   # (Gemma 4 E2B / E4B's per-layer embeddings)

    def run_blocks(self, h, *args, carry=None):
        """The blocks in order (parallel/ac.apply_ac replaces this to checkpoint groups of them); `carry`: what flows
        beside h (Gemma 4 E2B / E4B: model/gemma4_small.py)."""
        for layer in self.layers:
            h = gemma4_small.run_block(layer, h, args, carry)
        return h


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, attention=None, linear=None):
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention = attention or SDPAAttention()
        self.linear, self.hybrid = linear or LocalLinear(), any(map(args.is_linear, range(args.n_layers)))  # (deltanet)

    def rope(self, position_ids, dtype):
        """cos, sin [B, S, Hd] for global positions, or (full, sliding) pairs of each: model.rope.rope_tables."""
        span = self.attention.spans(position_ids) if self.args.rope_scaling.get("rope_type") == "longrope" else None
        return rope_tables(self.args, position_ids, dtype, span)   # (LongRoPE's choice, per document of the row)

    def forward(self, input_ids, position_ids=None, labels=None, loss_fn=None, per_token=False, hits=None, noise=None,
                dft=False):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        embed = self.model.embed_tokens   # (DPO's reference for --train-embeddings: its weight, model.norms)
        ref = getattr(embed, "reference", None)
        head = ref if ref is not None and self.args.tie_embeddings else self.lm_head.weight   # (tied: the same)
        dt = getattr(embed, "compute_dtype", None) or head.dtype   # (--train-embeddings' float32 master, where no
        if head.dtype != dt:   # mixed precision cast it: the compute dtype, as a frozen one's; a tied one's grad
            head = head.to(dt)   # flows back through the cast)
        x = [(embed(input_ids) if ref is None else F.embedding(input_ids, ref)).to(dt)]   # [B, S, D] (itself if dt)
        x[0] = scaled_embedding(x[0], self.args)   # Gemma's, Granite's: before NEFTune's noise, as transformers' hook
        if noise is not None:   # adds to the embedding output in place (--neftune-alpha's: parallel/neftune.py)
            noise(x[0])
        carry = gemma4_small.carry(self, input_ids, x[0])   # (Gemma 4 E2B / E4B's per-layer inputs, from the noised x)
        cos, sin = self.rope(position_ids, x[0].dtype)
        meta = self.attention.prepare(position_ids)
        linear = (self.linear, self.linear.prepare(position_ids)) if self.hybrid else None   # (model/linear_layers.py)
        # handed over, not kept here (no *args: that tuple would hold it): the blocks drop it once block 0 has run (with
        # AC its checkpoint keeps the ids instead), not at the end, when every block's checkpoint is alive beside it
        h = self.model.run_blocks(x.pop(), cos, sin, self.attention, meta, linear, carry=carry)
        h, s = self.model.norm(h), self.args.logits_scaling   # (Granite: logits / s; else 1)
        c = {} if self.args.logit_softcap is None else {"softcap": self.args.logit_softcap}   # (Gemma 4's c)
        if labels is None:
            y = F.linear(h, head) if s == 1 else F.linear(h, head) / s      # [B, S, V], transformers' order
            return y if not c else torch.tanh(y / c["softcap"]) * c["softcap"]   # c·tanh(y / c), transformers' order
        if s != 1:   # the loss' logits: (h / s) @ W = (h @ W) / s, within rounding; in place (nothing saved the norm's
            h = h.div_(s)   # output), per token, so the loss, DPO's per-token log-probs, accuracy and eval all see it
        return chunked_cross_entropy(h.reshape(B * S, -1), head, labels.reshape(-1),
                                     loss_fn=loss_fn, per_token=per_token, hits=hits, dft=dft, **c)
