"""Context-parallel attention speed against the single-process kernel, measured side by side.

Times forward + backward of causal attention over one sequence of --seq tokens:
- t_1: `parallel.kernels.attention` in one process (one thread on CPU, one GPU on CUDA);
- t_P: the same sequence sharded over --nproc ranks for each CP implementation (ulysses, ring, and
  the ulysses × ring hybrid when --nproc is 4 or more and even), one process per rank (gloo on CPU with
  one thread each, nccl with one GPU each on CUDA).
Prints ratio = t_P / (t_1 / P): 1.0 is perfect scaling, above it is communication and imbalance. Each
time is the best of --iters after --warmup (the slowest rank's time on each iteration). The same ratio
of CPU time is printed too: on a machine shared with other jobs the wall clock measures the sharing.

`--blocks N` instead compares, in one process, the backward of rows longer than N in N-token blocks
(kernels.BACKWARD_BLOCK, 65,536 by default) with one kernel call over the whole row: time and, on CUDA, the
peak allocated memory of each, and their ratios. `--tiles N` compares `kernels.attention` (its default blocks)
with the kernel calls of --tiled-attn (parallel/tiled_attention.py: N-row query tiles, each a causal diagonal
block and N-token key blocks merged by log-sum-exp; the backward per tile with the global out/lse): the attention
part of that flag's cost, without its projections. `--docs N` packs the sequence with documents of about N tokens
(uniform in [N/2, 3N/2), seeded) and times ring attention with each of `--mask-tiles` (masks.MASK_TILE; 0: a block's
span pairs masked whole, each one call, as ring blocks were before 2026-12-01), side by side, ratios to the 0 row.

Run: .venv/bin/python bench/attention.py                      # P=2, S=8192, 4 heads, head_dim 64, fp32
     .venv/bin/python bench/attention.py --nproc 4 --seq 16384 # adds the hybrid (2 x 2)
     python3 bench/attention.py --blocks 65536 --seq 131072 --heads 28 --kv-heads 4 --head-dim 128 --dtype bfloat16
     python3 bench/attention.py --tiles 16384 --seq 131072 --heads 28 --kv-heads 4 --head-dim 128 --dtype bfloat16
     .venv/bin/python bench/attention.py --docs 2000 --seq 65536 --mask-tiles 4096,0   # packed rows on the ring
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import kernel_choice, kernels, masks  # noqa: E402
from parallel.cp import cp_attention, shard_sequence  # noqa: E402
from parallel.mesh import ParallelDims  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


def device_for(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(args, device):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = lambda h: (args.batch, args.seq, h, args.head_dim)
    q = torch.randn(shape(args.heads), generator=g)
    k, v = (torch.randn(shape(args.kv_heads), generator=g) for _ in range(2))
    dout = torch.randn(shape(args.heads), generator=g)
    return [x.to(device, dtype) for x in (q, k, v, dout)]


def time_step(fn, inputs, dout, device, iters, warmup, barrier=None):
    """Best-of-iters (wall, cpu) seconds for out = fn(*inputs); out.backward(dout).

    cpu is this process's CPU time (all its threads): on a CPU machine shared with other jobs it
    still shows the work and overhead of a rank when the wall clock mostly shows the contention."""
    best = torch.tensor([float("inf")] * 2, dtype=torch.float64)
    for i in range(warmup + iters):
        xs = [x.detach().requires_grad_() for x in inputs]
        if barrier:
            barrier()
        sync(device)
        t, c = time.perf_counter(), time.process_time()
        fn(*xs).backward(dout)
        sync(device)
        dt = torch.tensor([time.perf_counter() - t, time.process_time() - c], dtype=torch.float64)
        if barrier:  # the step is as slow as its slowest rank
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            best = torch.minimum(best, dt)
    return best.tolist()


def packed_positions(args, device):
    """[B, S] positions restarting at every document (lengths uniform in [N/2, 3N/2), seeded), or one document."""
    if not args.docs:
        return torch.arange(args.seq, device=device).expand(args.batch, -1)
    g, pos, at = torch.Generator().manual_seed(1), torch.empty(args.batch, args.seq, dtype=torch.long), 0
    while at < args.seq:
        n = int(torch.randint(args.docs // 2, args.docs * 3 // 2, (), generator=g))
        pos[:, at:at + n] = torch.arange(min(n, args.seq - at))
        at += n
    return pos.to(device)


def rank_main(rank, world, args, impl, tile=None):
    device = device_for(rank)
    if tile is not None:
        masks.MASK_TILE = tile or args.seq   # 0: never cut a span pair
    u = {"ulysses": world, "ring": 1, "hybrid": 2}[impl]
    dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=world // u)
    attn = cp_attention(dims.build_mesh(device.type), dims)
    q, k, v, dout = (shard_sequence(x, dims, rank, 0.0) for x in make_inputs(args, device))
    pos = shard_sequence(packed_positions(args, device), dims, rank, None)
    scale = args.head_dim ** -0.5
    fn = lambda q, k, v: attn(q, k, v, attn.prepare(pos), scale)
    return time_step(fn, (q, k, v), dout, device, args.iters, args.warmup, barrier=dist.barrier)


def run_impl(args, impl, tile=None):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # (gloo: forked from tests/dist.py's forkserver, which imported torch and the project once; nccl spawns)
    return run_ranks(rank_main, args.nproc, args, impl, tile, timeout=3600, pg_timeout=600, backend=backend)[0]


def compare_mask_tiles(args):
    """Ring attention over packed rows with each masks.MASK_TILE of --mask-tiles, side by side."""
    tiles = [int(x) for x in args.mask_tiles.split(",")]
    base, rows = None, []
    for tile in tiles:
        t, c = run_impl(args, "ring", tile)
        base = (t, c) if tile == 0 else base
        rows.append((tile, t, c))
        print(f"ring P={args.nproc} mask tile {tile or 'whole'}: {t:.3f} s, cpu {c:.3f} s", flush=True)
    print("\n| mask tile | P | S | documents of ~ | t (s) | cpu (s) | t / t(whole) | cpu / cpu(whole) |")
    print("|---|---|---|---|---|---|---|---|")
    for tile, t, c in rows:
        rel = (f"{t / base[0]:.3f} | {c / base[1]:.3f}") if base else "- | -"
        print(f"| {tile or 'whole'} | {args.nproc} | {args.seq} | {args.docs} | {t:.3f} | {c:.3f} | {rel} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="CP degree P: processes (GPUs when CUDA is present)")
    ap.add_argument("--seq", type=int, default=8192, help="total sequence length")
    ap.add_argument("--batch", type=int, default=1, help="batch size")
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads (GQA when fewer than --heads)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations (best one is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    ap.add_argument("--impls", default=None, help="comma list of ulysses,ring,hybrid (default: all that fit)")
    ap.add_argument("--blocks", type=int, default=0, help="compare the backward in blocks of N tokens with one call")
    ap.add_argument("--tiles", type=int, default=0, help="compare --tiled-attn's kernel calls (N-row tiles) with one")
    ap.add_argument("--docs", type=int, default=0, help="pack the row with documents of about N tokens (ring only)")
    ap.add_argument("--mask-tiles", default="4096,0", help="with --docs: masks.MASK_TILE values to compare (0: whole)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    if args.docs:
        return compare_mask_tiles(args)
    device = device_for(0)
    q, k, v, dout = make_inputs(args, device)
    scale = args.head_dim ** -0.5
    fn = lambda q, k, v: kernels.attention(q, k, v, True, scale)
    if args.blocks:
        return compare_blocks(args, fn, (q, k, v), dout, device)
    if args.tiles:
        return compare_tiles(args, fn, (q, k, v), dout, device)
    t1, c1 = time_step(fn, (q, k, v), dout, device, args.iters, args.warmup)
    backend = kernel_choice.pick_backend(q)
    del q, k, v, dout
    p = args.nproc
    print(f"single process: {t1:.3f} s, cpu {c1:.3f} s  (S={args.seq}, B={args.batch}, H={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, {device.type}, kernel {backend})", flush=True)

    impls = args.impls.split(",") if args.impls else ["ulysses", "ring"] + (["hybrid"] if p >= 4 and p % 2 == 0 else [])
    rows = []
    for impl in impls:
        t, c = run_impl(args, impl)
        rows.append((impl, t, t / (t1 / p), c / (c1 / p)))
        print(f"{impl:8s} P={p}: {t:.3f} s, cpu {c:.3f} s  ratio to ideal {rows[-1][2]:.3f} "
              f"(cpu time {rows[-1][3]:.3f})", flush=True)

    print("\n| impl | P | S | t_1 (s) | t_P (s) | ideal t_1/P (s) | ratio t_P / (t_1/P) | cpu-time ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for impl, t, ratio, cratio in rows:
        print(f"| {impl} | {p} | {args.seq} | {t1:.3f} | {t:.3f} | {t1 / p:.3f} | {ratio:.2f} | {cratio:.2f} |")

def measured(name, fn, args, inputs, dout, device):
    """(best fwd+bwd seconds, CUDA peak GB above the inputs, nan on CPU) of fn, printed under `name`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t, _ = time_step(fn, inputs, dout, device, args.iters, args.warmup)
    gb = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if device.type == "cuda" else float("nan")
    print(f"{name:>22}: fwd+bwd {t:.3f} s, peak above inputs {gb:.2f} GB", flush=True)
    return t, gb


def compare_blocks(args, fn, inputs, dout, device):
    res = {}
    for name, block in (("one call", args.seq + 1), (f"{args.blocks}-token blocks", args.blocks)):
        kernels.BACKWARD_BLOCK = block
        kernels.backward_block = lambda row, block=block: block   # this block size at any length
        res[name] = measured(name, fn, args, inputs, dout, device)
    (t1, m1), (tb, mb) = res.values()
    kernel = kernel_choice.pick_backend(inputs[0])
    print(f"blocks / one call: time {tb / t1:.3f}, peak {mb / m1:.3f}  (S={args.seq}, H={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, {device.type}, kernel {kernel})")


class _TiledKernels(torch.autograd.Function):
    """The attention calls of parallel/tiled_attention.py over one whole row, as one differentiable op."""

    @staticmethod
    def forward(ctx, q, k, v, spec):
        from parallel.tiled_attention import _attend

        s = q.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], s, dtype=torch.float32, device=q.device)
        for a in range(0, s, spec.tile):
            _attend(spec, q[:, a:a + spec.tile], k, v, a, ([0, s], {}), out[:, a:a + spec.tile],
                    lse[:, :, a:a + spec.tile])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        from parallel.tiled_attention import _attend_backward

        q, k, v, out, lse = ctx.saved_tensors
        spec, s, n = ctx.spec, q.shape[1], ctx.spec.tile
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v))
        for a in range(0, s, n):
            dq[:, a:a + n] = _attend_backward(spec, dout[:, a:a + n], q[:, a:a + n], k, v, out[:, a:a + n],
                                              lse[:, :, a:a + n], a, ([0, s], {}), dk, dv)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def compare_tiles(args, fn, inputs, dout, device):
    from types import SimpleNamespace

    spec = SimpleNamespace(scale=args.head_dim ** -0.5, window=None, tile=args.tiles, backend=None, device=device,
                           sinks=None)
    tiled = lambda q, k, v: _TiledKernels.apply(q, k, v, spec)
    (t1, m1), (tt, mt) = (measured(name, f, args, inputs, dout, device)
                          for name, f in (("kernels.attention", fn), (f"{args.tiles}-row tiles", tiled)))
    got = []
    for f in (fn, tiled):   # the same numbers, to rounding
        xs = [x.detach().requires_grad_() for x in inputs]
        out = f(*xs)
        out.backward(dout)
        got.append([out.detach()] + [x.grad for x in xs])
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*got))
    print(f"max |difference| of out, dq, dk, dv between the two: {diff:.2e}")
    print(f"tiles / kernels.attention: time {tt / t1:.3f}, peak {mt / m1:.3f}  (S={args.seq}, H={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, {device.type}, kernel "
          f"{kernel_choice.pick_backend(inputs[0])})")


if __name__ == "__main__":
    main()
