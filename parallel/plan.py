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
1-3. base weights, root, LoRA (and the trained norms and embedding): parallel/plan_weights.py.
4. activations: what autograd saves (counted with saved_tensors_hooks on this decoder). Per block:
   parallel/plan_saved.py. With AC (non-reentrant checkpoint per block)
   only each block's input [T, D]·e is kept and one block is recomputed in backward (its saved tensors less that input,
   which the first norm saves again without a copy). The first checkpoint keeps the token ids, not the embedding's
   output, and looks them up again (ac._FromIds): max(N - 1, 1) inputs (N - 1 with --ac-blocks); not with
   --neftune-alpha, whose noise changes that output in place (kept whole, offloaded, as a trained embedding's). The
   forward's last block (L - 1 inputs, one block's forward) stays under the backward's block phase (CPU, measured).
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
   --lora-layers (lowest adapted block lo): the embedding is frozen, so blocks below lo need no grad: they save
   nothing, their checkpoints keep nothing, no backward runs there; block lo saves as layer 0 does, and its input is
   kept whole (no ids to look up again: N - lo checkpoint inputs, N - lo offloaded; ceil(L/G) - floor(lo/G) group
   inputs, one fewer when lo < G). Un-adapted blocks above lo save no LoRA tensors (B's inputs, down_proj's A input,
   Ulysses' o_proj input, dropout's, DoRA's). The recompute term is the largest block's, less the block inputs
   above it (freed by then; tests/test_plan.py checks these against autograd's saved tensors).
   Also cos/sin (2eT·R, R the rotated dims: hd but for Qwen3.5's partial RoPE; 4eT·R with Ministral 3's q tables,
   which carry its attention temperature: no other tensor;
   Gemma 3's two tables, full and sliding layers': 4eT·hd). The final norm's input and rsqrt
   (eTD + 4T) and the loss' grad_hidden (eTD) are saved too, but freed by the first backward nodes, so they count in
   the loss phase (8) only. Gemma 3's norms on the sublayers' outputs keep their inputs and rsqrt: 2·(eTD + 4T) more per
   block (--tiled-mlp: the MLP's runs in the feed-forward unit's tiles, parallel/memory.py: one); its scaled embedding
   output is a new tensor, kept whole by the first checkpoint (no ids), as Granite's (× embedding_multiplier; its other
   multipliers and logits / logits_scaling save nothing). SmolLM3's NoPE layers
   hand the kernel q and k as projected (the same bytes; the tables are made once for the RoPE layers, and a RoPE
   layer's q/k/v backward (9) is the largest; plan_speed leaves their RoPE pass out).
Transient (the block phases 6, 7, 9 and the loss phase 8 never overlap):
5. FSDP2: one block (the largest kind's) unsharded in full (padded to W) for the current + one prefetched, the
   all-gather output of one block before its copy-out, and one block's LoRA gradients unsharded plus their
   fp32 reduce-scatter input (lora·(el + 4)).
6, 7. the block backward's MLP and attention phases: parallel/plan_block.py.
8. the loss phase, at the end of forward (and a tied head's or a trained embedding's gradient): parallel/plan_block.py.
9, 10. the block backward's q/k/v phase and AC + --tiled-mlp's recompute forward: parallel/plan_block.py.
11. the recompute's attention forward with K/V expanded (CUDA's efficient op: heads over 256): parallel/plan_block.py.
Qwen3-MoE's blocks (experts, router; their saved tensors and MLP phase; Gemma 4's beside the MLP) in these terms:
parallel/plan_moe.py; Qwen3.5's
linear blocks (weights, LoRA targets, saved tensors in place of the attention's, the backward phase in place of 7 and
9; each block planned as its layer type, the peak block the worse kind's): parallel/plan_linear.py.
Gemma 4 E2B / E4B's per-layer embeddings, KV sharing and wide MLPs: parallel/plan_small.py.
Peak and planned total from these terms: `Plan.peak`, `Plan.total` (parallel/plan_totals.py).
Host (on CUDA): --offload-activations' (L - 1)·eTD pinned bytes per rank, and Gemma 4 E2B / E4B's per-layer table
with its pinned rows (parallel/plan_small.py), planned against --host-mem.
"""

from __future__ import annotations

from functools import partial

from model.lora_spec import lora_layers
from parallel import kernels, plan_block, plan_layers, plan_linear, plan_moe, plan_saved, plan_small, plan_weights
from parallel.plan_totals import Plan, sample_tokens
from parallel.plan_weights import _pad, quant_state_bytes  # noqa: F401 (term 1's: tests read it here)


def memory_plan(m, dims, args, target: str, pack: bool) -> Plan:
    """Term-by-term plan (see the module docstring) for ModelArgs `m` under ParallelDims `dims`."""
    m, args = plan_layers.unfused(m, args)   # (Phi-3's fused Linears as their parts)
    e = 2 if (args.dtype or ("bf16" if target == "cuda" else "fp32")) == "bf16" else 4
    el = e if target == "cuda" and e == 2 else 4
    W, U, R = dims.dp_shard * dims.cp, dims.ulysses, dims.ring
    div, mb = dims.cp_divisor, args.micro_batch or 1   # (auto, 0: rows of the longest sample's length)
    S = sample_tokens(args)
    T = (_pad(S * mb, div) if pack else mb * _pad(S, div)) // dims.cp
    D, H, K, hd, F, L, V, r = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.intermediate_size, m.n_layers, \
        m.vocab_size, args.lora_r
    rows = 1 if pack else mb   # (rows: a micro-batch's; packed, one; K' per block: layer_saved)
    shapes = {"q_proj": (H * hd * (1 + m.attn_gate), D), "k_proj": (K * hd, D), "v_proj": (K * hd, D),
              "o_proj": (D, H * hd), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}   # (out, in);
    # Qwen3.5's q_proj gives each head its gate too
    # Qwen3.5's linear blocks (parallel/plan_linear.py): linear_attn's Linears in place of the attention's
    lshapes = plan_linear.block_shapes(m, {t: shapes[t] for t in plan_moe.MLP}) if m.linear else {}
    every_shape, lin, kind = {**shapes, **lshapes}, m.is_linear, partial(plan_layers.key, m)
    at = lambda i: {**every_shape, **plan_layers.attn_shapes(m, i)}   # block i's (Gemma 4: its own attention's)
    targets = [t for t in args.lora_targets.split(",") if t in every_shape]
    tgs = lambda i: [t for t in targets if m.has(i, t)]   # the targets block i holds (not a k_eq_v layer's v_proj)
    nf4 = args.quant == "nf4"
    tiled, offload, ta = (getattr(args, f, False) for f in ("tiled_mlp", "offload_activations", "tiled_attn"))
    G = min(getattr(args, "ac_group", 1), L) if args.ac else 1
    N = (L if getattr(args, "ac_blocks", None) is None else min(args.ac_blocks, L)) if args.ac else 0
    K = L - N   # K from here: the blocks that keep their activations (the last K; no AC at all when N == 0)
    if offload and not args.ac:
        raise ValueError("--offload-activations moves the checkpoints of --ac to host memory: drop --no-ac")
    router = lambda rows: ([(rows, rows * D)] + plan_moe.extras(m)) * bool(rows)   # an MoE block's router [E, D],
    # never quantized (GPT-OSS's: + its biases, the experts', the sinks)
    # (blocks, frozen Linears, never-quantized ones: routers, linear_attn's conv and others, linear): dense, MoE
    # (Qwen3-MoE) and linear (Qwen3.5) blocks
    attn4 = [shapes[t] for t in ("q_proj", "k_proj", "v_proj", "o_proj")]   # (Gemma 4: a kind per attention shape)
    kinds = plan_layers.kinds(m, plan_linear.kinds(m, [(c, ws, router(rr), False) for c, ws, rr in plan_moe.kinds(
        m, shapes)], lshapes, attn4), attn4)
    moe = m.moe is not None and any(m.moe.sparse(i) for i in range(L))
    beside = moe and m.moe.beside   # Gemma 4's MoE block: beside every block's dense MLP, not in its place
    base = []
    nb = 4 if m.sandwich_norms else 2   # block norms [D] (Gemma 3: two more, on the sublayers' outputs)
    pre, post = not m.post_norms, m.sandwich_norms or m.post_norms   # norms in front of / on the sublayers' outputs
    base += [(D, D)] * nb + [(o, o) for t, (o, _) in shapes.items()
                            if (t in ("q_proj", "k_proj", "v_proj") and m.qkv_bias) or (t == "o_proj" and m.o_bias)
                            or (t.endswith(("gate_proj", "up_proj", "down_proj")) and m.mlp_bias)] \
        + [(1, 1)] * m.layer_scalar + ([(D, D)] * 4 + [(m.moe.experts,) * 2] if beside else []) \
        + plan_small.block_base(m)   # (Gemma 4's frozen [1] per block; its MoE block's three norms, the router's scale
    # [D] and per_expert_scale [E]; E2B / E4B's per-layer input gate, projection and norm: parallel/plan_small.py)
    dora = getattr(args, "dora", False)   # + DoRA's magnitude [out] per target, trained and sharded as A and B
    chosen = lora_layers(getattr(args, "lora_layers", None))   # --lora-layers: the blocks adapted (None: all)
    norms = getattr(args, "train_norms", False)   # --train-norms: an adapted block's norms train as LoRA does
    xl = plan_moe.expert_lora(m, args)   # --lora-targets experts: an MoE block's LoRA tensors (parallel/plan_moe.py)
    adapted = [i for i in range(L) if (chosen is None or i in chosen) and (tgs(i) or norms or xl and m.moe.sparse(i))] \
        or [L - 1]   # (a
    # block holding none of the targets trains nothing, as un-adapted; mesh.validate refuses no block at all)
    lo = adapted[0] * (not (norms and plan_small.branch_saved(m, 1, e)))   # blocks below lo need no grad: they
    # save nothing, no backward runs there (Gemma 4 E2B / E4B's trained per_layer_projection_norm: every block's
    # PLE branch needs one, so the blocks below the adapted ones run as un-adapted ones above them)
    own = {x: [(r, r * at(i)[t][1]) for t in tgs(i) if t not in plan_layers.doubled(args, tgs(i))]   # (one A a
           + [(at(i)[t][0], at(i)[t][0] * (r + dora)) for t in tgs(i)]   # fused Linear: parallel/plan_layers.py)
           + ([(D, D)] * (nb + 3 * beside) + plan_layers.qk_norms(m, i) + plan_small.trained_norms(m)[0]) * norms
           for x, i in {kind(i): i for i in range(L)}.items()}
    loras = {x: ls + xl for x, ls in own.items()}   # (FSDP2's largest block: every kind with the experts' LoRA;
    # Qwen3-MoE's dense and MoE blocks share a kind)
    lora = lambda i: own[kind(i)] + xl * m.moe.sparse(i) if xl else own[kind(i)]   # a block's LoRA by its kind
    # (linear or not; Gemma 4: its attention shape), + the experts' in an MoE block
    emb = getattr(args, "train_embeddings", False)   # --train-embeddings: the input embedding trains
    tied = emb and m.tie_embeddings   # (and a tied model's head is it: trained through the loss too)
    neft = getattr(args, "neftune_alpha", None) is not None   # NEFTune's noise, added to the embedding output in place
    fresh = emb or neft or m.embed_scale or m.embed_multiplier != 1   # the blocks' input is no mere lookup: AC's
    # first checkpoint keeps it whole (a trained or noised embedding's, Gemma's or Granite's scaled output: a new
    # tensor), else the ids, looked up again (ac._FromIds)
    lookup = lo == 0 and not fresh

    saved_of = plan_saved.Saved(m=m, args=args, target=target, e=e, el=el, T=T, U=U, cp=dims.cp, D=D, H=H, r=r,
                                rows=rows, shapes=every_shape, at=at, targets=targets, norms=norms, pre=pre, post=post,
                                emb=emb, ta=ta, tiled=tiled, beside=beside, dora=dora, xl=xl, adapted=adapted)
    layer_saved, dora_saved, dropped = saved_of.layer, saved_of.dora_saved, saved_of.dropped   # term 4, per block
    direct, fed = saved_of.direct, saved_of.fed

    # per block: nothing below lo; lo as layer 0 (its input needs no grad); un-adapted ones without LoRA's tensors
    sparse = lambda i: moe and m.moe.sparse(i)   # an MoE block (parallel/plan_moe.py)
    saved = [0.0] * lo + [layer_saved(i == lo, tgs(i) * (i in adapted), sparse(i), lin(i), i) for i in range(lo, L)]
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
    recompute = lambda ids: max((layer_saved(False, tgs(0), sparse(0), lin(0), 0) - e * T * D * shares(i, False)
                                 if i == 0 else saved[i] - e * T * D * shares(i, i == lo)) - (L - 1 - i) * e * T * D
                                for i in ids)
    one = recompute(range(lo, L))
    p = Plan(target=target)
    t = p.terms
    blk, lora_n = plan_weights.weight_terms(t, m=m, args=args, D=D, V=V, L=L, W=W, e=e, el=el, nf4=nf4, kinds=kinds,
                                            base=base, loras=loras, lora=lora, adapted=adapted, norms=norms, emb=emb,
                                            tied=tied, moe=moe)   # terms 1-3 (and one unsharded block's bytes)
    plan_small.root_terms(t, p, m, args, e, T, W, norms, target)   # (Gemma 4 E2B / E4B's PLE; its table in host memory)
    if m.small is not None:   # (the per-layer inputs, every block's; the storing layers' K/V: parallel/plan_small.py)
        t[f"activations: saved tensors: per-layer inputs [{T}, {L}, {m.small.ple}]"] = plan_small.inputs(
            m, T, e, norms)
        t["activations: the storing layers' K/V, gradients (KV sharing)"] = plan_small.held(m, T, e, N > 0, norms)
    if N == 0:
        t[f"activations: saved tensors of {L - lo} blocks at {T} tokens"] = every
    elif offload:
        p.host_each = e * T * D if target == "cuda" else 0
        p.host += max(N - lo - lookup, 0) * p.host_each   # the ids' lookup is not offloaded (a trained or noised
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
    if (n_at := sum(not lin(i) for i in range(lo, N))) and getattr(args, "ac_keep_attn", False):   # (linear: none)
        t[f"activations: {n_at} kept attention outputs (--ac-keep-attn)"] = sum(KR * (
            e * T * H * m.attn_dims(i)[2] + 4 * T * H) for i in range(lo, N) if not lin(i))
    if 0 < K < L:   # the last K blocks without AC (--ac-blocks): backward frees them before any recompute
        t[f"activations: saved tensors of the last {K} blocks (--ac-blocks {N})"] = sum(saved[N:])
    # a table is kept where a block taking it rotates a q or k needing grad: any above lo, block lo's if checkpointed
    # (the checkpoint holds it) or q_proj or k_proj is adapted there (--tiled-attn's tiles: any of q/k/v/o)
    rope = lambda i: i > lo or i == lo and (lo < N or norms or emb or any(
        x in tgs(lo) for x in ("q_proj", "k_proj") + ("v_proj", "o_proj") * ta))
    t["activations: rope cos/sin"] = plan_layers.rope_bytes(m, T, e, rope)   # (R: Qwen3.5's partial RoPE rotates
    # R < hd dims; Ministral 3: q's own; Gemma: the sliding layers' too, Gemma 4's at their own head size)
    t["FSDP2: 2 unsharded blocks (current + prefetch)"] = 2 * blk
    t["FSDP2: all-gather output + LoRA-grad reduce-scatter (1 block)"] = blk + lora_n * (el + 4)
    dequant = max(o * i for _, ws, _, _ in kinds for o, i in ws) * e if nf4 else 0
    n_held = plan_moe.held(m, {t: max((at(i)[t] for i in range(L) if t in at(i)), key=lambda s: s[0] * s[1])
                                for t in shapes})   # each projection's weights a block dequantizes (MoE: all experts')
    held = lambda *ts: sum(n_held[x] for x in ts) * e if nf4 else 0   # dequant_once's weights (MoE: every expert's)
    row = T * U // (1 if pack else mb)   # attention tokens per row
    p.attn_row, p.attn_block = row, kernels.backward_block(row)   # (smaller past 4 blocks a row: the plan falls
    # there; plan_search.longest looks past it)

    # the "| block" phases of a block's backward (terms 6, 7, 9, 10, 11): parallel/plan_block.py
    Fb = m.moe.top_k * m.moe.width + m.moe.shared if moe and not beside else F   # (a token's experts' width, + a
    # shared expert; Gemma 4's: the dense MLP's, the experts' in plan_moe.backward)
    block_terms = lambda i, *a, **k: plan_block.block_terms(
        *a, D=D, F=Fb if moe and not beside else at(i)["up_proj"][0], G=G, H=H, K=K, KR=KR,
        Kp=max(m.attn_dims(i)[1], U), N=N, R=R, T=T, U=U, args=args, blk=blk,
        dequant=dequant, direct=direct, dora=dora, dora_saved=partial(dora_saved, sh=at(i)), e=e, hd=m.attn_dims(i)[2],
        dropped=partial(dropped, sh=at(i)), held=held, mb=mb, nf4=nf4, offload=offload, p=p, pack=pack, row=row,
        tiled=tiled, moe=(plan_moe.saved(m, T, e), plan_moe.backward(m, T, e), beside,
                          plan_moe.unit(m, T, e) if beside else None) if moe else None, **k)   # (i's)

    # the block whose backward peaks: an adapted one (its LoRA's, DoRA's, dropout's tensors in every phase) or, under
    # --lora-layers, an un-adapted one above them (none of those; it may recompute more, having fewer inputs above
    # it freed): each kind's largest recompute, and its phases (review, helper 81: the un-adapted block's recompute
    # with the adapted blocks' phases, whose DoRA and dropout tensors freed midway it never held, under-counted);
    # Qwen3.5's linear and full blocks apart (a linear block's sublayer backward in place of 7 and 9)
    groups = {}
    for i in range(lo, L):
        groups.setdefault((kind(i), i in adapted), []).append(i)   # (Gemma 4: each attention shape's own)
    phase = plan_linear.phase(m, T, rows, e, dims.cp) if m.linear else 0
    t.update(max((block_terms(ids[0], tgs(ids[0]) * a, recompute(ids), ta=ta and not x[0], linear=phase if x[0]
                              else None) for (x, a), ids in groups.items()), key=lambda ts: sum(ts.values())))
    t.update(plan_block.loss_terms(T=T, D=D, V=V, e=e, el=el, tied=tied, emb=emb, softcap=m.logit_softcap))   # 8, end
    p.alt_activations = (every if args.ac else (max(L - 1, 1) if lo == 0 and not emb else L - lo) * e * T * D
                         + 8 * T * emb + one + e * T * D)
    p.notes.append(f"{T} tokens per rank per micro-batch ({'packed' if pack else 'padded'} rows, CP divisor {div})")
    return p
