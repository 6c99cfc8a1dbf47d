"""`--compile`: torch.compile of the elementwise pieces of every block (parallel/parallelize.py, step 4c).

Contract: `apply_compile(model)` wraps every RMSNorm (Gemma's, and Gemma 4's weightless v_norm), Rotary and SwiGLU /
GeGLU forward (below); the math is the eager one up to float rounding order (tests/test_compile.py: loss and LoRA
grads equal eager, one process and FSDP2 ring on 2 ranks; no function recompiles for a new length or exceeds a few
dynamo cache entries; tests/test_gemma3_run.py: Gemma 3 and 4).
"""

from __future__ import annotations


def apply_compile(model) -> None:
    """torch.compile the elementwise pieces of every block (RMSNorm, RoPE, SwiGLU), each a small graph
    with no collective, LoRA or 4-bit op inside: they fuse into a few kernels and compose with AC (the
    recompute calls the same compiled code), FSDP2 (parameters arrive unsharded) and NF4. Whole-block
    compilation would break its graph at the CP attention's communication and bitsandbytes' ops."""
    import torch._dynamo

    from model.gemma import GeGLU, GemmaRMSNorm, UnitRMSNorm
    from model.llama import SwiGLU
    from model.rmsnorm import RMSNorm
    from model.rope import Rotary

    # One compiled function serves every block, but dynamo guards on rank, grad mode and requires_grad: whole
    # rows and tiles, layer 0's input (no grad), no_grad forward tiles. Rows in, rows out (rank 2) keeps the
    # variants to a few; past dynamo's limit (8) a function would run eager from then on, silently.
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"   # torch < 2.6: the old name
    setattr(cfg, limit, max(getattr(cfg, limit), 32))
    for m in model.modules():
        if isinstance(m, Rotary):
            m.forward = torch.compile(m.forward, dynamic=True)
        elif isinstance(m, (RMSNorm, SwiGLU, GemmaRMSNorm, UnitRMSNorm, GeGLU)):   # (UnitRMSNorm: v's, each head)
            m.forward = _as_rows(torch.compile(m.forward, dynamic=True))


def _as_rows(fn):
    """fn over [N, last] views of its tensor arguments (all of one shape), its output viewed back."""
    def run(*xs):
        return fn(*(x.reshape(-1, x.shape[-1]) for x in xs)).view(*xs[0].shape[:-1], -1)
    run.compiled = fn
    return run
