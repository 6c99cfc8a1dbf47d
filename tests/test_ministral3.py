"""Ministral 3 (`model_type: ministral3`): transformers' Ministral3ForCausalLM, Llama 4's attention temperature too.

Pins (tiny random checkpoints written by transformers, YaRN with an original length of 8, so rows of 45 tokens reach
positions where q's temperature 1 + beta·log(1 + floor(pos / 8)) is far from 1):
- logits = transformers' (float32, 1e-5): whole rows far from 0 and a packed row (each document from its own
  positions, as transformers computes it alone); config.json read as transformers reads the edited file (no RoPE:
  its class's YaRN 16 × 16384, with positions past 16384; the classic `rope_scaling` form; a top-level original
  length; a sliding window, on every layer; no `sliding_window`: none; no `rms_norm_eps`: 1e-5); a RoPE without
  `llama_4_scaling_beta` refused; `--rope-scaling` keeps the temperature's length (others refused) and its RoPE
  loaded into transformers gives our logits; the FP8 releases refused, naming their BF16 twin;
- LoRA (all seven projections, B != 0, no quantization): summed loss and every LoRA gradient = peft's on the
  transformers model, packed rows, plain, with AC, and with --tiled-attn (tiles of 5 query rows) with and without AC;
- one process = cp 2 Ulysses = cp 2 ring (float64, whole model): loss and every gradient equal transformers' on
  every rank (so a temperature dropped, or taken from a shard's local positions, fails on each layout);
- the planner's activation terms = the bytes autograd keeps (q's own cos/sin tables counted), and `--plan` on the
  class's own config.json (Ministral 3 8B's sizes) runs.
A mutation check (the temperature dropped; the local position in its place) fails each of these tests.

Run: .venv/bin/python -m pytest -q tests/test_ministral3.py
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers as T

import model
from tests.dist import run_ranks

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6)
ROPE = {"type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3,
        "max_position_embeddings": 4096}
R, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PACKED = [[(0, 20, 0), (20, 45, 0)], [(0, 45, 50)]]   # per row (start, end, first position): two documents; one


def save(path, **kw):
    torch.manual_seed(0)
    hf = T.Ministral3ForCausalLM(T.Ministral3Config(**{**COMMON, **kw}, rope_parameters=dict(ROPE))).float().eval()
    with torch.no_grad():   # non-trivial norms, so a skipped one shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save(tmp_path_factory.mktemp("ministral3"))


def batch(rows=PACKED, n=45):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (len(rows), n), generator=g)
    ids[ids == 11] = 12   # (transformers gives its pad_token_id 11 no embedding gradient, ours one)
    pos = torch.empty(len(rows), n, dtype=torch.long)
    for r, row in enumerate(rows):
        for x, y, p in row:
            pos[r, x:y] = torch.arange(p, p + y - x)
    labels = torch.cat([ids[:, 1:], torch.full((len(rows), 1), -100)], 1)
    labels[0, 19] = -100   # (document 0's last token: no target in document 1)
    return ids, pos, labels


def hf_logits(hf, ids, pos, rows=PACKED):
    """transformers' logits of packed rows: each document alone, from its own positions."""
    return torch.cat([torch.cat([hf(input_ids=ids[r:r + 1, x:y], position_ids=pos[r:r + 1, x:y]).logits
                                 for x, y, _ in row], 1) for r, row in enumerate(rows)])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_logits_match_transformers(ckpt):
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = model.from_pretrained(ckpt).eval()
    a = ours.args
    assert (a.model_type, a.attn_temperature_beta, a.attn_temperature_length) == ("ministral3", 0.3, 8), a
    ids, pos, _ = batch()
    whole = torch.arange(45).expand(2, 45) + torch.tensor([[0], [300]])
    with torch.no_grad():
        ref, out = hf(input_ids=ids, position_ids=whole).logits, ours(ids, position_ids=whole)
        assert rel(out, ref) < 1e-5, f"whole rows: {rel(out, ref):.2e}"
        ref, out = hf_logits(hf, ids, pos), ours(ids, position_ids=pos)
        assert rel(out, ref) < 1e-5, f"packed rows: {rel(out, ref):.2e}"


def _drop(*keys):
    return lambda c: [c.pop(k, None) for k in keys]


def _classic(c):   # the older hub form: top-level rope_theta, rope_scaling with "type"
    c.pop("rope_parameters")
    c.update(rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                           "llama_4_scaling_beta": 0.2})


# case -> edit of config.json, the window of each layer, rms_norm_eps read, the first position of the rows
READ_AS_TRANSFORMERS = {
    "no_rope": (_drop("rope_parameters"), [None, None], 1e-6, 40000),   # the class's YaRN 16 × 16384, theta 1e6
    "classic": (_classic, [None, None], 1e-6, 0),
    "top_level_original": (lambda c: c.update(original_max_position_embeddings=16), [None, None], 1e-6, 0),
    "window": (lambda c: c.update(sliding_window=6), [6, 6], 1e-6, 0),
    "no_window_key": (_drop("sliding_window"), [None, None], 1e-6, 0),
    "no_eps": (_drop("rms_norm_eps"), [None, None], 1e-5, 0),
}


@pytest.mark.parametrize("case", sorted(READ_AS_TRANSFORMERS))
def test_config_read_as_transformers_reads_it(case, tmp_path):
    edit, windows, eps, first = READ_AS_TRANSFORMERS[case]
    path = save(tmp_path)
    c = json.load(open(tmp_path / "config.json"))
    edit(c)
    json.dump(c, open(tmp_path / "config.json", "w"))
    hf = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = model.from_pretrained(path).eval()
    assert [blk.self_attn.window for blk in ours.model.layers] == windows and ours.args.norm_eps == eps, case
    ids, pos, _ = batch()
    pos = torch.arange(45).expand(2, 45) + torch.tensor([[first], [first + 40000]])
    with torch.no_grad():
        ref, out = hf(input_ids=ids, position_ids=pos).logits, ours(ids, position_ids=pos)
    assert rel(out, ref) < 1e-5, f"{case}: relative error {rel(out, ref):.2e}"


def test_refusals_and_rope_scaling(ckpt):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "llama_4_scaling_beta"}
    with pytest.raises(ValueError, match=r"ministral3 model scales q by .* lacks llama_4_scaling_beta"):
        model.ModelArgs.from_config_dict({**cfg, "rope_parameters": rope})
    with pytest.raises(ValueError, match=r"ministral3 model scales q by .* lacks original_max_position_embeddings"):
        model.ModelArgs.from_config_dict({**cfg, "rope_parameters": {"rope_type": "default",
                                                                     "llama_4_scaling_beta": 0.1}})
    fp8 = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}   # (Ministral 3 Instruct's)
    with pytest.raises(ValueError, match=r"quant_method 'fp8'\).*pass the unquantized checkpoint it was made from \(an "
                                         r"FP8 release's BF16 one: .*-BF16\)"):
        model.ModelArgs.from_config_dict({**cfg, "quantization_config": fp8})
    args = model.read_args(ckpt)
    for bad in ("linear:2", "yarn:4@16", "none"):
        with pytest.raises(ValueError, match=rf"--rope-scaling {bad}: .*original length 8.*yarn:F@8"):
            args.with_rope_scaling(bad)
    # a scaling that keeps the length: transformers loaded with the RoPE the run records computes our logits
    scaled = args.with_rope_scaling("yarn:32")
    assert scaled.rope_parameters()["llama_4_scaling_beta"] == 0.3, scaled.rope_parameters()
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                rope_parameters=scaled.rope_parameters()).eval()
    ours = model.from_pretrained(ckpt, rope_scaling="yarn:32").eval()
    ids, _, _ = batch()
    pos = torch.arange(45).expand(2, 45) + 100
    with torch.no_grad():
        assert rel(ours(ids, position_ids=pos), hf(input_ids=ids, position_ids=pos).logits) < 1e-5


@pytest.mark.parametrize("ac,tiled", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "ac", "tiled_attn", "tiled_attn_ac"])
def test_lora_loss_and_gradients_equal_peft(ckpt, ac, tiled, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from parallel import kernels
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b, hf_as_trained

    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 4 * 5)   # --tiled-attn's tiles: 5 query rows
    mdl, _ = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=R, lora_alpha=ALPHA, seed=3, ac=ac,
                                          tiled_attn=tiled))
    mine = {n: p for n, p in mdl.named_parameters() if p.requires_grad}
    ref = get_peft_model(hf_as_trained(ckpt), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL,
                                                         init_lora_weights=False))
    theirs = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(mine) and len(mine) == 2 * 7 * 2
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(mine[n])
    ids, pos, labels = batch()
    ours, _ = mdl(ids, position_ids=pos, labels=labels)
    ours.backward()
    want = F.cross_entropy(hf_logits(ref, ids, pos).reshape(-1, 96), labels.reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg="summed loss")
    for n, p in mine.items():
        torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad {n}")


def _layout_ranks(rank, world, path, splits):
    """On every rank: transformers' loss and gradients (float64, packed rows each document alone) = ours under each
    CP layout (the loss and gradients summed over the ranks)."""
    import torch.distributed as dist

    from parallel.cp import cp_attention, shard_sequence
    from parallel.mesh import ParallelDims

    ids, pos, labels = batch()
    hf = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    want = F.cross_entropy(hf_logits(hf, ids, pos).reshape(-1, 96), labels.reshape(-1), reduction="sum")
    want.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    done = []
    for u, r in splits:
        dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=r)
        m = model.from_pretrained(path).double()
        m.attention = cp_attention(dims.build_mesh("cpu"), dims)
        group = m.attention.cp_group
        loss, _ = m(shard_sequence(ids, dims, rank, 0), position_ids=shard_sequence(pos, dims, rank, None),
                    labels=shard_sequence(labels, dims, rank, -100))
        loss.backward()
        label = f"{'ring' if u == 1 else 'ulysses'} u{u}×r{r}"
        total = loss.detach().double()   # (loss.py sums in float32)
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, want.detach(), rtol=1e-6, atol=1e-6, msg=lambda s, x=label: f"{x} loss: {s}")
        for n, p in m.named_parameters():
            dist.all_reduce(p.grad, group=group)
            # loss.py forms its fused gradient in float32: float32 round-off
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6,
                                       msg=lambda s, n=n, x=label: f"{x} grad {n}: {s}")
        done.append(label)
    return done


@pytest.mark.timeout(240)
def test_cp_layouts_equal_transformers_on_every_rank(ckpt):
    done = run_ranks(_layout_ranks, 2, ckpt, [(1, 2), (2, 1)], timeout=220)
    assert done == [["ring u1×r2", "ulysses u2×r1"]] * 2


def test_plan_counts_the_tables_autograd_keeps(tmp_path, monkeypatch):
    """The planner's kept activations (no AC, fp32) = the bytes autograd keeps, q's cos/sin tables (its temperature)
    included; `--plan` on transformers' own Ministral3Config (the 8B's sizes) plans its 262,144 positions."""
    import tests.helpers
    from tests.test_plan import _saved_and_plan, run_plan, term

    monkeypatch.setattr(tests.helpers, "tiny_checkpoint", lambda path, **kw: save(
        path, vocab_size=kw["vocab"], num_key_value_heads=kw["kv_heads"], head_dim=kw["head_dim"],
        hidden_size=kw["heads"] * kw["head_dim"], num_attention_heads=kw["heads"], intermediate_size=kw["inter"],
        num_hidden_layers=2, tie_word_embeddings=kw["tie"]))
    saved, p = _saved_and_plan(tmp_path, 2, ["--no-ac"], ac=False)
    assert term(p, "activations: rope") == 4 * 4 * 128 * 16   # cos, sin: k's and q's, fp32, 128 tokens, hd 16
    assert term(p, "activations: saved tensors") + term(p, "activations: rope") + term(p, "| or: final norm in") \
        == saved
    T.Ministral3Config().save_pretrained(tmp_path / "8b")
    _, out = run_plan("--model", str(tmp_path / "8b"), "--max-len", "262144", "--gpu-mem", "1000")
    assert out.startswith("plan: ministral3 8.49B params") and "reaches past" not in out, out
