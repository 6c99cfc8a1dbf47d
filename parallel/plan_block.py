"""The phases of the memory plan that never overlap, of which the peak takes the largest (parallel/plan_totals.py):
the block backward's, the "| block" terms 6, 7, 9, 10, 11 of parallel/plan.py's docstring, and the loss's, the "| or:"
term 8 (with a tied head's gradient and a trained embedding's "| end:"), in its notation. `block_terms(targets, one,
...)` is called by `memory_plan` for the block whose backward peaks, `loss_terms(...)` once; their keyword arguments
are memory_plan's sizes and helpers of the same names.

6. block backward, at its peak in the MLP (backward runs the block in reverse): the gradients of the product's
   two inputs (2eTF), the incoming residual gradient (eTD), the norm output rebuilt for gate/up's LoRA A
   (eTD), for nf4 the largest weight dequantized (n·e); with AC, on top, the recomputed block (term 4 for one
   layer), all of it alive at that moment. --tiled-mlp: the incoming gradient (eTD; the input gradient goes into the
   saved input h's own storage, recompute.spare) plus one tile's recomputed tensors and gradients (e·t·(6F + D), t =
   parallel.memory.tile_tokens(D) = D tokens) and gate/up/down dequantized (kept for all tiles, model.nf4.dequant_once;
   --tiled-attn's phase likewise q/k/v/o); Gemma 4's MoE block: its feed-forward unit's tile of E·D/k tokens, experts
   and all, and every expert dequantized too (parallel/plan_moe.unit, held). --dora: + one tile's DoRA tensors (term
   4's, at t tokens; the weight is the held one), here and in --tiled-attn's tiles.
7. attention, later in the same block backward, when the MLP's 4eTF saved tensors, its norm's eTD input and
   the MLP phase's gradients are gone, but dh (those gradients summed, eTD) and the kernel's incoming
   gradient (eT·H·hd) are alive: counted as max(0, attention buffers + eT·H·hd - (4eTF, tiled 0) - term 6),
   the excess over the MLP phase. --dora: the MLP's and o_proj's DoRA tensors are gone too (q/k/v's not); o_proj's
   DoRA node holds dh's rescaled copy (eTD; the magnitude's gradient is summed over row chunks, model.dora).
   --tiled-attn: dh, dx, float32 dk/dv over the row and one tile (its norm output,
   q, incoming gradient, float32 dq, a call's buffers as below), less the MLP's norm input h, which is gone.
   Buffers: kernel backward dq, dk, dv (eT·hd·(H + 2K')), + 4eT·H·hd when K' < H (flash's float32 dq and
   dK/dV expanded to H heads; the efficient op's expanded K/V and dK/dV). GQA/MQA (K' < H) rows of more than
   kernels.BACKWARD_BLOCK attention tokens (T·U, / micro-batch for padded rows; not ring, whose steps are blocks
   already; a row is planned as one document: packed rows of several take CUDA's varlen op, or on CPU one call
   per document, without spare storage, neither planned) run the backward in
   blocks (backends.blocked_backward; the cores' spare_q): dq, dk, dv go into q's, k's, v's own storage and
   each key block's float32 dk/dv sums into out's rows of a finished query block (one-row batches, where
   8K' <= e·H), so only key block 0's sums are new: share · 8T·K'·hd (padded rows of several: the sums of
   every key block, 8T·K'·hd), plus one call's share of the buffers above with a float32 dq (4T·H·hd);
   share = n / row, n = kernels.backward_block(row) (BACKWARD_BLOCK; a quarter of it past four of them).
   The norm output rebuilt for q/k/v's LoRA A (eTD) comes after the kernel's backward has freed its saved
   q, k, v, out (more), so it is not a peak. o_proj's backward builds its input gradient in one buffer
   (model.qlora._BaseAndA): dh and one eT·H·hd over the recompute. On peft's path (LoRA dropout, a dtype cast)
   it holds its base's and LoRA A's at once, and with a plain base (an nn.Linear: a view, as A's) their sum
   too: counted as max(attention buffers + eT·H·hd, o_proj's (1 + 1 + 1)·eT·H·hd). Other [T, D] tensors with
   two gradients (q/k/v's input, the residuals) get them summed in place (test_memory pins it).
   Ulysses: all-to-all send and receive copies of q, k, v or their grads at [S_full, H/U, hd] (2eT·hd·(H + 2K')).
   Ring: the K/V block received and the one in flight (4eT·K'·hd) and fp32 accumulators: out or dq (4T·H·hd),
   dK/dV held and in flight (16T·K'·hd), lse (4TH). Hybrid: both.
9. q/k/v backward, after the kernel's (model.llama makes q last, so q's chain runs first, before the input
   norm's gradient and its rebuilt output exist): dh (eTD; with offload also the prefetched input, eTD) and the
   largest of dq with RoPE's gradient of it and its chunk temporaries (2eT·H·hd + 3.5e·min(ROPE_CHUNK, T·H·hd);
   under Ulysses dq's all-to-all, 3eT·H·hd), q_proj's input gradient beside it (eT·(D + H·hd)), and the norm's
   gradient, its rebuilt output and one more gradient (3eTD, from q_proj's backward on: its LoRA A rebuilds
   the output), all beside dk and dv, which wait for k's and v's chains (2eT·K'·hd; bench/memtrace.py at 32,768
   tokens, 2026-12-01); the block's saved tensors are gone: its excess over 6-7. --dora: not q/k/v's DoRA tensors
   (k's, v's wait with their chains; q's to its DoRA node: 2eT·H·hd, the gradient and its rescaled copy).
10. AC + --tiled-mlp: the recompute's forward at o_proj (base and LoRA addmm outputs) or at the residual (o_proj's
   output and h), with dy: rec + 2eTD (its excess over 6, 7, 9). Not where o_proj runs _BaseAndA (no dropout,
   cast or --tiled-attn): B's share and the residual are summed into the base's output in place, and the input
   norm's output is gone since q, k, v (model.llama.Attention.projections): rec + eTD.
11. the recompute's attention forward where the op is handed K and V expanded to H heads (torch's memory-efficient op
   on CUDA: float32, or heads over 256, Gemma 4's full layers; backends._cuda_forward): the recompute less what comes
   after the kernel (the MLP's input and saved tensors: eTD + 3eTF, MoE's its own) + 2eT·H·hd (`expanded_kv`; 33 GB
   at 503k tokens of the 31B's full layers), its excess over 6, 7, 9 (10 counts its excess over it). Its backward's
   buffers are term 7's.
8. loss phase, at the end of forward: the final norm's saved input and rsqrt and output (eTD + 4T + eTD), the
   loss' grad_hidden (eTD), loss.CHUNK_BYTES of float32 logits ([c, V], c = CHUNK_BYTES // 4V tokens) plus a
   bf16 copy (2cV) for a bf16 weight; with final_logit_softcapping (Gemma 4) two float32 blocks, the capped logits
   and the tanh values their gradient reads, of c = CHUNK_BYTES // 8V tokens each (8cV, the same bytes; 2cV the copy).
   A chunk's hidden gradient is written into grad_hidden's rows (no ecD: bench/memtrace.py's loss phase at 8,192
   tokens, where c = T, is these terms to the byte).
"""

from __future__ import annotations

import torch

from loss import CHUNK_BYTES
from model.rope import ROPE_CHUNK
from parallel import kernels
from parallel.plan_totals import GB


def block_terms(targets, one, *, D, F, G, H, K, KR, Kp, N, R, T, U, args, blk, dequant, direct, dora, dora_saved,
                dropped, e, hd, held, mb, nf4, offload, p, pack, row, ta, tiled, moe=None, linear=None) -> dict:
    """The "| block" phases of the backward of a block with LoRA on `targets` whose recompute holds `one`; `moe`: an
    MoE block's (saved MLP tensors, MLP phase, beside, --tiled-mlp's unit: (tokens, bytes) of a tile or None)
    (parallel/plan_moe.py; F is then k·I, a token's expert width);
    `linear`: a Gated DeltaNet block's sublayer backward beyond its saved tensors (parallel/plan_linear.py's), in
    place of 7 and 9: dh and it over the freed MLP (no kept attention output, no prefetch: the attention's only)."""
    t, gu = {}, any(x in targets for x in ("gate_proj", "up_proj"))
    beside = moe is not None and moe[2]   # Gemma 4's MoE: beside the dense MLP (F its width)
    unit = beside and tiled   # ... both in --tiled-mlp's feed-forward unit (plan_moe.unit)
    ds = lambda ts, rows=T: dora_saved(ts, rows, tg=targets)   # (this block's targets' DoRA tensors)
    if N and not K:   # less the block input: counted above, and the first norm saves it without a copy;
        # --ac-keep-attn: less its kept attention outputs too (counted above; the recompute takes them over)
        kept = KR * (e * T * H * hd + 4 * T * H) if getattr(args, "ac_keep_attn", False) and linear is None else 0
        t["| block recompute (AC): one block's saved tensors"] = one - kept
    if G > 1:
        t[f"| block group recompute: {G - 1} more block inputs + unsharded blocks"] = (G - 1) * (e * T * D + blk)
    if tiled:
        from parallel.memory import tile_tokens
        tt, tile = moe[3] if unit else (min(T, tile_tokens(D, None)), e * min(T, tile_tokens(D, None)) * (6 * F + D))
        mlp = e * T * D + tile + held("gate_proj", "up_proj", "down_proj") \
            + ds(("gate_proj", "up_proj", "down_proj"), tt)   # dy; dx: in h's storage
        t[f"| block backward at the tiled {'MLP and experts' if unit else 'MLP'} ({tt}-token tiles)" + (
            ", dequantized weights" if nf4 else "")] = mlp
    else:
        mlp = (moe[1] if moe and not beside else 2 * e * T * F + e * T * D * (1 + gu * direct)) + dequant
    if beside and not tiled:   # Gemma 4's experts (made after the dense MLP) run their backward first, the dense
        # branch's gradient waiting (eTD); then the dense MLP's, the experts' tensors freed, x's gradient from them
        # waiting (eTD)
        mlp = max(moe[1] + e * T * D + dequant, mlp + e * T * D - moe[0])
    if not tiled:
        t["| block backward at the MLP" + " and the experts" * beside + ": grads" + (", dequantized weight" if nf4
                                                                                     else "")] = mlp
    attn = kernel_backward(T, H, Kp, hd, e)
    what, n = "kernel", p.attn_block
    # --dpo-share-prompt: the rows' branches take the ring's planned calls, whose float32 sums are the ring's
    ring = R > 1 or (getattr(args, "objective", "sft") == "dpo" and getattr(args, "dpo_share_prompt", False))
    if not ring and Kp < H and (mb == 1 or not pack) and row > kernels.BACKWARD_BLOCK:   # blocked: dq, fp32
        call = kernel_backward(T, H, Kp, hd, e) + 4 * T * H * hd   # dk/dv, one call
        sums = 8 * T * Kp * hd * (n / row if mb == 1 and 8 * Kp <= e * H else 1)   # key block 0's; the rest: in out
        attn, what = sums + n / row * call, f"kernel in {n}-token blocks"   # dq, dk, dv: in q's, k's, v's storage
    if U > 1:
        attn += 2 * e * T * hd * (H + 2 * Kp)
        what += "+a2a"
    if ring:
        attn += 4 * e * T * Kp * hd + 4 * T * hd * (H + 4 * Kp) + 4 * T * H
        what += "+ring"
    # alive then, beyond the recompute: dh and the kernel's incoming gradient; gone: the MLP's tensors, h. Before
    # it, o_proj's backward: one input gradient (_BaseAndA), or on peft's path 2 (3 with a plain base: a view)
    lo = "o_proj" in targets and not direct
    oproj = e * T * H * hd * (1 + lo + (lo and not nf4))
    gone = (0 if tiled else (moe[0] if moe and not beside else 4 * e * T * F) + ds(
        ("gate_proj", "up_proj", "down_proj"))) + (moe[0] if beside and not tiled else 0)
    o_dora = ds(("o_proj",))   # gone once o_proj's DoRA node has run, which holds [T, D] (docstring)
    o_drop = dropped([x for x in ("o_proj",) if x in targets])   # gone once o_proj's LoRA A backward has run
    oproj = max(oproj, e * T * D * bool(o_dora))
    if linear is not None:
        t["| block linear attention backward over the freed MLP (dh + parallel/plan_linear's)"] = \
            max(0, e * T * D + linear - gone - mlp)
    elif ta:   # dh, dx and float32 dk, dv over the row, one tile's tensors; gone: h (the MLP's norm input) too
        n = kernels.tile_rows(T if pack else T // mb) * (1 if pack else mb)   # query rows of one tile (all padded
        # rows)
        call = e * n * hd * (H + 2 * Kp) + 4 * n * H * hd + (4 * e * n * H * hd if Kp < H else 0)
        tile = e * n * D + 2 * e * n * H * hd + 4 * n * H * hd + call \
            + ds(("q_proj", "k_proj", "v_proj", "o_proj"), n)
        attn = 2 * e * T * D + 8 * T * Kp * hd + tile + held("q_proj", "k_proj", "v_proj", "o_proj")
        t[f"| block attention in {n}-row query tiles over the freed MLP (tile {tile / GB:.2f} GB)"] = \
            max(0, attn - e * T * D - gone - mlp)
    else:
        ex = t[f"| block attention over the freed MLP ({what} {attn / GB:.2f} GB; o_proj's input grads "
               f"{oproj / GB:.2f})"] = max(0, max(attn + e * T * H * hd - o_dora - o_drop, oproj) - gone - mlp)
        # 9. q/k/v backward (q's chain first; see the docstring)
        first = max(2 * e * T * H * hd + 3.5 * e * min(ROPE_CHUNK, T * H * hd), 3 * e * T * H * hd * (U > 1))
        kv = ds(("k_proj", "v_proj"))   # (+ q's while its chain runs, to its DoRA node's 2 [T, H·hd])
        first = max(first, 2 * e * T * H * hd * ("q_proj" in targets and dora)) + ds(("q_proj",))
        qkv = e * T * D * (1 + offload) + max(first, e * T * (D + H * hd), 3 * e * T * D) + kv \
            + 2 * e * T * Kp * hd
        rec = one - (kept if N and not K else 0)   # the block's own: freed by then
        t["| block q/k/v backward after the kernel's" + " (next input prefetched)" * offload] = \
            max(0, qkv - rec - mlp - ex)
    if (kv := expanded_kv(p.target, T, H, Kp, hd, e)) and not ta and linear is None:   # 11. (--tiled-attn: a tile's)
        blocks = sum(v for k, v in t.items() if k.startswith("| block") and "recompute" not in k)
        # not yet made when it runs: the MLP's saved tensors (at least 3eTF) and its input (its norm's or the tiles')
        gone = e * T * D + (0 if tiled else moe[0] if moe and not beside else 3 * e * T * F) + (
            moe[0] if beside and not tiled else 0)
        t[f"| block attention forward (AC: in the recompute): the efficient op's K/V expanded ({kv / GB:.2f} GB)"] = \
            max(0, kv - gone - blocks)
    if N and not K and tiled and (ta or not direct or "o_proj" not in targets):   # 10. (2eTD - h + dy over rec)
        blocks = sum(v for k, v in t.items() if k.startswith("| block") and "recompute" not in k)
        t["| block recompute's forward at o_proj and the residual (dy + 2 [T, D])"] = max(0, 2 * e * T * D - blocks)
    return t


def kernel_backward(T: int, H: int, Kp: int, hd: int, e: int) -> int:
    """A backward call's buffers over T query and key rows (term 7): dq, dk, dv, and with K' < H four [T, H, hd] more:
    flash's float32 dq and dK/dV expanded to H heads; the efficient op's (torch's, backends._cuda_backward: float32,
    heads over 256) K, V, dK, dV expanded, beside which dk, dv are summed back to K' heads."""
    return e * T * hd * (H + 2 * Kp) + (4 * e * T * H * hd if Kp < H else 0)


def expanded_kv(target: str, T: int, H: int, Kp: int, hd: int, e: int) -> int:
    """Term 11: the K and V the efficient op's forward is handed expanded to H heads (backends._cuda_forward: CUDA,
    K' < H, float32 or heads over 256: Gemma 4's full layers), [T, H, hd] copies each; 0 where no op expands them
    (flash's and cuDNN's take GQA as is; one KV head expands as a view; the CPU's flash op expands them too: not
    planned there)."""
    from parallel.backends import cuda_op
    dtype = torch.bfloat16 if e == 2 else torch.float32
    return 2 * e * T * H * hd if target == "cuda" and 1 < Kp < H and cuda_op(dtype, hd) == "efficient" else 0


def loss_terms(*, T, D, V, e, el, tied, emb, softcap=None) -> dict:
    """The loss's terms (8; a tied head's held gradient; a trained embedding's "| end:" phase) at T tokens; `softcap`:
    the model's final_logit_softcapping (two float32 blocks of half the rows, the same bytes: loss.py)."""
    blocks = 1 if softcap is None else 2   # (the cap's tanh values beside the logits, for the gradient)
    t, c = {}, max(1, min(T, CHUNK_BYTES // (4 * blocks * V)))
    # a tied head's gradient (loss.py): summed in float32 over the chunks in the loss's forward (bf16 heads: + one
    # [V, D] product per chunk; the CPU's bf16: + the head's cast from its float32 master) and saved; its backward
    # hands it on in the head's dtype (e), held until the embedding's backward adds its own: a term of its own, so
    # the loss's lines below (which add up) count what they hold beyond it: the saved float32 sum's 4 - e, the
    # chunk's product and the cast
    if tied:
        t["tied head's gradient (the loss's share, held until the embedding's backward)"] = V * D * e
    t["| or: final norm input + loss grad_hidden (saved)"] = e * T * D + 4 * T + e * T * D + V * D * (4 - e) * tied
    if emb:   # backward's last node, once every activation is gone: the unsharded embedding's gradient, and FSDP2's
        # float32 reduce-scatter input (a tied head's share, held, added to it in place)
        t["| end: the input embedding's gradient + its reduce-scatter input (fp32)"] = V * D * (el + 4 - e * tied)
    t["| or: final norm output + chunked loss block" + "s (softcap)" * (softcap is not None)] = e * T * D + \
        4 * blocks * c * V + (2 * c * V if e == 2 else 0) + \
        V * D * (e * (e == 2) + e * (el != e)) * tied
    return t
