"""The memory plan of Gemma 4 (gemma4_text): per-layer attention shapes (parallel/plan_layers.py), the soft-capped
loss's blocks (parallel/plan_block.loss_terms), its step time and google/gemma-4-31B's config as the hub has it.

Pins (CPU, tiny models made and saved by transformers' Gemma4ForCausalLM: tests/test_gemma4.py's CONFIG, sliding
layers 2 KV heads of 16, full layers a head size of 32, 1 KV head with attention_k_eq_v, 2 without):
- the plan's activation terms (each layer's q, k, v, out, lse and q/k norms at its own K and hd; v_norm's input, rsqrt
  and one-element weight; the full and sliding layers' RoPE tables at their own widths) = the bytes autograd keeps in
  a real forward (saved_tensors_hooks, unique storages, parameters excluded), k_eq_v and v_proj models, plain, tiled,
  LoRA dropout, --train-norms, --lora-layers, fp32 and the CPU's bf16;
- the weight terms (nf4 off, one process) = the built model's frozen block Linears (no v_proj on k_eq_v layers), its
  norms and layer_scalar, and 16 bytes per trainable LoRA element;
- the loss phase with final_logit_softcapping: loss.chunked_cross_entropy's allocations (the profiler's CPU memory
  events, over its forward: the blocks and the bf16 copy) = the plan's term, less the final norm's output;
- bench/configs/gemma-4-31b (the hub's top-level global_head_dim / num_global_key_value_heads) reads as transformers
  reads it: 30.70B parameters on the meta device; `--plan`, `--max-len auto` and `--suggest` run on it.

Run: .venv/bin/python -m pytest -q tests/test_plan_layers.py
"""

import contextlib
import io
import json
import os

import pytest
import torch
import transformers as T

import train
from tests.test_gemma4 import CONFIG

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
G31 = os.path.join(CONFIGS, "gemma-4-31b")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d, out = tmp_path_factory.mktemp("gemma4_plan"), {}
    for kv in (True, False):
        torch.manual_seed(0)
        T.Gemma4ForCausalLM(T.Gemma4TextConfig(**CONFIG, attention_k_eq_v=kv)).float().save_pretrained(d / str(kv))
        out[kv] = str(d / str(kv))
    return out


def _build(path, flags, dtype="fp32", quant="nf4"):
    from model.lora_spec import lora_layers
    from parallel.parallelize import BuildOptions, build_model

    args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1", "--quant",
                                            quant, "--dtype", dtype, "--no-ac", *flags])
    ours, _ = build_model(BuildOptions(
        path, quant=quant, ac=False, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        lora_dropout=args.lora_dropout, tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn,
        train_norms=args.train_norms, lora_targets=tuple(args.lora_targets.split(",")),
        lora_layers=lora_layers(args.lora_layers)), device="cpu")
    return ours, args


@pytest.mark.parametrize("k_eq_v", [True, False], ids=["k_eq_v", "v_proj"])
@pytest.mark.parametrize("flags", [["--lora-dropout", "0"], ["--tiled-mlp", "--tiled-attn", "--lora-dropout", "0"],
                                   ["--tiled-attn", "--lora-dropout", "0"], ["--lora-dropout", "0.1"],
                                   ["--train-norms", "--lora-dropout", "0"], ["--lora-layers", "1-3", "--lora-dropout",
                                                                             "0"],
                                   ["--lora-targets", "v_proj,o_proj", "--lora-dropout", "0"], ["bf16"]],
                         ids=["plain", "tiled_both", "tiled_attn", "dropout", "train_norms", "lora_layers", "v_o",
                              "bf16"])
def test_planned_activations_match_autograd(ckpts, k_eq_v, flags):
    """No AC, one process, nf4: the plan's saved-tensor, RoPE and final-norm terms = autograd's saved bytes."""
    from tests.helpers import planned_and_saved_activations

    bf16 = flags == ["bf16"]
    ours, args = _build(ckpts[k_eq_v], ["--lora-dropout", "0"] if bf16 else flags, "bf16" if bf16 else "fp32")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


@pytest.mark.parametrize("k_eq_v", [True, False, "qwen3"], ids=["k_eq_v", "v_proj", "qwen3"])
def test_weight_terms_are_the_models_parameters(ckpts, k_eq_v, tmp_path):
    """--quant none, fp32, one process: base weights = the blocks' frozen Linears (each layer's own shapes, no v_proj on
    k_eq_v layers), the norms-and-biases term = the block norms, q/k norms and layer_scalar, LoRA's = 16 bytes per
    trainable element (parameter, gradient, AdamW's two), all of the built model (a Qwen3's q/k norms too)."""
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    path = ckpts.get(k_eq_v)
    if k_eq_v == "qwen3":
        T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)).save_pretrained(
            path := str(tmp_path))
    ours, args = _build(path, ["--lora-dropout", "0"], quant="none")
    dims, pack_rows = validate(args, ours.args, 1)
    p = memory_plan(ours.args, dims, args, "cpu", pack_rows)
    named = [(n, q) for n, q in ours.model.layers.named_parameters()]
    linear = sum(q.numel() for n, q in named if n.endswith("proj.weight") and "lora" not in n and "base_layer" not in n
                 or n.endswith("base_layer.weight"))
    rest = sum(q.numel() for n, q in named if "norm" in n or n.endswith("layer_scalar"))
    lora = sum(q.numel() for q in ours.parameters() if q.requires_grad)
    n_v = sum(n.endswith("v_proj.base_layer.weight") for n, _ in named)   # (k_eq_v: the 2 sliding layers' only)
    assert n_v == sum(ours.args.has(i, "v_proj") for i in range(ours.args.n_layers)) == (2 if k_eq_v is True else
                                                                                          len(ours.model.layers))
    got = {k.split(" (")[0].split(" shard")[0]: v for k, v in p.terms.items()}
    assert got["base weights"] == 4 * linear
    assert got["block norms, biases"] == 4 * rest
    assert [v for k, v in p.terms.items() if k.startswith("LoRA params")] == [16 * lora]


@pytest.mark.parametrize("Tn", [256, 12], ids=["chunks", "one_short_chunk"])
def test_softcapped_loss_blocks_match_the_allocations(monkeypatch, Tn):
    """The loss phase's blocks with final_logit_softcapping 30 and a gradient, float32: loss.chunked_cross_entropy's
    peak allocation over its forward (the profiler's CPU memory events) less grad_hidden [T, D] (the plan's other loss
    term holds it) = the plan's "chunked loss blocks" term less the final norm's output: two float32 blocks of
    min(T, CHUNK_BYTES // 8V) rows (uncapped: one of CHUNK_BYTES // 4V rows; the same bytes over many chunks, half of
    them at T = 12 rows, under one chunk). The bf16 copy of a chunk (a bf16 weight; the CPU's bf16 GEMM allocates
    more than CUDA's): by hand, half the uncapped one."""
    from torch.profiler import ProfilerActivity, profile

    import loss
    from parallel import plan_block

    D, V = 32, 1000
    monkeypatch.setattr(loss, "CHUNK_BYTES", 8 * V * 16)   # 16 rows a block with the cap (32 without)
    monkeypatch.setattr(plan_block, "CHUNK_BYTES", 8 * V * 16)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(Tn, D, generator=g).requires_grad_()
    w, labels = torch.randn(V, D, generator=g), torch.randint(0, V, (Tn,), generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.chunked_cross_entropy(h, w, labels, softcap=30.0)
    cur = top = 0
    for _, n in sorted((ev.start_ns(), ev.nbytes()) for ev in prof.profiler.kineto_results.events()
                       if ev.name() == "[memory]"):
        cur += n
        top = max(top, cur)
    block = lambda e, cap: [v - e * Tn * D for k, v in plan_block.loss_terms(
        T=Tn, D=D, V=V, e=e, el=e, tied=False, emb=False, softcap=cap).items() if k.startswith("| or: final norm out")]
    small = 64 * Tn   # the labels' masks and indices ([T] and [T, 1] each), the loss' scalars
    assert block(4, 30.0)[0] <= top - 4 * Tn * D <= block(4, 30.0)[0] + small, (top - 4 * Tn * D, block(4, 30.0))
    c = min(Tn, 16)
    c2 = min(Tn, 32)   # (uncapped rows)
    assert block(2, 30.0) == [2 * 4 * c * V + 2 * c * V] and block(2, None) == [4 * c2 * V + 2 * c2 * V]


def test_31b_config_reads_as_transformers_reads_it():
    """The hub's form (top-level global_head_dim, num_global_key_value_heads, attention_k_eq_v): sliding layers 16 KV
    heads of 256, full layers 4 of 512 with no v_proj; n_params = transformers' parameters on the meta device (less the
    q/k norms, which n_params leaves out for every model): 30.70B."""
    from model.load import read_args

    m = read_args(G31)
    with open(os.path.join(G31, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg))
    qk = sum(q.numel() for n, q in hf.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert m.n_params - m.n_layers == sum(q.numel() for q in hf.parameters()) - qk   # (our layer_scalar: its buffer)
    assert round(m.n_params / 1e9, 2) == 30.70
    assert [m.attn_dims(i) for i in (0, 5)] == [(32, 16, 256), (32, 4, 512)] and m.shares_kv(5) and not m.shares_kv(0)
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        assert (a.k_proj.weight.shape[0], a.v_proj is None) == (m.attn_dims(i)[1] * m.attn_dims(i)[2], m.shares_kv(i))


def test_31b_plan_caps_the_loss_and_plans_each_attention_shape():
    """memory_plan of the 31B at 32k, bf16 on CUDA: the loss phase is the capped one (two float32 blocks of 128 rows at
    V 262,144, + the bf16 copy), the rope tables the full layers' 512 and the sliding layers' 256 wide, and the FSDP2
    block the larger kind's (by hand from the shapes: a sliding block with v_proj, a full one without)."""
    from model.load import read_args
    from parallel.mesh import ParallelDims
    from parallel.plan import memory_plan

    m, T = read_args(G31), 32768
    args = train.build_parser().parse_args(["--model", G31, "--max-len", str(T), "--global-batch", "1",
                                            "--quant", "none"])
    p = memory_plan(m, ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 32, 16), args, "cuda", True)
    D, V, c = 5376, 262144, 256 * 2**20 // (8 * 262144)
    assert c == 128 and p.terms["| or: final norm output + chunked loss blocks (softcap)"] == \
        2 * T * D + 2 * 4 * c * V + 2 * c * V
    assert p.terms["activations: rope cos/sin"] == 2 * 2 * T * (512 + 256)
    F, r, sliding, full = 21504, 16, 32 * 256 * D * 2 + 16 * 256 * D * 2, 32 * 512 * D * 2 + 4 * 512 * D
    lora = r * (6 * D + 2 * 32 * 512 + 4 * 512 + 3 * F)   # q, k, o, gate, up, down (no v_proj): A [r, in], B [out, r]
    assert full > sliding and p.terms["FSDP2: 2 unsharded blocks (current + prefetch)"] == 2 * (
        2 * (full + 3 * D * F + 4 * D + 1 + 2 * 512) + 2 * lora)   # bf16 weights, norms, layer_scalar, q/k norms


@pytest.mark.parametrize("flags", [["--max-len", "32768"], ["--max-len", "auto"], ["--max-len", "auto", "--tiled-mlp"],
                                   ["--max-len", "32768", "--suggest"]], ids=["32k", "auto", "auto_tiled", "suggest"])
def test_plan_runs_on_the_31b(flags):
    """--plan on google/gemma-4-31B's config (one H200, 141 GB): no refusal; the plan names the model."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["--plan", "--model", G31, "--global-batch", "1", "--gpu-mem", "141", *flags])
    assert ("--cp 1 --dp-shard 1" if "--suggest" in flags else "gemma4_text") in out.getvalue(), out.getvalue()


def test_step_time_counts_each_layers_attention_and_the_cap():
    """parallel/plan_speed on the 31B at 32k, --no-ac, by hand from the module's model: the base matmuls per layer at
    its own shapes (a full layer's q [32·512, D], k [4·512, D], no v_proj, o), the attention kernel per layer at its
    own H·hd over the keys its window lets a query see (sliding: 1,024), and the softcap's CAP bytes a logit of
    elementwise work (dropping the cap drops exactly those)."""
    import dataclasses

    from model.load import read_args
    from parallel.mesh import ParallelDims
    from parallel.plan_speed import CAP, RATES, step_seconds

    m, T, r = read_args(G31), 32768, RATES
    args = train.build_parser().parse_args(["--model", G31, "--max-len", str(T), "--global-batch", "1", "--no-ac"])
    dims = ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 32, 16)
    (_, c), (_, plain) = (step_seconds(x, dims, args, "cuda", True) for x in (m, dataclasses.replace(
        m, logit_softcap=None)))
    D, F, V, w = 5376, 21504, 262144, 1024
    g = lambda p: 2 * T * p / r["MATMUL"]
    full = [i for i in range(60) if i % 6 == 5]
    per = lambda i: (32 * 512 * D * 2 + 4 * 512 * D) if i in full else (32 * 256 * D * 2 + 2 * 16 * 256 * D)
    assert c["matmul"] == pytest.approx(sum(2 * g(per(i) + 3 * F * D) for i in range(60)) + 2 * g(V * D), rel=1e-12)
    span = lambda i: T / 2 if i in full else w * (1 - w / (2 * T))
    hd = lambda i: 512 if i in full else 256
    attn = sum(4 * T * span(i) * 32 * hd(i) / r["ATTN"] * (1 + r["BWD"]) for i in range(60))
    assert c["attention"] == pytest.approx(attn, rel=1e-12)
    assert c["elementwise"] - plain["elementwise"] == pytest.approx(CAP * T * V / r["ELEMENTWISE"], rel=1e-9)
    assert (c["matmul"], c["attention"]) == (plain["matmul"], plain["attention"])


def _peak_allocated(fn):
    """(fn's result, the largest bytes it held allocated at once over those live before it): the profiler's CPU memory
    events, as test_softcapped_loss_blocks_match_the_allocations reads them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    cur = top = 0
    for _, n in sorted((ev.start_ns(), ev.nbytes()) for ev in prof.profiler.kineto_results.events()
                       if ev.name() == "[memory]"):
        cur += n
        top = max(top, cur)
    return out, top


@pytest.mark.parametrize("K", [1, 2, 8], ids=["mqa", "gqa", "mha"])
def test_efficient_op_transients_match_the_allocations(monkeypatch, K):
    """Gemma 4's full layers (heads of 512, bf16) on CUDA take torch's memory-efficient op with K/V expanded to the
    query heads (backends._cuda_forward / _cuda_backward), here on CPU with torch's two CUDA ops faked to allocate what
    they return (out in [B, S, H, D] storage, lse padded to 32 rows; dq, dk, dv of the shapes they are handed). The
    forward's peak over its inputs, less out and lse (saved, term 4) = plan_block.expanded_kv (2 [T, H, hd], none
    when K = H, nor with one KV head: a view); the backward's peak = plan_block.kernel_backward (dq, dk, dv, + the
    expanded K, V, dK, dV where K < H), + lse's padded copy and the seed. The plan takes the forward's on CUDA only,
    and only for the efficient op (flash's heads of 256: none)."""
    from parallel import backends, plan_block

    t = backends._t

    def eff_forward(q, k, v, bias, lse_too, p, causal, scale=None):
        b, h, s, d = q.shape
        return t(q.new_empty(b, s, h, d)), q.new_empty(b, h, -(-s // 32) * 32, dtype=torch.float32), None, None

    def eff_backward(dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal, scale=None):
        return (*(t(torch.empty_like(t(x))) for x in (q, k, v)), None)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", eff_forward)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", eff_backward)
    Tn, H, hd, e = 64, 8, 512, 2
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, Tn, H, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, Tn, K, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    (out, lse), fwd = _peak_allocated(lambda: backends._cuda_forward(q, k, v, True, hd ** -0.5))
    saved = e * Tn * H * hd + 4 * H * Tn   # out, lse (lse's [..., :S] of its 32-row padding: Tn = 64, none)
    assert fwd - saved == plan_block.expanded_kv("cuda", Tn, H, K, hd, e) == 2 * e * Tn * H * hd * (1 < K < H)
    assert plan_block.expanded_kv("cpu", Tn, H, K, hd, e) == plan_block.expanded_kv("cuda", Tn, H, K, 256, e) == 0
    _, bwd = _peak_allocated(lambda: backends._cuda_backward(dout, q, k, v, out, lse, True, hd ** -0.5))
    small = 4 * H * Tn + 64   # lse's padded float32 copy, the dropout seed and offset
    assert plan_block.kernel_backward(Tn, H, K, hd, e) <= bwd <= plan_block.kernel_backward(Tn, H, K, hd, e) + small


def test_31b_plan_counts_the_expanded_kv_of_the_full_layers():
    """memory_plan of the 31B on CUDA at 502,784 tokens, --tiled-mlp --offload-activations: the block recompute's
    attention forward at a full layer (32 heads of 512, 4 KV heads: the efficient op) holds the recompute less the MLP's
    input ([T, D], not made yet) and K, V expanded (2 · 2T · 32 · 512); its term is that over the block's other
    phases. On --target cpu none (the CPU's op is not planned this way)."""
    from model.load import read_args
    from parallel.mesh import ParallelDims
    from parallel.plan import memory_plan

    m, T, D = read_args(G31), 502784, 5376
    args = train.build_parser().parse_args(["--model", G31, "--max-len", str(T), "--global-batch", "1", "--tiled-mlp",
                                            "--offload-activations"])
    dims = ParallelDims.from_args(1, 1, -1, 1, "ulysses", None, 32, 16)
    p = memory_plan(m, dims, args, "cuda", True)
    name = next(k for k in p.terms if "K/V expanded" in k)
    block = sum(v for k, v in p.terms.items() if k.startswith("| block") and k != name)
    rec = p.terms["| block recompute (AC): one block's saved tensors"]
    kv = 2 * 2 * T * 32 * 512
    assert p.terms[name] == max(0, rec - 2 * T * D + kv - block) > 0, (p.terms[name], kv / 1e9)
    assert not any("K/V expanded" in k for k in memory_plan(m, dims, args, "cpu", True).terms)
