"""Chunked linear cross-entropy: the LM-head loss without a [tokens, vocab] logits tensor.

At 32k tokens and a 151,936-token vocabulary the float32 logits alone are 19.9 GB, and autograd keeps two or three
tensors of that size alive. Here the head matmul, the loss and its gradient run per chunk of tokens, so only one
[chunk, vocab] float32 block exists at a time. Idea from Liger kernel's fused linear cross entropy and Apple's
cut-cross-entropy.

Contract of `chunked_cross_entropy(hidden [N, D], weight [V, D], labels [N], loss_fn=None, softcap=None) -> (loss_sum,
n_tokens)`:

1. `labels` are already shifted (`labels[t]` is the target of `hidden[t]`); `ignore_index` marks prompt/padding
   positions. `n_tokens` is the int64 count of the other positions (no grad).
2. Tokens are walked in chunks of `chunk_size` rows (default: `auto_chunk_size`, which keeps the float32 logits block
   near `CHUNK_BYTES`). No host sync: an all-ignored chunk costs like any other.
3. Per chunk, in the forward pass: logits = hidden_chunk @ weight.T (a GEMM in the weight's dtype with float32
   accumulation) into a reused float32 block; with `softcap=c` (Gemma 2/4's final_logit_softcapping) the block then
   holds the capped logits u = c·tanh(logits / c), transformers' order of operations, and everything below (the loss,
   `hits`, `dft`, `per_token`, a `loss_fn`'s input) is of u. Then the loss and d(loss)/d(u) (model/chunk_loss.py):
   - `loss_fn=None` (default): fused cross-entropy; softmax - one_hot (0 on ignored rows) is made in place in the
     block, no autograd involved. `dft=True` scales each row's loss and gradient by its target's probability, a
     constant (Wu et al. 2025, "On the Generalization of SFT": Dynamic Fine-Tuning).
   - `loss_fn(logits [c, V] float32, labels [c]) -> scalar`: any differentiable loss, which must be the SUM of the
     chunk's per-token losses over its target rows (ignored rows carry `ignore_index`). Autograd differentiates it
     w.r.t. this chunk's logits only, so label smoothing, a z-loss or token weights need no hand-written gradient and
     still no [N, V] tensor, and no second head GEMM.
   With the cap, d(loss)/d(logits) = d(loss)/d(u) · (1 - t²), t = tanh(logits / c) from a second float32 block of the
   chunk's size (torch's own tanh backward reads its output the same way). Why a block, not a recompute: t cannot be
   kept in the block (the fused path turns it into probabilities in place), recomputing it means a second head GEMM
   per chunk, and recovering it from the probabilities (u = lse + log p) loses it where exp(u - max) underflows
   float32 (c above ~43). So the cap halves the auto chunk: the two blocks together stay near `CHUNK_BYTES` (without
   grad no t is kept: one block, the chunk as uncapped). An explicit `chunk_size` is honored: two blocks of it.
   d(loss)/d(logits) is turned into d/d(hidden_chunk) (and, for a trainable weight, accumulated into d/d(weight))
   while the block is live.
4. `loss_sum` is the float32 SUM over target tokens; the caller divides by the GLOBAL target count.
5. Backward only scales the stored gradients by the incoming scalar (in place, so no second copy of a [V, D] gradient
   appears); the graph can therefore be backpropagated once (no retain_graph).

FSDP2: the model calls this inside the root module's forward, where FSDP2 has all-gathered `lm_head.weight`, so the
unsharded weight is live for every chunk. With a frozen weight (LoRA) nothing about the weight is saved for backward
(only grad_hidden is), so backward never all-gathers it again.

Context parallelism: each cp rank passes its own sequence shard of hidden states and labels. Labels were shifted on
the whole sequence before sharding, so the shards' sums add up to the unsharded sum; the caller all-reduces
`loss_sum` and `n_tokens` (over cp, dp and micro-batches) before dividing.
"""

import math
from collections.abc import Callable

import torch

IGNORE_INDEX = -100   # the label of positions without a target; F.cross_entropy's default too

# Budget for the one [chunk, V] float32 logits block: chunk = CHUNK_BYTES // (4 * V), so 256 MiB at V=151,936 gives
# 441 tokens. The fused path works in place in the block, so the transient peak is this plus, for bf16 weights, one
# half-size bf16 copy; a `loss_fn` adds what its autograd keeps (e.g. two or three more blocks for log_softmax). A
# softcap with grad: two blocks of CHUNK_BYTES // (8 * V) rows (128 at Gemma's V=262,144), the same bytes, and a
# bf16 copy of half the size. On top, the forward keeps grad_hidden [N, D] and, for a trainable weight, a float32
# [V, D] gradient (bf16/fp16 weights: + one [V, D] product per chunk).
CHUNK_BYTES = 256 * 2**20

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def auto_chunk_size(n_tokens: int, vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: floor(budget_bytes / (4 * vocab)), clamped to [1, n_tokens]."""
    return max(1, min(n_tokens, budget_bytes // (4 * vocab)))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the gradients; backward just scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, loss_fn, per_token=False, hits=None, dft=False,
                softcap=None):
        # (imported here, not at the top: model/llama.py imports this module, and the model package imports llama)
        from model.chunk_loss import cap, custom_loss, fused_ce, uncap
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if per_token and (loss_fn is not None or need_w):   # (a row's weight gradient cannot be scaled afterwards)
            raise ValueError("per_token: the fused cross-entropy only (no loss_fn), and a frozen weight")
        ctx.per_token = per_token
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0).unsqueeze(1)   # [N, 1]; any in-range id works for masked rows
        validf = valid.to(torch.float32).unsqueeze(1)      # [N, 1]
        loss_sum = torch.zeros(n if per_token else (), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        # A trainable weight's gradient sums every chunk's (bf16: a float32-accumulating GEMM's) product in float32,
        # rounded once, not per chunk (a bf16 sum over 300 chunks at 128k); autograd casts it on the way out.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # One [chunk, V] float32 block reused by every chunk: the only vocab-sized tensor.
        block = torch.empty(min(chunk_size, n), weight.shape[0], dtype=torch.float32, device=hidden.device)
        # A softcap's tanh values for its gradient (module docstring, 3): a second block, only when a gradient is made.
        tblock = torch.empty_like(block) if softcap is not None and (need_h or need_w) else None

        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            x = hidden[s:e].to(weight.dtype)               # [c, D]
            logits = block[: e - s]                        # [c, V], a contiguous prefix
            hit = hits[s:e] if hits is not None and hits.dim() else hits   # (per-row hits: a view of the chunk's)
            if weight.dtype == torch.float32:
                torch.mm(x, weight.t(), out=logits)
            else:
                logits.copy_(x @ weight.t())               # a bf16 GEMM (float32 accumulate), then upcast
            t = None if softcap is None else cap(logits, softcap, tblock)   # u = c·tanh(z / c) in the block, t beside
            if loss_fn is None:
                loss, dlogits = fused_ce(logits, safe[s:e], validf[s:e], need_h or need_w, hit, dft)
                if per_token:
                    loss_sum[s:e] = loss
                else:
                    loss_sum += loss.sum()
            else:
                loss, dlogits = custom_loss(loss_fn, logits, labels[s:e], safe[s:e], validf[s:e], need_h or need_w, hit)
                loss_sum += loss
            if not (need_h or need_w):
                continue
            if t is not None:   # through the cap: d/dz = d/du·(1 - t²)
                dlogits = uncap(dlogits, t)
            g = dlogits.to(weight.dtype)
            if need_h and grad_h.dtype == weight.dtype:
                torch.mm(g, weight, out=grad_h[s:e])       # a row block of a contiguous tensor: no copy
            elif need_h:
                grad_h[s:e] = g @ weight
            if need_w and grad_w.dtype == weight.dtype:
                grad_w.addmm_(g.t(), x)
            elif need_w:
                grad_w += g.t() @ x

        # Only gradients are saved, never the weight: with a frozen weight FSDP2 can free it.
        ctx.save_for_backward(grad_h, grad_w)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_out):
        if getattr(ctx, "used", False):   # (else autograd's in-place version check fires, naming no cause)
            raise RuntimeError("chunked_cross_entropy: a second backward through one forward: the loss scales its "
                               "saved gradients in place, so run the forward again per backward")
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        # In place: the buffers are this node's. grad_out stays float32: the exact factor (1 / global target count).
        if grad_h is not None:   # (per_token: each row by its own factor, so the saved rows are d(loss_t)/d(hidden_t))
            grad_h = grad_h.mul_(grad_out.unsqueeze(1) if ctx.per_token else grad_out)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None,
                          loss_fn: LossFn | None = None, per_token: bool = False, hits: torch.Tensor | None = None,
                          dft: bool = False, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses of `hidden @ weight.T` against `labels` (already shifted), and the target count: (loss_sum
    float32 0-dim, n_tokens int64 0-dim). Gradients flow to `hidden` and, if it requires grad, to `weight`.
    `loss_fn=None` is cross-entropy; see the module docstring for a custom `loss_fn`.
    `per_token=True`: the losses [N] float32 (-log p of each target, 0 at ignored rows) in place of their sum, for
    a loss of whole sequences (`parallel.preference.dpo_loss`); backward scales each row's saved gradient by its own
    incoming factor, so it takes the fused cross-entropy only and a frozen `weight` (LoRA's head).
    `hits`: an int64 tensor (FSDP2's mixed precision casts a float one to a copy) that gets, in place, the count of
    target rows whose target has the row's largest logit (token accuracy's numerator; a tie counts), or, shaped [N],
    each row's 1 or 0 (--eval-positions' accuracy by position), from what the loss reads anyway.
    `dft=True` (--sft-loss dft): sum of sg(p)·(-log p), each target's loss and gradient scaled by its p held
    constant (Dynamic Fine-Tuning), from the fused path's own numbers (no loss_fn; `hits` unchanged).
    `softcap=c` (a finite c > 0): every path above is of the capped logits c·tanh(logits / c) in float32 (module
    docstring, 3); `hits` too, so a target saturating with the row's largest (float32 tanh is 1 beyond |logits / c|
    ≈ 9.1) ties with it and counts, though the uncapped argmax is the other.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, D], weight [V, D], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if dft and loss_fn is not None:
        raise ValueError("dft scales the fused cross-entropy; a loss_fn computes its own loss: pass one of them")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, int | float)
                                or not 0 < softcap < math.inf):   # (0 divides by zero, a negative c flips every logit)
        raise ValueError(f"softcap must be None (no cap) or a finite number > 0 (the config's final_logit_softcapping, "
                         f"e.g. 30.0), got {softcap!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hits is not None and (hits.is_floating_point() or hits.is_complex()):   # (FSDP2's bf16 would count in a copy)
        raise ValueError(f"hits must be an integer tensor (torch.int64), got {hits.dtype}")
    if hits is not None and hits.shape not in ((), labels.shape):
        raise ValueError(f"hits must be 0-dim (the count) or shaped as labels {tuple(labels.shape)} (each row's), got "
                         f"{tuple(hits.shape)}")
    if not torch.is_grad_enabled():   # (Function.apply still reports needs_input_grad under no_grad: no grad work)
        hidden, weight = hidden.detach(), weight.detach()
    two = softcap is not None and (hidden.requires_grad or weight.requires_grad)   # (forward's tblock: same test)
    chunk = chunk_size or auto_chunk_size(hidden.shape[0], weight.shape[0], CHUNK_BYTES // (2 if two else 1))
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk, loss_fn, per_token, hits,
                                           dft, softcap), (labels != ignore_index).sum()
