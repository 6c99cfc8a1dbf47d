"""Adapter export and merge: what train.py writes loads in peft and transformers and computes our model.

Pins (gloo on CPU, float32, a tiny Qwen2 checkpoint made by transformers, LoRA r 4 / alpha 8 with a
non-zero B so the adapter moves the logits):
- `export_adapter` on 2 FSDP2 ranks writes an adapter that `peft.PeftModel.from_pretrained` loads on
  the transformers model of the checkpoint with no missing and no unexpected keys (its safetensors
  keys are exactly `get_peft_model_state_dict`'s), whose config holds r, lora_alpha and the target
  modules, and whose logits equal our model's (quant none) within 1e-5 relative norm; also for an
  `--rslora` build (use_rslora in the config: peft scales by alpha / sqrt(r), as ours did), whose merge
  equals peft's `merge_and_unload()` too;
- `merge(quant="none", dtype=float32)`: the merged checkpoint, loaded by transformers alone, gives
  the base + adapter (peft) logits within 1e-5; with the default bf16 it loads and computes in bf16
  within 3e-2 relative norm of the float32 reference (bf16 keeps 8 mantissa bits);
- `merge(quant="nf4", dtype=float32)`: the merged checkpoint gives OUR nf4 model's logits (the
  2-rank build, which test_qlora pins to the single-process one) within 1e-5: it holds
  dequant(NF4(W)) + scale·B@A and ours computes the same in float32. Also when LoRA targets only
  q/v: the untargeted projections were 4-bit in training too, so merge dequantizes them as well;
- the merged tensors (one output file per base file, with an index) equal peft's own
  `merge_and_unload()` within 1e-6 in float32 and one bf16 rounding in bf16: on the plain base, and
  for nf4 on the HF model whose block Linears hold bitsandbytes' dequantized NF4 weights;
- a DoRA adapter made and saved by peft itself (use_dora, random A and B, magnitudes off their start): `python -m
  model.merge` of it on the plain base equals peft's `merge_and_unload()` tensor by tensor (1e-6 in float32, one
  rounding in bf16) and the peft DoRA model's logits (1e-5); with quant="nf4" the merged logits and tensors equal
  peft's DoRA model on the transformers model whose block Linears hold `model.nf4.nf4_round_trip(W)`; a DoRA
  adapter with a projection's magnitude removed or cut short, a magnitude without its A and B, a LoRA adapter saying
  use_dora, or magnitudes under a config without it, is refused (exit 2, naming the tensor and the fix, nothing
  written);
- merge's imports (model.merge, model.nf4, the tiled attention that dequantizes) take bitsandbytes without peft or
  transformers (2.4 s a process; model/qlora.py imports peft where it builds LoRA) or torch._dynamo.
- `python -m model.merge` runs as a subprocess from the repo root, takes --quant from the run's config.json
  beside the adapter (a run with quant none, unlike the CLI's nf4 fallback), writes the same tensors
  as `merge`, copies the tokenizer files, and refuses a missing adapter with exit code 2 and a
  message naming it;
- an export that fails after writing the weights (the config's write raising) leaves the adapter already in the
  folder byte-identical; the next export replaces it whole and leaves no .tmp/.old folder.

Run: .venv/bin/python -m pytest -q tests/test_export.py
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.dist import run_ranks
from tests.helpers import bnb_nf4, tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R, ALPHA = 4, 8.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = {"none": ("none", ALL), "nf4": ("nf4", ALL), "nf4_qv": ("nf4", ("q_proj", "v_proj")), "rslora": ("none", ALL)}
RSLORA = {"rslora"}   # --rslora: scale alpha / sqrt(r) = 4 here, not alpha / r = 2


def _ids():
    return torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(5))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _export_rank(rank, world_size, path, out_root):
    """Build each case on the FSDP2 mesh, export its adapter; return our logits (every rank agrees)."""
    from model.export import export_adapter
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    mesh = ParallelDims(world_size).build_mesh("cpu").fsdp
    logits = {}
    for case, (quant, targets) in CASES.items():
        cfg = BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA, lora_targets=targets, seed=1,
                           rslora=case in RSLORA)
        model, peft_model = build_nonzero_b(cfg, fsdp_mesh=mesh, device="cpu")
        with torch.no_grad():
            logits[case] = model(_ids())
        export_adapter(peft_model, os.path.join(out_root, case), path)
    return logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(base checkpoint with tokenizer files, adapter root, our logits per case) from one 2-rank spawn. Every Linear
    input 64 wide: the nf4 merge's reference, bitsandbytes 0.50.2's CPU dequantize_4bit of a 2-D state, takes other
    blocks' scales at widths that are multiples of 16 but not of 64 (model/bnb.py)."""
    from tests.fixtures import make_tokenizer

    path = tiny_checkpoint(tmp_path_factory.mktemp("base"), heads=4, head_dim=16)
    make_tokenizer(path)
    out = str(tmp_path_factory.mktemp("adapters"))
    logits = run_ranks(_export_rank, 2, path, out, timeout=240)
    for case in CASES:
        torch.testing.assert_close(logits[1][case], logits[0][case], rtol=0, atol=0, msg=f"{case}: ranks agree")
    return path, out, logits[0]


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _hf_logits(model):
    with torch.no_grad():
        return model(_ids()).logits


@pytest.mark.timeout(300)
def test_adapter_loads_in_peft_and_matches(exported):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    path, root, ours = exported
    assert _rel(ours["rslora"], ours["none"]) > 1e-3, "the same A and B at another scale move the logits"
    for case, (quant, targets) in CASES.items():
        adapter = os.path.join(root, case)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            acfg = json.load(f)
        assert (acfg["r"], acfg["lora_alpha"], acfg["peft_type"]) == (R, ALPHA, "LORA"), (case, acfg)
        assert acfg["use_rslora"] is (case in RSLORA), (case, acfg["use_rslora"])
        assert sorted(acfg["target_modules"]) == sorted(targets), (case, acfg["target_modules"])
        assert acfg["base_model_name_or_path"] == os.path.abspath(path), case
        assert acfg["task_type"] == "CAUSAL_LM", (case, acfg["task_type"])   # (until 2026-12-04 null: peft's Auto
        # class could not tell what to load it as)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = PeftModel.from_pretrained(_hf(path), adapter).eval()
        bad = [str(w.message) for w in caught if "adapter keys" in str(w.message) or "unexpected" in str(w.message)]
        assert not bad, f"{case}: peft warned {bad}"
        again = pm.load_adapter(adapter, adapter_name="again")   # the load result peft only warns about
        assert not again.missing_keys and not again.unexpected_keys, (case, again)
        with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
            keys = set(f.keys())
        expected = set(get_peft_model_state_dict(pm, adapter_name="default"))
        assert keys == expected, f"{case}: extra {sorted(keys - expected)[:4]}, missing {sorted(expected - keys)[:4]}"
        n_layers = 2
        assert len(keys) == 2 * len(targets) * n_layers, (case, len(keys))
        if quant == "none":    # nf4 adapters sit on a 4-bit base, which the float HF model is not
            rel = _rel(_hf_logits(pm), ours[case])
            print(f"peft on HF vs ours ({case}): {rel:.2e}")
            assert rel < 1e-5, f"peft logits vs ours: relative norm {rel:.2e}"
            assert _rel(_hf_logits(_hf(path)), ours[case]) > 1e-3, "the adapter must move the logits"
            auto = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()   # (its base: by path)
            assert _rel(_hf_logits(auto), ours[case]) < 1e-5, f"{case}: AutoPeftModelForCausalLM's logits"


@pytest.mark.timeout(300)
def test_merge_plain_base(exported, tmp_path):
    from peft import PeftModel

    from model.merged import merge

    path, root, ours = exported
    adapter = os.path.join(root, "none")
    ref = _hf_logits(PeftModel.from_pretrained(_hf(path), adapter).eval())

    merge(path, adapter, str(tmp_path / "fp32"), quant="none", dtype=torch.float32)
    rel = _rel(_hf_logits(_hf(str(tmp_path / "fp32"))), ref)
    print(f"merged fp32 vs peft: {rel:.2e}")
    assert rel < 1e-5, f"merged fp32 vs peft: relative norm {rel:.2e}"

    merge(path, adapter, str(tmp_path / "bf16"), quant="none")   # default dtype: bf16
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    hf = _hf(str(tmp_path / "bf16"), dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    rel = _rel(_hf_logits(hf), ref)
    print(f"merged bf16 vs peft fp32: {rel:.2e}")
    assert rel < 3e-2, f"merged bf16 vs peft fp32: relative norm {rel:.2e}"
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(tmp_path / "bf16" / fn), f"{fn} not copied"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["nf4", "nf4_qv"])
def test_merge_nf4_base_equals_our_model(exported, tmp_path, case):
    from model.merged import merge

    path, root, ours = exported
    merge(path, os.path.join(root, case), str(tmp_path), quant="nf4", dtype=torch.float32)
    rel = _rel(_hf_logits(_hf(str(tmp_path))), ours[case])
    print(f"merged nf4 ({case}) vs ours: {rel:.2e}")
    assert rel < 1e-5, f"{case}: merged nf4 base vs our nf4 model: relative norm {rel:.2e}"


def _merged_tensors(out_dir):
    """Every tensor of a merged checkpoint, through its index (the merge writes one file per base file)."""
    from safetensors.torch import load_file

    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(files) > 1, f"the tiny base is sharded, so the streamed merge is too: {files}"
    return {k: v for fn in files for k, v in load_file(os.path.join(out_dir, fn)).items()}


@pytest.mark.timeout(300)
def test_merge_equals_peft_merge_and_unload(exported, tmp_path):
    """Tensor by tensor against peft's own merge: on the plain base (fp32, bf16) and, for nf4, on the
    HF model whose block Linears hold bitsandbytes' dequantized NF4 weights (what training saw)."""
    from bitsandbytes.functional import dequantize_4bit
    from peft import PeftModel

    from model.merged import _is_nf4, merge

    path, root, _ = exported
    for case, quant, dtype, tol in [("none", "none", torch.float32, 1e-6), ("none", "none", torch.bfloat16, 0),
                                    ("rslora", "none", torch.float32, 1e-6),
                                    ("nf4", "nf4", torch.float32, 1e-6), ("nf4_qv", "nf4", torch.bfloat16, 0)]:
        hf = _hf(path)
        if quant == "nf4":
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if _is_nf4(n, p.shape):
                        packed, st = bnb_nf4(p.data)
                        p.copy_(dequantize_4bit(packed, st))
        ref = PeftModel.from_pretrained(hf, os.path.join(root, case)).merge_and_unload().state_dict()
        out = tmp_path / f"{case}_{dtype}"
        merge(path, os.path.join(root, case), str(out), quant=quant, dtype=dtype)
        got = _merged_tensors(out)
        assert set(got) == set(ref), (case, sorted(set(ref) ^ set(got))[:4])
        for k, v in got.items():
            want = ref[k].to(dtype)
            assert v.dtype == dtype, (case, k, v.dtype)
            # bf16: both round the same float32 sum once, but peft adds in its own order: 1 bf16 ulp
            torch.testing.assert_close(v.float(), want.float(), rtol=tol or 2 ** -7, atol=tol or 1e-6,
                                       msg=f"{case} {dtype} {k}")


DORA = {"none": ("q_proj", "v_proj", "down_proj"), "nf4": ALL}   # adapters peft makes itself, per base


@pytest.fixture(scope="module")
def dora(tmp_path_factory):
    """(base checkpoint, {case: adapter dir}): DoRA adapters made and saved by peft itself (use_dora, r 4 / alpha 8,
    random A and B, magnitudes scaled by U(0.5, 1.5) off peft's start ‖W + s·B A‖, so they are not the norms and a
    plain LoRA fold is not their merge). q/v carry Qwen2's biases, which DoRA leaves as they are."""
    from peft import LoraConfig, get_peft_model

    path = tiny_checkpoint(tmp_path_factory.mktemp("dora_base"))
    root = tmp_path_factory.mktemp("dora")
    for seed, (case, targets) in enumerate(DORA.items()):
        torch.manual_seed(seed)
        pm = get_peft_model(_hf(path), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(targets),
                                                  use_dora=True, init_lora_weights=False))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_magnitude_vector" in n:
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
        pm.save_pretrained(str(root / case))
    return path, {case: str(root / case) for case in DORA}


@pytest.mark.timeout(300)
def test_merge_dora_equals_peft_merge_and_unload(dora, tmp_path):
    """`python -m model.merge` of a peft DoRA adapter on the plain base (--quant none): tensor by tensor peft's own
    `merge_and_unload()` (float32 within 1e-6, bf16 within one rounding), and the merged checkpoint, loaded by
    transformers alone, gives the peft DoRA model's logits within 1e-5."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from model import merge as cli
    from model.merged import merge

    path, adapters = dora
    adapter = adapters["none"]
    pm = PeftModel.from_pretrained(_hf(path), adapter).eval()
    ref_logits = _hf_logits(pm)
    ref = pm.merge_and_unload().state_dict()
    assert _rel(ref_logits, _hf_logits(_hf(path))) > 1e-3, "the adapter moves the logits"

    out = tmp_path / "fp32"
    assert cli.main(["--model", path, "--adapter", adapter, "--out", str(out), "--quant", "none",
                     "--dtype", "fp32"]) == 0, "the CLI merges a DoRA adapter"
    got = _merged_tensors(out)
    assert set(got) == set(ref), sorted(set(ref) ^ set(got))[:4]
    for k, v in got.items():
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-6, msg=f"fp32 {k} vs peft's merge_and_unload")
    rel = _rel(_hf_logits(_hf(str(out))), ref_logits)
    print(f"merged DoRA fp32 vs peft's DoRA model: {rel:.2e}")
    assert rel < 1e-5, f"merged DoRA fp32 vs peft's DoRA model: relative norm {rel:.2e}"

    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))   # the magnitudes are what moved it
    pre = "base_model.model.model.layers.0.self_attn.q_proj."
    name = "model.layers.0.self_attn.q_proj.weight"
    plain = _hf(path).state_dict()[name] + ALPHA / R * lora[pre + "lora_B.weight"] @ lora[pre + "lora_A.weight"]
    assert _rel(got[name], plain) > 1e-2, "a DoRA merge is not the plain LoRA fold of the same A and B"
    assert torch.equal(got["model.layers.0.self_attn.q_proj.bias"], _hf(path).state_dict()[
        "model.layers.0.self_attn.q_proj.bias"]), "DoRA leaves the bias as it is (peft's forward and merge)"

    merge(path, adapter, str(tmp_path / "bf16"), quant="none")   # default dtype: bf16, one rounding of the same sum
    for k, v in _merged_tensors(tmp_path / "bf16").items():
        assert v.dtype == torch.bfloat16, (k, v.dtype)
        torch.testing.assert_close(v.float(), ref[k].to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6,
                                   msg=f"bf16 {k} vs peft's merge_and_unload")


@pytest.mark.timeout(300)
def test_merge_dora_from_nf4_equals_peft_dora_on_the_round_trip(dora, tmp_path):
    """merge(quant="nf4") of a DoRA adapter folds into `model.nf4.nf4_round_trip(W)`, the base a QLoRA run
    computes with, the DoRA norm taken over it too: its logits equal peft's DoRA model on the transformers model whose
    adapted weights (every block Linear here) hold the round trip within 1e-5, its tensors that model's
    `merge_and_unload()` within 1e-6."""
    from peft import PeftModel

    from model.merged import _is_nf4, merge
    from model.nf4 import nf4_round_trip

    path, adapters = dora
    adapter = adapters["nf4"]
    hf = _hf(path)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if _is_nf4(n, p.shape):
                p.copy_(nf4_round_trip(p.data))
    pm = PeftModel.from_pretrained(hf, adapter).eval()
    ref_logits = _hf_logits(pm)
    ref = pm.merge_and_unload().state_dict()
    on_plain = _hf_logits(PeftModel.from_pretrained(_hf(path), adapter).eval())
    assert _rel(ref_logits, on_plain) > 1e-4, "the 4-bit round trip moves the DoRA model's logits"

    merge(path, adapter, str(tmp_path), quant="nf4", dtype=torch.float32)
    rel = _rel(_hf_logits(_hf(str(tmp_path))), ref_logits)
    print(f"merged DoRA nf4 vs peft's DoRA model on the round trip: {rel:.2e}")
    assert rel < 1e-5, f"merged DoRA from nf4 vs peft's DoRA on the round trip: relative norm {rel:.2e}"
    got = _merged_tensors(tmp_path)
    assert set(got) == set(ref), sorted(set(ref) ^ set(got))[:4]
    for k, v in got.items():
        torch.testing.assert_close(v, ref[k], rtol=1e-6, atol=1e-6, msg=f"nf4 {k} vs peft's merge_and_unload")


def test_merge_refuses_a_dora_adapter_it_cannot_fold(dora, tmp_path, capsys):
    """model.merge stops (exit 2, naming the tensor and the fix, writing nothing) on a DoRA adapter with a projection's
    lora_magnitude_vector removed or of another shape than the weight's rows, one whose magnitude has no A and B, a
    plain LoRA adapter whose config says use_dora (no magnitudes at all), and magnitudes in an adapter whose config
    does not say use_dora (its merge would drop them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from model import merge as cli

    path, adapters = dora
    lora = load_file(os.path.join(adapters["none"], "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.1.mlp.down_proj."
    mag = pre + "lora_magnitude_vector"
    assert lora[mag].shape == (48,), lora[mag].shape   # (hidden 48: down_proj's output rows)

    def refused(name, tensors, **cfg):
        adapter = tmp_path / name
        shutil.copytree(adapters["none"], adapter)
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
        if cfg:
            acfg = json.loads((adapter / "adapter_config.json").read_text())
            (adapter / "adapter_config.json").write_text(json.dumps({**acfg, **cfg}))
        out = tmp_path / f"out_{name}"
        assert cli.main(["--model", path, "--adapter", str(adapter), "--out", str(out), "--quant", "none"]) == 2, name
        assert not out.exists(), f"{name}: a refused merge wrote its --out"
        return capsys.readouterr().err

    fix = "export the adapter again (`python -m parallel.checkpoint RUN/ckpt --out DIR`, or peft's save_pretrained)"
    err = refused("no_magnitude", {k: v for k, v in lora.items() if k != mag})
    assert f"{mag} is missing" in err and fix in err, err
    assert "1 of 6 projections lack a magnitude that fits" in err, err   # (2 layers x 3 projections)
    err = refused("short_magnitude", {**lora, mag: lora[mag][:-1]})
    assert f"{mag} is [47], not [48], one per output row of model.layers.1.mlp.down_proj.weight" in err and \
        fix in err, err
    err = refused("magnitude_alone", {k: v for k, v in lora.items() if not k.startswith((pre + "lora_A",
                                                                                          pre + "lora_B"))})
    assert "model.layers.1.mlp.down_proj.weight: only lora_magnitude_vector" in err, err
    plain = {k: v for k, v in lora.items() if "lora_magnitude_vector" not in k}
    err = refused("lora_as_dora", plain)   # (use_dora true, as peft saved it: a LoRA adapter's config edited)
    assert "6 of 6 projections lack a magnitude that fits" in err and fix in err, err
    assert "a plain LoRA adapter's adapter_config.json says use_dora: false" in err, err
    err = refused("dora_as_lora", lora, use_dora=False)
    assert "holds tensors that are not LoRA A/B weights (base_model.model.model.layers.0.mlp.down_proj." \
        "lora_magnitude_vector" in err and "adapter_config.json has no use_dora: true" in err, err


def test_merge_refuses_what_it_would_merge_wrong(exported, tmp_path, capsys, monkeypatch):
    """model.merge stops (exit 2, naming the fix, writing nothing) rather than: guess the base an adapter was trained
    against (no trained_on.json, no run config.json beside it: an nf4 guess would round a full-precision run's every
    block weight to 4 bits); fold per-module alpha/rank patterns in with one scale (DoRA's refusals: the test above);
    write into the base through a symlink or into a folder inside it (said alike with --force or without, never
    "pass --force" for an --out that --force would not make fit); fold into another base than the one trained on
    (trained_on.json's model_sha256: other weights of the same shapes, an edited config.json) without --any-base. A
    merge stopped while writing (over an earlier merge) leaves that merge as it was; one killed outright, its stage,
    which the same command clears."""
    import shutil

    from model import merge as cli
    from model.export import TRAINED_ON
    from model.merged import merge

    path, root, _ = exported
    adapter = tmp_path / "adapter"
    shutil.copytree(os.path.join(root, "none"), adapter)
    out = tmp_path / "out"

    def refused(*extra, adapter=adapter, out=out, model=path):
        there = sorted(os.listdir(out)) if out.exists() else None
        base = ["--model", str(model)] if model else []
        assert cli.main([*base, "--adapter", str(adapter), "--out", str(out), *extra]) == 2
        assert (sorted(os.listdir(out)) if out.exists() else None) == there, "a refused merge wrote something"
        return capsys.readouterr().err

    # a run's folder, or a path that is not there, is said as such, also without --model (until 2026-12-05 that
    # said "pass --model", as if the base were what was missing)
    for model in (path, None):
        assert f"there; that is a run's folder: pass its adapter, {str(adapter)}" in \
            refused(adapter=tmp_path, model=model)
        assert f"--adapter {str(tmp_path / 'nope')!r}: no such directory" in refused(adapter=tmp_path / "nope",
                                                                                     model=model)
    assert "pass --quant nf4 (a QLoRA adapter" in refused()
    (adapter / TRAINED_ON).write_text(json.dumps({"quant": "none"}))
    assert cli.run_quant(str(adapter)) == ("none", str(adapter / TRAINED_ON))
    base_copy = tmp_path / "base"
    shutil.copytree(path, base_copy)
    (tmp_path / "link").symlink_to(base_copy)
    before = {f: (base_copy / f).read_bytes() for f in os.listdir(base_copy)}
    assert "is the --model directory" in refused("--force", out=tmp_path / "link", model=base_copy)
    assert "is inside the --model directory" in refused(out=base_copy / "merged", model=base_copy)
    # the run directory an adapter lies in (RUN/adapter), even with --force: the merge would replace its config.json
    assert "holds the --adapter directory" in refused("--force", out=tmp_path)
    # an --out refused whatever --force says is refused for that alone, with --force or without (until 2026-12-06,
    # without it also said "pass --force to write into it anyway", which then was refused)
    for out_dir, model, why in ((adapter, path, "is the --adapter directory; merging would overwrite it"),
                                (tmp_path, path, "holds the --adapter directory"),
                                (tmp_path / "link", base_copy, "is the --model directory")):
        said = [refused(*force, out=out_dir, model=model) for force in ((), ("--force",))]
        assert said[0] == said[1] and why in said[0] and "--force" not in said[0], said
    run_like = tmp_path / "run_like"
    run_like.mkdir()
    (run_like / "metrics.jsonl").write_text("{}\n")
    assert "is a train.py run directory (metrics.jsonl)" in refused("--force", out=run_like)
    assert {f: (base_copy / f).read_bytes() for f in os.listdir(base_copy)} == before, "the base was written"
    for key, value in (("alpha_pattern", {"q_proj": 16}), ("rank_pattern", {"v_proj": 2}),
                       ("layer_replication", [[0, 1], [0, 1]]), ("alora_invocation_tokens", [5, 6]),
                       ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "olora"),
                       ("modules_to_save", ["lm_head"])):   # (peft's short name of a module not trained here: what
        other = tmp_path / f"{key}-{value}"   # it matches named; those of norms and the embedding merge: test_norms)
        shutil.copytree(adapter, other)      # (peft's variants a plain W + s·B@A merge is not: until 2026-12-04
        cfg = json.loads((other / "adapter_config.json").read_text())   # PiSSA, OLoRA, aLoRA and layer replication
        (other / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))   # merged, wrong, with exit 0)
        want = f"has {key} {value!r} (" + ("its base is rebuilt" if key == "init_lora_weights" else
                                           "'lm_head' matches lm_head, not trained here" if key == "modules_to_save"
                                           else "not trained here")
        assert want in refused(adapter=other), key
        assert ("peft matches each as a name suffix" in refused(adapter=other)) == (key == "modules_to_save"), key
    # the base it was trained on, by its files (trained_on.json's model_sha256, as train.py writes it): a copy
    # elsewhere merges; the same shapes with other weights, or an edited config.json, do not, unless --any-base
    from model.hub import model_fingerprint
    (adapter / TRAINED_ON).write_text(json.dumps({"quant": "none", "model_sha256": model_fingerprint(path)}))
    other_w, other_cfg = tmp_path / "other_weights", tmp_path / "other_config"
    for d in (other_w, other_cfg):
        shutil.copytree(base_copy, d)
    shard = sorted(f for f in os.listdir(other_w) if f.endswith(".safetensors"))[0]
    blob = bytearray((other_w / shard).read_bytes())
    blob[-4:] = bytes(b ^ 0xFF for b in blob[-4:])   # one float's bytes in its last MB
    (other_w / shard).write_bytes(bytes(blob))
    cfg = json.loads((other_cfg / "config.json").read_text())
    (other_cfg / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    for d in (other_w, other_cfg):
        assert "is not the base" in (msg := refused(model=d)) and "--any-base" in msg, msg
    assert cli.main(["--model", str(other_cfg), "--adapter", str(adapter), "--out", str(tmp_path / "any"),
                     "--any-base"]) == 0
    assert cli.main(["--model", str(base_copy), "--adapter", str(adapter), "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    tree = lambda d: {os.path.relpath(os.path.join(w, f), d): open(os.path.join(w, f), "rb").read()
                      for w, _, fs in os.walk(d) for f in fs}
    before = tree(out)
    monkeypatch.setattr(shutil, "copyfile", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):   # after the shards and the index, while copying the tokenizer
        merge(path, str(adapter), str(out), quant="none")
    # the files go to OUT/.merge-tmp, moved in once all are written: the earlier merge stays whole (until 2026-12-04
    # it was removed first, so a stopped --force merge left neither model)
    assert tree(out) == before and not (out / ".merge-tmp").exists(), "a stopped merge changed the earlier one"
    fresh = tmp_path / "fresh"   # a merge killed outright leaves its stage: the same command runs again, no --force
    (fresh / ".merge-tmp").mkdir(parents=True)
    (fresh / ".merge-tmp" / ".merge-stage").write_bytes(b"")
    (fresh / ".merge-tmp" / "model.safetensors").write_bytes(b"half")
    monkeypatch.undo()
    argv = lambda out, *extra: ["--model", str(base_copy), "--adapter", str(adapter), "--out", str(out), *extra]
    # a live merge's stage is not a killed one's: a second merge into the same --out is refused while the first holds
    # the folder's lock (review, helper 54: it cleared the first's stage, and the two left one mixed, incomplete model)
    from model.merge_out import _hold
    held = _hold(str(fresh))
    try:
        assert cli.main(argv(fresh)) == 2
        assert f"another merge is writing into {str(fresh)!r} now" in capsys.readouterr().err
        assert (fresh / ".merge-tmp" / "model.safetensors").read_bytes() == b"half", "the live stage was touched"
    finally:
        os.close(held)
    assert cli.main(argv(fresh)) == 0
    assert (fresh / "config.json").is_file() and not (fresh / ".merge-tmp").exists()
    # without --force, "empty" is checked again under the lock: a merge that ended while this one started (its
    # stage only, when model.merge looked) is not replaced (review, helper 56)
    done = tree(fresh)
    with pytest.raises(ValueError, match="is not empty .* pass --force"):
        merge(str(base_copy), str(adapter), str(fresh), quant="none", force=False)
    assert tree(fresh) == done
    users = tmp_path / "users"   # a .merge-tmp of the user's (no marker) is content: --force, then refused, kept
    (users / ".merge-tmp").mkdir(parents=True)
    (users / ".merge-tmp" / "notes.txt").write_text("mine")
    assert cli.main(argv(users)) == 2 and "is not empty" in capsys.readouterr().err
    assert cli.main(argv(users, "--force")) == 2 and "is not a merge's own folder" in capsys.readouterr().err
    assert sorted(os.listdir(users)) == [".merge-tmp"] and (users / ".merge-tmp" / "notes.txt").read_text() == "mine"
    clash = tmp_path / "clash"   # a file where the merge puts a folder: refused before the earlier model is touched
    shutil.copytree(fresh, clash)
    (base_copy / "additional_chat_templates").mkdir()
    (base_copy / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (clash / "additional_chat_templates").write_text("a file")
    earlier = tree(clash)
    assert cli.main(argv(clash, "--force")) == 2 and "is a file, where the merge writes a folder" in \
        capsys.readouterr().err
    assert tree(clash) == earlier and not (clash / ".merge-tmp").exists()
    shutil.rmtree(base_copy / "additional_chat_templates")
    replace = os.replace   # a move that fails once the earlier model is gone: said so, with where the files are

    def moves_fail(a, b):
        if ".merge-tmp" in str(a) and ".merge-tmp" not in str(b) and str(b).endswith("config.json"):
            raise OSError(5, "Input/output error")
        return replace(a, b)
    monkeypatch.setattr(os, "replace", moves_fail)
    assert cli.main(argv(clash, "--force")) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "the earlier model there is removed; the files not moved yet are in" in err and "it is as it was" not in \
        err and (clash / ".merge-tmp" / "config.json").is_file() and not (clash / "config.json").exists(), err


def test_merge_carries_the_bases_other_files(exported, tmp_path):
    """The merged folder gets the base's tokenizer files beyond tokenizer*.json (added_tokens.json, *.tiktoken) and,
    for a config with auto_map, its remote code; a base without generation_config.json, merged with a --chat-template
    adapter, gets one with config.json's bos/pad ids and both eos ids (until 2026-12-02 it held the eos ids only)."""
    import shutil

    from data.templates import TEMPLATES
    from model.export import TEMPLATE
    from model.merged import merge

    path, root, _ = exported
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(path, base)
    shutil.copytree(os.path.join(root, "none"), adapter)
    (adapter / TEMPLATE).write_text(TEMPLATES["chatml"])
    (base / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_x.X"}, bos_token_id=1, pad_token_id=2, eos_token_id=0)
    (base / "config.json").write_text(json.dumps(cfg))
    for fn in ("modeling_x.py", "added_tokens.json", "x.tiktoken"):
        (base / fn).write_text("{}" if fn.endswith(".json") else "# " + fn)
    merge(str(base), str(adapter), str(tmp_path / "merged"), quant="none")
    for fn in ("modeling_x.py", "added_tokens.json", "x.tiktoken"):
        assert (tmp_path / "merged" / fn).read_text() == (base / fn).read_text(), fn
    gen = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(str(tmp_path / "merged")).convert_tokens_to_ids("<|im_end|>")
    assert gen == {"bos_token_id": 1, "pad_token_id": 2, "eos_token_id": [0, end]}, gen


@pytest.mark.timeout(300)
def test_merge_cli(exported, tmp_path):
    from transformers import AutoTokenizer

    from model.merged import merge

    path, root, _ = exported
    run = tmp_path / "run"                      # the layout train.py writes: RUN/config.json + RUN/adapter
    run.mkdir()
    os.symlink(os.path.join(root, "none"), run / "adapter")
    # "none" differs from the CLI's fallback (nf4), so the output proves the run config was read
    (run / "config.json").write_text(json.dumps({"model": path, "quant": "none"}))
    cli = [sys.executable, "-m", "model.merge", "--model", path]

    # `python -m model.export` (a library) names the commands, exit 2 (it did nothing and exited 0)
    lib = subprocess.run([sys.executable, "-m", "model.export", "--adapter", str(run / "adapter"), "--out",
                          str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert lib.returncode == 2 and "python -m parallel.checkpoint RUN/ckpt --out DIR" in lib.stderr and \
        "python -m model.merge --adapter RUN/adapter --out DIR" in lib.stderr and not (tmp_path / "x").exists(), lib
    bad = subprocess.run([*cli, "--adapter", str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope" in bad.stderr and "no such directory" in bad.stderr, bad.stderr

    out = tmp_path / "merged"
    res = subprocess.run([*cli, "--adapter", str(run / "adapter"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "quant none (from" in res.stdout and "done" in res.stdout, res.stdout

    merge(path, os.path.join(root, "none"), str(tmp_path / "direct"), quant="none")
    got, want = _merged_tensors(out), _merged_tensors(tmp_path / "direct")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert _hf_logits(_hf(str(out), dtype="auto")).isfinite().all()
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size > 0


def test_merge_force_replaces_an_earlier_model_and_never_writes_through_links(exported, tmp_path, capsys, monkeypatch):
    """--force into a folder that holds links (a `cp -rs` view of another model) replaces the links and leaves their
    targets as they were (until 2026-12-04 the tokenizer and generation files were copied through them, into the
    other model); an earlier merge's single model.safetensors goes (it loaded instead of the new sharded index); the
    base's additional_chat_templates/ travels. An adapter whose B @ A does not fit the base is refused before anything
    is written, so an earlier merge stays whole (it was a RuntimeError at the first such shard, config.json gone)."""
    import hashlib
    import shutil

    from safetensors.torch import load_file, save_file

    from model import merge as cli
    from model.export import TRAINED_ON
    from model.merged import merge
    from tests.fixtures import make_tokenizer

    path, root, _ = exported
    adapter, base, other, out = (tmp_path / n for n in ("adapter", "base", "other", "out"))
    shutil.copytree(os.path.join(root, "none"), adapter)
    (adapter / TRAINED_ON).write_text(json.dumps({"quant": "none"}))
    shutil.copytree(path, base)
    (base / "additional_chat_templates").mkdir()
    (base / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    make_tokenizer(tiny_checkpoint(other, heads=4, seed=3))
    for f in ("tokenizer_config.json", "generation_config.json"):   # files of its own, which the merge copies over
        (other / f).write_text(json.dumps({**json.loads((other / f).read_text()), "theirs": 1}))
    digest = lambda d: {os.path.relpath(os.path.join(w, f), d): hashlib.sha256(open(os.path.join(w, f), "rb").read())
                        .hexdigest() for w, _, fs in os.walk(d) for f in fs}
    theirs = digest(other)
    out.mkdir()
    for f in os.listdir(other):
        (out / f).symlink_to(other / f)
    argv = ["--model", str(base), "--adapter", str(adapter), "--out", str(out), "--force"]
    assert cli.main(argv) == 0
    assert digest(other) == theirs, "the merge wrote through links into another model"
    merge(str(base), str(adapter), str(tmp_path / "fresh"), quant="none")
    assert not [f for f in os.listdir(out) if os.path.islink(out / f)]
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "fresh")), os.listdir(out)
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ messages }}"
    assert _merged_tensors(out).keys() == _merged_tensors(tmp_path / "fresh").keys()
    # a `cp -al` copy of the base (hard links): every file written is a new one, the base's bytes stay (until
    # 2026-12-04 a SameFileError, and the advice to rerun with --force, which failed alike); a link of the user's
    # under a name the merge never writes stays (links of every name were removed)
    hard, data = tmp_path / "hard", tmp_path / "data"
    shutil.copytree(base, hard, copy_function=os.link)
    data.mkdir()
    (hard / "datalink").symlink_to(data)
    bases = digest(base)
    assert cli.main(["--model", str(base), "--adapter", str(adapter), "--out", str(hard), "--force"]) == 0
    assert digest(base) == bases, "the merge wrote through hard links into the base"
    assert (hard / "datalink").is_symlink() and sorted(os.listdir(hard)) == sorted(os.listdir(out) + ["datalink"])
    assert all(torch.equal(a, b) for a, b in zip(_merged_tensors(hard).values(), _merged_tensors(out).values()))
    hard2 = tmp_path / "hard2"   # a `cp -al` copy of another model: its files stay as they were too
    shutil.copytree(other, hard2, copy_function=os.link)
    assert cli.main(["--model", str(base), "--adapter", str(adapter), "--out", str(hard2), "--force"]) == 0
    assert digest(other) == theirs, "the merge wrote through hard links into another model"
    # --out as the directory it names on disk: 'DIR/typo/..' is DIR, not empty (until 2026-12-04 taken as a new
    # directory: its files were removed as --force's); a run's checkpoint folder is refused even with --force
    capsys.readouterr()
    assert cli.main(["--model", str(base), "--adapter", str(adapter), "--out", str(hard / "typo" / "..")]) == 2
    assert "is not empty" in capsys.readouterr().err and (hard / "datalink").is_symlink()
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step_000002")
    assert cli.main([*argv[:4], "--out", str(ckpt / "merged"), "--force"]) == 2
    assert f"is inside a run's checkpoint folder {str(ckpt)!r}" in capsys.readouterr().err
    (tmp_path / "run" / "metrics.jsonl").write_text("")   # its export folder: replaced at its next export
    for exported in ("adapter", "adapter_best", "adapter.abandoned-2"):
        assert cli.main([*argv[:4], "--out", str(tmp_path / "run" / exported / "merged"), "--force"]) == 2
        assert f"is inside a run's adapter folder {str(tmp_path / 'run' / exported)!r}" in capsys.readouterr().err
    assert cli.main([*argv[:4], "--out", str(tmp_path / "run" / "adapter_4" / "merged")]) == 0   # (not the run's)
    shutil.rmtree(tmp_path / "run" / "adapter_4")
    assert cli.main([*argv[:4], "--out", str(base / "sub" / ".."), "--force"]) == 2
    assert f"--out {str(base / 'sub' / '..')!r} is the --model directory" in capsys.readouterr().err
    save_file({"stale": torch.zeros(2)}, out / "model.safetensors")   # another base's one-file merge, earlier
    save_file({"mine": torch.zeros(2)}, out / "adapter_model.safetensors")   # a user's file: not a model's name
    assert cli.main(argv) == 0 and not (out / "model.safetensors").exists()
    assert load_file(out / "adapter_model.safetensors").keys() == {"mine"}
    os.remove(out / "adapter_model.safetensors")
    merged = digest(out)
    shutil.copy(adapter / "adapter_model.safetensors", tmp_path / "adapter_ok.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")   # an adapter of another model: one B a row too long
    k = next(k for k in sorted(lora) if ".lora_B." in k)
    lora[k] = torch.cat([lora[k], lora[k][:1]])
    save_file(lora, adapter / "adapter_model.safetensors")
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert "does not fit the base" in (err := capsys.readouterr().err) and "B @ A is [65, 64]" in err, err
    assert digest(out) == merged, "a refused merge touched the earlier one"
    (adapter / "adapter_model.safetensors").write_bytes((tmp_path / "adapter_ok.safetensors").read_bytes()[:300])
    assert cli.main(argv) == 2 and "cannot be read" in capsys.readouterr().err   # a cut file (was a traceback)
    assert digest(out) == merged
    save_file(load_file(tmp_path / "adapter_ok.safetensors"), adapter / "adapter_model.safetensors")
    from safetensors import SafetensorError

    with monkeypatch.context() as m:   # a full disk: one line naming --out and the way on, exit 2 (was a traceback;
        # safetensors raises its own SafetensorError there, not OSError: until 2026-12-04 a traceback all the same)
        m.setattr("model.export._save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)")))
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"merge: writing {str(out)!r} failed (OSError: writing " in err and "No space left on device" in err \
        and "it is as it was" in err, err
    assert digest(out) == merged, "a full disk changed the earlier merge"
    assert cli.main([*argv, "--quant", "nf4"]) == 0   # allowed, and said: not the base it trained against
    assert "note: --quant nf4, but" in capsys.readouterr().out
    acfg = json.loads((adapter / "adapter_config.json").read_text())   # the base it names, moved away since
    acfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(acfg))
    assert cli.main(["--adapter", str(adapter), "--out", str(tmp_path / "o2")]) == 2
    assert f"the base adapter_config.json names, {str(tmp_path / 'gone')!r} is not a directory" in \
        (err := capsys.readouterr().err) and err.rstrip().endswith("; pass --model BASE_DIR"), err
    acfg["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(acfg))
    assert cli.main(["--adapter", str(adapter), "--out", str(base), "--force"]) == 2
    assert f"--out {str(base)!r} is the base directory adapter_config.json names; merging would overwrite it" in \
        capsys.readouterr().err   # (was "the the base adapter_config.json names, directory")
    # another tool's adapter naming its base by a relative path and a branch (peft's revision "main"): the directory
    # there (2026-12-04, briefly, it went to the Hub as an id); train.py's own Hub adapters record a commit
    monkeypatch.chdir(tmp_path)
    acfg.update(base_model_name_or_path="base", revision="main")
    (adapter / "adapter_config.json").write_text(json.dumps(acfg))
    assert cli.main(["--adapter", str(adapter), "--out", str(tmp_path / "o3")]) == 0


def test_a_failed_export_leaves_the_adapter_that_was_there(tmp_path, monkeypatch):
    """An export killed halfway leaves the adapter that was there whole, or, on the first export (none there yet, or an
    empty folder, which `python -m parallel.checkpoint --out .` writes into), no adapter file at all: never one that
    peft cannot load (until 2026-12-02 the first export wrote in place)."""
    from model.export import write_adapter
    from model.qlora import lora_config

    out = str(tmp_path / "adapter")
    sd = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}
    for there in ("nothing", "an empty folder"):
        if there != "nothing":
            os.makedirs(out)
        cfg = lora_config(2, 4.0, 0.0)
        with monkeypatch.context() as m:
            m.setattr(type(cfg), "save_pretrained", lambda self, d: (_ for _ in ()).throw(OSError("killed")))
            with pytest.raises(OSError, match="killed"):
                write_adapter(sd, cfg, out, str(tmp_path))
        assert not os.path.exists(out) or not [f for f in os.listdir(out) if not f.startswith(".")], \
            f"{there}: a half adapter in {out}"
        # and no half-written folder left (an adapter with --train-embeddings is GBs, on what may be a full disk, and
        # the advice is another --out: until 2026-12-07 `adapter.tmp-export` or `adapter/.adapter.tmp` stayed)
        assert os.listdir(tmp_path) == ([] if there == "nothing" else ["adapter"]) and \
            (there == "nothing" or os.listdir(out) == []), f"{there}: {os.listdir(tmp_path)}"
    write_adapter(sd, lora_config(2, 4.0, 0.0), out, str(tmp_path))   # into the empty folder, its leftover cleared
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert sorted(before) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    cfg = lora_config(2, 4.0, 0.0)
    monkeypatch.setattr(type(cfg), "save_pretrained", lambda self, d: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):   # killed after the weights, before the config
        write_adapter({k: v * 2 for k, v in sd.items()}, cfg, out, str(tmp_path))
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["adapter"], os.listdir(tmp_path)
    monkeypatch.undo()
    write_adapter({k: v * 2 for k, v in sd.items()}, lora_config(2, 4.0, 0.0), out, str(tmp_path),
                  rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0})
    from safetensors.torch import load_file
    got = load_file(os.path.join(out, "adapter_model.safetensors"))[next(iter(sd))]
    assert torch.equal(got, torch.full((2, 4), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["adapter"], "a .tmp or .old folder was left behind"
    here = tmp_path / "here"   # `--out .` from an empty directory
    here.mkdir()
    monkeypatch.chdir(here)
    write_adapter(sd, lora_config(2, 4.0, 0.0), ".", str(tmp_path))
    assert sorted(os.listdir(here)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["adapter", "here"], "a .tmp or .old folder was left beside it"
    half = tmp_path / "half"   # an export of another run (its RoPE and template) killed between its renames there:
    (half / ".adapter.tmp").mkdir(parents=True)   # written again without the files this adapter does not have
    for name in ("base_config_overrides.json", "chat_template.jinja", "adapter_model.safetensors"):
        (half / name).write_text("{}")
    write_adapter(sd, lora_config(2, 4.0, 0.0), str(half), str(tmp_path))
    assert sorted(os.listdir(half)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"], \
        os.listdir(half)
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                       "base_config_overrides.json"]


def test_the_adapter_card_names_its_base_as_the_hub_reads_it(tmp_path):
    """README.md beside the adapter is a model card huggingface_hub's own ModelCard reads: library_name peft, and for
    a base fetched from the Hub its id as base_model (the Hub then lists the adapter under its base; a local base has
    no id to name); it says the LoRA shape, and the RoPE and template files when there are."""
    from huggingface_hub import ModelCard

    from model.export import write_adapter
    from model.qlora import lora_config

    sd = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    write_adapter(sd, lora_config(2, 4.0, 0.0), str(tmp_path / "a"), str(snap), tied=False,
                  rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}, chat_template="{{ x }}")
    card = ModelCard.load(tmp_path / "a" / "README.md")
    assert card.data.base_model == "org/tiny" and card.data.library_name == "peft", card.data
    assert card.data.pipeline_tag == "text-generation", card.data   # (a wrapper base's: test_wrapper_write)
    assert f"org/tiny at commit {'c' * 40}" in card.text and "LoRA r 2, alpha 4" in card.text, card.text
    assert "base_config_overrides.json" in card.text and "chat_template.jinja" in card.text, card.text
    write_adapter(sd, lora_config(2, 4.0, 0.0), str(tmp_path / "b"), str(tmp_path), tied=False)
    card = ModelCard.load(tmp_path / "b" / "README.md")
    assert card.data.base_model is None and card.data.library_name == "peft" and "a local checkpoint" in card.text
    assert "base_config_overrides.json" not in card.text


def test_init_adapter_given_a_run_or_checkpoint_names_the_adapter_to_pass(tmp_path):
    """--init-adapter pointed at a run's folder or one of its checkpoints (not an adapter): the refusal names what to
    pass, or how to export it (review, helper 41: one generic line for every such path)."""
    from model.adapter_read import check_init_adapter

    def said(path):
        with pytest.raises(ValueError) as e:
            check_init_adapter(str(path), 16, 32.0, ["q_proj"])
        return str(e.value)

    run = tmp_path / "run"
    (run / "ckpt" / "step_000003").mkdir(parents=True)
    (run / "ckpt" / "latest").write_text("step_000003\n")
    (run / "ckpt" / "step_000003" / "meta.json").write_text("{}")
    assert f"that is a run's folder with no adapter yet: export its adapter first, `python -m parallel.checkpoint " \
           f"{run / 'ckpt'} --out DIR`, and pass DIR" in said(run)
    for ckpt in (run / "ckpt", run / "ckpt" / "step_000003"):
        assert f"that is a run's checkpoint: export its adapter first, `python -m parallel.checkpoint {ckpt} --out " \
               "DIR`" in said(ckpt)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    assert f"that is a run's folder: pass its adapter, {run / 'adapter'}" in said(run)
    assert "pass a PEFT adapter folder (e.g. an earlier run's OUT/adapter)" in said(tmp_path)
    assert "no adapter_config.json and adapter_model.safetensors there" in said(tmp_path)
    # one of the two there (a copy cut short): the one missing is named, not both
    assert "no adapter_model.safetensors there" in said(run / "adapter")
    (run / "adapter" / "adapter_config.json").rename(run / "adapter" / "adapter_model.safetensors")
    assert "no adapter_config.json there" in said(run / "adapter")


@pytest.mark.parametrize("text, phrase", [
    ('{"r": 16,\n "lora_alpha": ', "is not valid JSON (line 2, column 16: Expecting value)"),
    ("[16, 32]", "holds no JSON object"),
    (json.dumps({"peft_type": "LORA", "r": 0, "lora_alpha": 32.0, "target_modules": ["q_proj"]}),
     "r 0 and lora_alpha 32.0: r must be a whole number of 1 or more"),
    (json.dumps({"peft_type": "LORA", "r": 16, "target_modules": ["q_proj"]}),
     "r 16 and lora_alpha None: r must be a whole number of 1 or more and lora_alpha a finite number"),
], ids=["cut_short", "a_list", "r_0", "no_alpha"])
def test_an_adapter_config_that_cannot_be_read_is_named_with_the_fix(text, phrase, tmp_path, capsys):
    """An adapter folder whose adapter_config.json is cut short, holds no object, or has no usable r / lora_alpha (peft
    scales B @ A by alpha / r): --init-adapter's start-up check and model.merge (exit 2, writing nothing) both name the
    flag, the file, what is wrong and the fix, before any weight. Until 2026-12-07 --init-adapter said only "Expecting
    value: line 2 column 16 (char 25)"; the merge said the folder had "no adapter_config.json naming a base model"
    (without --model), and merged an r of 0 into a ZeroDivisionError traceback."""
    from model import merge as cli
    from model.adapter_read import check_init_adapter

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(text)
    (adapter / "adapter_model.safetensors").write_bytes(b"")   # (never read: the config is refused first)
    fn, fix = str(adapter / "adapter_config.json"), "fix it, or export the adapter again"
    with pytest.raises(ValueError) as e:
        check_init_adapter(str(adapter), 16, 32.0, ["q_proj"])
    assert str(e.value).startswith(f"--init-adapter {str(adapter)!r}: {fn} ") and phrase in str(e.value) and \
        fix in str(e.value), str(e.value)
    assert cli.main(["--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"merge: --adapter {str(adapter)!r}: {fn} ") and phrase in err and fix in err, err
    assert not (tmp_path / "merged").exists(), "a refused merge wrote something"


def test_an_adapter_of_another_peft_type_is_named_by_it_and_check_inputs_lists_every_problem(tmp_path, capsys):
    """An adapter peft made of another kind (IA3: no r, no lora_alpha) is refused naming its peft_type, by
    --init-adapter and the merge, not as a LoRA with a bad r; and the merge's check_inputs lists a broken
    adapter_config.json among the other problems, rather than raising (review, helper 178)."""
    import argparse

    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    from model import merge as cli
    from model.adapter_read import check_init_adapter

    base = tiny_checkpoint(tmp_path / "base")
    ia3 = tmp_path / "ia3"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])).save_pretrained(str(ia3))
    assert "r" not in json.loads((ia3 / "adapter_config.json").read_text())   # (peft's own IA3 config)
    with pytest.raises(ValueError, match=r"peft_type 'IA3' \(LoRA is trained here\)"):
        check_init_adapter(str(ia3), 16, 32.0, ["q_proj", "k_proj", "down_proj"])
    assert cli.main(["--model", base, "--adapter", str(ia3), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert "peft_type 'IA3' (LoRA is trained here)" in err and "r None" not in err, err
    (ia3 / "adapter_config.json").write_text("[1]")
    errors = cli.check_inputs(argparse.Namespace(model=str(tmp_path / "nope"), adapter=str(ia3), out=str(base),
                                                 force=False))
    assert any("is not a directory" in e for e in errors) and any("holds no JSON object" in e for e in errors) and \
        any("is not empty" in e for e in errors), errors
    assert not (tmp_path / "merged").exists()


@pytest.mark.timeout(300)
def test_init_adapter_takes_peft_regex_targets_and_exclude_modules(tmp_path):
    """peft's other spellings of which modules it adapted, made by peft itself: target_modules as a regex (matched in
    full against module names) and exclude_modules (names matched as suffixes, or a regex). The start-up checks take
    them (they refused both: the regex as "beyond this run's --lora-targets" whatever those were, an excluded module
    as "a damaged or hand-edited adapter"; review, helper 92), a regex's projections beyond --lora-targets are still
    refused, and the run starts from peft's function (logits = PeftModel's)."""
    from peft import LoraConfig, get_peft_model

    from model.adapter_fit import init_adapter_fits
    from model.adapter_read import check_init_adapter
    from model.load import read_args
    from parallel.parallelize import BuildOptions, build_model

    path = tiny_checkpoint(tmp_path / "base")
    shapes = read_args(path).projections()
    cases = {"regex": dict(target_modules=r".*\.(q_proj|up_proj)"),
             "exclude": dict(target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.1.self_attn.q_proj"]),
             "exclude_re": dict(target_modules=["k_proj", "down_proj"], exclude_modules=r".*\.0\.mlp\.down_proj")}
    for case, kw in cases.items():
        torch.manual_seed(3)
        pm = get_peft_model(_hf(path), LoraConfig(r=R, lora_alpha=ALPHA, task_type="CAUSAL_LM", **kw))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        out = str(tmp_path / case)
        pm.save_pretrained(out)
        check_init_adapter(out, R, ALPHA, ALL)
        init_adapter_fits(out, shapes, R, 2)
        ours, _ = build_model(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, ac=False, init_adapter=out),
                              device="cpu")
        with torch.no_grad():
            rel = _rel(ours(_ids()), _hf_logits(pm.eval()))
            assert rel < 1e-5, f"{case}: our start vs peft: relative norm {rel:.2e}"
            assert _rel(_hf_logits(_hf(path)), _hf_logits(pm)) > 1e-3, f"{case}: the adapter must move the logits"
    with pytest.raises(ValueError, match=r"target_modules '\.\*\\\\\.\(q_proj\|up_proj\)' \(adapting q_proj,up_proj\), "
                                         r"beyond this run's --lora-targets q_proj,v_proj"):
        check_init_adapter(str(tmp_path / "regex"), R, ALPHA, ("q_proj", "v_proj"))
    with open(os.path.join(str(tmp_path / "exclude"), "adapter_config.json")) as f:   # (no exclude: a cut adapter)
        cfg = json.load(f)
    with open(os.path.join(str(tmp_path / "exclude"), "adapter_config.json"), "w") as f:
        json.dump({**cfg, "exclude_modules": None}, f)
    with pytest.raises(ValueError, match=r"holds no tensors for 1 of those projections \(layer 1 q_proj\)"):
        init_adapter_fits(str(tmp_path / "exclude"), shapes, R, 2)


def test_merge_and_nf4_import_no_peft_or_transformers():
    code = ("import sys, model.merge, model.nf4, parallel.tiled_attention\n"
            "print(sorted(m for m in ('bitsandbytes', 'peft', 'transformers', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # (dynamo: imported by model.bnb before its swap of torch.compile, the one module importing it on purpose)
    assert r.stdout.split("\n")[-2] == "['bitsandbytes', 'torch._dynamo']", r.stdout
