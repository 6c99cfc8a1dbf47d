"""Checkpoints quantized already with bitsandbytes' 4-bit (the -bnb-4bit uploads): model/prequant.py.

Pins (gloo on CPU, float32; the shared tiny Qwen2 checkpoint quantized and saved by transformers + bitsandbytes
themselves, sharded so weights and their companions fall in different files):
- double quantization, --quant nf4, FSDP2 over 2 ranks (codes stored as uint8, and as bf16 the way FSDP-QLoRA
  uploads store them): every NF4 layer's gathered codes are the upload's bytes and
  its dequantized weight is bitsandbytes' `dequantize_4bit` of transformers' own loaded `Linear4bit`, bit for bit;
  our logits with LoRA (B non-zero) equal peft's LoRA on transformers' 4-bit model loading the adapter we export
  (1e-5); `merge(quant="nf4")` into the 4-bit base gives a float checkpoint (no quantization_config) that
  transformers loads alone with the same logits (1e-5);
- without double quantization: the codes are the upload's; the fp32 block scales are nested from bitsandbytes' own
  primitives (`quantize_blockwise` of the scales less their float64 mean), and the weight stays within 1% of
  transformers' (relative norm);
- --quant none (and fp4, which it alone takes): every weight is bitsandbytes' dequantization, bit for bit, whole and
  in any rows (`get_rows`, `get_flat`);
- `llm_int8_skip_modules`: the projections stored in float are quantized as from a float checkpoint (bitsandbytes'
  primitives), and the start-up note says so;
- `python -m data.demo_compare` on an upload quantized from bf16 (compute dtype bf16, fp32 scales): its transformers
  model computes training's logits (float32; under nf4 the scales nested as training nests them);
- refusals before any weight is read, naming the fix: fp4 under --quant nf4 (no run directory made); a packed weight
  without a companion tensor, or cut short, a companion (scales, code books) of another length than its quant state
  implies, a quant state of block size 0 (CorruptCheckpointError naming it).

Run: .venv/bin/python -m pytest -q tests/test_prequant.py
"""

import json
import os
import shutil

import pytest
import torch

from tests.dist import run_ranks
from tests.helpers import bnb_checkpoint

R, ALPHA = 4, 8.0


def _ids():
    return torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(5))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _u8(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny Qwen2 checkpoint whose Linear inputs are whole 64-blocks (hidden 64, MLP 128), as every real model's are:
    bitsandbytes 0.50's CPU `dequantize_4bit` takes the wrong block scales when a row is not (a [16, 48] weight: 4x
    the quantization error; CUDA's kernel and a flat shape are right), which would hide what is pinned here. Then
    its 4-bit saves by transformers."""
    from tests.fixtures import make_tokenizer
    from tests.helpers import tiny_checkpoint

    d = tmp_path_factory.mktemp("bnb")
    base = tiny_checkpoint(d / "float", heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512)
    make_tokenizer(base)
    return {"float": base,
            "dq": bnb_checkpoint(base, d / "dq", bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
            "bf16_storage": bnb_checkpoint(base, d / "bf16_storage", bnb_4bit_quant_type="nf4",   # (FSDP-QLoRA's
                                           bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16),
            "plain": bnb_checkpoint(base, d / "plain", bnb_4bit_quant_type="nf4"),
            "fp4": bnb_checkpoint(base, d / "fp4", bnb_4bit_quant_type="fp4"),
            "skip": bnb_checkpoint(base, d / "skip", bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   llm_int8_skip_modules=["down_proj", "lm_head"])}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float32)


def _logits(model):
    """In train mode (no dropout in these models or adapters): bitsandbytes' CPU inference path repacks a 4-bit
    weight for its own kernel, which takes only widths it can tile (not this tiny model's)."""
    with torch.no_grad():
        return model.train()(_ids()).logits


def _bnb_weights(path) -> dict:
    """transformers' own 4-bit model of `path`: {name: (packed codes, bitsandbytes' dequantized float32 weight)}."""
    import copy

    from bitsandbytes.functional import dequantize_4bit

    out = {}
    for n, m in _hf(path).named_modules():
        if hasattr(getattr(m, "weight", None), "quant_state"):
            st = copy.copy(m.weight.quant_state)
            st.dtype = torch.float32
            out[f"{n}.weight"] = (m.weight.data, dequantize_4bit(m.weight.data, st))
    return out


def _rank(rank, world_size, packed, out_root):
    """FSDP2 over `world_size` ranks: each case's NF4 layers (gathered) and float weights, logits; the dq adapter."""
    from model.export import export_adapter
    from model.nf4 import NF4Linear
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    mesh = ParallelDims(world_size).build_mesh("cpu").fsdp
    got = {}
    for case, path, quant in (("dq", packed["dq"], "nf4"), ("bf16_storage", packed["bf16_storage"], "nf4"),
                              ("plain", packed["plain"], "nf4"),
                              ("skip", packed["skip"], "nf4"), ("none", packed["dq"], "none")):
        model, peft_model = build_nonzero_b(BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA, seed=1),
                                            fsdp_mesh=mesh, device="cpu")
        layers = {}
        for n, m in model.named_modules():
            if isinstance(m, NF4Linear):
                layers[n.replace(".base_layer", "") + ".weight"] = (_u8(m.weight.full_tensor()), m.dequantized(),
                                                                     m.state())
        for n, p in model.named_parameters():
            if quant == "none" and ".layers." in n and n.endswith("proj.base_layer.weight"):
                layers[n.replace(".base_layer", "")] = (None, p.full_tensor().detach(), None)
        with torch.no_grad():
            got[case] = (layers, model(_ids()))
        if case == "dq":
            export_adapter(peft_model, os.path.join(out_root, case), path)
    return got if rank == 0 else None


@pytest.fixture(scope="module")
def built(packed, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("adapters"))
    return run_ranks(_rank, 2, packed, out, timeout=300)[0], out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["dq", "bf16_storage"])
def test_double_quantized_nf4_is_trained_as_stored(packed, built, case):
    from model.stored import read_header

    got, _ = built
    ref = _bnb_weights(packed[case])
    layers = got[case][0]
    assert sorted(layers) == sorted(ref) and len(ref) == 14, (sorted(layers)[:3], len(ref))
    for name, (codes, deq, _) in layers.items():
        assert torch.equal(codes, _u8(ref[name][0])), f"{name}: gathered codes vs the upload's"
        assert torch.equal(deq, ref[name][1]), f"{name}: dequantized vs bitsandbytes' of transformers' Linear4bit"
    stored = {d for f in os.listdir(packed[case]) if f.endswith(".safetensors")
              for n, (d, *_) in read_header(os.path.join(packed[case], f))[0].items() if n in ref}
    assert stored == {torch.uint8 if case == "dq" else torch.bfloat16}, f"{case}: codes stored as {stored}"


@pytest.mark.timeout(400)
def test_peft_on_transformers_4bit_model_computes_our_logits_and_the_merge_loads_alone(packed, built, tmp_path):
    from peft import PeftModel

    from model.merged import merge

    got, root = built
    ours = got["dq"][1]
    adapter = os.path.join(root, "dq")
    hf = _hf(packed["dq"])
    assert _rel(_logits(hf), ours) > 1e-3, "the adapter must move the logits"
    rel = _rel(_logits(PeftModel.from_pretrained(hf, adapter)), ours)
    print(f"peft on transformers' 4-bit model vs ours: {rel:.2e}")
    assert rel < 1e-5, f"peft on the 4-bit model vs ours: relative norm {rel:.2e}"
    merge(packed["dq"], adapter, str(tmp_path / "merged"), quant="nf4", dtype=torch.float32)
    with open(tmp_path / "merged" / "config.json") as f:
        assert "quantization_config" not in json.load(f), "the merged weights are float"
    merged = _hf(str(tmp_path / "merged"))
    assert not any(hasattr(p, "quant_state") for p in merged.parameters()), "transformers loaded it as float"
    rel = _rel(_logits(merged), ours)
    print(f"merged 4-bit base vs ours: {rel:.2e}")
    assert rel < 1e-5, f"merged 4-bit base vs ours: relative norm {rel:.2e}"


@pytest.mark.timeout(400)
def test_fp32_scales_are_nested_as_bitsandbytes_would(packed, built):
    from bitsandbytes.functional import QuantState, dequantize_4bit, quantize_blockwise

    from model.load import CheckpointReader

    got, _ = built
    ref = _bnb_weights(packed["plain"])
    reader = CheckpointReader(packed["plain"])
    for name, (codes, deq, _) in got["plain"][0].items():
        assert torch.equal(codes, _u8(ref[name][0])), f"{name}: codes vs the upload's"
        absmax = reader.get_raw(f"{name}.absmax")
        assert absmax.dtype == torch.float32, f"{name}: the upload's scales are fp32 ({absmax.dtype})"
        offset = absmax.double().mean().float()
        qabsmax, state2 = quantize_blockwise(absmax - offset, blocksize=256)
        st = QuantState(absmax=qabsmax, shape=deq.shape, dtype=torch.float32, blocksize=64, quant_type="nf4",
                        code=reader.get_raw(f"{name}.quant_map"), offset=offset, state2=state2)
        assert torch.equal(deq, dequantize_4bit(ref[name][0], st)), f"{name}: the upload's codes, scales nested"
        assert 0 < _rel(deq, ref[name][1]) < 1e-2, f"{name}: {_rel(deq, ref[name][1]):.2e} from transformers'"
    reader.close()


@pytest.mark.timeout(400)
def test_quant_none_and_fp4_train_on_the_dequantized_weights(packed, built):
    from model.load import CheckpointReader, from_pretrained

    got, _ = built
    ref = _bnb_weights(packed["dq"])
    for name, (_, w, _) in got["none"][0].items():
        assert torch.equal(w, ref[name][1].view(w.shape)), f"{name}: FSDP2's rows vs bitsandbytes' dequantization"
    assert len(got["none"][0]) == 14
    fp4 = _bnb_weights(packed["fp4"])
    params = dict(from_pretrained(packed["fp4"]).named_parameters())
    reader = CheckpointReader(packed["fp4"])
    for name, (_, w) in fp4.items():
        assert torch.equal(params[name], w.view(params[name].shape)), f"fp4 {name}"
        flat = w.reshape(-1)
        assert torch.equal(reader.get_rows(name, 1, 3), w[1:3]) and torch.equal(
            reader.get_flat(name, 64, 200), flat[64:200]) and torch.equal(
            reader.get_flat(name, 5, 77), flat[5:77]), f"fp4 {name}: rows and ranges"
    assert not any(".absmax" in n or "quant" in n for n in reader.where), "companions are no weights"
    reader.close()


@pytest.mark.timeout(400)
def test_projections_stored_in_float_are_quantized_as_a_float_checkpoints(packed, built):
    from bitsandbytes.functional import dequantize_4bit

    from model.load import CheckpointReader, read_args
    from model.load_checks import check_config_shapes
    from tests.helpers import bnb_nf4

    got, _ = built
    reader = CheckpointReader(packed["skip"])
    floats = sorted(n for n in got["skip"][0] if n not in reader.packed)
    assert floats == [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)], floats
    for name in floats:
        packed_w, st = bnb_nf4(reader.get(name))
        assert torch.equal(got["skip"][0][name][1], dequantize_4bit(packed_w, st)), name
    reader.close()
    note = check_config_shapes(packed["skip"], read_args(packed["skip"]), "nf4")
    assert "2 block projections stored unquantized" in note and "--quant none keeps them" in note, note
    assert "dequantized" in check_config_shapes(packed["skip"], read_args(packed["skip"]), "none")


@pytest.mark.timeout(120)
def test_plan_refuses_what_the_run_refuses(packed, capsys):
    """`--plan` reads config.json alone: an fp4 upload under --quant nf4 (the default) is refused there as the run
    refuses it (until 2026-12-06 the plan said it fit); under --quant none it plans."""
    import train

    flags = ["--plan", "--model", packed["fp4"], "--max-len", "1024", "--gpu-mem", "80", "--world-size", "1"]
    with pytest.raises(ValueError, match=r"--quant nf4: .*fp4 in blocks of 64.*pass --quant none"):
        train.main(flags)
    train.main([*flags, "--quant", "none"])
    assert "fits" in capsys.readouterr().out


def test_a_name_with_the_marker_twice_is_a_corrupt_checkpoint_not_a_traceback():
    """A tensor name holding ".quant_state.bitsandbytes__" twice (no upload has one; a hand-made file might) is split at
    the last: the weight it names is missing, said as any missing one is (it was a ValueError from unpacking)."""
    import json

    from model.prequant import index
    from model.stored import CorruptCheckpointError

    name = "w.quant_state.bitsandbytes__nf4.quant_state.bitsandbytes__nf4"
    state = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2, 64]}).encode()
    with pytest.raises(CorruptCheckpointError, match=r"the 4-bit weight 'w.quant_state.bitsandbytes__nf4' lacks"):
        index({name: (torch.uint8, (len(state),), 0, len(state))}, lambda n: state)


@pytest.mark.timeout(300)
def test_demo_compare_keeps_the_uploads_4bit_layers(packed):
    """`python -m data.demo_compare` rounds the transformers base's block Linear weights to the NF4 training used; on
    a 4-bit upload's model its Linear4bit layers are that already. Until 2026-12-06 their packed codes were quantized
    as if they were weights (the base and tuned answers garbage); the float-stored projections are rounded as a float
    checkpoint's (bitsandbytes' primitives)."""
    from bitsandbytes.functional import dequantize_4bit

    from data.demo_compare import nf4_round_trip
    from tests.helpers import bnb_nf4

    hf, float_hf = _hf(packed["skip"]), _hf(packed["float"])
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    nf4_round_trip(hf)
    floats = dict(float_hf.named_parameters())
    n4 = 0
    for n, p in hf.named_parameters():
        if hasattr(p, "quant_state"):
            n4 += 1
            assert torch.equal(p, before[n]), f"{n}: a 4-bit layer's codes changed"
        elif n.endswith("down_proj.weight"):
            assert torch.equal(p, dequantize_4bit(*bnb_nf4(floats[n]))), f"{n}: not training's NF4 of it"
        else:
            assert torch.equal(p, before[n]), n
    assert n4 == 12, n4   # (2 blocks × 6: down_proj kept float)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_demo_compare_computes_a_bf16_upload_as_training_does(packed, tmp_path, quant):
    """`python -m data.demo_compare` on a run trained on an upload as real ones are (quantized from bf16, fp32 block
    scales, bnb_4bit_compute_dtype bf16, its other tensors stored bf16), in eval mode as it generates: the transformers
    model's logits are training's (our decoder on that upload, LoRA off; pinned to transformers' and bitsandbytes'
    own weights above). Until 2026-12-06 the demo kept transformers' 4-bit model as loaded: bf16 compute, bf16 float
    tensors though float32 was asked for, bitsandbytes' CPU inference kernel with bf16 scales, and under nf4 the
    un-nested scales training does not use (logits 5e-3 off)."""
    from transformers import AutoModelForCausalLM

    from data.demo_compare import as_trained, nf4_round_trip
    from model.stored import read_header
    from parallel.parallelize import BuildOptions, build_model
    from tests.helpers import bnb_checkpoint

    path = bnb_checkpoint(packed["float"], tmp_path / "bf16", dtype=torch.bfloat16, bnb_4bit_quant_type="nf4",
                          bnb_4bit_compute_dtype=torch.bfloat16)
    stored = {d for f in os.listdir(path) if f.endswith(".safetensors")
              for n, (d, *_) in read_header(os.path.join(path, f))[0].items() if n.endswith("norm.weight")}
    assert stored == {torch.bfloat16}, stored
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)   # (as compare() loads it)
    if quant == "nf4":
        nf4_round_trip(hf)
    as_trained(hf, quant)
    with torch.no_grad():
        theirs = hf.eval()(_ids()).logits
        ours = build_model(BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA), device="cpu")[0](_ids())
    assert theirs.dtype == torch.float32, theirs.dtype
    assert _rel(theirs, ours) < 1e-5, f"demo's base vs training's: relative norm {_rel(theirs, ours):.2e}"


@pytest.mark.timeout(300)
def test_refusals_name_the_fix_before_any_weight(assets, packed, tmp_path):
    from safetensors.torch import load_file, save_file

    from model.load import CheckpointReader
    from model.stored import CorruptCheckpointError
    from tests.helpers import startup_error, train_argv

    said = startup_error(train_argv({**assets, "model": packed["fp4"]}, str(tmp_path / "run"), "--quant", "nf4"))
    assert "fp4 in blocks of 64" in said and "--quant none" in said, said
    assert not (tmp_path / "run").exists(), "a run directory was made before the check"
    for cut in ("companion", "short"):
        bad = shutil.copytree(packed["dq"], tmp_path / cut)
        fn = next(f for f in sorted(os.listdir(bad)) if f.endswith(".safetensors") and any(
            k.endswith("proj.weight") for k in load_file(os.path.join(bad, f))))
        ts = load_file(os.path.join(bad, fn))
        name = next(k for k in sorted(ts) if k.endswith("proj.weight"))
        if cut == "short":
            ts[name] = ts[name][:-1]
        index = os.path.join(bad, "model.safetensors.index.json")
        with open(index) as f:
            wmap = json.load(f)
        if cut == "companion":   # (where the index has the weight's absmax, the file it names lacks it)
            absmax = name + ".absmax"
            ts.pop(absmax, None)
            wmap["weight_map"].pop(absmax)
            with open(index, "w") as f:
                json.dump(wmap, f)
        save_file(ts, os.path.join(bad, fn), metadata={"format": "pt"})
        want = f"{name}.*lacks {name}.absmax" if cut == "companion" else f"{name}: .* bytes of 4-bit codes"
        with pytest.raises(CorruptCheckpointError, match=want):
            CheckpointReader(str(bad))
        said = startup_error(train_argv({**assets, "model": str(bad)}, str(tmp_path / f"run_{cut}"), "--quant", "nf4"))
        assert "re-download" in said and name in said, said


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, comp, cut", [("dq", "nested_absmax", 0), ("dq", "absmax", -3), ("plain", "absmax", -3),
                                             ("dq", "quant_map", 15), ("dq", "nested_quant_map", 100),
                                             ("dq", "quant_state.bitsandbytes__nf4", "blocksize")])
def test_companions_of_another_length_are_refused_naming_them(assets, packed, tmp_path, case, comp, cut):
    """A hand-edited or cut companion tensor, said at start-up: bitsandbytes' kernels read as many scales and code book
    entries as the quant state says (until 2026-12-06 an empty nested_absmax was a segfault on CPU, a short absmax or
    code book weights dequantized from the bytes beyond it, unsaid)."""
    from safetensors.torch import load_file, save_file

    from model.load import CheckpointReader
    from model.load_checks import check_weight_headers
    from model.stored import CorruptCheckpointError
    from tests.helpers import startup_error, train_argv

    bad = shutil.copytree(packed[case], tmp_path / "bad")
    name = f"model.layers.1.self_attn.q_proj.weight.{comp}"
    with open(bad / "model.safetensors.index.json") as f:
        fn = os.path.join(bad, json.load(f)["weight_map"][name])
    ts = load_file(fn)
    if cut == "blocksize":   # (a ZeroDivisionError under --quant none)
        state = {**json.loads(bytes(ts[name].tolist())), "blocksize": 0}
        ts[name] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    else:
        ts[name] = ts[name][:cut]
    save_file(ts, fn, metadata={"format": "pt"})
    for read in (lambda: CheckpointReader(str(bad)), lambda: check_weight_headers(str(bad), "none")):
        with pytest.raises(CorruptCheckpointError, match=f"{name}: .*(needs|blocks of 1 or more).*re-download"):
            read()
    said = startup_error(train_argv({**assets, "model": str(bad)}, str(tmp_path / "run"), "--quant", "nf4"))
    assert name in said and "re-download" in said, said
    assert not (tmp_path / "run").exists(), "a run directory was made before the check"


@pytest.mark.timeout(300)
def test_hub_upload_of_another_4bit_type_is_refused_from_its_config(assets, packed, tmp_path, monkeypatch):
    """A Hub id of an fp4 upload under --quant nf4: refused from the config.json fetched first (its
    bnb_4bit_quant_type), before the weights are downloaded (until 2026-12-06: once they were, gigabytes later)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from tests.helpers import startup_error, train_argv

    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):   # (as test_hub's)
        calls.append(allow_patterns)
        snap = tmp_path / "cache" / f"models--org--{repo_id.split('/')[1]}" / "snapshots" / ("c" * 40)
        for f in filter_repo_objects(os.listdir(packed["fp4"]), allow_patterns=allow_patterns,
                                     ignore_patterns=ignore_patterns):
            snap.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(packed["fp4"], f), snap / f)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    argv = train_argv(assets, str(tmp_path / "run"), "--quant", "nf4")
    argv[argv.index(assets["model"])] = "org/tiny-bnb-4bit"
    said = startup_error(argv)
    assert calls == [["config.json"]], f"fetched {calls} before the refusal"
    assert "--model org/tiny-bnb-4bit" in said and "fp4 in blocks of 64" in said and "--quant none" in said, said
    assert not (tmp_path / "run").exists(), "a run directory was made before the check"
    argv[argv.index("nf4")] = "none"   # (what it names: taken, its weights fetched once the layout passed)
    with pytest.raises(AssertionError, match="a weight was about to be read"):
        startup_error(argv)
    assert calls[1:] and "*.safetensors" in calls[-1], calls


@pytest.mark.timeout(300)
def test_merge_into_an_fp4_base_as_nf4_is_refused_before_writing(packed, built, tmp_path):
    """`python -m model.merge --quant nf4` on an fp4 upload (no NF4 base to fold into, as training has none): refused
    before --out is made (until 2026-12-06 after two of its files were written into the staging folder)."""
    from model.merged import merge

    _, root = built
    with pytest.raises(ValueError, match=r"fp4 in blocks of 64.*: merge with --quant none \(an adapter of this base "
                                         "trained on its weights dequantized"):
        merge(packed["fp4"], os.path.join(root, "dq"), str(tmp_path / "merged"), quant="nf4")
    assert not (tmp_path / "merged").exists(), os.listdir(tmp_path / "merged")
