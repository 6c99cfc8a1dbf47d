"""CUDA-only check of Gemma 4 E2B / E4B's per-layer table in host memory (parallel/host_table.py), never run on a GPU
before this file was written (2026-12-07, a session without one): on CPU tests/test_gemma4_small.py pins the same
path (the copy a no-op there); here the rows really cross to the GPU from a pinned buffer, without blocking.
- tests/test_gemma4_small.py's tiny E2B in bf16 on the GPU, the table in host memory = on the GPU (--ple-on-device):
  logits, loss and every LoRA gradient bit for bit; the table's weight in host memory, its rows buffer pinned; the
  GPU memory the build holds is the --ple-on-device build's less the table's bytes, exactly (the memory plan's change,
  parallel/plan_small.py, measured).
- E4B's table (262,144 × 42·256 bf16, 5.6 GB of host memory and as much GPU memory for the comparison), 32,768 tokens:
  the host table's forward = the GPU lookup, and the time of each printed (random ids; ids over 8k distinct tokens),
  with the GPU synchronized around each call: what a micro-batch pays. No timing is asserted.

Run: make test-gpu   (or python3 -m pytest -q -s tests/gpu/test_gpu_host_table.py)
"""

import gc
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: these tests need a GPU", allow_module_level=True)

import transformers as T  # noqa: E402

from parallel.host_table import HostEmbedding  # noqa: E402
from tests.test_gemma4 import ALL  # noqa: E402
from tests.test_gemma4_layouts import _batch, _grads  # noqa: E402
from tests.test_gemma4_small import SMALL, _perturb_small  # noqa: E402

DEV = torch.device("cuda")


def _build(path, on_device: bool):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    return build_nonzero_b(BuildOptions(path, quant="none", dtype=torch.bfloat16, lora_r=4, lora_alpha=8, seed=3,
                                        lora_targets=ALL, ple_on_device=on_device), device=DEV)[0]


def test_host_table_on_cuda_equals_the_gpu_table_and_leaves_its_memory(tmp_path):
    torch.manual_seed(0)
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**SMALL, attention_k_eq_v=True)).float()
    _perturb_small(hf)
    hf.save_pretrained(tmp_path)
    _build(str(tmp_path), True)   # (whatever a first build allocates once, before the measured ones; then freed)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    host = _build(str(tmp_path), False)
    held = torch.cuda.memory_allocated() - base
    dev = _build(str(tmp_path), True)
    held_dev = torch.cuda.memory_allocated() - base - held
    table = host.model.embed_tokens_per_layer
    size = table.weight.numel() * table.weight.element_size()
    assert type(table) is HostEmbedding and table.weight.device.type == "cpu"
    assert held_dev - held == size, (held_dev, held, size)
    ids, labels, pos = (x.to(DEV) for x in _batch())
    out = []
    for m in (host, dev):
        with torch.no_grad():
            y = m(ids, position_ids=pos)
        s, n = m(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        out.append((y, s.detach(), _grads(m)))
    torch.cuda.synchronize()
    assert table.rows.is_pinned() and table.rows.dtype == torch.bfloat16, "the rows buffer: pinned, compute dtype"
    (y, s, g), (y_dev, s_dev, g_dev) = out
    assert torch.equal(y, y_dev) and torch.equal(s, s_dev), "logits, loss"
    assert g.keys() == g_dev.keys() and all(torch.equal(g[k], g_dev[k]) for k in g), "LoRA grads"


def test_e4b_table_gather_time():
    V, W, S = 262144, 42 * 256, 32768
    host = HostEmbedding(V, W, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        host.weight.normal_()
    dev = host.weight.to(DEV)
    g = torch.Generator().manual_seed(0)
    distinct = torch.randint(0, V, (8192,), generator=g)
    for label, ids in (("random ids", torch.randint(0, V, (1, S), generator=g)),
                       ("ids over 8k distinct tokens", distinct[torch.randint(0, 8192, (1, S), generator=g)])):
        ids = ids.to(DEV)
        times = {}
        for name, f in (("host table", lambda x=ids: host(x)), ("GPU table", lambda x=ids: dev[x])):
            f()
            ts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                y = f()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            times[name] = (sorted(ts)[2] * 1e3, y)
        assert torch.equal(times["host table"][1], times["GPU table"][1]), label
        print(f"\n{label}: {S} tokens, {torch.unique(ids).numel()} distinct: host table "
              f"{times['host table'][0]:.1f} ms, GPU table {times['GPU table'][0]:.1f} ms (medians of 5, "
              f"{torch.get_num_threads()} CPU threads)")
