"""The memory plan's persistent weight terms, 1-3 of parallel/plan.py's docstring (in its notation), and the bytes of
one unsharded block for FSDP2's term 5: `weight_terms(t, ...)` adds them to a plan's terms and returns (one block's
unsharded bytes, one block's LoRA elements); its keyword arguments are memory_plan's sizes of the same names. Block
kinds (parallel/plan_moe.py's dense and MoE blocks, parallel/plan_linear.py's Gated DeltaNet ones) each have their own
frozen Linears, never-quantized parameters and LoRA targets; FSDP2's unsharded block is the largest kind's.

1. base weights. nf4: n/2 bytes of codes per block Linear as [n/(2·itemsize), 1] compute-dtype elements, FSDP2-
   sharded over W on dim 0 (ceil(rows/W) rows). `quantize_4bit(blocksize=64, compress_statistics=True)`'s state:
   one uint8 absmax per 64 weights (a parameter, [ceil(n/64/e), 1] elements sharded and all-gathered with the
   codes, term 5) and one fp32 absmax per 256 of those, 16 + 256 fp32 code-book entries and an fp32 offset on
   the module on every rank. none: n·e / W. Never quantized: block norms, biases: e bytes per element / W.
   GLM-4.5's routers: float32 whole on every rank, a term of their own (parallel/plan_glm4.routers).
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
"""

from __future__ import annotations

from parallel import plan_glm4
from parallel.plan_totals import with_reference

_pad = lambda n, w: -(-n // w) * w   # n rounded up to a multiple of w (FSDP2 pads dim 0 to the shard count)


def quant_state_bytes(n: int) -> int:
    """bitsandbytes NF4 with nested absmax (term 1)."""
    blocks = -(-n // 64)
    return blocks + 4 * -(-blocks // 256) + 4 * (16 + 256 + 1)


def weight_terms(t: dict, *, m, args, D, V, L, W, e, el, nf4, kinds, base, loras, lora, adapted, norms, emb, tied,
                 moe) -> tuple[float, int]:
    """Terms 1-3 into `t`; (the largest kind's unsharded block in bytes, with its LoRA in el, the largest kind's LoRA
    elements). `kinds`: [(blocks, frozen Linears' (out, in), never-quantized (dim 0, elements), linear)]; `loras`:
    {linear: that kind's LoRA (dim 0, elements)}, `lora(i)` block i's; `base`: every block's norms and biases."""
    # one block's parameters: (dim 0, elements) in the compute dtype, plus LoRA (dim 0, elements) in fp32
    packed = lambda ws: [(o * i // (2 * e), o * i // (2 * e)) if nf4 else (o, o * i) for o, i in ws]
    shard = lambda ps: sum(-(-d0 // W) * (n // d0) for d0, n in ps)   # FSDP2 dim-0 shard
    full = lambda ps: sum(_pad(d0, W) * (n // d0) for d0, n in ps)    # unsharded, padded
    qa = lambda ws: [(-(-o * i // 64 // e), -(-o * i // 64 // e)) for o, i in ws] if nf4 else []
    root = [(V, V * D)] * (0 if tied else 1 if m.tie_embeddings or emb else 2) + [(D, D)] * (not norms)
    q = "nf4 packed" if nf4 else {2: "bf16", 4: "fp32"}[e]
    t[f"base weights shard ({q}, 1/{W} of {L} blocks)"] = sum(c * shard(packed(ws)) for c, ws, _, _ in kinds) * e
    if nf4:   # the uint8 absmax codes are a parameter sharded with the block (model/nf4.py); the rest is not
        t[f"quantization state (absmax 1/{W}, {L} blocks)"] = sum(c * sum(
            quant_state_bytes(o * i) - o * i // 64 for o, i in ws) + c * shard(qa(ws)) * e for c, ws, _, _ in kinds)
    frozen = ", ".join(["embeddings"] * (not emb) + ["lm_head"] * (not tied) + ["final norm"] * (not norms))
    if root or norms:   # (the trained ones: below)
        t[(frozen or "final norm (trained: fp32 shard, AdamW's)") + " (frozen: whole on every rank)" * bool(root)] = \
            sum(n for _, n in root) * e + 4 * 4 * -(-D // W) * norms   # (a trained final norm: sharded, with AdamW's)
    if emb:   # the root all-gathers it for the step (in LoRA's dtype: FSDP2's param dtype), keeps the float32 shard
        t[f"input embedding (trained): unsharded for the step, fp32 shard + grad + AdamW m, v (1/{W})"] = \
            V * D * el + 4 * 4 * shard([(V, V * D)])
    glm = moe and bool(m.moe.groups)   # (GLM-4.5's routers: float32 whole on every rank, parallel/plan_glm4.routers)
    if glm:
        t["routers (float32, whole on every rank)"] = plan_glm4.routers(m, e)
    rt = ", routers" * (moe and not glm)
    t[f"block norms, biases{rt}{', linear_attn conv etc.' * bool(m.linear)} shard (1/{W})"] = (
        L * shard(base) + sum(c * shard(x) for c, _, x, _ in kinds)) * e
    A = len(adapted)
    of = f"{A} of {L} blocks" if A < L else f"{L} blocks"
    t[f"LoRA params + grads + AdamW m, v (fp32, 1/{W}, {of})"] = 4 * 4 * sum(shard(lora(i)) for i in adapted)
    if with_reference(args) and (getattr(args, "init_adapter", None) or str(getattr(
            args, "dpo_reference", None)).startswith("adapter")):   # (a planning copy carries no init_adapter)
        t["DPO reference adapter (--init-adapter: whole on every rank)"] = sum(
            n for i in adapted for _, n in lora(i)) * el
    if with_reference(args) and emb:   # (model.norms.reference_trained: the base's, or the reference adapter's)
        t["DPO reference's input embedding (whole on every rank)"] = V * D * el
    blk = max(full(packed(ws) + base + qa(ws) + x) * e + full(loras[k]) * el for _, ws, x, k in kinds)
    return blk, max(sum(n for _, n in ls) for ls in loras.values())
