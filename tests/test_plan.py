"""The memory planner (`train.py --plan`, parallel/plan.py): its terms, its verdicts, its suggestions.

Pins:
- every term for a tiny Qwen2-shaped config (nf4, bf16, cp 2 Ulysses × dp_shard 2, AC) equals arithmetic
  written out here from the shapes, independently of the module's code;
- the quantization-state formula equals the bytes bitsandbytes' own `quantize_4bit` state holds, and the
  no-AC activation terms equal what autograd saves (saved_tensors_hooks) in a real forward of this decoder;
- --dora: its terms by hand from the shapes (the attention phases too, where they set the block's peak), what it
  adds to the activation terms = what it adds to autograd's saved tensors, and `--max-len auto` and the start-up
  check plan with it;
- `--plan` on a layout that does not fit exits non-zero and names what to change; an invalid layout raises
  the run's own validation error (train.py's CLI prints it as "error: <fix>", exit 2);
- `--suggest` lists exactly the layouts that pass the run's validation (checked here through
  `ParallelDims.from_args`), least communication first, and never an invalid one (Ulysses degree 8 with 28
  heads);
- `--plan` reads no weights: bench/configs holds config.json files only.

Run: .venv/bin/python -m pytest -q tests/test_plan.py
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import weakref

import pytest
import torch

import train
from model.config import ModelArgs
from parallel.mesh import ParallelDims, validate
from parallel.plan import memory_plan, quant_state_bytes

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
Q72, Q7 = os.path.join(CONFIGS, "qwen2.5-72b"), os.path.join(CONFIGS, "qwen2.5-7b")


def term(plan, prefix):
    (v,) = [v for k, v in plan.terms.items() if k.startswith(prefix)]
    return v


def run_plan(*flags):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train.main(["--plan", *flags])
    return result, out.getvalue()


def test_terms_by_hand():
    # D 64, 4 heads of 16, 2 KV heads, F 128, 2 layers, V 1000, q/k/v bias; W = dp_shard 2 × cp 2 = 4;
    # bf16 on CUDA (e = 2, LoRA computed in bf16 under mixed precision); T = 256 / cp 2 = 128 tokens.
    m = ModelArgs(model_type="qwen2", vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=128, qkv_bias=True)
    args = train.build_parser().parse_args(["--max-len", "256", "--global-batch", "2", "--quant", "nf4"])
    dims = ParallelDims.from_args(4, 1, -1, 2, "ulysses", None, 4, 2)
    p = memory_plan(m, dims, args, "cuda", pack=True)
    # linears per layer: q 64x64, k 32x64, v 32x64, o 64x64, gate/up 128x64, down 64x128
    n_layer = 4096 + 2048 + 2048 + 4096 + 3 * 8192                     # 36864 weights
    assert term(p, "base weights shard") == 2 * n_layer // 2 // 4       # 4 bits each, 1/4: 9216 B
    # absmax: n/64 uint8 sharded 1/4 (a bf16 parameter, 2 per element) + one fp32 per 256 of them
    # + (16 + 256) fp32 code-books + fp32 offset on every rank
    qs = lambda n: n // 64 // 4 + 4 * 1 + 4 * 273
    assert term(p, "quantization state") == 2 * (2 * qs(4096) + 2 * qs(2048) + 3 * qs(8192)) == 15632
    # embed + lm_head + final norm whole (frozen, not FSDP2's); block norms 16 of 64, biases (64, 32, 32) / 4; bf16
    assert term(p, "embeddings, lm_head") == 2 * (2 * 1000 * 64 + 64) == 256128
    assert term(p, "block norms, biases") == 2 * 2 * (2 * 16 + 16 + 8 + 8) == 256
    # LoRA r 16 sharded on dim 0: A [16, in] -> 4 rows, B [out, 16] -> out/4 rows; 16 B per element
    lora_shard = (4 * 64 + 16 * 16) * 2 + (4 * 64 + 8 * 16) * 2 + (4 * 64 + 32 * 16) * 2 + (4 * 128 + 16 * 16)
    assert term(p, "LoRA params") == 16 * 2 * lora_shard == 131072
    assert term(p, "activations: 1 block checkpoints") == 1 * 128 * 64 * 2   # block 0's: the ids, looked up again
    assert term(p, "activations: rope") == 2 * 128 * 16 * 2
    lora_full = 16 * (64 + 64) * 2 + 16 * (64 + 32) * 2 + 16 * (64 + 128) * 3      # 16384 elements
    block = n_layer // 2 + n_layer // 64 + 2 * 64 * 2 + (64 + 32 + 32) * 2 + lora_full * 2  # + absmax codes
    assert term(p, "FSDP2: 2 unsharded") == 2 * block
    assert term(p, "FSDP2: all-gather") == block + lora_full * (2 + 4)
    # 2 [T, F] grads, residual grad, the norm output rebuilt for gate/up's LoRA A, dequantized down
    mlp = 2 * 2 * 128 * 128 + 2 * 128 * 64 + 2 * 128 * 64 + 128 * 64 * 2
    assert term(p, "| block backward") == mlp == 114688
    saved = (2 * (2 * 128 * 64 + 4 * 128)          # two norms: bf16 input + rsqrt
             + 2 * 128 * 16 * (4 + 2 + 2 + 4) + 4 * 128 * 4   # q, k, v, out + lse (Ulysses 2 <= 2 KV)
             + 2 * 128 * 64                         # o_proj input: heads_to_seq made a new tensor
             + 4 * 2 * 128 * 128                    # gate, silu(gate), up, product
             + 7 * 128 * 16 * 2                     # lora_B inputs
             - 2 * 128 * 64)                        # less the block input: the checkpoint term holds it
    assert term(p, "| block recompute") == saved == 244736     # LoRA A keeps the norms' inputs (above)
    attn = (2 * 128 * 16 * 8 + 4 * 2 * 128 * 64     # dq, dk, dv; K/V and dK/dV expanded to 4 heads
            + 2 * 2 * 128 * 16 * 8)                # all-to-all send + receive copies
    assert attn == 163840 and term(p, "| block attention") == max(0, attn - 4 * 2 * 128 * 128 - mlp) == 0
    assert term(p, "| or: final norm input") == 2 * 128 * 64 + 4 * 128 + 2 * 128 * 64
    c = 128                                        # 256 MiB / (4 B × 1000) tokens > T
    assert term(p, "| or: final norm output") == 2 * 128 * 64 + 4 * c * 1000 + 2 * c * 1000   # (no chunk dh: in place)
    fixed = 9216 + 15632 + 256128 + 256 + 131072 + 16384 + 8192 + 2 * block + block + lora_full * 6
    assert p.peak == fixed + max(244736 + 114688 + 0, 33280 + 784384)
    assert p.total == pytest.approx(p.peak * 1.10 + 1.0e9)


@pytest.mark.parametrize("quant", ["nf4", "none"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["one buffer", "peft's path"])
def test_o_proj_backward_beats_short_attention_buffers_on_pefts_path(monkeypatch, quant, dropout):
    """o_proj's backward, just before the attention kernel's, builds its input gradient in one buffer
    (model.qlora._BaseAndA); on peft's path (LoRA dropout) it holds its base's and LoRA A's input gradients, and
    with a plain base (an nn.Linear: a view, as A's, so autograd sums them out of place) their sum too. A
    16,384-token row past four 1,024-token blocks takes 256-token quarter blocks, whose short kernel buffers
    (dq, dk, dv and the float32 sums go into q's, k's, v's and out's storage) leave the o_proj phase the larger
    on peft's path; with one buffer both stay under the tiled MLP's phase. 28/4 heads of 16, tiled MLP, bf16."""
    from parallel import kernels

    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 1024)
    m = ModelArgs(model_type="qwen2", vocab_size=1000, dim=448, n_layers=2, n_heads=28, n_kv_heads=4,
                  intermediate_size=512)
    args = train.build_parser().parse_args(["--max-len", "16384", "--global-batch", "1", "--quant", quant,
                                            "--tiled-mlp", "--lora-dropout", str(dropout)])
    p = memory_plan(m, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 28, 4), args, "cuda", pack=True)
    e, T, H, K, hd = 2, 16384, 28, 4, 16
    assert kernels.backward_block(T) == 256
    call = e * T * hd * (H + 2 * K) + 4 * T * H * hd + 4 * e * T * H * hd
    attn = 256 / T * (8 * T * K * hd + call)   # key block 0's fp32 sums, one call (the rest: in q, k, v, out)
    oproj = e * T * H * hd * ((3 if quant == "none" else 2) if dropout else 1)
    mlp = term(p, "| block backward")
    assert term(p, "| block attention") == max(0, max(attn + e * T * H * hd, oproj) - mlp)
    assert (oproj > attn + e * T * H * hd) == (dropout > 0), (oproj, attn + e * T * H * hd)


def test_q_k_v_phase_with_offload(monkeypatch):
    """After the attention kernel's backward (term 9): dh, the prefetched next block input (offload), and the largest
    of dq with RoPE's gradient of it and its chunk temporaries, q_proj's input gradient beside it, or the norm's
    gradient with its rebuilt output and one more, beside dk and dv; the block's own saved tensors are gone. With
    4,096-token attention blocks (the kernel's buffers short) it is the block's peak, with offload by one [T, D]
    (the prefetched input) more."""
    from parallel import kernels

    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 4096)
    m = ModelArgs(model_type="qwen2", vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                  intermediate_size=768)
    e, T, D = 4, 16384, 256
    excess = {}
    for offload in (True, False):
        args = train.build_parser().parse_args(["--max-len", str(T), "--global-batch", "1", "--quant", "nf4",
                                                "--tiled-mlp"] + ["--offload-activations"] * offload)
        p = memory_plan(m, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 4, 2), args, "cpu", pack=True)
        qkv = e * T * D * (1 + offload) + max(2 * e * T * D + 3.5 * e * T * D, 2 * e * T * D, 3 * e * T * D) \
            + 2 * e * T * 2 * D // 4   # dk, dv (2 of 4 heads' width each) wait for k's and v's chains
        before = term(p, "| block recompute (AC)") + term(p, "| block backward") + term(p, "| block attention")
        assert term(p, "| block q/k/v") == max(0, qkv - before) and qkv > before, (qkv, before)
        excess[offload] = term(p, "| block q/k/v")
        # 10: not with o_proj's _BaseAndA, whose LoRA B share and residual are summed into its output in place
        assert not any(k.startswith("| block recompute's forward") for k in p.terms), p.terms
    assert excess[True] - excess[False] == e * T * D, excess
    from model.load import read_args

    # on peft's path (LoRA dropout) the recompute's forward at o_proj holds 2 [T, D] over the recompute, with dy
    args = train.build_parser().parse_args(["--max-len", "524288", "--global-batch", "1", "--tiled-mlp",
                                            "--lora-dropout", "0.1"])
    p = memory_plan(read_args(Q7), ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 28, 4), args, "cuda", True)
    rest = term(p, "| block backward") + term(p, "| block attention") + term(p, "| block q/k/v")
    assert term(p, "| block recompute's forward") == max(0, 2 * 2 * 524288 * 3584 - rest)


def test_quant_state_matches_bitsandbytes():
    from bitsandbytes.functional import quantize_4bit

    for shape in [(64, 64), (768, 256), (300, 7)]:
        _, st = quantize_4bit(torch.randn(shape), blocksize=64, compress_statistics=True, quant_type="nf4")
        held = [st.absmax, st.code, st.offset, st.state2.absmax, st.state2.code]
        assert quant_state_bytes(shape[0] * shape[1]) == sum(t.numel() * t.element_size() for t in held), shape


def _saved_and_plan(tmp_path, layers, flags, quant="nf4", dtype=torch.float32, tie=False, **opts):
    """Bytes autograd keeps in one forward at 128 tokens (fp32 unless `dtype`; unique storages, parameters excluded)
    and the plan of the same run flags (`tie`: a model whose head is its input embedding)."""
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, kv_heads=2, head_dim=16, layers=layers, vocab=256, inter=96,
                           max_shard_size="50MB", tie=tie)
    model, _ = build_model(BuildOptions(path, quant=quant, dtype=dtype, **opts), device="cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def pack(t):   # by storage; a tensor freed during forward (its node unreachable) no longer counts
        held[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), weakref.ref(t))
        return t

    ids = torch.randint(0, 256, (1, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1", "--quant",
                                            quant, "--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", *flags])
    dims, pack_rows = validate(args, model.args, 1)
    alive = sum(n for ptr, (n, ref) in held.items() if ptr not in params and ref() is not None)
    del out
    return alive, memory_plan(model.args, dims, args, "cpu", pack_rows)


@pytest.mark.parametrize("tiled,ta,dropout,norms", [(False, False, 0, False), (True, False, 0, False),
                                                    (False, True, 0, False), (True, True, 0, False),
                                                    (False, False, 0.1, False), (True, False, 0.1, False),
                                                    (False, False, 0, True), (True, True, 0, True),
                                                    (False, False, 0.1, True), (False, False, 0, "bf16"),
                                                    (False, False, 0.1, "bf16"), (True, False, 0.1, "bf16"),
                                                    (False, True, 0.1, "bf16"), (False, False, 0, "emb"),
                                                    (True, True, 0.1, "emb"), (False, False, 0, "tied"),
                                                    (True, False, 0.1, "tied_bf16")],
                         ids=["mlp", "tiled_mlp", "tiled_attn", "tiled_both", "mlp_dropout", "tiled_mlp_dropout",
                              "train_norms", "train_norms_tiled_both", "train_norms_dropout", "bf16", "bf16_dropout",
                              "bf16_tiled_mlp_dropout", "bf16_tiled_attn_dropout", "train_embeddings",
                              "train_embeddings_tiled_both_dropout", "tied_train_embeddings",
                              "tied_train_embeddings_bf16_tiled_mlp_dropout"])
def test_activations_match_autograd(tmp_path, tiled, ta, dropout, norms):
    """No AC, fp32, one process: the plan's activation terms vs the tensors autograd keeps for backward (with LoRA
    dropout: each dropped input and its mask, on CPU the scaled float32 mask the product keeps; with --train-norms
    layer 0's first norm keeps its input, and its output needs grad; "emb": --train-embeddings with them, block 0's
    input needs grad and the embedding keeps the ids). "bf16": the CPU's --dtype bf16, LoRA in float32:
    each LoRA A keeps peft's float32 cast of its input, or with dropout the dropped copy of that cast (the cast itself
    not), and down_proj's never the bf16 MLP product."""
    tied = str(norms).startswith("tied")   # a tied model's embedding: the loss saves the head's float32 gradient
    bf16, emb, norms = norms in ("bf16", "tied_bf16"), norms in ("emb", "tied", "tied_bf16"), norms is True or \
        norms == "emb"
    flags = ["--no-ac", "--lora-dropout", str(dropout)] + ["--tiled-mlp"] * tiled + ["--tiled-attn"] * ta + \
        ["--train-norms"] * norms + ["--train-embeddings"] * emb
    saved, p = _saved_and_plan(tmp_path, 2, flags, dtype=torch.bfloat16 if bf16 else torch.float32, ac=False,
                               tiled_mlp=tiled, tiled_attn=ta, lora_dropout=dropout, train_norms=norms,
                               train_embeddings=emb, tie=tied)
    planned = term(p, "activations: saved tensors") + term(p, "activations: rope") + term(p, "| or: final norm in") \
        + (term(p, "tied head's gradient") if tied else 0)
    assert planned == saved


@pytest.mark.parametrize("group,emb", [(2, False), (3, False), (2, True), (3, True)],
                         ids=["2", "3", "2_train_embeddings", "3_train_embeddings"])
def test_ac_group_checkpoints_match_autograd(tmp_path, group, emb):
    """--ac-group G, fp32, one process, 5 blocks: the plan's group-checkpoint term vs the [T, D] block inputs
    autograd keeps outside the checkpoints (saved_tensors_hooks around the forward; the final norm's input,
    planned in the loss phase, is the one more), and G - 1 more inputs in the group recompute term. With
    --train-embeddings the first group's input is the embedding's output, kept (no ids to look up again), and the
    embedding's backward keeps the int64 ids."""
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, kv_heads=2, head_dim=16, layers=5, vocab=256, inter=96,
                           max_shard_size="50MB")
    model, _ = build_model(BuildOptions(path, quant="nf4", dtype=torch.float32, ac=True, ac_group=group,
                                        train_embeddings=emb), device="cpu")
    T, D = 128, model.args.dim
    held = []
    ids = torch.randint(0, 256, (1, T))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        model(ids, labels=ids)
    args = train.build_parser().parse_args(["--model", path, "--max-len", str(T), "--global-batch", "1",
                                            "--ac-group", str(group)] + ["--train-embeddings"] * emb)
    dims, pack_rows = validate(args, model.args, 1)
    p = memory_plan(model.args, dims, args, "cpu", pack_rows)
    kept = -(-5 // group) - (not emb)   # the first group's input: the ids, looked up again (a frozen embedding)
    inputs = held.count(((1, T, D), torch.float32)) - 1
    assert held.count(((1, T), torch.int64)) == emb
    assert term(p, f"activations: {kept} group") == inputs * 4 * T * D + 8 * T * emb == kept * 4 * T * D + 8 * T * emb
    blk = term(p, "FSDP2: 2 unsharded blocks") / 2
    assert term(p, "| block group recompute") == (group - 1) * (4 * T * D + blk)


@pytest.mark.parametrize("emb", [False, True], ids=["frozen_embedding", "train_embeddings"])
def test_offload_host_term_counts_the_block_inputs_moved(tmp_path, emb):
    """--offload-activations, 4 blocks: the plan's host bytes are the block inputs HostOffload moves in a real forward:
    L - 1 (the first checkpoint keeps the token ids) or, with --train-embeddings, L (the first block's input is the
    trained embedding's output, offloaded as the others)."""
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, kv_heads=2, head_dim=16, layers=4, vocab=256, inter=96,
                           max_shard_size="50MB")
    model, _ = build_model(BuildOptions(path, quant="nf4", dtype=torch.float32, ac=True, offload_activations=True,
                                        train_embeddings=emb), device="cpu")
    ids = torch.randint(0, 256, (1, 128))
    model(ids, labels=ids)
    moved = model.model.layers[0].forward.hooks.moved
    args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1",
                                            "--offload-activations"] + ["--train-embeddings"] * emb)
    dims, pack_rows = validate(args, model.args, 1)
    p = memory_plan(model.args, dims, args, "cuda", pack_rows)
    assert moved == 3 + emb and p.host == moved * p.host_each, (moved, p.host / p.host_each)


def test_ac_blocks_activations_match_autograd(tmp_path):
    """--ac-blocks 2 of 4 blocks, fp32, one process: the plan's two activation terms (2 checkpointed inputs,
    the last 2 blocks' saved tensors) vs the bytes autograd keeps (saved_tensors_hooks, unique storages)."""
    saved, p = _saved_and_plan(tmp_path, 4, ["--ac-blocks", "2"], ac=True, ac_blocks=2)
    planned = (term(p, "activations: 1 block checkpoints") + term(p, "activations: saved tensors of the last 2")
               + term(p, "activations: rope") + term(p, "| or: final norm in"))
    assert planned == saved
    assert not [k for k in p.terms if k.startswith("| block recompute")], "no recompute on top of kept blocks"


@pytest.mark.parametrize("flags", [["--no-ac"], ["--ac-blocks", "2"]], ids=["no_ac", "ac_blocks_2_of_3"])
def test_qk_norms_saved_count_the_kv_heads_not_the_kept_blocks(tmp_path, flags):
    """Qwen3's k_norm keeps k_proj's output and rsqrt per KV head: 2 KV heads over 3 blocks, where the plan counted the
    blocks keeping their activations (3 without AC, 1 with --ac-blocks 2) as KV heads; = autograd's saved bytes."""
    import transformers as T

    from parallel.parallelize import BuildOptions, build_model

    cfg = T.Qwen3Config(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=3, head_dim=8,
                        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    T.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    ac = flags != ["--no-ac"]
    model, _ = build_model(BuildOptions(str(tmp_path), ac=ac, ac_blocks=2 if ac else None), device="cpu")
    params, held = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        held[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randint(0, 128, (1, 128)), labels=torch.randint(0, 128, (1, 128)))
    saved = sum(n for ptr, (n, ref) in held.items() if ptr not in params and ref() is not None)
    del out
    args = train.build_parser().parse_args(["--model", str(tmp_path), "--max-len", "128", "--global-batch", "1",
                                            "--dtype", "fp32", *flags])
    dims, pack_rows = validate(args, model.args, 1)
    p = memory_plan(model.args, dims, args, "cpu", pack_rows)
    planned = sum(v for k, v in p.terms.items() if k.startswith(("activations: ", "| or: final norm in")))
    assert planned == saved


def test_dora_terms_by_hand():
    """--dora over the same flags, by hand from the shapes: each adapted projection's magnitude [out] in the LoRA terms
    (fp32 with AdamW, 1/W; unsharded and reduce-scattered with the block), and in the block recompute the fused sum
    `out` [T, out] that the rescale keeps for the magnitude's gradient with the norm and the scale [out] (e bytes);
    no other term moves for this short row, and the peak (the block's: vocab 100) grows by their sum. Then at 524,288
    tokens of Qwen2.5-7B with --tiled-mlp: a tile's DoRA sums in the tiled MLP's phase, and o_proj's DoRA node (dh's
    rescaled copy, [T, D]: model.dora sums the magnitude's gradient over row chunks) under it, no attention phase."""
    m = ModelArgs(model_type="qwen2", vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=128, qkv_bias=True)
    flags = ["--max-len", "128", "--global-batch", "1", "--quant", "nf4"]
    dims = ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 4, 2)
    plain, dora = (memory_plan(m, dims, train.build_parser().parse_args(flags + extra), "cuda", pack=True)
                   for extra in ([], ["--dora"]))
    e, T, L = 2, 128, 2
    outs = [64, 32, 32, 64, 128, 128, 64]                   # q, k, v, o, gate, up, down (out features)
    grow = {"LoRA params": 16 * L * sum(outs),              # W = 1: no padding, no shard
            "FSDP2: 2 unsharded": 2 * e * sum(outs),        # the LoRA tensors in bf16 under mixed precision
            "FSDP2: all-gather": e * sum(outs) + (e + 4) * sum(outs),   # + the fp32 reduce-scatter input
            "| block recompute": e * (T + 2) * sum(outs)}   # out [T, o], norm and scale [o]
    assert plain.terms.keys() == dora.terms.keys()
    for k in plain.terms:
        want = next((v for p, v in grow.items() if k.startswith(p)), 0)
        assert dora.terms[k] - plain.terms[k] == want, k
    loss = sum(v for k, v in dora.terms.items() if k.startswith("| or:"))
    assert term(dora, "| block recompute") > loss and dora.peak - plain.peak == sum(grow.values()) == 155648
    from model.load import read_args

    T, D, F = 524288, 3584, 18944
    q7 = read_args(Q7)
    plain, dora = (memory_plan(q7, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 28, 4), train.build_parser(
        ).parse_args(["--max-len", str(T), "--global-batch", "1", "--tiled-mlp", *extra]), "cuda", True)
        for extra in ([], ["--dora"]))
    assert term(dora, "| block backward at the tiled MLP") - term(plain, "| block backward at the tiled MLP") \
        == e * (D + 2) * (F + F + D)                        # a 3,584-token tile's gate, up and down sums
    assert term(plain, "| block attention") == 0
    assert e * T * D < term(dora, "| block backward at the tiled MLP") and term(dora, "| block attention") == 0
    assert term(dora, "| block recompute (AC)") - term(plain, "| block recompute (AC)") \
        == e * (T + 2) * (D + 512 + 512 + D)                # q, k, v, o (the MLP's run in its tiles)


def test_dora_attention_phases_by_hand():
    """--dora where the attention phase sets the block's peak (Qwen2.5-7B, 131,072 tokens, --tiled-mlp): o_proj's
    DoRA sum [T, D] (in the recompute term) is gone once its node has run, before the kernel's backward, so the
    attention phase's excess falls by it and by the tiled MLP phase's growth (a tile's gate, up and down sums); with
    --tiled-attn one query tile's q, k, v and o sums join the tile instead. The block's peak then grows by q's, k's and
    v's sums alone (still saved then). Untiled, where attention outgrows the freed MLP, the MLP's sums go with it."""
    from model.load import read_args

    e, T, D, F, tt, n = 2, 131072, 3584, 18944, 3584, 16384
    q7 = read_args(Q7)

    def plans(*flags):
        return [memory_plan(q7, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 28, 4), train.build_parser(
            ).parse_args(["--max-len", str(T), "--global-batch", "1", *flags, *extra]), "cuda", True)
            for extra in ([], ["--dora"])]

    tile = e * (tt + 2) * (F + F + D)                       # the tiled MLP phase's growth
    plain, dora = plans("--tiled-mlp")
    assert term(plain, "| block attention") > 0 and term(dora, "| block attention") > 0, "the attention phase counts"
    assert term(dora, "| block backward at the tiled MLP") - term(plain, "| block backward at the tiled MLP") == tile
    assert term(dora, "| block attention") - term(plain, "| block attention") == -(e * (T + 2) * D + tile)
    block = lambda p: sum(v for k, v in p.terms.items() if k.startswith("| block"))
    assert block(dora) - block(plain) == e * (T + 2) * (D + 512 + 512)   # q, k, v's sums wait for their nodes
    plain, dora = plans("--tiled-mlp", "--tiled-attn")
    assert term(plain, "| block attention in") > 0 and term(dora, "| block attention in") > 0
    assert term(dora, "| block attention in") - term(plain, "| block attention in") \
        == e * (n + 2) * (D + 512 + 512 + D) - tile         # one 16,384-row query tile's q, k, v, o sums
    # untiled, 32 query heads of 128 over hidden 1,024 (the kernel's buffers outgrow the freed MLP): gate's, up's and
    # down's sums are gone with the MLP's tensors, and o_proj's with its node
    m = ModelArgs(model_type="qwen3", vocab_size=1000, dim=1024, n_layers=4, n_heads=32, n_kv_heads=8, head_dim=128,
                  intermediate_size=1536)
    T, D, F = 8192, 1024, 1536
    plain, dora = (memory_plan(m, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 32, 8), train.build_parser(
        ).parse_args(["--max-len", str(T), "--global-batch", "1", *extra]), "cuda", True) for extra in ([], ["--dora"]))
    assert term(plain, "| block attention") > 0 and term(dora, "| block attention") > 0
    assert term(dora, "| block attention") - term(plain, "| block attention") == -e * (T + 2) * (F + F + D + D)


@pytest.mark.parametrize("flags", [[], ["--lora-dropout", "0.1"], ["--tiled-mlp"], ["--tiled-attn"]],
                         ids=["fused", "dropout", "tiled_mlp", "tiled_attn"])
def test_dora_activations_match_autograd(tmp_path, flags):
    """No AC, fp32, one process: what --dora adds to the plan's activation terms = what it adds to the tensors
    autograd keeps (saved_tensors_hooks) in a real forward with DoRA, on the fused path (the sum, the norm and the
    scale per projection), on peft's formula with LoRA dropout (model.dora.forward: the base's and LoRA's shares, the
    dequantized weight F.linear keeps, none of them at layer 0's q/k/v for the weight) and with the tiled MLP or
    attention, whose projections keep theirs only inside a tile."""
    opts = {"lora_dropout": 0.1} if flags[:1] == ["--lora-dropout"] else {
        f.lstrip("-").replace("-", "_"): True for f in flags}
    got = {}
    for dora in (False, True):
        saved, p = _saved_and_plan(tmp_path / str(dora), 2, ["--no-ac", *flags] + ["--dora"] * dora, ac=False,
                                   dora=dora, **opts)
        got[dora] = saved, term(p, "activations: saved tensors")
    assert got[True][0] - got[False][0] == got[True][1] - got[False][1] > 0, got


@pytest.mark.parametrize("quant,dropout", [("none", 0.0), ("nf4", 0.0), ("none", 0.1), ("nf4", 0.1)],
                         ids=["none", "nf4", "none_dropout", "nf4_dropout"])
def test_dora_activations_match_autograd_in_cpu_bf16(tmp_path, quant, dropout):
    """No AC, the CPU's --dtype bf16 (LoRA in float32: every DoRA layer takes peft's formula, x cast): what --dora adds
    to the plan's activation terms = what it adds to autograd's saved tensors. Without dropout the base's share is
    the base layer's own bf16 output; with it F.linear's float32 output (model.dora._FrozenLinear keeps no weight)."""
    got = {}
    for dora in (False, True):
        saved, p = _saved_and_plan(tmp_path / str(dora), 2, ["--no-ac", "--lora-dropout", str(dropout)]
                                   + ["--dora"] * dora, quant=quant, dtype=torch.bfloat16, ac=False, dora=dora,
                                   lora_dropout=dropout)
        got[dora] = saved, term(p, "activations: saved tensors")
    assert got[True][0] - got[False][0] == got[True][1] - got[False][1] > 0, got


def test_dora_max_len_auto_and_the_start_up_check():
    """`--plan --dora --max-len auto` searches with DoRA's terms (the length fits with --dora, 1,024 more do not, and it
    is shorter than without), and the run's start-up check (parallel/preflight_memory.py) plans them: on a device
    between the two plans' totals a plain run is told it fits, a --dora run is warned."""
    from model.load import read_args
    from parallel import budgets, preflight_memory

    flags = ["--tiled-mlp", "--dora"]
    found = {}
    for f in (flags[:1], flags):
        _, out = run_plan("--model", Q7, "--max-len", "auto", "--gpu-mem", "141", "--global-batch", "1", *f)
        found[len(f)] = int(re.fullmatch(r"max_len (\d+)", out.strip().splitlines()[-1]).group(1))
    n = found[2]
    assert _fits_at(n, flags, 1, 141, 512) and not _fits_at(n + 1024, flags, 1, 141, 512) and n < found[1], found
    said = {}
    for dora in (False, True):
        args = train.build_parser().parse_args(["--model", Q7, "--max-len", "32768", "--global-batch", "1",
                                                "--dtype", "bf16"] + ["--dora"] * dora)
        margs = read_args(Q7)
        dims, _ = validate(args, margs, 1)
        said[dora] = []
        p = preflight_memory.check(args, margs, dims, [budgets.Budget(0, "cuda", 26.5e9, "26.5 GB (test)", float("inf"),
                                                                        "", "m")], said[dora].append)
        assert p.total == memory_plan(margs, dims, args, "cuda", True).total
    assert said[False][0].startswith("memory: planned 24.9 GB"), said
    assert said[True][0].startswith("warning: planned 28.5 GB per rank") and "Step 1 may run out" in said[True][0], said


def test_plan_names_the_fewest_ac_blocks_that_fit():
    _, out = run_plan("--model", Q7, "--max-len", "32768", "--gpu-mem", "141", "--dtype", "bf16",
                      "--global-batch", "1")
    n = int(re.search(r"faster: --ac-blocks (\d+) also fits", out).group(1))
    assert 0 < n < 28, out
    for k, fits in ((n, True), (n - 1, False)):
        args = train.build_parser().parse_args(["--model", Q7, "--max-len", "32768", "--dtype", "bf16",
                                                "--global-batch", "1", "--ac-blocks", str(k)])
        from model.load import read_args
        dims, pack = validate(args, read_args(Q7), 1)
        assert (memory_plan(read_args(Q7), dims, args, "cuda", pack).total <= 0.95 * 141e9) == fits, k
    # a short context fits with no block recomputed: said as the flag that does it (until 2026-12-04 "--ac-blocks 0")
    _, out = run_plan("--model", Q7, "--max-len", "2048", "--gpu-mem", "141", "--dtype", "bf16", "--global-batch", "1")
    assert "faster: --no-ac also fits" in out and "--ac-blocks 0" not in out, out
    _, out = run_plan("--model", Q7, "--max-len", "2048", "--gpu-mem", "141", "--dtype", "bf16", "--global-batch", "1",
                      "--no-ac")
    assert "fits: " in out, out


@pytest.mark.parametrize("gpu, hint", [("141", "--ac-keep-attn"), ("30", "--tiled-mlp --ac-keep-attn")])
def test_plan_names_ac_keep_attn_when_it_fits(gpu, hint):
    """A plan that fits with plain AC names --ac-keep-attn (else with --tiled-mlp) when that fits in 95% of the
    device: 32k Qwen2.5-7B fits it alone on 141 GB; on 30 GB only with the tiled MLP."""
    from model.load import read_args

    _, out = run_plan("--model", Q7, "--max-len", "32768", "--gpu-mem", gpu, "--dtype", "bf16", "--global-batch", "1")
    assert f"faster: {hint} also fits" in out, out
    base = ["--model", Q7, "--max-len", "32768", "--dtype", "bf16", "--global-batch", "1", "--ac-keep-attn"]
    for flags, fits in (([], gpu == "141"), (["--tiled-mlp"], True)):
        args = train.build_parser().parse_args(base + flags)
        dims, pack = validate(args, read_args(Q7), 1)
        assert (memory_plan(read_args(Q7), dims, args, "cuda", pack).total <= 0.95 * float(gpu) * 1e9) == fits, flags


def test_plan_with_ac_keep_attn_suggests_only_what_the_run_accepts():
    """With --ac-keep-attn the fewest --ac-blocks is at least 1 (0 is refused with it), and the memory fixes that
    refuse it (--ac-group, offload) are offered with it dropped, each one a configuration the run accepts."""
    _, out = run_plan("--model", Q7, "--max-len", "32768", "--gpu-mem", "80", "--ac-keep-attn", "--global-batch", "1")
    n = int(re.search(r"faster: --ac-blocks (\d+) also fits", out).group(1))
    assert n >= 1, out
    with pytest.raises(SystemExit) as e:
        run_plan("--model", Q7, "--max-len", "131072", "--gpu-mem", "80", "--ac-keep-attn", "--global-batch", "1")
    assert "--ac-group 2 (no --ac-keep-attn)" in str(e.value) and "no --ac-keep-attn (" in str(e.value), e.value
    _, out = run_plan("--model", Q7, "--max-len", "131072", "--gpu-mem", "80", "--ac-group", "2", "--global-batch", "1")
    assert "fits: " in out, out


@pytest.mark.parametrize("mode", [["--max-len", "auto"], ["--suggest", "--max-len", "auto"],
                                  ["--suggest", "--max-len", "32768"]], ids=" ".join)
def test_searches_refuse_bad_ac_blocks_first(mode):
    """The searches try many layouts and skip what `validate` refuses: a bad flag must not read as 'nothing
    fits'; it is refused before any search, with the run's message."""
    for bad, msg in ((["--ac-blocks", "99"], "--ac-blocks 99 is more than the model's 28 blocks"),
                     (["--ac-blocks", "-1"], "--ac-blocks must be >= 0"),
                     (["--ac-blocks", "0", "--offload-activations"], "--ac-blocks 0 with --offload-activations")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            run_plan("--model", Q7, "--gpu-mem", "141", "--global-batch", "1", *mode, *bad)


def test_ac_blocks_is_kept_by_suggest_and_dropping_it_is_a_fix():
    _, out = run_plan("--suggest", "--model", Q7, "--max-len", "auto", "--gpu-mem", "141", "--host-mem", "512",
                      "--global-batch", "1", "--ac-blocks", "20")
    assert out.strip().splitlines()[-2].endswith("--ac-blocks 20"), out
    assert "--ac-group" not in out, "--ac-group cannot go with --ac-blocks: not suggested"
    with pytest.raises(SystemExit, match=r"no --ac-blocks \(AC on every block\) \(\d"):
        run_plan("--model", Q7, "--max-len", "131072", "--gpu-mem", "141", "--global-batch", "1",
                 "--ac-blocks", "4")


def test_plan_does_not_fit_names_the_fix():
    assert sorted(os.listdir(Q72)) == ["config.json"] and sorted(os.listdir(Q7)) == ["config.json"]
    common = ["--model", Q72, "--max-len", "32768", "--world-size", "4", "--global-batch", "4"]
    with pytest.raises(SystemExit) as exc:   # pure FSDP at 32k: the failure this project started from
        run_plan(*common, "--gpu-mem", "80")
    msg = str(exc.value.code)
    assert exc.value.code != 0 and "does not fit" in msg and "> 80.0 GB per GPU" in msg, msg
    assert "--cp 2 --dp-shard 2 --cp-impl ulysses" in msg, msg
    with pytest.raises(SystemExit) as exc:
        run_plan(*common, "--gpu-mem", "0.001")
    assert exc.value.code != 0 and "does not fit" in str(exc.value.code)
    msg = str(exc.value.code)   # it names the memory flags not on yet, and only those
    assert "no single change fits: combine --tiled-mlp, --tiled-attn, --offload-activations; lower --max-len" in msg
    with pytest.raises(SystemExit) as exc:
        run_plan(*common, "--gpu-mem", "0.001", "--tiled-mlp", "--offload-activations", "--cp", "2", "--dp-shard", "2")
    msg = str(exc.value.code)
    assert "no single change fits: every memory flag is on; lower --max-len, or use more ranks (a larger --cp)" in msg
    with pytest.raises(SystemExit) as exc:
        run_plan(*common, "--gpu-mem", "0.001", "--ac-keep-attn", "--ac-blocks", "2")
    msg = str(exc.value.code)
    assert "combine --tiled-mlp, --tiled-attn (without --ac-keep-attn), --offload-activations (without " \
           "--ac-keep-attn), and drop --ac-blocks and --ac-keep-attn; lower --max-len" in msg, msg
    plan, out = run_plan(*common, "--gpu-mem", "80", "--cp", "2", "--dp-shard", "2")
    assert "fits: " in out and "base weights shard" in out and plan.total < 80e9


def test_plan_names_tiled_attn_where_the_tiled_mlp_alone_does_not_fit():
    """Qwen2.5-7B NF4 at 532,480 tokens on 141 GB: the tiled MLP alone is over; the fixes name both tilings."""
    with pytest.raises(SystemExit) as exc:
        run_plan("--model", Q7, "--max-len", "532480", "--world-size", "1", "--gpu-mem", "141", "--global-batch", "1",
                 "--tiled-mlp")
    msg = str(exc.value.code)
    assert "does not fit" in msg and re.search(r"--tiled-mlp --tiled-attn \(1[34]\d\.\d GB\)", msg), msg


def test_plan_max_len_auto_raises_the_runs_error_when_no_length_can_fix_it():
    """--tiled-attn with --cp 2 is refused at any length: --max-len auto says why, not "not even 1,024 fits"."""
    with pytest.raises(ValueError, match="--tiled-attn with --cp 2: .* drop one of them"):
        run_plan("--model", Q7, "--max-len", "auto", "--world-size", "2", "--cp", "2", "--gpu-mem", "141",
                 "--global-batch", "1", "--tiled-attn")


def test_a_run_given_max_len_auto_is_told_to_ask_the_planner(capsys):
    """--max-len auto is the planner's search: a run (no --plan) refuses it at parsing, before anything is read or
    written, with the command that prints the number; the planner itself takes both spellings."""
    for argv in (["--max-len", "auto"], ["--max-len=auto"]):
        with pytest.raises(SystemExit) as exc:
            train.main([*argv, "--model", Q7, "--data", "none.jsonl"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "'auto' is the planner's search" in err and "--plan --max-len auto" in err, err
        last = run_plan(*argv, "--model", Q7, "--gpu-mem", "141", "--tiled-mlp")[1].splitlines()[-1]
        assert re.fullmatch(r"max_len \d+", last) and int(last.split()[1]) >= 524288, last   # issue 13's goal
    for given, n in (("32k", 32768), ("128K", 131072), ("1M", 1048576)):   # (said so, typed so: the number named)
        with pytest.raises(SystemExit) as exc:
            train.main(["--max-len", given, "--model", Q7, "--data", "none.jsonl"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"'{given}' is not a whole number of tokens: write it out, --max-len {n} " \
            f"({given} as context lengths count, in 1024s)" in err, err


@pytest.mark.parametrize("flags,said", [(["--gpu-mem", "0"], "--gpu-mem must be a positive number of GB, got 0.0"),
                                        (["--gpu-mem", "nan"], "--gpu-mem must be a positive number of GB, got nan"),
                                        (["--host-mem", "inf"], "--host-mem must be a positive number of GB, got inf"),
                                        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
                                        (["--data", "x.jsonl"], "--plan needs --model DIR")])
def test_the_planners_own_flags_are_checked(capsys, flags, said):
    """(until 2026-12-04: --gpu-mem 0 and --world-size 0 read as not given, NaN planned as nothing fitting, --data
    without --model a TypeError traceback)"""
    with pytest.raises(SystemExit) as exc:   # (with --data and no --model: no model)
        run_plan(*([] if "--data" in flags else ["--model", Q7]), "--max-len", "4096", *flags)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_plan_searches_keep_cp_layouts_open_without_tiled_attn():
    """--tiled-attn runs one process's attention, so a CP layout is named with "(no --tiled-attn)" instead of
    silently vanishing from the fixes and from --suggest --max-len auto."""
    with pytest.raises(SystemExit) as exc:
        run_plan("--model", Q7, "--max-len", "1048576", "--world-size", "8", "--gpu-mem", "141", "--global-batch", "8",
                 "--tiled-mlp", "--tiled-attn")
    assert "--cp 4 --dp-shard 2 --cp-impl ulysses (no --tiled-attn) (" in str(exc.value.code), exc.value.code
    rows, out = run_plan("--suggest", "--model", Q7, "--max-len", "auto", "--world-size", "4", "--gpu-mem", "80",
                         "--host-mem", "256", "--global-batch", "4", "--tiled-mlp", "--tiled-attn")
    lines = out.strip().splitlines()
    assert lines[-1] == "max_len 4235264" and lines[-2].startswith("flags: --cp 4 "), out
    # pasteable: the note after a '#', and the user's --tiled-attn not added back to a CP layout
    flags, note = lines[-2].split("  # ")
    assert "(" not in flags and "--tiled-attn" not in flags and note.startswith("without --tiled-attn"), out
    assert any(f.startswith("--cp 1 ") and "no --tiled-attn" not in f for _, f in rows), out


@pytest.mark.parametrize("flags, pattern", [
    (["--cp", "8", "--cp-impl", "ulysses"], r"28 attention heads are not divisible by the Ulysses degree 8"),
    (["--cp", "8", "--lr", "nan"], r"--lr must be a finite number"),
    (["--cp", "3"], r"cannot infer --dp-shard: world size 8"),
    (["--cp", "2", "--global-batch", "6"], r"--global-batch 6 must be a multiple of"),
    (["--cp", "2", "--tiled-attn"], r"--tiled-attn with --cp 2: .* drop one of them"),
])
def test_plan_invalid_layout_uses_the_runs_checks(flags, pattern):
    with pytest.raises(ValueError, match=pattern):   # what the run raises; train.py's CLI prints "error: ..."
        run_plan("--model", Q7, "--max-len", "131072", "--world-size", "8", "--gpu-mem", "80", *flags)


# bad configurations of a 1-rank run on the demo-sized fixture: train.py and --plan must refuse each alike
SAME_REFUSALS = [["--dp-shard", "2"], ["--cp", "2", "--cp-impl", "ulysses", "--max-len", "1"],
                 ["--global-batch", "6", "--micro-batch", "4"], ["--lr", "inf"], ["--steps", "0"],
                 ["--lora-alpha", "0"], ["--lora-targets", "q_proj,nope"], ["--lora-dropout", "1"],
                 ["--timeout", "-1"], ["--ac-group", "0"], ["--ac-group", "3", "--offload-activations"],
                 ["--ac-blocks", "-1"], ["--ac-blocks", "1", "--no-ac"], ["--ac-blocks", "1", "--ac-group", "2"],
                 ["--ac-blocks", "9"], ["--ac-keep-attn", "--no-ac"], ["--ac-keep-attn", "--ac-group", "2"],
                 ["--ac-keep-attn", "--offload-activations"], ["--ac-keep-attn", "--ac-blocks", "0"],
                 ["--tiled-attn", "--ac-keep-attn"], ["--offload-activations", "--no-ac"], ["--ac-group", "9"],
                 ["--lora-r", "17"], ["--data-cache", ""]]


def test_an_empty_data_cache_is_refused_not_taken_as_off():
    """--data-cache "" (an unset variable) turned the token cache off without a word; now it is refused, naming
    `none` for that (review, helper 80)."""
    from parallel.flags import check_flags

    with pytest.raises(ValueError, match="--data-cache is empty \\(an unset variable\\?\\): pass a directory, or none"):
        check_flags(train.build_parser().parse_args(["--data-cache", ""]))
    check_flags(train.build_parser().parse_args(["--data-cache", "none"]))


@pytest.mark.parametrize("flags", SAME_REFUSALS, ids=lambda f: " ".join(f))
def test_run_and_plan_refuse_the_same_configurations(assets, tmp_path, flags):
    from tests.helpers import startup_error, train_argv

    argv = train_argv(assets, str(tmp_path / "out"), *flags)
    run_msg = startup_error(argv)
    with pytest.raises(ValueError) as e:
        run_plan(*argv)
    assert str(e.value) == run_msg


def test_help_lists_run_flags_and_plan_help_planner_flags(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    run_help = capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.main(["--plan", "--help"])
    plan_help = capsys.readouterr().out
    for flag in ("--suggest", "--gpu-mem", "--world-size"):
        assert flag not in run_help and flag in plan_help, flag
    assert "--lr" in run_help and "--max-len" in plan_help
    # PLAN_FLAGS (a run given one is told to add --plan) are exactly the planner's own: the list cannot drift
    from parallel.plan_cli import PLAN_FLAGS
    flags = lambda text: set(re.findall(r"^  (--[a-z][a-z0-9-]*)", text, re.M))   # each option's own line
    assert flags(plan_help) - flags(run_help) == set(PLAN_FLAGS), flags(plan_help) - flags(run_help)


def _listed(out):
    out = out.split("\nnot listed, the run's checks refuse them:")[0]   # (the refused layouts, with why: after it)
    rows = re.findall(r"--cp (\d+) --dp-shard (\d+)(?: --cp-impl (\w+))?(?: --ulysses-degree (\d+))?", out)
    assert all(impl or c == "1" for c, s, impl, u in rows), out   # (--cp-impl: where cp > 1 only)
    return [(int(c), int(s), impl or "ulysses", int(u) if u else None) for c, s, impl, u in rows]


def test_suggest_lists_only_valid_layouts():
    common = ["--suggest", "--model", Q7, "--max-len", "131072", "--world-size", "8", "--global-batch", "8"]
    # every layout of 8 ranks that the run's validation accepts, by brute force over the flags, as the
    # resolved (cp, dp_shard, ring, ulysses) (hybrid with ring 1 is the Ulysses layout, listed once)
    valid = set()
    for cp in (1, 2, 4, 8):
        for impl, u in [("ulysses", None), ("ring", None), ("hybrid", 2), ("hybrid", 4)]:
            try:
                d = ParallelDims.from_args(8, 1, -1, cp, impl, u, 28, 4)
            except ValueError:
                continue
            valid.add((d.cp, d.dp_shard, d.ring, d.ulysses))
    assert (8, 1, 1, 8) not in valid and (8, 1, 2, 4) in valid   # 28 heads: Ulysses degree 8 is refused
    rows, out = run_plan(*common, "--gpu-mem", "10000")   # everything fits: the list is the valid set
    listed = []
    for cp, shard, impl, u in _listed(out):   # each line must pass the run's own validation
        d = ParallelDims.from_args(8, 1, shard, cp, impl, u, 28, 4)
        listed.append((d.cp, d.dp_shard, d.ring, d.ulysses))
    assert set(listed) == valid and len(listed) == len(valid), out
    assert listed == sorted(listed, key=lambda x: (x[0], x[2])), "least communication first: small cp, ring"
    assert "not listed, the run's checks refuse them:\n  --cp 8 --dp-shard 1 --cp-impl ulysses: --cp-impl ulysses " \
        "with --cp 8: the 28 attention heads are not divisible by the Ulysses degree 8" in out, out   # (said)
    rows, out = run_plan(*common, "--gpu-mem", "30")   # 128k tokens of 7B on 30 GB: cp 4 and 8 (~23, ~14 GB)
    fit = _listed(out)
    assert fit and len(fit) < len(valid) and all(c >= 4 for c, *_ in fit), out


def test_plan_says_a_max_len_past_the_models_context_as_the_run_does():
    """--plan past max_position_embeddings prints the run's own start-up warning (ModelArgs.beyond_context), with
    the scaling that would cover it; within it, nothing (review, helper 81: only the run said it)."""
    from model.load import read_args

    _, out = run_plan("--model", Q7, "--max-len", "262144", "--gpu-mem", "1000")
    assert read_args(Q7).beyond_context(262144) in out.splitlines() and "--rope-scaling yarn:2" in out, out
    _, out = run_plan("--model", Q7, "--max-len", "131072", "--gpu-mem", "1000")
    assert "reaches past" not in out, out


def test_sliding_window_models_are_planned_not_refused():
    m = ModelArgs(model_type="mistral", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, sliding_window=4096)
    flags = ["--max-len", "4096", "--micro-batch", "2", "--global-batch", "2"]
    assert validate(train.build_parser().parse_args(flags + ["--no-pack"]), m, 1)[1] is False
    assert validate(train.build_parser().parse_args(flags), m, 1)[1] is True, "packed rows longer than the window"


def _fits_at(n, flags, world, gpu, host):
    from model.load import read_args

    args = train.build_parser().parse_args(["--model", Q7, "--max-len", str(n), "--global-batch", "1", *flags])
    margs = read_args(Q7)
    dims, pack = validate(args, margs, world)
    p = memory_plan(margs, dims, args, "cuda", pack)
    return p.total <= gpu * 1e9 and p.host <= host * 1e9


@pytest.mark.parametrize("world, flags, gpu, host, goal", [
    (1, ["--tiled-mlp"], 141, 512, 524_288),
    (1, ["--tiled-mlp", "--tiled-attn"], 141, 512, 524_288),
    (1, ["--tiled-mlp", "--ac-group", "2"], 141, 512, 524_288),
    (1, ["--tiled-mlp", "--offload-activations"], 141, 512, 1_200_000),
    (4, ["--cp", "4", "--tiled-mlp", "--offload-activations"], 80, 256, 2_097_152),
])
def test_max_len_auto_finds_the_longest(world, flags, gpu, host, goal):
    """The issue's goals for Qwen2.5-7B NF4; the answer fits and 1,024 more tokens do not."""
    _, out = run_plan("--model", Q7, "--max-len", "auto", "--world-size", str(world), "--gpu-mem", str(gpu),
                      "--host-mem", str(host), "--global-batch", "1", *flags)
    last = out.strip().splitlines()[-1]
    n = int(re.fullmatch(r"max_len (\d+)", last).group(1))
    assert n % 1024 == 0 and n >= goal, out
    assert _fits_at(n, flags, world, gpu, host) and not _fits_at(n + 1024, flags, world, gpu, host)
    if "--offload-activations" not in flags:
        return
    # host memory binds too: a quarter of the checkpoints' host bytes cannot fit that length
    _, out = run_plan("--model", Q7, "--max-len", "auto", "--world-size", str(world), "--gpu-mem", str(gpu),
                      "--host-mem", str(host / 8), "--global-batch", "1", *flags)
    assert int(out.strip().split()[-1]) < n, out


@pytest.mark.parametrize("gpu, want", [(77, 271_360), (75.2, 264_192)])
def test_max_len_auto_looks_past_the_attention_backwards_smaller_blocks(gpu, want):
    """Past 4 backward blocks a row (262,144 tokens) the attention backward runs in blocks a quarter as long
    (kernels.backward_block) and the plan falls (Qwen2.5-7B NF4, --tiled-mlp: 77.2 GB at 262,144, 74.7 at 263,168):
    on a device between the two, the longest that fits lies past the fall, where one search from below stopped
    (261,120 on 77 GB, 253,952 on 75.2; review, helper 81). The answer fits, the next 1,024 tokens do not."""
    _, out = run_plan("--model", Q7, "--max-len", "auto", "--world-size", "1", "--gpu-mem", str(gpu),
                      "--global-batch", "1", "--tiled-mlp")
    n = int(re.fullmatch(r"max_len (\d+)", out.strip().splitlines()[-1]).group(1))
    assert n == want and _fits_at(n, ["--tiled-mlp"], 1, gpu, 512) and not _fits_at(n + 1024, ["--tiled-mlp"], 1,
                                                                                      gpu, 512), out
    assert _fits_at(262_144 + 1024, ["--tiled-mlp"], 1, gpu, 512) and not _fits_at(262_144, ["--tiled-mlp"], 1, gpu,
                                                                                       512), "not the case it pins"


def test_host_memory_refusal_rounds_both_sides_alike():
    """The host check's two numbers at one precision (review, helper 81: "3.5 GB of offloaded checkpoints >
    --host-mem 4 GB", the flag rounded to a whole GB, read as a contradiction)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        train.main(["--plan", "--model", Q7, "--world-size", "8", "--cp", "8", "--max-len", "146432", "--tiled-mlp",
                    "--offload-activations", "--gpu-mem", "80", "--host-mem", "3.53"])
    said = str(e.value) + out.getvalue()
    assert "3.54 GB of offloaded checkpoints > --host-mem 3.53 GB per rank" in said, said
    assert "(--host-mem 3.53 GB)" in said, said


def test_suggest_max_len_auto_names_the_flags():
    rows, out = run_plan("--suggest", "--model", Q7, "--max-len", "auto", "--gpu-mem", "141", "--host-mem", "512",
                         "--global-batch", "1")
    lines = out.strip().splitlines()
    # with offload the 512 GB of host memory binds: --tiled-attn adds no length; the tie keeps the search order
    assert lines[-2] == "flags: --cp 1 --dp-shard 1 --tiled-mlp --offload-activations", out   # (no --cp-impl at cp 1)
    assert lines[-1] == f"max_len {rows[0][0]}" and rows[0][0] == max(n for n, _ in rows) == rows[1][0], out
    assert [n for n, _ in rows] == sorted((n for n, _ in rows), reverse=True) and len(rows) == 9, out
    assert [f.split("--dp-shard 1")[-1].strip() for _, f in rows] == [
        "--tiled-mlp --offload-activations", "--tiled-mlp --tiled-attn --offload-activations",
        "--tiled-mlp --tiled-attn --ac-group 4", "--tiled-mlp --ac-group 4", "--tiled-mlp --tiled-attn", "--tiled-mlp",
        "--offload-activations", "--ac-group 4", ""], out


def test_plan_and_a_refused_flag_import_no_peft_or_bitsandbytes():
    """`--plan` (every search: --max-len auto, --suggest, the tiled flags) and a run refused at its flag checks
    answer in about the time torch takes to import: neither imports peft or bitsandbytes (4 s of a CPU core), and
    the planner not torch._dynamo either (0.9 s; model/deltanet_core.py disables compile on its core at first use,
    not at import. A refused run builds train.py's optimizer to record it: torch.optim imports dynamo)."""
    import subprocess
    import sys

    heavy = "print('heavy:', sorted(m for m in ('peft', 'bitsandbytes', 'torch._dynamo') if m in sys.modules))\n"
    code = ("import sys, train\n"
            "train.main(['--plan', '--model', sys.argv[1], '--max-len', 'auto', '--gpu-mem', '141', '--suggest'])\n"
            f"{heavy}try:\n    train.main(['--lr', '0'])\nexcept ValueError as e:\n    print('refused:', e)\n{heavy}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code, Q7], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-4].startswith("max_len ") and lines[-2].startswith("refused: --lr must be > 0"), lines[-5:]
    assert lines[-3] == "heavy: []", lines[-3]   # the planner
    assert lines[-1] == "heavy: ['torch._dynamo']", lines[-1]   # the refused run: no peft, no bitsandbytes


def test_a_run_given_planner_flags_is_told_to_add_plan():
    with pytest.raises(ValueError) as e:
        train.main(["--gpu-mem", "80", "--world-size=4", "--max-len", "1024"])
    assert str(e.value) == ("--gpu-mem, --world-size: the planner's flags, not a run's: add --plan "
                            "(`train.py --plan --help` lists them)"), str(e.value)


def test_an_abbreviated_plan_flag_is_refused_not_run(tmp_path):
    """argparse takes `--pla` for --plan, but train.py hands only the whole word to the planner: the run path refuses
    it by name before anything is written (until 2026-12-06 it trained)."""
    with pytest.raises(ValueError) as e:
        train.main(["--pla", "--steps", "1", "--out", str(tmp_path / "out")])
    assert str(e.value) == "--pla: write --plan in full (an abbreviation of it would start a run, not print the plan)"
    assert not (tmp_path / "out").exists()


def test_lora_layers_terms_by_hand():
    """--lora-layers over 4 blocks, by hand from the shapes (bf16 on CUDA, T 128, W 1). 2-3 with AC: the LoRA terms
    of 2 blocks, not 4, and the checkpoints of blocks 2 and 3 only (block 2's input is kept whole: no ids to look up
    again; blocks 0-1 need no grad, their checkpoints keep nothing); the FSDP2 terms (one block's, an adapted one) and
    the recompute (block 3's) as before. 1,3 without AC: the un-adapted block 2 saves neither LoRA B's inputs [T, r]
    nor down_proj's LoRA A input (the product, [T, F]); block 0 saves nothing, block 1 as layer 0 does."""
    m = ModelArgs(model_type="qwen2", vocab_size=100, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                  intermediate_size=128, qkv_bias=True)
    dims = ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 4, 2)
    plan = lambda *f: memory_plan(m, dims, train.build_parser().parse_args(
        ["--max-len", "128", "--global-batch", "1", "--quant", "nf4", *f]), "cuda", pack=True)
    e, T, D, F, r = 2, 128, 64, 128, 16
    lora = r * (64 * 6 + 128) + r * (64 + 32 + 32 + 64 + 128 + 128 + 64)   # A [r, in] + B [out, r] per block
    every, some = plan(), plan("--lora-layers", "2-3")
    assert term(every, "LoRA params") == 16 * 4 * lora and term(some, "LoRA params") == 16 * 2 * lora
    assert term(every, "activations: 3 block checkpoints") == 3 * e * T * D
    assert term(some, "activations: 2 block checkpoints") == 2 * e * T * D
    moved = ("LoRA params", "activations: 2 block", "activations: 3 block")
    for k in every.terms:
        if not k.startswith(moved):
            assert some.terms[k.replace("(fp32, 1/1, 4 blocks)", "(fp32, 1/1, 2 of 4 blocks)")] == every.terms[k], k
    assert every.peak - some.peak == 16 * 2 * lora + e * T * D

    ls = lambda *f: term(plan("--no-ac", *f), "activations: saved tensors")
    lora_saved = 7 * T * r * e + e * T * F   # LoRA B's inputs [T, r] per target, down_proj's A input (the product)
    un = 2 * (e * T * D + 4 * T) + e * T * 16 * (2 * 4 + 2 * 2) + 4 * T * 4 + 3 * e * T * F   # norms, qkv/out/lse, MLP
    assert ls() - ls("--lora-layers", "0") == 3 * lora_saved and ls("--lora-layers", "0") - ls(
        "--lora-layers", "3") == 3 * un   # block 0 as layer 0 + 3 un-adapted; block 3 as layer 0 alone
    assert ls("--lora-layers", "1,3") == ls("--lora-layers", "3") + un + (un + lora_saved)


@pytest.mark.parametrize("spec", ["14-23", "0", "0-3", "20"])
def test_lora_layers_plans_the_peaking_blocks_own_phases(spec):
    """--lora-layers leaves blocks above the adapted ones without LoRA: their backward may peak (a larger recompute,
    fewer inputs above it freed), with none of LoRA's, DoRA's or dropout's tensors in its phases. A flag that adds
    tensors (--dora, --lora-dropout) then never lowers the plan (review, helper 81: 262k tokens, Mistral-7B's shape,
    --tiled-mlp, 14-23: 64.5 GB, with --dora 62.2: the un-adapted block's recompute under the adapted blocks' phases,
    less DoRA's and dropout's tensors it never held); where the un-adapted block peaks, they leave its phases as
    they are."""
    from model.load import read_args

    mistral = ModelArgs(model_type="mistral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        head_dim=128, intermediate_size=14336)

    def plan(m, T, *f):
        dims = ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, m.n_heads, m.n_kv_heads)
        return memory_plan(m, dims, train.build_parser().parse_args(
            ["--max-len", str(T), "--global-batch", "1", "--quant", "nf4", "--lora-layers", spec, *f]), "cuda", True)

    for m, T in ((mistral, 262144), (read_args(Q7), 131072)):
        for extra in ([], ["--tiled-mlp"]):
            base = plan(m, T, *extra).peak
            for more in (["--dora"], ["--lora-dropout", "0.1"], ["--dora", "--lora-dropout", "0.1"]):
                assert plan(m, T, *extra, *more).peak >= base, (m.model_type, spec, extra, more)
    if spec == "14-23":   # the un-adapted block 31 peaks here
        phases = lambda p: {k: v for k, v in p.terms.items() if k.startswith("| block")}
        got = [phases(plan(mistral, 262144, "--tiled-mlp", *f)) for f in ([], ["--dora"], ["--lora-dropout", "0.1"])]
        assert got[0] == got[1] == got[2], got


@pytest.mark.parametrize("spec,flags", [("1,3", ["--no-ac"]), ("1,3", ["--no-ac", "--dora"]), ("2-3", [])],
                         ids=["no_ac", "no_ac_dora", "ac"])
def test_lora_layers_activations_match_autograd(tmp_path, spec, flags):
    """--lora-layers, fp32, one process, 4 blocks: the plan's activation terms vs the tensors autograd keeps in a real
    forward (saved_tensors_hooks, unique storages): without AC, nothing of block 0, block 1 as layer 0, the un-adapted
    block 2 without LoRA's (or DoRA's) tensors; with AC, the inputs of blocks 2 and 3 only."""
    from model.lora_spec import lora_layers
    opts = dict(ac="--no-ac" not in flags, dora="--dora" in flags, lora_layers=lora_layers(spec))
    saved, p = _saved_and_plan(tmp_path, 4, [*flags, "--lora-layers", spec], **opts)
    acts = [k for k in p.terms if k.startswith("activations: saved tensors") or "block checkpoints" in k]
    planned = sum(p.terms[k] for k in acts) + term(p, "activations: rope") + term(p, "| or: final norm in")
    assert len(acts) == 1 and planned == saved, (acts, planned, saved)


def test_train_norms_recompute_of_block_lo_shares_its_checkpointed_input(tmp_path):
    """--lora-layers 3 of 4 with --train-norms under AC: block 3's first norm trains, so its recompute saves the
    block's input (the checkpoint's, counted in the checkpoint term) without a copy: the recompute term is the no-AC
    block's saved tensors less that [T, D], not all of them (it counted the input twice)."""
    from model.load import read_args
    from tests.helpers import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, kv_heads=2, head_dim=16, layers=4, vocab=256, inter=96,
                           max_shard_size="50MB")
    m = read_args(path)

    def plan(*flags):
        args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1",
                                                "--quant", "nf4", "--dtype", "fp32", "--lora-layers", "3",
                                                "--train-norms", *flags])
        dims, pack_rows = validate(args, m, 1)
        return memory_plan(m, dims, args, "cpu", pack_rows)

    ac, no_ac = plan(), plan("--no-ac")
    block = term(no_ac, "activations: saved tensors")   # (block 3's alone: test_activations_match_autograd's terms)
    assert term(ac, "activations: 1 block checkpoints") == 4 * 128 * m.dim
    assert term(ac, "| block recompute (AC)") == block - 4 * 128 * m.dim
