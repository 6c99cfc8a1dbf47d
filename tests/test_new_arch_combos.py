"""GPT-OSS and Gemma 4 E2B / E4B under the flags and inputs their own tests leave out: each combination against an
outside reference (transformers + peft, the DPO formula on them, or one process on every rank).

Pins (CPU; tests/test_gpt_oss.py's tiny GPT-OSS: sinks, biases, a 4-token window, 6 experts top 2; tests/
test_gemma4_small.py's tiny E2B form: layers 1 and 2 store K/V, 3-5 reuse them, per-layer inputs, double-wide MLPs,
a tied embedding):
- GPT-OSS with --train-norms and --train-embeddings: the loss and every LoRA, norm and embedding gradient = peft's
  (`modules_to_save`) on GptOssForCausalLM: plain; AC with --tiled-mlp; --ac-keep-attn with the tiled MLP and the
  kernel core (the CPU flash op's outputs kept, the sinks merged after them); DoRA with --tiled-attn (o_proj's bias);
  the full layer's GQA row through the blocked backward (kernels.BACKWARD_BLOCK lowered: a row past 65,536 tokens on a
  GPU) given the sink-merged out/lse, its sums in q's, k's, v's and out's storage;
- E2B with --train-norms and --lora-layers leaving out the storing layers: the decoder's per_layer_projection_norm
  gets every block's gradient, the blocks below the lowest adapted one included, and the storing layers, not
  adapted, pass the reuse layers' gradient down; = peft (`layers_to_transform`, `modules_to_save`) under AC with
  --tiled-mlp, --ac-group 2, --ac-keep-attn with the tiled MLP (kernel core), --ac-blocks 2; and every block with DoRA
  and the tied embedding trained (ensure_weight_tying);
- E2B with NEFTune's noise: the per-layer inputs read the noised embedding output, as transformers' do under its hook
  on embed_tokens (the same noise added there): the loss and every LoRA gradient;
- E2B with LoRA dropout and --tiled-mlp, whose block recompute runs the tiled unit: AC and --ac-group 2 = the untiled
  unit run per tile with grad (the same masks);
- DPO with shared prompts (branches: the ring's planned calls on one process) on GPT-OSS (sinks) and E2B (KV sharing),
  AC, tiled MLP, --train-norms (the reference computes with the base's norms) = the formula on transformers + peft;
- `python -m model.merge --quant nf4` of an adapter with trained norms (and GPT-OSS's untied embedding): GPT-OSS (BF16
  form and MXFP4: experts 4-bit one by one, written fused back) and E2B (its per-layer Linears not 4-bit): the merged
  folder in transformers computes our NF4 model's logits;
- cp 2 Ulysses (with --ac-group 2 / --offload-activations) and ring (--offload-activations / --tiled-mlp), every rank,
  float64: a micro-batch of two rows of 43 tokens (one packed, one with padding that continues its positions),
  padded to the CP divisor by the layout: GPT-OSS with --train-norms, E2B with --lora-layers 3-5 --train-norms give
  one process's loss and every trained gradient.
The inputs hold E2B's pad token (0) mid-row: its row untrained through the lookup on both sides (padding_idx, as
transformers builds the embedding).

Run: .venv/bin/python -m pytest -q tests/test_new_arch_combos.py
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import model
from tests.test_gemma4 import ALL
from tests.test_gemma4_small import save_small
from tests.test_gpt_oss import ATTN, _save, clamp_as_configured  # noqa: F401 (the autouse fixture: 5.17's clamp)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpt_oss_combos"))


@pytest.fixture(scope="module")
def e2b(tmp_path_factory):
    return save_small(tmp_path_factory.mktemp("e2b_combos"))


def _ours(path, targets, **kw):
    """Our model (B ~ N(0, 0.05)), every trained norm and the embedding moved off the base's (× 1 + 0.1·N(0, 1))."""
    from torch.distributed.tensor import distribute_tensor

    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    mesh = {k: kw.pop(k) for k in ("fsdp_mesh", "attention") if k in kw}
    m, pm = build_nonzero_b(BuildOptions(path, **{"quant": "none", **kw}, lora_r=4, lora_alpha=8, seed=3,
                                         lora_targets=targets), **mesh)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad and "lora_" not in n:   # (under FSDP2 each rank its shard of the same draw)
                f = 1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                p.mul_(distribute_tensor(f, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else f)
    return m, pm


def _peft_twin(path, targets, ours, layers=None, dora=False):
    """peft on the transformers model (tests/test_norms.py's twin): LoRA (on `layers`) and the tensors we train beside
    it as modules_to_save, holding our values."""
    from tests.test_norms import _peft_twin as twin

    ref, mine, theirs = twin(path, "none", ours, layers, dora, targets)
    return ref.train(), mine, theirs


def _against_peft(path, targets, layers=None, hook=None, noise=None, rows=2, **kw):
    """Our loss and every trained gradient = peft's twin on `rows` rows of 29 tokens (`hook`: a forward hook on the
    transformers model's embed_tokens; `noise`: ours, the same)."""
    ours, _ = _ours(path, targets, lora_layers=layers, **kw)
    ref, mine, theirs = _peft_twin(path, targets, ours, None if layers is None else list(layers), kw.get("dora", False))
    ids = torch.randint(0, 128, (rows, 29), generator=torch.Generator().manual_seed(5))
    ids[0, 3] = 0   # (E2B's pad token mid-row: its row of a trained embedding gets the lookup's gradient, ~1000x the
    # others' on this model, whose pad row is zero: RMSNorm's gradient at 0 is 1/sqrt(eps))
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    s, n = ours(ids, labels=labels, noise=noise)
    (s / n).backward()
    handle = ref.get_base_model().model.embed_tokens.register_forward_hook(hook) if hook else None
    logits = ref(input_ids=ids).logits
    if handle:
        handle.remove()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="sum", ignore_index=-100)
    (want / n).backward()
    torch.testing.assert_close(s.detach(), want.detach(), rtol=1e-5, atol=1e-5, msg="summed loss")
    for k, p in mine.items():
        assert theirs[k].grad is not None and theirs[k].grad.abs().sum() > 0, k
        assert (r := rel(p.grad, theirs[k].grad)) < 1e-4, f"grad {k} off by {r:.2g}"
    return mine


GPT_OSS_MEM = {"plain": dict(ac=False), "ac_tiled_mlp": dict(ac=True, tiled_mlp=True),
               "ac_keep_attn_tiled_mlp_kernel": dict(ac=True, ac_keep_attn=True, tiled_mlp=True, kernel=True),
               "dora_ac_tiled_attn_mlp": dict(ac=True, tiled_attn=True, tiled_mlp=True, kernel=True, dora=True),
               "ac_kernel_blocked_backward": dict(ac=True, kernel=True, rows=1, block=8)}


@pytest.mark.parametrize("mem", list(GPT_OSS_MEM.values()), ids=list(GPT_OSS_MEM))
def test_gpt_oss_norms_and_embedding_train_as_peft(gpt_oss, mem, monkeypatch):
    """`block`: kernels.BACKWARD_BLOCK, so the full layer's GQA rows (29 tokens) take the blocked backward (a row past
    65,536 tokens on a GPU), given the sink-merged out, lse, its sums in q's, k's, v's and out's storage (one row)."""
    from parallel import kernels
    from parallel.cp import KernelAttention

    mem = dict(mem)
    if mem.pop("kernel", False):
        mem["attention"] = KernelAttention()
    if block := mem.pop("block", None):
        monkeypatch.setattr(kernels, "BACKWARD_BLOCK", block)
        calls = []
        blocked = kernels.backends.blocked_backward
        monkeypatch.setattr(kernels.backends, "blocked_backward", lambda *a, **k: calls.append(a[-1]) or blocked(*a))
    mine = _against_peft(gpt_oss, ATTN, train_norms=True, train_embeddings=True, **mem)
    norms = [k for k in mine if "norm" in k]
    assert len(norms) == 2 * 2 + 1 and "model.embed_tokens.weight" in mine, sorted(mine)
    assert len(mine) == 16 + 8 * mem.get("dora", False) + 5 + 1, sorted(mine)   # (DoRA: a magnitude a projection)
    assert not block or calls == [{"q", "k", "v", "out"}], calls   # (one full layer, every storage spare)


E2B_CASES = {"layers_3_5_ac_tiled_mlp": ((3, 4, 5), dict(ac=True, tiled_mlp=True)),
             "layers_2_4_ac_group_2": ((2, 4), dict(ac=True, ac_group=2)),
             "layers_3_5_ac_keep_attn_tiled_mlp_kernel": ((3, 4, 5), dict(ac=True, ac_keep_attn=True, tiled_mlp=True,
                                                                          kernel=True)),
             "layers_1_3_5_ac_blocks_2": ((1, 3, 5), dict(ac=True, ac_blocks=2)),
             "all_layers_dora_tied_embedding_ac_tiled_mlp": (None, dict(ac=True, tiled_mlp=True, train_embeddings=True,
                                                                        dora=True))}


@pytest.mark.parametrize("layers,mem", list(E2B_CASES.values()), ids=list(E2B_CASES))
def test_e2b_lora_layers_norms_and_embedding_as_peft(e2b, layers, mem):
    """--lora-layers leaving out the storing layers (1; 2 too where 3-5) and the blocks below them: the trained
    per_layer_projection_norm feeds every block, so those blocks run backward all the same. Every block adapted with
    DoRA and the tied embedding trained: its gradient comes through the head and through the scaled embedding, which
    the per-layer inputs' projection reads too."""
    from parallel.cp import KernelAttention

    mem = dict(mem)
    if mem.pop("kernel", False):
        mem["attention"] = KernelAttention()
    mine = _against_peft(e2b, ALL, layers, train_norms=True, **mem)
    assert "model.per_layer_projection_norm.weight" in mine and not any(
        f"layers.{i}." in k for k in mine for i in set(range(6)) - set(layers or range(6))), sorted(mine)
    assert ("model.embed_tokens.weight" in mine) == mem.get("train_embeddings", False)


def test_e2b_neftune_noise_reaches_the_per_layer_inputs_as_in_transformers(e2b):
    """The noise (a fixed draw here, added where train.py's NEFTune adds its own: model/llama.py's `noise`) is part of
    the embedding output the per-layer inputs are made from, as under transformers' hook on embed_tokens
    (Gemma4TextModel projects the hooked inputs_embeds)."""
    delta = torch.randn(2, 29, 48, generator=torch.Generator().manual_seed(9)) * 0.5
    assert model.load.read_args(e2b).dim == 48

    def noise(x):
        x.add_(delta)
    _against_peft(e2b, ALL, noise=noise, hook=lambda mod, args, out: out + delta, ac=True, tiled_mlp=True)


@pytest.mark.parametrize("which", ["gpt_oss", "e2b"])
def test_dpo_with_shared_prompts_equals_the_formula_on_transformers_and_peft(tmp_path, which):
    """DPO (sigmoid, beta 0.7, the base as the reference) on a packed micro-batch of three pairs, each prompt held once
    and the rejected answer a branch (--dpo-share-prompt: the ring's planned calls on one process), under AC with the
    tiled MLP and --train-norms (the reference computes with the base's norms, the decoder's per_layer_projection_norm
    included): GPT-OSS's sinks join the branches' rows, E2B's reuse layers take the storing layers' K/V of the
    branched row; = each sequence alone through transformers + peft (its disable_adapter() the reference): losses
    and every trained gradient. (Windows of 64: a binding one is refused beside branches.)"""
    import math

    from data.collate import collate
    from data.pairs import shared_start
    from parallel.cp import KernelAttention
    from parallel.preference import DPO, Preference
    from tests.test_dpo import _formula, _pair

    if which == "gpt_oss":
        path, targets = _save(tmp_path / "m", sliding_window=64), ATTN
    else:
        path, targets = save_small(tmp_path / "m", sliding_window=64), ALL
    g = torch.Generator().manual_seed(3)
    made = [_pair(g, 19, 13, 6), _pair(g, 9, 22, 4), _pair(g, 15, 15, 12)]
    rows = [{"input_ids": torch.cat([c, r[f:]]), "labels": torch.cat([lc, lr[f:]]), "split": len(c), "shared": f}
            for _, (c, r), (lc, lr) in made
            for f in [shared_start({"input_ids": c, "labels": lc}, {"input_ids": r, "labels": lr})]]
    b = collate(rows, True, 1, 0, sides=True)
    ours, _ = _ours(path, targets, train_norms=True, ac=True, tiled_mlp=True, attention=KernelAttention())
    pref = Preference(beta=0.7)
    losses, _ = DPO(ours, pref, base=path)(b["input_ids"], b["position_ids"], b["labels"], b["sides"], 3, [0, 1, 2])
    (losses.sum() / 3).backward()
    ref, mine, theirs = _peft_twin(path, targets, ours)

    def logp(ids, lab):   # each sequence alone, the whole logits
        z = ref(input_ids=ids[None]).logits[0].float().log_softmax(-1)
        keep = lab != -100
        return z[keep].gather(1, lab[keep, None]).sum()

    want = []
    for _, seqs, labels in made:
        with torch.no_grad(), ref.disable_adapter():
            base = [logp(s, lab) for s, lab in zip(seqs, labels)]
        want.append(_formula(pref, [logp(s, lab) for s, lab in zip(seqs, labels)], base,
                             [(lab != -100).sum() for lab in labels]))
    want = torch.stack(want)
    (want.sum() / 3).backward()
    torch.testing.assert_close(losses.float(), want.detach(), rtol=1e-5, atol=1e-6, msg="pair losses")
    assert bool(((losses.detach() - math.log(2)).abs() > 1e-4).all()), "the policy should differ from the reference"
    for k, p in mine.items():
        assert theirs[k].grad is not None and theirs[k].grad.norm() > 0, k
        assert (r := rel(p.grad, theirs[k].grad)) < 1e-4, f"grad {k} off by {r:.2g}"


@pytest.mark.parametrize("which", ["gpt_oss", "gpt_oss_mxfp4", "e2b"])
def test_nf4_merge_with_trained_norms_is_what_the_nf4_model_computes(gpt_oss, e2b, tmp_path, which):
    """An adapter trained on the NF4 base (--quant nf4: GPT-OSS's experts 4-bit one by one, its router not; E2B's block
    projections, not its per-layer Linears) with --train-norms and --train-embeddings (GPT-OSS: untied), merged with
    --quant nf4: transformers' model of the merged folder (the experts written fused back; an MXFP4 base's as its BF16
    form) computes our NF4 model's logits, with the trained norms and embedding (moved off the base's)."""
    from model import merge
    from model.export import export_adapter
    from tests.test_gpt_oss_mxfp4 import _mxfp4

    path, targets, tied = {"gpt_oss": (gpt_oss, ATTN, False), "e2b": (e2b, ALL, True)}.get(which, (None, ATTN, False))
    if which == "gpt_oss_mxfp4":
        path = _mxfp4(_save(tmp_path / "bf16", intermediate_size=32), tmp_path / "mx")
    ours, pm = _ours(path, targets, quant="nf4", train_norms=True, train_embeddings=not tied)
    assert ours.args.tie_embeddings == tied
    export_adapter(pm, str(tmp_path / "a"), path, quant="nf4")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", path, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32",
                       "--quant", "nf4"]) == 0
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    got, info = T.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        want = ours.eval()(ids)
        assert rel(got.eval()(input_ids=ids).logits, want) < 1e-5, "nf4 merge"
        plain = T.AutoModelForCausalLM.from_pretrained(path if which != "gpt_oss_mxfp4" else str(tmp_path / "bf16"),
                                                       dtype=torch.float32).eval()
        assert rel(plain(input_ids=ids).logits, want) > 1e-3, "the base's own logits are ours too"


# ----------------------------------------------------------------------------- layouts


def _micro_batch():
    """Two rows of 43 tokens: documents 17 + 26, and 25 tokens then 18 of padding (label -100, positions going on:
    data/collate.py's), which the layouts pad to their divisor (44) again."""
    ids = torch.randint(0, 128, (2, 43), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[1, 24:] = -100
    pos = torch.stack([torch.cat([torch.arange(17), torch.arange(26)]), torch.arange(43)])
    return ids, labels, pos


def _layouts(rank, world_size, cases):
    """Each case (checkpoint, LoRA targets, cp impl, model flags, memory flags): cp 2's loss and every trained
    gradient = one process's (float64; the model flags on both, the memory flags on cp 2's)."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims, kv_heads

    ids, labels, pos = _micro_batch()
    grads = lambda m: {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                       for k, p in m.named_parameters() if p.requires_grad}
    done = []
    for path, targets, impl, flags, mem in cases:
        what = f"cp 2 {impl} {flags} {mem} rank {rank}"
        ref, _ = _ours(path, targets, dtype=torch.float64, ac=False, **flags)
        s, n = ref(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        margs = model.load.read_args(path)
        dims = ParallelDims.from_args(world_size, 1, -1, 2, impl, None, margs.n_heads, kv_heads(margs))
        meshes = dims.build_mesh("cpu")
        m, _ = _ours(path, targets, dtype=torch.float64, fsdp_mesh=meshes.fsdp, attention=cp_attention(meshes, dims),
                     **flags, **mem)
        c = meshes.cp.get_local_rank()
        ls, ln = m(shard_sequence(ids, dims, c, 0), position_ids=shard_sequence(pos, dims, c, None),
                   labels=shard_sequence(labels, dims, c, -100))
        assert shard_sequence(ids, dims, c, 0).shape[1] == 22, what   # (43 padded to 44)
        total, got = ln.detach().clone(), ls.detach().clone()
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
        dist.all_reduce(got, group=meshes.dp_cp.get_group())
        (ls / total).backward()
        assert total.item() == n.item(), what
        torch.testing.assert_close(got / total, s.detach() / n, rtol=1e-7, atol=0, msg=f"{what}: loss")
        want, have = grads(ref), grads(m)
        assert have.keys() == want.keys() and any("norm" in k for k in have), what
        for k in have:
            assert (r := rel(have[k], want[k])) < 1e-6, f"{what}: grad {k} off by {r:.2g}"
        done.append(what)
    return done


@pytest.mark.timeout(300)
def test_cp2_padded_micro_batch_with_norms_equals_one_process(gpt_oss, e2b):
    from tests.dist import run_ranks

    norms = dict(train_norms=True)
    cases = [(gpt_oss, ATTN, "ring", norms, dict(offload_activations=True)),
             (gpt_oss, ATTN, "ulysses", norms, dict(ac_group=2)),
             (e2b, ALL, "ring", dict(norms, lora_layers=(3, 4, 5)), dict(tiled_mlp=True)),
             (e2b, ALL, "ulysses", dict(norms, lora_layers=(3, 4, 5)), dict(offload_activations=True))]
    done = run_ranks(_layouts, 2, cases, timeout=280)
    assert [len(d) for d in done] == [4, 4], done


def test_e2b_lora_dropout_under_ac_replays_the_units_masks(e2b):
    """LoRA dropout 0.2 with --tiled-mlp (7-token tiles) on E2B, whose block recompute runs the tiled unit (the
    per-layer branch saves the sum after it), under AC and under --ac-group 2: the loss and every LoRA gradient
    (float64) = the untiled model's without AC whose unit runs each tile with grad in the tiles' order (the same masks,
    drawn in forward; backward draws others between): the recompute must hand the per-layer branch forward's sum, and
    the unit's backward forward's masks."""
    from parallel.memory import apply_tiled_mlp

    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ref, _ = _ours(e2b, ALL, lora_dropout=0.2, dtype=torch.float64, ac=False)
    for b in ref.model.layers:   # the reference: the untiled unit on each tile with grad, in the tiles' order
        b.feed_forward = lambda r, f=b.feed_forward: torch.cat([f(x) for x in r.reshape(-1, r.shape[-1]).split(7)]
                                                               ).view_as(r)
    out = []
    for mem in (None, dict(ac=True), dict(ac=True, ac_group=2)):
        if mem is None:
            m = ref
        else:
            m, _ = _ours(e2b, ALL, lora_dropout=0.2, dtype=torch.float64, **mem)
            apply_tiled_mlp(m, 7)
        torch.manual_seed(42)
        s, n = m.train()(ids, labels=labels)
        torch.manual_seed(43)
        (s / n).backward()
        out.append((mem, s.detach(), {k: p.grad for k, p in m.named_parameters() if p.requires_grad}))
    (_, s0, g0), *rest = out
    for mem, s, g in rest:
        torch.testing.assert_close(s, s0, rtol=1e-12, atol=0, msg=f"{mem}: loss")
        assert g.keys() == g0.keys() and len(g) == 2 * (7 + 6 + 7 + 5 + 5 + 5), mem
        for k in g:
            assert (r := rel(g[k], g0[k])) < 1e-6, f"{mem}: grad {k} off by {r:.2g}"   # (float32 tile sums)
