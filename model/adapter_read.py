"""Adapters read back: what `--init-adapter` and the merge accept (plain LoRA, DoRA, this trainer's trained norms and
embedding), the notes a run logs about its --init-adapter, and its tensors under our parameter names.

Contract:
- `check_init_adapter(path, r, alpha, targets, ...)` -> its adapter_config.json, or ValueError naming each value this
  run cannot start from and the flag that fixes it (config only: before any weight is read).
- `read_adapter_config(path, flag)` -> the folder's adapter_config.json, or ValueError naming `flag`, the file, what is
  wrong (not JSON, no object, an r or lora_alpha no LoRA has) and the fix; --init-adapter and the merge read it so.
- `not_an_adapter(path, flag)`, `not_plain_lora(cfg)`, `untied_embedding(cfg)`: why a folder or a config is refused
  (None / []: accepted), shared with the merge (model/merged.py). peft's modules_to_save read as the modules of ours
  they name: model/saved_modules.py.
- `read_init_adapter(path)` -> {our parameter name: tensor}, the inverse of model/export.py's `peft_keys`; a tied
  model's head (`tied_head`: the trained embedding again, for peft's ensure_weight_tying) left out.
- `init_adapter_note(path, ...)`: what a run says, rather than refuses, about the folder (another base, template, RoPE
  or --quant).
The files an adapter folder holds are named in model/export.py, which writes them.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

from model.expert_lora import EXPERT_KEY, EXPERTS, PEFT_PARAMS, ours
from model.export import OVERRIDES, TEMPLATE, TIED_HEAD, TRAINED_ON
from model.lora_spec import FUSED
from model.norms import is_embed_weight, is_norm_weight
from model.rope_read import is_real
from model.saved_modules import saved_modules, saves_trained
from model.stored import read_header
from model.wrapper import to_ours


def not_plain_lora(cfg: dict, dora: bool = False, experts: bool = False) -> list[str]:
    """What in an adapter_config.json is more than plain LoRA, W + scale · B @ A with one r and alpha (what this
    trainer trains, starts from and merges), or DoRA's rescaling of it where `dora` (the caller handles use_dora):
    each as a phrase naming it. Norm layers and the input embedding as modules_to_save (--train-norms',
    --train-embeddings') are this trainer's too."""
    saved = "; ".join(saved_modules(cfg.get("modules_to_save") or [])[1]) + ": peft matches each as a name suffix, " \
        "and only norm layers and the input embedding train here (e.g. [\"norm\", \"embed_tokens\"]); merge such an " \
        "adapter with peft's merge_and_unload and train on the merged model"
    wrong = [f"{k} {cfg[k]!r} ({saved if k == 'modules_to_save' else 'not trained here'})" for k in (
        "use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "alpha_pattern", "rank_pattern")
             if cfg.get(k) and not (dora and k == "use_dora") and not (k == "modules_to_save" and saves_trained(cfg))]
    wrong += [f"{k} {cfg[k]!r} (not trained here)" for k in (
        "alora_invocation_tokens", "layer_replication", "use_bdlora", "use_qalora",
        "velora_config", "kasa_config", "monteclora_config", "arrow_config", "megatron_config") if cfg.get(k)]
    if cfg.get("target_parameters") and not (experts and set(cfg["target_parameters"]) <= set(PEFT_PARAMS)):
        wrong.append(f"target_parameters {cfg['target_parameters']!r} (" + (   # (--lora-targets experts trains them:
            "LoRA on the experts' fused parameters: pass --lora-targets with experts" if not experts else
            f"only {', '.join(PEFT_PARAMS)} are read here") + ")")   # model/expert_lora.py)
    init = cfg.get("init_lora_weights")   # these rebuild the base as W - s·B0@A0 (or quantize it) when peft loads it
    if isinstance(init, str) and (init.lower().startswith("pissa") or init.lower() in ("olora", "corda", "loftq",
                                                                                        "lora_ga")):
        wrong.append(f"init_lora_weights {init!r} (its base is rebuilt from the initial adapter on load: save it "
                     "converted, with peft's path_initial_model_for_weight_conversion, to a plain LoRA)")
    if cfg.get("loftq_config"):
        wrong.append(f"loftq_config {cfg['loftq_config']!r} (its base is not the checkpoint's)")
    if cfg.get("bias", "none") != "none":
        wrong.append(f"bias {cfg['bias']!r} (its trained biases would land in frozen weights; only 'none' here)")
    if cfg.get("peft_type") != "LORA":
        wrong.append(f"peft_type {cfg.get('peft_type')!r} (LoRA is trained here)")
    return wrong


def not_an_adapter(path: str, flag: str) -> str | None:
    """Why `path` is not a PEFT adapter folder, with what to pass instead (a run's folder, a checkpoint), or None."""
    if os.path.isfile(os.path.join(path, "adapter_config.json")) and \
            os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return None
    has = lambda *p: os.path.isfile(os.path.join(path, *p))
    export = "export its adapter first, `python -m parallel.checkpoint {} --out DIR`, and pass DIR"
    if not os.path.isdir(path):
        fix = "no such directory" if not os.path.exists(path) else "a file, not a directory"
        return f"{flag} {path!r}: {fix}; pass a PEFT adapter folder (e.g. a run's OUT/adapter)"
    if has("adapter", "adapter_config.json"):   # (a run's folder, a checkpoint, a run's before its end)
        fix = f"that is a run's folder: pass its adapter, {os.path.join(path, 'adapter')}"
    elif has("meta.json") or has("latest"):
        fix = "that is a run's checkpoint: " + export.format(path)
    elif has("ckpt", "latest"):
        fix = "that is a run's folder with no adapter yet: " + export.format(os.path.join(path, "ckpt"))
    else:
        fix = "pass a PEFT adapter folder (e.g. an earlier run's OUT/adapter)"
    gone = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not has(f)]   # (one of them: a copy
    return f"{flag} {path!r}: no {' and '.join(gone)} there; {fix}"   # cut short, or another tool's weights file)


def read_adapter_config(path: str, flag: str) -> dict:
    """The folder's adapter_config.json, else a ValueError naming `flag`, the file and the fix (module docstring; until
    2026-12-07 --init-adapter said only the JSON parser's words, and the merge divided by an r of 0). A LoRA's r and
    lora_alpha are checked here; another peft_type is refused by `not_plain_lora`, naming it."""
    fn = os.path.join(path, "adapter_config.json")
    fix = "fix it, or export the adapter again (python -m parallel.checkpoint RUN/ckpt --out DIR)"
    try:
        with open(fn, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:   # (not UTF-8, or not JSON: each says where)
        raise ValueError(f"{flag} {path!r}: {fn} is not " + (f"valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
                         if isinstance(e, json.JSONDecodeError) else f"UTF-8 text ({e})") + f"; {fix}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{flag} {path!r}: {fn} holds no JSON object ({{...}}) but {json.dumps(cfg)[:60]}; {fix}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if cfg.get("peft_type") == "LORA" and not (is_real(r) and is_real(alpha) and r == int(r) and r >= 1):
        raise ValueError(f"{flag} {path!r}: {fn} has r {r!r} and lora_alpha {alpha!r}: r must be a whole number of 1 "
                         f"or more and lora_alpha a finite number (peft scales B @ A by alpha / r); {fix}")
    return cfg


def check_init_adapter(path: str, r: int, alpha: float, targets, rslora: bool = False,
                       chat_template: str | None = None, dora: bool = False, train_norms: bool = False,
                       train_embeddings: bool = False) -> dict:
    """`--init-adapter`: refuse a PEFT LoRA adapter this run cannot start from, naming the value and the fix (config
    only: cheap, before any weight). Returns its adapter_config.json."""
    if why := not_an_adapter(path, "--init-adapter"):
        raise ValueError(why)
    cfg = read_adapter_config(path, "--init-adapter")
    mods = cfg.get("target_modules")
    wrong = not_plain_lora(cfg, dora=True, experts=EXPERTS in targets)
    if bool(cfg.get("use_dora")) != dora:   # (DoRA's magnitudes dropped, or a LoRA adapter as DoRA's start: refused,
        # as another rslora is: say which flag keeps what it learned)
        wrong.append(f"use_dora {bool(cfg.get('use_dora'))}, this run " + ("--dora" if dora else "no --dora")
                     + (" (pass --dora)" if cfg.get("use_dora") else " (drop --dora)"))
    saved = saved_modules(cfg["modules_to_save"])[0] if saves_trained(cfg) else []   # (its trained norms or embedding
    if any(is_norm_weight(m + ".weight") for m in saved) and not train_norms:   # would be dropped: another function)
        wrong.append(f"modules_to_save {cfg['modules_to_save']!r} (trained norm weights), this run no --train-norms "
                     "(pass --train-norms)")
    if any(is_embed_weight(m + ".weight") for m in saved) and not train_embeddings:
        wrong.append("modules_to_save with model.embed_tokens (a trained input embedding), this run no "
                     "--train-embeddings (pass --train-embeddings)")
    if bool(cfg.get("use_rslora")) != rslora:   # the other scale would change the function it learned
        wrong.append(f"use_rslora {bool(cfg.get('use_rslora'))}, this run " + ("--rslora" if rslora else "no --rslora")
                     + (" (pass --rslora)" if cfg.get("use_rslora") else " (drop --rslora)"))
    if cfg.get("r") != r or cfg.get("lora_alpha") != alpha:
        wrong.append(f"r {cfg.get('r')} and lora_alpha {cfg.get('lora_alpha')}, this run --lora-r {r} --lora-alpha "
                     f"{alpha:g} (the same numbers keep the function it learned: pass them)")
    if os.path.isfile(t := os.path.join(path, TEMPLATE)):
        with open(t, encoding="utf-8") as f:
            if f.read() != chat_template:
                wrong.append(f"the chat template in {t}, {'another' if chat_template else 'no'} --chat-template in "
                             f"this run (its chats were rendered with it: pass --chat-template {t})")
    if isinstance(mods, str):   # peft's regex form (matched in full against module names): what it adapted is what
        # its tensors name (the safetensors header: no weight read)
        header, _ = read_header(os.path.join(path, "adapter_model.safetensors"))
        mods = sorted({m[1] for k in header if (m := re.search(r"\.(\w+)\.lora_[AB]\b", k))
                       and ".mlp.experts." not in k})   # (the experts' fused parameters: target_parameters)
    parts = lambda names: {p for n in names for p in FUSED.get(n, (n,))}   # (Phi-3's fused Linears: their parts,
    if not isinstance(mods, list) or not parts(mods) <= parts(targets):   # as --lora-targets maps them, lora_spec.py)
        wrong.append(f"target_modules {cfg.get('target_modules')!r}"
                     + (f" (adapting {','.join(mods)})" if mods != cfg.get("target_modules") else "")
                     + f", beyond this run's --lora-targets {','.join(targets)} (pass a --lora-targets that holds "
                     "them)")
    if wrong:
        raise ValueError(f"--init-adapter {path!r}: the adapter has " + "; ".join(wrong))
    return cfg


def init_adapter_note(path: str | None, chat_template: str | None, model_sha256: str | None = None,
                      quant: str | None = None, rope_parameters: dict | None = None) -> str | None:
    """The lines a run logs about --init-adapter's folder, said rather than refused (starting from another base's
    adapter, or under another template, is a choice): no chat_template.jinja while the run renders chats with a
    --chat-template (it learned under its base's own template or one it did not record; other trainers' adapters carry
    none); a trained_on.json naming another base (model_sha256: other files than --model's) or the other --quant; a
    base_config_overrides.json (the RoPE a --rope-scaling run learned under) other than this run's (`rope_parameters`,
    None: config.json's): extending the context again is that, forgetting the flag is too (review, helper 50)."""
    if not path:
        return None
    notes = []
    if chat_template is not None and not os.path.isfile(os.path.join(path, TEMPLATE)):
        notes.append(f"note: --init-adapter {path} records no chat template ({TEMPLATE}): it was trained with its "
                     "base's own template or one it did not keep, and this run renders chats with --chat-template's; "
                     "if they differ, its first steps relearn the turn markers")
    try:
        with open(os.path.join(path, TRAINED_ON)) as f:
            was = json.load(f)
    except (OSError, ValueError):
        was = {}
    was = was if isinstance(was, dict) else {}
    if model_sha256 and was.get("model_sha256") not in (None, model_sha256):
        notes.append(f"note: --init-adapter {path} was trained on another base than --model's files (its {TRAINED_ON}"
                     f" records model_sha256 {str(was['model_sha256'])[:12]}..., --model gives {model_sha256[:12]}...):"
                     " it starts from what it learned there")
    try:
        with open(os.path.join(path, OVERRIDES)) as f:
            learned = json.load(f).get("rope_parameters")
    except (OSError, ValueError, AttributeError):
        learned = None
    if learned is not None and learned != rope_parameters:
        now = "its base config.json's" if rope_parameters is None else json.dumps(rope_parameters)
        notes.append(f"note: --init-adapter {path} learned under RoPE {json.dumps(learned)} ({OVERRIDES}), this run "
                     f"runs {now}: it starts from another function than it learned (to keep that one, pass the "
                     "--rope-scaling its run had: that run's config.json records it)")
    if quant and was.get("quant") in ("nf4", "none") and was["quant"] != quant:
        notes.append(f"note: --init-adapter {path} was trained against the "
                     f"{'4-bit' if was['quant'] == 'nf4' else 'unquantized'} base, this run's --quant is {quant}")
    return "\n".join(notes) or None


def read_init_adapter(path: str) -> dict:
    """An adapter's tensors under our parameter names (the inverse of `peft_keys`, after `to_ours`); a tied model's
    head (peft's ensure_weight_tying: the trained embedding again, `tied_head`) is left out, as it is the embedding."""
    sd = {to_ours(k): v for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items()}   # (made on
    tied_head(sd, path)   # a multimodal wrapper or a text-only model: the same language model's, model/wrapper.py)
    with open(os.path.join(path, "adapter_config.json")) as f:   # (the experts': model.expert_lora.ours, as named)
        params = json.load(f).get("target_parameters")
    sd = ours({k.removeprefix("base_model.model."): v for k, v in sd.items()}, params)
    return {k if EXPERT_KEY in k else re.sub(r"\.lora_magnitude_vector$", ".lora_magnitude_vector.default.weight", k)
            .replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
            for k, v in sd.items()}


def untied_embedding(cfg: dict) -> str | None:
    """Why an adapter_config.json `cfg`, read against a base whose head is tied to its input embedding, does not tie
    them (the trained embedding without peft's ensure_weight_tying: in peft the head stays the base's), or None."""
    if "model.embed_tokens" in saved_modules(cfg.get("modules_to_save") or [])[0] and \
            not cfg.get("ensure_weight_tying"):
        return ("trains the input embedding (modules_to_save model.embed_tokens) of a model whose output head is that "
                "embedding (config.json's tie_word_embeddings), without peft's ensure_weight_tying: in peft its head "
                "stays the base's embedding, untied from the trained one")
    return None


def tied_head(sd: dict, path: str) -> None:
    """Drop from an adapter's tensors `sd` (peft's keys) the output head of a model whose head is its input
    embedding, which --train-embeddings wrote beside that embedding for peft's ensure_weight_tying: it must be the
    embedding, else refused (`path`: the adapter, named)."""
    if TIED_HEAD not in sd:
        return
    emb = sd.get("base_model.model.model.embed_tokens.weight")
    with open(os.path.join(path, "adapter_config.json")) as f:
        tying = json.load(f).get("ensure_weight_tying")
    if not tying or emb is None or not torch.equal(sd[TIED_HEAD], emb):
        raise ValueError(f"adapter {path!r} holds a trained output head (lm_head.weight), which this trainer does not "
                         "train: only a tied model's, as the trained input embedding itself (ensure_weight_tying), is "
                         "taken; export it with the embedding alone, or merge it with peft's merge_and_unload")
    del sd[TIED_HEAD]
