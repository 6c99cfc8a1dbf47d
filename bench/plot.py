"""Draw the loss curve of a run from its metrics.jsonl as a PNG (`make plot RUN=runs/demo`); with --eval-positions'
buckets, their eval token accuracy in a second panel.

Usage: python bench/plot.py runs/demo/metrics.jsonl runs/demo/loss.png
"""

import json
import os
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
    ev = [r for r in rows if "eval_loss" in r]
    start = lambda k: int(k.split("@")[1].split("-")[0].rstrip("+"))   # noqa: E731 (--eval-positions' buckets)
    acc = sorted({k for r in ev for k in r if k.startswith("eval_token_acc@")}, key=start)
    # (--eval-positions: each bucket's token accuracy in a panel of its own, a share on a 0-1 axis, not the loss's)
    fig, axes = plt.subplots(1, 1 + bool(acc), figsize=(11 if acc else 6, 3.5), dpi=120, squeeze=False, sharex=True)
    ax, color = axes[0][0], {}
    conf = os.path.join(os.path.dirname(src), "config.json")   # (--sft-loss dft: the steps' loss is DFT's, eval's not)
    dft = os.path.exists(conf) and json.load(open(conf)).get("sft_loss") == "dft"
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss (DFT)" if dft else "train loss",
            lw=1.5)
    if ev:
        color["eval"] = ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")[0]
    for key in sorted({k for r in ev for k in r if k.startswith("eval_loss/")}):   # each eval file's, of several
        at = [r for r in ev if key in r]
        ax.plot([r["step"] for r in at], [r[key] for r in at], ".--", lw=1, label=key.replace("eval_loss/", "eval: "))
    for key in sorted({k for r in ev for k in r if k.startswith("eval_loss@")}, key=start):
        at = [r for r in ev if key in r]
        color[key.split("@")[1]] = ax.plot([r["step"] for r in at], [r[key] for r in at], ".:", lw=1,
                                           label=key.replace("eval_loss@", "eval, positions "))[0]
    ax.set_xlabel("optimizer step")
    dpo = "reward_acc" in rows[0]   # (--objective dpo's metrics)
    ax.set_ylabel("preference loss (mean over pairs)" if dpo else "loss (mean over target tokens)")
    if acc:   # (each line in the colour of its loss line: the same targets; a bucket's loss line is drawn with it)
        bx, at = axes[0][1], [r for r in ev if "eval_token_acc" in r]
        bx.plot([r["step"] for r in at], [r["eval_token_acc"] for r in at], "o-", color=color["eval"].get_color(),
                label="eval token accuracy")
        for key in acc:
            at = [r for r in ev if key in r]
            bx.plot([r["step"] for r in at], [r[key] for r in at], ".:", lw=1,
                    color=color[key.split("@")[1]].get_color(), label=key.replace("eval_token_acc@", "positions "))
        bx.set(xlabel="optimizer step", ylabel="token accuracy (argmax = target)", ylim=(0, 1))
    for a in axes[0]:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(dst)
    print(f"wrote {dst} ({len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
