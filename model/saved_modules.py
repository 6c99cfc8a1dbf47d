"""peft's modules_to_save read as this trainer's modules: which of ours an entry names, by the rule the installed peft
applies, and whether they are only those this trainer trains beside LoRA (--train-norms' norm layers,
--train-embeddings' input embedding). Read by model/adapter_read.py (--init-adapter; what the merge accepts) and
model/merged.py.

Contract:
- `saved_modules(mods)` -> (the modules of ours that modules_to_save `mods` names, full names or the suffixes peft
  matches (e.g. "norm", "embed_tokens"); a phrase for each entry that names a module not trained here, or none).
- `saves_trained(cfg)`: whether an adapter_config.json's modules_to_save name those trained modules only (and some).
- `peft_saves(name, entry)`: whether the installed peft wraps our module `name` for the entry (its rule asked of peft
  where peft 0.21's and 0.22's differ). `MODULES`: our module names an entry can match.
"""

from __future__ import annotations

import functools
import re

import torch

from model.norms import is_saved_weight
from model.wrapper import to_ours


def saves_trained(cfg: dict) -> bool:
    """Whether an adapter_config.json's modules_to_save name norm layers and the input embedding only (and some):
    --train-norms' and --train-embeddings' adapter, or peft's with those (full names or peft's short ones)."""
    mods = cfg.get("modules_to_save")
    return isinstance(mods, list) and bool(mods) and not saved_modules(mods)[1]


# our model's module names (transformers' Llama family; {i}: a block's index), what a modules_to_save entry can match
MODULES = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head",
           "model.per_layer_projection_norm"] + [   # (Gemma 4 E2B / E4B's, and its blocks' post_per_layer_input_norm)
    "model.layers.{i}" + m for m in ("", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm",
                                     ".pre_feedforward_layernorm", ".post_feedforward_layernorm",   # (Gemma 3)
                                     ".post_per_layer_input_norm",
                                     ".mlp.act_fn", *(".self_attn." + p for p in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj", "q_norm", "k_norm",
                                                                                  "qkv_proj")),   # (Phi-3's fused)
                                     *(".mlp." + p for p in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")),
                                     ".linear_attn", *(".linear_attn." + p for p in (   # (Qwen3.5's linear layers)
                                         "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm")))]


def saved_modules(mods) -> tuple[list[str], list[str]]:
    """peft's modules_to_save `mods` as the modules they match here, and a phrase for each entry that matches a module
    this trainer does not train (the head, a projection, a block) or none. peft wraps every module whose name ends
    with an entry, so users write short names ("embed_tokens": the input embedding), by the installed peft's rule
    (`peft_saves`): "norm" is every norm up to peft 0.21 (input_layernorm, q/k_norm, model.norm), model.norm alone
    from 0.22. A block's module is named at the index the entry spells (or ends with: "1.input_layernorm" is block 1's,
    and 11's up to 0.21), else block 0's: which blocks it covers, the adapter's tensors say (saved under full names)."""
    names, wrong = set(), []
    for e in mods if isinstance(mods, list) else [mods]:
        e = to_ours(e) if isinstance(e, str) else e   # (peft's names on a multimodal wrapper: its language model's)
        at = {0} | {int(p + d) for d in re.findall(r"\d+", e) for p in ("", "1")} if isinstance(e, str) else set()
        hit = sorted({m.format(i=i) for m in MODULES for i in at if peft_saves(m.format(i=i), e)})
        other = [h.replace("layers.0.", "layers.N.") if at == {0} else h for h in hit   # (every block's)
                 if not is_saved_weight(h + ".weight")]
        if other or not hit:
            wrong.append(f"{e!r} matches " + (f"{', '.join(other[:3])}{' ...' * (len(other) > 3)}, not trained here"
                                              if other else "no module of a Llama-family model"))
        names.update(hit)
    return sorted(names), wrong


def peft_saves(name: str, entry: str) -> bool:
    """Whether the installed peft wraps the module `name` for the modules_to_save `entry`: peft up to 0.21 takes any
    name ending with it (`_set_trainable`: key.endswith(entry)), 0.22 a whole dotted suffix (`_is_valid_match`). Where
    the two differ for `name`, peft itself is asked (`_suffix_rule`), so the rule here is the one peft applies."""
    return name == entry or name.endswith("." + entry) or (name.endswith(entry) and _suffix_rule())


@functools.cache
def _suffix_rule() -> bool:
    """Whether the installed peft wraps, for modules_to_save ["norm"], a module named q_norm too (any name suffix)
    rather than only one named norm: asked of get_peft_model on a toy of three modules (here, not at import: the
    merge imports peft only for a short entry the two rules read apart)."""
    from model.bnb import bnb  # noqa: F401 - bitsandbytes before peft, which imports it: see model/bnb.py
    # isort: split
    from peft import LoraConfig, get_peft_model

    toy = torch.nn.Module()
    toy.proj, toy.norm, toy.q_norm = torch.nn.Linear(1, 1), torch.nn.LayerNorm(1), torch.nn.LayerNorm(1)
    get_peft_model(toy, LoraConfig(r=1, target_modules=["proj"], modules_to_save=["norm"]))
    if not hasattr(toy.norm, "modules_to_save"):   # (peft's wrapper holds its copies there)
        raise RuntimeError("peft wrapped no module named 'norm' for modules_to_save ['norm']: its matching rule is "
                           "neither peft 0.21's nor 0.22's; model/saved_modules.peft_saves needs updating for it")
    return hasattr(toy.q_norm, "modules_to_save")
