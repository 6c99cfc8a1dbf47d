"""Broken checkpoints fail with a message that names the file and the fix, not a library traceback.

Pins (tiny Qwen2 checkpoints made by transformers, then damaged here):
- a config.json that is not valid JSON: `read_args` raises a ValueError naming the file, the line and
  the column (the JSON parser alone names neither the file nor what to do); one with a required key
  missing names the key and the file; one that holds no JSON object (a list, a string, null) names the file and
  the fix, from train.py's start-up check and `read_args`;
- a truncated safetensors file (cut mid-tensor, or cut inside its header): `CheckpointReader` raises
  a ValueError naming the file and saying it is truncated or corrupt and to re-download it, before any
  tensor is read; the reader's tensors otherwise equal safetensors' own `safe_open` (whole, dim-0 rows,
  flat ranges);
- tensor shapes that disagree with config.json (intermediate_size changed): `from_pretrained` and
  `build_model` (nf4 and none) raise a ValueError naming the tensor, its file and both shapes, from the
  safetensors headers, before the weights are loaded;
- `train.py` (1 process) on the truncated checkpoint prints `error: ...` naming the file and exits 2;
- a checkpoint quantized otherwise than in bitsandbytes 4-bit (AWQ, GPTQ, bnb 8-bit; bnb 4-bit is read:
  tests/test_prequant.py): `read_args` and train.py's start-up name its quantization_config and the fix before any
  weight is read; an FP8 tensor's dtype error says the same.

Run: .venv/bin/python -m pytest -q tests/test_load_errors.py
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _copy(ckpt, tmp_path):
    dst = str(tmp_path / "model")
    shutil.copytree(ckpt, dst)
    return dst


def test_broken_config_json_names_file_and_line(ckpt, tmp_path):
    from model.load import read_args

    path = _copy(ckpt, tmp_path)
    fn = os.path.join(path, "config.json")
    lines = json.dumps(json.load(open(fn)), indent=1).splitlines()
    lines.insert(4, '  "oops": ,')                       # line 5 is bad
    open(fn, "w").write("\n".join(lines))
    with pytest.raises(ValueError) as e:
        read_args(path)
    msg = str(e.value)
    assert fn in msg and "line 5" in msg and "column" in msg and "re-download" in msg, msg

    cfg = json.loads("\n".join(lines[:4] + lines[5:]))
    del cfg["hidden_size"]
    open(fn, "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size") as e:
        read_args(path)
    assert fn in str(e.value), str(e.value)
    for key, v in (("num_attention_heads", 0), ("num_key_value_heads", -2), ("intermediate_size", 1.5)):
        open(fn, "w").write(json.dumps({**json.loads("\n".join(lines[:4] + lines[5:])), key: v}))
        with pytest.raises(ValueError, match=rf"config.json: {key} {v} must be a positive whole number"):
            read_args(path)   # (heads 0 was a ZeroDivisionError traceback)


@pytest.mark.parametrize("text", ["[1, 2]", '"qwen2"', "null"])
def test_a_config_json_that_is_no_object_names_file(ckpt, tmp_path, text):
    """A config.json that parses as JSON but holds no object (a list, a string, null) fails as a broken file, naming it
    and the fix, from train.py's start-up check (check_weight_headers) and from read_args alike. Until 2026-12-07 it
    was an AttributeError traceback ('list' object has no attribute 'get')."""
    from model.load import read_args
    from model.load_checks import check_weight_headers

    path = _copy(ckpt, tmp_path)
    fn = os.path.join(path, "config.json")
    open(fn, "w").write(text)
    for read in (lambda: check_weight_headers(path, "nf4"), lambda: read_args(path)):
        with pytest.raises(ValueError, match="holds no JSON object") as e:
            read()
        assert fn in str(e.value) and "re-download" in str(e.value), str(e.value)


def test_reader_reads_what_safetensors_reads(ckpt):
    from safetensors import safe_open

    from model.load import CheckpointReader

    r = CheckpointReader(ckpt)
    assert len(r.where) > 10
    for name, fn in r.where.items():
        with safe_open(fn, "pt") as f:
            ref = f.get_tensor(name)
        assert r.shape(name) == tuple(ref.shape), name
        assert torch.equal(r.get(name), ref), name
        rows = ref.shape[0]
        for a, b in ((0, rows), (1, max(1, rows // 3)), (rows // 2, rows), (rows, rows)):
            assert torch.equal(r.get_rows(name, a, b), ref[a:b]), (name, a, b)
        n = ref.numel()
        assert torch.equal(r.get_flat(name, n // 5, n - 3), ref.reshape(-1)[n // 5: n - 3]), name
    r.close()


def _largest_file(path):
    return max((os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")),
               key=os.path.getsize)


@pytest.mark.parametrize("cut", ["mid-tensor", "header"])
def test_truncated_safetensors_names_path(ckpt, tmp_path, cut):
    from model.load import CheckpointReader

    path = _copy(ckpt, tmp_path)
    fn = _largest_file(path)
    size = os.path.getsize(fn)
    with open(fn, "r+b") as f:
        f.truncate(size - 100 if cut == "mid-tensor" else 20)
    with pytest.raises(ValueError) as e:
        CheckpointReader(path)
    msg = str(e.value)
    assert fn in msg and "truncated or corrupt" in msg and "re-download" in msg, msg


@pytest.mark.parametrize("damage", ["truncated", "lfs"])
def test_train_cli_reports_truncated_checkpoint(ckpt, tmp_path, damage):
    """A cut weight file, or a Git LFS pointer in its place (a clone without git-lfs; until 2026-12-04 a MemoryError
    traceback), is one error line at start-up: no run directory is made."""
    from tests.fixtures import make_text_jsonl, make_tokenizer

    path = str(tmp_path / "model")
    tiny_checkpoint(path, vocab=len(make_tokenizer(path)))   # a vocabulary that fits the tokenizer
    make_text_jsonl(tmp_path / "d.jsonl", 8)
    fn = _largest_file(path)
    if damage == "lfs":
        with open(fn, "w") as f:
            f.write(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 988097824\n")
    else:
        with open(fn, "r+b") as f:
            f.truncate(os.path.getsize(fn) - 100)
    res = subprocess.run([sys.executable, "train.py", "--model", path, "--data", str(tmp_path / "d.jsonl"),
                          "--out", str(tmp_path / "run"), "--steps", "1", "--global-batch", "1",
                          "--max-len", "32"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "error:" in res.stderr and fn in res.stderr, res.stderr[-3000:]
    assert ("truncated" if damage == "truncated" else "is a Git LFS pointer, not the weights") in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "run").exists(), "a run directory was made before the check"


def test_shape_mismatch_named_before_loading(ckpt, tmp_path):
    from model.load import from_pretrained
    from parallel.parallelize import BuildOptions, build_model

    path = _copy(ckpt, tmp_path)
    fn = os.path.join(path, "config.json")
    cfg = json.load(open(fn))
    cfg["intermediate_size"] = 128                       # the checkpoint's MLP is 64 wide
    json.dump(cfg, open(fn, "w"))
    for build in (lambda: from_pretrained(path),
                  lambda: build_model(BuildOptions(path, quant="nf4", lora_r=4), device="cpu"),
                  lambda: build_model(BuildOptions(path, quant="none", lora_r=4), device="cpu")):
        with pytest.raises(ValueError) as e:
            build()
        msg = str(e.value)
        assert "model.layers.0.mlp.gate_proj.weight" in msg and "[64, 48]" in msg and "[128, 48]" in msg, msg
        assert ".safetensors" in msg and "config.json" in msg, msg
    from model.load import read_args
    from model.load_checks import check_config_shapes  # train.py's check before the data (headers only)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight in .*safetensors: checkpoint "
                                         r"\[64, 48\], config.json implies \[128, 48\]"):
        check_config_shapes(path, read_args(path))
    json.dump({**cfg, "intermediate_size": 64, "num_hidden_layers": 3}, open(fn, "w"))
    with pytest.raises(ValueError, match=r"lacks 7 tensors its config.json implies \(model.layers.2"):
        check_config_shapes(path, read_args(path))
    json.dump({**cfg, "intermediate_size": 64, "num_hidden_layers": 1}, open(fn, "w"))   # fewer: allowed, and said
    assert check_config_shapes(path, read_args(path)) == (
        f"note: {path} holds the weights of 2 blocks and config.json's num_hidden_layers is 1: the run builds and "
        "trains the first 1 (as transformers loads it)")
    json.dump({**cfg, "intermediate_size": 64}, open(fn, "w"))
    assert check_config_shapes(path, read_args(path)) is None


def test_a_quantized_checkpoint_is_named_so_before_any_weight(assets, tmp_path):
    """A checkpoint quantized already otherwise than in bitsandbytes 4-bit (AWQ, GPTQ, bitsandbytes 8-bit; FP8 ones
    carry a quantization_config too) holds packed weights, not the float tensors config.json implies. Until 2026-12-06
    train.py said "lacks 14 tensors ... or the download is incomplete" of an AWQ one (FP8: a dtype this loader does
    not read); now config.json's quantization is named, with the fix, before any weight is read. (Its float weights
    are left here: config.json alone decides.)"""
    from safetensors.torch import save_file

    from model.load import read_args
    from model.stored import read_header
    from tests.helpers import startup_error, train_argv

    path = shutil.copytree(assets["model"], tmp_path / "quantized")
    with open(path / "config.json") as f:
        cfg = json.load(f)
    for q, said_as in (({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
                       ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
                       ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quant_method 'bitsandbytes' 8-bit"),
                       ({"quant_method": "bitsandbytes"},   # (until 2026-12-06 called 8-bit)
                        "quant_method 'bitsandbytes', neither load_in_4bit nor load_in_8bit")):
        with open(path / "config.json", "w") as f:
            json.dump({**cfg, "quantization_config": q}, f)
        fix = rf"quantized already \(quantization_config: {said_as}\).*pass the unquantized checkpoint"
        with pytest.raises(ValueError, match=fix):
            read_args(str(path))   # (--plan, the merge and the export read config.json here too)
        said = startup_error(train_argv({**assets, "model": str(path)}, str(tmp_path / "run")))
        assert said_as in said and "--quant nf4" in said and "bitsandbytes 4-bit" in said, said
        assert not (tmp_path / "run").exists(), "a run directory was made before the check"
    fp8 = str(tmp_path / "fp8.safetensors")   # an FP8 checkpoint's weights (a header check runs before config.json)
    save_file({"w": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, fp8)
    with pytest.raises(ValueError, match=r"dtype 'F8_E4M3', which this loader does not read .*a quantized checkpoint "
                                         r"\(FP8\?\): pass the unquantized one"):
        read_header(fp8)
