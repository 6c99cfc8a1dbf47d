"""Model FLOPs per token (`model.flops.flops_per_token`) against torch's own FLOP counter.

Pins:
- a tiny Qwen2-shaped model (GQA, q/k/v bias, untied lm_head), every weight trainable, no activation
  checkpointing, forward + backward of a cross-entropy loss on the logits, counted by
  `torch.utils.flop_counter.FlopCounterMode`, equals `flops_per_token(args, S, causal=False) · B · S`
  exactly. The attention core here is a plain dense masked softmax (what the counter sees as 2
  matmuls forward and 4 backward over all S² pairs, masked or not), hence `causal=False`; the
  causal count is that attention term halved, checked separately;
- the Qwen2.5-7B numbers written out by hand: 7,070,285,824 matmul weights and 62.15 GFLOP per
  token at 32,768 tokens (42.42 matmul + 19.73 attention);
- Qwen3.5's linear layers: their projections' matmuls in place of the attention's, no attention term (the counter,
  with a matmul-free core), the conv and rule as linear_flops_per_token counts them;
- sliding windows (Mistral 7B v0.1: every layer, 4,096; Qwen2 with use_sliding_window on its upper layers): the
  attention term within 0.1% of a count query by query of the keys each sees (min(t + 1, w) for query t); rows no
  longer than the window count as full causal attention, exactly.

Run: .venv/bin/python -m pytest -q tests/test_flops.py
"""

import json
import os

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from model.attention import AttentionCore
from model.config import ModelArgs
from model.flops import flops_per_token, matmul_params
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


def test_moe_flops_match_torch_flop_counter():
    """Qwen3-MoE (4 experts, top 2, block 1 dense): each token's k experts and the router, = the counter's count."""
    from model.moe import MoESpec

    args = ModelArgs(model_type="qwen3_moe", vocab_size=96, dim=48, n_layers=3, n_heads=6, n_kv_heads=2,
                     intermediate_size=80, qk_norm=True, moe=MoESpec(4, 2, 32, True, 1, (1,)))
    torch.manual_seed(0)
    model = Transformer(args, attention=DenseCausal())
    b, s = 2, 40
    ids = torch.randint(0, args.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, s, causal=False) * b * s
    assert args.n_params == sum(p.numel() for n, p in model.named_parameters() if "_norm." not in n or "layernorm" in n)
    # (every weight: the experts' and routers'; n_params leaves out the q/k norms, a Qwen3's too)



def test_shared_expert_flops_match_torch_flop_counter():
    """Qwen3.5-MoE's blocks (every one MoE, full attention here): each token's k experts, the router, the shared expert
    (intermediate_size wide there) and its gate [1, D], = the counter's count; n_params = the model's weights."""
    from model.moe import MoESpec

    args = ModelArgs(model_type="qwen3_5_moe_text", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, intermediate_size=48, qk_norm=True, norm_offset=1.0, attn_gate=True,
                     partial_rotary_factor=0.25, moe=MoESpec(4, 2, 32, True, shared=48))
    torch.manual_seed(0)
    model = Transformer(args, attention=DenseCausal())
    b, s = 2, 40
    ids = torch.randint(0, args.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, s, causal=False) * b * s
    assert args.n_params == sum(p.numel() for n, p in model.named_parameters() if "_norm." not in n or "layernorm" in n)

def test_hybrid_flops_count_linear_layers_in_place_of_attention():
    """Qwen3.5's linear layers (linear, linear, full): their matmuls are linear_attn's five projections, no attention
    term (counter: a stand-in core with no matmul of its own, every projection still trained), the conv and the rule
    `linear_flops_per_token`'s rest; only the full layer's term grows with S."""
    from model.flops import linear_flops_per_token
    from model.linear_layers import LinearSpec

    args = ModelArgs(model_type="qwen3_5_text", vocab_size=96, dim=48, n_layers=3, n_heads=4, n_kv_heads=2,
                     head_dim=16, intermediate_size=80, qk_norm=True, norm_offset=1.0, attn_gate=True,
                     partial_rotary_factor=0.25, linear=LinearSpec(2, 4, 16, 8, 4),
                     layer_types=["linear_attention", "linear_attention", "full_attention"])

    def core(q, k, v, g, beta, conv_w, meta):   # elementwise only (not counted); every input in the graph
        return v + ((g + beta) * 0)[..., None] + (q.sum() + k.sum()) * 0

    torch.manual_seed(0)
    model = Transformer(args, attention=DenseCausal(), linear=type("Core", (), {
        "prepare": lambda self, pos: None, "__call__": lambda self, *a: core(*a)})())
    b, s = 2, 40
    ids = torch.randint(0, args.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    proj = 48 * (2 * 2 * 16 + 4 * 8) + 2 * 48 * 4 * 8 + 2 * 48 * 4   # in_proj_qkv, in_proj_z + out_proj, b + a
    conv_rule = 2 * (linear_flops_per_token(48, 2, 4, 16, 8, 4) - 6 * proj)
    assert counter.get_total_flops() == (flops_per_token(args, s, causal=False) - conv_rule) * b * s
    assert flops_per_token(args, 4 * s) - flops_per_token(args, s) == 6 * 3 * s * args.n_heads * args.head_dim, \
        "only the full layer's attention grows with S"


def test_flops_qwen25_7b_by_hand():
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "configs", "qwen2.5-7b", "config.json")
    args = ModelArgs.from_config_dict(json.load(open(path)))
    d, f, v = 3584, 18944, 152064
    per_layer = 2 * d * d + 2 * d * 512 + 3 * d * f      # q, o (28 × 128 = d); k, v (4 × 128); MLP
    assert matmul_params(args) == 28 * per_layer + v * d == 7_070_285_824
    attn = 6 * 28 * 32768 * 28 * 128                       # causal: 6 · L · S · H · Hd
    assert flops_per_token(args, 32768) == 6 * 7_070_285_824 + attn
    assert round(flops_per_token(args, 32768) / 1e9, 2) == 62.15


def test_flops_sliding_window_counts_the_keys_each_query_sees():
    """mfu's FLOPs on a sliding-window model: a query at position t attends min(t + 1, w) keys (4·Hd FLOPs each
    forward, twice that backward, per head), summed query by query over the row; the formula's S/2 mean becomes the
    window's mean. Until 2026-12-06 the window was ignored: Mistral 7B v0.1 at 32k counted 4.3× its attention FLOPs."""
    mistral = ModelArgs.from_config_dict({
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
        "max_position_embeddings": 32768})
    qwen = ModelArgs.from_config_dict({
        "model_type": "qwen2", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 1000,
        "max_window_layers": 2})   # layers 2 and 3 slide
    assert [qwen.window(i) for i in range(4)] == [None, None, 1000, 1000]
    for args, s in ((mistral, 32768), (mistral, 8192), (qwen, 16384), (qwen, 3000)):
        keys = sum(sum(min(t + 1, args.window(i) or s) for t in range(s)) for i in range(args.n_layers))
        by_hand = 3 * 4 * args.head_dim * args.n_heads * keys / s   # per token, every layer, fwd + bwd
        got = flops_per_token(args, s) - 6 * matmul_params(args)
        assert abs(got - by_hand) <= 1e-3 * by_hand, (args.model_type, s, got, by_hand)
    full = lambda a, s: 6 * a.n_layers * s * a.n_heads * a.head_dim   # S/2 keys a query
    assert flops_per_token(mistral, 4096) == 6 * matmul_params(mistral) + full(mistral, 4096), "within the window"
    assert flops_per_token(mistral, 32768) < 6 * matmul_params(mistral) + full(mistral, 32768) / 3


def test_linear_attention_forward_count():
    """Qwen3.5's Gated DeltaNet sublayer: a third of `linear_flops_per_token` per token = torch's FlopCounterMode over
    its forward (projections, the conv, the chunked rule's matmuls) plus its two unit-triangular solves counted from
    their shapes (c²·d a chunk and head: the counter has no formula for linalg_solve_triangular). S a whole number of
    chunks (the rule pads to one); the conv runs over S + K - 1 outputs before the causal slice: K - 1 more a row."""
    from model.deltanet import GatedDeltaNet
    from model.flops import linear_flops_per_token

    D, Hk, Hv, dk, dv, K, B, S, c = 48, 2, 4, 16, 8, 4, 2, 192, 64
    m = GatedDeltaNet(D, Hk, Hv, dk, dv, K, 1e-6)
    x = torch.randn(B, S, D)
    with FlopCounterMode(display=False) as fc:
        m(x, None)
    solves = B * Hv * (S // c) * c * c * (dk + dv)
    C = 2 * Hk * dk + Hv * dv
    conv_tail = 2 * C * K * (K - 1) * B
    assert fc.get_total_flops() + solves - conv_tail == B * S * linear_flops_per_token(D, Hk, Hv, dk, dv, K) // 3


def test_gemma4_flops_match_torch_flop_counter(tmp_path):
    """Gemma 4 (a tiny Gemma4ForCausalLM config saved by transformers, read as ours: sliding layers 2 KV heads of 16,
    full layers 1 KV head of 32 and no v_proj, attention_k_eq_v; final_logit_softcapping 30): the counter's count over
    forward + backward = flops_per_token(causal=False), each layer at its own H·Hd with k_proj's weights and no v_proj
    on the full layers (every layer as a sliding one until 2026-12-07); the causal count: each layer's keys by hand, the
    sliding layers' within their window of 4 (the softcap's tanh is elementwise: neither counts it)."""
    import transformers as T

    from model.load import read_args
    from tests.test_gemma4 import CONFIG

    T.Gemma4TextConfig(**{**CONFIG, "final_logit_softcapping": 30.0}, attention_k_eq_v=True).save_pretrained(tmp_path)
    args = read_args(str(tmp_path))
    assert args.shares_kv(1) and args.attn_dims(1) == (4, 1, 32) and args.attn_dims(0) == (4, 2, 16)
    torch.manual_seed(0)
    model = Transformer(args, attention=DenseCausal())   # (full causal on every layer: the non-causal count's)
    b, s = 2, 40
    ids = torch.randint(0, args.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert counter.get_total_flops() == flops_per_token(args, s, causal=False) * b * s
    P = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight")) + args.vocab_size * args.dim
    assert matmul_params(args) == P
    for s in (4096, 32768):   # (the formula's S/2 keys a query: within 0.1% of the count, as for the other windows)
        keys = sum(sum(min(t + 1, args.window(i) or s) for t in range(s)) * 4 * args.attn_dims(i)[2]
                   for i in range(args.n_layers))   # per layer: the keys of every query · H · Hd
        by_hand = 3 * 4 * keys / s   # per token, every layer, fwd + bwd
        assert abs(flops_per_token(args, s) - 6 * P - by_hand) <= 1e-3 * by_hand, (s, flops_per_token(args, s), by_hand)


def test_gemma4_moe_flops_keep_the_dense_mlp_by_hand():
    """google/gemma-4-26B-A4B (bench/configs/gemma-4-26b-a4b): its experts run beside every block's dense MLP, so
    matmul_params counts, by hand from the shapes: each layer's attention (25 sliding: q, o [16·256, D], k, v [8·256,
    D]; 5 full: q, o [16·512, D], k [2·512, D], no v_proj), the dense MLP (3·D·F), a token's top 8 experts (3·D·I each)
    and the router [128, D], and lm_head (it subtracted the dense MLP as for Qwen3-MoE, whose experts replace it)."""
    from model.load import read_args

    m = read_args(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs",
                               "gemma-4-26b-a4b"))
    D, dense, width, V = 2816, 2112, 704, 262144
    sliding, full = 2 * 16 * 256 * D + 2 * 8 * 256 * D, 2 * 16 * 512 * D + 2 * 512 * D
    block = 3 * D * dense + 8 * 3 * D * width + 128 * D
    assert matmul_params(m) == 25 * sliding + 5 * full + 30 * block + V * D
    # one key: each layer's QK and PV, 2·2·H·hd forward, x3 with backward
    assert flops_per_token(m, 1, causal=False) - 6 * matmul_params(m) == 12 * 16 * (25 * 256 + 5 * 512)
