"""The memory plan's terms for Gemma 4 E2B / E4B's parts (model/gemma4_small.py: per-layer embeddings (PLE), KV
sharing, the KV-shared layers' double-wide MLP), in parallel/plan.py's notation, plus P = hidden_size_per_layer_input
and V' = vocab_size_per_layer_input. Functions of ModelArgs (`m.small`); memory_plan calls them beside
parallel/plan_layers.py's per-layer hooks, which plan each block at its own shapes: a reuse layer without k_proj,
v_proj, k_norm, v_norm (and their LoRA, saved tensors), an MLP of its own width (E2B's reuse layers: 2F), each such
layer a kind of its own (FSDP2's unsharded block, the block phases 6-11 at its F: the wide block's are the peak's).

- Weights (terms 1, 2, 5): the decoder's table [V', L·P], per_layer_model_projection [L·P, D] and
  per_layer_projection_norm [P], frozen, in the compute dtype, whole on every rank beside embed_tokens (FSDP2 ignores
  the root's frozen parameters: parallel/fsdp.py): `root_terms` (E2B's table: 2.35B elements, 4.7 GB in bf16). On
  CUDA the table is in host memory (parallel/host_table.py; not with --ple-on-device): a host term, V'·L·P·e, with the
  pinned buffer of a micro-batch's gathered rows, e·T·L·P rounded up to a power of two (torch's pinned allocator;
  one buffer, reused), planned against --host-mem with --offload-activations' buffers (`Plan.host`). Their device copy,
  the U rows and the [T, L·P] expanded from them, lives at the forward's start, before any activation is saved (as
  the table's lookup did on the device): under the peak, not a term. On CPU the "host" is the device's RAM: the
  table stays a device term, as offloaded checkpoints do. Each block's
  per_layer_input_gate [P, D], per_layer_projection [D, P] and post_per_layer_input_norm [D]: never NF4 (model/nf4.py
  quantizes the projections LoRA adapts), sharded with the block norms (`block_base`). --train-norms trains the two
  norms: the block's [D] with the other block norms, the decoder's [P] as the final norm (`trained_norms`).
- Activations (term 4), pinned against autograd's saved tensors (tests/test_plan_small.py):
    the per-layer inputs [T, L, P] (`inputs`): one tensor made before block 0, each block handed a view of its slice,
    which its PLE branch's product saves (and under AC the block's checkpoint keeps as an input): the whole storage
    lives from the forward's start to the last block's backward, e·T·L·P (E2B: 8,960 elements a token, 5.8 block
    inputs);
    a block's PLE branch (`branch_saved`), wherever its input or output needs grad (block lo and above), with and
    without --tiled-mlp (it runs after the MLP's residual, outside its tiles): gelu's input, the gate's output [T, P],
    and post_per_layer_input_norm's input and float32 rsqrt (eTD + 4T); the frozen gate and projection save none of
    their inputs;
    --train-norms (per_layer_projection_norm) or --train-embeddings make the per-layer inputs need a gradient: the
    projection's norm keeps its input [T, L·P] and rsqrt [T, L], each block's product gelu's output [T, P], and the
    inputs' gradient [T, L, P] sums over the blocks' backward (e·T·L·P, with the stored K/V's term);
    the stored K/V (`stored_kv`): each storing layer's k and v [T, K, hd] at its own (K, hd) flow to the reuse layers
    (a core gets copies, which it saves as any layer's k, v: term 4's). Without AC autograd saves neither; the forward
    holds them to its end (the loss phase), and in backward their gradients sum over the reuse layers' backward until
    the storing layer's: 2e·T·K·hd a storing layer either way. Under AC they are outputs of the storer's checkpoint and
    inputs of the reuse layers', held to the lowest reuse layer's backward while their gradients sum from the highest
    one's: twice that over the reuse layers' backward, where the peak block (E2B's wide MLP) runs.
Not modelled: the PLE branch's own backward (dh, [T, P] gradients: under the MLP phase's), the per-layer inputs' making
at the forward's start (a few e·T·L·P transients, before any activation is saved).
"""

from __future__ import annotations


def root_terms(t: dict, p, m, args, e: int, T: int, W: int, norms: bool, target: str) -> None:
    """The decoder's PLE parameters into the plan's terms `t`: the projection and norm whole on every rank (a trained
    norm [P] sharded with AdamW's, as the final norm: `trained_norms`); the table beside them, or on CUDA, unless
    --ple-on-device, in host memory with a micro-batch's pinned rows: `p.host_ple`, part of `p.host` (module
    docstring)."""
    s = m.small
    if s is None or not s.ple:
        return
    table, host = s.ple_vocab * m.n_layers * s.ple * e, target == "cuda" and not getattr(args, "ple_on_device", False)
    rest = (m.dim * m.n_layers * s.ple + s.ple * (not norms)) * e + 16 * -(-s.ple // W) * norms
    t[f"per-layer embeddings: {'' if host else 'table, '}projection, norm (frozen: whole on every rank)"] = \
        rest + table * (not host)
    if host:
        p.host_ple = table + (1 << (e * T * m.n_layers * s.ple - 1).bit_length())   # (the rows: a power of two)
        p.host += p.host_ple


def trained_norms(m) -> tuple[list, list]:
    """(a block's, the root's) norms --train-norms adds, as (dim 0, elements): post_per_layer_input_norm [D],
    per_layer_projection_norm [P]."""
    s = m.small
    return ([(m.dim, m.dim)], [(s.ple, s.ple)]) if s is not None and s.ple else ([], [])


def block_base(m) -> list:
    """A block's never-quantized PLE parameters, (dim 0, elements): the gate, the projection and their norm."""
    s, d = m.small, m.dim
    return [(s.ple, s.ple * d), (d, d * s.ple), (d, d)] if s is not None and s.ple else []


def inputs(m, T: int, e: int, grad: bool = False) -> int:
    """The per-layer inputs [T, L, P] (module docstring); `grad`: they need one (a trained projection norm or input
    embedding), so the projection's norm keeps its input [T, L·P] and float32 rsqrt [T, L] too."""
    n = m.n_layers * m.small.ple if m.small is not None else 0
    return e * T * n + (e * T * n + 4 * T * m.n_layers) * grad


def branch_saved(m, T: int, e: int, grad: bool = False) -> int:
    """What a block's PLE branch saves (module docstring): the gate's output and the norm's input and rsqrt; `grad`:
    the per-layer inputs need one, so the product keeps gelu's output [T, P] too."""
    return e * T * (m.small.ple * (1 + grad) + m.dim) + 4 * T if m.small is not None and m.small.ple else 0


def held(m, T: int, e: int, ac: bool, grad: bool) -> int:
    """The storing layers' K/V or their gradients, twice under AC (module docstring), and with `grad` the per-layer
    inputs' gradient; 0 without either."""
    if m.small is None:
        return 0
    ple = e * T * m.n_layers * m.small.ple * grad
    each = sum(2 * e * T * k * hd for i, mode in enumerate(m.small.modes) if mode == "store"
               for _, k, hd in [m.attn_dims(i)])
    return each * (2 if ac else 1) + ple
