"""The host-resident per-layer table's gather (parallel/host_table.py) at Gemma 4 E4B's sizes: V' 262,144 rows of
L·P = 42·256 bf16 (5.6 GB), 32,768 tokens, one thread (torchrun's default per rank). Prints the forward's host gather
of the distinct tokens' rows into a reused buffer (what a CUDA run's cached pinned block gets) for random ids and for
ids over 8k distinct tokens, and the whole forward on CPU (fresh buffers, the expansion on the host too) beside the
plain lookup's (nn.Embedding, what --ple-on-device runs).

Run: .venv/bin/python bench/host_table.py   (needs ~7 GB of free memory)
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.host_table import HostEmbedding  # noqa: E402


def median_ms(f, n=7) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def main():
    torch.set_num_threads(1)
    V, W, T = 262144, 42 * 256, 32768
    table = HostEmbedding(V, W, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        table.weight.zero_()   # (every page touched once: the run's table is loaded)
    g = torch.Generator().manual_seed(0)
    distinct = torch.randint(0, V, (8192,), generator=g)
    for label, ids in (("random ids", torch.randint(0, V, (1, T), generator=g)),
                       ("ids over 8k distinct tokens", distinct[torch.randint(0, 8192, (1, T), generator=g)])):
        uniq = torch.unique(ids)
        buf = torch.empty(uniq.numel(), W, dtype=torch.bfloat16).zero_()
        gather = median_ms(lambda u=uniq, b=buf: torch.index_select(table.weight, 0, u, out=b))
        whole = median_ms(lambda x=ids: table(x))
        plain = median_ms(lambda x=ids: torch.nn.functional.embedding(x, table.weight))
        print(f"{label}: {T} tokens, {uniq.numel()} distinct, {buf.nbytes / 1e6:.0f} MB: the host gather into a reused "
              f"buffer {gather:.0f} ms; the whole forward on CPU {whole:.0f} ms, the plain lookup's (--ple-on-device "
              f"on CPU) {plain:.0f} ms (medians of 7)")


if __name__ == "__main__":
    main()
