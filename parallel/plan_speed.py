"""Step time of a run's flags, estimated, to rank the flag sets that fit: `train.py --plan`'s "fastest:" line and
bench/gpu.py's "ours+fastest" row. Memory is parallel/plan.py's; this says which of the plans that fit runs fastest.

Contract:
- `step_seconds(margs, dims, args, target, pack)` -> (seconds, {category: seconds}) for one optimizer micro-step
  of one rank, on the H200 rates below (a ranking, not a promise: other GPUs scale the categories differently).
- `fastest(args, margs, dims, target, mem, host, pack, key)` -> [(flags, plan, seconds)] for every memory flag set
  that fits `mem` (`key(plan)`: the planned total by default), fastest first. The sets: the run's own flags; AC on
  the fewest blocks that fit (`--ac-blocks N`, or `--no-ac`) with the run's flags, with --ac-keep-attn, with
  --tiled-mlp, with --tiled-mlp --ac-keep-attn and with --tiled-mlp --tiled-attn (one process only).
  --offload-activations and --ac-group are memory flags with no speed to gain: kept only as the run has them.
- `cached_reference_line(args, margs, dims, target, pack)`: --plan's "dpo:" line, a DPO step with and without the
  reference model's forward (--dpo-cache-ref skips it from the second epoch on).
- `fast_flags(args, margs, dims, pack, world)` -> (flags, log line) and `apply_flags(args, flags)`: train.py's and
  --plan's `--fast`, the first of `fastest` for this device (95% of it) when it beats the run's own flags or those
  do not fit; `apply_fast(...)`: train.py's, for the smallest budget of all ranks (parallel/budgets.py gathers them).

The model, per rank, per block and micro-step, T tokens, S the row (attention span), P weights of a base matmul:
  g(P) = 2·T·P / MATMUL          a base matmul pass (forward, a recompute, or the input gradient: the base is frozen)
  a    = 4·T·S'·H·hd / ATTN      the attention kernel's forward, S' the keys a query sees (S/2 causal, the window);
         a Qwen3.5 linear layer's: T·flops.linear_core_flops / LINEAR, BWD its LINEAR_BWD, never kept or tiled
  o    = T·bytes / ELEMENTWISE   the elementwise work of a sublayer's forward (norm, RoPE, SwiGLU, adds, casts)
  forward g(all) + a + o;  backward g(all) + BWD·a + 2·o
  AC recompute of a checkpointed block: its attention half (g(q, k, v, o) + o_attn + a, no a with --ac-keep-attn),
    and without --tiled-mlp its MLP half (g(gate, up) + o_mlp, + g(down) for --quant none or where the block reads
    the MLP's output, Gemma's: elsewhere a 4-bit down_proj's output is read by nobody and not computed, recompute.py)
  --tiled-mlp: backward recomputes the MLP per tile (g(gate, up) + o_mlp: down_proj's frozen base only
    differentiates there, but in Gemma's unit, whose post norm reads it), x TILE; its AC recompute skips the MLP
  --tiled-attn: backward recomputes q's and k/v's chains per tile (g(q, k, v) + o_attn; o_proj only
    differentiates); its kernel calls cost x TILED_ATTN
  lm_head: 2·g(V·D) (loss.py: each chunk's logits and their input gradient, both in forward; a tied model's trained
    embedding, --train-embeddings, its weight gradient too: 3·g(V·D), and per chunk its [V, D] product added to a
    float32 sum, 12 bytes an element in bf16, 8 in fp32) and the float32 [chunk, V] softmax passes, ~16 bytes per
    logit at ELEMENTWISE; Gemma 4's final_logit_softcapping CAP (48) more. Each block at its own attention shape
    (Gemma 4: ModelArgs.attn_dims; no v_proj on its k_eq_v layers).
  --dora: the frozen bases whose output nobody reads above (down_proj in the recompute and the tiles, o_proj in the
    attention tiles) run their GEMM where DoRA adapts them (it reads it); each pass of an adapted layer (forward,
    the recompute but the tiled MLP's, the backward tiles' one call) computes B A (2·r·P) and ‖W + s·B A‖ (~8e
    bytes a weight: dequantize, the product, the sum, the norm's read), and the rescale's elementwise work (2e an
    output element forward; backward 6e: its scaled gradient, the product with the output and its sum). Not
    measured on a GPU.
  --objective dpo: a row holds a pair, two documents of --max-len (S' from --max-len), and the reference model's
    forward (no grad) adds a forward of every block and of lm_head: g(all) + a + o per block, g(V·D) + 8 bytes a logit
    (not for --dpo-loss simpo or orpo, which have no reference).
  --lora-layers: a block below the lowest adapted one runs its forward only (its input and weights need no grad);
    un-adapted blocks above it run as the others (their backward still differentiates the input), but DoRA's terms.
  Per block its own GEMMs, model.flops.block_matmuls (the MFU column's: one count): an MoE block's router and a
    token's k experts (Qwen3.5-MoE: + the shared expert and its gate) as its MLP module, recomputed whole (no
    down_proj base to skip) and tiled with --tiled-mlp; Gemma 4's experts beside its dense MLP, in the AC recompute
    untiled, in the feed-forward unit's tiles with --tiled-mlp (parallel/memory.py). Their dispatch's bytes and,
    with nf4, every expert's weights dequantized a pass (forward, backward's input gradient, the recompute; one for
    the tiles): parallel/plan_speed_block.py.
  Left out: communication (CP, FSDP2), the same for every flag set of a layout; --compile's fusions; packed rows
  of short documents (attention is counted as one causal document per row, which overvalues --ac-keep-attn there).
Rates (`RATES`): one H200, torch 2.11, cuDNN attention, from the 2026-11-30 profiles (bench/results/2026-11-30-h200):
matmul 2.05 s for 28 blocks' 2.7 passes + lm_head at 32k -> ~660 TFLOP/s; cuDNN forward 219 ms per 131,072-token
layer -> 562 TFLOP/s, backward 2.54x; elementwise ("other" 0.97 s at 32k over 4 passes of 28 blocks); the tiled
overheads from the --tiled-mlp (+2.5%) and --tiled-attn (+4.7%) rows at 128k. tests/test_plan_speed.py checks the
model against the measured H200 steps of every flag set (the code of that day: no recompute skip, the float32 norm,
the RoPE formula) and, with the defaults, against the late session's (bench/results/2026-11-30-h200-late: within
4.1%; cuDNN's attention backward took 2.86x its forward at 32k, 2.54x at 128k; the 524,288-token offload step took
10% longer than estimated, its tiled-attn step 3% less: single unwarmed steps). LINEAR, LINEAR_BWD: NOT measured on a
GPU (2026-12): the eager chunked rule's dispatch-bound estimate, its reasoning in parallel/plan_speed_block.py.
"""

from __future__ import annotations

import argparse
import re

from model.flops import block_matmuls
from model.lora_spec import lora_layers
from parallel import plan_search
from parallel.flags import check_flags
from parallel.plan import memory_plan
from parallel.plan_layers import unfused
from parallel.plan_speed_block import elementwise_bytes as _elementwise_bytes
from parallel.plan_speed_block import experts_tiled, mixing_seconds, mlp_read, moe_bytes, unit_read
from parallel.plan_totals import GB, sample_tokens, with_reference

CAP = 48   # bytes a logit of final_logit_softcapping's passes (loss.py): div, tanh, mul forward; square, addcmul
# for the gradient, float32 in place (4 read + 4 written each; addcmul reads three), 5 more elementwise passes
RATES = dict(MATMUL=660e12, ATTN=562e12, BWD=2.54, ELEMENTWISE=2.2e12, TILE=1.15, TILED_ATTN=1.06,
             REST=1.04,   # copies, casts, NF4 dequantize, the optimizer and launch gaps: ~4% of the profiled steps
             LINEAR=2.8e12, LINEAR_BWD=6.0)   # Qwen3.5's linear core: NOT measured on a GPU (module docstring)


def step_seconds(m, dims, args, target: str, pack: bool, nf4_skip: bool = True, fused_norm: bool | None = None,
                 rope: float = 5, reference: bool = True):
    """(seconds, {matmul, attention, elementwise}) of one micro-step on one rank (module docstring); `reference`
    False: a DPO step whose pairs' reference log-probs are kept (--dpo-cache-ref, the second epoch on)."""
    r = RATES
    m, args = unfused(m, args)   # (Phi-3's fused Linears timed as their parts: the same GEMM sizes, within one LoRA A)
    e = 2 if (args.dtype or ("bf16" if target == "cuda" else "fp32")) == "bf16" else 4
    fused_norm = target == "cuda" if fused_norm is None else fused_norm
    S, Sd = sample_tokens(args), args.max_len   # a row's tokens, a document's (a DPO pair: two of --max-len)
    T = (args.micro_batch or 1) * S // dims.cp   # (auto, 0: one row of the longest sample's length)
    ref = with_reference(args) and reference   # DPO: the reference model's forward too (no grad)
    D, H, K, hd, F, L, V = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.intermediate_size, m.n_layers, m.vocab_size
    g = lambda p: 2 * T * p / r["MATMUL"]
    nf4 = args.quant == "nf4"
    dora = getattr(args, "dora", False)
    shapes = {"q_proj": (H * hd, D), "k_proj": (K * hd, D), "v_proj": (K * hd, D), "o_proj": (D, H * hd),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F),   # (out, in); linear_attn's (Qwen3.5):
              **{n: (o, i) for n, (i, o) in (m.linear.projections(D) if getattr(m, "linear", None) else {}).items()}}
    adapted = [t for t in args.lora_targets.split(",") if t in shapes] if dora else []
    tiled, ta = getattr(args, "tiled_mlp", False), getattr(args, "tiled_attn", False)
    N = (L if getattr(args, "ac_blocks", None) is None else min(args.ac_blocks, L)) if args.ac else 0
    chosen = lora_layers(getattr(args, "lora_layers", None))   # --lora-layers (None: every block adapted)
    lo = min((i for i in range(L) if chosen is None or i in chosen), default=L - 1)
    mm = att = ew = 0.0
    for layer in range(L):   # each block's own GEMMs (model/flops.py: its attention shapes, experts, router)
        q, kv, o, gu, down, ex = block_matmuls(m, layer).values()   # (ex: Gemma 4's experts beside the dense MLP)
        H, K, hd = m.attn_dims(layer)
        shapes.update({"q_proj": (H * hd, D), "k_proj": (K * hd, D), "v_proj": (K * hd, D), "o_proj": (D, H * hd)})
        lin = m.is_linear(layer)   # (Qwen3.5's linear layers: no attention kernel, nothing --tiled-attn tiles)
        inner = m.moe is not None and m.moe.sparse(layer) and not m.moe.beside   # (the MoE is the MLP module: no
        ox, dq = moe_bytes(m, layer, e)   # down_proj base to skip, recompute.py; its dispatch bytes in om)
        ox, dq = 0 if inner else ox * T / r["ELEMENTWISE"], dq * nf4 / r["ELEMENTWISE"]   # (dq: a pass's dequantize)
        turns = rope if not hasattr(m, "rotates") or m.rotates(layer) else 0   # (SmolLM3's NoPE layers: no RoPE)
        oa, om = (b * T / r["ELEMENTWISE"] for b in _elementwise_bytes(m, e, fused_norm, turns, layer))
        a, back, kept = mixing_seconds(m, layer, T, Sd, r, ta)   # (the attention kernel, or a linear layer's core)
        if layer < lo:   # below the lowest adapted block: a forward with no grad (no backward, no recompute)
            mm, att = mm + g(q + kv + o + gu + down + ex) * (1 + ref), att + a * (1 + ref)
            ew += (oa + om + ox + dq) * (1 + ref)
            continue
        here = [t for t in adapted if m.has(layer, t)] if chosen is None or layer in chosen else []   # (a DoRA
        # base's output is read: its GEMM runs; no v_proj on Gemma 4's k_eq_v layers, linear_attn's in linear ones)
        skip_down, skip_o = (nf4_skip and t not in here for t in ("down_proj", "o_proj"))   # (recompute.py's rule)
        skip_down = skip_down and not inner
        mm += 2 * g(q + kv + o + gu + down + ex)
        att += a + back
        ew += 3 * (oa + om + ox) + 2 * dq   # (the experts' weights dequantized in forward and for dx in backward)
        read, xt = mlp_read(m, layer), tiled and experts_tiled(m, layer)   # (Gemma's blocks read the MLP's output)
        if layer < N:   # the checkpointed blocks' recompute: untiled, the MLP (and Gemma 4's experts); tiled, none of
            mm += g(q + kv + o) + (0 if xt else g(ex))   # the feed-forward side: a recompute skips the tiles, Gemma's
            att += 0 if args.ac_keep_attn and kept else a   # post norm runs in them (memory.py's unit)
            ew += oa + (0 if xt else ox) + dq * (not xt)   # (the tiles' dequant_once serves the backward tiles)
            if not tiled or unit_read(m, layer):   # (tiled: E2B / E4B's blocks read the unit's output there)
                mm += g(gu) + (0 if nf4 and skip_down and not read else g(down))
                ew += om
        if tiled:   # (Gemma's unit's tiles read down's output: its post norm is in them, so its GEMM runs there)
            mm += (g(gu) + (0 if skip_down and not read else g(down)) + (g(ex) if xt else 0)) * r["TILE"]
            ew += (om + (ox if xt else 0)) * r["TILE"]
        if ta and not lin:
            mm += g(q + kv) + (0 if skip_o else g(o))
            ew += oa
        if ref:
            mm, att, ew = mm + g(q + kv + o + gu + down + ex), att + a, ew + oa + om + ox + dq
        for t in here:   # DoRA: B A, row norms per pass, rescale
            (out, n), mlp = shapes[t], t in ("gate_proj", "up_proj", "down_proj")
            passes = 1 + (layer < N and (not tiled or not mlp)) + (tiled and mlp or ta and not (mlp or lin))
            mm += passes * 2 * args.lora_r * out * n / r["MATMUL"]
            ew += (passes * 8 * e * out * n + (2 * passes + 6) * e * T * out) / r["ELEMENTWISE"]
    tied = getattr(args, "train_embeddings", False) and m.tie_embeddings   # (the head's weight gradient too)
    mm += (3 if ref else 2 + tied) * g(V * D)
    ew += ((24 if ref else 16) + CAP * (1 + ref) * (getattr(m, "logit_softcap", None) is not None)) * T * V / r[
        "ELEMENTWISE"]   # (Gemma 4's softcap: its passes over every float32 logit, and the reference's)
    if tied:   # each chunk's [V, D] product added to the float32 sum (loss.py): read, and the sum read and written
        from loss import CHUNK_BYTES
        ew += (12 if e == 2 else 8) * V * D * -(-T // max(1, min(T, CHUNK_BYTES // (4 * V)))) / r["ELEMENTWISE"]
    return (mm + att + ew) * r["REST"], dict(matmul=mm, attention=att, elementwise=ew)


def fastest(args, margs, dims, target, mem, host, pack, key=None):
    """[(flags, plan, seconds)] of the flag sets that fit (module docstring), fastest first."""
    key = key or (lambda p: p.total)
    L = margs.n_layers
    sets = [("", {})]
    if args.ac_group == 1 and not args.offload_activations:
        sets += [(s, kw) for s, kw, ok in (
            ("--ac-keep-attn", dict(ac_keep_attn=True), not args.ac_keep_attn and not args.tiled_attn),
            ("--tiled-mlp", dict(tiled_mlp=True), not args.tiled_mlp),
            ("--tiled-mlp --ac-keep-attn", dict(tiled_mlp=True, ac_keep_attn=True),
             not args.tiled_attn and not (args.tiled_mlp and args.ac_keep_attn)),
            ("--tiled-mlp --tiled-attn", dict(tiled_mlp=True, tiled_attn=True),
             dims.cp == 1 and not args.ac_keep_attn and not (args.tiled_mlp and args.tiled_attn))) if ok]
    out = []
    for flags, kw in sets:
        a0 = argparse.Namespace(**{**vars(args), **kw})
        blocks = [None] if not args.ac or args.ac_group > 1 or args.offload_activations else \
            [n for n in range(0 if not a0.ac_keep_attn else 1, L + 1)]
        for n in blocks:   # the fewest checkpointed blocks that fit: the least recompute
            # with the run's own --ac-blocks the count is named as such (--no-ac would be refused beside it)
            own = args.ac_blocks is not None
            a = a0 if n is None else argparse.Namespace(**{**vars(a0), "ac": n > 0 or own,
                                                         "ac_blocks": n if own else None if n in (0, L) else n})
            try:
                check_flags(a)
                p = memory_plan(margs, dims, a, target, pack)
            except ValueError:
                continue
            if key(p) <= mem and p.host <= host:
                extra = "" if n is None or (n == L and not own) else (
                    " --no-ac" if n == 0 and not own else f" --ac-blocks {n}")
                out.append(((flags + extra).strip(), p, step_seconds(margs, dims, a, target, pack)[0]))
                break
    return sorted(out, key=lambda x: x[2])


def _faster(args, margs, dims, target, mem, host, pack):
    """(fits, best, own, own_fits): whether any flag set fits `mem` (95% of a device), the fastest one (flags, plan,
    seconds) if it beats the run's own flags or those do not fit, else None, the own flags' estimate, and whether
    they fit."""
    found = fastest(args, margs, dims, target, mem, host, pack)
    own = step_seconds(margs, dims, args, target, pack)[0]
    own_fits = plan_search._fits(memory_plan(margs, dims, args, target, pack), mem, host)
    best = found[0] if found and found[0][0] and (found[0][2] < own or not own_fits) else None
    return bool(found), best, own, own_fits


def fastest_line(args, margs, dims, target, mem, host, pack) -> str | None:
    """`--plan`'s "fastest:" line (CUDA plans only: the rates are a GPU's): the fastest flag set that fits 95% of
    the device, against the run's own flags."""
    if target != "cuda" or args.ac_group > 1:
        return None
    fits, best, own, _ = _faster(args, margs, dims, target, plan_search.SAFETY * mem, host, pack)
    if not fits:
        return f"fastest: nothing fits 95% of the device; the given flags est. {own:.2f} s/step at H200 rates"
    if best is None:
        return f"fastest: the given flags, est. {own:.2f} s/step at H200 rates (parallel/plan_speed.py)"
    flags, p, t = best
    return (f"fastest: {flags} fits ({p.total / GB:.1f} GB), est. {t:.2f} s/step vs {own:.2f} s for the given flags "
            "at H200 rates (parallel/plan_speed.py; --fast adds them)")


def cached_reference_line(args, margs, dims, target, pack) -> str | None:
    """`--plan`'s "dpo:" line for a DPO run with a reference model: its est. step with the reference forward and
    without it, as --dpo-cache-ref runs every epoch after the first (CUDA plans only, at H200 rates)."""
    if target != "cuda" or not with_reference(args):
        return None
    full, kept = (step_seconds(margs, dims, args, target, pack, reference=r)[0] for r in (True, False))
    said = (f"est. {full:.2f} s/step in the first epoch, {kept:.2f} s/step after it" if args.dpo_cache_ref else
            f"est. {full:.2f} s/step; --dpo-cache-ref keeps each pair's reference log-probs: {kept:.2f} s/step "
            "from the second epoch on (a resume reads those kept)")
    return f"dpo: the reference model's forward is {1 - kept / full:.0%} of a step: {said} (given flags, H200 rates)"


def fast_flags(args, margs, dims, pack, world: int, budget=None, host=None) -> tuple[str, str]:
    """--fast: (flags, log line): what `fastest_line` names for this device and world size (`budget`, else
    plan_search._budget's: --gpu-mem, this process's CUDA device, else this machine's RAM over its local ranks;
    `host` bytes, else --plan's --host-mem or this machine's RAM over its local ranks), "" where the run's own flags
    are the fastest that fit or nothing fits (the run's own checks then speak). On CPU too: there the ranking is
    still the H200's, the memory this machine's."""
    a = argparse.Namespace(**{"gpu_mem": None, "host_mem": None, **vars(args)})
    target, mem, where = budget or plan_search._budget(a, world)   # (looked up at the call: tests replace it)
    fits, best, own, own_fits = _faster(a, margs, dims, target, plan_search.SAFETY * mem,
                                        plan_search._host_budget(a, world) if host is None else host, pack)
    if best is None:
        return "", (f"--fast: the given flags are the fastest that fit 95% of {where} (est. {own:.3g} s/step at H200 "
                    "rates)" if fits else f"--fast: none of the memory flag sets --fast tries fits 95% of {where}; the "
                    "given flags are kept")
    flags, p, t = best
    return flags, (f"--fast: {flags} (planned {p.total / GB:.1f} GB of {where}; est. {t:.3g} s/step vs {own:.3g} s for "
                   "the given flags" + ("" if own_fits else ", which do not fit") + " at H200 rates, "
                   "parallel/plan_speed.py)")


def apply_fast(args, margs, dims, budgets, log, tokens: int | None = None) -> None:
    """train.py's --fast on every rank: `fast_flags` for the smallest device and host budget of all ranks
    (parallel.budgets.gather_budgets: the flags must fit every rank, mixed GPUs or hosts; a device's total memory
    less what other processes hold on it now, budgets.device_budget) and the data's longest sample (`tokens`:
    --max-len only caps the samples; shorter data leave memory to spend on less recompute), the same on every rank
    (same budgets, same arithmetic: no rank waits on another), applied to `args` and logged. A rank without a budget
    is named, raised on every rank."""
    from parallel.budgets import host_per_rank
    from parallel.preflight_memory import planning_copy
    if bad := next((b for b in budgets if b.target is None), None):
        raise RuntimeError(f"--fast: no device budget on {bad.where}")
    low = min(budgets, key=lambda b: b.device)
    where = low.where + (f", rank {low.rank}'s: the smallest of {len(budgets)}"
                         if len({b.device for b in budgets}) > 1 else "")
    try:
        two = sample_tokens(args) // args.max_len   # (2: a DPO pair, planned as 2n)
        n = min(args.max_len, -(-tokens // two) if tokens else args.max_len)
        flags, line = fast_flags(planning_copy(args, max_len=n), margs, dims, args.pack, len(budgets),
                                 budget=(low.target, low.device, where), host=min(host_per_rank(budgets)))
        line += f" for the longest sample, {two * n:,} tokens" if n < args.max_len else ""
    except Exception as e:   # noqa: BLE001 (the same on every rank)
        raise RuntimeError(f"--fast failed: {type(e).__name__}: {e}") from e
    apply_flags(args, flags)
    args.fast_flags = flags   # recorded in OUT/config.json with the rest: what --fast added, as typed
    log(line)


def apply_flags(args, flags: str) -> None:
    """`fast_flags`'s flags set on a run's args, as if typed: --tiled-mlp, --tiled-attn, --ac-keep-attn,
    --ac-blocks N, --no-ac."""
    for name, value in re.findall(r"--([a-z-]+)(?: (\d+))?", flags):
        if name == "no-ac":
            args.ac = False
        elif name in ("tiled-mlp", "tiled-attn", "ac-keep-attn", "ac-blocks"):
            setattr(args, name.replace("-", "_"), int(value) if value else True)
        else:
            raise ValueError(f"--fast: unexpected flag --{name} in {flags!r}")
