"""`python -m model.merge` streams: its peak host memory is one base shard plus the adapter, not the model.

Pins (Linux; a random float32 Llama checkpoint of ~430 MB in ~48 MB safetensors files with an index,
written by test_load_memory's `write_checkpoint`; a random r 8 adapter on every projection): the merge
CLI run as a subprocess with --quant nf4 --dtype fp32 (the widest output, so holding the merged model
would cost its full size) peaks (the child's ru_maxrss from wait4, i.e. its VmHWM) below
  the peak of the same command on a tiny checkpoint (imports, interpreter)
  + the largest base file + 4 × the largest tensor (a float32 copy, bitsandbytes' quantize and
  dequantize temporaries) + the adapter + 32 MB,
and below that baseline + 60% of the checkpoint. The output holds every base tensor, one file per base
file, listed in model.safetensors.index.json, and an adapted weight equals dequant(NF4(W)) + (alpha/r)·B@A.
(That the merged model equals peft's merge_and_unload is pinned in test_export.py.)

Run: .venv/bin/python -m pytest -q tests/test_merge_memory.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_load_memory import write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="wait4 ru_maxrss in KB")


def _adapter(path, base, r=8, alpha=16):
    """A random PEFT-format LoRA adapter for every projection of `base`; returns its size in bytes."""
    from model.load import CheckpointReader

    os.makedirs(path, exist_ok=True)
    reader = CheckpointReader(str(base))
    shapes = {n: reader.shape(n) for n in reader.where if ".self_attn." in n or ".mlp." in n}
    reader.close()
    g = torch.Generator().manual_seed(0)
    sd = {}
    for n in shapes:
        out_f, in_f = shapes[n]
        stem = "base_model.model." + n.removesuffix(".weight")
        sd[stem + ".lora_A.weight"] = torch.randn(r, in_f, generator=g) * 0.02
        sd[stem + ".lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.02
    save_file(sd, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"]}, f)
    return sum(t.numel() * 4 for t in sd.values()), sd


def _merge_peak(base, adapter, out):
    """Run the merge CLI; return the child's own peak RSS in bytes (wait4, not RUSAGE_CHILDREN)."""
    p = subprocess.Popen([sys.executable, "-m", "model.merge", "--model", base, "--adapter", adapter, "--out", out,
                          "--quant", "nf4", "--dtype", "fp32"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = p.stdout.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0, log[-3000:]
    return usage.ru_maxrss * 1024


@pytest.mark.timeout(300)
def test_merge_peak_rss_is_one_shard(tmp_path):
    from bitsandbytes.functional import dequantize_4bit

    from tests.helpers import bnb_nf4

    total, largest, _ = write_checkpoint(tmp_path / "big", hidden=1024, layers=8, inter=2816, vocab=8192)
    write_checkpoint(tmp_path / "tiny", hidden=64, layers=2, inter=128, vocab=256, heads=4, kv_heads=2)
    big_bytes, sd = _adapter(tmp_path / "ab", tmp_path / "big")
    _adapter(tmp_path / "at", tmp_path / "tiny")
    files = [os.path.join(tmp_path / "big", f) for f in os.listdir(tmp_path / "big") if f.endswith(".safetensors")]
    largest_file = max(os.path.getsize(f) for f in files)

    base = _merge_peak(str(tmp_path / "tiny"), str(tmp_path / "at"), str(tmp_path / "tiny_out"))
    peak = _merge_peak(str(tmp_path / "big"), str(tmp_path / "ab"), str(tmp_path / "out"))
    bound = base + largest_file + 4 * largest + big_bytes + 32 * MB
    msg = (f"merge peak RSS {peak / MB:.0f} MB (imports baseline {base / MB:.0f} MB), bound {bound / MB:.0f} MB; "
           f"checkpoint {total / MB:.0f} MB in {len(files)} files (largest {largest_file / MB:.0f} MB), "
           f"largest tensor {largest / MB:.0f} MB, adapter {big_bytes / MB:.0f} MB")
    print(msg)
    assert peak < bound, msg
    assert peak < base + 0.6 * total, msg

    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    with open(tmp_path / "big" / "model.safetensors.index.json") as f:
        assert wm == json.load(f)["weight_map"], "one output file per base file, same names"
    name = "model.layers.3.mlp.down_proj.weight"
    w = load_file(tmp_path / "big" / wm[name])[name]
    packed, st = bnb_nf4(w)
    stem = "base_model.model.model.layers.3.mlp.down_proj"
    want = dequantize_4bit(packed, st) + 2.0 * sd[stem + ".lora_B.weight"] @ sd[stem + ".lora_A.weight"]
    torch.testing.assert_close(load_file(tmp_path / "out" / wm[name])[name], want, rtol=1e-6, atol=1e-6)
