"""Mesh validation and construction.

Pins: every impossible `dp_replicate × dp_shard × cp` or cp split is refused by `ParallelDims` with a
message that prints the degrees, the world size and the fix; `dp_shard=-1` infers; `--cp-impl auto`
picks the largest Ulysses degree the heads allow; a 4-rank gloo run builds dp_shard 2 × cp 2 and
every submesh has the expected members (cp groups are adjacent ranks, FSDP spans all four).

Run: .venv/bin/python -m pytest -q tests/test_mesh.py
"""

import pytest
import torch.distributed as dist

from parallel.mesh import ParallelDims, resolve_cp
from tests.dist import run_ranks


def test_infers_dp_shard():
    d = ParallelDims(8, dp_replicate=2, dp_shard=-1, cp=2)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.dp) == (2, 2, 2, 4)


@pytest.mark.parametrize("kw, pattern", [
    (dict(world_size=4, dp_shard=3, cp=2), r"--dp-replicate 1 × --dp-shard 3 × --cp 2 = 6 but the world size is 4"),
    (dict(world_size=6, dp_shard=-1, cp=4), r"cannot infer --dp-shard: world size 6 .* --cp 4 = 4"),
    (dict(world_size=4, dp_replicate=3, dp_shard=-1), r"world size 4 is not divisible by --dp-replicate 3"),
    (dict(world_size=4, cp=0), r"--cp must be >= 1 \(world size 4"),
    (dict(world_size=4, dp_replicate=0), r"--dp-replicate must be >= 1"),
    (dict(world_size=4, dp_shard=0), r"--dp-shard must be >= 1 or -1"),
])
def test_world_size_errors(kw, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        ParallelDims(**kw)
    assert "world size" in str(e.value)


@pytest.mark.parametrize("args, pattern", [
    ((4, "ulysses", None, 6, 2), r"6 attention heads are not divisible by the Ulysses degree 4.*--cp-impl ring"),
    # the fix lists the degrees these heads allow (3 divides 6 heads but not 2 KV heads, nor do they divide 3)
    ((3, "ulysses", None, 6, 2), r"--cp 3: the Ulysses degree 3 must divide the 2 KV heads.*a --cp of 1, 2, 6\."),
    ((4, "ulysses", None, 12, 3), r"degree 4 must divide the 3 KV heads or be a multiple.*--cp of 1, 3, 6, 12\."),
    ((4, "hybrid", None, 8, 8), r"--cp-impl hybrid needs --ulysses-degree dividing --cp 4, got None"),
    ((4, "hybrid", 3, 12, 12), r"--cp-impl hybrid needs --ulysses-degree dividing --cp 4, got 3"),
    ((4, "hybrid", 2, 6, 3), r"--ulysses-degree 2: the Ulysses degree 2 must divide the 3 KV heads.*allow: 1; or"),
    ((8, "hybrid", 8, 28, 4), r"--ulysses-degree 8: the 28 attention.*dividing --cp 8 that the heads allow: 1, 2, 4;"),
    ((2, "zigzag", None, 8, 8), r"--cp-impl must be one of"),
])
def test_cp_split_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_cp(*args)


@pytest.mark.parametrize("args, split", [
    ((4, "auto", None, 8, 2), (4, 1)),    # KV heads replicated: 4 is a multiple of 2
    ((4, "auto", None, 6, 2), (2, 2)),    # 4 does not divide 6 heads: ulysses 2 × ring 2
    ((4, "auto", None, 6, 3), (1, 4)),    # 3 KV heads: neither 2 nor 4 works -> pure ring
    ((4, "ring", None, 6, 3), (1, 4)),
    ((2, "ulysses", None, 6, 2), (2, 1)),
    ((4, "hybrid", 2, 8, 2), (2, 2)),
])
def test_cp_split(args, split):
    assert resolve_cp(*args) == split


def test_divisor():
    assert ParallelDims(4, cp=4, ulysses=4, ring=1).cp_divisor == 4
    assert ParallelDims(4, cp=4, ulysses=2, ring=2).cp_divisor == 8
    assert ParallelDims(4, cp=2, dp_shard=2, ulysses=1, ring=2).cp_divisor == 4


def _mesh_members(rank, world_size):
    dims = ParallelDims.from_args(world_size, 1, -1, 2, "auto", None, n_heads=4, n_kv_heads=2)
    m = dims.build_mesh("cpu")
    members = {k: dist.get_process_group_ranks(getattr(m, k).get_group())
               for k in ("cp", "ulysses", "ring", "dp", "dp_cp")}
    members["fsdp_shard"] = dist.get_process_group_ranks(m.fsdp.get_group("dp_shard_cp"))
    members["fsdp_replicate"] = dist.get_process_group_ranks(m.fsdp.get_group("dp_replicate"))
    members["cp_rank"] = m.cp.get_local_rank()
    members["dims"] = (dims.dp_shard, dims.cp, dims.ulysses, dims.ring)
    return members


@pytest.mark.timeout(120)
def test_mesh_2x2_membership():
    res = run_ranks(_mesh_members, 4)
    for r, m in enumerate(res):
        assert m["dims"] == (2, 2, 2, 1), f"rank {r}"
        base = r - r % 2
        assert m["cp"] == [base, base + 1], f"rank {r}: cp group"
        assert m["ulysses"] == m["cp"], f"rank {r}: ulysses group"
        assert m["ring"] == [r], f"rank {r}: ring group"
        assert m["dp"] == [r % 2, r % 2 + 2], f"rank {r}: data group"
        assert m["dp_cp"] == [0, 1, 2, 3], f"rank {r}: loss group"
        assert m["fsdp_shard"] == [0, 1, 2, 3], f"rank {r}: FSDP shard group"
        assert m["fsdp_replicate"] == [r], f"rank {r}: FSDP replicate group"
        assert m["cp_rank"] == r % 2, f"rank {r}: cp rank"
