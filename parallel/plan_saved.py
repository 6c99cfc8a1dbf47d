"""Term 4 of the memory plan (parallel/plan.py): the tensors autograd saves for one decoder block, as
saved_tensors_hooks count them on this decoder (tests/test_plan.py and each family's tests compare the two).

Contract: `Saved(...)`, filled by parallel/plan.py's `memory_plan` with the run's sizes and flags;
`Saved.layer(first, tg, sparse, linear, i)`: block i's saved bytes (`first`: its input needs no grad, block lo's;
`tg`: its LoRA targets; `sparse`: an MoE block, parallel/plan_moe.py; `linear`: a Gated DeltaNet block,
parallel/plan_linear.py); `dora_saved`, `dropped`: DoRA's and LoRA dropout's share, which the block phases
(parallel/plan_block.py) count again. The checkpoints around the blocks (AC, offload, --ac-blocks, --ac-group,
--lora-layers) are parallel/plan.py's.

Notation: parallel/plan.py's. Per block: each RMSNorm keeps its input and rsqrt [T] (2·(eTD + 4T)); LoRA A on q/k/v
   and on gate/up keeps that same input, not the norm's
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
   its output there (eTD, when handed it directly: no cast, no dropout). At block lo only what an adapted projection
   makes need grad is kept (`frozen_inputs`): no kernel tensors without q/k/v (o_proj's LoRA A keeps out), no MLP norm
   without o_proj too, silu's and the product's by gate's and up's, no dropout mask on an input needing no grad.
   --tiled-attn: the sublayer keeps its input (the norm's, layer 0's too), k, v, out, lse: no q, rsqrt or LoRA
   intermediate of q/k/v/o (parallel/tiled_attention.py).
   --dora (model/dora.py), per adapted projection of o outputs: the fused path keeps its sum `out` for the
   magnitude's gradient, the norm and the scale: e(T + 2)·o. peft's formula (LoRA dropout, a cast: dora.forward)
   keeps the base's and LoRA's shares and three [o], el(2T + 3)·o (without dropout the base's share is the base
   layer's own output, e·T·o: el != e is the CPU's bf16; the share on the dropped input saves no weight:
   model.dora._FrozenLinear dequantizes again in backward); at layer 0 q/k/v one [o] less (their input needs no
   grad). As autograd saves them.
   Qwen3.5's gated attention (attn_gate; q_proj [2·H·hd, D]: each head's query and gate): sigmoid(gate) eT·H·hd
   where the gate or the core's output needs grad, and the gated product (o_proj's input, no view of out) for o_proj's
   LoRA A when handed it directly (eT·H·hd; under Ulysses the product keeps heads_to_seq's output instead of o_proj's
   LoRA A, where the gate needs grad); --tiled-attn recomputes the gate: none.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel import plan_layers, plan_linear, plan_moe, plan_small

FED = ("q_proj", "k_proj", "v_proj") + plan_linear.IN_PROJ   # the projections the block's input norm feeds


@dataclass(frozen=True)
class Saved:
    """What term 4 reads of the run (parallel/plan.py's names: sizes, the block's shapes, the flags)."""
    m: object
    args: object
    target: str
    e: int
    el: int
    T: int
    U: int
    cp: int
    D: int
    H: int
    r: int
    rows: int
    shapes: dict
    at: object
    targets: list
    norms: bool
    pre: bool
    post: bool
    emb: bool
    ta: bool
    tiled: bool
    beside: bool
    dora: bool
    xl: list
    adapted: list

    @property
    def direct(self) -> bool:   # LoRA A is handed the norm's output itself (no cast, dropout)
        return self.el == self.e and self.args.lora_dropout == 0

    @property
    def qkv(self) -> bool:
        return any(t in self.targets for t in ("q_proj", "k_proj", "v_proj"))

    def fed(self, tg, *ts) -> bool:   # LoRA A of one of `ts` keeps the input it is handed
        return self.direct and any(t in tg for t in ts)

    def dora_saved(self, ts, rows=None, first=False, tg=None, sh=None) -> float:
        """DoRA's saved tensors (term 4) for the targets among `ts` at `rows` tokens (`sh`: the block's shapes;
        `first`: True for block lo's FED, or the targets whose input needs no grad there, `frozen_inputs`)."""
        e, el, args, dora, direct = self.e, self.el, self.args, self.dora, self.direct
        rows, tg, sh = self.T if rows is None else rows, self.targets if tg is None else tg, sh or self.shapes
        ts = [x for x in ts if dora and x in tg]
        if direct:   # the fused sum `out`, the norm and the scale
            return e * (rows + 2) * sum(sh[x][0] for x in ts)
        lead = [x in _free(first) for x in ts]   # their input needs no grad (block lo's)
        eb = el if args.lora_dropout > 0 else e   # the base's share: F.linear's (in el), else the base's own output
        return sum(((eb + el) * rows + el * (3 - z)) * sh[x][0] for x, z in zip(ts, lead))

    def dropped(self, ts, first=False, sh=None) -> float:
        """LoRA dropout's saved output and mask for the targets `ts`: the mask a bool on CUDA (native_dropout), in el
        on CPU (the scaled mask its product keeps); none where the input needs no grad (q/k/v of block lo, `first`).
        down_proj's dropped input takes the place of the MLP's product (counted in 4eTF, kept only for down's LoRA
        A): its mask alone is more. `first` as dora_saved's."""
        e, el, T, args, target, sh = self.e, self.el, self.T, self.args, self.target, sh or self.shapes
        mask = lambda x: 0 if x in _free(first) else 1 if target == "cuda" else el
        return sum(T * sh[x][1] * (mask(x) + el * (x != "down_proj" or el != e)) for x in ts) * (
            args.lora_dropout > 0)   # (el != e, CPU bf16: no product kept, dropout's el output in its place)

    def layer(self, first: bool, tg=None, sparse=False, linear=False, i=0) -> float:
        """Block i's saved tensors; `first`: its input needs no grad (block lo's); `tg`: its LoRA targets; `linear`:
        a Gated DeltaNet block (parallel/plan_linear.py: its sublayer's tensors in place of the attention's)."""
        m, args, e, el, T, U, D, H, r, rows = (self.m, self.args, self.e, self.el, self.T, self.U, self.D, self.H,
                                               self.r, self.rows)
        at, norms, pre, post, emb, ta, tiled = self.at, self.norms, self.pre, self.post, self.emb, self.ta, self.tiled
        beside, xl, adapted, direct, qkv, fed = self.beside, self.xl, self.adapted, self.direct, self.qkv, self.fed
        dora_saved, dropped, tg = self.dora_saved, self.dropped, self.targets if tg is None else tg
        _, KV, hd = m.attn_dims(i)   # (Gemma 4's full layers: their own; parallel/plan_layers.py)
        Kp, sh = max(KV, U), at(i)
        first = first and not (norms and tg and pre) and not emb   # (a trained pre-norm saves its input and makes
        # an output needing grad; a trained embedding makes block 0's input need grad)
        tl = ta and not linear   # (--tiled-attn tiles the full layers only)
        kin, ag, free = frozen_inputs(first, tg, linear, sparse)
        inner = [t for t in tg if not (tiled and t in ("gate_proj", "up_proj", "down_proj"))
                 and not (tl and t in ("q_proj", "k_proj", "v_proj", "o_proj"))]
        # the MLP's input: its norm keeps it and rsqrt (the tiles run the norm: no rsqrt); with no norm in front
        # (OLMo) the tiled MLP keeps it, else gate/up's LoRA A where handed it directly
        # (block lo, the sublayer's output needing no grad: nor does the MLP's input, so its norm keeps nothing)
        mlp_in = e * T * D + 4 * T * (not tiled) if pre and ag else \
            e * T * D * (tiled or fed(tg, "gate_proj", "up_proj"))
        if linear:   # as the attention's norm in front; in_proj_*'s LoRA A keep its input (its output at block lo,
            # where the MLP's norm keeps no rsqrt if the sublayer's output needs no grad: no target of its own)
            b = mlp_in + (e * T * D + 4 * T) * (not first) + e * T * D * first * fed(tg, *plan_linear.IN_PROJ) \
                + plan_linear.sublayer_saved(m, T, rows, e, self.cp, tg, first, direct)
        elif tl:   # the tiles keep the sublayer's (the norm's) input (layer 0's too), k, v, out, lse: no rsqrt, q,
            # LoRA A
            b = mlp_in + (e * T * D + e * T * hd * (H + 2 * Kp) + 4 * T * H) * ag   # (nothing without a grad)
        else:
            b = mlp_in + ((e * T * D + 4 * T) * (not first) + e * T * D * qkv * first * direct if pre
                          else e * T * D * fed(tg, "q_proj", "k_proj", "v_proj"))   # (OLMo: q/k/v's LoRA A keep x)
            # the kernel keeps q, k, v, out, lse where one of q, k, v needs grad; else o_proj's LoRA A keeps out
            b += (e * T * hd * (2 * H + 2 * Kp) + 4 * T * H) * kin \
                + e * T * H * hd * (not kin and U == 1 and not m.attn_gate and fed(tg, "o_proj"))
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
                     if (not first or t in tg or norms and tg) and m.has(i, t)) * m.qk_norm   # (reuse layers: no k)
            b += plan_layers.v_norm_saved(m, i, T, e, not first or ("k_proj" if m.shares_kv(i) else "v_proj") in tg)
        b += (e * T * D + 4 * T) * (ag + (not tiled)) * post   # Gemma's and OLMo's norms on attention's and the
        # MLP's outputs (attention's: none where its output needs no grad, at block lo)
        b += plan_small.branch_saved(m, T, e, norms)   # (Gemma 4 E2B / E4B's PLE branch; the MLP at its width)
        xr = r * bool(xl and i in adapted)   # (the experts' LoRA rank in an adapted MoE block)
        # the dense MLP: silu keeps gate's output and the product up where gate's needs grad, silu(gate) where up's
        # does (at block lo only an adapted gate's, up's, with the MLP's input needing none), down's A the product
        g, u = ag or "gate_proj" in tg, ag or "up_proj" in tg
        b += (0 if tiled else plan_moe.saved(m, T, e, xr) if sparse and not beside else e * T * sh["up_proj"][0] * (
            2 * g + u + ("down_proj" in tg and el == e))) + (
            plan_moe.saved(m, T, e) if sparse and beside and not tiled else 0)
        # (Gemma 4's MoE: beside the dense MLP, tiled with it; el != e: down's A keeps its float32 input, not the
        # product; peft casts x before dropout: the dropped input is kept, not the cast)
        b += sum(T * r * el + (4 * T * sh[t][1] if el != e and not args.lora_dropout > 0 else 0) for t in inner
                 if t not in plan_layers.doubled(args, inner)) \
            + dora_saved(inner, first=free, tg=tg, sh=sh)
        return b + dropped(inner, free, sh)


def _free(first) -> tuple:
    """The targets whose input needs no grad: `first` True, block lo's FED; False, none; else those named."""
    return FED if first is True else () if first is False else tuple(first)


def frozen_inputs(first: bool, tg, linear=False, sparse=False) -> tuple:
    """(the attention's (the core's) inputs need grad, its output does, the targets whose input needs no grad) in a
    block with LoRA on `tg`; `first`: block lo's, whose input needs none. There only an adapted projection's output
    needs grad, and what is made from it: q/k/v's (in_proj_*'s) make the kernel's (the core's) inputs need it, o_proj
    (out_proj) the sublayer's output, then the residual and the MLP's input (an MoE block's: counted as needing it),
    gate's or up's the product, down's input. (Until 2026-12-07 block lo was planned as if all but its input needed
    grad: MLP-only targets over-counted its kernel's saved tensors, the MLP's norm and up to 3 [T, F].)"""
    sub, out = (plan_linear.IN_PROJ, "out_proj") if linear else (("q_proj", "k_proj", "v_proj"), "o_proj")
    kin = not first or any(x in tg for x in sub)
    ag = kin or out in tg
    if not first:
        return kin, ag, ()
    g, u = ag or sparse or "gate_proj" in tg, ag or sparse or "up_proj" in tg
    return kin, ag or sparse, FED + (out,) * (not kin) + ("gate_proj", "up_proj") * (not ag and not sparse) \
        + ("down_proj",) * (not (g or u))
