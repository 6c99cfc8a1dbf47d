"""Per-rank memory plan from config.json and the run's flags: know in a second whether a layout fits.

Contract:
- `main(argv, run_parser)` (train.py's `--plan`; no process group, no weight read) parses the run's
  flags plus the planner's own (`--plan --help` lists them), validates with the run's one check
  (`parallel.mesh.validate`: a failure raises the run's ValueError), prints the terms below against the
  device memory and raises SystemExit naming what to change when it does not fit. `--suggest` lists
  every valid (cp, dp_shard, cp-impl) layout of the world size that fits, least communication first.
- `memory_plan(margs, dims, args, target)` -> `Plan` (named byte counts); bench/plan.py measures it.

Notation, per rank and micro-batch: T tokens (micro-batch · max-len padded to the CP divisor, / cp), D hidden,
H heads, K KV heads, K' the KV heads a rank attends with (max(K, U) under Ulysses degree U: replicated KV),
hd head dim, F intermediate, L layers, V vocab, r LoRA rank, W = dp_shard·cp (FSDP2's shard degree), e bytes
of the compute dtype (bf16 2, fp32 4), el of LoRA compute (e under FSDP2 mixed precision, i.e. CUDA bf16,
else 4), n the elements of one weight.

Persistent all step:
1. base weights. nf4: 4-bit codes, n/2 bytes per block Linear, stored as [n/(2·itemsize), 1] compute-dtype
   elements that FSDP2 shards over W along dim 0 (padded: ceil(rows/W) rows). The quantization state of
   `quantize_4bit(blocksize=64, compress_statistics=True)` is one absmax per 64 weights, itself quantized to
   uint8 with one fp32 absmax per 256 of them: ceil(n/64) + 4·ceil(n/64/256) bytes (0.127 bits/weight), plus
   16 + 256 fp32 code-book entries and an fp32 offset. The uint8 absmax codes are a parameter
   ([ceil(n/64/e), 1] compute-dtype elements) that FSDP2 shards over W with the codes and all-gathers with
   the block (term 5); only the fp32 rest is on the module, on every rank. none: n·e / W. Never quantized: embeddings,
   lm_head, norms, biases: e bytes per element / W.
2. root unsharded. fully_shard(model) owns embed_tokens, the final norm and lm_head; FSDP2 never reshards the
   root after forward (backward needs it at once), so the full (V·D·(2, or 1 tied) + D)·e stays all step.
3. LoRA: A [r, in] and B [out, r] per target in fp32: parameter + gradient + AdamW exp_avg, exp_avg_sq =
   16 bytes per element / W.
4. activations: what autograd saves (counted with saved_tensors_hooks on this decoder). Per layer: each RMSNorm
   keeps its fp32 input (pow) and rsqrt [T] (2·(4TD + 4T)); the normalized outputs that LoRA A saves (eTD each
   for q/k/v and for gate/up); the kernel's q, k, v, out, lse (eT·hd·(2H + 2K') + 4TH; o_proj's input is a view
   of out, except under Ulysses where heads_to_seq makes it new: + eT·H·hd); the MLP's gate output (silu),
   silu(gate) and up (the product) and its result (down's LoRA A): 4eTF; lora_B's input [T, r]·el per target
   (+ the fp32 input copy peft casts to when el != e; + dropout's output and mask when --lora-dropout > 0).
   Layer 0's first norm saves nothing (the embedding output needs no grad). With AC (non-reentrant
   checkpoint per block) only each block's input [T, D]·e is kept and one block is recomputed in backward.
   Also cos/sin (2eT·hd). The final norm's fp32 input and rsqrt (4T(D + 1)) and the loss' grad_hidden (eTD)
   are saved too, but freed by the first backward nodes, so they count in the loss phase (8) only.
Transient (the block phase 6-7 and the loss phase 8 never overlap):
5. FSDP2: one block unsharded in full (padded to W) for the current block + one prefetched (2 blocks), the
   all-gather output of one block before its copy-out, and one block's LoRA gradients unsharded plus their
   fp32 reduce-scatter input (lora·(el + 4)).
6. block backward, at its peak in the MLP (backward runs the block in reverse): the gradients of the product's
   two inputs (2eTF), the incoming residual gradient (eTD), for nf4 the largest weight dequantized (n·e); with
   AC, on top, the recomputed block (term 4 for one layer), all of it alive at that moment.
7. attention, later in the same block backward, when the MLP's 4eTF saved tensors and its gradients are gone:
   counted as max(0, attention buffers - 4eTF - term 6's gradients), the excess over what the MLP freed.
   Buffers: kernel backward dq, dk, dv (eT·hd·(H + 2K')), + 4eT·H·hd when K' < H (torch kernels expand K/V
   and dK/dV to H heads; flash-attn does not, so this over-counts there). Ulysses: all-to-all send and receive
   copies of q, k, v or their grads at [S_full, H/U, hd] (2eT·hd·(H + 2K')). Ring: the K/V block received and
   the one in flight (4eT·K'·hd) and fp32 accumulators: out or dq (4T·H·hd), dK/dV held and in flight
   (16T·K'·hd), lse (4TH). Hybrid: both.
8. loss phase, at the end of forward: the final norm's saved input and rsqrt and output (4T(D + 1) + eTD), the
   loss' grad_hidden (eTD), loss.CHUNK_BYTES of float32 logits ([c, V], c = CHUNK_BYTES // 4V tokens) plus a
   bf16 copy (2cV) for a bf16 weight, and one chunk's hidden gradient (ecD).
Peak = 1 + 2 + 3 + 4 + 5 + max(6 + 7, 8); planned total = peak · FRAGMENTATION + RUNTIME[target].
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from loss import CHUNK_BYTES
from parallel.mesh import validate

GB = 1e9
FRAGMENTATION = 1.10   # caching-allocator (CUDA) / malloc (CPU) slack on top of the live tensors
RUNTIME = {"cuda": 1.0e9,  # CUDA context (~0.5 GB) + NCCL communicators and their buffers
           "cpu": 0.5e9}   # Python + torch + transformers + peft + bitsandbytes imports: 0.41 GB RSS measured


_pad = lambda n, w: -(-n // w) * w   # n rounded up to a multiple of w (FSDP2 pads dim 0 to the shard count)


def quant_state_bytes(n: int) -> int:
    """bitsandbytes NF4 with nested absmax (term 1)."""
    blocks = -(-n // 64)
    return blocks + 4 * -(-blocks // 256) + 4 * (16 + 256 + 1)


@dataclass
class Plan:
    terms: dict = field(default_factory=dict)   # name -> bytes; the max() group is marked by "|"
    notes: list = field(default_factory=list)
    target: str = "cuda"
    alt_activations: float = 0.0                 # activations + recompute with AC toggled, for the printout

    @property
    def peak(self) -> float:
        fixed = sum(v for k, v in self.terms.items() if not k.startswith("|"))
        block = sum(v for k, v in self.terms.items() if k.startswith("| block"))
        return fixed + max(block, sum(v for k, v in self.terms.items() if k.startswith("| or:")))

    @property
    def total(self) -> float:
        return self.peak * FRAGMENTATION + RUNTIME[self.target]


def memory_plan(m, dims, args, target: str, pack: bool) -> Plan:
    """Term-by-term plan (see the module docstring) for ModelArgs `m` under ParallelDims `dims`."""
    e = 2 if (args.dtype or ("bf16" if target == "cuda" else "fp32")) == "bf16" else 4
    el = e if target == "cuda" and e == 2 else 4
    W, U, R = dims.dp_shard * dims.cp, dims.ulysses, dims.ring
    div, mb = dims.cp_divisor, args.micro_batch
    T = (_pad(args.max_len * mb, div) if pack else mb * _pad(args.max_len, div)) // dims.cp
    D, H, K, hd, F, L, V, r = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.intermediate_size, m.n_layers, \
        m.vocab_size, args.lora_r
    Kp = max(K, U)
    shapes = {"q_proj": (H * hd, D), "k_proj": (K * hd, D), "v_proj": (K * hd, D), "o_proj": (D, H * hd),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}   # (out, in)
    targets = [t for t in args.lora_targets.split(",") if t in shapes]
    nf4 = args.quant == "nf4"
    # one block's parameters: (dim 0, elements) in the compute dtype, plus LoRA (dim 0, elements) in fp32
    base = [(o * i // (2 * e), o * i // (2 * e)) if nf4 else (o, o * i) for o, i in shapes.values()]
    base += [(D, D)] * 2 + [(o, o) for t, (o, _) in shapes.items()
                            if (t in ("q_proj", "k_proj", "v_proj") and m.qkv_bias) or (t == "o_proj" and m.o_bias)
                            or (t.endswith(("gate_proj", "up_proj", "down_proj")) and m.mlp_bias)]
    lora = [(r, r * shapes[t][1]) for t in targets] + [(shapes[t][0], shapes[t][0] * r) for t in targets]
    root = [(V, V * D)] * (1 if m.tie_embeddings else 2) + [(D, D)]
    shard = lambda ps: sum(-(-d0 // W) * (n // d0) for d0, n in ps)   # FSDP2 dim-0 shard
    full = lambda ps: sum(_pad(d0, W) * (n // d0) for d0, n in ps)    # unsharded, padded
    lora_n = sum(n for _, n in lora)

    def layer_saved(first: bool) -> float:
        qkv = any(t in targets for t in ("q_proj", "k_proj", "v_proj"))
        gu = any(t in targets for t in ("gate_proj", "up_proj"))
        b = 2 * (4 * T * D + 4 * T) - (4 * T * D + 4 * T) * first + e * T * D * (qkv + gu)
        b += e * T * hd * (2 * H + 2 * Kp) + 4 * T * H + e * T * H * hd * (U > 1 and "o_proj" in targets)
        b += e * T * F * (3 + ("down_proj" in targets))
        b += sum(T * r * el + (4 * T * shapes[t][1] if el != e else 0) for t in targets)
        if args.lora_dropout > 0:
            b += sum(T * shapes[t][1] * (el + 1) for t in targets)
        return b

    every = (L - 1) * layer_saved(False) + layer_saved(True)
    ckpt = L * e * T * D
    p = Plan(target=target)
    q = "nf4 packed" if nf4 else {2: "bf16", 4: "fp32"}[e]
    t = p.terms
    t[f"base weights shard ({q}, 1/{W} of {L} blocks)"] = L * shard(base[:7]) * e
    qa = [(-(-o * i // 64 // e), -(-o * i // 64 // e)) for o, i in shapes.values()] if nf4 else []
    if nf4:   # the uint8 absmax codes are a parameter sharded with the block (model/qlora.py); the rest is not
        t[f"quantization state (absmax 1/{W}, {L} blocks)"] = L * sum(
            quant_state_bytes(o * i) - o * i // 64 for o, i in shapes.values()) + L * shard(qa) * e
    t[f"embeddings, lm_head, norms, biases shard (1/{W})"] = (shard(root) + L * shard(base[7:])) * e
    t["root unsharded all step (embed, lm_head, final norm)"] = full(root) * e
    t[f"LoRA params + grads + AdamW m, v (fp32, 1/{W})"] = 4 * 4 * L * shard(lora)
    t[(f"activations: {L} block checkpoints [{T}, {D}]" if args.ac else
       f"activations: saved tensors of {L} blocks at {T} tokens")] = ckpt if args.ac else every
    t["activations: rope cos/sin"] = 2 * e * T * hd
    blk = full(base + qa) * e + full(lora) * el
    t["FSDP2: 2 unsharded blocks (current + prefetch)"] = 2 * blk
    t["FSDP2: all-gather output + LoRA-grad reduce-scatter (1 block)"] = blk + lora_n * (el + 4)
    dequant = max(o * i for o, i in shapes.values()) * e if nf4 else 0
    if args.ac:
        t["| block recompute (AC): one block's saved tensors"] = layer_saved(False)
    mlp = 2 * e * T * F + e * T * D + dequant
    t["| block backward at the MLP: grads" + (", dequantized weight" if nf4 else "")] = mlp
    attn = e * T * hd * (H + 2 * Kp) + (4 * e * T * H * hd if Kp < H else 0)
    what = "kernel"
    if U > 1:
        attn += 2 * e * T * hd * (H + 2 * Kp)
        what += "+a2a"
    if R > 1:
        attn += 4 * e * T * Kp * hd + 4 * T * hd * (H + 4 * Kp) + 4 * T * H
        what += "+ring"
    t[f"| block attention over the freed MLP ({what} {attn / GB:.2f} GB)"] = max(0, attn - 4 * e * T * F - mlp)
    c = max(1, min(T, CHUNK_BYTES // (4 * V)))
    t["| or: final norm input + loss grad_hidden (saved)"] = 4 * T * (D + 1) + e * T * D
    t["| or: final norm output + chunked loss block"] = e * T * D + 4 * c * V + (2 * c * V if e == 2 else 0) + e * c * D
    p.alt_activations = (every if args.ac else ckpt + layer_saved(False))
    p.notes.append(f"{T} tokens per rank per micro-batch ({'packed' if pack else 'padded'} rows, CP divisor {div})")
    return p


# ------------------------------------------------------------------------------------------------ CLI


def _with(args, **kw):
    return argparse.Namespace(**{**vars(args), **kw})


def _layouts(args, margs, world):
    """Every (cp, impl, ulysses degree) for this world, validated; least communication first."""
    out = []
    for cp in (c for c in range(1, world + 1) if world % (c * args.dp_replicate) == 0):
        impls = [("ulysses", None), ("ring", None)] + [("hybrid", u) for u in range(2, cp) if cp % u == 0]
        for rank, (impl, u) in enumerate(impls[:1] if cp == 1 else impls):
            a = _with(args, cp=cp, dp_shard=-1, cp_impl=impl, ulysses_degree=u)
            try:
                dims, pack = validate(a, margs, world)
            except ValueError:
                continue
            out.append((cp, dims.ring, rank, a, dims, pack))
    return [x[3:] for x in sorted(out, key=lambda x: x[:3])]


def _flags(a, dims) -> str:
    return f"--cp {a.cp} --dp-shard {dims.dp_shard} --cp-impl {a.cp_impl}" + (
        f" --ulysses-degree {a.ulysses_degree}" if a.ulysses_degree else "")


def _fixes(args, margs, world, target, mem):
    """Single changes that make the plan fit, as flag strings with their totals."""
    tries = [(f, _with(args, **kw), world) for f, kw, ok in (
        ("--ac", dict(ac=True), not args.ac), ("--quant nf4", dict(quant="nf4"), args.quant != "nf4"),
        ("--micro-batch 1", dict(micro_batch=1), args.micro_batch > 1)) if ok]
    tries += [(_flags(a, dims), a, world) for a, dims, _ in _layouts(args, margs, world) if a.cp > args.cp]
    for k in (2, 4, 8):
        tries.append((f"more ranks: --world-size {world * k} --cp {args.cp * k} (--cp-impl auto)",
                      _with(args, cp=args.cp * k, cp_impl="auto", ulysses_degree=None), world * k))
    out, seen = [], set()
    for flags, a, w in tries:
        kind = flags.split()[0] if flags.startswith("--") else flags[:10]
        try:
            dims, pack = validate(a, margs, w)
        except ValueError:
            continue
        total = memory_plan(margs, dims, a, target, pack).total
        if total <= mem and kind not in seen:   # the first (least communication) of each kind
            seen.add(kind)
            out.append(f"{flags} ({total / GB:.1f} GB)")
    return out


def _budget(args, world):
    import torch
    if torch.cuda.is_available():
        mem = args.gpu_mem * GB if args.gpu_mem else torch.cuda.get_device_properties(0).total_memory
        src = "--gpu-mem" if args.gpu_mem else torch.cuda.get_device_name()
        return "cuda", mem, f"{mem / GB:.1f} GB per GPU ({src})"
    if args.gpu_mem:
        return "cuda", args.gpu_mem * GB, f"{args.gpu_mem:.1f} GB per GPU (--gpu-mem: planning CUDA from a CPU machine)"
    import psutil
    ram = psutil.virtual_memory().total
    return "cpu", ram / world, (f"{ram / world / GB:.1f} GB per rank: no CUDA device and no --gpu-mem, so this "
                                f"machine's RAM ({ram / GB:.1f} GB, psutil) shared by {world} CPU ranks")


def parse_args(argv, run_parser, demo: dict):
    """The run's flags (`run_parser`, built with add_help=False) plus the planner's own; with neither
    --model nor --data, the run's demo defaults (its assets are built if missing), as a run would."""
    p = argparse.ArgumentParser(prog="train.py --plan", parents=[run_parser],
                                description="Per-rank memory plan of a run, from config.json only.")
    a = p.add_argument
    a("--suggest", action="store_true", help="list the layouts that fit, best first")
    a("--gpu-mem", type=float, default=None, help="GB per device (default: this device's)")
    a("--world-size", type=int, default=None, help="ranks to plan for (default: launched, else 1)")
    args = p.parse_args(argv)
    if args.model is None and args.data is None:
        from data import make_demo
        make_demo(os.path.dirname(demo["model"]))
        p.set_defaults(**demo)
        args = p.parse_args(argv)
    return args


def main(argv, run_parser, demo: dict):
    from model.load import read_args

    args = parse_args(argv, run_parser, demo)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    margs = read_args(args.model)
    target, mem, where = _budget(args, world)
    if args.suggest:   # every valid layout, best first; only those that fit are printed
        rows = []
        for a, dims, pack in _layouts(args, margs, world):
            p = memory_plan(margs, dims, a, target, pack)
            if p.total <= mem:
                rows.append(f"  {_flags(a, dims):<58} {p.total / GB:7.1f} GB  {dims}")
        print(f"layouts that fit in {where}, least communication first:\n" + "\n".join(rows or ["  none"]))
        if not rows:
            raise SystemExit(f"no layout of {world} ranks fits; try --ac, --quant nf4, a lower --max-len or more ranks")
        return rows
    dims, pack = validate(args, margs, world)   # a ValueError, as in the run: train.py prints "error: <fix>"
    p = memory_plan(margs, dims, args, target, pack)
    e = args.dtype or ("bf16" if target == "cuda" else "fp32")
    n, (u, un) = margs.n_params, ((GB, "GB") if p.total >= 10 * GB else (1e6, "MB"))
    print(f"plan: {margs.model_type} {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'} params, {dims}\n"
          f"      --max-len {args.max_len} --micro-batch {args.micro_batch}, quant {args.quant}, {e}, "
          f"AC {'on' if args.ac else 'off'}, LoRA r {args.lora_r}; {p.notes[0]}")
    print(f"  {'per-rank memory':<72}{un:>8}")
    for k, v in p.terms.items():
        print(f"  {k:<72}{v / u:8.2f}")
    print(f"  {'peak of live tensors (the | lines: the larger of block vs loss)':<72}{p.peak / u:8.2f}")
    print(f"  {f'x {FRAGMENTATION:.2f} fragmentation + {RUNTIME[target] / GB:.1f} GB runtime ({target})':<72}"
          f"{p.total / u:8.2f}")
    other = "without" if args.ac else "with"
    print(f"  ({other} AC the activations would be {p.alt_activations / u:.2f} {un})")
    if p.total > mem:
        fixes = _fixes(args, margs, world, target, mem)
        raise SystemExit(f"does not fit: {p.total / GB:.1f} GB planned > {where}.\nWhat to change: "
                         + ("; ".join(fixes) if fixes else "no single change fits: raise --cp and enable --ac, "
                            "use --quant nf4, lower --max-len, or use more ranks / larger devices"))
    print(f"fits: {p.total / GB:.1f} GB of {where}")
    return p
