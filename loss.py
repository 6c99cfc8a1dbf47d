"""Chunked linear cross-entropy: the LM-head loss without a [tokens, vocab] logits tensor.

At 32k tokens and a 151,936-token vocabulary the float32 logits alone are 19.9 GB, and autograd keeps
two or three tensors of that size alive. Here the head matmul, softmax, loss and gradient are fused
per chunk of tokens, so only one [chunk, vocab] float32 block exists at a time.
Idea from Liger kernel's fused linear cross entropy and Apple's cut-cross-entropy.

Contract of `chunked_cross_entropy(hidden [N, D], weight [V, D], labels [N]) -> (loss_sum, n_tokens)`:

1. `labels` are already shifted (`labels[t]` is the target of `hidden[t]`); `ignore_index` marks
   prompt/padding positions. `n_tokens` is the int64 count of the other positions (no grad).
2. Tokens are walked in chunks of `chunk_size` rows (default: `auto_chunk_size`, which keeps the
   float32 logits block near `CHUNK_BYTES`). A chunk whose labels are all ignored costs the same as
   any other: skipping it would need a host sync, and this function never syncs.
3. Per chunk, in the forward pass: logits = hidden_chunk @ weight.T in the weight's dtype (the GEMM
   accumulates in float32 on CPU and CUDA), written into a reused float32 block; log-sum-exp and the target logit give
   the token losses; softmax - one_hot, zeroed on ignored rows, is d(loss_sum)/d(logits) and is
   turned into d/d(hidden_chunk) (and, if the weight is trainable, added into a float32 d/d(weight))
   while the block is still live.
4. `loss_sum` is the float32 SUM over target tokens; the caller divides by the GLOBAL target count.
5. Backward only scales the stored gradients by the incoming scalar (in place, so no second copy of
   a [V, D] gradient appears); the graph can therefore be backpropagated once (no retain_graph).

FSDP2: the model calls this inside the root module's forward, where FSDP2 has all-gathered
`lm_head.weight`, so the unsharded weight is live for every chunk. With a frozen weight (LoRA) nothing
about the weight is saved for backward (only grad_hidden is), so FSDP2 may reshard it right after the
forward and backward never all-gathers it again for the loss.

Context parallelism: each cp rank passes its own sequence shard of hidden states and labels. Labels
were shifted on the whole sequence before sharding, so a shard's last position already holds its
target from the next shard and the shards' sums add up to the unsharded sum; the caller all-reduces
`loss_sum` and `n_tokens` (over cp, dp and micro-batches) before dividing.
"""

import torch

# Budget for the one [chunk, V] float32 logits block: chunk = CHUNK_BYTES // (4 * V), so 256 MiB at
# V=151,936 gives 441 tokens. Softmax and its gradient are made in place in the block, so the transient
# peak is this plus, for bf16 weights, one half-size bf16 copy (GEMM output or grad-GEMM input). On top
# of it the forward keeps grad_hidden [N, D] and, for a trainable weight, a float32 [V, D] gradient.
CHUNK_BYTES = 256 * 2**20


def auto_chunk_size(n_tokens: int, vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: floor(budget_bytes / (4 * vocab)), clamped to [1, n_tokens]."""
    return max(1, min(n_tokens, budget_bytes // (4 * vocab)))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the gradients; backward just scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size):
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0).unsqueeze(1)  # [N, 1]; any in-range id works for masked rows
        validf = valid.to(torch.float32).unsqueeze(1)  # [N, 1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # One [chunk, V] float32 block reused by every chunk: the only vocab-sized tensor.
        block = torch.empty(min(chunk_size, n), weight.shape[0], dtype=torch.float32, device=hidden.device)

        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            x = hidden[s:e].to(weight.dtype)  # [c, D]
            y, m = safe[s:e], validf[s:e]  # [c, 1]
            logits = block[: e - s]  # [c, V], a contiguous prefix
            if weight.dtype == torch.float32:
                torch.mm(x, weight.t(), out=logits)
            else:
                logits.copy_(x @ weight.t())  # a bf16 GEMM (float32 accumulate), then upcast
            target = logits.gather(1, y)  # [c, 1]
            mx = logits.amax(1, keepdim=True)
            probs = logits.sub_(mx).exp_()  # exp(z - max), in place
            denom = probs.sum(1, keepdim=True)
            token_loss = mx + denom.log() - target  # lse - z_target
            loss_sum += torch.where(m > 0, token_loss, 0.0).sum()
            if not (need_h or need_w):
                continue
            # d(loss)/d(logits) = softmax - one_hot on target rows, 0 on ignored rows.
            probs.mul_(m / denom).scatter_add_(1, y, -m)
            if need_h:
                grad_h[s:e] = probs.to(weight.dtype) @ weight
            if need_w:
                grad_w.addmm_(probs.t(), x.float())

        if need_w and weight.dtype != torch.float32:
            grad_w = grad_w.to(weight.dtype)
        # Only gradients are saved, never the weight: with a frozen weight FSDP2 can free it.
        ctx.save_for_backward(grad_h, grad_w)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # In place: these buffers belong to this node and are released with it. grad_out stays float32
        # so a bf16 gradient is scaled by the exact factor (e.g. 1 / global token count).
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out)
        return grad_h, grad_w, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of `hidden @ weight.T` against `labels`, and the target count.

    hidden [N, D], weight [V, D], labels [N] (already shifted). Returns (loss_sum float32 0-dim,
    n_tokens int64 0-dim). Gradients flow to `hidden` and, if it requires grad, to `weight`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, D], weight [V, D], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not torch.is_grad_enabled():
        # Function.apply still reports needs_input_grad under no_grad; detaching skips the grad work.
        hidden, weight = hidden.detach(), weight.detach()
    n_tokens = (labels != ignore_index).sum()
    chunk = chunk_size or auto_chunk_size(hidden.shape[0], weight.shape[0])
    loss_sum = ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk)
    return loss_sum, n_tokens
