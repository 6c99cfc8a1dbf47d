"""Gemma 4 E2B / E4B's parts (google/gemma-4-E2B, gemma-4-E4B; a gemma4_text config.json with
hidden_size_per_layer_input, num_kv_shared_layers, use_double_wide_mlp): per-layer embeddings (PLE), KV sharing and
the KV-shared layers' double-wide MLP, over Gemma 4's dense decoder (model/gemma.py's SandwichBlock).

Contract:
- `small_fields(cfg, types)`: {"small": SmallSpec} as Gemma4TextConfig reads the three keys (transformers 5.17 and
  5.25 alike), {} for the dense forms (all three off); bad values refused naming the key.
- `SmallSpec.modes[i]`: transformers' kv_sharing_modes: the last num_kv_shared_layers layers "reuse" the keys and
  values (after k_norm, v_norm and RoPE) of the last earlier layer of their own attention type, which "store"s them;
  a reuse layer has no k_proj, v_proj, k_norm, v_norm (ModelArgs.has), and with use_double_wide_mlp an MLP twice
  intermediate_size wide (`width`).
- PLE: the decoder's `embed_tokens_per_layer` [V_ple, L·P] (× sqrt(P) rounded to its dtype),
  `per_layer_model_projection` (D -> L·P, × D^-0.5) and `per_layer_projection_norm` [P] make each token's [L, P]
  inputs (`per_layer_inputs`: (norm(proj(x)) + table(ids)) × 2^-0.5, from the scaled embedding output x); block i
  adds, after its feed-forward residual and before layer_scalar, post_per_layer_input_norm(per_layer_projection(
  gelu_tanh(per_layer_input_gate(h)) × input_i)) (`add_per_layer`). Per token: under context parallelism each rank
  makes its own tokens' rows. These are frozen base weights in the compute dtype, never quantized (NF4 covers the
  block projections LoRA adapts): the table is a lookup of T rows a step, whole on every rank as embed_tokens
  (ignored by FSDP2, parallel/fsdp.py); a run keeps it in host memory, its module swapped from outside for one that
  gathers the rows there (parallel/host_table.py), which this module calls as any embedding.
- `Carry`: what flows beside the hidden state from block to block (Decoder.run_blocks, parallel/ac.py's groups):
  block i's slice of the per-layer inputs and the stored K/V by layer type, handed to each block call as keyword
  tensors (`ple`, `kv`; `store` asks a storing block to return (h, (k, v))), so under activation checkpointing they
  are inputs and outputs of the blocks' checkpoints and FSDP2's hooks: the storing layer's k_proj (and its LoRA) gets
  the gradient of every reuse layer. K/V are stored as the layer hands them to its core, [B, S_local, K, Hd] per
  token of the rank's shard: a reuse layer's core gets the layout its own projections would have made (Ulysses and
  ring split them inside the core). Each core gets its own copy (`core_kv`): a core may write its backward's dk, dv
  into the k, v it was handed (model/attention.py), which other layers read too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SmallSpec:
    ple: int              # hidden_size_per_layer_input P (0: no per-layer embeddings)
    ple_vocab: int        # vocab_size_per_layer_input
    modes: tuple          # per layer None, "store" or "reuse" (transformers' kv_sharing_modes)
    double_wide: bool     # use_double_wide_mlp: the reuse layers' MLP 2 × intermediate_size

    def reuses(self, layer: int) -> bool:
        return self.modes[layer] == "reuse"

    def width(self, layer: int, f: int) -> int:
        """Block `layer`'s MLP width, intermediate_size f or twice it."""
        return 2 * f if self.double_wide and self.reuses(layer) else f

    @property
    def kv_shared(self) -> bool:
        return "reuse" in self.modes

    def n_params(self, a) -> int:
        """Parameters beyond the dense decoder's count (ModelArgs.n_params): PLE's; no k/v projections in the reuse
        layers; their double-wide MLPs."""
        d, n, p = a.dim, a.n_layers, self.ple
        ple = self.ple_vocab * n * p + d * n * p + p + n * (2 * d * p + d) if p else 0
        kv = sum(d * k * e * (1 + (not a.shares_kv(i))) for i in range(n) if self.reuses(i)
                 for _, k, e in [a.attn_dims(i)])
        return ple - kv + sum(3 * d * a.intermediate_size for i in range(n) if self.width(i, 1) == 2)


def _whole(cfg: dict, key: str, default: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"config.json: {key} {v!r} must be a whole number >= 0")
    return v


def small_fields(cfg: dict, types: list) -> dict:
    """ModelArgs' `small` of a gemma4_text config.json (module docstring): the keys' defaults as Gemma4TextConfig's
    (hidden_size_per_layer_input 256, vocab_size_per_layer_input 262144, num_kv_shared_layers 0, use_double_wide_mlp
    false)."""
    n, p, shared = len(types), _whole(cfg, "hidden_size_per_layer_input", 256), _whole(cfg, "num_kv_shared_layers", 0)
    vocab, wide = _whole(cfg, "vocab_size_per_layer_input", 262144), bool(cfg.get("use_double_wide_mlp", False))
    if p and not vocab:
        raise ValueError(f"config.json: vocab_size_per_layer_input 0 with hidden_size_per_layer_input {p}: the "
                         "per-layer embedding table needs rows (Gemma 4 E2B / E4B: 262144)")
    if shared >= n > 0:
        raise ValueError(f"config.json: num_kv_shared_layers {shared} of {n} layers leaves no layer to compute the "
                         "keys and values the others reuse (transformers fails on it too)")
    first = n - shared
    modes = [None if i < first else "reuse" for i in range(n)]
    if shared:
        for kind in set(types):
            if kind not in types[:first]:
                raise ValueError(f"config.json: num_kv_shared_layers {shared}: the shared layers include "
                                 f"{kind} ones and none of the first {first} layers is one, to store their keys and "
                                 "values (transformers refuses it too)")
            modes[first - 1 - types[:first][::-1].index(kind)] = "store"
    if not p and not any(m == "reuse" for m in modes):
        return {}   # (double-wide without reuse layers: nothing is wide, as in transformers)
    return {"small": SmallSpec(p, vocab, tuple(modes), wide)}


# ----------------------------------------------------------------------------- the modules, under transformers' names


def add_decoder_parts(decoder: nn.Module, a) -> None:
    """The decoder's PLE modules (module docstring), or none."""
    if a.small is None or not a.small.ple:
        return
    p, n = a.small.ple, a.n_layers
    decoder.embed_tokens_per_layer = nn.Embedding(a.small.ple_vocab, n * p)
    decoder.per_layer_model_projection = nn.Linear(a.dim, n * p, bias=False)
    decoder.per_layer_projection_norm = _norm(a, p)


def add_block_parts(block: nn.Module, a, layer: int) -> None:
    """Block `layer`'s PLE modules and its KV-sharing role (`kv_mode`: None, "store", "reuse"; `kind`: its type)."""
    block.index, block.kv_mode = layer, a.small.modes[layer] if a.small else None
    # the per-layer branch reads the feed-forward side's output (the sum after it): --tiled-mlp's unit must compute it
    # in a block recompute too (parallel/memory.py; the step-time model: plan_speed_block.unit_read)
    block.unit_output_read = bool(a.small and a.small.ple)
    block.kind = a.layer_types[layer] if a.layer_types else "full_attention"
    if a.small is not None and a.small.ple:
        block.per_layer_input_gate = nn.Linear(a.dim, a.small.ple, bias=False)
        block.per_layer_projection = nn.Linear(a.small.ple, a.dim, bias=False)
        block.post_per_layer_input_norm = _norm(a, a.dim)


def _norm(a, dim: int) -> nn.Module:
    from model.gemma import GemmaRMSNorm
    return GemmaRMSNorm(dim, a.norm_eps, a.norm_offset)


def per_layer_inputs(decoder: nn.Module, a, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B, S, L, P]: each token's per-layer inputs from its ids and the scaled embedding output x [B, S, D]
    (transformers' get_per_layer_inputs + project_per_layer_inputs, its roundings)."""
    n, p = a.n_layers, a.small.ple
    e = decoder.embed_tokens_per_layer(ids).to(x.dtype)
    e = e * torch.tensor(math.sqrt(p), dtype=e.dtype)                          # [B, S, L·P]
    proj = decoder.per_layer_model_projection(x) * a.dim ** -0.5               # [B, S, L·P]
    proj = decoder.per_layer_projection_norm(proj.view(*x.shape[:2], n, p))    # [B, S, L, P]
    return (proj + e.view(*x.shape[:2], n, p)) * 2.0 ** -0.5


def add_per_layer(block: nn.Module, h: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
    """h + post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) × ple)): ple [B, S, P]."""
    g = F.gelu(block.per_layer_input_gate(h), approximate="tanh") * ple
    return h + block.post_per_layer_input_norm(block.per_layer_projection(g))


def core_kv(k: torch.Tensor, v: torch.Tensor, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k, v a storing or reuse layer hands its core: copies (module docstring), else k, v themselves."""
    return (k.clone(), v.clone()) if shared else (k, v)


class Carry:
    """The per-layer inputs and stored K/V beside h (module docstring); `run(block, h, args)` calls one block."""

    def __init__(self, ple: torch.Tensor | None):
        self.ple, self.kv = ple, {}

    def run(self, block: nn.Module, h: torch.Tensor, args: tuple) -> torch.Tensor:
        kw = {} if self.ple is None else {"ple": self.ple[:, :, block.index]}
        if block.kv_mode == "reuse":
            kw["kv"] = self.kv[block.kind]
        elif block.kv_mode == "store":
            kw["store"] = True
        out = block(h, *args, **kw)
        if block.kv_mode == "store":
            out, self.kv[block.kind] = out
        return out


def carry(model: nn.Module, ids: torch.Tensor, x: torch.Tensor) -> Carry | None:
    """The Carry of one forward (None for a model without these parts)."""
    a = model.args
    if a.small is None:
        return None
    return Carry(per_layer_inputs(model.model, a, ids, x) if a.small.ple else None)


def run_block(block: nn.Module, h: torch.Tensor, args: tuple, carried: Carry | None) -> torch.Tensor:
    """One block call: plain, or through the Carry."""
    return block(h, *args) if carried is None else carried.run(block, h, args)


def refuse_tiled_attn(a) -> None:
    """--tiled-attn runs each layer's own k/v projections over tiles; a reuse layer has none (module docstring)."""
    if a.small is not None and a.small.kv_shared:
        raise ValueError("--tiled-attn with KV-shared layers (config.json's num_kv_shared_layers, Gemma 4 E2B / E4B): "
                         "the tiles compute each layer's own keys and values, which those layers take from an earlier "
                         "one; drop --tiled-attn (--tiled-mlp and --offload-activations work)")
