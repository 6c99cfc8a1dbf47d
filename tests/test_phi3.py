"""Phi-3 / Phi-4 (`model_type: phi3`, model/phi3.py: fused qkv_proj and gate_up_proj, partial RoPE, LongRoPE)
compute what transformers' Phi3ForCausalLM does.

Pins (CPU, tiny random checkpoints saved by transformers, 6 query / 2 KV heads of 8, every norm weight drawn away
from 1): "mini" is Phi-4-mini's form (partial_rotary_factor 0.75: 6 of 8 dims rotate; LongRoPE with short and long
factors from original_max_position_embeddings 18 to 4096, tied embeddings), "window" Phi-3's default RoPE with a
5-token sliding window, untied.
- logits = transformers' on whole rows and a packed row of two documents; LongRoPE on rows below (short factors)
  and above (long factors) the original length, each set mattering there; the sliding window mattering;
- config.json read as Phi3Config reads it (bench/configs/phi-4-mini and phi-4: its rope_parameters, theta, partial
  factor, original length, attention factor; the parameter count, and --plan on both); bad factors, dropouts and rope
  types refused naming the key;
- --lora-targets: the default and the shorthands adapt the fused Linears; q_proj,v_proj on phi3 refused naming the fix;
  padding (a CP divisor's, --no-pack's) never gives a document the long factors: it restarts where it would;
- LoRA's loss and every LoRA gradient = peft's on the transformers model (plain, and AC + tiled MLP + tiled attention);
- one process = cp 2 ring = cp 2 Ulysses (2 ranks, gloo; nf4 and plain; DoRA) = cp 4 hybrid (4 ranks): loss, grad
  norm, logits and every LoRA gradient on every rank, LongRoPE's threshold passed by the whole row and not by some
  rank's shard;
- --train-norms: the adapter loads in peft on transformers' model, our logits, and --init-adapter takes it; `python -m
  model.merge` = peft's merge_and_unload, and transformers loads what it writes;
- planned activations = autograd's saved bytes; --plan on the bench configs; --mem-phases finds qkv_proj.

Run: .venv/bin/python -m pytest -q tests/test_phi3.py
"""

import json
import os

import pytest
import torch
import transformers as T

import model
from tests.dist import run_ranks

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "configs")
SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.5, 4.0, 9.0]}
CONFIGS = {"mini": dict(SIZES, rope_parameters=LONGROPE, original_max_position_embeddings=18, tie_word_embeddings=True),
           "window": dict(SIZES, rope_parameters={"rope_type": "default", "rope_theta": 3e4}, sliding_window=5)}
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        hf = T.Phi3ForCausalLM(T.Phi3Config(**cfg)).float().eval()
        with torch.no_grad():   # transformers starts norm weights at 1: that would hide a dropped one
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, max_shard_size="60KB")
        out[name] = str(path)
    return out


def _hf(path, dtype=torch.float32):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_logits_match_transformers(ckpts):
    """float64: whole rows (positions offset), a packed row; LongRoPE below and above original length 18 (the row's
    largest position + 1), where the other factor set is far off; the sliding window, where no window is far off."""
    from model.load import read_args

    ids = torch.randint(0, 128, (2, 31), generator=torch.Generator().manual_seed(1))
    for name, path in ckpts.items():
        hf, ours = _hf(path, torch.float64), model.from_pretrained(path, dtype=torch.float64).eval()
        attn = ours.model.layers[0].self_attn
        assert attn.q_proj is attn.k_proj is attn.v_proj is None and tuple(attn.qkv_proj.weight.shape) == (80, 48)
        assert tuple(ours.model.layers[0].mlp.gate_up_proj.weight.shape) == (128, 48), name
        with torch.no_grad():
            for n in (12, 18, 19, 31):   # 18: the largest position + 1 equals the original length: short factors
                sub = ids[:1, :n]
                assert rel(ours(sub), hf(input_ids=sub).logits) < 1e-12, f"{name}: row of {n}"
            pos = torch.arange(12).expand(2, 12) + torch.tensor([[3], [0]])   # both rows short (largest + 1 <= 18)
            assert rel(ours(ids[:, :12], position_ids=pos), hf(input_ids=ids[:, :12], position_ids=pos).logits) \
                < 1e-12, f"{name}: rows off position 0"
            packed = torch.cat([torch.arange(11), torch.arange(20)])[None]   # the second document passes 18
            want = torch.cat([hf(input_ids=ids[:1, :11]).logits, hf(input_ids=ids[:1, 11:]).logits], 1)
            assert rel(ours(ids[:1], position_ids=packed), want) < 1e-12, f"{name}: packed row"
            if name == "mini":   # each factor set where the other one's belongs: far off
                args = ours.args
                swapped = dict(args.rope_scaling, short_factor=LONGROPE["long_factor"],
                               long_factor=LONGROPE["short_factor"])
                ours.args = type(args)(**{**vars(args), "rope_scaling": swapped})
                for n in (12, 31):
                    assert rel(ours(ids[:1, :n]), hf(input_ids=ids[:1, :n]).logits) > 1e-3, f"factors at {n}: no effect"
                ours.args = args
            else:
                assert [b.self_attn.window for b in ours.model.layers] == [5, 5]
                for b in ours.model.layers:
                    b.self_attn.window = None
                assert rel(ours(ids[:1]), hf(input_ids=ids[:1]).logits) > 1e-3, "the window has no effect"
    assert read_args(ckpts["mini"]).rotary_dim == 6


def test_cp_padding_keeps_a_documents_short_factors(ckpts):
    """A row padded for a CP divisor (data.collate; padding continues the last document's positions): a last document
    of 17 or 18 tokens (short factors alone) padded to 20 would pass original length 18 and take the long factors.
    LocalBatches' collate restarts that padding at 0 instead (model.phi3.pad_restart), so the real tokens' logits are
    transformers' on the documents alone; without the restart they are not; past 18 the padding continues as before.
    --no-pack rows (padded to the longest sample) likewise."""
    from data.collate import collate
    from model.load import read_args
    from model.phi3 import pad_restart
    from parallel.cp import LocalBatches
    from parallel.mesh import ParallelDims

    margs = read_args(ckpts["mini"])
    assert pad_restart(margs) == 18 and pad_restart(read_args(ckpts["window"])) is None
    hf, ours = _hf(ckpts["mini"], torch.float64), model.from_pretrained(ckpts["mini"], dtype=torch.float64).eval()
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    sample = lambda n: {"input_ids": torch.tensor(ids[:n]), "labels": torch.tensor(ids[1:n] + [-100])}   # noqa: E731
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    to_local = LocalBatches([sample(4)], tok, ParallelDims(2, cp=2, ulysses=1, ring=2), 0, True, False, "cpu", margs)
    for docs in ([17], [18], [5, 13], [9, 18], [19]):   # (packed: the last document's length decides)
        rows = {r: collate([sample(n) for n in docs], True, 4, 0, restart=r) for r in (None, 18)}
        got = to_local.collate([sample(n) for n in docs])
        assert torch.equal(got["position_ids"], rows[18]["position_ids"]), docs
        n, pad = sum(docs), got["position_ids"].shape[1] - sum(docs)
        pos = got["position_ids"][0, n:].tolist()
        passes = docs[-1] <= 18 < docs[-1] + pad
        assert pos == (list(range(pad)) if passes else list(range(docs[-1], docs[-1] + pad))), (docs, pos)
        want = []
        with torch.no_grad():
            for k in docs:
                want.append(hf(input_ids=torch.tensor([ids[:k]])).logits)
            want = torch.cat(want, 1)
            for r, row in rows.items():
                y = ours(row["input_ids"], position_ids=row["position_ids"])[:, :n]
                off = rel(y, want)
                if r == 18 or not passes:
                    assert off < 1e-12, (docs, r, off)
                else:
                    assert off > 1e-3, f"{docs}: the padding's long factors changed nothing"
    # --no-pack with 2 samples a micro-batch: each row padded to the longer one's (and the divisor): the short row's
    # padding passes 18 and restarts, so each row's real tokens are transformers' on that sample alone
    got = collate([sample(12), sample(19)], False, 4, 0, restart=18)
    assert got["position_ids"][0, 12:].tolist() == list(range(8)), got["position_ids"][0]
    assert got["position_ids"][1, 19:].tolist() == [19], got["position_ids"][1]
    with torch.no_grad():
        y = ours(got["input_ids"], position_ids=got["position_ids"])
        for r, n in enumerate((12, 19)):
            assert rel(y[r:r + 1, :n], hf(input_ids=torch.tensor([ids[:n]])).logits) < 1e-12, f"no-pack row {r}"


def test_config_read_as_phi3config_reads_it():
    """bench/configs/phi-4-mini (Phi-4-mini-instruct's config.json: classic rope_scaling, top-level partial factor and
    original length) and phi-4: RoPE as Phi3Config standardizes it, the attention factor as transformers computes it;
    the old type name "su"; refusals naming the key."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from model.rope import inv_freq

    for name in ("phi-4-mini", "phi-4"):
        with open(os.path.join(BENCH, name, "config.json")) as f:
            hub = json.load(f)
        a = model.ModelArgs.from_config_dict(hub)
        want = T.Phi3Config(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
        rp = want.rope_parameters
        assert (a.rope_theta, a.partial_rotary_factor, a.fused, a.sliding_window, a.tie_embeddings) == (
            rp["rope_theta"], rp["partial_rotary_factor"], True, want.sliding_window, want.tie_word_embeddings), name
        if rp["rope_type"] == "longrope":
            for long in (False, True):
                f, s = ROPE_INIT_FUNCTIONS["longrope"](want, None, seq_len=(rp["original_max_position_embeddings"] + 1)
                                                       * long or None)
                mine = inv_freq(a, long)
                assert torch.equal(mine[0], f) and mine[1] == pytest.approx(s, rel=1e-12), (name, long)
        else:
            assert a.rope_scaling == {} and rp["rope_type"] == "default"
    mini = {"model_type": "phi3", **SIZES, "original_max_position_embeddings": 18, "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "su", "short_factor": [1, 1, 1], "long_factor": [2, 2, 2]}}
    a = model.ModelArgs.from_config_dict(mini)
    assert a.rope_scaling["rope_type"] == "longrope" and a.with_rope_scaling("none").rope_scaling == {}
    with pytest.raises(ValueError, match="drop --rope-scaling"):   # (Phi3Config: default or longrope only)
        a.with_rope_scaling("yarn:2")
    bad = [({"rope_scaling": {**mini["rope_scaling"], "long_factor": [2, 2]}}, "long_factor must be a list of 3"),
           ({"resid_pdrop": 0.1}, "resid_pdrop 0.1 is not supported"), ({"embd_pdrop": 0.1}, "embd_pdrop"),
           ({"attention_dropout": 0.1}, "attention_dropout"),
           ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported")]
    for over, match in bad:
        with pytest.raises(ValueError, match=match):
            model.ModelArgs.from_config_dict({**mini, **over})


def test_lora_targets_map_to_the_fused_linears():
    from model.lora_spec import NotGiven, lora_targets_arg, run_targets

    phi, llama = (model.ModelArgs.from_config_dict({"model_type": t, **SIZES}) for t in ("phi3", "llama"))
    default = NotGiven(lora_targets_arg("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"))
    assert run_targets(default, phi) == (tuple(FUSED), "--lora-targets not given: LoRA on qkv_proj,o_proj,gate_up_proj,"
                                         "down_proj, this phi3 model's Linears (q/k/v and gate/up are one Linear each "
                                         "as stored: lora_spec.fused_targets)")
    assert run_targets(lora_targets_arg("all-linear"), phi)[0] == tuple(FUSED)
    assert run_targets(lora_targets_arg("attn"), phi)[0] == ("qkv_proj", "o_proj")
    assert run_targets(lora_targets_arg("mlp"), phi)[0] == ("gate_up_proj", "down_proj")
    assert run_targets("qkv_proj,down_proj", phi)[0] == ("qkv_proj", "down_proj")
    with pytest.raises(ValueError, match="name all of q_proj,k_proj,v_proj .or qkv_proj."):
        run_targets("q_proj,v_proj", phi)
    with pytest.raises(ValueError, match="has gate_proj,up_proj apart"):
        run_targets("gate_up_proj", llama)
    assert run_targets(default, llama)[0] == tuple(default.split(","))
    assert run_targets(lora_targets_arg("all-linear"), llama)[0] == tuple(default.split(",")), \
        "all-linear on a model without fused Linears"


@pytest.mark.parametrize("name", ["mini", "window"])
@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=True, tiled_mlp=True, tiled_attn=True)],
                         ids=["plain", "ac_tiled_mlp_tiled_attn"])
def test_lora_grads_match_peft_on_transformers(ckpts, name, mem):
    """peft's LoRA on transformers' model (qkv_proj, o_proj, gate_up_proj, down_proj) with our adapter's values: the
    same loss and every LoRA gradient; rows of 23 pass the mini's original length (long factors)."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import assert_lora_grads_match_peft, build_nonzero_b

    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    ours, peft_model = build_nonzero_b(BuildOptions(ckpts[name], quant="none", lora_r=4, lora_alpha=8, seed=3, **mem))
    assert_lora_grads_match_peft(_hf(ckpts[name]), FUSED, ours, peft_model, ids, labels, 4 * 2 * 2)


@pytest.mark.timeout(300)
def test_cp_ring_and_ulysses_equal_one_process(ckpts):
    """tests/test_qlora.py's check (rows of 21 tokens) on 2 ranks: the mini's original length 18 is passed by the
    whole row (21, padded 22 or 24) but by neither Ulysses rank 0's shard (positions 0..10) nor ring rank 1's (6..17):
    those must take the long factors from the other rank (AttentionCore.row_span)."""
    from tests.test_qlora import _cases, layout

    cases = {"mini (LongRoPE), nf4, cp 2 Ulysses": layout("nf4", 2, family="mini"),
             "mini (LongRoPE), plain weights, cp 2 ring": layout("none", 2, "ring", family="mini"),
             "mini, DoRA on the fused Linears, nf4, cp 2 ring": layout("nf4", 2, "ring", family="mini", dora=True),
             "window, nf4, cp 2 ring": layout("nf4", 2, "ring", family="window")}
    assert run_ranks(_cases, 2, ckpts, cases, timeout=280) == [len(cases)] * 2


@pytest.mark.timeout(300)
def test_cp_4_hybrid_equals_one_process(ckpts):
    """cp 4 hybrid (Ulysses 2 × ring 2: each rank a piece of two chunks, model.attention spans gathered through
    parallel.cp.layout_index) on the LongRoPE mini = one process, on 4 ranks."""
    from tests.test_qlora import _cases, layout

    cases = {"mini (LongRoPE), nf4, cp 4 hybrid": layout("nf4", 4, "auto", family="mini")}
    assert run_ranks(_cases, 4, ckpts, cases, timeout=280) == [len(cases)] * 4


def test_train_norms_adapter_loads_in_peft_and_merges(ckpts, tmp_path):
    """--train-norms on the mini: gradients = peft's with the norms as modules_to_save; the exported adapter loads in
    peft on Phi3ForCausalLM with our logits (a row past the original length: long factors); `python -m model.merge`
    writes a checkpoint transformers loads, whose logits = peft's merge_and_unload's."""
    from peft import PeftModel

    from model.adapter_read import check_init_adapter
    from model.export import export_adapter
    from model.merge import main as merge_main
    from tests.test_norms import _ours, _peft_twin

    path = ckpts["mini"]
    ours, peft_model = _ours(path)   # (B ~ N(0, 0.05), the trained norms drawn off their start)
    ref, mine, theirs = _peft_twin(path, "none", ours, targets=FUSED)
    assert sum("norm" in k for k in mine) == 2 * 2 + 1, sorted(mine)
    ids = torch.randint(0, 128, (1, 25), generator=torch.Generator().manual_seed(7))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    s, n = ours(ids, labels=labels)
    s.backward()
    logits = ref(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum",
                                      ignore_index=-100).backward()
    for k in mine:
        torch.testing.assert_close(mine[k].grad, theirs[k].grad, rtol=1e-4, atol=1e-6, msg=f"grad {k}")
    export_adapter(peft_model, str(tmp_path / "adapter"), path)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        cfg = json.load(f)
    assert sorted(cfg["target_modules"]) == sorted(FUSED) and len(cfg["modules_to_save"]) == 2 * 2 + 1, cfg
    # --init-adapter takes it under the default --lora-targets (the parts' names, mapped to the fused Linears) and
    # under its own names; not under names without the MLP's
    default = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj".split(",")
    for targets in (default, FUSED):
        check_init_adapter(str(tmp_path / "adapter"), 4, 8.0, targets, train_norms=True)
    with pytest.raises(ValueError, match="beyond this run's --lora-targets"):
        check_init_adapter(str(tmp_path / "adapter"), 4, 8.0, default[:4], train_norms=True)
    peft = PeftModel.from_pretrained(_hf(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        want = ours(ids)
        torch.testing.assert_close(peft(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5, msg="peft's logits")
        merged_ref = peft.merge_and_unload()(input_ids=ids).logits
    assert merge_main(["--model", path, "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"),
                       "--quant", "none", "--dtype", "fp32"]) == 0
    with torch.no_grad():
        got = _hf(str(tmp_path / "merged"))(input_ids=ids).logits
    torch.testing.assert_close(got, merged_ref, rtol=1e-4, atol=1e-4, msg="merged checkpoint = merge_and_unload")


@pytest.mark.parametrize("name,flags", [("mini", []), ("window", ["--tiled-mlp", "--tiled-attn"]),
                                        ("mini", ["--train-norms"]), ("mini", ["--lora-targets", "qkv_proj"]),
                                        ("window", ["--lora-targets", "qkv_proj,o_proj"]),
                                        ("mini", ["--lora-targets", "gate_up_proj"]),
                                        ("mini", ["--lora-targets", "o_proj,gate_up_proj"]),
                                        ("window", ["--lora-targets", "down_proj", "--tiled-attn"])],
                         ids=["mini", "window_tiled_both", "mini_train_norms", "mini_qkv", "window_qkv_o",
                              "mini_gate_up", "mini_o_gate_up", "window_down_tiled_attn"])
def test_planned_activations_match_autograd(ckpts, name, flags):
    """No AC, fp32, one process, nf4: the plan's activation terms (the fused Linears planned as their parts, one LoRA
    pair each) = the bytes autograd keeps for backward in a real forward (unique storages, parameters excluded)."""
    import train
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import planned_and_saved_activations

    args = train.build_parser().parse_args(["--model", ckpts[name], "--max-len", "128", "--global-batch", "1",
                                            "--quant", "nf4", "--dtype", "fp32", "--no-ac", "--lora-dropout", "0",
                                            *flags])
    from model.load import read_args
    from model.lora_spec import run_targets

    args.lora_targets = ",".join(run_targets(args.lora_targets, read_args(ckpts[name]))[0])
    opts = dict(tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn, train_norms=args.train_norms,
                lora_targets=tuple(args.lora_targets.split(",")))
    ours, _ = build_model(BuildOptions(ckpts[name], quant="nf4", ac=False, lora_dropout=0.0, **opts), device="cpu")
    for b in ours.model.layers:   # (the CPU kernel keeps a windowed layer's [S, S] mask: not a GPU's, not planned)
        b.self_attn.window = None
    planned, saved, terms = planned_and_saved_activations(ours, args)
    assert planned == saved, (planned, saved, planned - saved, terms)


def test_plan_reads_the_bench_configs():
    """bench/configs/phi-4-mini and phi-4: ModelArgs.n_params = transformers' Phi3ForCausalLM's parameter count on the
    meta device (Phi-4-mini's tied embedding once), and --plan on each names that count."""
    import contextlib
    import io

    import train
    from model.load import read_args

    for name, params in (("phi-4-mini", "3.84B"), ("phi-4", "14.66B")):
        path = os.path.join(BENCH, name)
        with open(os.path.join(path, "config.json")) as f:
            cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
        with torch.device("meta"):
            want = sum(p.numel() for p in T.Phi3ForCausalLM(T.Phi3Config(**cfg)).parameters())
        assert read_args(path).n_params == want, (name, read_args(path).n_params, want)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.main(["--plan", "--model", path, "--max-len", "32768", "--global-batch", "1", "--gpu-mem", "80"])
        assert f"plan: phi3 {params} params" in out.getvalue(), out.getvalue()


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="cannot reset VmHWM")
def test_mem_phases_find_the_fused_qkv_proj(ckpts):
    """--mem-phases hooks the last block's q/k/v projections to mark the attention's end: on Phi-3 that is qkv_proj;
    every phase fires, in the backward's order."""
    from parallel.parallelize import BuildOptions
    from parallel.phases import PhaseMeter
    from tests.helpers import build_nonzero_b
    from tests.test_phases import PHASES

    ours, _ = build_nonzero_b(BuildOptions(ckpts["mini"], quant="none", lora_r=4, lora_alpha=8, seed=3, ac=True))
    meter = PhaseMeter(ours, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    with meter.measuring(True):
        s, n = ours(ids, labels=ids)
        (s / n).backward()
    assert [name for name, _ in meter.phases] == PHASES, meter.phases
