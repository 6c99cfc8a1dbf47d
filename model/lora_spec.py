"""What LoRA adapts: the block projections (LORA_TARGETS) and `--lora-targets` / `--lora-layers` as argparse reads
them (`lora_targets_arg`: projection names or a set name of TARGET_SETS; `lora_layers_arg`), `run_targets`: the
targets a model runs (the default: the model's own, `NotGiven`), and `lora_layers(spec)`: the block indices a spec
names (None: every block)."""

from __future__ import annotations

import argparse

from model.expert_lora import EXPERTS
from model.moe import expert_targets

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # adaptable projections
# Qwen3.5's Gated DeltaNet layers' (linear_attn, model/deltanet.py): in_proj_qkv (q, k, v), in_proj_z (the output
# gate), in_proj_b (beta: how much each token writes), in_proj_a (the decay's input), out_proj
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Phi-3's fused Linears (model/phi3.py) and the projections each holds the rows of
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ADAPTABLE = LORA_TARGETS + LINEAR_TARGETS + tuple(FUSED)
# + EXPERTS ("experts"): the routed experts (Qwen3-MoE, Qwen3.5-MoE, GLM-4.5, GPT-OSS), as peft's target_parameters
# there (model/expert_lora.py); named only, never in a default or a shorthand (peft's all-linear on such a model: MLP
# names)
NAMED = ADAPTABLE + (EXPERTS,)
# --lora-targets' default: the seven and, on a model with linear layers, their token mixer's big projections (q/k/v,
# the gate, the output: what the attention's four are to a full layer); in_proj_b / in_proj_a (a few outputs per head,
# scalars per token) only when named or with all-linear. `model_targets` drops the linear names on other models, so
# their runs adapt, record and export the seven as before.
DEFAULT_TARGETS = LORA_TARGETS + ("in_proj_qkv", "in_proj_z", "out_proj")
# --lora-targets' shorthands: peft's "all-linear" (every linear layer of the language model but the output head: the
# seven, and the linear layers' five), and the token mixers' (attention and linear_attn's default three) or the MLP's
# (Phi-3's fused names are not in them: `fused_targets` maps their parts, named here, to them on Phi-3, and refuses
# them on every other model)
TARGET_SETS = {"all-linear": LORA_TARGETS + LINEAR_TARGETS, "attn": LORA_TARGETS[:4] + DEFAULT_TARGETS[7:],
               "mlp": LORA_TARGETS[4:]}


def sublayer(name: str) -> str:
    """The module of a block that holds projection `name`: mlp, self_attn or linear_attn."""
    return "mlp" if name in (*LORA_TARGETS[4:], "gate_up_proj", EXPERTS) else "self_attn" if name in (
        *LORA_TARGETS[:4], "qkv_proj") else "linear_attn"


def fused_targets(targets, margs) -> tuple[str, ...]:
    """`targets` on a model with fused projections (Phi-3: `margs.fused`): each fused Linear in place of its parts
    when ALL of them are named (q_proj,k_proj,v_proj -> qkv_proj; gate_proj,up_proj -> gate_up_proj: the same weight
    rows adapted, by one LoRA pair); some of them only, or a fused name on a model without them, is a ValueError
    naming the fix (one LoRA A of qkv_proj cannot adapt q's rows alone)."""
    out = list(targets)
    for fused, parts in FUSED.items():
        named = [t for t in parts if t in out]
        if margs.fused and named:
            if len(named) < len(parts):
                raise ValueError(f"--lora-targets {','.join(targets)}: this {margs.model_type} model holds "
                                 f"{','.join(parts)} as one Linear, {fused}, which LoRA adapts whole; name all of "
                                 f"{','.join(parts)} (or {fused}), or none")
            out[out.index(named[0])] = fused
            out = [t for t in out if t not in parts]
        if fused in out and not margs.fused:
            raise ValueError(f"--lora-targets {','.join(targets)}: {fused} is Phi-3's fused Linear; this "
                             f"{margs.model_type} model has {','.join(parts)} apart: name those")
    return tuple(dict.fromkeys(out))


def model_targets(targets, margs) -> tuple[str, ...]:
    """`targets` less the LINEAR_TARGETS a model without linear layers (`margs.linear` None) lacks (the default and
    the shorthands name them for every model), with fused projections for their parts (`fused_targets`); ValueError
    when nothing is left."""
    targets = fused_targets(targets, margs)
    out = tuple(t for t in targets if margs.linear is not None or t not in LINEAR_TARGETS)
    if not out:
        raise ValueError(f"--lora-targets {','.join(targets)}: this model ({margs.model_type}) has no linear-attention "
                         f"layers, so none of these; choose from {','.join(LORA_TARGETS)}")
    return out


class NotGiven(str):
    """--lora-targets' default as argparse stores it: DEFAULT_TARGETS' spelling (what every reader before the model is
    known sees, as before), marked as not given, so `run_targets` may take the model's own default instead."""


def run_targets(given: str, margs) -> tuple[tuple[str, ...], str | None]:
    """The targets this model runs for --lora-targets `given` (`model_targets`), and the start-up line that says why
    when that is not the default: not given (`NotGiven`) on Phi-3 (its fused Linears' names) or on a model whose MLP
    names are its experts' (Qwen3-MoE, Qwen3.5-MoE, GPT-OSS: model.moe.expert_targets refuses them), the adaptable
    rest (the attention's, and Qwen3.5's linear layers' default three: `attn`); named, they stay refused
    (parallel.flags.check_model_flags)."""
    targets = model_targets(given.split(","), margs)
    if isinstance(given, NotGiven) and margs.fused:   # (said: the names differ from the default's spelling)
        return targets, (f"--lora-targets not given: LoRA on {','.join(targets)}, this {margs.model_type} model's "
                         "Linears (q/k/v and gate/up are one Linear each as stored: lora_spec.fused_targets)")
    if not isinstance(given, NotGiven) or not expert_targets(margs, targets):
        return targets, None
    kept = tuple(t for t in targets if sublayer(t) != "mlp")
    mlp = ",".join(t for t in targets if t not in kept)
    return kept, (f"--lora-targets not given: LoRA on {','.join(kept)}, this {margs.model_type} model's default: its "
                  f"{mlp} are its experts' projections, which LoRA does not adapt (model.moe.expert_targets); pass "
                  "--lora-targets to choose")


def lora_targets_arg(text: str) -> str:
    """--lora-targets: comma-separated names, a shorthand (TARGET_SETS) standing for its names where it is written,
    each name once; unknown names are kept, for the flag checks to name. The default (NotGiven) is kept as it is."""
    if isinstance(text, NotGiven):   # (argparse passes a string default through `type` too)
        return text
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
