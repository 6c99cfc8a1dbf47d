"""Attention masks from global token indices, document ids and sliding windows.

Contract:
- `document_ids(position_ids)` -> [B, S] long: the document of every token of a row. A document
  starts where `model.attention.document_starts` says (the one place that rule is written).
- `keep(qi, ki, q_doc=None, k_doc=None, window=None)` -> bool [B or 1, Sq, Sk]: the query at GLOBAL
  index qi[a] sees the key at ki[b] iff ki[b] <= qi[a], both lie in the same document (q_doc [B, Sq]
  vs k_doc [B, Sk], when given) and qi[a] - ki[b] < window (transformers' sliding window: a query
  sees `window` keys, itself included).
- `classify(keep, diagonal)` -> "skip" (nothing visible: call no kernel), "full" (everything
  visible), "causal" (a diagonal block that is exactly causal) or "masked" (needs `keep`).
- `kernel_bias(keep, q, k, causal)` -> (additive 0/-inf bias [B, H, Sq, Sk] in q's dtype, dead rows
  [B, Sq]): rows with no visible key are unmasked in the bias so kernels never see an empty softmax;
  `parallel.kernels` then overwrites them (out 0, lse -inf) and gives them no gradient.
"""

from __future__ import annotations

import torch

from model.attention import document_starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    return document_starts(position_ids).cumsum(1)


def keep(qi, ki, q_doc=None, k_doc=None, window=None) -> torch.Tensor:
    d = qi[:, None] - ki[None, :]                                  # [Sq, Sk]: distance back to the key
    mask = (d >= 0) if window is None else (d >= 0) & (d < window)
    mask = mask[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])   # [B, Sq, Sk]
    return mask


def classify(mask: torch.Tensor, diagonal: bool) -> str:
    if not bool(mask.any()):
        return "skip"
    if bool(mask.all()):
        return "full"
    if diagonal and mask.shape[1] == mask.shape[2]:
        tril = torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
        if bool((mask == tril).all()):
            return "causal"
    return "masked"


def kernel_bias(mask, q, k, causal: bool):
    b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    if mask.dim() != 3 or tuple(mask.shape[1:]) != (sq, sk) or mask.shape[0] not in (1, b):
        raise ValueError(f"mask must be bool [B or 1, Sq, Sk] = [{b}, {sq}, {sk}], got {list(mask.shape)}")
    if causal:
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril()
    dead = ~mask.any(-1)                                           # [B or 1, Sq]
    mask = mask | dead[..., None]
    # Rows padded to 16 keys: CUDA's efficient kernel wants aligned bias strides.
    bias = torch.zeros(mask.shape[0], sq, -(-sk // 16) * 16, dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(~mask, float("-inf"))
    return bias[:, None].expand(b, h, sq, sk), dead.expand(b, sq)
