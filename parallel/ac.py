"""Activation checkpointing per decoder block (`apply_ac`, step 4b of parallel/parallelize.py's order): each block
recomputed in backward from its input, optionally in groups (--ac-group), for the first N blocks only (--ac-blocks),
keeping the attention kernels' outputs (--ac-keep-attn) or the inputs in host memory (--offload-activations,
parallel/offload.py). `check_ac`: those flags' constraints (parallel/flags.check_flags, apply_ac and build_model call
it)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from model.gemma4_small import run_block
from model.llama import Transformer
from parallel.offload import HostOffload
from parallel.recompute import recompute_context


def apply_ac(model: Transformer, offload: bool = False, group: int = 1, blocks: int | None = None,
             keep_attn: bool = False, reserve: int = 0) -> HostOffload | None:
    """Recompute each decoder block in backward: only its input is saved (non-reentrant checkpoint).
    `offload`: that input lives in host memory until its block's backward (offload.HostOffload, its host buffers
    at least `reserve` bytes each); returned.
    `blocks` N: only the first N blocks are checkpointed; the last L - N keep their activations (no recompute:
    faster, more memory). The last ones, because backward reaches them first: their activations are freed
    before any checkpointed block is recomputed, so the two never add up.
    `group` G > 1: a second, outer checkpoint around each run of G blocks keeps only the group's input. In
    backward the group is recomputed up to its last block's input (torch stops a recompute once it has
    what backward needs), which re-saves the G - 1 inner block inputs, then each block is recomputed as
    with G = 1: ceil(L/G) - 1 + G - 1 block inputs live instead of L - 1 (the first checkpoint keeps the token
    ids, `_FromIds`), for G - 1 more block forwards per group.
    FSDP2's hooks run inside the group recompute; it keeps those blocks unsharded (no reshard, no
    prefetch-order record while in backward) until their own backward.
    `keep_attn`: selective AC. Each block checkpoint also keeps the outputs (out, lse) of the attention kernel
    ops it runs (torch's dispatch-level cache, create_selective_checkpoint_contexts), so the recompute takes
    them instead of running the kernel again: attention, most of a long-context step, runs once per step
    forward instead of twice, for T·H·hd·e + 4·T·H bytes per checkpointed block (per ring step under ring).
    Kernels not in ATTENTION_OPS (the float64 reference, math fallbacks) are recomputed as before.
    Credit: checkpointed segments of sqrt(L) layers follow Chen et al., "Training Deep Nets with Sublinear
    Memory Cost" (2016); saving only the expensive ops follows torchtitan's selective AC (op-level policy)."""
    check_ac(group, True, offload, blocks, keep_attn)
    hooks = HostOffload(reserve) if offload else None
    if blocks != 0:
        _tag_lookups(model.model.embed_tokens)
    for block in model.model.layers[:blocks]:
        if hooks and hasattr(block, "self_attn"):   # the next block's input comes back once this block's attention
            block.self_attn.forward = hooks.after_attention(block.self_attn.forward)   # backward is done (a linear
            # block's release never comes: its own unpack fetches it, without the overlap: offload.py)
        block.forward = _checkpointed(block.forward, hooks, _keep_attn_contexts if keep_attn else _contexts, block)
    if group > 1:
        model.model.run_blocks = _grouped(model.model.layers, group)
    return hooks


class _FromIds:
    """The first checkpoint's saved input when it is a frozen embedding's output: the checkpoint keeps the token
    ids and looks the [T, D] rows up again when its recompute asks for them (one block input fewer kept from
    the end of the forward on). Saved-tensor hooks bypass autograd's in-place check, so the versions are
    checked here: an output changed in place before the checkpoint is saved as usual; ids changed in place
    before backward (a reused input buffer) raise instead of giving layer 0 wrong gradients."""

    def __init__(self, lookup, ids, x):
        self.lookup, self.ids, self.like = lookup, ids, (x.shape, x.dtype, x.device)
        self.versions = (x._version, ids._version)

    def saving(self, x):
        def unpack(h):
            if h is not self:
                return h
            if self.ids._version != self.versions[1]:
                raise RuntimeError("the input_ids of this step were modified in place between forward and "
                                   "backward; activation checkpointing looks the first block's input up again "
                                   "from them: pass a fresh ids tensor per micro-batch (or clone it)")
            with torch.no_grad():
                t = self.lookup(self.ids)
            if (t.shape, t.dtype, t.device) != self.like:
                raise RuntimeError(f"the embedding looked up again is {(t.shape, t.dtype, t.device)}, "
                                   f"the checkpoint saved {self.like}")
            return t
        ref = weakref.ref(x)   # autograd may keep the pack hook as long as the saved tensor: not x itself
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self if t is ref() else t, unpack)


def _tag_lookups(embed):   # its output, when it needs no grad, carries how to look it up again
    lookup = embed.forward

    def run(ids):
        x = lookup(ids)
        if torch.is_grad_enabled() and not x.requires_grad:
            x._from_ids = _FromIds(lookup, ids, x)
        return x
    embed.forward = run


def _saving(x, hooks):
    """The hooks around a checkpoint call whose first input is x. The outermost checkpoint that sees the ids'
    lookup takes it (popped): a group's inner first block then saves x through the group's checkpoint, in
    forward as in the group's recompute (which hands it a fresh lookup), so their saved tensors pair up."""
    src = x.__dict__.pop("_from_ids", None)
    if src is not None and x._version == src.versions[0]:   # else changed in place: not a lookup any more
        return src.saving(x)
    return hooks.saving(x) if hooks else contextlib.nullcontext()


def _contexts():   # checkpoint's context_fn: nothing around the forward, a flag around the recompute
    return contextlib.nullcontext(), recompute_context()


# the attention kernels torch or flash-attn run as one op (outputs: out, lse, and the op's bookkeeping)
ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward", "flash_attn._flash_attn_forward", "flash_attn._flash_attn_varlen_forward"})


_KEEP: dict = {}   # op -> policy: the policy runs for every op of every checkpointed block


def _keep_attention(ctx, op, *args, **kwargs):
    if op not in _KEEP:
        keep = str(getattr(op, "overloadpacket", op)) in ATTENTION_OPS
        _KEEP[op] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return _KEEP[op]


def _keep_attn_contexts():   # a fresh cache per checkpoint call; the recompute reads it, with the flag set
    caching, cached = create_selective_checkpoint_contexts(_keep_attention)
    return caching, recompute_context(True, cached)


def _group_contexts():   # a group's recompute runs whole blocks: their tiled MLPs must produce outputs
    return contextlib.nullcontext(), recompute_context(False)


def _grouped(layers, group):
    def run(h, *args, carry=None):   # (carry: Gemma 4 E2B / E4B's per-layer inputs and shared K/V, gemma4_small.py:
        for i in range(0, len(layers), group):   # a group's storing block's K/V leave its checkpoint through it)
            blocks = layers[i:i + group]
            if len(blocks) == 1 or not torch.is_grad_enabled() or _frozen(h, blocks):
                for block in blocks:
                    h = run_block(block, h, args, carry)
            else:
                with _saving(h, None):
                    h = checkpoint(_run_group, blocks, h, *args, carry=carry, use_reentrant=False,
                                   context_fn=_group_contexts)
        return h
    return run


def _run_group(blocks, h, *args, carry=None):
    for block in blocks:   # block(...): FSDP2's hooks, then the block's own checkpoint
        h = run_block(block, h, args, carry)
    return h


def _frozen(x, blocks) -> bool:
    """Nothing to differentiate here: x needs no grad and the blocks train nothing (--lora-layers' blocks below the
    lowest adapted one). torch's checkpoint would still save x, which --offload-activations would copy to host."""
    return not x.requires_grad and not any(p.requires_grad for b in blocks for p in b.parameters())


def _checkpointed(forward, hooks, contexts, block):
    def run(*args, **kw):   # (kw: Gemma 4 E2B / E4B's per-layer input and shared K/V: inputs of the checkpoint)
        if not torch.is_grad_enabled() or _frozen(args[0], [block]):   # eval (or a frozen block): nothing to save,
            return forward(*args, **kw)                                  # nothing to recompute
        # the hooks wrap the checkpoint call, so they see the checkpoint's saved inputs and nothing else
        with _saving(args[0], hooks):
            return checkpoint(forward, *args, **kw, use_reentrant=False, context_fn=contexts)
    run.hooks = hooks   # for tests and logs: what the offload moved
    return run


def check_ac(group: int, ac: bool, offload: bool, blocks: int | None = None, keep_attn: bool = False,
             tiled_attn: bool = False) -> None:
    """The AC flags' constraints (--ac-group, --ac-blocks, --ac-keep-attn; parallel/ac.apply_ac),
    named with the fix."""
    if offload and not ac:
        raise ValueError("--offload-activations moves the checkpoints of --ac to host memory: drop --no-ac")
    if keep_attn and tiled_attn:
        raise ValueError("--tiled-attn with --ac-keep-attn: the tiles run many attention kernels per block, whose "
                         "outputs --ac-keep-attn would keep (many times the attention output); use one or the other")
    if keep_attn and not ac:
        raise ValueError("--ac-keep-attn keeps the attention outputs of --ac's checkpoints: drop --no-ac")
    if keep_attn and (group > 1 or offload):
        what = f"--ac-group {group}" if group > 1 else "--offload-activations"
        raise ValueError(f"--ac-keep-attn with {what}: that flag saves device memory, --ac-keep-attn spends it "
                         "(one attention output per checkpointed block) for speed; use one or the other")
    if keep_attn and blocks == 0:
        raise ValueError("--ac-keep-attn with --ac-blocks 0: no block is checkpointed, so no recompute to spare; "
                         "raise --ac-blocks or drop --ac-keep-attn")
    if blocks is not None and blocks < 0:
        raise ValueError(f"--ac-blocks must be >= 0 (how many blocks to checkpoint), got {blocks}")
    if blocks is not None and not ac:
        raise ValueError(f"--ac-blocks {blocks} picks the blocks --ac checkpoints: drop --no-ac")
    if blocks is not None and group > 1:
        raise ValueError(f"--ac-blocks {blocks} with --ac-group {group}: use one or the other")
    if blocks == 0 and offload:
        raise ValueError("--ac-blocks 0 with --offload-activations: no block is checkpointed, so nothing is "
                         "offloaded; raise --ac-blocks or drop --offload-activations")
    if group < 1:
        raise ValueError(f"--ac-group must be >= 1 (blocks per kept checkpoint), got {group}")
    if group > 1 and not ac:
        raise ValueError(f"--ac-group {group} groups the checkpoints of --ac: drop --no-ac or use --ac-group 1")
    if group > 1 and offload:
        raise ValueError(f"--ac-group {group} with --offload-activations: the checkpoints are in host memory "
                         "already; use one or the other")
