"""The per-chunk losses of loss.py's chunked cross-entropy: one [c, V] float32 logits block in, the chunk's loss and
d(loss)/d(logits) out. What each computes, the chunking and the head GEMMs around them: loss.py's docstring, 3.

- `fused_ce`: the default cross-entropy, its gradient made in place in the block (`dft`: --sft-loss dft's weighting).
- `custom_loss`: a `loss_fn`'s chunk sum and, by autograd on this chunk's logits only, its gradient.
- `cap` / `uncap`: the final-logit soft-cap u = c·tanh(z / c) in the block, and the gradient back through it.
- `hits` (token accuracy's numerator): each path counts the target rows whose target is the row's top logit.

Math only, on blocks the caller owns; imports nothing but torch. loss.py imports it inside its autograd Function, not at
its top: model/llama.py imports loss.py, and this package's `__init__` imports llama.
"""

import torch


def fused_ce(logits, safe, valid, grad: bool = True, hits=None, dft: bool = False):
    """Cross-entropy of a chunk's rows and, in place in `logits`, its gradient softmax - one_hot (if `grad`); `hits`
    gets the count of rows whose target is the top logit added. `dft`: each row's loss and gradient × its target's
    probability p = exp(z_target - lse), a constant (no gradient through it)."""
    target = logits.gather(1, safe)                     # [c, 1]
    mx = logits.amax(1, keepdim=True)
    if hits is not None:   # (from what the loss reads anyway: no pass over the block)
        count_hits(hits, (target >= mx) & (valid > 0))
    probs = logits.sub_(mx).exp_()                      # exp(z - max), in place
    denom = probs.sum(1, keepdim=True)
    ce = mx + denom.log() - target                      # lse - z_target, per row [c, 1]
    w = valid * (-ce).exp() if dft else valid           # (DFT: from the row's own [c, 1] numbers, no pass over V)
    loss = torch.where(valid > 0, w * ce, 0.0).squeeze(1)
    if grad:
        probs.mul_(w / denom).scatter_add_(1, safe, -w)   # 0 on ignored rows
    return loss, probs


def count_hits(hits, right):
    """Add a chunk's [c, 1] right-or-not to `hits`: their count (0-dim) or each row's 0/1 (`hits` the chunk's [c])."""
    hits += right.squeeze(1) if hits.dim() else right.sum()


def custom_loss(loss_fn, logits, labels, safe, valid, need_grad, hits=None):
    """A user loss on one chunk and its gradient w.r.t. the chunk's logits (autograd, chunk-local); `hits` as
    `fused_ce`'s, counted first (loss_fn may write into the block: one more pass over it)."""
    if hits is not None:
        count_hits(hits, (logits.gather(1, safe) >= logits.amax(1, keepdim=True)) & (valid > 0))
    if not need_grad:
        return loss_fn(logits, labels).float(), None
    with torch.enable_grad():
        z = logits.detach().requires_grad_()
        loss = loss_fn(z, labels)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar (the chunk's summed loss), got shape {tuple(loss.shape)}")
        (grad,) = torch.autograd.grad(loss, z, allow_unused=True)
    return loss.detach().float(), (torch.zeros_like(logits) if grad is None else grad)


def cap(logits, c, tblock):
    """The block's logits z → u = c·tanh(z / c), in place (transformers' order of operations), and t = tanh(z / c) in
    the first rows of `tblock` for the gradient (returned); `tblock` None (no gradient: nothing needs t): None."""
    if tblock is None:
        logits.div_(c).tanh_().mul_(c)
        return None
    t = torch.div(logits, c, out=tblock[: logits.shape[0]]).tanh_()
    torch.mul(t, c, out=logits)
    return t


def uncap(dlogits, t):
    """d(loss)/d(z) = d/du - d/du·t², written over t (d/du may be loss_fn's, any layout: not written to)."""
    return torch.addcmul(dlogits, dlogits, t.square_(), value=-1, out=t)
