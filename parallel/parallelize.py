"""The one place that assembles the trainable model; the order is what makes LoRA, CP and FSDP2 compose.

    1. skeleton on the meta device        no memory, no random init of a 70B model
    2. nn.Linear -> NF4Linear (4-bit)     before peft, so peft wraps the 4-bit layer with its
                                          4-bit LoRA layer (LoRA outside the quantized base)
    3. LoRA with peft                     before sharding, so FSDP2 shards LoRA parameters together
                                          with the block they belong to; only LoRA is trainable; its
                                          scaled add fused into lora_B's GEMM (model.qlora.fuse_lora)
    4. memory steps (parallel/memory.py)  wrap forwards (parameter names unchanged) before fully_shard,
                                          so FSDP2's hooks stay outside: the pre-backward all-gather
                                          has run when a recompute starts; first apply_unread_outputs
                                          (parallel/recompute.py: no GEMM for outputs nobody reads)
       a. apply_tiled_mlp (--tiled-mlp)   the MLP over tiles of tokens, recomputed tile by tile;
          apply_tiled_attention           the attention sublayer over tiles of query rows (one process)
          (--tiled-attn)
       b. apply_ac: checkpoint each block inside it, the tiled MLP keeps only its input; with
          (--offload-activations,         --offload-activations the saved block inputs go to host memory;
           --ac-group, --ac-blocks)       --ac-group G: one more checkpoint around each G blocks;
                                          --ac-blocks N: only the first N blocks are checkpointed
       c. apply_compile (--compile)       torch.compile of RMSNorm, RoPE and SwiGLU (parallel/compile.py)
       d. apply_norm_rebuild              LoRA A (and the tiled MLP) keep a block norm's input, not its
                                          output, rebuilt in backward; after c, so it calls compiled code
       e. apply_host_table                Gemma 4 E2B / E4B's per-layer-embedding table kept in host memory
          (unless --ple-on-device)        (parallel/host_table.py): 6 and FSDP2 leave it there
    5. fully_shard each block, then root  one all-gather per block; root last so it owns the rest (its frozen
                                          embeddings, final norm, lm_head stay whole: parallel/fsdp.py)
    6. materialise (to_empty)             each rank allocates only its shards
    7. stream weights from safetensors    each rank keeps only its shard; NF4 quantized on device
    8. deterministic LoRA init            depends on the seed only: same adapter for any mesh

CP needs no step here: the attention core (`attention=`, see model/attention.py) calls the CP
attention, and LoRA acts on the projections outside it. The trainer calls the returned `Transformer`
directly (peft's wrapper calls `forward` without `__call__`, which would skip FSDP2's hooks); the
`PeftModel` is kept for export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from model.attention import SDPAAttention
from model.llama import Transformer
from model.load import CheckpointReader, read_args
from model.lora_spec import DEFAULT_TARGETS, lora_layers
from model.nf4 import apply_nf4, pack_nf4_weights
from model.norms import is_norm_weight, is_saved_weight
from model.qlora import apply_lora, fuse_lora, init_lora, set_param
from model.weights import load_weights
from parallel.ac import apply_ac, check_ac
from parallel.compile import apply_compile
from parallel.cp import KernelAttention
from parallel.fsdp import apply_fsdp
from parallel.host_table import apply_host_table
from parallel.memory import apply_norm_rebuild, apply_tiled_mlp
from parallel.recompute import apply_unread_outputs
from parallel.tiled_attention import apply_tiled_attention


@dataclass
class BuildOptions:
    path: str
    quant: str = "nf4"                     # "nf4" or "none"
    dtype: torch.dtype = torch.float32     # base-weight / compute dtype (bf16 on CUDA)
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: tuple = field(default=DEFAULT_TARGETS)   # (those the model lacks dropped: model_targets)
    rslora: bool = False                   # scale alpha / sqrt(r) (peft's use_rslora)
    dora: bool = False                     # DoRA (peft's use_dora; model/dora.py)
    lora_layers: tuple | None = None       # the blocks adapted (None: all; peft's layers_to_transform)
    train_norms: bool = False              # the RMSNorm weights train too (model/norms.py)
    train_embeddings: bool = False         # the input embedding trains too (model/norms.py)
    ac: bool = True
    compile: bool = False                  # torch.compile RMSNorm, RoPE and SwiGLU (apply_compile)
    tiled_mlp: bool = False                # MLP over tiles of tokens (parallel/memory.py)
    tiled_attn: bool = False               # attention sublayer over tiles of query rows (parallel/tiled_attention.py)
    offload_activations: bool = False      # AC's saved block inputs in (pinned) host memory
    offload_reserve: int = 0               # bytes of each host buffer at least (the plan's input at the longest row)
    ac_group: int = 1                      # blocks per kept checkpoint (apply_ac)
    ac_blocks: int | None = None           # checkpoint only the first N blocks (None: all)
    ac_keep_attn: bool = False             # checkpoints keep the attention kernels' outputs (apply_ac)
    ple_on_device: bool = False            # Gemma 4 E2B / E4B's per-layer table on the device (else host memory)
    seed: int = 0
    rope_scaling: str | None = None        # --rope-scaling: replaces config.json's (model.rope_read.rope_scaling_flag)
    init_adapter: str | None = None        # --init-adapter: LoRA starts from this PEFT adapter's tensors
    mixed_precision: bool | None = None    # FSDP2 hands the float32 trained tensors to forward in `dtype` (None: on
    # CUDA with dtype != float32, what a run does; True: on CPU too, the CUDA path's dtypes under gloo, for tests)

    @classmethod
    def from_args(cls, args, dtype: torch.dtype, plan=None) -> BuildOptions:
        """The options of a run (train.py's flags; `plan`, its memory plan: the offload's host buffers' size)."""
        return cls(args.model, quant=args.quant, dtype=dtype, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                   lora_dropout=args.lora_dropout, lora_targets=tuple(args.lora_targets.split(",")),
                   rslora=getattr(args, "rslora", False), dora=getattr(args, "dora", False),
                   lora_layers=lora_layers(getattr(args, "lora_layers", None)),
                   train_norms=getattr(args, "train_norms", False),
                   train_embeddings=getattr(args, "train_embeddings", False), ac=args.ac,
                   seed=args.seed, tiled_mlp=args.tiled_mlp, tiled_attn=args.tiled_attn,
                   offload_activations=args.offload_activations, offload_reserve=int(getattr(plan, "host_each", 0)),
                   compile=args.compile, ac_group=args.ac_group, ac_blocks=args.ac_blocks,
                   ac_keep_attn=args.ac_keep_attn, ple_on_device=getattr(args, "ple_on_device", False),
                   rope_scaling=getattr(args, "rope_scaling", None),
                   init_adapter=None if getattr(args, "resume", None) else getattr(args, "init_adapter", None))


def build_model(opts: BuildOptions, *, fsdp_mesh=None, attention=None, linear=None, device=None):
    """Return (transformer, peft_model). `fsdp_mesh=None` builds the plain single-process model; `attention`, `linear`:
    the attention and linear-attention cores (model.llama.Transformer's; None: one process's)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if opts.quant not in ("nf4", "none"):
        raise ValueError(f"--quant must be nf4 or none, got {opts.quant!r}")
    if opts.offload_activations and not opts.ac:
        raise ValueError("--offload-activations moves the checkpoints of --ac to host memory: drop --no-ac")
    check_ac(opts.ac_group, opts.ac, opts.offload_activations, opts.ac_blocks, opts.ac_keep_attn, opts.tiled_attn)
    args = read_args(opts.path, opts.rope_scaling)
    reader = CheckpointReader(opts.path)
    with torch.device("meta"):                                              # 1
        model = Transformer(args, attention=attention, linear=linear)
        model.to(opts.dtype)
        if opts.quant == "nf4":                                             # 2
            apply_nf4(model, storage_dtype=opts.dtype)
        peft_model = apply_lora(model, opts.lora_r, opts.lora_alpha, opts.lora_dropout,
                                opts.lora_targets, opts.rslora, opts.dora, opts.lora_layers, opts.train_norms,
                                opts.train_embeddings)   # 3
        fuse_lora(model)
        if opts.quant == "nf4":
            pack_nf4_weights(model)
    apply_unread_outputs(model)   # bases whose output nobody reads in a recompute or a backward tile
    if opts.tiled_mlp:                                                      # 4a
        apply_tiled_mlp(model)
    if opts.tiled_attn:
        if attention is not None and not isinstance(attention, (KernelAttention, SDPAAttention)):
            raise ValueError("--tiled-attn tiles one process's whole-sequence attention; with context "
                             "parallelism (--cp > 1) the sequence is split across ranks already: drop one of them")
        apply_tiled_attention(model)
    if opts.ac:                                                             # 4b
        apply_ac(model, opts.offload_activations, opts.ac_group, opts.ac_blocks, opts.ac_keep_attn,
                 opts.offload_reserve)
    if opts.compile:                                                        # 4c
        apply_compile(model)
    apply_norm_rebuild(model)                                               # 4d
    if not opts.ple_on_device:                                              # 4e
        apply_host_table(model)
    if fsdp_mesh is not None:                                               # 5
        mp = None
        if opts.dtype != torch.float32 and (device.type == "cuda" if opts.mixed_precision is None
                                            else opts.mixed_precision):
            mp = MixedPrecisionPolicy(param_dtype=opts.dtype, reduce_dtype=torch.float32)
        apply_fsdp(model, fsdp_mesh, mp)
    model.to_empty(device=device)                                           # 6
    if args.tie_embeddings and not isinstance(model.model.embed_tokens.weight, DTensor):   # plain, or FSDP-ignored
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, reader, device)                                     # 7
    reader.close()
    init_lora(model, opts.seed)                                             # 8
    if opts.init_adapter:
        init_from_adapter(model, opts.init_adapter)
    return model, peft_model


def init_from_adapter(model, path: str) -> None:
    """Copy a PEFT adapter's tensors into the LoRA parameters they name (this rank's shard of each); projections the
    adapter does not cover keep init_lora's start (B = 0: no change to the function)."""
    from model.adapter_read import read_init_adapter

    params = dict(model.named_parameters())
    for name, t in read_init_adapter(path).items():
        p = params.get(name)
        if is_saved_weight(name) and (p is None or not p.requires_grad):   # (check_init_adapter wants the flags)
            raise ValueError(f"--init-adapter {path!r}: its trained weight {name} is not one this run trains "
                             "(--train-norms trains the norms of the --lora-layers blocks and the final one; "
                             "--train-embeddings the input embedding)")
        if not (re.search(r"\.lora_([AB]|magnitude_vector)\.default\.weight$|\.experts_lora\..*\.lora_[AB]\.weight$",
                          name) or is_saved_weight(name)) or \
                p is not None and not p.requires_grad:
            raise ValueError(f"--init-adapter {path!r}: its tensor {name} is not a LoRA A/B weight or DoRA magnitude: "
                             "an adapter with trained biases or saved modules is not one this run can start from")
        if p is None or tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"--init-adapter {path!r}: its tensor {name} {tuple(t.shape)} "
                             + ("has no LoRA parameter in this model" if p is None else
                                f"does not fit this model's {tuple(p.shape)}") + ": an adapter of another base model?")
        set_param(p, t.to(p.dtype))


def lora_parameters(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad]


def lora_groups(model, plus_ratio: float | None = None) -> list:
    """make_optimizer's params: the LoRA tensors; with LoRA+ (`--lora-plus-ratio R`, Hayou et al. 2024) two groups,
    the B matrices' marked `lr_ratio` R: train.py sets each group's LR to lr_at's × its lr_ratio (as peft's
    create_loraplus_optimizer groups them: tests/test_optimizer.py). --train-norms' weights: a group of their own
    without weight decay (transformers' Trainer keeps norms out of it; with LoRA+ at B's LR, as peft's 1-D tensors)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not is_norm_weight(n)]
    norms = [p for n, p in model.named_parameters() if p.requires_grad and is_norm_weight(n)]
    extra = [{"params": norms, "weight_decay": 0.0, **({"lr_ratio": plus_ratio} if plus_ratio else {})}] * bool(norms)
    if not plus_ratio:
        return [p for _, p in named] if not norms else [{"params": [p for _, p in named]}, *extra]
    b = [("lora_B" in n or p.ndim == 1) for n, p in named]   # (peft's: B and 1-D tensors, DoRA's magnitudes)
    return [{"params": [p for (_, p), is_b in zip(named, b) if not is_b]},
            {"params": [p for (_, p), is_b in zip(named, b) if is_b], "lr_ratio": plus_ratio}, *extra]
