"""GLM-4.5's router (model/glm4_moe.py `Router`) is held in float32 whatever the model's dtype, as transformers'
Glm4MoeForCausalLM holds it (`_keep_in_fp32_modules_strict`), in every path.

Pins (CPU; tests/test_glm4_moe.py's tiny checkpoint, its routers rewritten so that bf16 rounding matters: weights of
std 0.01, correction biases 3.0 + distinct offsets of 0.003 apart, which bf16's spacing at 3 (2^-6) merges):
- bf16: our from_pretrained's chosen experts = transformers' (loaded with dtype bf16) for every token of every MoE
  block, the logits within bf16 rounding; the router rounded to bf16 (the old behaviour) chooses otherwise;
- the router float32 and equal to the checkpoint after from_pretrained (bf16) and after build_model (bf16, nf4 and
  none); on 2 gloo ranks under FSDP2 with its bf16 mixed precision: each block's router a plain float32 tensor (not a
  DTensor), its choice and the loss = one process's; the plan's router term = those tensors' bytes on each rank;
- the merge writes the router tensors in float32 as stored; transformers loads them as it loads the original's.

Run: .venv/bin/python -m pytest -q tests/test_glm4_router_fp32.py
"""

import json
import os

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import model
from tests.test_glm4_moe import SIZES, save_checkpoint

ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("glm_fp32"), SIZES)
    g = torch.Generator().manual_seed(7)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = {}
        for k, fn in json.load(f)["weight_map"].items():
            files.setdefault(fn, []).append(k)
    for fn, keys in files.items():
        if not any(k.endswith(ROUTER) for k in keys):
            continue
        sd = load_file(os.path.join(path, fn))
        for k in keys:
            if k.endswith("mlp.gate.weight"):
                sd[k] = torch.randn(sd[k].shape, generator=g) * 0.01
            elif k.endswith("e_score_correction_bias"):
                sd[k] = 3.0 + 0.003 * torch.randperm(8, generator=g).float()
        save_file(sd, os.path.join(path, fn), metadata={"format": "pt"})
    return path


def _choices(m, router_cls, ids):
    """(logits, [(each MoE block's router input [T, D], its chosen experts [T, k] sorted)]) of model `m` on `ids`."""
    got = []
    hook = lambda _, inp, out: got.append((inp[0].reshape(-1, inp[0].shape[-1]), out[-1].sort(-1)[0]))
    hooks = [mod.register_forward_hook(hook) for mod in m.modules() if isinstance(mod, router_cls)]
    with torch.no_grad():
        out = m(ids)
    for h in hooks:
        h.remove()
    return getattr(out, "logits", out), got


def test_bf16_choice_and_logits_match_transformers(ckpt):
    """On transformers' own router inputs (bf16 hidden states of its bf16 model) our loaded routers choose its experts
    for every token; the whole model's logits are within bf16 rounding of its."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from model.glm4_moe import Router

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, experts_implementation="eager").eval()
    ours = model.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    stored = {}
    for fn in os.listdir(ckpt):
        if fn.endswith(".safetensors"):
            stored.update({k: v for k, v in load_file(os.path.join(ckpt, fn)).items() if k.endswith(ROUTER)})
    mine = {k: v for k, v in ours.state_dict().items() if k.endswith(ROUTER)}
    assert mine.keys() == stored.keys() and len(mine) == 4, sorted(mine)
    for k, v in mine.items():
        assert v.dtype == torch.float32 and torch.equal(v, stored[k]), f"{k}: {v.dtype}, as stored"
    ref, theirs = _choices(hf, Glm4MoeTopkRouter, ids)
    logits, _ = _choices(ours, Router, ids)
    routers = [b.mlp.gate for b in ours.model.layers[1:]]
    assert len(theirs) == len(routers) == 2 and all(x.dtype == torch.bfloat16 for x, _ in theirs), "two MoE blocks"
    choose = lambda: [r(x)[1].sort(-1)[0] for r, (x, _) in zip(routers, theirs)]
    with torch.no_grad():
        for i, (a, (_, b)) in enumerate(zip(choose(), theirs)):
            assert torch.equal(a, b), f"MoE block {i}: experts chosen differ for {(a != b).any(-1).sum()} tokens"
        assert ((logits.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2, "logits, bf16 rounding"
        for r in routers:   # the old behaviour: the router rounded to bf16 chooses otherwise
            for p in r.parameters():
                p.copy_(p.bfloat16().float())
        off = sum((a != b).any(-1).sum().item() for a, (_, b) in zip(choose(), theirs))
    assert off > 10, f"bf16 rounding changes the choice ({off} of 160 tokens' choices)"
    x, kept = theirs[0][0].clone().requires_grad_(), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        routers[0](x)
    weight = routers[0].weight.untyped_storage().data_ptr()
    copies = [t.shape for t in kept if t.numel() == routers[0].weight.numel()
              and t.untyped_storage().data_ptr() != weight]   # (F.linear keeps Wᵀ: [D, E])
    assert not copies, f"bf16: autograd keeps a copy of the router weight {copies} (parallel/plan_glm4.saved has none)"


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_build_model_keeps_the_router_float32(ckpt, quant):
    from parallel.parallelize import BuildOptions, build_model

    ours, _ = build_model(BuildOptions(ckpt, quant=quant, dtype=torch.bfloat16, lora_targets=("q_proj",)),
                          device="cpu")
    ref = model.from_pretrained(ckpt, dtype=torch.bfloat16)
    for i in (1, 2):
        gate, want = ours.model.layers[i].mlp.gate, ref.model.layers[i].mlp.gate
        for n in ("weight", "e_score_correction_bias"):
            p = getattr(gate, n)
            assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, f"{quant} block {i} {n}: {p.dtype}"
            assert torch.equal(p, getattr(want, n)), f"{quant} block {i} {n}: as loaded"
    assert ours.model.layers[1].self_attn.k_proj.weight.dtype != torch.float32, f"{quant}: the rest not float32"


def _fsdp(rank, world_size, path):
    """FSDP2 over 2 ranks, bf16 with the CUDA path's mixed precision: each MoE block's router a plain float32 tensor,
    whole; the choice and the loss = one process's; the plan's router term = the bytes held on this rank."""
    import train
    from model.glm4_moe import Router
    from model.nf4 import NF4Linear
    from parallel.mesh import ParallelDims, kv_heads, validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan

    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    for quant in ("nf4", "none"):
        opts = dict(quant=quant, dtype=torch.bfloat16, lora_targets=("q_proj",), ac=False, mixed_precision=True)
        one, _ = build_model(BuildOptions(path, **opts), device="cpu")
        dims = ParallelDims.from_args(world_size, 1, -1, 1, "ulysses", None, one.args.n_heads, kv_heads(one.args))
        m, _ = build_model(BuildOptions(path, **opts), fsdp_mesh=dims.build_mesh("cpu").fsdp, device="cpu")
        what = f"{quant} rank {rank}"
        held = 0
        for i in (1, 2):
            for n in ("weight", "e_score_correction_bias"):
                p, want = getattr(m.model.layers[i].mlp.gate, n), getattr(one.model.layers[i].mlp.gate, n)
                assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, f"{what} block {i} {n}: {type(p)}"
                assert torch.equal(p, want), f"{what} block {i} {n}: whole, as one process's"
                held += p.numel() * p.element_size()
        # (before forward: the last block stays unsharded after it; rank 0 holds ceil(rows / W) rows, the plan's)
        nf4 = {f"{n}.{w}" for n, mod in m.named_modules() if isinstance(mod, NF4Linear) for w in ("weight", "absmax")}
        rest = sum(p.to_local().numel() * p.element_size() for n, p in m.named_parameters()
                   if n.startswith("model.layers.") and "lora_" not in n and n not in nf4 and ".gate." not in n)
        with torch.no_grad():
            s1, n1 = one(ids, labels=labels)
            s, n = m(ids, labels=labels)
        _, want = _choices(one, Router, ids)
        _, have = _choices(m, Router, ids)
        assert len(have) == 2 and all(torch.equal(a[1], b[1]) for a, b in zip(have, want)), f"{what}: experts chosen"
        torch.testing.assert_close((s / n).float(), (s1 / n1).float(), rtol=1e-2, atol=0, msg=f"{what}: loss")
        args = train.build_parser().parse_args(["--model", path, "--max-len", "64", "--global-batch", "2", "--quant",
                                                quant, "--dtype", "bf16", "--lora-targets", "q_proj"])
        d, pack = validate(args, m.args, world_size)
        terms = memory_plan(m.args, d, args, "cpu", pack).terms
        assert terms["routers (float32, whole on every rank)"] == held, (what, terms, held)
        assert not any("routers" in k for k in terms if k.startswith("block norms")), f"{what}: counted once"
        if quant == "nf4" and rank == 0:
            assert next(v for k, v in terms.items() if k.startswith("block norms, biases")) == rest, (terms, rest)
    return True


@pytest.mark.timeout(240)
def test_fsdp2_holds_the_router_whole_in_float32(ckpt):
    from tests.dist import run_ranks

    assert run_ranks(_fsdp, 2, ckpt, timeout=220) == [True, True]


def test_merge_writes_the_router_float32_as_stored(ckpt, tmp_path):
    from model.merged import merge
    from parallel.parallelize import BuildOptions, build_model

    _, peft_model = build_model(BuildOptions(ckpt, quant="none", lora_targets=("q_proj",)), device="cpu")
    peft_model.save_pretrained(tmp_path / "adapter")
    merge(ckpt, str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype=torch.bfloat16)
    out, src = {}, {}
    for d, sd in ((tmp_path / "merged", out), (ckpt, src)):
        for fn in os.listdir(d):
            if fn.endswith(".safetensors"):
                sd.update(load_file(os.path.join(d, fn)))
    routers = [k for k in out if k.endswith(ROUTER)]
    assert len(routers) == 4 and all(out[k].dtype == torch.float32 and torch.equal(out[k], src[k]) for k in routers)
    assert out["model.layers.1.self_attn.k_proj.weight"].dtype == torch.bfloat16, "the rest in the merge's dtype"
    # transformers loads the merged router as it loads the original's, the stored values in the dtype it holds them
    # in: float32 both under transformers 5.25; 5.17 keeps only the bias float32 (_keep_in_fp32_modules_strict)
    gate, orig = (T.AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16).model.layers[1].mlp.gate
                  for p in (tmp_path / "merged", ckpt))
    for n in ("weight", "e_score_correction_bias"):
        got, want = getattr(gate, n), getattr(orig, n)
        assert got.dtype == want.dtype and torch.equal(got, want), f"transformers loads {n} as the original's"
        assert torch.equal(got, src[f"model.layers.1.mlp.gate.{n}"].to(got.dtype)), f"transformers loads {n} as stored"
