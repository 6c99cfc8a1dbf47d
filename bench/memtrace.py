"""Where one training step's memory goes, counted per tensor storage like CUDA's allocated bytes, on a CPU: per
phase, and what is alive at each phase's peak, by the line of this repository that allocated it, beside the
planner's terms.

The CPU plan check (bench/plan.py) reads the process RSS, which misses what a GPU pays for: a buffer allocated and
never written (an `empty` nobody touches is never paged in) and the allocator's view of every tensor's bytes. This
counts storages instead: a TorchDispatchMode sees every op's outputs and keeps each new storage's byte count until
it dies (weak references), so the running total approximates `torch.cuda.memory_allocated` for the tensors made
during the step (not the weights made before it, nor --offload-activations' host copies; an op's internal
temporaries, freed before it returns, are not seen; nor the CPU attention forward's K/V copies expanded to the query
heads, which CUDA's kernels do not make). The attention core is train.py's at --cp 1 (parallel.cp.KernelAttention,
with the blocked backward of long rows), not torch's SDPA. `parallel.phases.PhaseMeter` marks the phases (train.py
--mem-phases), its peaks taken from this count; at each phase's peak the live storages are grouped by the innermost
repository frame of the op that made them (and its caller). Found with it: the CopySlices of in-place adds on
views (README, "Long sequences").

Its own cost, undone: under a Python dispatch mode autograd cannot sum a tensor's second gradient into the first in
place (the mode's Python references count as owners of the first), so it adds them into a new tensor, which a real
run does not (tests/test_memory.py::test_input_gradients_are_summed_in_place). An `add` made outside this
repository's code ("autograd's sum": nearly all are) is counted as the in-place sum it stands for: its first operand,
the gradient being summed into, counts 0 bytes from then on (the sum holds them), so no moment has both.

The model is a random Qwen2 checkpoint with Qwen2.5-7B's shape ratios (28 query / 4 KV heads, intermediate
5.3 x hidden) at hidden 224 (--head-dim 8), vocab 512 (a block's backward, not the loss, sets the peak); fp32, NF4 base
weights, LoRA r 16 on all seven projections, one row of --tokens tokens. Sizes print in [T, D] units (one fp32
[tokens, hidden] tensor) so they compare with the planner's terms across lengths. `--block N` sets
kernels.BACKWARD_BLOCK (rows longer than 4 N run their attention backward in N/4-token blocks, as 524,288-token
rows do at the default); `--norm-chunk` sets model.rmsnorm.NORM_CHUNK and model.rope.ROPE_CHUNK (a small one stands
in for CUDA's fused RMSNorm, which has no float32 temporaries). Slow: every op is seen in Python (T = 8,192: ~15 s).

Run: .venv/bin/python bench/memtrace.py --like-long --tiled-mlp --offload-activations   (then --tiled-mlp --tiled-attn)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = ("tiled_mlp", "tiled_attn", "offload_activations", "ac_keep_attn", "dora")
LONG = 524288   # the long case's row (bench/gpu.py)


def _site() -> str:
    """The innermost repository frame of the current op and its caller (this file and venvs skipped; of the frames
    inside `run`: a caller of `main`, e.g. a test, is not the op's site)."""
    stack = traceback.extract_stack()[:-3]
    inside = max((i for i, f in enumerate(stack) if f.filename.endswith("memtrace.py") and f.name == "run"), default=-1)
    own = [f for f in stack[inside + 1:] if f.filename.startswith(ROOT) and "site-packages" not in f.filename
           and not f.filename.endswith(("memtrace.py", "phases.py"))]
    return " < ".join(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} ({f.name})" for f in own[::-1][:2]) or "(torch)"


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage made under it and still alive; its peak since `reset()`, and what was alive then."""

    def __init__(self):
        super().__init__()
        self.refs, self.cur, self.peak, self.at_peak = {}, 0, 0, []

    def _sweep(self):
        for k in [k for k, (r, _, _) in self.refs.items() if r.expired()]:
            del self.refs[k]
        self.cur = sum(n for _, n, _ in self.refs.values())

    def reset(self) -> tuple[int, list]:
        self._sweep()
        got = (self.peak, self.at_peak)
        self.peak, self.at_peak = self.cur, [(n, s) for _, n, s in self.refs.values()]
        return got

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()   # first: a freed storage's key may be reused by a new one
        # an op returning an alias (a view, detach, t(), an in-place op) makes no storage: a weight's view
        # must not count the weight
        fresh = not any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0] if fresh else ():
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st._cdata not in self.refs and st.nbytes():
                    site = _site()
                    if site.startswith("parallel/offload.py") and "(__init__)" in site:
                        continue   # --offload-activations' host copy: host memory on a GPU run, not counted
                    if "(_expand_kv) < parallel/backends.py" in site and "(_cpu_forward)" in site:
                        continue   # the CPU op's K/V expanded to the query heads: CUDA's kernels take GQA as is
                    if site == "(torch)" and func is torch.ops.aten.add.Tensor:   # a real run sums in place
                        site = "autograd's sum (in place: its first operand's bytes)"
                        first = args[0].untyped_storage()._cdata if isinstance(args[0], torch.Tensor) else None
                        if first in self.refs and self.refs[first][1] == st.nbytes():
                            ref, n, at = self.refs[first]
                            self.refs[first] = (ref, 0, at)   # moved into the sum
                            self.cur -= n
                    else:
                        site = f"{site} [{func}]"
                    self.refs[st._cdata] = (StorageWeakRef(st), st.nbytes(), site)
                    self.cur += st.nbytes()
        if self.cur > self.peak:
            self.peak, self.at_peak = self.cur, [(n, s) for _, n, s in self.refs.values()]
        return out


def run(args) -> dict:
    """One step; {phase: (peak bytes, [(bytes, count, site)] at that peak)} in the order the phases came."""
    import model.qlora as qlora
    import model.rmsnorm as rmsnorm
    import model.rope as rope
    import parallel.memory as memory
    import parallel.phases as phases
    from parallel import kernels
    from parallel.cp import KernelAttention
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b, tiny_checkpoint
    if args.like_long:   # each row-chunked buffer the fraction of the row it is at 524,288 tokens of Qwen2.5-7B
        dim = 28 * args.head_dim
        frac = lambda n, per: max(1, round(args.tokens * dim * n / (LONG * per)))   # n of a per-token quantity
        args.block = args.block or max(1, args.tokens // 8)   # rows > 4 blocks: blocks of a quarter (16,384 there)
        args.norm_chunk = args.norm_chunk or frac(rmsnorm.NORM_CHUNK, 3584)
        args.mlp_tile = args.mlp_tile or frac(3584, dim)          # tile_tokens(3584) tokens there
        args.row_chunk = args.row_chunk or frac(qlora.ROW_CHUNK, 3584)
    kernels.BACKWARD_BLOCK = args.block or kernels.BACKWARD_BLOCK
    rmsnorm.NORM_CHUNK = rope.ROPE_CHUNK = args.norm_chunk or rmsnorm.NORM_CHUNK   # (RoPE's chunks alike)
    qlora.ROW_CHUNK = args.row_chunk or qlora.ROW_CHUNK
    if args.mlp_tile:   # the tiled MLP's tile (and the plan's): read from the module at each call
        memory.tile_tokens = lambda dim, tile: args.mlp_tile
    ckpt = tiny_checkpoint(tempfile.mkdtemp(), heads=28, kv_heads=4, head_dim=args.head_dim, layers=args.layers,
                           vocab=512, inter=148 * args.head_dim, max_shard_size="50MB")   # 18,944 / 3,584 x D
    opts = BuildOptions(ckpt, quant="nf4", lora_r=16, lora_alpha=32, seed=0,
                        **{f: getattr(args, f) for f in FLAGS})
    model, _ = build_nonzero_b(opts, attention=KernelAttention())   # train.py's core at --cp 1 (not torch's SDPA)
    ids = torch.randint(0, 512, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    live, got = LiveBytes(), {}
    meter = phases.PhaseMeter(model, torch.device("cpu"))
    meter.why = None

    def peak():   # the meter's peak (GB) since its last boundary, from the count; what was alive then, kept
        n, at = live.reset()
        meter.at = at
        return n / 1e9

    def mark(name, base=meter._mark):
        if all(k != name for k in got):
            base(name)
            agg = {}
            for n, s in meter.at:
                a = agg.setdefault(s, [0, 0])
                a[0], a[1] = a[0] + n, a[1] + 1
            got[name] = (dict(meter.phases)[name] * 1e9, sorted(((n, c, s) for s, (n, c) in agg.items()),
                                                                reverse=True))
    meter._peak, meter._mark = peak, mark
    torch.manual_seed(0)
    with live, meter.measuring(True):
        s, n = model(ids, labels=ids)
        (s / n).backward()
    plan = planned(args, ckpt)
    return got, plan, ckpt


def planned(args, ckpt):
    """parallel.plan.memory_plan's terms for the same run (target cpu: fp32, LoRA in fp32)."""
    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan import memory_plan
    flags = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f)]
    a = train.build_parser().parse_args(["--model", ckpt, "--data", "unused", "--max-len", str(args.tokens),
                                         "--quant", "nf4", "--lora-r", "16", *flags])
    margs = read_args(ckpt)
    dims, pack = validate(a, margs, 1)
    return memory_plan(margs, dims, a, "cpu", pack)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the one row")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers")
    ap.add_argument("--head-dim", type=int, default=8, help="head dim (hidden = 28 x this: LoRA's r = 16 is a larger "
                    "share of a small hidden size than of Qwen2.5-7B's 3,584)")
    ap.add_argument("--block", type=int, default=None, help="kernels.BACKWARD_BLOCK for this run")
    ap.add_argument("--norm-chunk", type=int, default=None, help="model.rmsnorm.NORM_CHUNK and model.rope.ROPE_CHUNK "
                    "(elements) for this run")
    ap.add_argument("--mlp-tile", type=int, default=None, help="--tiled-mlp's tokens per tile (default: the hidden "
                    "size)")
    ap.add_argument("--row-chunk", type=int, default=None, help="model.qlora.ROW_CHUNK (elements) for this run")
    ap.add_argument("--like-long", action="store_true", help="unless given: --block, --norm-chunk, --mlp-tile and "
                    "--row-chunk at the fraction of the row each is at 524,288 tokens of Qwen2.5-7B (bench/gpu.py's "
                    "long case), so the phases compare with that GPU run's (at 8,192 tokens: 1024, 65536, 56, 16384)")
    ap.add_argument("--top", type=int, default=8, help="sites shown per phase")
    ap.add_argument("--min", type=float, default=0.05, help="sites under this many [T, D] are not shown")
    for f in FLAGS:
        ap.add_argument(f"--{f.replace('_', '-')}", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    got, plan, ckpt = run(args)
    shutil.rmtree(ckpt, ignore_errors=True)   # (the step's tiny checkpoint: nothing reads it after the plan)
    u = args.tokens * 28 * args.head_dim * 4   # one fp32 [T, D]
    on = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f)]
    print(f"{args.tokens} tokens, {args.layers} layers, flags: {' '.join(on) or '(none)'}; 1 [T, D] = {u / 1e6:.2f} MB"
          " (sizes: bytes made during the step, weights excluded)")
    for name, (peak, sites) in got.items():
        print(f"{name:<26} {peak / u:6.2f} [T, D]")
        for n, c, s in [x for x in sites if x[0] / u >= args.min][:args.top]:
            print(f"    {n / u:6.2f} {c:4d}  {s}")
    print("planned (parallel/plan.py, cpu):")
    for k, v in plan.terms.items():
        print(f"  {v / u:6.2f}  {k}")
    print(f"  {plan.peak / u:6.2f}  peak of live tensors (weights included)")
    return got, plan


if __name__ == "__main__":
    main()
