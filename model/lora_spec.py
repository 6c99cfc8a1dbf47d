"""What LoRA adapts: the block projections (LORA_TARGETS) and `--lora-targets` / `--lora-layers` as argparse reads
them (`lora_targets_arg`: projection names or a set name of TARGET_SETS; `lora_layers_arg`), and `lora_layers(spec)`:
the block indices a spec names (None: every block)."""

from __future__ import annotations

import argparse

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # adaptable projections
# --lora-targets' shorthands: peft's "all-linear" (every linear layer but the output head: these seven), and the
# attention's or the MLP's projections
TARGET_SETS = {"all-linear": LORA_TARGETS, "attn": LORA_TARGETS[:4], "mlp": LORA_TARGETS[4:]}


def lora_targets_arg(text: str) -> str:
    """--lora-targets: comma-separated names, a shorthand (TARGET_SETS) standing for its names where it is written,
    each name once; unknown names are kept, for the flag checks to name."""
    names = [n for part in text.split(",") for n in TARGET_SETS.get(part.strip(), (part.strip(),))]
    return ",".join(dict.fromkeys(names))


def lora_layers_arg(text: str) -> str | None:
    """--lora-layers: block indices and ranges ("20-27", "0,4,8-11"), or "all" (None): written back sorted, ranges
    joined ("8-11,4" -> "4,8-11"), so runs record one spelling."""
    if text.strip().lower() == "all":
        return None
    got = set()
    for part in (p.strip() for p in text.split(",")):
        a, sep, b = part.partition("-")
        if not (a.isdigit() and (not sep or b.isdigit())) or sep and int(b) < int(a):
            raise argparse.ArgumentTypeError(f"{part!r} is not a block index or a range A-B (A <= B): e.g. 20-27, "
                                             "or 0,4,8-11, or all")
        got.update(range(int(a), int(b or a) + 1))
    runs, out = sorted(got), []
    for i in runs:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in out)


def lora_layers(spec: str | None) -> tuple[int, ...] | None:
    """The block indices of a --lora-layers spelling (None: every block)."""
    if spec is None:
        return None
    return tuple(i for part in spec.split(",") for i in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))
