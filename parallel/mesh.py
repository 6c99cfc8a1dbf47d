"""Parallel dimensions, their validation, and the device mesh.

Contract:
- `ParallelDims` holds `dp_replicate × dp_shard × cp` (outermost first) and the split of `cp` into
  `ring × ulysses`. Constructing it validates everything against the world size and the model's head
  counts and raises `ValueError` with every degree, the world size and the fix in the message. It
  reads nothing but numbers, so it runs before any weight is touched.
- `validate(args, margs, world)` is the ONE start-up check of a run's flags (train.py and `--plan` both
  call it, so they refuse exactly the same configurations): plain flag values first, then the layout
  (`ParallelDims.from_args`), batch sizes, sequence length and packing. It returns `(dims, pack)`.
- `ParallelDims.build_mesh(device_type)` calls `init_device_mesh` with dims
  `("dp_replicate", "dp_shard", "ring", "ulysses")` and returns `Meshes`: "cp" (ring × ulysses),
  "fsdp" (dp_replicate × dp_shard·cp; FSDP2 shards over the second dim), "dp" (data ranks: one
  sample stream each) and "dp_cp" (every rank that holds target tokens: loss all-reduce).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from data.batches import check_batch_sizes
from data.mix import data_files
from model.config import LORA_TARGETS, lora_layers
from model.rope import rope_scaling_flag

CP_IMPLS = ("ulysses", "ring", "hybrid", "auto")


def ulysses_ok(degree: int, n_heads: int, n_kv_heads: int) -> str | None:
    """Why `degree` cannot be a Ulysses degree for these heads, or None when it can."""
    if n_heads % degree:
        return f"the {n_heads} attention heads are not divisible by the Ulysses degree {degree}"
    if n_kv_heads % degree and degree % n_kv_heads:
        return (f"the Ulysses degree {degree} must divide the {n_kv_heads} KV heads or be a "
                f"multiple of them (then KV heads are replicated)")
    return None


def ulysses_degrees(n_heads: int, n_kv_heads: int, within: int | None = None) -> str:
    """The Ulysses degrees these heads allow (those dividing `within`), for an error's fix: '1, 2, 6'."""
    return ", ".join(str(d) for d in range(1, n_heads + 1) if ulysses_ok(d, n_heads, n_kv_heads) is None
                     and (within is None or within % d == 0))


def resolve_cp(cp: int, impl: str, ulysses_degree: int | None, n_heads: int, n_kv_heads: int):
    """Split `cp` into (ulysses, ring) for `impl`; raise ValueError naming the fix."""
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if impl not in CP_IMPLS:
        raise ValueError(f"--cp-impl must be one of {CP_IMPLS}, got {impl!r}")
    heads = f"(model: {n_heads} heads, {n_kv_heads} KV heads)"
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


def check_flags(args) -> None:
    """Values no run can use, whatever the model and world: each error names the flag and the fix."""
    for flag in ("lr", "lora_alpha", "lora_dropout", "weight_decay", "clip", "timeout", "save_minutes"):
        v = getattr(args, flag)
        if not math.isfinite(v):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number, got {v}")
    lower = [("--lr", args.lr, 0, "> 0"), ("--lora-alpha", args.lora_alpha, 0, "> 0 (0 trains nothing: "
             "the LoRA output is scaled by alpha / r, or / sqrt(r))"), ("--lora-r", args.lora_r, 0, ">= 1"),
             ("--timeout", args.timeout, 0.99, ">= 1 minute (a step, a save or the first compile may take that "
                                               "long; the watchdog ends the job past it)"),
             ("--keep-ckpts", args.keep_ckpts, 0, ">= 1"), ("--max-nonfinite", args.max_nonfinite, 0, ">= 1")]
    for flag, v, bound, need in lower:
        if v <= bound:
            raise ValueError(f"{flag} must be {need}, got {v}")
    upper = [("--timeout", args.timeout, 1e6, "<= 1e6 minutes (about two years)"),
             ("--lr", args.lr, 1.0, "<= 1 (a learning rate, e.g. 2e-4)"),
             ("--global-batch", getattr(args, "global_batch", 1), 10 ** 7, "<= 10 million samples a step (each "
              "step lists its samples: 1e11 hung in the first step)"),
             ("--seed", abs(getattr(args, "seed", 0)), 2 ** 40, "between -2**40 and 2**40 (it seeds torch per rank)")]
    for flag, v, bound, need in upper:   # (past these: an overflow deep in torch or datetime, late)
        if v > bound:
            raise ValueError(f"{flag} must be {need}, got {v}")
    if (pt := getattr(args, "peak_tflops", None)) is not None and not (math.isfinite(pt) and pt > 0):
        raise ValueError(f"--peak-tflops must be a positive number (the device's dense bf16 TFLOP/s), got {pt}")
    if (ud := getattr(args, "ulysses_degree", None)) is not None:
        if ud < 1:
            raise ValueError(f"--ulysses-degree must be >= 1, got {ud}")
        if getattr(args, "cp_impl", "auto") != "hybrid":
            raise ValueError(f"--ulysses-degree {ud} applies only with --cp-impl hybrid (got --cp-impl "
                             f"{getattr(args, 'cp_impl', None)}): add --cp-impl hybrid, or drop it")
    rope_scaling_flag(getattr(args, "rope_scaling", None))   # its syntax; the model's numbers come with config.json
    if getattr(args, "init_adapter", None) and not args.resume:   # (a resume's LoRA comes from its checkpoint)
        from model.export import check_init_adapter
        if args.overwrite and args.out and os.path.realpath(args.init_adapter).startswith(
                os.path.realpath(args.out) + os.sep):
            raise ValueError(f"--init-adapter {args.init_adapter!r} lies inside --out {args.out!r}, which --overwrite "
                             "empties first: pass a new --out, or copy the adapter out of it")
        check_init_adapter(args.init_adapter, args.lora_r, args.lora_alpha, args.lora_targets.split(","),
                           getattr(args, "rslora", False), getattr(args, "chat_template_text", None),
                           getattr(args, "dora", False), getattr(args, "train_norms", False),
                           getattr(args, "train_embeddings", False))
    for flag, v in (("--weight-decay", args.weight_decay), ("--clip", args.clip), ("--warmup", args.warmup),
                    ("--eval-every", args.eval_every), ("--save-every", args.save_every),
                    ("--save-minutes", args.save_minutes), ("--data-workers", getattr(args, "data_workers", 0))):
        if v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
    check_ac(getattr(args, "ac_group", 1), args.ac, getattr(args, "offload_activations", False),
             getattr(args, "ac_blocks", None), getattr(args, "ac_keep_attn", False), getattr(args, "tiled_attn", False))
    if getattr(args, "ac_keep_attn", False) and getattr(args, "compile", False) and not _sac_lets_compile():
        raise ValueError(f"--ac-keep-attn with --compile: torch {torch.__version__}'s selective-checkpoint cache "
                         "stops torch.compile inside it (every block would run eager); use one or the other")
    if (plus := getattr(args, "lora_plus_ratio", None)) is not None and not (math.isfinite(plus) and plus > 0):
        raise ValueError(f"--lora-plus-ratio must be a finite number above 0 (B's LR over A's; 16 in the LoRA+ paper), "
                         f"got {plus:g}")
    schedule, ratio, decay = (getattr(args, k, None) for k in ("lr_schedule", "min_lr_ratio", "wsd_decay"))
    if ratio is not None and (schedule == "constant" or not 0 <= ratio <= 1):   # (nan too)
        raise ValueError(f"--min-lr-ratio {ratio:g}: " + ("--lr-schedule constant has no decay to end at; drop it"
                         if schedule == "constant" else "the LR the decay ends at, as a share of --lr, in [0, 1]"))
    if decay is not None and (schedule != "wsd" or not 0 <= decay <= 1):
        raise ValueError(f"--wsd-decay {decay:g}: " + ("the share of the steps --lr-schedule wsd decays over, in [0, "
                         "1]" if schedule == "wsd" else f"acts only with --lr-schedule wsd (this run's is {schedule}): "
                         "pass that too, or drop it"))
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if getattr(args, "profile", None) is not None and args.profile < 1:
        raise ValueError(f"--profile must be a step number >= 1 (1-based), got {args.profile}")
    if getattr(args, "profile", None) is not None and getattr(args, "steps", None) and args.profile > args.steps:
        raise ValueError(f"--profile {args.profile}: this run has steps 1..{args.steps}; pick one of them (not step 1 "
                         "for timings: it also pays the kernels' first-call setup)")   # (--epochs: once the data are
        # counted; this one before they are read: review, helper 54)
    if getattr(args, "early_stop_delta", 0) and getattr(args, "early_stop", None) is None:
        raise ValueError(f"--early-stop-delta {args.early_stop_delta:g} acts only with --early-stop N (the evaluations "
                         "in a row without such an improvement that end the run): pass that too, or drop it")
    if isinstance(getattr(args, "max_len", None), int) and args.max_len < 2:
        raise ValueError(f"--max-len must be >= 2 (one input and one target), got {args.max_len}")
    if (split := getattr(args, "eval_split", None)) is not None:
        if getattr(args, "eval_data", None):
            raise ValueError(f"--eval-split {split:g} and --eval-data {' '.join(data_files(args.eval_data))} both "
                             "name the eval set: pass one (--eval-split holds out records of --data)")
        if not (0 < split < 1 or (math.isfinite(split) and split >= 1 and split == int(split))):   # (nan too)
            raise ValueError(f"--eval-split must be a share of --data's records above 0 and below 1 (0.05), or a "
                             f"whole number of them (500), got {split:g}")
    if getattr(args, "eval_every", 0) and not getattr(args, "eval_data", None) and hasattr(args, "eval_data") and \
            not getattr(args, "eval_split", None):
        raise ValueError(f"--eval-every {args.eval_every} evaluates on --eval-data, which is not given: pass "
                         "--eval-data FILE (or --eval-split), or drop --eval-every")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}; omit --steps to train one epoch")
    if (epochs := getattr(args, "epochs", None)) is not None:
        if not 0 < epochs <= 1e6:   # (nan fails too)
            raise ValueError(f"--epochs must be above 0 and at most 1e6, got {epochs:g}; omit it to train one epoch")
        if args.steps is not None:
            raise ValueError(f"--steps {args.steps} and --epochs {epochs:g} both set the run's length: pass one")
    bad = [t for t in args.lora_targets.split(",") if t not in LORA_TARGETS]
    if bad or not args.lora_targets:
        raise ValueError(f"--lora-targets {args.lora_targets!r}: unknown {bad}; choose from {','.join(LORA_TARGETS)} "
                         "(or all-linear, attn, mlp)")


def _sac_lets_compile() -> bool:
    """torch's selective-checkpoint dispatch modes tell dynamo to trace through them (newer torch does)."""
    from torch.utils import checkpoint as c
    return all(getattr(getattr(c, m, None), "ignore_compile_internals", lambda: False)()
               for m in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"))


def check_ac(group: int, ac: bool, offload: bool, blocks: int | None = None, keep_attn: bool = False,
             tiled_attn: bool = False) -> None:
    """The AC flags' constraints (--ac-group, --ac-blocks, --ac-keep-attn; parallel/parallelize.apply_ac),
    named with the fix."""
    if offload and not ac:
        raise ValueError("--offload-activations moves the checkpoints of --ac to host memory: drop --no-ac")
    if keep_attn and tiled_attn:
        raise ValueError("--tiled-attn with --ac-keep-attn: the tiles run many attention kernels per block, whose "
                         "outputs --ac-keep-attn would keep (many times the attention output); use one or the other")
    if keep_attn and not ac:
        raise ValueError("--ac-keep-attn keeps the attention outputs of --ac's checkpoints: drop --no-ac")
    if keep_attn and (group > 1 or offload):
        what = f"--ac-group {group}" if group > 1 else "--offload-activations"
        raise ValueError(f"--ac-keep-attn with {what}: that flag saves device memory, --ac-keep-attn spends it "
                         "(one attention output per checkpointed block) for speed; use one or the other")
    if keep_attn and blocks == 0:
        raise ValueError("--ac-keep-attn with --ac-blocks 0: no block is checkpointed, so no recompute to spare; "
                         "raise --ac-blocks or drop --ac-keep-attn")
    if blocks is not None and blocks < 0:
        raise ValueError(f"--ac-blocks must be >= 0 (how many blocks to checkpoint), got {blocks}")
    if blocks is not None and not ac:
        raise ValueError(f"--ac-blocks {blocks} picks the blocks --ac checkpoints: drop --no-ac")
    if blocks is not None and group > 1:
        raise ValueError(f"--ac-blocks {blocks} with --ac-group {group}: use one or the other")
    if blocks == 0 and offload:
        raise ValueError("--ac-blocks 0 with --offload-activations: no block is checkpointed, so nothing is "
                         "offloaded; raise --ac-blocks or drop --offload-activations")
    if group < 1:
        raise ValueError(f"--ac-group must be >= 1 (blocks per kept checkpoint), got {group}")
    if group > 1 and not ac:
        raise ValueError(f"--ac-group {group} groups the checkpoints of --ac: drop --no-ac or use --ac-group 1")
    if group > 1 and offload:
        raise ValueError(f"--ac-group {group} with --offload-activations: the checkpoints are in host memory "
                         "already; use one or the other")


def check_model_flags(args, margs) -> None:
    """The flag checks that need the model's config.json but no layout."""
    shapes = margs.projections()
    over = [f"{t} ({shapes[t][0]} -> {shapes[t][1]})" for t in args.lora_targets.split(",")
            if t in shapes and args.lora_r > min(shapes[t])]
    if over:   # B @ A cannot have a higher rank than the projection: the extra rank is parameters and time, no more
        raise ValueError(f"--lora-r {args.lora_r} is more than the rank of {', '.join(over)}: use --lora-r "
                         f"{min(min(shapes[t]) for t in args.lora_targets.split(',') if t in shapes)} or less, or "
                         "leave those projections out of --lora-targets")
    layers = lora_layers(getattr(args, "lora_layers", None))
    if layers is not None and max(layers) >= margs.n_layers:
        raise ValueError(f"--lora-layers {args.lora_layers}: the model has blocks 0-{margs.n_layers - 1}; pass "
                         f"indices below {margs.n_layers}")
    if getattr(args, "train_embeddings", False) and margs.tie_embeddings and \
            getattr(args, "objective", "sft") == "dpo":
        raise ValueError("--train-embeddings with --objective dpo: this model ties its output head to the input "
                         "embedding (config.json's tie_word_embeddings), so the embedding would train through the head "
                         "too, and DPO's per-token losses take a frozen head (each token's share of the head's "
                         "gradient is known only once its pair's sums are): drop --train-embeddings (--train-norms "
                         "trains the norms), or train it with --objective sft")
    if getattr(args, "train_embeddings", False) and layers is not None and min(layers) > 0:
        raise ValueError(f"--train-embeddings with --lora-layers {args.lora_layers}: the embedding lies below every "
                         "block, so every block would run backward, which --lora-layers skips below its lowest block: "
                         "include block 0 in --lora-layers, or drop one of them")
    if getattr(args, "init_adapter", None) and not getattr(args, "resume", None):
        _init_adapter_fits(args.init_adapter, shapes, args.lora_r, margs.n_layers, layers, margs.tie_embeddings)
    blocks, group = getattr(args, "ac_blocks", None), getattr(args, "ac_group", 1)
    if group > margs.n_layers:
        raise ValueError(f"--ac-group {group} is more than the model's {margs.n_layers} blocks (one checkpoint would "
                         f"span them all, its recompute holding every block's activations): use at most "
                         f"--ac-group {margs.n_layers}")
    if blocks is not None and blocks > margs.n_layers:
        raise ValueError(f"--ac-blocks {blocks} is more than the model's {margs.n_layers} blocks; omit it to "
                         "checkpoint them all")


def _init_adapter_fits(path: str, shapes: dict, r: int, n_layers: int, layers=None, tied: bool = False) -> None:
    """--init-adapter's LoRA tensors (their safetensors header) fit this model's projections (`shapes`: name -> (in,
    out)) at rank r: an adapter of another model is said before the data, not when its tensors are copied in. `tied`:
    the model's head is its input embedding; an adapter that trains that embedding without peft's ensure_weight_tying
    kept the base's head in peft (untied), which a run here cannot start from."""
    from model.export import untied_embedding
    from model.load import read_header
    header, _ = read_header(os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json")) as f:   # (check_init_adapter read it: a list of names)
        cfg = json.load(f)
    if tied and (why := untied_embedding(cfg)):
        raise ValueError(f"--init-adapter {path!r} {why}: this run would start with the head tied to it, not the "
                         "function it learned; start from an adapter saved with ensure_weight_tying "
                         "(--train-embeddings writes one), or merge it with peft's merge_and_unload and train on that")
    bad, halves = [], {}
    for k, h in sorted(header.items()):
        if not (m := re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B|magnitude_vector)\b", k)) or \
                m[2] not in shapes:
            continue
        halves.setdefault(f"layer {m[1]} {m[2]}", set()).add(m[3])
        i, o = shapes[m[2]]
        want = {"A": (r, i), "B": (o, r), "magnitude_vector": (o,)}[m[3]]
        if int(m[1]) >= n_layers:
            bad.append(f"{k} (layer {m[1]}; the model has {n_layers})")
        elif tuple(h[1]) != want:
            bad.append(f"{k} {list(h[1])}, this model's {list(want)}")
    need = {"A", "B"} | ({"magnitude_vector"} if cfg.get("use_dora") else set())   # (DoRA's: the three)
    stray = [k for k, v in halves.items() if v - need]
    if stray:   # DoRA's magnitudes under a config that says plain LoRA: a start would drop them
        raise ValueError(f"--init-adapter {path!r} holds DoRA's lora_magnitude_vector for {len(stray)} projections "
                         f"({'; '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}) but its adapter_config.json "
                         "has no use_dora: true: a hand-edited adapter; pass the adapter as it was saved (with --dora)")
    half = [f"{k} (only lora_{' and lora_'.join(sorted(v))})" for k, v in halves.items() if v != need]
    if half:   # (the other half would keep this run's init: B 0 drops the module's change, a random A garbles it;
        # review, helper 50)
        raise ValueError(f"--init-adapter {path!r} holds " + ("one half of a LoRA pair" if len(need) == 2 else
                                                              "some of DoRA's lora_A, lora_B and lora_magnitude_vector")
                         + f" for {len(half)} projections "
                         f"({'; '.join(half[:3])}{' ...' if len(half) > 3 else ''}): a damaged or hand-edited "
                         "adapter; pass the adapter as it was saved")
    if layers is not None and (out := sorted({int(k.split()[1]) for k in halves} - set(layers))):
        raise ValueError(f"--init-adapter {path!r} adapts blocks {','.join(map(str, out))}, which --lora-layers "
                         f"leaves out (its LoRA there would be dropped): pass --lora-layers covering them")
    if bad:
        raise ValueError(f"--init-adapter {path!r} does not fit this --model: {len(bad)} LoRA tensors differ "
                         f"({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): it was trained on another model; "
                         "pass an adapter of this one")
    # every projection its config names, in every layer it was trained on (peft's layers_to_transform: those only;
    # an int is one layer), holds tensors: a projection without them would start at B = 0, silently not the adapter
    # it was (a cut or hand-edited file)
    layers = cfg.get("layers_to_transform")
    layers = range(n_layers) if layers is None else [layers] if isinstance(layers, int) else layers
    missing = [f"layer {i} {t}" for t in cfg.get("target_modules") or () if t in shapes for i in layers
               if 0 <= i < n_layers and f"layer {i} {t}" not in halves]
    if cfg.get("layers_to_transform") is not None and (extra := sorted(
            k for k in halves if int(k.split()[1]) not in layers)):   # (peft would not load them: another function)
        raise ValueError(f"--init-adapter {path!r}: its adapter_config.json has layers_to_transform {list(layers)}, "
                         f"but adapter_model.safetensors holds tensors for {len(extra)} projections outside them "
                         f"({'; '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}), which peft does not load: a "
                         "hand-edited adapter; pass the adapter as it was saved")
    if missing:
        where = f" in layers {list(layers)}" if cfg.get("layers_to_transform") is not None else ""
        raise ValueError(f"--init-adapter {path!r}: its adapter_config.json names target_modules "
                         f"{cfg['target_modules']!r}{where}, but adapter_model.safetensors holds no tensors for "
                         f"{len(missing)} of those projections ({'; '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}): a damaged or hand-edited adapter, or one of a model "
                         f"with fewer layers (this one has {n_layers}); pass the adapter as it was saved")


def validate(args, margs, world: int):
    """Every check of a run's flags against the model's config.json and the world size -> (dims, pack)."""
    check_flags(args)
    dims = ParallelDims.from_args(world, args.dp_replicate, args.dp_shard, args.cp, args.cp_impl,
                                  args.ulysses_degree, margs.n_heads, margs.n_kv_heads)
    check_batch_sizes(args.global_batch, args.micro_batch, dims.dp)
    if getattr(args, "tiled_attn", False) and dims.cp > 1:
        raise ValueError(f"--tiled-attn with --cp {dims.cp}: the tiles run one process's whole-sequence attention, "
                         "and context parallelism splits the sequence across ranks already; drop one of them")
    # (--no-pack pads a row to its micro-batch's longest pair, and the padding joins the branch: 2 x --max-len there;
    # review, helper 47)
    from parallel.plan import sample_tokens  # (plan imports model.llama: here, not at the top)
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
    check_model_flags(args, margs)
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


def init_distributed(dt: str, timeout) -> bool:
    """torchrun's process group, or a 1-rank one for a plain process so the same code path runs.
    Returns whether it made the group (then the caller destroys it); one already up is kept."""
    if dist.is_initialized():
        return False
    backend = "nccl" if dt == "cuda" else "gloo"
    if "RANK" in os.environ:   # torchrun
        if dt == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = os.path.join(tempfile.mkdtemp(), "pg")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    return True


def dense_bf16_tflops(name: str) -> float | None:
    """Dense bf16 peak of known devices (SXM parts; a PCIe H100 is ~756: pass --peak-tflops)."""
    for key, tflops in (("H100", 989), ("H200", 989), ("B200", 2250), ("A100", 312), ("L40S", 362)):
        if key in name:
            return tflops
    return None


def device_type() -> str:
    """One CUDA device per rank with NCCL, or CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"
