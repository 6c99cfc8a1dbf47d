"""Long-context memory steps applied from outside the model: tiled MLP, norm outputs rebuilt (offload: offload.py).

Contract:
- `apply_tiled_mlp(model, tile=None)` makes each block's MLP (its LoRA-wrapped, possibly NF4 projections
  included) run over tiles of the flattened tokens. Forward: each tile under no_grad, written into one
  [tokens, D] output. Backward: each tile is recomputed with grad and differentiated at once, its input
  gradient written into one [tokens, D] buffer (x's own, below) and the trainable parameters' gradients summed
  over tiles in float32, returned through autograd (AccumulateGrad and FSDP2 see one gradient per parameter). No
  [tokens, intermediate] tensor outlives one tile. Tile rule (`tile=None`): tokens per tile = the hidden
  size D, so a tile's [tile, F] intermediates have the size of one MLP weight [F, D] at any length.
  Its input x is the decoder's own (the block's h, or a norm's output) and read by nothing after the MLP, so where
  `recompute.spare(x)` the input gradient goes into x's storage, tile by tile once a tile's rows are read for the
  last time: no [tokens, D] buffer beside x. (Without AC a second backward through a kept graph fails torch's
  version check; with AC the block is recomputed. Another saver of x is not caught under AC: the contract.)
  Per token the math is the untiled MLP's; only the parameter gradients are summed in another order. NF4 weights
  are dequantized once per call for all its tiles (`model.nf4.dequant_once`: gate, up and down held together). With
  LoRA dropout each tile draws its own masks and backward replays them (the RNG state of forward, tile order).
  model.llama.Block hands it `norm_stand_in(norm, h)` instead of its norm's output (`takes_norm`): an empty tensor
  tagged with the norm and its input h (where grad is needed), so the norm's [T, D] output is never computed, in
  forward or in the block's recompute; the tiles start from h and run norm + MLP: h is the one saved tensor and
  gets the gradient (so do the norm's trainable parameters), and the norm's own backward over all tokens (a [T, D]
  gradient, float32 temporaries) never runs. In a block recompute the output, never read, is one element expanded
  to x's shape, not a [T, D] buffer (the two made ~7.5 GB of a 524,288-token block's peak on an H200).
  Gemma's and OLMo's block (model.gemma.SandwichBlock, its `feed_forward`; `_tiled_unit`): the whole feed-forward
  side is the tiled unit, on r, the residual after attention: pre_feedforward_layernorm, the MLP, its post norm,
  and Gemma 4's MoE beside the MLP (the router on r, pre_feedforward_layernorm_2, the experts,
  post_feedforward_layernorm_1 and _2), then post_feedforward_layernorm of the sum. r is the one saved tensor: no
  post norm keeps the MLP's [T, D] output, no [T, E] router tensor, [T·k, I] or [T·k, D] expert tensor outlives a
  tile; in a block recompute the unit runs no tile (nothing saved reads its output), and its backward tiles
  compute the MLP's output (the post norms read it: no `grads_only_context`). Tile rule with experts: E·D/k
  tokens, so each expert averages D routed rows a tile (GEMMs of a dense tile's shape) and its [t·k, I]
  intermediates are the size of one projection of all E experts: with D-token tiles each expert ran ~D·k/E rows
  (176 for the 26B-A4B) and the tiles' per-expert ops (~30 a tile forward and backward, in Python) came ~16x as
  often. NF4: the dense MLP's and every expert's weights are dequantized once a call, all held for its tiles
  (E·3·I·D: 1.5 GB for the 26B-A4B in bf16; per use would dequantize each expert 3 times a tile instead).
- `HostOffload`, the checkpoint offload: parallel/offload.py.
- `apply_norm_rebuild(model)`: peft's LoRA A on q/k/v and gate/up saves its input for the A gradient, a block
  RMSNorm's output. The norm saves its own input, so they keep that instead and rebuild the output in
  backward with the same norm call (row chunks of min(D, 2^24 / D) tokens): T·D fewer saved elements per
  norm; q/k/v share one rebuild, dropped after the last. It steps aside where peft hands LoRA A another
  tensor (dropout, a dtype cast). At layer 0's first norm the norm saves nothing (its input, the embedding's
  output, needs no grad), so without AC keeping that input instead of the output is even; with AC the block's
  recompute has the input anyway (looked up again from the ids), and keeping the output too was one [T, D] more
  in the first block's backward than in any other (bench/memtrace.py). The same numbers: bit for bit on CPU
  (tested); on CUDA a chunk may round the last bit apart.
- `recomputing()`, `recompute_context` and the bases whose outputs nobody reads in a recompute or a backward tile:
  parallel/recompute.py. The tiled MLP skips its forward tiles inside a block recompute (backward needs only its
  saved input; the checkpoint stops the recompute there, so the output is never read), and runs its backward
  tiles under `grads_only_context` (each tile's output is only differentiated).

Credit: tiling the MLP over the sequence and offloading checkpoints to the host follow Arctic Long Sequence
Training (Bekman et al., 2025); torchtitan's apply_ac shaped where this is applied.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from parallel.recompute import grads_only_context, recomputing, spare


def tile_tokens(dim: int, tile: int | None, routed: tuple | None = None) -> int:
    """Tokens per tile: `tile` if given, else the hidden size, or with experts in the unit (`routed`: (E, k), Gemma 4's
    MoE) E·D/k (see the module docstring)."""
    return max(1, tile or (dim * routed[0] // routed[1] if routed else dim))


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, rng, skip, unread, x, *params):
        # fn: a tile's rows -> its MLP output (the block norm first, when x is that norm's input);
        # rng: fn draws random numbers (LoRA dropout), so backward replays the tiles from this state; skip: no output
        # in a block recompute (False where the block would read it there: a norm after the MLP saving it); unread:
        # the down projection's output is only differentiated in a backward tile (not where fn's post norm reads it)
        ctx.fn, ctx.tile, ctx.params, ctx.unread = fn, tile, params, unread
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None) if rng else None
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])                                   # [N, D]
        # the checkpoint stops a recompute at our saved input and never reads the output: one element in x's shape
        # there, not a [tokens, D] buffer beside the recompute (made in forward too: selective AC, --ac-keep-attn,
        # replays forward's ops in order and refuses a recompute op that forward lacked)
        stand_in = x.new_empty(()).expand(x.shape)
        if skip and recomputing():
            return stand_in
        from model.nf4 import dequant_once  # bitsandbytes and peft: not on the planner's path (tile_tokens)
        with torch.no_grad(), dequant_once():   # NF4 weights dequantized once for all tiles, not once a tile
            out = _by_rows(fn, flat, tile)                                  # [N, D], tile by tile
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        (x,), params = ctx.saved_tensors, ctx.params
        flat, dflat = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        dx = None   # the input gradient goes into x's own storage where x is spare (module docstring)
        if ctx.needs_input_grad[5]:
            dx = flat.detach() if spare(x) else torch.empty_like(flat)
        acc = [None] * len(params)   # float32 sums over tiles: bf16 grads summed tile by tile would round
        from model.nf4 import dequant_once
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else [], enabled=ctx.rng is not None), \
                dequant_once():
            if ctx.rng is not None:   # the same dropout masks as forward: same state, same tile order
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], x.device)
            _tiles_backward(ctx, flat, dflat, dx, acc, params)
        pgrads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (None, None, None, None, None, None if dx is None else dx.view_as(x), *pgrads)


def _by_rows(fn, flat, rows):
    """fn over row chunks of a [N, D] tensor, written into one [N, D'] output."""
    out = None
    for i in range(0, flat.shape[0], rows):
        y = fn(flat[i:i + rows])
        if out is None:
            out = y.new_empty(flat.shape[0], y.shape[-1])
        out[i:i + rows] = y
    return out


def _tiles_backward(ctx, flat, dflat, dx, acc, params):
    for i in range(0, flat.shape[0], ctx.tile):
        xt = flat[i:i + ctx.tile].detach().requires_grad_(dx is not None)
        with torch.enable_grad(), grads_only_context() if ctx.unread else nullcontext():   # (y only differentiated:
            # the down base runs no GEMM; the unit's post norms read it)
            y = ctx.fn(xt)
        wrt = ([xt] if dx is not None else []) + list(params)
        grads = torch.autograd.grad(y, wrt, dflat[i:i + ctx.tile], allow_unused=True)
        if dx is not None:
            dx[i:i + ctx.tile], grads = grads[0], grads[1:]
        for j, g in enumerate(grads):
            if g is not None:
                acc[j] = g.float() if acc[j] is None else acc[j].add_(g)


def _tiled(mlp: nn.Module, tile: int | None, skip: bool = True):
    forward = mlp.forward   # the module's own forward: calling it skips __call__ (no recursion)
    rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules())

    def run(x):
        # the trainable parameters are inputs, so the output requires grad and autograd receives their
        # gradients; read per call, since FSDP2 swaps the parameter objects between sharded and unsharded
        params = [p for p in mlp.parameters() if p.requires_grad]
        src = getattr(x, "_norm_output", None)   # (the norm that made x, its input h)
        if src is None:
            return _TiledMLP.apply(forward, tile_tokens(x.shape[-1], tile), rng, skip, True, x, *params)
        # the block norm joins the tiles: its input h is the one saved tensor and gets the gradient, so x (an empty
        # stand-in, `norm_stand_in`: the norm never runs over all tokens) and the norm's own backward drop out
        norm, h = src
        return _TiledMLP.apply(lambda t: forward(norm.forward(t)), tile_tokens(h.shape[-1], tile), rng, skip, True,
                               h, *params, *norm.params)
    return run


def _tiled_unit(block, tile: int | None):
    """model.gemma.SandwichBlock's `feed_forward` (pre norm, MLP, Gemma 4's router and experts and their norms, the
    post norms) as one tiled unit on r, the residual after attention (module docstring)."""
    forward = block.feed_forward   # the untiled unit (a bound method), run per tile
    mods = [m for n in block.FEED_FORWARD if (m := getattr(block, n, None)) is not None]
    rng = any(isinstance(m, nn.Dropout) and m.p > 0 for mod in mods for m in mod.modules())
    routed = (len(block.experts), block.router.top_k) if block.experts is not None else None

    # a block recompute skips the unit (its output unread there) but where the block reads the sum after it: Gemma 4
    # E2B / E4B's per-layer input branch saves it (model/gemma4_small.add_block_parts), so the tiles run there
    skip = not getattr(block, "unit_output_read", False)

    def run(r):   # (parameters read per call: FSDP2 swaps them)
        params = [p for mod in mods for p in mod.parameters() if p.requires_grad]
        return _TiledMLP.apply(forward, tile_tokens(r.shape[-1], tile, routed), rng, skip, False, r, *params)
    return run


def apply_tiled_mlp(model, tile: int | None = None) -> None:
    """Tile every block's MLP over the tokens (module docstring); parameter names are unchanged."""
    for block in model.model.layers:
        if hasattr(block, "feed_forward"):   # Gemma's and OLMo's: the whole feed-forward side, one unit
            block.feed_forward = _tiled_unit(block, tile)
            continue
        block.mlp.forward = _tiled(block.mlp, tile, not getattr(block, "outputs_saved", False))
        block.mlp.takes_norm = norm_stand_in   # model.llama.Block hands it this, not the norm's output


# ------------------------------------------------------------------------- block norm outputs rebuilt


class _NormOutput:
    """Rebuilds one block norm's output in backward, once for the LoRA A layers it feeds. Holds no tensor
    from forward: what it held would outlive the block's checkpoint."""

    def __init__(self, forward, params):
        # params: the norm's trainable parameters at this call (the tiled MLP differentiates them per tile)
        self.forward, self.params, self.users, self.y = forward, params, 0, None

    def get(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of `x` (its saved input), built by the first user's backward and dropped after the last."""
        if self.y is None:
            d = x.shape[-1]
            with torch.no_grad():   # row chunks: the formula's fp32 temporaries stay ~3 x 64 MB (CUDA: none)
                self.y = _by_rows(self.forward, x.reshape(-1, d), min(d, max(1, 2**24 // d)))
        y, self.users = self.y.view_as(x), self.users - 1
        if self.users == 0:
            self.y = None
        return y


class _LoRAOnNorm(torch.autograd.Function):
    """lora_A(y) = y @ A^T for y a block norm's output x -> y: saves x (which the norm saves anyway), not y."""

    @staticmethod
    def forward(ctx, rebuild, x, y, weight):
        ctx.rebuild = rebuild
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(y, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        y = ctx.rebuild.get(x)
        dw = g.reshape(-1, g.shape[-1]).t().mm(y.reshape(-1, y.shape[-1])) if ctx.needs_input_grad[3] else None
        return None, None, g.matmul(weight) if ctx.needs_input_grad[2] else None, dw


def _tagging(norm: nn.Module):
    forward = norm.forward

    def run(x):
        y = forward(x)
        if torch.is_grad_enabled():   # for the consumers: how to rebuild y, from what (layer 0 too: see above)
            y._norm_output = (_NormOutput(forward, [p for p in norm.parameters() if p.requires_grad]), x)
        return y
    run.norm_forward = forward   # the norm's own (possibly compiled) forward, for tests
    return run


def norm_stand_in(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What model.llama.Block hands a sublayer that runs its block norm over its own tiles (`takes_norm`: the tiled
    MLP and attention) in place of norm(x): an empty tensor tagged as `_tagging` tags the norm's output, so that
    [T, D] output is never computed, in forward or in the block's recompute (layer 0's too, whose input needs no
    grad: the tiles' LoRA A still do). In no-grad mode, norm(x) itself: the sublayer then tiles that."""
    if not torch.is_grad_enabled():
        return norm(x)
    params = [p for p in norm.parameters() if p.requires_grad]
    y = x.new_empty(0)
    y._norm_output = (_NormOutput(getattr(norm.forward, "norm_forward", norm.forward), params), x)
    return y


def _lora_a(lin: nn.Linear):
    forward = lin.forward

    def run(y):
        src = getattr(y, "_norm_output", None)
        # peft hands lora_A the norm's output itself when no dropout or dtype cast comes between them
        if src is None or lin.bias is not None or y.dtype != lin.weight.dtype or not torch.is_grad_enabled():
            return forward(y)
        src[0].users += 1
        return _LoRAOnNorm.apply(src[0], src[1], y, lin.weight)
    return run


def apply_norm_rebuild(model) -> None:
    """LoRA A on q/k/v, gate/up and the tiled MLP keep a block norm's input, not its output (module docstring)."""
    for block in model.model.layers:   # (pre_norms: the norms in front of attention and MLP, Gemma's too)
        fed = dict(zip(block.pre_norms, getattr(block, "norm_fed", None) or (   # (linear blocks: linear_layers.py)
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))))
        for norm, projs in fed.items():
            norm = block.get_submodule(norm)
            norm.forward = _tagging(norm)   # after apply_compile: wraps the compiled forward
            subs = [getattr(block.get_submodule(p.split(".")[0]), p.split(".")[1], None) for p in projs]   # (MoE: none)
            for lin in (a for sub in subs for a in getattr(sub, "lora_A", {}).values()):
                lin.forward = _lora_a(lin)
