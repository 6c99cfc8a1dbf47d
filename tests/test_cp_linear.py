"""parallel/cp_linear.py: Gated DeltaNet under context parallelism equals one process on the whole sequence.

Pins (gloo, float64, tiny sizes: hidden 32, head dims 8, conv kernel 4; A_log, dt_bias, the gated norm's weight and
a tripled conv weight drawn at random as tests/test_deltanet.py does, whose module is pinned to transformers'
Qwen3_5GatedDeltaNet): on every rank, `GatedDeltaNet.forward(x_shard, core.prepare(positions_shard), core)` gathered
= the module on one process over the unpadded rows (its local core, `prepare_linear`), at 1e-10:
- outputs, the rank's own input gradient (zero on the padding `shard_sequence` adds) and every parameter's gradient
  summed over the cp ranks (each rank holds its tokens' and its head range's share);
- cp 2 Ulysses (contiguous shards), cp 2 zigzag ring (the gathered sequence permuted: `layout_index`), and on 4 ranks
  the 2×2 hybrid (pieces of zigzag chunks), with 2 key heads for 4 value heads (cp 4: each key head replicated to the
  two ranks holding its value heads) and 4 key heads for 8 (split);
- rows: a batch of 2, one packed with documents 5, 60, 3, 57 (documents crossing every layout's shard edges and the
  64-token chunk edge, one of 3 tokens, shorter than the conv kernel), one a single document; 125 tokens padded to
  128 (padding continues the last document); and a row of one document alone (meta None);
- heads the cp degree cannot split are refused before any traffic, naming the heads, the --cp and the degrees that
  work; cp 1 is model/deltanet.py's own core.

Run: .venv/bin/python -m pytest -q tests/test_cp_linear.py
"""

import pytest
import torch
import torch.distributed as dist

from model.deltanet import GatedDeltaNet, local_linear_core
from parallel.cp import gather_sequence, pad_sequence, shard_sequence
from parallel.cp_linear import ContextParallelLinear, LocalLinear, check_linear_heads, cp_linear
from parallel.mesh import ParallelDims
from tests.dist import run_ranks

D, DK, DV, K = 32, 8, 8, 4
TOL = dict(atol=1e-10, rtol=1e-9)
REAL = 125   # padded to 128 by every layout here


def module(hk, hv):
    torch.manual_seed(hk * 10 + hv)
    m = GatedDeltaNet(D, hk, hv, DK, DV, K, 1e-6).double()
    with torch.no_grad():
        m.A_log.copy_(torch.randn(hv))
        m.dt_bias.copy_(torch.randn(hv))
        m.norm.weight.copy_(1 + 0.5 * torch.randn(DV))
        m.conv1d.weight.normal_().mul_(0.3)   # default init is small: make the conv's reach across documents visible
    return m


def positions(*rows):
    """position_ids [B, S] from per-row document lengths (each starts at 0)."""
    return torch.tensor([[i for n in row for i in range(n)] for row in rows])


def check(m, core, dims, pos, label):
    group, rank = core.cp_group, dist.get_rank(core.cp_group)
    g = torch.Generator().manual_seed(pos.shape[0] * 31 + m.n_k_heads)
    x = torch.randn(*pos.shape, D, generator=g, dtype=torch.float64)
    dout = torch.randn(*pos.shape, D, generator=g, dtype=torch.float64)
    # the reference: one process, the unpadded rows, model/deltanet.py's own core
    m.zero_grad()
    xr = x.clone().requires_grad_()
    ref = m(xr, LocalLinear().prepare(pos))
    ref.backward(dout)
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    # ours: this rank's shard (padding: zeros, positions continued, no gradient into it)
    xl = shard_sequence(x, dims, rank, 0.0).requires_grad_()
    out = m(xl, core.prepare(shard_sequence(pos, dims, rank, None)), core)
    out.backward(shard_sequence(dout, dims, rank, 0.0))
    torch.testing.assert_close(gather_sequence(out, group, dims, pos.shape[1]), ref.detach(), **TOL,
                               msg=lambda s: f"{label} out: {s}")
    padded = pad_sequence(xr.grad, dims.cp_divisor, 0.0)   # the reference's input gradient, zero on the padding
    torch.testing.assert_close(xl.grad, shard_sequence(padded, dims, rank, 0.0), **TOL,
                               msg=lambda s: f"{label} rank {rank} dx: {s}")
    for n, p in m.named_parameters():
        dist.all_reduce(p.grad, group=group)
        torch.testing.assert_close(p.grad, want[n], **TOL, msg=lambda s, n=n: f"{label} d{n}: {s}")


def _ranks(rank, world, splits, heads):
    torch.set_num_threads(1)
    done = []
    for u, r in splits:
        dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=r)
        core = cp_linear(dims.build_mesh("cpu"), dims)
        assert isinstance(core, ContextParallelLinear)
        for hk, hv in heads:
            m = module(hk, hv)
            for pos, what in ((positions([5, 60, 3, 57], [REAL]), "packed + padding"), (positions([REAL]), "one doc")):
                label = f"u{u}×r{r} Hk={hk} Hv={hv} {what}"
                check(m, core, dims, pos, label)
                done.append(label)
    return done


@pytest.mark.timeout(120)
def test_two_ranks_ulysses_and_ring():
    done = run_ranks(_ranks, 2, [(2, 1), (1, 2)], [(2, 4)], timeout=100)
    assert done[0] == done[1] and len(done[0]) == 4, done


@pytest.mark.timeout(120)
def test_four_ranks_hybrid():
    done = run_ranks(_ranks, 4, [(2, 2)], [(2, 4), (4, 8)], timeout=100)
    assert all(d == done[0] for d in done) and len(done[0]) == 4, done


def test_heads_refused_before_traffic():
    fix = r"16 linear-attention key heads are not divisible by --cp 3.*Use a --cp of 1, 2, 4, 8, 16, 32\."
    with pytest.raises(ValueError, match=fix):
        check_linear_heads(16, 32, 3)
    with pytest.raises(ValueError, match=r"12 linear-attention value heads are not divisible by --cp 8"):
        check_linear_heads(4, 12, 8)
    check_linear_heads(16, 32, 32)   # cp a multiple of the key heads: each is replicated to the ranks it serves
    check_linear_heads(16, 32, 4)
    # the core refuses as well, before any collective (no process group exists here)
    core = ContextParallelLinear(ParallelDims(3, dp_shard=1, cp=3), None)
    q, v, gb = torch.zeros(1, 4, 16, DK), torch.zeros(1, 4, 32, DV), torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="key heads"):
        core(q, q, v, gb, gb, None, None)


def test_cp1_is_the_local_core():
    core = cp_linear(None, ParallelDims(1, dp_shard=1, cp=1))
    assert type(core) is LocalLinear
    m = module(2, 4)
    x, pos = torch.randn(1, 20, D, dtype=torch.float64), positions([7, 13])
    torch.testing.assert_close(m(x, core.prepare(pos), core), m(x, core.prepare(pos), local_linear_core), **TOL)
