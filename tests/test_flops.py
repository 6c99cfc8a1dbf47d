"""Model FLOPs per token (`model.config.flops_per_token`) against torch's own FLOP counter.

Pins:
- a tiny Qwen2-shaped model (GQA, q/k/v bias, untied lm_head), every weight trainable, no activation
  checkpointing, forward + backward of a cross-entropy loss on the logits, counted by
  `torch.utils.flop_counter.FlopCounterMode`, equals `flops_per_token(args, S, causal=False) · B · S`
  exactly. The attention core here is a plain dense masked softmax (what the counter sees as 2
  matmuls forward and 4 backward over all S² pairs, masked or not), hence `causal=False`; the
  causal count is that attention term halved, checked separately;
- the Qwen2.5-7B numbers written out by hand: 7,070,285,824 matmul weights and 62.15 GFLOP per
  token at 32,768 tokens (42.42 matmul + 19.73 attention).

Run: .venv/bin/python -m pytest -q tests/test_flops.py
"""

import json
import os

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from model.attention import AttentionCore
from model.config import ModelArgs, flops_per_token, matmul_params
from model.llama import Transformer


class DenseCausal(AttentionCore):
    """softmax(q·K^T·scale + causal mask)·V with plain matmuls (GQA by repeating K/V heads)."""

    def prepare(self, position_ids):
        return None

    def __call__(self, q, k, v, meta, scale, window=None):
        g = q.shape[2] // k.shape[2]
        q, k, v = (x.repeat_interleave(n, 2).transpose(1, 2) for x, n in ((q, 1), (k, g), (v, g)))
        s = (q @ k.transpose(-1, -2)) * scale                               # [B, H, S, S]
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        p = s.masked_fill(~keep, float("-inf")).softmax(-1)
        return (p @ v).transpose(1, 2)                                      # [B, S, H, Hd]


def test_flops_match_torch_flop_counter():
    args = ModelArgs(model_type="qwen2", vocab_size=96, dim=48, n_layers=2, n_heads=6, n_kv_heads=2,
                     intermediate_size=80, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(args, attention=DenseCausal())
    b, s = 2, 40
    ids = torch.randint(0, args.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    counted = counter.get_total_flops()
    assert all(p.grad is not None for p in model.parameters()), "every weight trained: 6 · P"
    want = flops_per_token(args, s, causal=False) * b * s
    assert counted == want, f"counted {counted} vs formula {want} (diff {counted - want})"
    attn_full = 12 * args.n_layers * s * args.n_heads * args.head_dim
    assert flops_per_token(args, s) == flops_per_token(args, s, causal=False) - attn_full // 2, "causal: half"


def test_flops_qwen25_7b_by_hand():
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "configs", "qwen2.5-7b", "config.json")
    args = ModelArgs.from_config_dict(json.load(open(path)))
    d, f, v = 3584, 18944, 152064
    per_layer = 2 * d * d + 2 * d * 512 + 3 * d * f      # q, o (28 × 128 = d); k, v (4 × 128); MLP
    assert matmul_params(args) == 28 * per_layer + v * d == 7_070_285_824
    attn = 6 * 28 * 32768 * 28 * 128                       # causal: 6 · L · S · H · Hd
    assert flops_per_token(args, 32768) == 6 * 7_070_285_824 + attn
    assert round(flops_per_token(args, 32768) / 1e9, 2) == 62.15
