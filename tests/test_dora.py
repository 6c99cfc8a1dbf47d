"""DoRA (`--dora`): our layers compute what peft's `use_dora=True` computes, and its adapter is peft's.

Pins (CPU, float32, a tiny Qwen2 checkpoint made by transformers, q/k/v with bias, LoRA r 4 / alpha 8 with non-zero
B and magnitudes moved off their start, so every DoRA term counts), against transformers + peft on the same weights
(for nf4: the transformers model holding `nf4_round_trip(W)`, the weight our NF4 layers compute with):
- the summed loss and the gradient of every LoRA A, B and magnitude equal peft's, on the fused path (no dropout) and
  on peft's term-by-term path (LoRA dropout 0.2 in training, the same masks drawn: `model.dora.forward`);
- with B = 0 our magnitudes start where peft's do (‖W‖ of each row);
- the adapter `export_adapter` writes loads in `peft.PeftModel.from_pretrained` with no missing or unexpected keys and
  gives our logits; `read_init_adapter` + `init_from_adapter` (--init-adapter) rebuild that model's logits, and
  `reference_adapter` (DPO's reference from a DoRA adapter) computes them on a model whose own LoRA is at its start;
- --init-adapter refuses a DoRA adapter without --dora, a plain one with it, and a DoRA adapter missing a magnitude;
  a resume refuses the other --dora (a checkpoint from before the flag: plain LoRA);
- bf16 with float32 LoRA (no mixed precision): each layer's output is peft's bit for bit, and DPO's reference from a
  DoRA adapter is the policy it starts; the one-process build under each memory step (AC, tiled MLP and attention,
  offload, --ac-keep-attn, --ac-group) trains as without; under (CUDA's) autocast no layer reaches peft's forward;
  the rescale's own backward = autograd's (float64, over row chunks).
(Layouts: test_qlora's "DoRA" cases and test_train's cp2×dp2 run; LoRA+ groups: test_optimizer.)

Run: .venv/bin/python -m pytest -q tests/test_dora.py
"""

import os

import pytest
import torch

from tests.helpers import tiny_checkpoint

R, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny Qwen2 with its q/k/v biases drawn (transformers starts them at 0, where DoRA's bias term vanishes)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(tmp_path_factory.mktemp("base"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, max_shard_size="60KB")   # (over the same shards)
    return path


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 19), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    return ids, labels, torch.arange(19).expand(2, 19)


def _ours(path, quant, dropout=0.0, b_std=0.05, moved=True, seed=3, **mem):
    """Our DoRA model (1 process; `mem`: BuildOptions' memory steps), B ~ N(0, b_std), each magnitude × (1 + 0.1·N(0,
    1)) when `moved`."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    model, peft_model = build_nonzero_b(BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA, dora=True,
                                                     lora_dropout=dropout, seed=seed, **mem), b_std=b_std)
    if moved:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_magnitude_vector" in n:
                    p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model, peft_model


def _hf(path, quant):
    from tests.helpers import hf_as_trained

    return hf_as_trained(path, quant)


def _peft_twin(path, quant, ours, dropout=0.0):
    """peft's DoRA on the transformers model, holding our model's LoRA tensors."""
    from peft import LoraConfig, get_peft_model

    ref = get_peft_model(_hf(path, quant), LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=ALL,
                                                      use_dora=True, init_lora_weights=False))
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.copy_(mine[n.removeprefix("base_model.model.")])
    return ref


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("quant,dropout", [("none", 0.0), ("nf4", 0.0), ("nf4", 0.2)],
                         ids=["plain_fused", "nf4_fused", "nf4_dropout"])
def test_loss_and_every_gradient_equal_peft(ckpt, quant, dropout):
    ids, labels, pos = _batch()
    model, _ = _ours(ckpt, quant, dropout)
    ref = _peft_twin(ckpt, quant, model, dropout)
    model.train(), ref.train()
    if dropout:   # each layer's mask drawn from its name: the same on both sides, whatever order they run in
        for m in (model, ref):
            for n, layer in m.named_modules():
                if hasattr(layer, "lora_dropout") and "default" in layer.lora_dropout:
                    layer.lora_dropout["default"] = _NamedDropout(n.removeprefix("base_model.model."), dropout)
    ours_sum, _ = model(ids, position_ids=pos, labels=labels)
    ours_sum.backward()
    ref_sum = _loss(ref(input_ids=ids).logits, labels)
    ref_sum.backward()
    torch.testing.assert_close(ours_sum, ref_sum, rtol=1e-5, atol=1e-5, msg="summed loss")
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    mine = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(mine) == sorted(grads) and sum("lora_magnitude_vector" in n for n in mine) == 14, sorted(mine)
    for n, g in mine.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=f"grad {n}")
    if dropout:   # (the path taken: dropout's, term by term; else the fused one)
        with torch.no_grad():
            model.eval(), ref.eval()
            torch.testing.assert_close(model(ids, position_ids=pos), ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5,
                                       msg="eval logits (dropout off)")


class _NamedDropout(torch.nn.Dropout):
    """Dropout whose mask is a function of the layer's name and the input's shape (an nn.Dropout: peft and our
    fused forward take it for dropout)."""

    def __init__(self, name, p):
        super().__init__(p)
        self.name = name

    def forward(self, x):
        if not self.training:
            return x
        g = torch.Generator().manual_seed(sum(map(ord, self.name)) * 1000 + x.shape[-2])
        keep = (torch.rand(x.shape, generator=g) >= self.p).to(x.dtype)
        return x * keep / (1 - self.p)


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_magnitudes_start_as_peft_starts_them(ckpt, quant):
    from peft import LoraConfig, get_peft_model

    model, _ = _ours(ckpt, quant, b_std=0.0, moved=False)
    ref = get_peft_model(_hf(ckpt, quant), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL, use_dora=True))
    want = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters() if "magnitude" in n}
    got = {n: p for n, p in model.named_parameters() if "magnitude" in n}
    assert sorted(got) == sorted(want) and len(got) == 14
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=0, msg=n)


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory):
    """An exported DoRA adapter (nf4-trained) and the logits of the model that wrote it."""
    from model.export import export_adapter

    model, peft_model = _ours(ckpt, "nf4")
    out = str(tmp_path_factory.mktemp("dora") / "adapter")
    export_adapter(peft_model, out, ckpt)
    ids, _, pos = _batch()
    with torch.no_grad():
        return out, model(ids, position_ids=pos)


def test_adapter_loads_in_peft_and_gives_our_logits(ckpt, adapter):
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    out, logits = adapter
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["use_dora"] is True
    keys = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert sum(k.endswith(".lora_magnitude_vector") for k in keys) == 14 and len(keys) == 42, sorted(keys)[:4]
    with _no_key_warning():
        peft = PeftModel.from_pretrained(_hf(ckpt, "nf4"), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=_batch()[0]).logits, logits, rtol=1e-5, atol=1e-5,
                                   msg="peft's logits from our adapter")


class _no_key_warning:
    """peft warns of missing or unexpected keys on load: fail on it."""

    def __enter__(self):
        import warnings
        self.cm = warnings.catch_warnings(record=True)
        self.caught = self.cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.cm.__exit__(*exc)
        said = [str(w.message) for w in self.caught if "key" in str(w.message).lower()]
        assert not said, said


def test_init_adapter_and_dpo_reference_rebuild_its_logits(ckpt, adapter):
    from model.adapter_read import read_init_adapter
    from model.qlora import reference_adapter
    from parallel.parallelize import init_from_adapter

    out, logits = adapter
    ids, _, pos = _batch()
    fresh, _ = _ours(ckpt, "nf4", b_std=0.0, moved=False, seed=9)   # another A, B = 0: the base's function
    with torch.no_grad():
        base = fresh(ids, position_ids=pos)
        assert (base - logits).abs().max() > 1e-3   # (the adapter moves the logits)
        with reference_adapter(fresh, read_init_adapter(out)):
            torch.testing.assert_close(fresh(ids, position_ids=pos), logits, rtol=1e-5, atol=1e-5,
                                       msg="DPO's reference from the DoRA adapter")
        torch.testing.assert_close(fresh(ids, position_ids=pos), base, rtol=0, atol=0, msg="reference left")
    init_from_adapter(fresh, out)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids, position_ids=pos), logits, rtol=1e-5, atol=1e-5,
                                   msg="--init-adapter's start")


def test_init_adapter_refuses_the_other_kind_and_a_missing_magnitude(ckpt, adapter, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from model.adapter_fit import init_adapter_fits
    from model.adapter_read import check_init_adapter

    out, _ = adapter
    with pytest.raises(ValueError, match=r"use_dora True, this run no --dora \(pass --dora\)"):
        check_init_adapter(out, R, ALPHA, ALL)
    check_init_adapter(out, R, ALPHA, ALL, dora=True)
    plain = str(tmp_path / "plain")
    shutil.copytree(out, plain)
    cfg_path = os.path.join(plain, "adapter_config.json")
    with open(cfg_path) as f:
        text = f.read()
    with open(cfg_path, "w") as f:
        f.write(text.replace('"use_dora": true', '"use_dora": false'))
    with pytest.raises(ValueError, match=r"use_dora False, this run --dora \(drop --dora\)"):
        check_init_adapter(plain, R, ALPHA, ALL, dora=True)
    cut = str(tmp_path / "cut")
    shutil.copytree(out, cut)
    st = os.path.join(cut, "adapter_model.safetensors")
    tensors = load_file(st)
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_magnitude_vector"]
    save_file(tensors, st)
    shapes = {p: ((48, 64) if p in ("gate_proj", "up_proj") else (64, 48) if p == "down_proj" else
                  (48, 48 if p in ("q_proj", "o_proj") else 16)) for p in ALL}
    init_adapter_fits(out, shapes, R, 2)   # (the whole adapter fits)
    with pytest.raises(ValueError, match=r"some of DoRA's lora_A, lora_B and lora_magnitude_vector for 1 projections "
                                         r"\(layer 1 up_proj \(only lora_A and lora_B\)\)"):
        init_adapter_fits(cut, shapes, R, 2)
    with open(os.path.join(plain, "adapter_config.json")) as f:   # (magnitudes under a config saying plain LoRA)
        assert '"use_dora": false' in f.read()
    with pytest.raises(ValueError, match=r"holds DoRA's lora_magnitude_vector for 14 projections \(layer 0 down_proj; "
                                         r".*has no use_dora: true"):
        init_adapter_fits(plain, shapes, R, 2)


def test_a_resume_keeps_dora():
    """--dora is run-defining: a resume with the other value is refused naming it; a checkpoint from before the flag
    (none recorded) was plain LoRA."""
    from parallel.resume import check_resume

    check_resume({"lora_r": 4}, {"lora_r": 4, "dora": False})
    for had, now in (({"lora_r": 4}, True), ({"lora_r": 4, "dora": True}, False)):
        with pytest.raises(ValueError, match=f"--dora: the checkpoint has {not now}, this run {now}"):
            check_resume(had, {"lora_r": 4, "dora": now})


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
def test_bf16_without_mixed_precision_rounds_as_peft(ckpt, dropout):
    """bf16 weights with float32 LoRA (the CPU's --dtype bf16: no FSDP2 mixed precision), where our layers take
    `model.dora.forward`: each projection's output is peft's use_dora output bit for bit (peft casts the sum back to
    bf16 once, as it does for plain LoRA, which is bit for bit too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    model, _ = build_nonzero_b(BuildOptions(ckpt, quant="none", dtype=torch.bfloat16, lora_r=R, lora_alpha=ALPHA,
                                            dora=True, lora_dropout=dropout, seed=3), b_std=0.05)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16),
                         LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=ALL, use_dora=True,
                                    init_lora_weights=False))
    mine = dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                ours = mine[n.removeprefix("base_model.model.")]
                if "magnitude" in n:
                    ours.mul_(1 + 0.1 * torch.randn(ours.shape, generator=g))
                p.data = ours.detach().clone()
    x = torch.randn(2, 19, 48, generator=g).to(torch.bfloat16)
    for proj in ("q_proj", "o_proj"):
        ours, theirs = (getattr(m.model.layers[0].self_attn, proj) for m in (model, ref.base_model.model))
        for layer in (ours, theirs):
            layer.train()
            if dropout:
                layer.lora_dropout["default"] = _NamedDropout(proj, dropout)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0, msg=f"{proj} output")


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_bf16_dpo_reference_equals_the_policy_it_starts(ckpt, quant, tmp_path):
    """bf16 without mixed precision (LoRA in float32, `model.dora.forward`): `reference_adapter` from a DoRA adapter
    gives, bit for bit, the logits of the policy `init_from_adapter` starts from that adapter (DPO's step 1: log 2)."""
    from model.adapter_read import read_init_adapter
    from model.export import export_adapter
    from model.qlora import reference_adapter
    from parallel.parallelize import BuildOptions, init_from_adapter
    from tests.helpers import build_nonzero_b

    opts = dict(quant=quant, dtype=torch.bfloat16, lora_r=R, lora_alpha=ALPHA, dora=True)
    model, peft_model = build_nonzero_b(BuildOptions(ckpt, seed=3, **opts), b_std=0.05)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1.05)
    out = str(tmp_path / "adapter")
    export_adapter(peft_model, out, ckpt)
    policy, _ = build_nonzero_b(BuildOptions(ckpt, seed=9, **opts), b_std=0.0)
    init_from_adapter(policy, out)
    ref, _ = build_nonzero_b(BuildOptions(ckpt, seed=9, **opts), b_std=0.0)
    ids, _, pos = _batch()
    with torch.no_grad(), reference_adapter(ref, read_init_adapter(out), dtype=torch.float32):
        torch.testing.assert_close(ref(ids, position_ids=pos), policy(ids, position_ids=pos), rtol=0, atol=0,
                                   msg="the reference's logits = the policy's at its start")


@pytest.mark.parametrize("mem", [dict(tiled_mlp=True, tiled_attn=True), dict(ac_keep_attn=True),
                                 dict(offload_activations=True, tiled_mlp=True), dict(ac_group=2, tiled_mlp=True)],
                         ids=["tiled_mlp_and_attn", "ac_keep_attn", "offload_tiled_mlp", "ac_group_tiled_mlp"])
def test_memory_steps_compute_the_plain_build(ckpt, mem):
    """One process, nf4, AC with each memory step (tiles whose weights and norms `dequant_once` holds per call, the
    recompute, kept attention, offloaded checkpoints): three SGD steps give the losses and every A, B and magnitude
    gradient of the build without AC or tiles, so no norm outlives the A and B it was taken from."""
    ids = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(7))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    pos = torch.arange(100).expand(2, 100)   # (tiled MLP: 200 tokens in 48-token tiles)

    from tests.helpers import sgd_steps

    steps = lambda **kw: sgd_steps(_ours(ckpt, "nf4", **kw)[0], ids, labels, pos)

    for step, ((want, gw), (got, gg)) in enumerate(zip(steps(ac=False), steps(ac=True, **mem))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step} loss")
        assert sum("magnitude" in k for k in gg) == 14
        for k in gw:
            torch.testing.assert_close(gg[k], gw[k], rtol=1e-4, atol=1e-6, msg=f"step {step} grad {k}")


def test_under_autocast_an_nf4_dora_layer_computes_doras_formula(ckpt, monkeypatch):
    """Under autocast (which the trainer does not enable; a fork might, on CUDA) a DoRA layer never reaches peft's own
    forward, which would dequantize our packed NF4 weight wrongly: the fused path's logits. (CPU autocast is not what
    the layers test, CUDA's is: torch.is_autocast_enabled is made to say yes.)"""
    ids, _, pos = _batch()
    model, _ = _ours(ckpt, "nf4")
    with torch.no_grad():
        want = model(ids, position_ids=pos)
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a, **k: True)
        got = model(ids, position_ids=pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_rescale_gradients_equal_autograds_over_row_chunks(monkeypatch, bias):
    """model.dora's rescale (its own backward: the scale's gradient summed over row chunks) = autograd's differentiation
    of scale ⊙ out + bias ⊙ (1 − scale), in float64, with rows split into 3-row chunks and one partial."""
    import model.dora as dora

    g = torch.Generator().manual_seed(4)
    out, scale, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 5, 7), (7,), (7,)))
    dy = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    monkeypatch.setattr(dora, "ROWS", 3 * 7)   # (3 rows a chunk: 10 rows in 4 chunks)
    got = [t.clone().requires_grad_() for t in (out, scale)]
    dora.apply_scale(got[0], got[1], b if bias else None).backward(dy)
    want = [t.clone().requires_grad_() for t in (out, scale)]
    (want[0] * want[1] + (b * (1 - want[1]) if bias else 0)).backward(dy)
    for name, x, y in zip(("out", "scale"), got, want):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12, msg=f"{name}'s gradient")
