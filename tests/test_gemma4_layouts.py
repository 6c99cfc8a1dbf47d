"""Gemma 4 on every layout: context parallelism (Ulysses, ring, hybrid), FSDP2, NF4, DoRA and the memory flags give
one process's numbers, on every rank, although the layers differ in attention shape.

Pins (CPU, gloo, float64: the loss' float32 parts leave ~3e-7 of a gradient's norm between layouts, float32 ~2e-5;
tests/test_gemma4.py's tiny transformers model with attention_k_eq_v: 4 query heads; the sliding layers 2 KV heads of
16 under a 4-token window, the full layers 1 KV head of 32 and no v_proj; softcap 2; packed rows whose documents cross
the shards):
- the global loss, the target count and every LoRA gradient (all seven targets; k_proj's output is also v on the full
  layers) = one process's, on every rank: cp 2 Ulysses (the full layers' one KV head replicated per rank, the sliding
  layers' two split) with --offload-activations, cp 2 ring (the window cut into the ring's blocks) with --tiled-mlp,
  cp 2 × dp_shard 2 with NF4 and DoRA, hybrid cp 4 (Ulysses 2 × ring 2); one process with --tiled-attn = without;
- the start-up check (parallel.mesh.validate) checks every layer's KV heads: a Ulysses degree one layer kind cannot
  take is refused naming that count and the degrees that work; Gemma-4-31B's 16 and 4 KV heads take Ulysses 8
  (the full layers replicated) and 16;
- train.py with --cp 2 --cp-impl ring (2 ranks; softcap 30, a 16-token window) trains as one process: every step's
  loss and grad norm, and the adapter;
- NF4: every nn.Linear but lm_head is quantized (the full layers' k_proj, which is also their v, included) and the
  logits = the plain model's on bitsandbytes' NF4 of those weights (tests.helpers.bnb_nf4).

Run: .venv/bin/python -m pytest -q tests/test_gemma4_layouts.py
"""

from types import SimpleNamespace

import pytest
import torch
import transformers as T

import model
from tests.test_gemma4 import ALL, CONFIG, _perturb

N_LORA = 7 + 7 + 6 + 6   # projections of the 4 blocks (no v_proj on the 2 full ones)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**{**CONFIG, "final_logit_softcapping": 2.0},
                                                attention_k_eq_v=True)).float()
    _perturb(hf)
    path = tmp_path_factory.mktemp("gemma4_layouts")
    hf.save_pretrained(path)
    return str(path)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _batch():
    """Two packed rows of 44 tokens (documents 17 + 27 and 30 + 14: they cross every layout's shards)."""
    ids = torch.randint(0, 128, (2, 44), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.stack([torch.cat([torch.arange(17), torch.arange(27)]), torch.cat([torch.arange(30),
                                                                                   torch.arange(14)])])
    return ids, labels, pos


def _build(path, **kw):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ALL, ac=True, dtype=torch.float64)
    mesh = {k: kw.pop(k) for k in ("fsdp_mesh", "attention") if k in kw}
    return build_nonzero_b(BuildOptions(path, **(opts | kw)), **mesh)


def _grads(m):
    return {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for k, p in m.named_parameters() if p.requires_grad}


def _layouts(rank, world_size, path, cases, n_lora=N_LORA):
    """Each case (cp, impl, ulysses degree, build flags): this layout's loss and LoRA gradients = one process's on the
    same global batch (data rank d takes row d, cp rank c its shard); `n_lora`: the model's adapted projections."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims, kv_heads

    ids, labels, pos = _batch()
    margs = model.load.read_args(path)
    from parallel.memory import apply_tiled_mlp

    for cp, impl, u, flags in cases:
        what = f"cp {cp} {impl} {flags} rank {rank}"
        flags = dict(flags)
        tile = flags.pop("tile", None)   # --tiled-mlp with tiles of this many tokens, not the rule's
        base = {k: v for k, v in flags.items() if k in ("quant", "dora", "dtype")}
        tol = 1e-6 if flags.get("dtype", torch.float64) == torch.float64 else 5e-5   # (float32: ~2e-5 between them)
        ref, _ = _build(path, **base, ple_on_device=True)   # (Gemma 4 E2B / E4B: the layout's table in host memory,
        # the default, against one process's on the device)
        s, n = ref(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        want = _grads(ref)
        dims = ParallelDims.from_args(world_size, 1, -1, cp, impl, u, margs.n_heads, kv_heads(margs))
        meshes = dims.build_mesh("cpu")
        m, _ = _build(path, fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims), **flags)
        if tile:
            apply_tiled_mlp(m, tile)
        d, c = meshes.dp.get_local_rank(), meshes.cp.get_local_rank()
        rows = slice(d * 2 // dims.dp, (d + 1) * 2 // dims.dp)
        ls, ln = m(shard_sequence(ids[rows], dims, c, 0), position_ids=shard_sequence(pos[rows], dims, c, None),
                   labels=shard_sequence(labels[rows], dims, c, -100))
        total, got = ln.detach().clone(), ls.detach().clone()
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
        dist.all_reduce(got, group=meshes.dp_cp.get_group())
        (ls / total).backward()
        assert total.item() == n.item(), what
        torch.testing.assert_close(got / total, s.detach() / n, rtol=tol / 10, atol=0, msg=f"{what}: loss")
        grads = _grads(m)
        assert grads.keys() == want.keys() and len(grads) == n_lora * (3 if flags.get("dora") else 2), what
        for k in grads:
            assert (r := rel(grads[k], want[k])) < tol, f"{what}: grad {k} off by {r:.2g}"
    return True


@pytest.mark.timeout(300)
def test_cp2_ulysses_and_ring_equal_one_process(ckpt):
    """cp 2 Ulysses with --offload-activations, cp 2 ring with --tiled-mlp; and one process: --tiled-attn = without."""
    from tests.dist import run_ranks

    cases = [(2, "ulysses", None, dict(offload_activations=True)), (2, "ring", None, dict(tiled_mlp=True))]
    assert run_ranks(_layouts, 2, ckpt, cases, timeout=280) == [True, True]
    ids, labels, pos = _batch()
    out = []
    for tiled in (False, True):
        m, _ = _build(ckpt, tiled_attn=tiled)
        s, n = m(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        out.append((s.detach(), _grads(m)))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-7, atol=0)
    assert len(out[1][1]) == N_LORA * 2 and all(rel(g, out[0][1][k]) < 1e-6 for k, g in out[1][1].items())


@pytest.mark.timeout(400)
def test_cp_with_dp_shard_and_hybrid_equal_one_process(ckpt):
    """cp 2 Ulysses × dp_shard 2 with NF4 and DoRA (float32: bitsandbytes dequantizes no float64); hybrid cp 4 =
    Ulysses 2 × ring 2 (4 ranks)."""
    from tests.dist import run_ranks

    cases = [(2, "ulysses", None, dict(quant="nf4", dora=True, dtype=torch.float32)), (4, "hybrid", 2, {})]
    assert run_ranks(_layouts, 4, ckpt, cases, timeout=380) == [True] * 4


def test_validate_checks_every_layers_kv_heads(ckpt):
    import train
    from parallel.mesh import kv_heads, resolve_cp, validate

    def flags(*extra):
        return train.build_parser().parse_args(["--model", ckpt, "--data", "x.jsonl", "--max-len", "64", *extra])

    args = model.load.read_args(ckpt)
    assert kv_heads(args) == (2, 1)
    dims, _ = validate(flags("--cp", "4", "--cp-impl", "ulysses"), args, 4)   # both kinds replicated: allowed
    assert (dims.ulysses, dims.ring) == (4, 1)
    # 6 heads; 6 KV heads on the sliding layers, 2 on the full ones: Ulysses 3 splits the first, not the second
    odd = model.ModelArgs.from_config_dict({**T.Gemma4TextConfig(**{
        **CONFIG, "num_attention_heads": 6, "num_key_value_heads": 6, "num_global_key_value_heads": 2},
        attention_k_eq_v=True).to_dict(), "architectures": ["Gemma4ForCausalLM"]})
    assert kv_heads(odd) == (6, 2)
    with pytest.raises(ValueError, match=r"--cp 3: the Ulysses degree 3 must divide the 2 KV heads of some layers "
                                         r"or be a multiple.*\(model: 6 heads, 6 and 2 KV heads\).*--cp of 1, 2, 6\."):
        validate(flags("--cp", "3", "--cp-impl", "ulysses"), odd, 3)
    dims, _ = validate(flags("--cp", "6", "--cp-impl", "auto"), odd, 6)
    assert (dims.ulysses, dims.ring) == (6, 1)
    assert (validate(flags("--cp", "3"), odd, 3)[0].ulysses, resolve_cp(3, "auto", None, 6, 6)) == (1, (3, 1))
    # Gemma-4-31B: 32 heads, 16 KV heads (sliding), 4 (full): Ulysses 8 and 16 split the one, replicate the other
    big = SimpleNamespace(n_layers=6, n_kv_heads=16, attn_dims=lambda i: (32, 4 if i % 6 == 5 else 16, 0))
    assert kv_heads(big) == (16, 4)
    assert [resolve_cp(cp, "ulysses", None, 32, kv_heads(big)) for cp in (8, 16)] == [(8, 1), (16, 1)]


def test_nf4_quantizes_what_bitsandbytes_would(ckpt):
    """Every nn.Linear of transformers' model but lm_head is NF4 here (the full layers' k_proj, their v too); the
    logits = the plain model's with those weights through bitsandbytes' NF4."""
    from bitsandbytes.functional import dequantize_4bit

    from model.nf4 import NF4Linear
    from tests.helpers import bnb_nf4

    q, _ = _build(ckpt, quant="nf4", lora_targets=("q_proj",), ac=False, dtype=torch.float32)
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    linears = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    name = lambda n: n.replace("base_layer", "").replace("..", ".").rstrip(".")
    assert {name(n) for n, m in q.named_modules() if isinstance(m, NF4Linear)} == linears
    assert "model.layers.1.self_attn.k_proj" in linears and "model.layers.1.self_attn.v_proj" not in linears
    plain, _ = _build(ckpt, lora_targets=("q_proj",), ac=False, dtype=torch.float32)
    ids, _, pos = _batch()
    with torch.no_grad():
        for n, m in plain.named_modules():   # (as one row: bitsandbytes on the CPU misreads a 2-D state 48 wide,
            if name(n) in linears and isinstance(m, torch.nn.Linear):
                m.weight.copy_(dequantize_4bit(*bnb_nf4(m.weight.reshape(1, -1))).view_as(m.weight))   # same blocks)
        torch.testing.assert_close(q(ids, position_ids=pos), plain(ids, position_ids=pos), rtol=1e-5, atol=1e-5)


SHORT = ["--steps", "2", "--global-batch", "4"]   # nothing resumes


def _train_ranks(rank, world_size, argv):
    import train
    from tests.helpers import one_thread

    with one_thread():
        train.main(argv)
    return True


@pytest.mark.timeout(400)
def test_train_with_cp2_ring_trains_like_one_process(assets, tmp_path):
    """train.py, 2 steps of --global-batch 4 on the fixture's chat records, a k_eq_v Gemma 4 (a 16-token window under
    64-token rows): --cp 2 --cp-impl ring on 2 ranks (the start-up check passes, nothing else refuses) trains as one
    process does: every step's loss, grad norm, and the adapter."""
    import train
    from tests.dist import run_ranks
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv
    from tests.test_train import _compare

    tok = make_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    cfg = {**CONFIG, "vocab_size": len(tok), "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 0,
           "bos_token_id": None, "final_logit_softcapping": 30.0}
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg, attention_k_eq_v=True)).float()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "model")
    a = {**assets, "model": str(tmp_path / "model")}
    with one_thread():
        train.main(train_argv(a, str(tmp_path / "one"), *SHORT))
    assert run_ranks(_train_ranks, 2, train_argv(a, str(tmp_path / "cp2"), *SHORT, "--cp", "2", "--cp-impl", "ring"),
                     timeout=380) == [True, True]
    _compare("Gemma 4 cp 2 ring", str(tmp_path / "cp2"), str(tmp_path / "one"), steps=(1, 2))
