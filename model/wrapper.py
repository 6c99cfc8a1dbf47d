"""Multimodal wrapper checkpoints whose language model trains here, text only (the image path is not ours): Mistral 3
(`Mistral3ForConditionalGeneration`: Mistral Small 3.1/3.2, Ministral 3, Magistral and Devstral Small), Gemma 3
(`Gemma3ForConditionalGeneration`: the 4B, 12B and 27B as published), Qwen3.5 (`Qwen3_5ForConditionalGeneration`) and
Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`: Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B), Gemma 4
(`Gemma4ForConditionalGeneration`: google/gemma-4-31B; vision and audio towers never read).

Contract:
- `unwrap(cfg)`: a config.json as transformers 5 reads a wrapper's language model -> (the text model's config dict,
  the wrapper's model_type or None). The text model is `text_config` (its model_type, when missing, the wrapper's
  default; Gemma 3's sizes, when missing, its text class's defaults, as transformers fills them); the outer keys that
  act on it are copied in: `tie_word_embeddings` (the outer one is what transformers obeys: the head is a module of
  the outer model; missing, the wrapper config's default, True) and `quantization_config` (bitsandbytes writes it
  there). Outer `architectures` must be the wrapper's generation class (a classifier's is refused by the caller's
  causal-LM check). Another multimodal model_type (llava, qwen2_vl...) is refused naming what is supported. A plain
  config.json passes through unchanged.
- `internal_names(stored, wrapper)`: {our name: stored name} of the language model's tensors among `stored`: our names
  are the text-only model's (`model.layers.N...`, `model.embed_tokens.weight`, `lm_head.weight`), read from either
  stored form in FORMS; the vision tower's and projector's tensors are left out (never read: they cost memory).
  `looked_for(wrapper)` says the stored prefixes, for the errors that name missing tensors.
- FORMS[wrapper][0] is transformers 5's module naming (what peft names an adapter on the wrapper by): the one mapping
  of names between our model and the wrapper's. `to_peft(name, wrapper)`: our module or tensor name (peft's
  `base_model.model.` prefix kept) as the wrapper's (model/export.py's keys and modules_to_save; the merge's tensors by
  their stored keys: `internal_names`). `peft_targets(targets, layers, wrapper)`: adapter_config.json's
  target_modules on the wrapper, peft's regex form naming the language model's projections only (the vision tower's
  have the same names: a name list would adapt them too), --lora-layers in it. `to_ours(name)`: an adapter's key or
  module name, made on a wrapper (either stored form) or on a text-only model, as ours (what --init-adapter and the
  merge read: an adapter of either fits either base, the language model being the same); one naming a wrapper's
  other parts (vision tower, projector) is refused naming it. `made_on(keys)`: the stored form an adapter's keys
  use (None: a text-only model's), whose names its adapter_config.json's exclude_modules match (`to_peft(name, None,
  form)` names our modules so). `stored_parts(path, wrapper)`: a wrapper checkpoint's
  stored keys, for the merge, which writes the language model merged under them and copies the rest as stored.
"""

from __future__ import annotations

import os

from model.lora_spec import LINEAR_TARGETS

# The wrapper's model_type -> its generation class(es), text_config's default model_type, the outer config's default
# tie_word_embeddings, and the stored key forms: (stored prefix, our prefix) pairs, one form per list. Form 0:
# transformers 5's module names (Mistral3ForConditionalGeneration.model.language_model, .lm_head); form 1: the keys
# save_pretrained writes (5.25, checked; and transformers 4's checkpoints), which transformers' "llava" conversion
# mapping renames to form 0 on load.
WRAPPERS = {"mistral3": dict(archs=("Mistral3ForConditionalGeneration",), text="mistral", tie=True),
            "gemma3": dict(archs=("Gemma3ForConditionalGeneration",), text="gemma3_text", tie=True,
                           # Gemma3TextConfig's defaults of the sizes the published text_configs leave out (the 4B-27B
                           # name hidden, intermediate, heads and layers; none names the vocabulary)
                           defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                                         num_hidden_layers=26, num_attention_heads=8)),
            # Gemma 4 (Gemma4ForConditionalGeneration: google/gemma-4-31B): model.vision_tower.*, model.audio_tower.*,
            # model.embed_vision.*, model.embed_audio.* never read (their Linears are q_proj... too: peft_targets)
            "gemma4": dict(archs=("Gemma4ForConditionalGeneration",), text="gemma4_text", tie=True,
                           defaults=dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216,
                                         num_hidden_layers=30, num_attention_heads=8)),   # (Gemma4TextConfig's)
            # Qwen3.5 (Qwen3_5ForConditionalGeneration: Qwen/Qwen3.5-9B, -27B...): its vision tower model.visual.*;
            # mtp.* (multi-token prediction) tensors, which transformers does not load either, are never read
            "qwen3_5": dict(archs=("Qwen3_5ForConditionalGeneration",), text="qwen3_5_text", tie=False,
                            defaults=dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                                          num_hidden_layers=32, num_attention_heads=16)),
            "qwen3_5_moe": dict(archs=("Qwen3_5MoeForConditionalGeneration",), text="qwen3_5_moe_text", tie=False,
                                defaults=dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                                              num_attention_heads=16))}   # (Qwen3_5MoeTextConfig's)
# a wrapper's parts that are not its language model (either form; Qwen3.5's model.visual.*)
OTHER = ("vision_tower.", "multi_modal_projector.", "visual.", "audio_tower.", "embed_vision.", "embed_audio.")
PEFT = "base_model.model."   # peft's prefix of an adapter's keys (the model it wraps)
FORMS = {w: ([("model.language_model.", "model."), ("lm_head.", "lm_head.")],   # (the same for both: transformers'
              [("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")])   # "llava" mapping)
         for w in WRAPPERS if not w.startswith(("qwen3_5", "gemma4"))}
FORMS["qwen3_5"] = FORMS["qwen3_5_moe"] = FORMS["gemma4"] = FORMS["gemma3"][:1]   # (no "llava" mapping:
# save_pretrained writes transformers' module names)
OUTER = ("tie_word_embeddings", "quantization_config")   # outer keys that act on the language model


def unwrap(cfg: dict) -> tuple[dict, str | None]:
    """(the language model's config dict, the wrapper's model_type or None): module docstring."""
    mt = cfg.get("model_type")
    if mt not in WRAPPERS:
        if isinstance(cfg.get("text_config"), dict) or "vision_config" in cfg:
            raise ValueError(f"config.json: model_type {mt!r} is a multimodal model ({cfg.get('architectures')}); of "
                             f"those only the language model of {', '.join(sorted(WRAPPERS))} (Gemma 3 4B-27B; Gemma 4 "
                             "31B; Mistral 3: Mistral Small 3.1/3.2, Ministral 3; Qwen3.5) trains here; or pass a "
                             "text-only checkpoint")
        return cfg, None
    w = WRAPPERS[mt]
    archs = [a] if isinstance(a := cfg.get("architectures") or [], str) else a
    if not isinstance(text := cfg.get("text_config"), dict):
        raise ValueError(f"config.json: model_type {mt!r} without a text_config (got {text!r}): the language model's "
                         "sizes are not named; fix config.json or re-download it")
    text = {"model_type": w["text"], **w.get("defaults", {}), **text,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", w["tie"])}
    if "quantization_config" in cfg:
        text["quantization_config"] = cfg["quantization_config"]
    if [a for a in archs if a not in w["archs"]]:   # (a classifier head made on the wrapper: the caller refuses it)
        text["architectures"] = archs
    return text, mt


def internal_names(stored, wrapper: str | None) -> dict:
    """{our name: stored name} of the language model's tensors among the names `stored` (module docstring)."""
    if wrapper is None:
        return {n: n for n in stored}
    out = {}
    for n in stored:
        ours = next((ours + n[len(pre):] for form in FORMS[wrapper] for pre, ours in form if n.startswith(pre)), None)
        if ours is None:
            continue   # the vision tower's, the projector's
        if ours in out:
            raise ValueError(f"the checkpoint stores {ours!r} of the {wrapper} language model twice, as {out[ours]!r} "
                             f"and {n!r}: re-save it with transformers' save_pretrained")
        out[ours] = n
    return out


def looked_for(wrapper: str) -> str:
    """The stored prefixes of the language model's tensors, for an error naming the ones missing."""
    return " or ".join(", ".join(f"{pre}*" for pre, _ in form) for form in FORMS[wrapper])


def to_peft(name: str, wrapper: str | None, form: list | None = None) -> str:
    """Our module or tensor name (peft's prefix kept) as the wrapper's module naming (FORMS[wrapper][0], or the stored
    `form` given: made_on's); a text-only model's (wrapper and form None) as it is."""
    if wrapper is None and form is None:
        return name
    head = PEFT if name.startswith(PEFT) else ""
    n = name[len(head):] + "."   # ("lm_head", a module: its prefix "lm_head." too)
    pre, ours = next((pre, ours) for pre, ours in form or FORMS[wrapper][0] if n.startswith(ours))
    return head + (pre + n[len(ours):])[:-1]


def to_ours(name: str) -> str:
    """An adapter's key or module name (peft's prefix kept) as our text-only model's, from any wrapper's stored form
    or a text-only model's (module docstring); a wrapper's vision tower or projector: ValueError naming it."""
    head = PEFT if name.startswith(PEFT) else ""
    n = name[len(head):]
    for forms in FORMS.values():
        for pre, ours in (p for form in forms for p in form):
            if pre != ours and n.startswith(pre):
                return head + ours + n[len(pre):]
    if n.startswith(OTHER) or n.startswith(tuple("model." + o for o in OTHER)):
        raise ValueError(f"{name!r} is a multimodal model's vision tower or projector, which does not train here (its "
                         "language model does): pass an adapter of the language model only (peft: target_modules as "
                         "a regex of model.language_model's modules)")
    return name


def made_on(keys) -> list | None:
    """The stored form (a FORMS list) of the wrapper an adapter whose tensors are `keys` (peft's prefix kept or not)
    was made on, or None: a text-only model's. Its adapter_config.json names modules so (peft's exclude_modules)."""
    return next((form for forms in FORMS.values() for form in forms if any(
        k.removeprefix(PEFT).startswith(pre) for k in keys for pre, ours in form if pre != ours)), None)


def peft_targets(targets, layers, wrapper: str):
    """adapter_config.json's target_modules for LoRA on the projections `targets` of the blocks `layers` (None: all)
    of a wrapper's language model: peft's regex form (matched in full against module names, where peft ignores
    layers_to_transform), e.g. model\\.language_model\\.layers\\.\\d+\\.(self_attn|mlp)\\.(q_proj|v_proj)."""
    blocks = r"\d+" if layers is None else "(" + "|".join(str(i) for i in sorted(layers)) + ")"
    subs = "self_attn|linear_attn|mlp" if set(targets) & set(LINEAR_TARGETS) else "self_attn|mlp"   # (Qwen3.5's)
    return (to_peft("model.layers", wrapper).replace(".", r"\.") + rf"\.{blocks}\.({subs})\."
            + "(" + "|".join(sorted(targets)) + ")")


def stored_parts(path: str, wrapper: str) -> tuple[dict, dict]:
    """({our name: stored key} of a wrapper checkpoint's language model, {weight file: [stored keys of its other parts:
    the vision tower's, the projector's]}), from the headers (the index's map where there is one)."""
    from model.stored import present_weight_files, read_header

    files, wmap = present_weight_files(path)
    names, rest = {}, {}
    for f in files:
        keys = list(read_header(os.path.join(path, f))[0]) if wmap is None else [n for n, v in wmap.items() if v == f]
        names.update(lm := internal_names(keys, wrapper))
        rest[os.path.join(path, f)] = sorted(set(keys) - set(lm.values()))
    return names, rest
