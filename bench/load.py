"""Sharded weight loading on --ranks CPU ranks (4): the whole-tensor path vs the lean path, side by side; and the same
model's 4-bit upload (saved by transformers + bitsandbytes, as the -bnb-4bit repos are: model/prequant.py) against the
lean NF4 load of its float checkpoint.

Whole (load_weights(lean=False), the loader before issue 14.4): every rank reads every whole tensor
and, for nf4, quantizes every whole weight, then keeps its shard. Lean (the default): each rank
reads only the byte range of its shard's rows and quantizes only its own 64-blocks; the fp32 absmax
is all-gathered (4 bytes per 64 weights). Both fill the same FSDP2-sharded model (built once per rank,
gloo, one thread per rank) from the same random float32 Llama checkpoint (350 MB, 48 MB files, made
by tests/test_load_memory.write_checkpoint; the frozen embeddings and lm_head, whole on every rank, are
read whole by both paths); the two paths alternate `--reps` times and the fastest of
each is kept. Time = the slowest rank's wall time between two barriers; peak = the largest per-rank
VmHWM rise during the load (reset through /proc/self/clear_refs). The 2-core machine is shared, so
wall time is noisy; CPU time (user+sys, summed over ranks) is printed next to it. The 4-bit row: lean only (each rank
reads its blocks' codes as stored, nothing to quantize), the files' size on disk beside the float32 checkpoint's.

Run: .venv/bin/python bench/load.py [--reps 2] [--ranks 4]
"""

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (model.bnb: bitsandbytes without its torch.compile wrappers, before transformers imports it for bnb_checkpoint's
# 4-bit upload: ~1 s of a core less)
import model.bnb  # noqa: E402,F401
from tests.dist import run_ranks  # noqa: E402
from tests.helpers import bnb_checkpoint  # noqa: E402
from tests.test_load_memory import _rss, write_checkpoint  # noqa: E402


def _rank(rank, world_size, path, reps, upload):
    import torch.distributed as dist

    from model.load import CheckpointReader
    from model.weights import load_weights
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, build_model

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)   # freed tensors leave RSS at once (see tests/test_load_memory.py)
    mesh = ParallelDims(world_size).build_mesh("cpu").fsdp
    out = {}
    for quant, src, ways in (("none", path, (False, True)), ("nf4", path, (False, True)), ("4bit", upload, (True,))):
        model, _ = build_model(BuildOptions(src, quant="none" if quant == "none" else "nf4", lora_r=4),
                               fsdp_mesh=mesh, device="cpu")
        reader = CheckpointReader(src)
        best = {}
        for _ in range(reps):
            for lean in ways:
                gc.collect()
                libc.malloc_trim(0)
                dist.barrier()
                base, _ = _rss()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                c0, t0 = time.process_time(), time.perf_counter()
                load_weights(model, reader, torch.device("cpu"), lean=lean)
                dist.barrier()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                peak = _rss()[1] - base
                prev = best.get(lean)
                if prev is None or wall < prev[0]:
                    best[lean] = (wall, cpu, peak)
        reader.close()
        out[quant] = best
        del model
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions; the fastest of each is kept")
    p.add_argument("--small", action="store_true", help="a tiny checkpoint (tests/test_bench_smoke.py)")
    p.add_argument("--ranks", type=int, default=4, help="CPU ranks (FSDP2 over all of them)")
    args = p.parse_args(argv)
    size = dict(hidden=128, layers=2, inter=256, vocab=1024) if args.small else \
        dict(hidden=1024, layers=3, inter=8192, vocab=2048)   # block linears 4x the root's whole-read tensors
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(os.path.join(tmp, "float"), **size)[0]
        upload = bnb_checkpoint(os.path.join(tmp, "float"), os.path.join(tmp, "4bit"), max_shard_size="48MB",
                                bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        packed = sum(os.path.getsize(os.path.join(upload, f)) for f in os.listdir(upload) if f.endswith(".safetensors"))
        res = run_ranks(_rank, args.ranks, os.path.join(tmp, "float"), args.reps, upload, timeout=1800, pg_timeout=600,
                        start="spawn")
    print(f"load of a {total / 1e6:.0f} MB float32 checkpoint on {args.ranks} CPU ranks (FSDP2 over "
          f"{args.ranks}), best of {args.reps}")
    print(f"{'quant':<6}{'whole s':>9}{'lean s':>8}{'ratio':>7}{'whole cpu s':>13}{'lean cpu s':>12}"
          f"{'whole peak MB':>15}{'lean peak MB':>14}")
    for quant in ("none", "nf4"):
        w = [max(r[quant][False][0] for r in res), sum(r[quant][False][1] for r in res),
             max(r[quant][False][2] for r in res)]
        n = [max(r[quant][True][0] for r in res), sum(r[quant][True][1] for r in res),
             max(r[quant][True][2] for r in res)]
        print(f"{quant:<6}{w[0]:9.2f}{n[0]:8.2f}{n[0] / w[0]:7.2f}{w[1]:13.2f}{n[1]:12.2f}"
              f"{w[2] / 1e6:15.0f}{n[2] / 1e6:14.0f}")
    nf4, up = ([max(r[k][True][0] for r in res), sum(r[k][True][1] for r in res), max(r[k][True][2] for r in res)]
               for k in ("nf4", "4bit"))
    print(f"the same model's 4-bit upload ({packed / 1e6:.0f} MB on disk, {packed / total:.2f} of the float32 files), "
          f"--quant nf4, lean:")
    print(f"4bit {up[0]:.2f} s (float32 checkpoint: {nf4[0]:.2f} s, ratio {up[0] / nf4[0]:.2f}), cpu {up[1]:.2f} s "
          f"({nf4[1]:.2f}), peak {up[2] / 1e6:.0f} MB ({nf4[2] / 1e6:.0f})")


if __name__ == "__main__":
    main()
