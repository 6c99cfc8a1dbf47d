"""NEFTune (`--neftune-alpha A`): uniform noise on the token embeddings of the training forwards, the same noise for a
token on every layout. Credit: Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning".

Contract:
- The rule: in each training forward of `--objective sft` (train.py's loop hands the model `noise=`; evaluation, --plan,
  the merge and demo_compare never do), the embedding output in the compute dtype (after model/llama.py's cast, before
  block 0) takes x += A / sqrt(L·d) · u in place: d the hidden size, L the token's own document's length (its sample's;
  with packing each packed document's own, never the row's or the padded length, which change with the layout:
  transformers' neftune_post_forward_hook takes the padded batch length), u uniform in [-1, 1) per element (24 bits).
  Padding takes none. The sum is rounded once into the compute dtype.
- Layout-free: u is a hash of (--seed, the sample's stream position (data/batches.py: step k's samples are the
  positions [k·G, (k+1)·G), one a sample even where a step holds a sample twice), the token's position in its
  document, the channel), never of the rank, the row, the micro-batch, the cp shard, the padding or a process RNG. So
  --cp (Ulysses, ring), --dp-*, --micro-batch (auto too), --pack, AC, offload, the tiled MLP and a resume give a token
  the same noise. The hash is murmur3's 32-bit finalizer in int64 torch ops (values below 2**32, each product split to
  stay below 2**63): the same bits on CPU and CUDA.
- `keys` lays a micro-batch's per-token key [B, S, 3] (stream position, document length, position in it; -1 on
  padding) out as data.collate lays out its rows, and shards it as parallel.cp.shard_batch shards the tokens; the
  model adds the noise of its rank's tokens only (`add_noise`).
- Memory: the noise is made and added in tiles of NOISE_CHUNK elements (int64 temporaries, ~40 bytes an element: ~170
  MB a tile, whatever the context), in forward before block 0, when nothing of the micro-batch is saved yet: below
  every phase the planner counts, so it has no term. What it does count (parallel/plan.py): the embedding output
  changed in place, AC's first checkpoint keeps it, not the token ids (ac._FromIds would look the rows up again
  without the noise): one block input more, as with --train-embeddings.
- The noise is a constant added to x: the gradient that reaches the embedding (--train-embeddings) is unchanged.
"""

from __future__ import annotations

import torch

from parallel.cp import shard_sequence

M32 = 0xFFFFFFFF
NOISE_CHUNK = 2**22   # elements a tile


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2**32 for x in [0, 2**32): c in 16-bit halves, so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer: a bijection of [0, 2**32) whose every output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def token_hash(seed: int, stream: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[n] int64 keys in [0, 2**32): --seed (any int: its two's-complement 64 bits), the stream positions, the
    positions in the document (non-negative int64), each mixed in whole."""
    s = seed % 2**64
    h = _fmix(torch.full_like(stream, s & M32))
    for v in (s >> 32, stream & M32, stream >> 32, pos & M32):
        h = _fmix(h ^ v)
    return h


def add_noise(x: torch.Tensor, keys: torch.Tensor, alpha: float, seed: int) -> None:
    """x [B, S, D] (contiguous, the embedding output) += alpha / sqrt(L·D) · u in place, `keys` [B, S, 3] its
    tokens' (stream position, document length L, position in the document), -1 on padding (module docstring)."""
    if keys.shape[:2] != x.shape[:2] or not x.is_contiguous():
        raise ValueError(f"NEFTune's keys {tuple(keys.shape)} do not lay out the embedding output {tuple(x.shape)}")
    d = x.shape[-1]
    live = keys.reshape(-1, 3)[:, 1] > 0   # (where the keys were built, the host: which tiles to skip, no device sync)
    flat, k = x.view(-1, d), keys.reshape(-1, 3).to(x.device)
    real = k[:, 1] > 0
    h = token_hash(seed, k[:, 0].clamp(min=0), k[:, 2].clamp(min=0))                     # [T]
    scale = torch.where(real, alpha / (k[:, 1].clamp(min=1).double() * d).sqrt(), 0.0).float()   # [T]
    ch = _fmix(torch.arange(d, device=x.device) + 0x9E3779B9 & M32)                      # [D]
    rows = max(1, NOISE_CHUNK // d)
    for i in range(0, flat.shape[0], rows):
        if not bool(live[i:i + rows].any()):
            continue
        u = (_fmix(h[i:i + rows, None] ^ ch) >> 8).float().mul_(2.0**-23).sub_(1.0)      # [n, D] in [-1, 1)
        flat[i:i + rows].add_(u.mul_(scale[i:i + rows, None]))


def keys(lengths, stream, pack: bool, dims, cp_rank: int) -> torch.Tensor:
    """[B, S_local, 3]: each token's (stream position, document length, position in it) for the samples of `lengths`
    at stream positions `stream`, in data.collate's rows (packed in one, or one each padded at the end), this cp
    rank's shard of them (parallel.cp.shard_sequence; -1 on padding)."""
    per = [torch.stack([torch.full((n,), p), torch.full((n,), n), torch.arange(n)], 1) for p, n in zip(stream, lengths)]
    rows = [torch.cat(per)] if pack else per
    full = torch.full((len(rows), max(len(r) for r in rows), 3), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        full[b, :len(r)] = r
    return shard_sequence(full, dims, cp_rank, -1)


class NEFTune:
    """train.py's: `self(step, idxs, i)` is micro-batch i's noise, a callable the model applies to its embedding output
    (`idxs`: the rank's micro-batches of step `step`, data/batches.py's; None for an idle one, which has no sample)."""

    def __init__(self, alpha: float, seed: int, lengths, global_batch: int, data_rank: int, data_ranks: int,
                 pack: bool, dims, cp_rank: int):
        self.alpha, self.seed, self.lengths, self.pack = alpha, seed, lengths, pack
        self.dims, self.cp_rank = dims, cp_rank
        self.global_batch, self.first = global_batch, data_rank * (global_batch // data_ranks)   # (the rank's share)

    @classmethod
    def of_run(cls, args, samples, dims, data_rank: int, cp_rank: int):
        if getattr(args, "neftune_alpha", None) is None:
            return None
        return cls(args.neftune_alpha, args.seed, samples.lengths, args.global_batch, data_rank, dims.dp, args.pack,
                   dims, cp_rank)

    def __call__(self, step: int, idxs: list[list[int]], i: int):
        if not idxs[i]:
            return None
        first = step * self.global_batch + self.first + sum(len(x) for x in idxs[:i])   # micro-batches: consecutive
        k = keys([int(self.lengths[j]) for j in idxs[i]], range(first, first + len(idxs[i])), self.pack, self.dims,
                 self.cp_rank)
        return lambda x: add_noise(x, k, self.alpha, self.seed)
