"""Parallel dimensions, their validation, and the device mesh.

Contract:
- `ParallelDims` holds `dp_replicate × dp_shard × cp` (outermost first) and the split of `cp` into
  `ring × ulysses`. Constructing it validates everything against the world size and the model's head
  counts and raises `ValueError` with every degree, the world size and the fix in the message. It
  reads nothing but numbers, so it runs before any weight is touched.
- `validate(args, margs, world)` is the ONE start-up check of a run's flags (train.py and `--plan` both
  call it, so they refuse exactly the same configurations): plain flag values first (`parallel.flags.check_flags`),
  then the layout (`ParallelDims.from_args`), batch sizes, sequence length, the flags that need config.json
  (`parallel.flags.check_model_flags`) and packing. It returns `(dims, pack)`.
- `ParallelDims.build_mesh(device_type)` calls `init_device_mesh` with dims
  `("dp_replicate", "dp_shard", "ring", "ulysses")` and returns `Meshes`: "cp" (ring × ulysses),
  "fsdp" (dp_replicate × dp_shard·cp; FSDP2 shards over the second dim), "dp" (data ranks: one
  sample stream each) and "dp_cp" (every rank that holds target tokens: loss all-reduce).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from data.batches import check_batch_sizes
from parallel.flags import check_flags, check_model_flags
from parallel.plan_totals import sample_tokens

CP_IMPLS = ("ulysses", "ring", "hybrid", "auto")


def _kvs(n_kv_heads) -> tuple[int, ...]:
    return (n_kv_heads,) if isinstance(n_kv_heads, int) else tuple(n_kv_heads)


def ulysses_ok(degree: int, n_heads: int, n_kv_heads) -> str | None:
    """Why `degree` cannot be a Ulysses degree for these heads, or None when it can. `n_kv_heads`: one count, or
    every attention layer's where they differ (`kv_heads`: Gemma 4's sliding and full layers), each checked."""
    if n_heads % degree:
        return f"the {n_heads} attention heads are not divisible by the Ulysses degree {degree}"
    for k in _kvs(n_kv_heads):
        if k % degree and degree % k:
            return (f"the Ulysses degree {degree} must divide the {k} KV heads{' of some layers' * (k != n_kv_heads)}"
                    " or be a multiple of them (then KV heads are replicated)")
    return None


def ulysses_degrees(n_heads: int, n_kv_heads, within: int | None = None) -> str:
    """The Ulysses degrees these heads allow (those dividing `within`), for an error's fix: '1, 2, 6'."""
    return ", ".join(str(d) for d in range(1, n_heads + 1) if ulysses_ok(d, n_heads, n_kv_heads) is None
                     and (within is None or within % d == 0))


def kv_heads(margs):
    """The KV heads of the model's attention layers: one count, or a tuple (largest first) where layers differ
    (Gemma 4's full layers: num_global_key_value_heads beside the sliding layers' num_key_value_heads). Ulysses
    splits each layer's own (parallel.ulysses.kv_to_heads reads them from the tensors), so every one must allow it."""
    dims = getattr(margs, "attn_dims", None)
    ks = sorted({dims(i)[1] for i in range(margs.n_layers)}, reverse=True) if dims else [margs.n_kv_heads]
    return ks[0] if len(ks) == 1 else tuple(ks)


def resolve_cp(cp: int, impl: str, ulysses_degree: int | None, n_heads: int, n_kv_heads):
    """Split `cp` into (ulysses, ring) for `impl`; raise ValueError naming the fix (`n_kv_heads`: `kv_heads`')."""
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if impl not in CP_IMPLS:
        raise ValueError(f"--cp-impl must be one of {CP_IMPLS}, got {impl!r}")
    heads = f"(model: {n_heads} heads, {' and '.join(map(str, _kvs(n_kv_heads)))} KV heads)"
    if impl == "ring":
        return 1, cp
    if impl == "ulysses":
        why = ulysses_ok(cp, n_heads, n_kv_heads)
        if why:
            raise ValueError(f"--cp-impl ulysses with --cp {cp}: {why} {heads}. Use --cp-impl ring "
                             f"or auto, or a --cp of {ulysses_degrees(n_heads, n_kv_heads)}.")
        return cp, 1
    if impl == "hybrid":
        if ulysses_degree is None or cp % ulysses_degree:
            raise ValueError(f"--cp-impl hybrid needs --ulysses-degree dividing --cp {cp}, got "
                             f"{ulysses_degree}. Or use --cp-impl auto.")
        why = ulysses_ok(ulysses_degree, n_heads, n_kv_heads)
        if why:
            raise ValueError(f"--ulysses-degree {ulysses_degree}: {why} {heads}. Those dividing "
                             f"--cp {cp} that the heads allow: {ulysses_degrees(n_heads, n_kv_heads, cp)}; or use "
                             f"--cp-impl auto.")
        return ulysses_degree, cp // ulysses_degree
    # auto: the largest Ulysses degree the heads allow (all-to-all is cheaper than a ring), ring the rest
    for u in range(cp, 0, -1):
        if cp % u == 0 and ulysses_ok(u, n_heads, n_kv_heads) is None:
            return u, cp // u
    raise AssertionError("unreachable: degree 1 always works")


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ulysses: int | None = None   # cp = ulysses × ring; unset means all-Ulysses until from_args splits it
    ring: int | None = None

    def __post_init__(self):
        w, r, s, c = self.world_size, self.dp_replicate, self.dp_shard, self.cp
        have = f"world size {w}, --dp-replicate {r}, --dp-shard {s}, --cp {c}"
        for name, v in (("--dp-replicate", r), ("--cp", c)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1 ({have}).")
        if s == -1:
            if w % (r * c):
                raise ValueError(
                    f"cannot infer --dp-shard: world size {w} is not divisible by "
                    f"--dp-replicate {r} × --cp {c} = {r * c} ({have}). Launch a multiple of "
                    f"{r * c} processes or change --cp / --dp-replicate.")
            self.dp_shard = s = w // (r * c)
        elif s < 1:
            raise ValueError(f"--dp-shard must be >= 1 or -1 to infer it ({have}).")
        if r * s * c != w:
            raise ValueError(
                f"--dp-replicate {r} × --dp-shard {s} × --cp {c} = {r * s * c} but the world size "
                f"is {w}. Make the product equal the number of processes (torchrun "
                f"--nproc_per_node × nodes), or pass --dp-shard -1 to infer it.")
        if self.ulysses is None and self.ring is None:
            self.ulysses, self.ring = c, 1
        if (self.ulysses or 0) * (self.ring or 0) != c:
            raise ValueError(f"ulysses {self.ulysses} × ring {self.ring} must equal --cp {c}.")

    @classmethod
    def from_args(cls, world_size, dp_replicate, dp_shard, cp, cp_impl, ulysses_degree,
                  n_heads, n_kv_heads):
        dims = cls(world_size, dp_replicate, dp_shard, cp)  # checks the world size first
        dims.ulysses, dims.ring = resolve_cp(cp, cp_impl, ulysses_degree, n_heads, n_kv_heads)
        return dims

    @property
    def dp(self) -> int:
        """Data ranks: each reads its own samples; the cp ranks of one group share a sample."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp_divisor(self) -> int:
        """The sequence length must be a multiple of this (zigzag needs 2 chunks per ring rank)."""
        return self.cp * (2 if self.ring > 1 else 1)

    def __str__(self):
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} × dp_shard "
                f"{self.dp_shard} × cp {self.cp} (ring {self.ring} × ulysses {self.ulysses})")

    def build_mesh(self, device_type: str) -> Meshes:
        names = ("dp_replicate", "dp_shard", "ring", "ulysses")
        world = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.ring, self.ulysses), mesh_dim_names=names)
        # FSDP2 wants a 2-D (replicate, shard) mesh for HSDP; rank order matches the flattened
        # (dp_shard, ring, ulysses) dims because both are row-major over the same world.
        fsdp = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard * self.cp),
                                mesh_dim_names=("dp_replicate", "dp_shard_cp"))
        return Meshes(
            world=world,
            fsdp=fsdp,
            cp=world["ring", "ulysses"]._flatten("cp"),
            ring=world["ring"],
            ulysses=world["ulysses"],
            dp=world["dp_replicate", "dp_shard"]._flatten("dp"),
            dp_cp=world._flatten("dp_cp"),
        )


@dataclass
class Meshes:
    """The submeshes the trainer uses; kept here because slicing flattened dims is deprecated."""
    world: DeviceMesh
    fsdp: DeviceMesh   # (dp_replicate, dp_shard_cp): FSDP2 shards over dim 1, replicates over dim 0
    cp: DeviceMesh     # ranks that share one sample (ring × ulysses)
    ring: DeviceMesh
    ulysses: DeviceMesh
    dp: DeviceMesh     # data ranks: one sample stream each
    dp_cp: DeviceMesh  # every rank: the global target-token count is all-reduced here


def validate(args, margs, world: int, say=None):
    """Every check of a run's flags against the model's config.json and the world size -> (dims, pack); `say`: the
    start-up line of --lora-targets' default where the model narrowed it (check_model_flags)."""
    check_flags(args)
    dims = ParallelDims.from_args(world, args.dp_replicate, args.dp_shard, args.cp, args.cp_impl,
                                  args.ulysses_degree, margs.n_heads, kv_heads(margs))
    check_batch_sizes(args.global_batch, args.micro_batch, dims.dp)
    if margs.linear is not None and dims.cp > 1:   # (Qwen3.5's linear layers split by heads over all cp ranks)
        from parallel.cp_linear import check_linear_heads
        check_linear_heads(margs.linear.k_heads, margs.linear.v_heads, dims.cp)
    if getattr(args, "tiled_attn", False) and dims.cp > 1:
        raise ValueError(f"--tiled-attn with --cp {dims.cp}: the tiles run one process's whole-sequence attention, "
                         "and context parallelism splits the sequence across ranks already; drop one of them")
    # (--no-pack pads a row to its micro-batch's longest pair, and the padding joins the branch: 2 x --max-len there;
    # review, helper 47)
    reach = args.max_len if args.pack is not False or args.micro_batch == 1 else sample_tokens(args)
    what = f"a side's --max-len {reach:,}" if reach == args.max_len else f"an unpacked row padded to {reach:,} tokens"
    if getattr(args, "dpo_share_prompt", False) and margs.sliding_window is not None and margs.sliding_window < \
            reach and "sliding_attention" in (margs.layer_types or ["sliding_attention"]):
        raise ValueError(f"--dpo-share-prompt makes a pair's rejected answer a branch that sees the prompt before "
                         f"the chosen one, which a sliding window (this model's, {margs.sliding_window} tokens, "
                         f"shorter than {what}) would measure by the row, not by its positions: drop "
                         "--dpo-share-prompt (a window that reaches that far cuts nothing: allowed)")
    if args.max_len < dims.cp_divisor:
        raise ValueError(f"--max-len {args.max_len} is shorter than the CP divisor {dims.cp_divisor} "
                         f"({dims}); raise --max-len or lower --cp")
    check_model_flags(args, margs, say)
    pack = True if args.pack is None else args.pack   # every core keeps packed documents apart
    if args.micro_batch == 0 and not pack:
        raise ValueError("--micro-batch auto packs the samples that fit the longest one's length into one row: drop "
                         "--no-pack, or give --micro-batch a number")
    return dims, pack


def peak_memory_gb(device: torch.device) -> float:
    """This rank's peak: CUDA allocated bytes, or the process RSS high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6   # kB -> GB (Linux)


def init_distributed(dt: str, timeout) -> tuple[bool, torch.device]:
    """torchrun's process group, or a 1-rank one for a plain process so the same code path runs.
    Returns whether it made the group (then the caller destroys it; one already up is kept) and this rank's device."""
    own, backend = not dist.is_initialized(), "nccl" if dt == "cuda" else "gloo"
    if own and "RANK" in os.environ:   # torchrun
        if dt == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
    elif own:
        store = os.path.join(tempfile.mkdtemp(), "pg")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    return own, torch.device(dt, torch.cuda.current_device()) if dt == "cuda" else torch.device("cpu")


def dense_bf16_tflops(name: str) -> float | None:
    """Dense bf16 peak of known devices (SXM parts; a PCIe H100 is ~756: pass --peak-tflops)."""
    for key, tflops in (("H100", 989), ("H200", 989), ("B200", 2250), ("A100", 312), ("L40S", 362)):
        if key in name:
            return tflops
    return None


def device_type() -> str:
    """One CUDA device per rank with NCCL, or CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"
