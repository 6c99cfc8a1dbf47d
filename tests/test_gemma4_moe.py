"""Gemma 4's MoE block (`enable_moe_block`: google/gemma-4-26B-A4B's form; model/gemma4_moe.py) computes what
transformers' Gemma4ForCausalLM does, trains under NF4, and its adapters and merges load in transformers and peft.

Pins (CPU, float32, tiny random models made and saved by transformers 5.25: 4 layers sliding, full, sliding, full,
attention_k_eq_v, 6 experts of width 32 top 2 beside a dense MLP of 64 in every block; every norm weight, the routers'
scale and per_expert_scale, layer_scalar drawn away from 1, the routers' projections × 200 so the top 2 are decided):
- logits = transformers' on rows far from position 0 and on a packed row; routing on the block's normed input, a
  dropped per_expert_scale or the gate/up halves of the fused gate_up_proj swapped each move them far;
- config.json read as Gemma4TextConfig reads it (num_experts, top_k_experts, moe_intermediate_size; a missing one
  refused naming it); n_params = our model's parameters; the memory plan names the MoE block as not yet planned;
- LoRA on the attention and the dense MLP (gate_proj, up_proj, down_proj: peft on transformers' model adapts those,
  never the fused experts): the loss and every LoRA gradient = peft's on Gemma4ForCausalLM, the same LoRA modules;
- the wrapper (Gemma4ForConditionalGeneration): logits = transformers'; the exported adapter loads in peft with our
  logits; `python -m model.merge` = peft's merge_and_unload, the experts written fused as stored; with --quant nf4 the
  merged model's logits = our NF4 model's with the adapter (each expert quantized on its own, as in training);
- NF4: every expert projection and the dense MLP 4-bit, the routers not; train.py, 2 steps of --global-batch 4 with
  --quant nf4: AC with --tiled-mlp = no AC (losses, grad norms, adapter);
- --tiled-mlp runs the block's whole feed-forward side (dense MLP, router, experts, all their norms) as one unit over
  token tiles: AC + tiled = untiled in float64 (loss and every gradient, LoRA dropout's masks replayed), = peft's
  gradients, and on cp 2 Ulysses and ring = one untiled process; the plan's saved tensors = autograd's (r alone).

Run: .venv/bin/python -m pytest -q tests/test_gemma4_moe.py
"""

import os

import pytest
import torch
import transformers as T

import model
from tests.helpers import one_thread, train_argv
from tests.test_gemma4 import _peft_loaded

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIG = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              hidden_size_per_layer_input=0, sliding_window=4, layer_types=TYPES, max_position_embeddings=4096,
              final_logit_softcapping=None, attention_k_eq_v=True, enable_moe_block=True, num_experts=6,
              top_k_experts=2, moe_intermediate_size=32)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
N_LORA = (7 + 6) * 2   # per block: the seven, less v_proj on the k_eq_v full layers; none on an expert
MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _perturb(m):
    """transformers starts every norm weight, router scale and layer_scalar at 1: the identity would hide a dropped
    one. The routers × 200 (logits of std ~4): decided top 2 (no near tie that float32 rounding could flip)."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "vision" in n:
                continue
            if "norm" in n or n.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("router.proj.weight"):
                p.mul_(200)
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar"):
                b.fill_(0.5 + torch.rand(()).item())


def _save(cfg, path, wrapper=False):
    torch.manual_seed(0)
    if wrapper:
        m = T.Gemma4ForConditionalGeneration(T.Gemma4Config(text_config=dict(cfg, model_type="gemma4_text"),
                                                            vision_config=VISION, audio_config=None))
    else:
        m = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg))
    m = m.float()
    _perturb(m)
    m.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _save(CONFIG, tmp_path_factory.mktemp("gemma4_moe"))


def _ids(s=37, seed=1):
    return torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(ckpt):
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = model.from_pretrained(ckpt).eval()
    b = ours.model.layers[0]
    assert len(b.experts) == 6 and b.router.top_k == 2 and tuple(b.experts[0].gate.weight.shape) == (32, 48)
    for i, blk in enumerate(ours.model.layers):   # loaded as stored, not the modules' 1
        torch.testing.assert_close(blk.router.per_expert_scale, hf.model.layers[i].router.per_expert_scale)
        assert (blk.router.per_expert_scale != 1).all() and (blk.router.scale != 1).all()
    ids = _ids()
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"
        for blk in ours.model.layers:   # per_expert_scale dropped
            blk.router.per_expert_scale.data, blk.saved = torch.ones(6), blk.router.per_expert_scale.data
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "per_expert_scale has no effect"
        for blk in ours.model.layers:
            blk.router.per_expert_scale.data = blk.saved
            blk.router.norm, blk.saved = torch.nn.Identity(), blk.router.norm
        assert rel(ours(ids, position_ids=pos), ref) > 1e-3, "the router's own weightless norm has no effect"
        for blk in ours.model.layers:
            blk.router.norm = blk.saved
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "restored"


def test_config_read_as_transformers_reads_it(ckpt):
    base = {**T.Gemma4TextConfig(**CONFIG).to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    a = model.ModelArgs.from_config_dict(base)
    assert (a.moe.experts, a.moe.top_k, a.moe.width, a.moe.beside, a.intermediate_size) == (6, 2, 32, True, 64)
    from model.moe import expert_targets
    assert expert_targets(a, ALL) is None   # (the dense MLP's names, as peft reads them)
    ours = model.from_pretrained(ckpt)
    assert model.load.read_args(ckpt).n_params == sum(p.numel() for n, p in ours.named_parameters()
                                                      if "_norm." not in n or "layernorm" in n)
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        with pytest.raises(ValueError, match=key):
            model.ModelArgs.from_config_dict({**base, key: None})
    with pytest.raises(ValueError, match="top_k_experts 7 is more than num_experts 6"):
        model.ModelArgs.from_config_dict({**base, "top_k_experts": 7})


def test_fused_tensors_read_expert_by_expert(ckpt, tmp_path):
    """Expert e's gate / up / down = the rows transformers' Gemma4TextExperts multiplies by; the start-up check names
    a fused tensor whose shape is not config.json's."""
    import json

    from safetensors.torch import load_file, save_file

    from model.load import CheckpointReader
    from model.load_checks import check_config_shapes

    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    r = CheckpointReader(ckpt)
    gu, down = stored["model.layers.2.experts.gate_up_proj"], stored["model.layers.2.experts.down_proj"]
    for e in range(6):
        assert torch.equal(r.get(f"model.layers.2.experts.{e}.gate.weight"), gu[e, :32]), e
        assert torch.equal(r.get(f"model.layers.2.experts.{e}.up.weight"), gu[e, 32:]), e
        assert torch.equal(r.get(f"model.layers.2.experts.{e}.down.weight"), down[e]), e
        assert torch.equal(r.get_rows(f"model.layers.2.experts.{e}.up.weight", 5, 9), gu[e, 37:41]), e
    assert "model.layers.2.experts.gate_up_proj" not in r.where
    r.close()
    assert check_config_shapes(ckpt, model.load.read_args(ckpt)) is None
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**stored, "model.layers.1.experts.down_proj": down[:, :, :16].contiguous()},
              str(bad / "model.safetensors"))
    with open(os.path.join(ckpt, "config.json")) as f, open(bad / "config.json", "w") as g:
        json.dump(json.load(f), g)
    with pytest.raises(ValueError, match=r"model.layers.1.experts.down_proj .*checkpoint \[6, 48, 16\], config.json "
                                         r"implies \[6, 48, 32\]"):
        check_config_shapes(str(bad), model.load.read_args(str(bad)))


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True)], ids=["plain", "ac_tiled_mlp"])
def test_lora_grads_match_peft_on_transformers(ckpt, mem):
    """peft's LoRA on Gemma4ForCausalLM with our adapter's values, the attention and the dense MLP named: the same LoRA
    modules (none on an expert, in peft and here), the same loss and every LoRA gradient (the routers' weights
    differentiable, as transformers'); also with AC and --tiled-mlp (the block's feed-forward side one tiled unit)."""
    from peft import LoraConfig, get_peft_model

    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids = _ids(29, 5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3,
                                                    lora_targets=ALL, **mem))
    assert all(("feed_forward" in vars(b)) == ("tiled_mlp" in mem) for b in ours.model.layers)
    s, n = ours(ids, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
                        LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL), lora_dropout=0.0,
                                   init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not hf.load_state_dict(state, strict=False).unexpected_keys
    logits = hf.train()(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    theirs = {k: p.grad for k, p in hf.named_parameters() if p.requires_grad}
    torch.testing.assert_close(s.detach(), ref.detach(), rtol=1e-5, atol=1e-5, msg="loss")
    assert theirs.keys() == mine.keys() and len(mine) == N_LORA * 2, sorted(set(mine) ^ set(theirs))
    assert not any("experts" in k for k in mine)
    for k in mine:
        assert rel(mine[k], theirs[k]) < 1e-4, f"grad {k}"


def _float64(ckpt, **kw):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    opts = dict(quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ALL, train_norms=True, dtype=torch.float64,
                ac=False)
    return build_nonzero_b(BuildOptions(ckpt, **(opts | kw)))[0].train()


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "lora_dropout"])
def test_tiled_feed_forward_equals_untiled_in_float64(ckpt, dropout):
    """--tiled-mlp runs the block's whole feed-forward side (pre_feedforward_layernorm, the dense MLP,
    post_feedforward_layernorm_1; the router, pre_feedforward_layernorm_2, the experts, post_feedforward_layernorm_2;
    post_feedforward_layernorm of their sum) as one unit over token tiles (parallel.memory._tiled_unit): under AC (the
    recompute skips the unit) the loss and every gradient (LoRA on the attention and the dense MLP, --train-norms'
    norms, the MoE block's three among them) = the untiled model's without AC, float64, on whole rows far from position
    0 and on a packed row; tiles of 7 tokens (uneven) and the rule's (E·D/k = 144 tokens: 2 × 100-token rows in two
    tiles). With LoRA dropout (masks drawn per tile) the reference runs the same tiles with grad: backward replays
    forward's."""
    from parallel.memory import apply_tiled_mlp

    def step(m, ids, pos, seed=5):
        labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)   # (the same dropout masks, forward's; backward draws others between)
        s, n = m(ids, position_ids=pos, labels=labels)
        torch.manual_seed(seed + 1)
        (s / n).backward()
        return s.detach(), {k: p.grad for k, p in m.named_parameters() if p.requires_grad}

    ids = _ids()
    rows = [(ids, torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])),
            (ids[:1], torch.cat([torch.arange(15), torch.arange(22)])[None])]
    long = _ids(100, 3)
    ref = _float64(ckpt, lora_dropout=dropout)
    if dropout:   # the reference: the untiled unit on each tile with grad, in the tiles' order
        for b in ref.model.layers:
            b.feed_forward = lambda r, f=b.feed_forward, t=7: torch.cat(
                [f(x) for x in r.reshape(-1, r.shape[-1]).split(t)]).view_as(r)
    tiled = _float64(ckpt, ac=True, lora_dropout=dropout)
    apply_tiled_mlp(tiled, 7)
    cases = [("7-token tiles", tiled, *rows[0]), ("7-token tiles, packed", tiled, *rows[1])]
    if not dropout:
        cases.append(("the rule's tiles", _float64(ckpt, ac=True, tiled_mlp=True), long, None))
    for what, m, x, pos in cases:
        with one_thread():
            want, got = step(ref, x, pos), step(m, x, pos)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0, msg=f"{what}: loss")
        assert got[1].keys() == want[1].keys() and len(want[1]) == N_LORA * 2 + 4 * (4 + 2 + 3) + 1, what
        assert {f"model.layers.{i}.{n}.weight" for i in range(4) for n in MOE_NORMS} <= want[1].keys(), what
        for k in want[1]:
            assert (r := rel(got[1][k], want[1][k])) < 1e-6, f"{what}: grad {k} off by {r:.2g}"


# ----------------------------------------------------------------------------- the wrapper, adapters, merges


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    return _save(CONFIG, tmp_path_factory.mktemp("gemma4_moe_wrapper"), wrapper=True)


def test_wrapper_adapter_and_merges(wrapped, tmp_path):
    from safetensors.torch import load_file

    from model import merge
    from model.export import export_adapter
    from model.load import from_pretrained
    from model.nf4 import NF4Linear
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ref = T.Gemma4ForConditionalGeneration.from_pretrained(wrapped).eval()
    ids = _ids(23)
    with torch.no_grad():
        assert rel(from_pretrained(wrapped)(ids), ref(input_ids=ids).logits) < 1e-5, "wrapper logits"
    ours, peft_model = build_nonzero_b(BuildOptions(wrapped, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ALL,
                                                    seed=3))
    export_adapter(peft_model, str(tmp_path / "a"), wrapped, quant="none")
    with torch.no_grad():
        want = ours(ids)
    pm = _peft_loaded(wrapped, str(tmp_path / "a"))
    with torch.no_grad():
        assert rel(pm(input_ids=ids).logits, want) < 1e-5, "adapter in peft"
    lora = [n for n, _ in pm.named_modules() if n.endswith(".lora_A")]
    assert len(lora) == N_LORA and all(".language_model.layers." in n and "experts" not in n for n in lora), lora
    out = str(tmp_path / "merged")
    assert merge.main(["--model", wrapped, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    merged_ref = pm.merge_and_unload()
    got, info = T.Gemma4ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert rel(got(input_ids=ids).logits, merged_ref(input_ids=ids).logits) < 1e-5, "merge"
    stored, merged = (load_file(os.path.join(p, "model.safetensors")) for p in (wrapped, out))
    assert sorted(merged) == sorted(stored), sorted(set(merged) ^ set(stored))
    kept = [k for k in stored if "experts" in k or "router" in k]
    assert len(kept) == 4 * 5 and all(torch.equal(merged[k], stored[k]) for k in kept)
    # NF4: the experts and the dense MLP 4-bit, the routers not; the nf4 merge = what that model computes
    q, qpeft = build_nonzero_b(BuildOptions(wrapped, quant="nf4", lora_r=4, lora_alpha=8.0, lora_targets=ALL, seed=3))
    blk = q.model.layers[1]
    assert all(isinstance(m, NF4Linear) for m in (blk.experts[5].gate, blk.experts[0].down, blk.mlp.base_layer
                                                  if hasattr(blk.mlp, "base_layer") else blk.mlp.up_proj.base_layer))
    assert type(blk.router.proj) is torch.nn.Linear
    export_adapter(qpeft, str(tmp_path / "q"), wrapped, quant="nf4")
    out = str(tmp_path / "merged_nf4")
    assert merge.main(["--model", wrapped, "--adapter", str(tmp_path / "q"), "--out", out, "--dtype", "fp32",
                       "--quant", "nf4"]) == 0
    with torch.no_grad():
        got = T.Gemma4ForConditionalGeneration.from_pretrained(out).eval()(input_ids=ids).logits
        assert rel(got, q(ids)) < 1e-5, "nf4 merge"
        assert rel(got, want) > 1e-3, "nf4 merge: the float base's"


def test_train_runs_with_nf4(assets, tmp_path):
    """train.py, 2 steps of --global-batch 4 with --quant nf4 on the fixture tokenizer's chat records: AC with
    --tiled-mlp = no AC."""
    import train
    from tests.fixtures import make_tokenizer
    from tests.test_train import _compare

    tok = make_tokenizer(tmp_path / "model")
    cfg = {**CONFIG, "vocab_size": len(tok), "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 0,
           "bos_token_id": None}
    a = {**assets, "model": _save(cfg, tmp_path / "model")}
    with one_thread():
        for name, flags in (("plain", ["--no-ac"]), ("tiled", ["--tiled-mlp"])):
            train.main(train_argv(a, str(tmp_path / name), "--quant", "nf4", "--steps", "2", "--global-batch", "4",
                                  *flags))
    _compare("Gemma 4 MoE nf4", str(tmp_path / "tiled"), str(tmp_path / "plain"), steps=(1, 2))


def _two_ranks(rank, world_size, a, root):
    """train.py on cp 2 ring (FSDP2 shards each block over both ranks: the experts' NF4 codes too, each rank reading
    its own blocks of the fused tensors); then a build on that mesh: each expert's codes a DTensor half."""
    from torch.distributed.tensor import DTensor

    import train
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, build_model

    train.main(train_argv(a, os.path.join(root, "cp2"), "--quant", "nf4", "--cp", "2", "--cp-impl", "ring",
                          "--steps", "1", "--global-batch", "4"))
    ours, _ = build_model(BuildOptions(a["model"], quant="nf4", lora_r=4, lora_alpha=8, seed=3),
                          fsdp_mesh=ParallelDims(world_size, cp=2).build_mesh("cpu").fsdp)
    w = ours.model.layers[1].experts[3].down.weight
    return isinstance(w, DTensor) and 2 * w.to_local().shape[0] == w.shape[0]


@pytest.mark.timeout(400)
def test_cp_layouts_equal_one_process_in_float64(ckpt):
    """Routing is per token, so a sequence shard routes each token as the whole row does: cp 2 Ulysses and cp 2 ring
    (2 ranks) give one process's loss and every LoRA gradient, on every rank, in float64 (tests/test_gemma4_layouts.py's
    harness on this MoE model); both with --tiled-mlp's feed-forward unit in 5-token tiles too (AC on, FSDP2 swapping
    the unit's parameters) = the untiled process. Why float64: the routing weights' softmax is saturated at these
    router scales (logits of std ~4 and more after training), and its backward, p·(g - sum(g·p)), cancels to ~1 - p of
    g, so float32's 1e-7 differences in the attention's summation order between layouts come out ~1e-4 in the LoRA
    gradients (measured: 5e-4 of the grad norm at step 1 with routers × 2000, --quant none or nf4 alike; dp_shard 2,
    which keeps each row's kernels, equal bit for bit)."""
    from tests.dist import run_ranks
    from tests.test_gemma4_layouts import _layouts

    cases = [(2, "ulysses", None, {}), (2, "ulysses", None, dict(tile=5)), (2, "ring", None, dict(tile=5))]
    assert run_ranks(_layouts, 2, ckpt, cases, timeout=380) == [True, True]


@pytest.mark.timeout(600)
def test_cp2_ring_with_sharded_nf4_experts_runs_as_one_rank(assets, tmp_path):
    """train.py with --quant nf4 on cp 2 ring, experts NF4 and FSDP2-sharded over both ranks (each expert's codes a
    DTensor half, each rank reading its rows of the fused tensors): step 1's loss and token count (--global-batch 4) =
    1 rank's (the
    gradients: float64, test_cp_layouts_equal_one_process_in_float64). A model without per-layer attention shapes."""
    import json

    from tests.dist import run_ranks
    from tests.fixtures import make_tokenizer

    tok = make_tokenizer(tmp_path / "model")
    cfg = {**CONFIG, "vocab_size": len(tok), "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 0,
           "bos_token_id": None, "global_head_dim": 16, "num_global_key_value_heads": None, "attention_k_eq_v": False}
    a = {**assets, "model": _save(cfg, tmp_path / "model")}
    import train
    with one_thread():
        train.main(train_argv(a, str(tmp_path / "one"), "--quant", "nf4", "--steps", "1", "--global-batch", "4"))
    got = run_ranks(_two_ranks, 2, a, str(tmp_path), timeout=400, pg_timeout=60)
    assert got == [True] * 2, "an expert's NF4 codes not halved over the 2 ranks"
    step = [next(m for m in map(json.loads, open(tmp_path / d / "metrics.jsonl")) if m.get("step") == 1)
            for d in ("one", "cp2")]
    assert step[0]["tokens"] == step[1]["tokens"] and abs(step[0]["loss"] - step[1]["loss"]) < 1e-5, step


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
G26 = os.path.join(CONFIGS, "gemma-4-26b-a4b")


def _build(path, flags, quant="nf4"):
    import train
    from model.lora_spec import lora_layers
    from parallel.parallelize import BuildOptions, build_model

    args = train.build_parser().parse_args(["--model", path, "--max-len", "128", "--global-batch", "1", "--quant",
                                            quant, "--dtype", "fp32", "--no-ac", "--lora-dropout", "0", *flags])
    ours, _ = build_model(BuildOptions(
        path, quant=quant, ac=False, lora_dropout=0.0, tiled_mlp=args.tiled_mlp, train_norms=args.train_norms,
        lora_targets=tuple(args.lora_targets.split(",")), lora_layers=lora_layers(args.lora_layers)), device="cpu")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    return ours, args


@pytest.mark.parametrize("flags", [[], ["--tiled-mlp"], ["--lora-targets", "attn"], ["--train-norms"],
                                   ["--lora-layers", "2-3"], ["--tiled-mlp", "--train-norms"]],
                         ids=["plain", "tiled_mlp", "attn", "train_norms", "lora_layers", "tiled_mlp_train_norms"])
def test_planned_activations_match_autograd(ckpt, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms = the bytes autograd keeps in a real forward (unique
    storages, parameters excluded): the dense Gemma 4 block's, and beside its MLP the MoE block's
    (parallel/plan_moe.saved: the router's rsqrt, one-element weight, float32 softmax, top k, renormalisation and
    per_expert_scale picks; the slots' order; each expert's gate, gelu and up outputs and its down output with the
    float32 routing weight; the three norms:
    pre_feedforward_layernorm_2's rsqrt, post_feedforward_layernorm_1's and _2's inputs and rsqrt). --tiled-mlp runs
    the whole feed-forward side as one tiled unit: none of these, nor post_feedforward_layernorm's input, is kept
    (the block keeps r, the unit's input)."""
    from tests.helpers import planned_and_saved_activations

    ours, args = _build(ckpt, flags)
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, terms)


@pytest.mark.parametrize("flags", [[], ["--train-norms"]], ids=["lora", "train_norms"])
def test_weight_terms_are_the_models_parameters(ckpt, flags):
    """--quant none, fp32, one process: base weights = the blocks' frozen Linears (attention at each layer's shapes, the
    dense MLP and every expert's gate, up, down), the norms-routers term = the block's seven norms, q/k norms,
    layer_scalar and the router (proj [E, D], scale [D], per_expert_scale [E]), LoRA's = 16 bytes per trainable element:
    all of the built model (with --train-norms the seven norms and q/k norms of each block too)."""
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    ours, args = _build(ckpt, flags, quant="none")
    dims, pack_rows = validate(args, ours.args, 1)
    p = memory_plan(ours.args, dims, args, "cpu", pack_rows)
    named = list(ours.model.layers.named_parameters())
    linear = sum(q.numel() for n, q in named if q.dim() == 2 and "lora" not in n and "router" not in n)
    rest = sum(q.numel() for n, q in named if "norm" in n or n.endswith("layer_scalar") or "router" in n)
    lora = sum(q.numel() for n, q in ours.named_parameters() if q.requires_grad and n != "model.norm.weight")   # (a
    # trained final norm: with the root's term, parallel/plan_weights.py)
    assert sum("experts" in n for n, _ in named) == 4 * 6 * 3
    got = {k.split(" (")[0].split(" shard")[0]: v for k, v in p.terms.items()}
    assert got["base weights"] == 4 * linear
    assert got["block norms, biases, routers"] == 4 * rest
    assert [v for k, v in p.terms.items() if k.startswith("LoRA params")] == [16 * lora]


def test_26b_a4b_config_reads_as_transformers_reads_it():
    """bench/configs/gemma-4-26b-a4b (the text config of google/gemma-4-26B-A4B): n_params = transformers' parameters on
    the meta device less the q/k norms (25.23B, the model card's 25.2B), 3.82B active (top 8 of 128 experts: the
    card's 3.8B); --plan, --max-len auto and the start-up check run on it (no refusal)."""
    import json

    from model.load import read_args

    m = read_args(G26)
    with open(os.path.join(G26, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg))
    qk = sum(q.numel() for n, q in hf.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert m.n_params - m.n_layers == sum(q.numel() for q in hf.parameters()) - qk   # (our layer_scalar: its buffer)
    assert round(m.n_params / 1e9, 2) == 25.23
    idle = (m.moe.experts - m.moe.top_k) * 3 * m.dim * m.moe.width * m.n_layers
    assert round((m.n_params - idle) / 1e9, 2) == 3.82


def test_train_norms_trains_the_moe_blocks_norms_and_the_adapter_loads_in_peft(wrapped, tmp_path):
    """--train-norms on the MoE block: its three norms (pre_feedforward_layernorm_2, post_feedforward_layernorm_1 and
    _2) train beside the dense block's four and q/k norms; the exported adapter (their weights moved off the base) loads
    in peft on transformers' model with our logits (the weightless v_norm and the router's norm have none)."""
    from model.export import export_adapter
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ours, peft_model = build_nonzero_b(BuildOptions(wrapped, quant="none", lora_r=4, lora_alpha=8.0,
                                                    lora_targets=ALL, seed=3, train_norms=True))
    trained = {n for n, p in ours.named_parameters() if p.requires_grad and "lora_" not in n}
    moe = {f"model.layers.{i}.{n}.weight" for i in range(4)
           for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")}
    assert moe <= trained and len(trained) == 4 * (4 + 2 + 3) + 1, sorted(trained)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n in trained:
                p.add_(torch.randn_like(p) * 0.2)
    export_adapter(peft_model, str(tmp_path / "a"), wrapped, quant="none")
    ids = _ids(23)
    with torch.no_grad():
        want = ours(ids)
    pm = _peft_loaded(wrapped, str(tmp_path / "a"))
    with torch.no_grad():
        assert rel(pm(input_ids=ids).logits, want) < 1e-5, "adapter with the trained norms in peft"
