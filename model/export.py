"""Adapters in PEFT format, written from a run (checked and read back for --init-adapter: model/adapter_read.py).

Contract:
- `export_adapter(peft_model, out_dir, base_path, rope_parameters=None)`: every rank takes part (each LoRA
  tensor is gathered from its FSDP2 shards); rank 0 writes `adapter_model.safetensors` and `adapter_config.json`,
  which `peft.PeftModel.from_pretrained` loads on the transformers model of the same checkpoint. A run with
  `--rope-scaling` also writes `base_config_overrides.json`: {"rope_parameters": ...} (transformers 5's form,
  rope_theta included: `ModelArgs.rope_overrides()`, per layer type for Gemma 3 and OLMo 3), what the base must be
  loaded with (`from_pretrained(DIR, rope_parameters=...)`) to run as it was trained; `model.merged.merge` writes that
  RoPE into the merged config.json in the base config's own form. `trained_on.json` records `quant`, the base it was
  trained against (what `model.merge` folds it into); README.md a model card (`model_card`: the base's id as the Hub's
  `base_model`). The folder is written beside it (`.tmp-export`) and swapped in whole
  (`write_adapter`), so a kill mid-export leaves the adapter that was there.
- Folding an adapter into its base (`python -m model.merge`): model/merged.py.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file as _save_file

from model import expert_lora
from model.expert_lora import EXPERT_KEY
from model.hub import hub_snapshot
from model.load import read_args
from model.norms import is_saved_weight, modules_to_save
from model.wrapper import peft_targets, to_peft

OVERRIDES = "base_config_overrides.json"
TEMPLATE = "chat_template.jinja"   # a run's --chat-template, beside its adapter (transformers' own file name)
TRAINED_ON = "trained_on.json"   # {"quant": "nf4" | "none", "model_sha256": ...}: the base it was trained against
CARD = "README.md"   # the model card: the Hub's page of an adapter pushed there (its metadata names the base)
WRITTEN = ("adapter_model.safetensors", "adapter_config.json", OVERRIDES, TEMPLATE, TRAINED_ON, CARD)   # all an
# export may write at an adapter's top level (what a re-export replaces, a --push-to-hub deletes where it lacks them)
TIED_HEAD = "base_model.model.lm_head.weight"   # a tied model's trained embedding again, for peft (write_adapter)
SWAP = (".tmp-export", ".old-export")   # write_adapter's own folders beside an adapter it (re)writes


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file, whose write errors (a full disk) are OSError as every other write's here: safetensors
    raises its own SafetensorError, which the tools' one-line error handlers did not catch (a traceback, exit 1)."""
    try:
        _save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        raise OSError(f"writing {path}: {e}") from e


def export_adapter(peft_model, out_dir: str, base_path: str, rope_parameters: dict | None = None,
                   chat_template: str | None = None, quant: str | None = None, model_sha256: str | None = None) -> None:
    """The LoRA weights in peft's format. The base model is named by its path, or, for a directory of
    huggingface_hub's cache (`--model org/name`), by its id and commit, which peft fetches."""
    from peft.utils import get_peft_model_state_dict  # here: merge (python -m model.merge) needs no peft

    full, writes = {}, not dist.is_initialized() or dist.get_rank() == 0
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p   # (a collective: every rank gathers)
            if writes:   # (rank 0's host copy only: a trained [V, D] embedding is GBs a rank)
                full[n] = t.detach().to("cpu", torch.float32, copy=True)   # (one host copy, never the param)
    if not writes:
        return
    experts = {n: full.pop(n) for n in list(full) if EXPERT_KEY in n}   # (ours, not peft's: model/expert_lora.py)
    sd = get_peft_model_state_dict(peft_model, state_dict=full)   # (LoRA's; peft drops what is not its own)
    sd.update(peft_keys({n.removeprefix("base_model.model."): t for n, t in experts.items()}))
    sd.update(peft_keys({n.removeprefix("base_model.model."): t for n, t in full.items() if is_saved_weight(n)}))
    args = peft_model.get_base_model().args
    write_adapter(sd, peft_model.peft_config["default"], out_dir, base_path, rope_parameters, chat_template, quant,
                  model_sha256, tied=args.tie_embeddings, wrapper=args.wrapper)


def peft_keys(lora: dict) -> dict:
    """Our model's LoRA tensors ({"model.layers.0.self_attn.q_proj.lora_A.default.weight": t}, as a checkpoint holds
    them) under peft's adapter keys ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"; DoRA's
    magnitude "...q_proj.lora_magnitude_vector", as peft saves it; the experts' LoRA: model.expert_lora.peft_keys)."""
    return expert_lora.peft_keys(lora) | {
        "base_model.model." + k.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
        .replace(".default.", "."): v for k, v in lora.items() if EXPERT_KEY not in k}


def half_written(out_dir: str) -> bool:
    """`out_dir` holds what a killed in-place write_adapter left (its `.adapter.tmp` and some of the files it renames
    out of it, never adapter_config.json, renamed last): it may be written again."""
    held = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    files = set(WRITTEN) - {"adapter_config.json"}   # (renamed last: never there in a half-written one)
    return ".adapter.tmp" in held and held <= files | {".adapter.tmp"}


def write_adapter(sd: dict, cfg, out_dir: str, base_path: str, rope_parameters: dict | None = None,
                  chat_template: str | None = None, quant: str | None = None, model_sha256: str | None = None,
                  tied: bool | None = None, wrapper: str | None = None) -> None:
    """adapter_model.safetensors (`sd`, peft's keys), adapter_config.json (`cfg`, a LoraConfig, naming the base),
    for a run with --rope-scaling base_config_overrides.json, for one with --chat-template chat_template.jinja.
    Written to `out_dir`.tmp-export, then renamed into place (the one before goes through `out_dir`.old-export:
    names of this function's own, so a user's `out_dir`.old is never touched): a kill at any point leaves no half
    adapter under `out_dir`, and one already there (a resumed run re-exporting) stays whole until the new one is
    complete. Into an empty directory that exists (`python -m parallel.checkpoint --out DIR`: a mount point, `.`),
    which cannot be swapped, the files go from `DIR/.adapter.tmp` by renames, adapter_config.json (what makes it an
    adapter to peft) last. `quant` and `model_sha256` (the base's `model.hub.model_fingerprint`, as the run recorded
    it): written to trained_on.json, what `model.merge` checks its base against. `tied`: whether the base's output head
    is its input embedding (None: read from `base_path`'s config.json), where a trained embedding is written twice.
    `wrapper`: the base is that multimodal wrapper (ModelArgs.wrapper): `sd` (our names under peft's prefix) and
    the config's module names are written as peft names them on it (model/wrapper.py: to_peft, peft_targets)."""
    out_dir = os.path.realpath(out_dir)   # (a symlinked OUT/adapter: its target is swapped, the link stays)
    in_place = os.path.isdir(out_dir) and (not os.listdir(out_dir) or half_written(out_dir))
    if not in_place and os.path.isdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        raise ValueError(f"{out_dir!r} holds files that are not an adapter (no adapter_config.json), which writing "
                         "the adapter there would replace: move them, or pass a new directory")   # (the callers'
        # checks refuse it first: this is the last line before a swap would delete them)
    tmp, old = (os.path.join(out_dir, ".adapter.tmp"), None) if in_place else (out_dir + SWAP[0], out_dir + SWAP[1])
    shutil.rmtree(tmp, ignore_errors=True)   # a write that was killed
    os.makedirs(tmp)
    try:
        _fill(tmp, sd, cfg, base_path, rope_parameters, chat_template, quant, model_sha256, tied, wrapper)
    except BaseException:   # (a full disk, Ctrl-C): no half-written folder left, GBs with a trained embedding, on a
        shutil.rmtree(tmp, ignore_errors=True)   # disk that may be full (until 2026-12-07 it stayed)
        raise
    if in_place:
        for name in set(os.listdir(out_dir)) - set(os.listdir(tmp)) - {".adapter.tmp"}:   # a killed export's files that
            os.remove(os.path.join(out_dir, name))   # this one does not write (another run's RoPE, template): gone
        for name in sorted(os.listdir(tmp), key=lambda n: n == "adapter_config.json"):
            os.rename(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    else:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(out_dir):
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(out_dir), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _fill(tmp: str, sd: dict, cfg, base_path: str, rope_parameters, chat_template, quant, model_sha256, tied,
          wrapper) -> None:
    """write_adapter's files, written and synced into the folder `tmp`."""
    cfg = copy.deepcopy(cfg)   # (not the training model's own)
    sd = {k: v.to(torch.float32).contiguous() for k, v in sd.items()}
    if saved := modules_to_save(sd):   # --train-norms, --train-embeddings: peft loads them as saved modules
        cfg.modules_to_save = saved
        if "model.embed_tokens" in saved and (read_args(base_path).tie_embeddings if tied is None else tied):
            # a tied head: peft's ensure_weight_tying reads the embedding under the head's name too, and ties the two
            sd[TIED_HEAD] = sd["base_model.model.model.embed_tokens.weight"].clone()
    if wrapper:   # a multimodal base: its language model's names (the vision tower's projections have LoRA's names too)
        sd = {to_peft(k, wrapper): v for k, v in sd.items()}
        cfg.modules_to_save = [to_peft(m, wrapper) for m in cfg.modules_to_save or []] or None
        cfg.target_modules = peft_targets(cfg.target_modules, cfg.layers_to_transform, wrapper)
        cfg.layers_to_transform = None   # (in the regex: peft ignores it beside one)
    save_file(sd, os.path.join(tmp, "adapter_model.safetensors"))
    cfg.task_type = "CAUSAL_LM"   # what peft's AutoPeftModelForCausalLM and PeftModel pick the causal-LM class by
    hub = hub_snapshot(base_path)
    if hub:   # the id and commit, which peft fetches
        cfg.base_model_name_or_path, cfg.revision = hub.split("@")
    else:
        cfg.base_model_name_or_path = os.path.abspath(base_path)
    cfg.save_pretrained(tmp)
    if TIED_HEAD in sd:   # (in the file itself: a peft without the field would drop the attribute when saving)
        with open(os.path.join(tmp, "adapter_config.json")) as f:
            written = json.load(f)
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump({**written, "ensure_weight_tying": True}, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:   # (after the config: what a pushed adapter shows)
        f.write(model_card(cfg, hub, rope_parameters is not None, chat_template is not None, wrapper))
    if rope_parameters is not None:   # the base ran with another RoPE than its config.json's
        with open(os.path.join(tmp, OVERRIDES), "w") as f:
            json.dump({"rope_parameters": rope_parameters}, f, indent=1)
    if chat_template is not None:   # the template the data were rendered with, for inference
        with open(os.path.join(tmp, TEMPLATE), "w", encoding="utf-8") as f:
            f.write(chat_template)
    if quant is not None:   # the base it was trained against (NF4 or as stored, which files): what model.merge folds
        with open(os.path.join(tmp, TRAINED_ON), "w") as f:   # it into
            json.dump({"quant": quant, **({"model_sha256": model_sha256} if model_sha256 else {})}, f)
    for name in os.listdir(tmp):   # on disk before the rename makes them the adapter
        fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def model_card(cfg, hub: str | None, rope: bool, template: bool, wrapper: str | None = None) -> str:
    """README.md of an adapter: metadata the Hub reads (`base_model`, the base's id where it came from the Hub: the
    page then lists the adapter under its base; `library_name: peft`), what was trained and how to load it (peft
    writes such a card with its own save_pretrained; until 2026-12-06 ours wrote none). Only what the adapter's own
    files say: the same card from a run's end and from `python -m parallel.checkpoint`. A multimodal `wrapper`'s
    base loads in its generation class (AutoModelForImageTextToText), which AutoPeftModelForCausalLM's
    AutoModelForCausalLM lacks for Mistral 3; its pipeline_tag is the pipeline that loads that class,
    image-text-to-text (the base's own on the Hub), which takes text-only prompts too: text-generation's
    AutoModelForCausalLM cannot load a Mistral 3, and the vision tower is still there, untouched by the adapter."""
    base = hub.split("@")[0] if hub else os.path.basename(cfg.base_model_name_or_path.rstrip("/"))
    targets = ", ".join(sorted(cfg.target_modules)) if not isinstance(cfg.target_modules, str) else cfg.target_modules
    kind = "DoRA" if getattr(cfg, "use_dora", False) else "LoRA"
    lines = ["---", *([f"base_model: {json.dumps(base)}"] if hub else []), "library_name: peft",
             f"pipeline_tag: {'image-text-to-text' if wrapper else 'text-generation'}", "tags:", "- lora", "- peft",
             "---", "",
             f"# {kind} adapter of {base}", "",
             f"{kind} r {cfg.r}, alpha {cfg.lora_alpha:g}{', rsLoRA' if cfg.use_rslora else ''} on {targets}"
             + (f"; also trained in full: {', '.join(cfg.modules_to_save)}" if cfg.modules_to_save else "") + ".",
             f"Base: {base}" + (f" at commit {hub.split('@')[1]}" if hub else " (a local checkpoint)") + ".", "",
             *(["    from peft import AutoPeftModelForCausalLM",
                "    model = AutoPeftModelForCausalLM.from_pretrained(\"THIS_FOLDER_OR_REPO\")"] if not wrapper else
               ["    from peft import PeftConfig, PeftModel",
                "    from transformers import AutoModelForImageTextToText",
                "    cfg = PeftConfig.from_pretrained(\"THIS_FOLDER_OR_REPO\")",
                "    base = AutoModelForImageTextToText.from_pretrained(cfg.base_model_name_or_path, "
                "revision=cfg.revision)", "    model = PeftModel.from_pretrained(base, \"THIS_FOLDER_OR_REPO\")"]), ""]
    if rope:
        lines += [f"Trained with another RoPE than the base's config.json: load the base with `{OVERRIDES}`'s "
                  "`rope_parameters` (`from_pretrained(..., rope_parameters=...)`" + (
                      "; a multimodal base: in its config's `text_config`, passed as `config=`" if wrapper else "")
                  + ").", ""]
    if template:
        lines += [f"The data were rendered with `{TEMPLATE}`: use it for inference.", ""]
    return "\n".join(lines)


def _put_chat_template(out_dir: str, text: str, model_cfg: dict | None = None) -> None:
    """The merged tokenizer's chat template: chat_template.jinja and tokenizer_config.json's key (transformers 4 and 5
    read one or the other); a base's chat_template.json (an older form) goes. Its end-of-turn token joins
    generation_config.json's eos_token_id (data/templates.py): generation stops where the tuned model ends a turn.
    A base without a generation_config.json gets one holding `model_cfg`'s (config.json's) bos, pad and eos ids too,
    the defaults transformers would have taken from config.json."""
    with open(os.path.join(out_dir, TEMPLATE), "w", encoding="utf-8") as f:
        f.write(text)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump({**cfg, "chat_template": text}, f, indent=2, ensure_ascii=False)
    if os.path.isfile(old := os.path.join(out_dir, "chat_template.json")):
        os.remove(old)
    from transformers import AutoTokenizer

    from data.templates import end_of_turn
    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    tok.chat_template = text
    _, ids = end_of_turn(tok)
    gen_path = os.path.join(out_dir, "generation_config.json")
    gen = {k: v for k, v in (model_cfg or {}).items() if k in ("bos_token_id", "pad_token_id", "eos_token_id")}
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    eos = gen.get("eos_token_id", tok.eos_token_id)
    eos = [x for x in (eos if isinstance(eos, list) else [eos]) if x is not None]
    with open(gen_path, "w") as f:
        json.dump({**gen, "eos_token_id": eos + [i for i in ids if i not in eos]}, f, indent=2)


if __name__ == "__main__":   # (a library: `-m model.export` did nothing and exited 0; review, helper 54)
    import sys
    print("model.export is the library the commands below use; it has no command of its own:\n"
          "  the adapter of a run's checkpoint:  python -m parallel.checkpoint RUN/ckpt --out DIR\n"
          "  an adapter folded into its base:    python -m model.merge --adapter RUN/adapter --out DIR\n"
          "(a finished run's adapter is already in RUN/adapter)", file=sys.stderr)
    sys.exit(2)
