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
   its output there (eTD, when handed it directly: no cast, no dropout).
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
        """DoRA's saved tensors (term 4) for the targets among `ts` at `rows` tokens (`sh`: the block's shapes)."""
        e, el, args, dora, direct = self.e, self.el, self.args, self.dora, self.direct
        rows, tg, sh = self.T if rows is None else rows, self.targets if tg is None else tg, sh or self.shapes
        ts = [x for x in ts if dora and x in tg]
        if direct:   # the fused sum `out`, the norm and the scale
            return e * (rows + 2) * sum(sh[x][0] for x in ts)
        lead = [first and x in FED for x in ts]   # layer 0's: their input needs no grad
        eb = el if args.lora_dropout > 0 else e   # the base's share: F.linear's (in el), else the base's own output
        return sum(((eb + el) * rows + el * (3 - z)) * sh[x][0] for x, z in zip(ts, lead))

    def dropped(self, ts, first=False, sh=None) -> float:
        """LoRA dropout's saved output and mask for the targets `ts`: the mask a bool on CUDA (native_dropout), in el
        on CPU (the scaled mask its product keeps); none where the input needs no grad (q/k/v of block lo, `first`).
        down_proj's dropped input takes the place of the MLP's product (counted in 4eTF, kept only for down's LoRA
        A): its mask alone is more."""
        e, el, T, args, target, sh = self.e, self.el, self.T, self.args, self.target, sh or self.shapes
        mask = lambda x: 0 if first and x in FED else 1 if target == "cuda" else el
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
        inner = [t for t in tg if not (tiled and t in ("gate_proj", "up_proj", "down_proj"))
                 and not (tl and t in ("q_proj", "k_proj", "v_proj", "o_proj"))]
        # the MLP's input: its norm keeps it and rsqrt (the tiles run the norm: no rsqrt); with no norm in front
        # (OLMo) the tiled MLP keeps it, else gate/up's LoRA A where handed it directly
        mlp_in = e * T * D + 4 * T * (not tiled) if pre else e * T * D * (tiled or fed(tg, "gate_proj", "up_proj"))
        if linear:   # as the attention's norm in front; in_proj_*'s LoRA A keep its input (its output at block lo,
            # where the MLP's norm keeps no rsqrt if the sublayer's output needs no grad: no target of its own)
            b = mlp_in + (e * T * D + 4 * T) * (not first) + e * T * D * first * fed(tg, *plan_linear.IN_PROJ) \
                + plan_linear.sublayer_saved(m, T, rows, e, self.cp, tg, first, direct) \
                - 4 * T * (first and not tiled and not any(x in tg for x in plan_linear.IN_PROJ + ("out_proj",)))
        elif tl:   # the tiles keep the sublayer's (the norm's) input (layer 0's too), k, v, out, lse: no rsqrt, q,
            # LoRA A
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
                     if (not first or t in tg or norms and tg) and m.has(i, t)) * m.qk_norm   # (reuse layers: no k)
            b += plan_layers.v_norm_saved(m, i, T, e, not first or ("k_proj" if m.shares_kv(i) else "v_proj") in tg)
        b += (e * T * D + 4 * T) * (2 - tiled) * post   # Gemma's and OLMo's norms on attention's and the MLP's outputs
        b += plan_small.branch_saved(m, T, e, norms)   # (Gemma 4 E2B / E4B's PLE branch; the MLP at its width)
        xr = r * bool(xl and i in adapted)   # (the experts' LoRA rank in an adapted MoE block)
        b += (0 if tiled else plan_moe.saved(m, T, e, xr) if sparse and not beside else e * T * sh["up_proj"][0] * (
            3 + ("down_proj" in tg and el == e))) + (plan_moe.saved(m, T, e) if sparse and beside and not tiled else 0)
        # (Gemma 4's MoE: beside the dense MLP, tiled with it; el != e: down's A keeps its float32 input, not the
        # product; peft casts x before dropout: the dropped input is kept, not the cast)
        b += sum(T * r * el + (4 * T * sh[t][1] if el != e and not args.lora_dropout > 0 else 0) for t in inner
                 if t not in plan_layers.doubled(args, inner)) \
            + dora_saved(inner, first=first, tg=tg, sh=sh)
        return b + dropped(inner, first, sh)
