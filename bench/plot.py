"""Draw the loss curve of a run from its metrics.jsonl as a PNG (`make plot RUN=runs/demo`).

Usage: python bench/plot.py runs/demo/metrics.jsonl runs/demo/loss.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")   # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    try:
        rows = [json.loads(line) for line in open(src) if line.strip()]
    except FileNotFoundError:
        sys.exit(f"{src!r} does not exist: run training first (make demo) or pass RUN=<out dir>")
    if not rows:
        sys.exit(f"{src!r} has no steps yet")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", lw=1.5)
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    for key in sorted({k for r in ev for k in r if k.startswith("eval_loss/")}):   # each eval file's, of several
        at = [r for r in ev if key in r]
        ax.plot([r["step"] for r in at], [r[key] for r in at], ".--", lw=1, label=key.replace("eval_loss/", "eval: "))
    start = lambda k: int(k.split("@")[1].split("-")[0].rstrip("+"))   # noqa: E731 (--eval-positions' buckets)
    for key in sorted({k for r in ev for k in r if k.startswith("eval_loss@")}, key=start):
        at = [r for r in ev if key in r]
        ax.plot([r["step"] for r in at], [r[key] for r in at], ":", lw=1,
                label=key.replace("eval_loss@", "eval, positions "))
    ax.set_xlabel("optimizer step")
    dpo = "reward_acc" in rows[0]   # (--objective dpo's metrics)
    ax.set_ylabel("preference loss (mean over pairs)" if dpo else "loss (mean over target tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst)
    print(f"wrote {dst} ({len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
