"""Worker for tests/gpu/test_multi_gpu.py (run under torchrun, one GPU per rank, NCCL).

Every rank builds the same bf16 q/k/v (1 × 1024·world tokens, 8 query / 2 KV heads, head_dim 128) and
differentiates single-GPU SDPA (`F.scaled_dot_product_attention`, causal, enable_gqa) on the whole
sequence; then, for Ulysses (all-to-all), ring (batched P2P, zigzag) and, with 4+ even ranks, the
hybrid, it shards the sequence, runs `parallel.cp.cp_attention` forward + backward and compares its
output and q/k/v gradients with this rank's shard of the reference. Labelled mismatches are printed;
the exit code is the number of failing checks summed over the ranks (0: all passed).

Run: torchrun --standalone --nproc_per_node 2 tests/gpu/multi_gpu_cp.py
(without CUDA it runs on CPU with gloo at a small size, so the script itself can be tried anywhere)
"""

import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parallel import kernel_choice  # noqa: E402
from parallel.cp import cp_attention, shard_sequence  # noqa: E402
from parallel.mesh import ParallelDims  # noqa: E402


def main():
    local, cuda = int(os.environ["LOCAL_RANK"]), torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    b, s, h, hkv, d = (1, 1024 * world, 8, 2, 128) if cuda else (1, 32 * world, 8, 2, 64)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(b, s, h, d, generator=g, device=dev, dtype=torch.bfloat16)
    t = lambda x: x.transpose(1, 2)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = t(F.scaled_dot_product_attention(t(qr), t(kr), t(vr), is_causal=True, enable_gqa=True))
    ref.backward(dout)
    impls = [("ulysses", world, 1), ("ring", 1, world)]
    if world >= 4 and world % 2 == 0:
        impls.append(("hybrid", 2, world // 2))
    failures = []
    for name, u, r in impls:
        dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=r)
        attn = cp_attention(dims.build_mesh(dev.type), dims)
        shard = lambda x, pad=0.0, dims=dims: shard_sequence(x, dims, rank, pad)
        ql, kl, vl = (shard(x).detach().requires_grad_() for x in (q, k, v))
        pos = shard(torch.arange(s, device=dev).expand(b, s), None)
        out = attn(ql, kl, vl, attn.prepare(pos), d ** -0.5)
        out.backward(shard(dout))
        checks = [("out", out, shard(ref.detach()), 2e-2), ("dq", ql.grad, shard(qr.grad), 5e-2),
                  ("dk", kl.grad, shard(kr.grad), 5e-2), ("dv", vl.grad, shard(vr.grad), 5e-2)]
        for what, got, want, tol in checks:
            try:
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            except AssertionError as e:
                failures.append(f"rank {rank} {name} (ulysses {u} x ring {r}) {what}: {e}")
        print(f"rank {rank} {name}: checked out, dq, dk, dv (kernel {kernel_choice.pick_backend(ql)})", flush=True)
    for f in failures:
        print("FAIL", f, flush=True)
    n = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(n)
    dist.destroy_process_group()
    sys.exit(min(int(n.item()), 100))


if __name__ == "__main__":
    main()
