"""Sharded loading keeps each rank's memory near its own shard, never the whole model.

Pins (4 gloo ranks on CPU, FSDP2 over all four, Llama checkpoints written here as several
safetensors files with an index): while `build_model` runs, each rank's peak RSS increase (the
kernel's high-water mark VmHWM, reset through /proc/self/clear_refs right before the build; it
counts file-backed pages too, so mmap'ed checkpoint pages would show) stays
- quant none, 350 MB float32: below its shard (a quarter of the blocks, plus the frozen embeddings, final
  norm and lm_head, which every rank holds whole: parallel/fsdp.py) + the larger of a quarter of the
  largest block tensor (the rows of it this rank reads: the lean loader reads only its shard's byte
  range) and one root tensor + 12 MB, and below 60% of the model;
- quant nf4, 53 MB float32: below its shard + the larger of one root tensor and a quarter of the largest
  quantized weight read plus 4 × that (each rank quantizes only its own 64-blocks; bitsandbytes' CPU
  quantizer needs about 3× its input in temporaries) + 12 MB, and below 60% of the full float32 model.
Reading whole tensors (the loader before issue 14.4, `load_weights(lean=False)`) adds a whole
largest block tensor (33 MB, four times the root's) and fails the first bound (134 MB against 121 MB);
bench/load.py times both paths side by side.
A rank holding the whole checkpoint (or keeping every page it read mapped, as safetensors' default
mmap backend does until the file is closed) fails these bounds. Warm-up builds on a tiny checkpoint
run first, so code paths and pools touched for the first time are not counted, and the ranks fix
glibc's mmap threshold so freed tensors leave RSS at once (see `_measure_rank`).

Run: .venv/bin/python -m pytest -q tests/test_load_memory.py
"""

import ctypes
import gc
import json
import os
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tests.dist import run_ranks

MB = 1e6
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def write_checkpoint(path, *, hidden, layers, inter, vocab, heads=16, kv_heads=4, file_bytes=48 * MB):
    """A random float32 Llama checkpoint in ~file_bytes safetensors files + index; no transformers
    model is built (seconds instead of a minute). Returns (total bytes, largest block-Linear bytes,
    embedding (= lm_head) bytes)."""
    os.makedirs(path, exist_ok=True)
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    numel = {k: torch.Size(s).numel() for k, s in shapes.items()}
    # one random pool, each tensor a shifted slice of it: random enough, and fast to make
    pool = torch.empty(max(numel.values()) + 1024).uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(0))
    files, cur, where = [], {}, {}

    def flush():
        fn = f"model-{len(files) + 1:05d}.safetensors"
        files.append(fn)
        save_file(cur, os.path.join(path, fn), metadata={"format": "pt"})
        where.update(dict.fromkeys(cur, fn))
        cur.clear()

    for i, (k, s) in enumerate(shapes.items()):
        cur[k] = pool[i % 1024: i % 1024 + numel[k]].view(s).clone() if len(s) == 2 else torch.ones(s)
        if sum(v.numel() * 4 for v in cur.values()) > file_bytes:
            flush()
    if cur:
        flush()
    total = 4 * sum(numel.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": where}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
                       intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32"), f)
    linears = [n for k, n in numel.items() if ".self_attn." in k or ".mlp." in k]
    return total, 4 * max(linears), 4 * vocab * hidden


def _rss():
    """(current RSS, high-water mark since the last reset), bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _measure_rank(rank, world_size, cases, tiny):
    import torch.distributed as dist

    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, build_model

    libc = ctypes.CDLL("libc.so.6")
    # A fixed mmap threshold (M_MMAP_THRESHOLD = -3): every allocation over 64 KB is its own mapping
    # and goes back to the kernel when freed, so RSS follows what the loader holds rather than what
    # glibc's heap keeps of freed temporaries (which it caps at a few tensors, loader or not).
    assert libc.mallopt(-3, 64 * 1024) == 1
    mesh = ParallelDims(world_size).build_mesh("cpu").fsdp
    out = {}
    for quant, path in cases.items():
        build_model(BuildOptions(tiny, quant=quant, lora_r=4), fsdp_mesh=mesh, device="cpu")   # warm-up
        gc.collect()
        libc.malloc_trim(0)        # hand freed heap back, so the baseline holds no reusable slack
        dist.barrier()
        base, _ = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")           # reset VmHWM to the current RSS (Linux >= 4.0)
        t0 = time.perf_counter()
        model = build_model(BuildOptions(path, quant=quant, lora_r=4), fsdp_mesh=mesh, device="cpu")[0]
        _, peak = _rss()
        seconds = time.perf_counter() - t0
        blocks = {id(p) for p in model.model.layers.parameters()}
        shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if id(p) in blocks)
        root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in blocks)
        assert not [n for n, p in model.named_parameters() if id(p) not in blocks and hasattr(p, "to_local")]
        out[quant] = dict(peak=peak - base, shard=shard, root=root, seconds=seconds)
        del model
        gc.collect()
        libc.malloc_trim(0)
    return out


@pytest.mark.timeout(300)
def test_peak_rss_per_rank_is_shard_plus_one_tensor(tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    big, big_linear, big_root = write_checkpoint(tmp_path / "none", hidden=1024, layers=3, inter=8192, vocab=2048)
    small, small_linear, small_root = write_checkpoint(tmp_path / "nf4", hidden=512, layers=4, inter=1408,
                                                       vocab=2048)
    write_checkpoint(tmp_path / "tiny", hidden=64, layers=2, inter=128, vocab=256, heads=4, kv_heads=2)
    cases = {"none": str(tmp_path / "none"), "nf4": str(tmp_path / "nf4")}
    res = run_ranks(_measure_rank, 4, cases, str(tmp_path / "tiny"), timeout=280)

    full = {"none": big, "nf4": small}
    root = {"none": 2 * big_root, "nf4": 2 * small_root}   # + the final norm: the frozen root, whole on every rank
    # none: this rank's rows of the block tensor being read (copied into the shard), or a whole root tensor
    # nf4: those rows + bitsandbytes' quantization temporaries for this rank's blocks (about 3× its input)
    transient = {"none": max(big_linear / 4, big_root), "nf4": max(small_linear / 4 * 5, small_root)}
    for quant in cases:
        for rank, r in enumerate(res):
            peak, shard = r[quant]["peak"], r[quant]["shard"] + r[quant]["root"]
            bound = shard + transient[quant] + 12 * MB   # + Python objects, quant states, metadata
            msg = (f"{quant}, rank {rank}: peak RSS +{peak / MB:.0f} MB, shard {shard / MB:.0f} MB, bound "
                   f"{bound / MB:.0f} MB, full model {full[quant] / MB:.0f} MB, built in {r[quant]['seconds']:.1f}s")
            print(msg)
            assert r[quant]["root"] <= root[quant] + 1 * MB, msg
            assert r[quant]["shard"] <= (full[quant] - root[quant]) / 4 + 1 * MB, msg   # the blocks: a quarter
            assert peak < bound, msg
            assert peak < 0.6 * full[quant], msg
