"""Chunked linear cross-entropy vs full logits + F.cross_entropy: extra peak memory and time.

Each (path, weight) case runs forward+backward in its own subprocess, so every peak-RSS reading
(ru_maxrss, a process-lifetime maximum) belongs to one path only. Baseline = RSS after the inputs are
created in place (randn writes every page, no transient copy) and a small warm-up call; extra peak =
ru_maxrss after the timed run minus that baseline. Shapes: N=4096 tokens, D=896, V=151,936
(Qwen2.5-0.5B head), float32, a quarter of the labels ignored, 2 threads. The naive and chunked
processes alternate `--reps` times and the fastest run of each is kept. The speed goal is judged on
process CPU time (user+sys): on a shared machine wall time mostly measures other people's load, while
CPU time counts the work done (wall time is printed next to it). A last row runs a custom `loss_fn`
(label smoothing 0.1) through the chunks against the same loss_fn on full logits, frozen weight.

Run: .venv/bin/python bench/loss.py [--reps 2]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import psutil
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss import IGNORE_INDEX, auto_chunk_size, chunked_cross_entropy  # noqa: E402

N, D, V = 4096, 896, 151_936
LONG_N = 32_768
GB = 1e9


def naive(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked(hidden, weight, labels):
    return chunked_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX)[0]


def smoothing(logits, labels):   # a custom loss_fn: label smoothing 0.1, summed over target rows
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=0.1)


def naive_ls(hidden, weight, labels):
    return smoothing(F.linear(hidden, weight).float(), labels)


def chunked_ls(hidden, weight, labels):
    return chunked_cross_entropy(hidden, weight, labels, loss_fn=smoothing)[0]


PATHS = {"naive": naive, "chunked": chunked, "naive_ls": naive_ls, "chunked_ls": chunked_ls}


def worker(path, trainable):
    torch.set_num_threads(2)
    fn = PATHS[path]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g).mul_(0.02).requires_grad_(trainable)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.25] = IGNORE_INDEX

    def step(n):
        h = hidden[:n].detach().requires_grad_()
        weight.grad = None
        fn(h, weight, labels[:n]).backward()
        return h.grad

    step(64)  # warm up thread pools and kernels before the baseline; its peak is far below the real one
    weight.grad = None
    base_rss = psutil.Process().memory_info().rss
    base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    cpu0, t0 = time.process_time(), time.perf_counter()
    step(N)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra": peak - base_rss, "pre_peak": base_max - base_rss, "time": wall, "cpu": cpu}))


def run_case(path, trainable):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path] + (["--trainable"] if trainable else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    name = "trainable" if trainable else "frozen"
    print(f"  {path:8s} {name:9s} extra peak {res['extra'] / GB:6.3f} GB   wall {res['time']:6.1f} s   "
          f"cpu {res['cpu']:6.1f} s   (high-water above baseline before the run: {res['pre_peak'] / 1e6:.0f} MB)",
          flush=True)
    return res


def best(runs):
    # Memory is deterministic (take the worst); time only gets worse with outside load (take the best).
    return {"extra": max(r["extra"] for r in runs), "time": min(r["time"] for r in runs),
            "cpu": min(r["cpu"] for r in runs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=list(PATHS), help="internal: run one case and print JSON")
    ap.add_argument("--trainable", action="store_true", help="internal: lm_head weight requires grad")
    ap.add_argument("--reps", type=int, default=2, help="alternating runs per path and weight (best time kept)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.trainable)

    chunk = auto_chunk_size(N, V)
    print(f"N={N} D={D} V={V} float32, 25% ignored, chunk={chunk} tokens "
          f"({chunk * V * 4 / 1e6:.0f} MB logits block), torch {torch.__version__}, 2 threads")
    rows, goals = [], {False: 0.08, True: 0.15}
    logits_bytes = N * V * 4
    for trainable in (False, True):
        runs = {"naive": [], "chunked": []}
        for _ in range(args.reps):
            for path in runs:
                runs[path].append(run_case(path, trainable))
        nv, ch = best(runs["naive"]), best(runs["chunked"])
        mem, tim = ch["extra"] / nv["extra"], ch["cpu"] / nv["cpu"]
        ok = mem <= goals[trainable] and tim <= 1.0
        rows.append((trainable, nv, ch, mem, tim, ok, nv["extra"] / logits_bytes))

    # a custom loss_fn (label smoothing) through the same chunks vs the same loss_fn on full logits,
    # frozen weight (issue 12 goal: extra memory <= 0.25x, cpu time <= 1.5x)
    runs = {"naive_ls": [], "chunked_ls": []}
    for _ in range(args.reps):
        for path in runs:
            runs[path].append(run_case(path, False))
    nls, cls = best(runs["naive_ls"]), best(runs["chunked_ls"])
    ls_row = (cls["extra"] / nls["extra"], cls["cpu"] / nls["cpu"], nls, cls)

    # 32k projection: naive extra scales with the logits (measured multiple of one logits tensor);
    # chunked keeps one logits block plus grad_hidden [N, D] (plus, if trainable, a [V, D] float32 grad).
    long_logits = LONG_N * V * 4
    long_chunk = auto_chunk_size(LONG_N, V) * V * 4 + LONG_N * D * 4
    print("\n| lm_head weight | naive extra peak | chunked extra peak | memory ratio | naive cpu (wall) | "
          "chunked cpu (wall) | cpu-time ratio (wall) | goal met |")
    print("|---|---|---|---|---|---|---|---|")
    for trainable, nv, ch, mem, tim, ok, _ in rows:
        goal = f"mem <= {goals[trainable]}, cpu <= 1"
        print(f"| {'trainable' if trainable else 'frozen (LoRA)'} | {nv['extra'] / GB:.2f} GB | "
              f"{ch['extra'] / GB:.3f} GB | {mem:.3f} | {nv['cpu']:.0f} s ({nv['time']:.0f} s) | "
              f"{ch['cpu']:.0f} s ({ch['time']:.0f} s) | {tim:.2f} ({ch['time'] / nv['time']:.2f}) | "
              f"{'yes' if ok else 'NO'} ({goal}) |")
    mem, tim, nls, cls = ls_row
    print(f"| frozen, loss_fn = label smoothing | {nls['extra'] / GB:.2f} GB | {cls['extra'] / GB:.3f} GB | "
          f"{mem:.3f} | {nls['cpu']:.0f} s ({nls['time']:.0f} s) | {cls['cpu']:.0f} s ({cls['time']:.0f} s) | "
          f"{tim:.2f} ({cls['time'] / nls['time']:.2f}) | {'yes' if mem <= 0.25 and tim <= 1.5 else 'NO'} "
          f"(mem <= 0.25, cpu <= 1.5) |")
    mult = rows[0][6]
    print(f"\nProjection at {LONG_N:,} tokens (V={V:,}, D={D}, float32): the naive logits tensor alone is "
          f"{long_logits / GB:.1f} GB and the naive frozen-weight peak was {mult:.1f}x that at N={N} "
          f"(~{mult * long_logits / GB:.0f} GB); the chunked transient is one logits block + grad_hidden = "
          f"{long_chunk / GB:.2f} GB, independent of N apart from grad_hidden "
          f"(+{V * D * 4 / GB:.2f} GB float32 grad when the weight is trainable).")


if __name__ == "__main__":
    main()
