"""The memory plan of Gemma 4 E2B / E4B (parallel/plan_small.py, parallel/plan_layers.py's per-layer shapes): per-layer
embeddings, KV sharing, the KV-shared layers' double-wide MLP.

Pins (CPU, tests/test_gemma4_small.py's tiny model made and saved by transformers' Gemma4ForCausalLM: 6 layers, the
last 3 KV-shared and double-wide, per-layer inputs of 8; with attention_k_eq_v and without):
- the plan's activation terms (the per-layer inputs [T, L, P], each block's PLE branch, the reuse layers without k/v
  norms or LoRA, their MLPs at 2F; --train-norms: the projection norm's input and the product's gelu output) = the
  bytes autograd keeps in a real forward (saved_tensors_hooks, unique storages, parameters excluded): plain,
  --tiled-mlp, LoRA dropout, --train-norms (with --tiled-mlp too), --lora-layers, q_proj alone, the CPU's bf16;
- the weight terms (nf4 off, one process) = the built model's parameters: the block Linears (no k/v in the reuse
  layers, their MLPs twice as wide), the never-quantized block parameters (norms, layer_scalar, the PLE gate and
  projection), the decoder's PLE table, projection and norm whole, 16 bytes per trainable LoRA element;
- the start-up memory check plans the model (no longer skipped), and the stored K/V term is 2e·T·K·hd a storing layer,
  twice under AC;
- planning CUDA, the per-layer table is host memory (parallel/host_table.py): the device peak = --ple-on-device's less
  the built model's host table; the host term = that table + the rows buffer its forward allocates for T tokens (as
  the pinned allocator rounds it); the start-up check passes it and refuses too little host memory naming the table
  and --ple-on-device, which --plan names as a fix.

Run: .venv/bin/python -m pytest -q tests/test_plan_small.py
"""

import pytest
import torch
import transformers as T

from tests.test_gemma4_small import SMALL
from tests.test_plan_layers import _build


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d, out = tmp_path_factory.mktemp("gemma4_small_plan"), {}
    for kv in (True, False):
        torch.manual_seed(0)
        T.Gemma4ForCausalLM(T.Gemma4TextConfig(**SMALL, attention_k_eq_v=kv)).float().save_pretrained(d / str(kv))
        out[kv] = str(d / str(kv))
    return out


NO_DROP = ["--lora-dropout", "0"]
FLAGS = {"plain": NO_DROP, "tiled": ["--tiled-mlp", *NO_DROP], "dropout": ["--lora-dropout", "0.1"],
         "train_norms": ["--train-norms", *NO_DROP], "tiled_norms": ["--tiled-mlp", "--train-norms", *NO_DROP],
         "lora_layers": ["--lora-layers", "2-5", *NO_DROP], "q": ["--lora-targets", "q_proj", *NO_DROP], "bf16": None}


@pytest.mark.parametrize("k_eq_v", [True, False], ids=["k_eq_v", "v_proj"])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_planned_activations_match_autograd(ckpts, k_eq_v, flags):
    """No AC, one process: the plan's saved-tensor, per-layer-input, RoPE and final-norm terms = autograd's bytes."""
    from tests.helpers import planned_and_saved_activations

    bf16 = FLAGS[flags] is None
    ours, args = _build(ckpts[k_eq_v], NO_DROP if bf16 else FLAGS[flags], "bf16" if bf16 else "fp32")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert any(k.startswith("activations: saved tensors: per-layer inputs") for k in terms), terms
    assert planned == saved, (planned, saved, terms)


@pytest.mark.parametrize("k_eq_v", [True, False], ids=["k_eq_v", "v_proj"])
def test_weight_terms_are_the_models_parameters(ckpts, k_eq_v):
    """--quant none, fp32, one process: every weight term = the built model's parameters of that kind."""
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    ours, args = _build(ckpts[k_eq_v], NO_DROP, quant="none")
    dims, pack_rows = validate(args, ours.args, 1)
    p = memory_plan(ours.args, dims, args, "cpu", pack_rows)
    named = list(ours.model.layers.named_parameters())
    base = lambda n: n.endswith("proj.weight") and "lora" not in n and "base_layer" not in n or n.endswith(
        "base_layer.weight")
    linear = sum(q.numel() for n, q in named if base(n))
    rest = sum(q.numel() for n, q in named if not base(n) and not q.requires_grad)   # norms, layer_scalar, PLE's
    assert any("per_layer_input_gate" in n for n, _ in named) and not any("k_proj" in n for n, _ in named
                                                                           if n.startswith(("3.", "4.", "5.")))
    root = sum(q.numel() for n, q in ours.model.named_parameters() if "per_layer" in n and not n.startswith("layers."))
    lora = sum(q.numel() for q in ours.parameters() if q.requires_grad)
    got = {k.split(" (")[0].split(" shard")[0]: v for k, v in p.terms.items()}
    assert got["base weights"] == 4 * linear
    assert got["block norms, biases"] == 4 * rest
    assert got["per-layer embeddings: table, projection, norm"] == 4 * root
    assert [v for k, v in p.terms.items() if k.startswith("LoRA params")] == [16 * lora]


def test_start_up_check_plans_it_and_the_stored_kv(ckpts):
    """The start-up memory check returns the plan (no longer skipped as 'not planned'); the storing layers' K/V (layer
    1: full, 1 KV head of 32 with k_eq_v; layer 2: sliding, 2 of 16) or their gradients: 2e·T·K·hd each, twice under
    AC (held by the reuse layers' checkpoints while their gradients sum)."""
    import train
    from model.load import read_args
    from parallel import budgets, preflight_memory
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    margs = read_args(ckpts[True])
    for ac in (True, False):
        args = train.build_parser().parse_args(["--model", ckpts[True], "--max-len", "256", "--global-batch", "1"]
                                               + ["--no-ac"] * (not ac))
        dims, pack = validate(args, margs, 1)
        said = []
        p = preflight_memory.check(args, margs, dims, [budgets.Budget(0, "cpu", 1e12, "1 TB (test)", float("inf"),
                                                                      "", "m")], said.append)
        assert p is not None and said[0].startswith("memory: planned"), said
        assert p.total == memory_plan(margs, dims, args, "cpu", pack).total
        kv = p.terms["activations: the storing layers' K/V, gradients (KV sharing)"]
        assert kv == 4 * 256 * 2 * (1 * 32 + 2 * 16) * (1 + ac)


def test_on_cuda_the_table_is_host_memory(ckpts):
    """Planning CUDA (the table in host memory unless --ple-on-device, parallel/host_table.py): the device peak is the
    --ple-on-device plan's less the built model's host table, byte for byte; the host term is that table plus the
    buffer its forward fills for a micro-batch of T tokens, as CUDA's pinned allocator rounds it (a power of two: not
    seen on CPU); the start-up check passes it
    with the host memory for it and refuses it, naming the table and --ple-on-device, without; --plan's fixes name
    --ple-on-device."""
    import train
    from parallel import budgets, host_table, preflight_memory
    from parallel.mesh import validate
    from parallel.plan import memory_plan
    from parallel.plan_search import _fixes, _with

    ours, args = _build(ckpts[True], NO_DROP, quant="none")
    dims, pack = validate(args, ours.args, 1)
    host = memory_plan(ours.args, dims, args, "cuda", pack)
    dev = memory_plan(ours.args, dims, _with(args, ple_on_device=True), "cuda", pack)
    table = ours.model.embed_tokens_per_layer
    assert type(table) is host_table.HostEmbedding
    size = table.weight.numel() * table.weight.element_size()
    assert dev.peak - host.peak == size and dev.host == dev.host_ple == 0, (dev.peak - host.peak, size)
    assert "per-layer embeddings: projection, norm (frozen: whole on every rank)" in host.terms, host.terms
    table(torch.randperm(128)[None])   # (T = --max-len 128 tokens)
    rows = table.rows.numel() * table.rows.element_size()   # (CUDA's pinned allocator rounds it to a power of two)
    assert rows == 128 * 6 * 8 * 4 and host.host == host.host_ple == size + (1 << (rows - 1).bit_length())
    said, gpu = [], lambda free: [budgets.Budget(0, "cuda", 1e12, "1 TB (test)", free, "(test)", "m")]
    a = train.build_parser().parse_args(["--model", ckpts[True], "--max-len", "128", "--global-batch", "1", "--quant",
                                         "none", "--dtype", "fp32", "--no-ac", *NO_DROP])
    assert preflight_memory.check(a, ours.args, dims, gpu(1e9), said.append).host_ple == host.host_ple, said
    with pytest.raises(ValueError, match=r"per-layer embedding table .*--ple-on-device"):
        preflight_memory.check(a, ours.args, dims, gpu(size), said.append)
    assert _fixes(args, ours.args, 1, "cuda", 1e12, size)[0].startswith("--ple-on-device ("), "--plan's first fix"
