"""model/deltanet.py's Gated DeltaNet computes what transformers' Qwen3_5GatedDeltaNet does, document by document.

Pins (CPU, float32, tiny sizes: hidden 64, 2 key heads serving 4 value heads, head dims 16, conv kernel 4; A_log,
dt_bias and the gated norm's weight drawn at random, away from transformers' init):
- transformers' state_dict loads strictly; output, input gradient (to 1e-5) and every parameter's gradient (a sum over
  all tokens: to 1e-5 of its norm; both implementations measure ~3e-6 from a float64 run) = transformers' module on one
  document of 150 tokens (3 chunks, the last partial);
- a packed row of documents 5, 70, 64, 3 (starts inside chunks, a document across two chunk edges, one of 3 tokens
  shorter than the conv kernel) = transformers' module run on each document alone, concatenated: outputs and
  gradients; batch 2 with different packings, one row ending in padding (positions continuing its last document);
- the chunked rule = transformers' per-token recurrence (torch_recurrent_gated_delta_rule) per document, strong decays
  included: outputs and gradients of q, k, v, g, beta;
- bfloat16: the output's dtype, and the casts where transformers makes them;
- the reset matters: the same packed row run as one document differs (from a document's first token on: the conv);
- the contract's head-range slicing (what a context-parallel core hands the local one) gives the whole core's heads;
- prepare_linear: None for a row of one document (padding included); branched rows refused by name.
- torch.compile keeps out of the core (torch.compiler.disable, one graph break there: dynamo's explain) though the
  disabled core is made at its first use, here while dynamo traces the forward: importing train.py, model.merge and
  the cores imports no torch._dynamo (0.9 s a process).
- the core in segments (`local_linear_core(..., segment=)`): = transformers per document with documents crossing the
  64-token segments' edges; = one pass of plain autograd, outputs and the gradients of all its inputs, bitwise for a
  row shorter than a segment, to rounding over several (documents starting at an edge and in the conv's reach before
  one); autograd keeps only its inputs and a state per segment; under parallel/ac.py's block checkpoint (plain and
  selective) = the bare module, bitwise.

Run: .venv/bin/python -m pytest -q tests/test_deltanet.py
"""

import copy
import functools

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from model.deltanet import GatedDeltaNet, causal_conv, gated_delta_rule, l2norm, local_linear_core, prepare_linear

D, HK, HV, DK, DV, K = 64, 2, 4, 16, 16, 4
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    """(transformers' module, ours with its state_dict)."""
    cfg = Qwen3_5TextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
                            linear_value_head_dim=DV, linear_conv_kernel_dim=K, num_hidden_layers=1,
                            layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    ref = hf.Qwen3_5GatedDeltaNet(cfg, 0).float()
    with torch.no_grad():
        ref.A_log.copy_(torch.randn(HV))
        ref.dt_bias.copy_(torch.randn(HV))
        ref.norm.weight.copy_(1 + 0.5 * torch.randn(DV))
        ref.conv1d.weight.mul_(3)   # default init is small: make the conv's reach across documents visible
    ours = GatedDeltaNet(D, HK, HV, DK, DV, K, 1e-6)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def positions(*rows):
    """position_ids [B, S] from per-row document lengths (a ("pad", n) entry continues the last document)."""
    out = []
    for row in rows:
        pos = []
        for n in row:
            pos += list(range(pos[-1] + 1, pos[-1] + 1 + n[1])) if isinstance(n, tuple) else list(range(n))
        out.append(pos)
    return torch.tensor(out)


def grads(module, x, fn, dout):
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    out = fn(module, x)
    (out * dout).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def check_against_reference(pair, pos, real, core=None):
    """Ours on rows with `pos` = transformers' module on each real document alone; `real` per row: document lengths
    (tokens past them are padding, left out of the loss)."""
    ref, ours = pair
    torch.manual_seed(1)
    x, dout = torch.randn(*pos.shape, D), torch.randn(*pos.shape, D)
    mask = torch.zeros(*pos.shape, 1)
    for r, lens in enumerate(real):
        mask[r, :sum(lens)] = 1
    dout = dout * mask

    def theirs(m, x):
        rows = []
        for r, lens in enumerate(real):
            docs = [m(d) for d in x[r:r + 1, :sum(lens)].split(lens, 1)]
            rows.append(torch.cat(docs + [x.new_zeros(1, pos.shape[1] - sum(lens), D)], 1))
        return torch.cat(rows)

    meta = prepare_linear(pos)
    o1, gx1, gp1 = grads(ours, x, lambda m, x: m(x, meta, core), dout)
    o2, gx2, gp2 = grads(ref, x, theirs, dout)
    torch.testing.assert_close(o1 * mask, o2, **TOL, msg="outputs")
    torch.testing.assert_close(gx1, gx2, **TOL, msg="input gradient")
    assert gp1.keys() == gp2.keys()
    for n in gp1:   # a sum over every token: float32 round-off grows with it, so measured against the whole tensor
        assert rel(gp1[n], gp2[n]) < 1e-5, f"gradient of {n}: relative error {rel(gp1[n], gp2[n]):.2e}"
    return o1


def test_one_document_matches_transformers(pair):
    check_against_reference(pair, positions([150]), [[150]])


def test_packed_row_matches_transformers_per_document(pair):
    check_against_reference(pair, positions([5, 70, 64, 3]), [[5, 70, 64, 3]])


def test_batch_of_packings_and_padding_matches_transformers(pair):
    check_against_reference(pair, positions([5, 70, 64, 3], [100, 30, ("pad", 12)]), [[5, 70, 64, 3], [100, 30]])
    check_against_reference(pair, positions([90, ("pad", 40)]), [[90]])   # one document + padding: meta None


def test_segments_match_transformers_per_document(pair):
    """The core in segments of one chunk (64 tokens): documents crossing segment edges, one row padded."""
    check_against_reference(pair, positions([5, 70, 64, 3], [100, 30, ("pad", 12)]), [[5, 70, 64, 3], [100, 30]],
                            functools.partial(local_linear_core, segment=1))


def one_pass(q, k, v, g, beta, conv_w, meta):
    """The core as one pass of plain autograd (no segments): conv, l2 norm, the rule on the whole rows."""
    B, S, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    x = causal_conv(torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1),
                    torch.cat([c.flatten(0, 1) for c in conv_w]), meta)
    q, k, v = (t.unflatten(-1, (-1, d)) for t, d in zip(x.split([Hk * dk, Hk * dk, Hv * dv], -1), (dk, dk, dv)))
    q, k = (t.repeat_interleave(Hv // Hk, 2) for t in (q, k))
    f = torch.promote_types(q.dtype, torch.float32)
    return gated_delta_rule(l2norm(q.to(f)) * dk ** -0.5, l2norm(k.to(f)), v, g, beta, meta).to(v.dtype)


def core_inputs(pos, dtype, seed=6):
    torch.manual_seed(seed)
    B, S = pos.shape
    ins = [torch.randn(B, S, HK, DK), torch.randn(B, S, HK, DK), torch.randn(B, S, HV, DV), -2 * torch.rand(B, S, HV),
           torch.rand(B, S, HV), torch.randn(HK, DK, K), torch.randn(HK, DK, K), torch.randn(HV, DV, K)]
    ins = [t.to(torch.promote_types(dtype, torch.float32)) if i == 3 else t.to(dtype) for i, t in enumerate(ins)]
    return [t.requires_grad_() for t in ins], torch.randn(B, S, HV, DV, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_segments_equal_one_pass(dtype):
    """Segmented core = one pass of plain autograd: outputs (with and without grad) and the gradients of q, k, v, g,
    beta and the conv weights. A row shorter than a segment: the same ops on the same shapes, bitwise. Several segments
    (1 and 2 chunks; documents crossing their edges, starting at one, 2 tokens before one (in the conv's reach), one of
    a token; rows ending mid-chunk): torch's CPU kernels round differently on
    other shapes (the first segment's own output already differs in float32's last bits), so within rounding (1e-12 in
    float64)."""
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else TOL
    for pos, segment, exact in ((positions([60, 40]), 2, True), (positions([300]), 1, False),
                                (positions([30, 100, 70, 3, 97], [62, 66, 1, 171]), 1, False),
                                (positions([30, 100, 70, 3, 97], [64, 128, 1, 107]), 2, False)):
        ins, dout = core_inputs(pos, dtype)
        meta = prepare_linear(pos)
        got = []
        for fn in (one_pass, functools.partial(local_linear_core, segment=segment)):
            out = fn(*ins[:5], tuple(ins[5:]), meta)
            with torch.no_grad():
                no_grad = fn(*ins[:5], tuple(ins[5:]), meta)
            got.append((out, no_grad, *torch.autograd.grad(out, ins, dout)))
        label = f"{pos.shape[1]} tokens in segments of {segment} chunks"
        for name, a, b in zip("out out_no_grad q k v g beta w_q w_k w_v".split(), got[1], got[0]):
            if exact:
                assert torch.equal(a, b), f"{name}, {label}: not bitwise equal"
            else:
                torch.testing.assert_close(a, b, **tol, msg=f"{name}, {label}")


def test_segmented_core_keeps_its_inputs_and_one_state_a_segment():
    """What autograd keeps of the core: its inputs, the concatenated conv weight and one float32 state [B, Hv, dk, dv]
    per segment after the first; not the rule's float32 blocks, the conv's output or the l2 norm's copies."""
    from tests.helpers import saved_bytes

    pos = positions([30, 100, 70, 3, 97], [300])
    ins, _ = core_inputs(pos, torch.bfloat16)
    _, got = saved_bytes(lambda: local_linear_core(*ins[:5], tuple(ins[5:]), prepare_linear(pos), segment=1))
    B, S = pos.shape
    want = sum(t.numel() * t.element_size() for t in ins) + 4 * B * HV * DK * DV * (-(-S // 64) - 1)
    assert got == want, (got, want)


@pytest.mark.parametrize("contexts", ["_contexts", "_keep_attn_contexts"])
def test_segments_nest_in_block_checkpoints(pair, contexts):
    """The module under parallel/ac.py's block checkpoint (plain, and selective with --ac-keep-attn's policy): the
    segments' recompute inside the block's recompute gives the outputs and gradients of the module run bare."""
    from torch.utils.checkpoint import checkpoint

    from parallel import ac

    _, ours = pair
    torch.manual_seed(7)
    pos = positions([5, 70, 64, 3], [142])
    x, dout = torch.randn(*pos.shape, D), torch.randn(*pos.shape, D)
    meta, core = prepare_linear(pos), functools.partial(local_linear_core, segment=1)
    bare = grads(ours, x, lambda m, x: m(x, meta, core), dout)
    nested = grads(ours, x, lambda m, x: checkpoint(m, x, meta, core, use_reentrant=False,
                                                    context_fn=getattr(ac, contexts)), dout)
    torch.testing.assert_close(nested[:2], bare[:2], rtol=0, atol=0)
    torch.testing.assert_close(nested[2], bare[2], rtol=0, atol=0)


def test_bfloat16_casts_as_transformers(pair):
    """In bfloat16 the output is bfloat16 and rounds where transformers' does (the rule in float32 inside)."""
    ref, ours = (m.to(torch.bfloat16) for m in copy.deepcopy(pair))
    torch.manual_seed(5)
    x = torch.randn(1, 142, D, dtype=torch.bfloat16)
    out = ours(x, prepare_linear(positions([5, 70, 64, 3])))
    assert out.dtype == torch.bfloat16
    expect = torch.cat([ref(d) for d in x.split([5, 70, 64, 3], 1)], 1)
    assert rel(out.float(), expect.float()) < 1e-2


def test_reset_matters(pair):
    """The packed row run as ONE document differs: the state (later tokens) and the conv (a document's first token,
    where the state is fresh either way only if the conv is masked too)."""
    _, ours = pair
    torch.manual_seed(2)
    x = torch.randn(1, 142, D)
    packed = ours(x, prepare_linear(positions([5, 70, 64, 3])))
    whole = ours(x, None)
    torch.testing.assert_close(packed[:, :5], whole[:, :5], **TOL)   # the first document is the same either way
    for start in (5, 75, 139):
        assert (packed[0, start] - whole[0, start]).abs().max() > 1e-3, f"conv leaked into the document at {start}"
    assert (packed[0, 100:139] - whole[0, 100:139]).abs().max() > 1e-3, "state leaked"


def test_rule_matches_transformers_recurrence():
    torch.manual_seed(3)
    lens, H = [40, 1, 100, 23], 3
    S = sum(lens)
    q, k = torch.randn(1, S, H, DK), torch.randn(1, S, H, DK)
    v, beta = torch.randn(1, S, H, DV), torch.rand(1, S, H)
    g = -torch.rand(1, S, H) * torch.tensor([0.1, 2.0, 12.0])   # mild to strong decays (12: e^-12 a step)
    ins = [t.requires_grad_(True) for t in (q, k, v, g, beta)]
    dout = torch.randn(1, S, H, DV)

    def ours(q, k, v, g, beta):
        return gated_delta_rule(l2norm(q) * DK ** -0.5, l2norm(k), v, g, beta, prepare_linear(positions(lens)))

    def theirs(q, k, v, g, beta):
        parts = zip(*(t.split(lens, 1) for t in (q, k, v, g, beta)))
        return torch.cat([hf.torch_recurrent_gated_delta_rule(*p, use_qk_l2norm_in_kernel=True)[0] for p in parts], 1)

    outs = []
    for fn in (ours, theirs):
        out = fn(*ins)
        gr = torch.autograd.grad((out * dout).sum(), ins)
        outs.append((out, gr))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL, msg="outputs")
    for name, a, b in zip("q k v g beta".split(), outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, **TOL, msg=f"gradient of {name}")


def test_head_ranges_as_the_contract_slices_them(pair):
    """Two 'ranks' of 2 value heads each (key head j // 2): their outputs concatenated = the whole core's."""
    _, ours = pair
    torch.manual_seed(4)
    B, S = 2, 80
    q, k, v = torch.randn(B, S, HK, DK), torch.randn(B, S, HK, DK), torch.randn(B, S, HV, DV)
    g, beta = -torch.rand(B, S, HV), torch.rand(B, S, HV)
    w = ours.conv1d.weight[:, 0].detach().split([HK * DK, HK * DK, HV * DV])
    conv_w = (w[0].view(HK, DK, K), w[1].view(HK, DK, K), w[2].view(HV, DV, K))
    meta = prepare_linear(positions([30, 50], [7, 73]))
    whole = local_linear_core(q, k, v, g, beta, conv_w, meta)
    r = HV // HK
    parts = [local_linear_core(q[:, :, a // r:b // r], k[:, :, a // r:b // r], v[:, :, a:b], g[..., a:b],
                               beta[..., a:b], (conv_w[0][a // r:b // r], conv_w[1][a // r:b // r], conv_w[2][a:b]),
                               meta) for a, b in ((0, 2), (2, 4))]
    torch.testing.assert_close(torch.cat(parts, 2), whole, **TOL)


def test_prepare_linear():
    assert prepare_linear(positions([50])) is None
    assert prepare_linear(positions([30, ("pad", 10)], [40])) is None
    meta = prepare_linear(positions([3, 4], [7]))
    assert meta.most == 2 and meta.seg.tolist() == [[1] * 3 + [2] * 4, [1] * 7]
    with pytest.raises(ValueError, match="dpo-share-prompt"):   # a branch: a document at position 2 after one of 5
        prepare_linear(torch.tensor([[0, 1, 2, 3, 4, 2, 3]]))


def test_a_whole_number_of_chunks_saves_no_copies():
    """At S a multiple of the chunk, F.pad is a strided view: the rule's padded q, k, v are made contiguous, or the
    matmuls copy q, kᵀ (twice) and k·beta and autograd keeps the copies (4 [S, Hv, dk] float32 tensors more than at
    S - 1). One token more costs no more than the average token."""
    from tests.helpers import saved_bytes

    torch.manual_seed(0)
    m = GatedDeltaNet(D, HK, HV, DK, DV, K, 1e-6).requires_grad_(False)
    x = torch.randn(1, 128, D, requires_grad=True)
    saved = {s: saved_bytes(lambda s=s: m(x[:, :s], None), [*m.parameters(), x])[1] for s in (127, 128)}
    assert saved[128] < saved[127] * 128 / 127, saved


_COMPILE_PROBE = """
import pickle, sys, torch
import model.merge, train
from model.linear_layers import LocalLinear
from parallel.cp_linear import ContextParallelLinear
print('dynamo at import:', 'torch._dynamo' in sys.modules)
import torch._dynamo
from model import deltanet, deltanet_core
torch.manual_seed(0)
m = deltanet.GatedDeltaNet(16, 2, 4, 8, 8, 4, 1e-6)
x = torch.randn(2, 12, 16)
meta = deltanet.prepare_linear(torch.cat([torch.arange(7), torch.arange(5)]).expand(2, 12))
f = lambda x, core: m(x, meta, core)
for core in (LocalLinear(), None):   # the model's default core (looked up first while traced); the module's default
    torch._dynamo.reset()
    ex = torch._dynamo.explain(f)(x, core)
    print('breaks:', ex.graph_break_count, '|'.join(str(r.reason).splitlines()[0] for r in ex.break_reasons))
    print('compiled = eager:', torch.equal(torch.compile(f, backend='eager')(x, core), f(x, core)))
fn = deltanet.local_linear_core
print('one core:', fn is deltanet_core.local_linear_core and pickle.loads(pickle.dumps(fn)) is fn)
"""


def test_the_core_is_kept_out_of_compile_and_dynamo_out_of_import():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "dynamo at import: False", lines
    for i in (1, 3):
        assert lines[i].startswith("breaks: 1 ") and "torch.compiler.disable()" in lines[i], lines   # the core only
        assert lines[i + 1] == "compiled = eager: True", lines
    assert lines[5] == "one core: True", lines
