"""model/flops.py against a count nobody here wrote: torch's FlopCounterMode over transformers' own models.

Pins (tiny configs saved by transformers and read back by model.load.read_args, float32, CPU, every weight trained):
- forward + backward of a cross-entropy loss, counted by `torch.utils.flop_counter.FlopCounterMode`, equals
  `flops_per_token(args, S, causal=False) · B · S` exactly for Llama, Qwen2 (q/k/v bias), Qwen3-MoE (with
  decoder_sparse_step and mlp_only_layers: dense blocks among the MoE ones), Qwen3.5-MoE on full-attention layers (the
  shared expert and its gate), Gemma 4 dense (sliding and full layers, 512-style wider full heads with their own KV
  heads, attention_k_eq_v: no v_proj there), Gemma 4 MoE (the experts beside the dense MLP, the router) and Gemma 4
  E2B / E4B's parts (tests/test_gemma4_small.py's config: per-layer embeddings' three Linears, the KV-shared layers
  without k/v projections and with double-wide MLPs; and without the wide MLPs, as E4B), Phi-3 (its fused qkv_proj
  and gate_up_proj) and GLM-4.5 (a dense block, then MoE blocks with shared experts of their own width). The
  routing is whatever the random router picks: transformers' eager experts run each expert over the tokens routed to
  it, so the counter sees k expert MLPs a token, exactly what flops.py counts, whatever the choice;
- what the counter counts for attention: transformers' eager attention is two matmuls over all S² pairs, masked or
  not (causal or a sliding window: the mask is added, nothing is skipped), hence `causal=False`, where flops.py counts
  every layer's full square; the causal and windowed counts (S/2 keys a query, the window's mean) are pinned against
  a count query by query in tests/test_flops.py. SDPA: on CPU torch dispatches `_scaled_dot_product_flash_attention_
  for_cpu`, which FlopCounterMode has no formula for, so it counts 0 (checked below); on CUDA its formula for the
  flash / efficient / cuDNN kernels is the full square too (4·S_q·S_k·d a head, is_causal ignored);
- Qwen3.5-MoE's Gated DeltaNet layers (forward): their five projections = flops.py's exactly, the depthwise conv too
  (transformers' runs over S + K - 1 outputs before its causal slice); the chunked rule is not comparable: flops.py
  counts model/deltanet.py's (k·kᵀ, q·kᵀ, scores·fresh, two triangular solves, three state products), transformers'
  torch fallback inverts the chunk's triangle row by row with elementwise ops the counter does not see and runs three
  c²·d products a chunk, so its count is lower (here 30,720 FLOPs a token against flops.py's 38,912: 21% less;
  recorded, not asserted as a contract);
- the RoPE table (inv_freq x positions, no weight) is taken out of the count: transformers 5.17 builds it with a bmm
  the counter sees, 5.25 elementwise; flops.py counts no table.

Run: .venv/bin/python -m pytest -q tests/test_flops_hf.py
"""

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from torch.utils.flop_counter import FlopCounterMode

from model.flops import _linear_proj, flops_per_token, linear_flops_per_token
from model.load import read_args
from tests import test_gemma4, test_gemma4_moe, test_gemma4_small, test_glm4_moe, test_qwen3_5_moe, test_qwen3_moe

B, S = 2, 40
DENSE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=256)
FULL = ["full_attention"] * 4
CASES = {
    "llama": (T.LlamaForCausalLM, T.LlamaConfig, DENSE),
    "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, DENSE),
    "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(test_qwen3_moe.SIZES, norm_topk_prob=True)),
    "qwen3_moe_step2": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
        test_qwen3_moe.SIZES, num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3])),   # only block 1 MoE
    "qwen3_5_moe": (T.Qwen3_5MoeForCausalLM, T.Qwen3_5MoeTextConfig, dict(test_qwen3_5_moe.SIZES, layer_types=FULL)),
    "gemma4": (T.Gemma4ForCausalLM, T.Gemma4TextConfig, dict(test_gemma4.CONFIG, attention_k_eq_v=True)),
    "gemma4_moe": (T.Gemma4ForCausalLM, T.Gemma4TextConfig, test_gemma4_moe.CONFIG),
    "gemma4_e2b": (T.Gemma4ForCausalLM, T.Gemma4TextConfig, dict(test_gemma4_small.SMALL, attention_k_eq_v=True)),
    "gemma4_e4b": (T.Gemma4ForCausalLM, T.Gemma4TextConfig, dict(test_gemma4_small.SMALL, use_double_wide_mlp=False)),
    "phi3": (T.Phi3ForCausalLM, T.Phi3Config, dict(DENSE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                  partial_rotary_factor=0.75)),   # (fused qkv_proj, gate_up_proj)
    "glm4_moe": (T.Glm4MoeForCausalLM, T.Glm4MoeConfig, test_glm4_moe.SIZES),   # (a dense block, shared experts)
}


def _hf(name, tmp_path, **over):
    """(transformers' model, eager attention and experts, float32; our ModelArgs of its saved config.json)."""
    cls, config, cfg = CASES[name]
    c = config(**{**cfg, **over}, experts_implementation="eager")   # (the grouped kernels: no counter formula)
    c._attn_implementation = "eager"
    c.save_pretrained(tmp_path)
    torch.manual_seed(0)
    return cls(c).float(), read_args(str(tmp_path))


@pytest.mark.parametrize("name", list(CASES))
def test_flops_per_token_equal_the_counter_on_transformers_model(name, tmp_path):
    hf, args = _hf(name, tmp_path)
    ids = torch.randint(0, args.vocab_size, (B, S))
    with FlopCounterMode(display=False) as counter:
        logits = hf(ids).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    moe = args.moe is not None and any(args.moe.sparse(i) for i in range(args.n_layers))
    assert moe == name.startswith(("qwen3_moe", "qwen3_5", "gemma4_moe", "glm4_moe")), f"{name}: MoE blocks read"
    assert (args.small is not None) == name.startswith("gemma4_e"), f"{name}: PLE / KV sharing read as such"
    want = flops_per_token(args, S, causal=False) * B * S
    # the RoPE table (inv_freq x positions, once a forward, no weight) is no model FLOP flops.py counts: transformers
    # 5.17 builds it with a bmm the counter counts (d·S: 320 for Llama's head_dim 8 here), 5.25 elementwise (none)
    table = sum(sum(v.values()) for k, v in counter.get_flop_counts().items() if k.endswith(".model.rotary_emb"))
    got = counter.get_total_flops() - table
    assert got == want, f"{name}: counter {got} (less {table} in the RoPE table) vs flops.py {want}"


def test_counter_sees_no_cpu_sdpa():
    """Why the comparisons above run transformers' eager attention: CPU SDPA counts nothing."""
    q = torch.randn(1, 2, 16, 8)
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with FlopCounterMode(display=False) as eager:
        (q @ q.transpose(-1, -2)).softmax(-1) @ q
    assert counter.get_total_flops() == 0 and eager.get_total_flops() == 4 * 2 * 16 * 16 * 8


def test_deltanet_layers_projections_and_conv_equal_the_counter(tmp_path):
    """Qwen3.5-MoE (3 Gated DeltaNet layers, 1 full): each linear layer's projections and conv, forward, = flops.py's
    (module docstring); the rule's difference recorded. S a whole number of the rule's 64-token chunks."""
    hf, args = _hf("qwen3_5_moe", tmp_path, layer_types=test_qwen3_5_moe.TYPES)
    s, n = 64, args.linear
    ids = torch.randint(0, args.vocab_size, (B, s))
    with FlopCounterMode(display=False) as counter:
        hf(ids)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    C, K = 2 * n.k_heads * n.k_dim + n.v_heads * n.v_dim, n.conv_kernel
    for i in (0, 1, 2):
        p = f"Qwen3_5MoeForCausalLM.model.layers.{i}.linear_attn"
        proj = sum(counts[f"{p}.{x}"] for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
        assert proj == 2 * _linear_proj(args) * B * s, f"layer {i}: projections"
        conv = dict(counter.get_flop_counts()[p])[torch.ops.aten.convolution]
        assert conv == 2 * C * K * (s + K - 1) * B, f"layer {i}: conv over S + K - 1 outputs"
        rule = linear_flops_per_token(args.dim, n.k_heads, n.v_heads, n.k_dim, n.v_dim, K) // 3 - 2 * _linear_proj(
            args) - 2 * K * C   # flops.py's forward rule a token
        theirs = (counts[p] - proj - conv) / (B * s)
        assert theirs < rule, f"layer {i}: transformers' rule {theirs} a token vs ours {rule} (module docstring)"
