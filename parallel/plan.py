"""Per-rank memory plan from config.json and the run's flags: know in a second whether a layout fits.

Contract:
- `memory_plan(margs, dims, args, target, pack)` -> `Plan` (named byte counts, with its peak and total:
  parallel/plan_totals.py); bench/plan.py measures it.
- train.py's `--plan` prints these terms against the device memory: its command line is parallel/plan_cli.py's
  `main` (the verdict, the fixes, `--suggest`, `--host-mem`), its searches (`--max-len auto`) parallel/plan_search.py.

Notation, per rank and micro-batch: T tokens (micro-batch · max-len padded to the CP divisor, / cp), D hidden,
H heads, K KV heads, K' the KV heads a rank attends with (max(K, U) under Ulysses degree U: replicated KV),
hd head dim, F intermediate, L layers, V vocab, r LoRA rank, W = dp_shard·cp (FSDP2's shard degree), e bytes
of the compute dtype (bf16 2, fp32 4), el of LoRA compute (e under FSDP2 mixed precision, i.e. CUDA bf16,
else 4), n the elements of one weight.

Persistent all step:
1. base weights. nf4: n/2 bytes of codes per block Linear as [n/(2·itemsize), 1] compute-dtype elements, FSDP2-
   sharded over W on dim 0 (ceil(rows/W) rows). `quantize_4bit(blocksize=64, compress_statistics=True)`'s state:
   one uint8 absmax per 64 weights (a parameter, [ceil(n/64/e), 1] elements sharded and all-gathered with the
   codes, term 5) and one fp32 absmax per 256 of those, 16 + 256 fp32 code-book entries and an fp32 offset on
   the module on every rank. none: n·e / W. Never quantized: block norms, biases: e bytes per element / W.
2. root. embed_tokens, final norm, lm_head: frozen, outside FSDP2 (parallel/fsdp.py), (V·D·(2, or 1 tied) + D)·e.
3. LoRA: A [r, in] and B [out, r] per target in fp32: parameter, gradient, AdamW's two: 16 bytes per element / W.
   --dora: + the magnitude [out] per target, alike (sharded, unsharded and reduce-scattered with A and B).
   --lora-layers: of the A adapted blocks only (A for L; term 5 is one block's: an adapted one).
   --train-norms: + each adapted block's norms (2 [D], Gemma 3's 4; Qwen3's q/k norms 2 [hd]) alike; the final norm
   [D] leaves term 2 for the root's FSDP2 shard with its AdamW state. In term 4 block lo then saves as the others (its
   first norm keeps its input, whose output needs grad).
   --train-embeddings: the embedding (a tied model's head with it) leaves term 2 for one of its own, V·D in LoRA's
   dtype (the root's unsharded copy for the step) + 16 bytes per element / W (float32 master, gradient, AdamW's two);
   block 0 saves as the others, the first checkpoint keeps the embedding's output (not the ids), the embedding's
   backward the int64 ids (8T) (so --offload-activations moves N - lo block inputs to host, not N - 1, and --ac-group
   keeps the first group's input too); and a phase of its own, the last in backward, once the activations are
   gone ("| end:"): its [V, D] gradient beside FSDP2's float32 reduce-scatter input. A tied model's head adds the
   loss's share of that gradient: V·D float32 in the loss's forward (+ a [V, D] product per chunk in bf16, + the CPU
   bf16 head's cast), saved, then V·D·e held through the backward until the embedding's adds to it. With a DPO
   reference model (untied only), that model's embedding too: V·D in LoRA's dtype, whole on every rank.
4. activations: what autograd saves (counted with saved_tensors_hooks on this decoder). Per layer: each RMSNorm keeps
   its input and rsqrt [T] (2·(eTD + 4T)); LoRA A on q/k/v and on gate/up keeps that same input, not the norm's
   output (parallel.memory.apply_norm_rebuild rebuilds it in backward); the kernel's q, k, v, out, lse (eT·hd·(2H +
   2K') + 4TH; o_proj's input is a view of out, except under Ulysses where heads_to_seq makes it new: + eT·H·hd); the
   MLP's gate output (silu), silu(gate) and up (the product) and its result (down's LoRA A): 4eTF (3eTF when el != e:
   down's LoRA A keeps its cast, not the product); lora_B's input [T, r]·el per target (+ the fp32 input copy peft
   casts to when el != e, but for dropout; + dropout's output and mask when --lora-dropout > 0: the mask a bool on
   CUDA, in el on CPU; none at block lo's q/k/v, whose input needs no grad; down_proj's dropped input in place of the
   MLP's product, so its mask alone, when el == e; peft casts before dropout, so the cast is not kept beside it).
   --tiled-mlp: the MLP keeps only its norm's input (saved
   already), none of its [T, F] tensors or LoRA intermediates, and not that norm's rsqrt (the tiles run the norm,
   parallel/memory.py). Layer 0's first norm saves nothing (the embedding output needs no grad), so q/k/v's LoRA A keeps
   its output there (eTD, when handed it directly: no cast, no dropout). With AC (non-reentrant checkpoint per block)
   only each block's input [T, D]·e is kept and one block is recomputed in backward (its saved tensors less that input,
   which the first norm saves again without a copy). The first checkpoint keeps the token ids, not the embedding's
   output, and looks them up again (ac._FromIds): max(N - 1, 1) inputs (N - 1 with --ac-blocks); not with
   --neftune-alpha, whose noise changes that output in place (kept whole, offloaded, as a trained embedding's). The
   forward's last block (L - 1 inputs, one block's forward) stays under the backward's block phase (CPU, measured).
   --tiled-attn: the sublayer keeps its input (the norm's, layer 0's too), k, v, out, lse: no q, rsqrt or LoRA
   intermediate of q/k/v/o (parallel/tiled_attention.py).
   --offload-activations: the L - 1 block inputs live in pinned host memory (host term, against --host-mem; on
   CPU the same RAM), the device holds one at the block's peak: the block being recomputed. The next one is
   prefetched once the block's attention backward is done (parallel/offload.py): it adds to the q/k/v phase (9).
   --ac-blocks N: only the first N blocks are checkpointed (N - 1 inputs), the last K = L - N keep their saved
   tensors (term 4 each); backward frees those before it recomputes any block, so the recompute (term 6's
   AC part, smaller than one block's saved tensors) never adds to them and is not counted when K > 0.
   --ac-keep-attn: each checkpointed block also keeps its attention kernel's out and lse (eT·H·hd + 4TH; R
   times under ring, one per ring step); the block being recomputed takes its own over, so the block phase
   (6) counts them once: its recompute term is that much smaller.
   --ac-group G: ceil(L/G) - 1 group inputs are kept; a group's backward recomputes it up to its last block
   (block phase: G' - 1 more block inputs and, under FSDP2, G' - 1 blocks left unsharded, G' = min(G, L)).
   --dora (model/dora.py), per adapted projection of o outputs: the fused path keeps its sum `out` for the
   magnitude's gradient, the norm and the scale: e(T + 2)·o. peft's formula (LoRA dropout, a cast: dora.forward)
   keeps the base's and LoRA's shares and three [o], el(2T + 3)·o (without dropout the base's share is the base
   layer's own output, e·T·o: el != e is the CPU's bf16; the share on the dropped input saves no weight:
   model.dora._FrozenLinear dequantizes again in backward); at layer 0 q/k/v one [o] less (their input needs no
   grad). As autograd saves them.
   --lora-layers (lowest adapted block lo): the embedding is frozen, so blocks below lo need no grad: they save
   nothing, their checkpoints keep nothing, no backward runs there; block lo saves as layer 0 does, and its input is
   kept whole (no ids to look up again: N - lo checkpoint inputs, N - lo offloaded; ceil(L/G) - floor(lo/G) group
   inputs, one fewer when lo < G). Un-adapted blocks above lo save no LoRA tensors (B's inputs, down_proj's A input,
   Ulysses' o_proj input, dropout's, DoRA's). The recompute term is the largest block's, less the block inputs
   above it (freed by then; tests/test_plan.py checks these against autograd's saved tensors).
   Qwen3.5's gated attention (attn_gate; q_proj [2·H·hd, D]: each head's query and gate): sigmoid(gate) eT·H·hd
   where the gate or the core's output needs grad, and the gated product (o_proj's input, no view of out) for o_proj's
   LoRA A when handed it directly (eT·H·hd; under Ulysses the product keeps heads_to_seq's output instead of o_proj's
   LoRA A, where the gate needs grad); --tiled-attn recomputes the gate: none.
   Also cos/sin (2eT·R, R the rotated dims: hd but for Qwen3.5's partial RoPE; 4eT·R with Ministral 3's q tables,
   which carry its attention temperature: no other tensor;
   Gemma 3's two tables, full and sliding layers': 4eT·hd). The final norm's input and rsqrt
   (eTD + 4T) and the loss' grad_hidden (eTD) are saved too, but freed by the first backward nodes, so they count in
   the loss phase (8) only. Gemma 3's norms on the sublayers' outputs keep their inputs and rsqrt: 2·(eTD + 4T) more
   per block; its scaled embedding output is a new tensor, kept whole by the first checkpoint (no ids), as Granite's
   (× embedding_multiplier; its other multipliers and logits / logits_scaling save nothing). SmolLM3's NoPE layers
   hand the kernel q and k as projected (the same bytes; the tables are made once for the RoPE layers, and a RoPE
   layer's q/k/v backward (9) is the largest; plan_speed leaves their RoPE pass out).
Transient (the block phases 6, 7, 9 and the loss phase 8 never overlap):
5. FSDP2: one block unsharded in full (padded to W) for the current block + one prefetched (2 blocks), the
   all-gather output of one block before its copy-out, and one block's LoRA gradients unsharded plus their
   fp32 reduce-scatter input (lora·(el + 4)).
6, 7. the block backward's MLP and attention phases: parallel/plan_block.py.
8. the loss phase, at the end of forward (and a tied head's or a trained embedding's gradient): parallel/plan_block.py.
9, 10. the block backward's q/k/v phase and AC + --tiled-mlp's recompute forward: parallel/plan_block.py.
Qwen3-MoE's blocks (experts, router; their saved tensors and MLP phase) in these terms: parallel/plan_moe.py.
Peak and planned total from these terms: `Plan.peak`, `Plan.total` (parallel/plan_totals.py).
Host (--offload-activations on CUDA): (L - 1)·eTD pinned bytes per rank, planned against --host-mem.
"""

from __future__ import annotations

from functools import partial

from model.lora_spec import lora_layers
from parallel import kernels, plan_block, plan_moe
from parallel.plan_totals import Plan, sample_tokens, with_reference

_pad = lambda n, w: -(-n // w) * w   # n rounded up to a multiple of w (FSDP2 pads dim 0 to the shard count)


def quant_state_bytes(n: int) -> int:
    """bitsandbytes NF4 with nested absmax (term 1)."""
    blocks = -(-n // 64)
    return blocks + 4 * -(-blocks // 256) + 4 * (16 + 256 + 1)


def memory_plan(m, dims, args, target: str, pack: bool) -> Plan:
    """Term-by-term plan (see the module docstring) for ModelArgs `m` under ParallelDims `dims`."""
    e = 2 if (args.dtype or ("bf16" if target == "cuda" else "fp32")) == "bf16" else 4
    el = e if target == "cuda" and e == 2 else 4
    W, U, R = dims.dp_shard * dims.cp, dims.ulysses, dims.ring
    div, mb = dims.cp_divisor, args.micro_batch or 1   # (auto, 0: rows of the longest sample's length)
    S = sample_tokens(args)
    T = (_pad(S * mb, div) if pack else mb * _pad(S, div)) // dims.cp
    D, H, K, hd, F, L, V, r = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.intermediate_size, m.n_layers, \
        m.vocab_size, args.lora_r
    Kp = max(K, U)
    shapes = {"q_proj": (H * hd * (1 + m.attn_gate), D), "k_proj": (K * hd, D), "v_proj": (K * hd, D),
              "o_proj": (D, H * hd), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}   # (out, in);
    # Qwen3.5's q_proj gives each head its gate too
    targets = [t for t in args.lora_targets.split(",") if t in shapes]
    nf4 = args.quant == "nf4"
    tiled, offload, ta = (getattr(args, f, False) for f in ("tiled_mlp", "offload_activations", "tiled_attn"))
    G = min(getattr(args, "ac_group", 1), L) if args.ac else 1
    N = (L if getattr(args, "ac_blocks", None) is None else min(args.ac_blocks, L)) if args.ac else 0
    KV, K = K, L - N   # K from here: the blocks that keep their activations (the last K; no AC at all when N == 0)
    if offload and not args.ac:
        raise ValueError("--offload-activations moves the checkpoints of --ac to host memory: drop --no-ac")
    # one block's parameters: (dim 0, elements) in the compute dtype, plus LoRA (dim 0, elements) in fp32
    packed = lambda ws: [(o * i // (2 * e), o * i // (2 * e)) if nf4 else (o, o * i) for o, i in ws]
    kinds = plan_moe.kinds(m, shapes)   # (blocks, frozen Linears, router rows): dense and MoE blocks (Qwen3-MoE)
    moe = m.moe is not None and any(m.moe.sparse(i) for i in range(L))
    base = []
    nb = 4 if m.sandwich_norms else 2   # block norms [D] (Gemma 3: two more, on the sublayers' outputs)
    pre, post = not m.post_norms, m.sandwich_norms or m.post_norms   # norms in front of / on the sublayers' outputs
    base += [(D, D)] * nb + [(o, o) for t, (o, _) in shapes.items()
                            if (t in ("q_proj", "k_proj", "v_proj") and m.qkv_bias) or (t == "o_proj" and m.o_bias)
                            or (t.endswith(("gate_proj", "up_proj", "down_proj")) and m.mlp_bias)]
    dora = getattr(args, "dora", False)   # + DoRA's magnitude [out] per target, trained and sharded as A and B
    chosen = lora_layers(getattr(args, "lora_layers", None))   # --lora-layers: the blocks adapted (None: all)
    adapted = [i for i in range(L) if chosen is None or i in chosen] or [L - 1]   # (mesh.validate refuses none)
    A, lo = len(adapted), adapted[0]   # blocks below lo need no grad: they save nothing, no backward runs there
    lora = [(r, r * shapes[t][1]) for t in targets] + [(shapes[t][0], shapes[t][0] * (r + dora)) for t in targets]
    norms = getattr(args, "train_norms", False)   # --train-norms: an adapted block's norms train as LoRA does
    qk = [(hd * n, hd * n) for n in ((H, KV) if m.qk_norm_whole else (1, 1))] * m.qk_norm   # (OLMo's: H·hd, K·hd)
    lora += ([(D, D)] * nb + qk) * norms
    emb = getattr(args, "train_embeddings", False)   # --train-embeddings: the input embedding trains
    tied = emb and m.tie_embeddings   # (and a tied model's head is it: trained through the loss too)
    neft = getattr(args, "neftune_alpha", None) is not None   # NEFTune's noise, added to the embedding output in place
    fresh = emb or neft or m.embed_scale or m.embed_multiplier != 1   # the blocks' input is no mere lookup: AC's
    # first checkpoint keeps it whole (a trained or noised embedding's, Gemma's or Granite's scaled output: a new
    # tensor), else the ids, looked up again (ac._FromIds)
    lookup = lo == 0 and not fresh
    root = [(V, V * D)] * (0 if tied else 1 if m.tie_embeddings or emb else 2) + [(D, D)] * (not norms)
    shard = lambda ps: sum(-(-d0 // W) * (n // d0) for d0, n in ps)   # FSDP2 dim-0 shard
    full = lambda ps: sum(_pad(d0, W) * (n // d0) for d0, n in ps)    # unsharded, padded
    lora_n = sum(n for _, n in lora)

    qkv = any(t in targets for t in ("q_proj", "k_proj", "v_proj"))
    direct = el == e and args.lora_dropout == 0   # LoRA A is handed the norm's output itself (no cast, dropout)
    fed = lambda tg, *ts: direct and any(t in tg for t in ts)   # LoRA A of one of `ts` keeps the input it is handed

    def dora_saved(ts, rows=T, first=False, tg=targets) -> float:
        """DoRA's saved tensors (term 4) for the targets among `ts` at `rows` tokens."""
        ts = [x for x in ts if dora and x in tg]
        if direct:   # the fused sum `out`, the norm and the scale
            return e * (rows + 2) * sum(shapes[x][0] for x in ts)
        lead = [first and x in ("q_proj", "k_proj", "v_proj") for x in ts]   # layer 0's: their input needs no grad
        eb = el if args.lora_dropout > 0 else e   # the base's share: F.linear's (in el), else the base's own output
        return sum(((eb + el) * rows + el * (3 - z)) * shapes[x][0] for x, z in zip(ts, lead))

    def dropped(ts, first=False) -> float:
        """LoRA dropout's saved output and mask for the targets `ts`: the mask a bool on CUDA (native_dropout), in el
        on CPU (the scaled mask its product keeps); none where the input needs no grad (q/k/v of block lo, `first`).
        down_proj's dropped input takes the place of the MLP's product (counted in 4eTF, kept only for down's LoRA
        A): its mask alone is more."""
        mask = lambda x: 0 if first and x in ("q_proj", "k_proj", "v_proj") else 1 if target == "cuda" else el
        return sum(T * shapes[x][1] * (mask(x) + el * (x != "down_proj" or el != e)) for x in ts) * (
            args.lora_dropout > 0)   # (el != e, CPU bf16: no product kept, dropout's el output in its place)

    def layer_saved(first: bool, tg=targets, sparse=False) -> float:
        """One block's saved tensors; `first`: its input needs no grad (block lo's); `tg`: its LoRA targets."""
        first = first and not (norms and tg and pre) and not emb   # (a trained pre-norm saves its input and makes
        # an output needing grad; a trained embedding makes block 0's input need grad)
        inner = [t for t in tg if not (tiled and t in ("gate_proj", "up_proj", "down_proj"))
                 and not (ta and t in ("q_proj", "k_proj", "v_proj", "o_proj"))]
        # the MLP's input: its norm keeps it and rsqrt (the tiles run the norm: no rsqrt); with no norm in front
        # (OLMo) the tiled MLP keeps it, else gate/up's LoRA A where handed it directly
        mlp_in = e * T * D + 4 * T * (not tiled) if pre else e * T * D * (tiled or fed(tg, "gate_proj", "up_proj"))
        if ta:   # the tiles keep the sublayer's (the norm's) input (layer 0's too), k, v, out, lse: no rsqrt, q, LoRA A
            b = e * T * D + mlp_in + e * T * hd * (H + 2 * Kp) + 4 * T * H
        else:
            b = mlp_in + ((e * T * D + 4 * T) * (not first) + e * T * D * qkv * first * direct if pre
                          else e * T * D * fed(tg, "q_proj", "k_proj", "v_proj"))   # (OLMo: q/k/v's LoRA A keep x)
            b += e * T * hd * (2 * H + 2 * Kp) + 4 * T * H
            if m.attn_gate:   # Qwen3.5: sigmoid(gate) (sigmoid's output, the product's other factor) where the gate
                # or the core's output needs grad; the product, o_proj's LoRA A input; under Ulysses the product
                # keeps heads_to_seq's output where the gate needs grad
                g = not first or "q_proj" in tg
                b += e * T * H * hd * ((g or any(x in tg for x in ("k_proj", "v_proj"))) + fed(tg, "o_proj")
                                       + (U > 1 and g))
            else:
                b += e * T * H * hd * (U > 1 and "o_proj" in tg)
            # q/k norms (Qwen3, Gemma 3 per head; OLMo over the projection: one rsqrt a token) keep q_proj's and
            # k_proj's outputs and rsqrt, where those need grad (or a trained norm's weight does)
            b += sum(e * T * hd * n + 4 * T * (1 if m.qk_norm_whole else n) for n, t in ((H, "q_proj"), (KV, "k_proj"))
                     if not first or t in tg or norms and tg) * m.qk_norm
        b += (e * T * D + 4 * T) * 2 * post   # Gemma's and OLMo's norms on attention's and the MLP's outputs
        b += 0 if tiled else plan_moe.saved(m, T, e) if sparse else e * T * F * (
            3 + ("down_proj" in tg and el == e))   # (el != e: down's A keeps its
        # float32 input, not the product; peft casts x before dropout: the dropped input is kept, not the cast)
        b += sum(T * r * el + (4 * T * shapes[t][1] if el != e and not args.lora_dropout > 0 else 0) for t in inner) \
            + dora_saved(inner, first=first, tg=tg)
        return b + dropped(inner, first)

    # per block: nothing below lo; lo as layer 0 (its input needs no grad); un-adapted ones without LoRA's tensors
    sparse = lambda i: moe and m.moe.sparse(i)   # an MoE block (parallel/plan_moe.py)
    saved = [0.0] * lo + [layer_saved(i == lo, targets if i in adapted else [], sparse(i)) for i in range(lo, L)]
    every = sum(saved) + 8 * T * emb   # (a trained embedding's backward keeps the int64 ids)
    # the first checkpoint keeps token ids, not the embedding's output (looked up again in its backward,
    # ac._FromIds): one block input fewer, but that lookup is live in the first block's own backward
    # (--lora-layers: a checkpoint below lo keeps nothing, its output needs no grad; block lo's input is kept whole)
    inputs = lambda n, ids=lookup: max(n - 1, 0 if K else 1) if ids else max(n, 0)   # (a trained embedding's
    # output, or one NEFTune noised, is kept as the other block inputs are)
    ckpt = inputs(N - lo) * e * T * D + 8 * T * emb
    # one block's recompute (AC; its input is counted above, block lo's first norm saves nothing to share it with
    # unless --train-norms trains it: then it saves that input, as the others'), less the inputs of the blocks above
    # it, freed by then (with --lora-layers, blocks differ). OLMo's block (no norm in front): the tiles or q/k/v's
    # LoRA A save that input where they take it, block lo's too
    shares = lambda i, first: (not first or norms) if pre else ta or fed(targets * (i in adapted), "q_proj", "k_proj",
                                                                          "v_proj")
    recompute = lambda ids: max((layer_saved(False, sparse=sparse(0)) - e * T * D * shares(i, False) if i == 0 else
                                 saved[i] - e * T * D * shares(i, i == lo)) - (L - 1 - i) * e * T * D for i in ids)
    one = recompute(range(lo, L))
    p = Plan(target=target)
    q = "nf4 packed" if nf4 else {2: "bf16", 4: "fp32"}[e]
    t = p.terms
    t[f"base weights shard ({q}, 1/{W} of {L} blocks)"] = sum(c * shard(packed(ws)) for c, ws, _ in kinds) * e
    qa = lambda ws: [(-(-o * i // 64 // e), -(-o * i // 64 // e)) for o, i in ws] if nf4 else []
    if nf4:   # the uint8 absmax codes are a parameter sharded with the block (model/nf4.py); the rest is not
        t[f"quantization state (absmax 1/{W}, {L} blocks)"] = sum(c * sum(
            quant_state_bytes(o * i) - o * i // 64 for o, i in ws) + c * shard(qa(ws)) * e for c, ws, _ in kinds)
    frozen = ", ".join(["embeddings"] * (not emb) + ["lm_head"] * (not tied) + ["final norm"] * (not norms))
    if root or norms:   # (the trained ones: below)
        t[(frozen or "final norm (trained: fp32 shard, AdamW's)") + " (frozen: whole on every rank)" * bool(root)] = \
            sum(n for _, n in root) * e + 4 * 4 * -(-D // W) * norms   # (a trained final norm: sharded, with AdamW's)
    if emb:   # the root all-gathers it for the step (in LoRA's dtype: FSDP2's param dtype), keeps the float32 shard
        t[f"input embedding (trained): unsharded for the step, fp32 shard + grad + AdamW m, v (1/{W})"] = \
            V * D * el + 4 * 4 * shard([(V, V * D)])
    router = lambda rows: [(rows, rows * D)] * bool(rows)   # an MoE block's router [E, D], never quantized
    t[f"block norms, biases{', routers' * moe} shard (1/{W})"] = (L * shard(base) + sum(
        c * shard(router(rr)) for c, _, rr in kinds)) * e
    of = f"{A} of {L} blocks" if A < L else f"{L} blocks"
    t[f"LoRA params + grads + AdamW m, v (fp32, 1/{W}, {of})"] = 4 * 4 * A * shard(lora)
    if with_reference(args) and (getattr(args, "init_adapter", None) or str(getattr(
            args, "dpo_reference", None)).startswith("adapter")):   # (a planning copy carries no init_adapter)
        t["DPO reference adapter (--init-adapter: whole on every rank)"] = A * lora_n * el
    if with_reference(args) and emb:   # (model.norms.reference_trained: the base's, or the reference adapter's)
        t["DPO reference's input embedding (whole on every rank)"] = V * D * el
    if N == 0:
        t[f"activations: saved tensors of {L - lo} blocks at {T} tokens"] = every
    elif offload:
        p.host_each = e * T * D if target == "cuda" else 0
        p.host = max(N - lo - lookup, 0) * p.host_each   # the ids' lookup is not offloaded (a trained or noised
        # embedding's output is, as the other block inputs are)
        if target == "cpu":   # the "host" copies share the one RAM
            t[f"activations: {inputs(N - lo)} block checkpoints [{T}, {D}] (offloaded, same RAM)"] = ckpt
        t["activations: 1 offloaded checkpoint on device (the next one comes after the attention)"] = e * T * D
        if emb and target != "cpu":   # (the embedding's backward keeps the int64 ids on the device: not offloaded)
            t["activations: token ids (the trained embedding's backward)"] = 8 * T
    elif G > 1:
        g = inputs(-(-L // G) - lo // G, lo < G and not fresh)   # the groups from lo's (a fresh block input, as
        # the other group inputs are, kept whole)
        t[f"activations: {g} group checkpoints [{T}, {D}] (--ac-group {G})"] = g * e * T * D + 8 * T * emb
    else:
        t[f"activations: {inputs(N - lo)} block checkpoints [{T}, {D}]"] = ckpt
    # per ring step: each kernel call's output is kept; with shared-prompt pairs' branches (--dpo-share-prompt) the
    # calls cover a row up to twice (one process: a branch's rows against its own document and its prefix; the ring:
    # 3.95 of 2 steps and 7.86 of 4 measured from its plans; review, helper 45: planned once, ~2x under)
    # under the ring, rows of an unpacked micro-batch of several share tiled calls: ~3.5x measured (review, helper
    # 47); on one process (and Ulysses) they run as one row, the exact calls (parallel.cp._branched)
    KR = R * (1 if not getattr(args, "dpo_share_prompt", False) else 4 if getattr(args, "pack", None) is False and
              getattr(args, "micro_batch", 1) != 1 and R > 1 else 2)
    if N > lo and getattr(args, "ac_keep_attn", False):
        t[f"activations: {N - lo} kept attention outputs (--ac-keep-attn)"] = (N - lo) * KR * (
            e * T * H * hd + 4 * T * H)
    if 0 < K < L:   # the last K blocks without AC (--ac-blocks): backward frees them before any recompute
        t[f"activations: saved tensors of the last {K} blocks (--ac-blocks {N})"] = sum(saved[N:])
    t["activations: rope cos/sin"] = 2 * e * T * m.rotary_dim * (   # (R: Qwen3.5's partial RoPE rotates R < hd dims;
        # Ministral 3: q's own; Gemma: the sliding layers' too)
        (1 + (m.attn_temperature_beta is not None)) * (2 if m.local_rope else 1))
    blk = max(full(packed(ws) + base + qa(ws) + router(rr)) for _, ws, rr in kinds) * e + full(lora) * el
    t["FSDP2: 2 unsharded blocks (current + prefetch)"] = 2 * blk
    t["FSDP2: all-gather output + LoRA-grad reduce-scatter (1 block)"] = blk + lora_n * (el + 4)
    dequant = max(o * i for _, ws, _ in kinds for o, i in ws) * e if nf4 else 0
    n_held = plan_moe.held(m, shapes)   # each projection's weights a block dequantizes (MoE: every expert's)
    held = lambda *ts: sum(n_held[x] for x in ts) * e if nf4 else 0   # dequant_once's weights (MoE: every expert's)
    row = T * U // (1 if pack else mb)   # attention tokens per row
    p.attn_row, p.attn_block = row, kernels.backward_block(row)   # (smaller past 4 blocks a row: the plan falls
    # there; plan_search.longest looks past it)

    # the "| block" phases of a block's backward (terms 6, 7, 9, 10): parallel/plan_block.py
    Fb = m.moe.top_k * m.moe.width + m.moe.shared if moe else F   # (a token's experts' width, + a shared expert)
    block_terms = partial(plan_block.block_terms, D=D, F=Fb, G=G, H=H, K=K, KR=KR, Kp=Kp, N=N, R=R, T=T, U=U, args=args,
                          blk=blk, dequant=dequant, direct=direct, dora=dora, dora_saved=dora_saved, dropped=dropped,
                          e=e, hd=hd, held=held, mb=mb, nf4=nf4, offload=offload, p=p, pack=pack, row=row, ta=ta,
                          tiled=tiled, moe=(plan_moe.saved(m, T, e), plan_moe.backward(m, T, e)) if moe else None)

    # the block whose backward peaks: an adapted one (its LoRA's, DoRA's, dropout's tensors in every phase) or, under
    # --lora-layers, an un-adapted one above them (none of those; it may recompute more, having fewer inputs above
    # it freed): each kind's largest recompute, and its phases (review, helper 81: the un-adapted block's recompute
    # with the adapted blocks' phases, whose DoRA and dropout tensors freed midway it never held, under-counted)
    kinds = [block_terms(targets, recompute(adapted))]
    if len(adapted) < L - lo:
        kinds.append(block_terms([], recompute([i for i in range(lo, L) if i not in adapted])))
    t.update(max(kinds, key=lambda ts: sum(ts.values())))
    t.update(plan_block.loss_terms(T=T, D=D, V=V, e=e, el=el, tied=tied, emb=emb))   # 8 and the backward's end
    p.alt_activations = (every if args.ac else (max(L - 1, 1) if lo == 0 and not emb else L - lo) * e * T * D
                         + 8 * T * emb + one + e * T * D)
    p.notes.append(f"{T} tokens per rank per micro-batch ({'packed' if pack else 'padded'} rows, CP divisor {div})")
    return p
