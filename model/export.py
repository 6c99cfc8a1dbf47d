"""Adapter export in PEFT format, and folding the adapter into a full Hugging Face checkpoint.

Contract:
- `export_adapter(peft_model, out_dir, base_path, rope_parameters=None)`: every rank takes part (each LoRA
  tensor is gathered from its FSDP2 shards); rank 0 writes `adapter_model.safetensors` and `adapter_config.json`,
  which `peft.PeftModel.from_pretrained` loads on the transformers model of the same checkpoint. A run with
  `--rope-scaling` also writes `base_config_overrides.json`: {"rope_parameters": ...} (transformers 5's form,
  rope_theta included: `ModelArgs.rope_parameters()`), what the base must be loaded with
  (`from_pretrained(DIR, rope_parameters=...)`) to run as it was trained; `merge` writes that RoPE into the
  merged config.json in the base config's own form. `trained_on.json` records `quant`, the base it was trained
  against (what `model.merge` folds it into). The folder is written beside it (`.tmp-export`) and swapped in whole
  (`write_adapter`), so a kill mid-export leaves the adapter that was there.
- `merge(base_path, adapter_dir, out_dir, quant)`: a full checkpoint (config, tokenizer files,
  bf16 safetensors in the base's file layout + model.safetensors.index.json) with
  W' = W + (alpha / r) · B @ A (alpha / sqrt(r) for a use_rslora adapter) for every adapted projection, or for a
  use_dora adapter W' = m / ‖W + s·B A‖_row ⊙ (W + s·B A) (`model.dora.fold`, m its lora_magnitude_vector), streamed
  one base file at a time; an adapter's chat_template.jinja (a run with --chat-template) becomes the merged
  tokenizer's template. With quant="nf4" every block Linear weight (adapted or not) is the dequantized NF4
  weight, i.e. exactly the base the adapter was trained against.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import shutil

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file

from model.load import CheckpointReader, _check_dir, hub_snapshot
from model.norms import is_norm_weight, modules_to_save

OVERRIDES = "base_config_overrides.json"
TEMPLATE = "chat_template.jinja"   # a run's --chat-template, beside its adapter (transformers' own file name)
TRAINED_ON = "trained_on.json"   # {"quant": "nf4" | "none", "model_sha256": ...}: the base it was trained against
SWAP = (".tmp-export", ".old-export")   # write_adapter's own folders beside an adapter it (re)writes
STAGE = ".merge-tmp"   # merge()'s folder inside --out, whose files move into --out once all are written
STAGE_MARK = ".merge-stage"   # the file inside STAGE that makes it merge()'s own (a user's .merge-tmp is left alone)


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

    full = {}
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            full[n] = t.detach().to("cpu", torch.float32).clone()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    sd = get_peft_model_state_dict(peft_model, state_dict=full)   # (LoRA's; peft drops what is not its own)
    sd.update(peft_keys({n.removeprefix("base_model.model."): t for n, t in full.items() if is_norm_weight(n)}))
    write_adapter(sd, peft_model.peft_config["default"], out_dir, base_path, rope_parameters, chat_template, quant,
                  model_sha256)


def not_plain_lora(cfg: dict, dora: bool = False) -> list[str]:
    """What in an adapter_config.json is more than plain LoRA, W + scale · B @ A with one r and alpha (what this
    trainer trains, starts from and merges), or DoRA's rescaling of it where `dora` (the caller handles use_dora):
    each as a phrase naming it. Norm layers as modules_to_save (--train-norms') are this trainer's too."""
    wrong = [f"{k} {cfg[k]!r} (not trained here)" for k in ("use_dora", "lora_bias", "modules_to_save",
                                                          "trainable_token_indices", "alpha_pattern", "rank_pattern")
             if cfg.get(k) and not (dora and k == "use_dora") and not (k == "modules_to_save" and saves_norms(cfg))]
    wrong += [f"{k} {cfg[k]!r} (not trained here)" for k in (
        "alora_invocation_tokens", "layer_replication", "use_bdlora", "target_parameters", "use_qalora",
        "velora_config", "kasa_config", "monteclora_config", "arrow_config", "megatron_config") if cfg.get(k)]
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


def saves_norms(cfg: dict) -> bool:
    """Whether an adapter_config.json's modules_to_save are norm layers only (and some): --train-norms' adapter."""
    mods = cfg.get("modules_to_save")
    return isinstance(mods, list) and bool(mods) and all(isinstance(m, str) and is_norm_weight(m + ".weight")
                                                         for m in mods)


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
    return f"{flag} {path!r}: no adapter_config.json and adapter_model.safetensors there; {fix}"


def check_init_adapter(path: str, r: int, alpha: float, targets, rslora: bool = False,
                       chat_template: str | None = None, dora: bool = False, train_norms: bool = False) -> dict:
    """`--init-adapter`: refuse a PEFT LoRA adapter this run cannot start from, naming the value and the fix (config
    only: cheap, before any weight). Returns its adapter_config.json."""
    if why := not_an_adapter(path, "--init-adapter"):
        raise ValueError(why)
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    mods = cfg.get("target_modules")
    wrong = not_plain_lora(cfg, dora=True)
    if bool(cfg.get("use_dora")) != dora:   # (DoRA's magnitudes dropped, or a LoRA adapter as DoRA's start: refused,
        # as another rslora is: say which flag keeps what it learned)
        wrong.append(f"use_dora {bool(cfg.get('use_dora'))}, this run " + ("--dora" if dora else "no --dora")
                     + (" (pass --dora)" if cfg.get("use_dora") else " (drop --dora)"))
    if saves_norms(cfg) and not train_norms:   # (its trained norms would be dropped: the function changes)
        wrong.append(f"modules_to_save {cfg['modules_to_save']!r} (trained norm weights), this run no --train-norms "
                     "(pass --train-norms)")
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
    if not isinstance(mods, list) or not set(mods) <= set(targets):
        wrong.append(f"target_modules {mods!r}, beyond this run's --lora-targets {','.join(targets)} (pass a "
                     "--lora-targets that holds them)")
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
    """An adapter's tensors under our parameter names (the inverse of `peft_keys`)."""
    return {re.sub(r"\.lora_magnitude_vector$", ".lora_magnitude_vector.default.weight",
                   k.removeprefix("base_model.model.")).replace(".lora_A.weight", ".lora_A.default.weight")
            .replace(".lora_B.weight", ".lora_B.default.weight"): v
            for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items()}


def peft_keys(lora: dict) -> dict:
    """Our model's LoRA tensors ({"model.layers.0.self_attn.q_proj.lora_A.default.weight": t}, as a checkpoint holds
    them) under peft's adapter keys ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"; DoRA's
    magnitude "...q_proj.lora_magnitude_vector", as peft saves it)."""
    return {"base_model.model." + k.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
            .replace(".default.", "."): v for k, v in lora.items()}


def half_written(out_dir: str) -> bool:
    """`out_dir` holds what a killed in-place write_adapter left (its `.adapter.tmp` and some of the files it renames
    out of it, never adapter_config.json, renamed last): it may be written again."""
    held = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    files = {"adapter_model.safetensors", OVERRIDES, TEMPLATE, TRAINED_ON}
    return ".adapter.tmp" in held and held <= files | {".adapter.tmp"}


def write_adapter(sd: dict, cfg, out_dir: str, base_path: str, rope_parameters: dict | None = None,
                  chat_template: str | None = None, quant: str | None = None, model_sha256: str | None = None) -> None:
    """adapter_model.safetensors (`sd`, peft's keys), adapter_config.json (`cfg`, a LoraConfig, naming the base),
    for a run with --rope-scaling base_config_overrides.json, for one with --chat-template chat_template.jinja.
    Written to `out_dir`.tmp-export, then renamed into place (the one before goes through `out_dir`.old-export:
    names of this function's own, so a user's `out_dir`.old is never touched): a kill at any point leaves no half
    adapter under `out_dir`, and one already there (a resumed run re-exporting) stays whole until the new one is
    complete. Into an empty directory that exists (`python -m parallel.checkpoint --out DIR`: a mount point, `.`),
    which cannot be swapped, the files go from `DIR/.adapter.tmp` by renames, adapter_config.json (what makes it an
    adapter to peft) last. `quant` and `model_sha256` (the base's `model.load.model_fingerprint`, as the run recorded
    it): written to trained_on.json, what `model.merge` checks its base against."""
    out_dir = os.path.realpath(out_dir)   # (a symlinked OUT/adapter: its target is swapped, the link stays)
    in_place = os.path.isdir(out_dir) and (not os.listdir(out_dir) or half_written(out_dir))
    if not in_place and os.path.isdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        raise ValueError(f"{out_dir!r} holds files that are not an adapter (no adapter_config.json), which writing "
                         "the adapter there would replace: move them, or pass a new directory")   # (the callers'
        # checks refuse it first: this is the last line before a swap would delete them)
    tmp, old = (os.path.join(out_dir, ".adapter.tmp"), None) if in_place else (out_dir + SWAP[0], out_dir + SWAP[1])
    shutil.rmtree(tmp, ignore_errors=True)   # a write that was killed
    os.makedirs(tmp)
    save_file({k: v.to(torch.float32).contiguous() for k, v in sd.items()},
              os.path.join(tmp, "adapter_model.safetensors"))
    cfg = copy.deepcopy(cfg)   # (not the training model's own)
    if norms := modules_to_save(sd):   # --train-norms: peft loads them as saved modules (model/norms.py)
        cfg.modules_to_save = norms
    cfg.task_type = "CAUSAL_LM"   # what peft's AutoPeftModelForCausalLM and PeftModel pick the causal-LM class by
    hub = hub_snapshot(base_path)
    if hub:   # the id and commit, which peft fetches
        cfg.base_model_name_or_path, cfg.revision = hub.split("@")
    else:
        cfg.base_model_name_or_path = os.path.abspath(base_path)
    cfg.save_pretrained(tmp)
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


def _is_nf4(name: str, w: torch.Tensor) -> bool:
    """The weights `model.qlora.apply_nf4` quantizes: Linear weights of a block's attention and MLP."""
    parts = name.split(".")   # model.layers.{i}.{self_attn|mlp}.{proj}.weight
    return (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] in ("self_attn", "mlp")
            and parts[5] == "weight" and w.ndim == 2)


def _misfit(name: str, ab: dict, shape, r: int) -> str | None:
    """Why LoRA pair `ab` ({"A", "B"}, a DoRA adapter's magnitude "m" beside them) cannot be folded into the base
    weight `name` of `shape`, or None. A trained norm's weight ({"norm"}): its shape is the base's."""
    if "norm" in ab:
        return None if tuple(ab["norm"].shape) == tuple(shape) else \
            f"{name}: the adapter's {list(ab['norm'].shape)}, the base's {list(shape)}"
    if {"A", "B"} - set(ab):
        return f"{name}: only " + " and ".join({"A": "lora_A", "B": "lora_B", "m": "lora_magnitude_vector"}[k]
                                               for k in sorted(ab))
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or a.shape[0] != r:
        return f"{name}: lora_B {list(b.shape)}, lora_A {list(a.shape)}, r {r}"
    if (b.shape[0], a.shape[1]) != tuple(shape):
        return f"{name}: B @ A is {[b.shape[0], a.shape[1]]}, the base's weight {list(shape)}"
    return None


def _no_magnitude(name: str, ab: dict, shape) -> str | None:
    """Why a DoRA adapter's pair for the base weight `name` of `shape` has no magnitude to fold with, or None."""
    if "norm" in ab:
        return None
    key = f"base_model.model.{name.removesuffix('.weight')}.lora_magnitude_vector"
    if "m" not in ab:
        return f"{key} is missing"
    if tuple(ab["m"].shape) != (shape[0],):
        return f"{key} is {list(ab['m'].shape)}, not [{shape[0]}], one per output row of {name}"
    return None


# what transformers loads a model from (and would load instead of the new merge); other files are the user's
_WEIGHTS = re.compile(r"(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
                      r"pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json|config\.json(\.tmp)?)$")


_COPIED = ("tokenizer", "special_tokens", "generation_config", "chat_template", "vocab", "merges", "added_tokens")


def _copied(name: str, remote_code: bool) -> bool:
    """A base's file the merge copies beside the weights: tokenizer and generation files, and remote code."""
    return name.startswith(_COPIED) or name.endswith(".tiktoken") or (name.endswith(".py") and remote_code)


def _clear_out(out_dir: str) -> list[str]:
    """Before a merge's files move into `out_dir` (empty, or --force), what they would replace is removed: links (a
    `cp -rs` view of another model, a shared tokenizer.json; their targets untouched) and hard links (a `cp -al` copy of
    the base or of another model), under the names the merge writes; and an earlier model's config.json, weight files
    and index under the names transformers loads (its model.safetensors beside a sharded merge loads instead of it;
    config.json goes first, so a merge killed in the moves leaves no folder that loads). Other files and links (an
    adapter_model.safetensors of the user's, a link to a data folder) stay. Returns the names removed."""
    gone = []
    for e in sorted(os.listdir(out_dir), key=lambda e: (e != "config.json", e)):
        p = os.path.join(out_dir, e)
        writes = bool(_WEIGHTS.match(e)) or _copied(e, True) or e == "additional_chat_templates"
        link = os.path.islink(p) and writes
        if link or (os.path.isfile(p) and (_WEIGHTS.match(e) or (writes and os.stat(p).st_nlink > 1))):   # (st_nlink:
            # a hard link, the file shared with another folder)
            os.remove(p)
            gone.append(e + (" (a link)" if link else ""))
    return gone


def merge(base_path: str, adapter_dir: str, out_dir: str, quant: str = "none",
          dtype: torch.dtype = torch.bfloat16, log=None, force: bool = True) -> None:
    """Shard by shard: read one base safetensors file, fold in the deltas of its tensors, write it
    under the same name, drop it; then model.safetensors.index.json. Peak host memory is one shard
    (plus one float32 tensor in flight) and the adapter, never the whole model. The files are written into
    OUT/.merge-tmp and moved into OUT once all are there (renames, config.json last), so an earlier model in OUT
    (--force) is whole until then, whatever stops the merge (a kill, a full disk: the disk holds both meanwhile)."""
    if quant not in ("nf4", "none"):
        raise ValueError(f"quant must be nf4 or none, got {quant!r}")
    cfg_path = _check_dir(base_path)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        acfg = json.load(f)
    scale = acfg["lora_alpha"] / (math.sqrt(acfg["r"]) if acfg.get("use_rslora") else acfg["r"])
    try:
        lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    except Exception as e:   # noqa: BLE001 - safetensors' own error for a cut or foreign file: said, before writing
        raise ValueError(f"{os.path.join(adapter_dir, 'adapter_model.safetensors')} cannot be read "
                         f"({type(e).__name__}: {e}): a truncated or foreign file; export the adapter again") from None
    dora = bool(acfg.get("use_dora"))   # (model.merge checked the rest of adapter_config.json: not_plain_lora)
    mag = ".lora_magnitude_vector"   # peft's key for DoRA's magnitude, one per output row
    norms = saves_norms(acfg)   # --train-norms' weights: they replace the base's
    other = sorted(k for k in lora if ".lora_A." not in k and ".lora_B." not in k and not (dora and mag in k)
                   and not (norms and is_norm_weight(k)))
    if other:   # before anything is written
        stray = not dora and any(mag in k for k in other)   # (DoRA's, in an adapter whose config says LoRA)
        raise ValueError(f"adapter {adapter_dir!r} holds tensors that are not LoRA A/B weights"
                         f"{' or DoRA magnitudes' if dora else ''} ({', '.join(other[:3])}"
                         f"{', ...' if len(other) > 3 else ''}): not {'a DoRA' if dora else 'a plain LoRA'} adapter "
                         "this merge can apply"
                         + ("; lora_magnitude_vector is DoRA's, and adapter_config.json has no use_dora: true "
                            "(its merge would drop the magnitudes)" if stray else ""))
    # "base_model.model.<name>.lora_A.weight" -> "<name>.weight": {"A", "B"} (and DoRA's "m")
    pairs = {}
    for k, v in lora.items():
        if norms and is_norm_weight(k):
            pairs[k.removeprefix("base_model.model.")] = {"norm": v.float()}
            continue
        name, which = k.removeprefix("base_model.model.").rsplit(".lora_", 1)
        which = which.split(".")[0]
        pairs.setdefault(name + ".weight", {})["m" if which == "magnitude_vector" else which] = v.float()
    reader = CheckpointReader(base_path)
    missing = sorted(set(pairs) - set(reader.where))
    if missing:   # before anything is written
        raise ValueError(f"adapter targets {missing[:5]} that the base checkpoint {base_path!r} lacks")
    bad = [_misfit(name, ab, reader.shape(name), acfg["r"]) for name, ab in sorted(pairs.items())]
    if any(bad):   # before anything is written (was a RuntimeError at the first such shard, files written before it)
        bad = [b for b in bad if b]
        raise ValueError(f"adapter {adapter_dir!r} does not fit the base {base_path!r}: {len(bad)} of {len(pairs)} "
                         f"LoRA pairs ({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); pass the base it was "
                         "trained on")
    bad = [_no_magnitude(name, ab, reader.shape(name)) for name, ab in sorted(pairs.items())] if dora else []
    if any(bad):   # without its magnitude a projection's DoRA rescaling would be dropped, not folded
        bad = [b for b in bad if b]
        none = all("m" not in ab for ab in pairs.values())   # (a plain LoRA adapter's config saying use_dora?)
        raise ValueError(f"DoRA adapter {adapter_dir!r} (use_dora in adapter_config.json): {len(bad)} of {len(pairs)} "
                         f"projections lack a magnitude that fits ({'; '.join(bad[:3])}"
                         f"{' ...' if len(bad) > 3 else ''}); every adapted projection needs its "
                         "lora_magnitude_vector, one number per output row: export the adapter again (`python -m "
                         "parallel.checkpoint RUN/ckpt --out DIR`, or peft's save_pretrained), which writes them all"
                         + ("; a plain LoRA adapter's adapter_config.json says use_dora: false" if none else ""))
    files = {}
    for name in sorted(reader.where):
        files.setdefault(reader.where[name], []).append(name)
    os.makedirs(out_dir, exist_ok=True)
    held = _hold(out_dir)   # for the whole merge: its stage is this merge's, not a killed one's to clear
    try:
        if not force and [e for e in os.listdir(out_dir) if not (e == STAGE and is_stage(os.path.join(out_dir, e)))]:
            raise ValueError(f"--out {out_dir!r} is not empty (a merge that ended while this one started wrote "
                             "there?): pass --force to write into it anyway")   # (model.merge checked it before the
            # lock: another merge may have finished since; review, helper 56)
        _merge_held(out_dir, base_path, adapter_dir, cfg_path, reader, files, pairs, acfg, scale, quant, dtype, log)
    finally:
        os.close(held)


def _hold(out_dir: str) -> int:
    """An exclusive flock on the --out directory itself (no file left in the merged model), or a refusal: a second
    merge into the same --out took the first one's live stage for a killed merge's and cleared it, so the two
    wrote one mixed, incomplete model, one of them saying done (review, helper 54)."""
    import fcntl

    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"another merge is writing into {out_dir!r} now (it holds that folder's lock): wait for it "
                         "to end, or pass another --out") from None
    except OSError as e:   # a filesystem without flock (some network mounts): the merge goes on unguarded
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):   # (EBADF: NFS and CIFS take
            # flock as a byte-range lock, which an exclusive one wants a file open for writing for)
            os.close(fd)
            raise
    return fd


def _merge_held(out_dir, base_path, adapter_dir, cfg_path, reader, files, pairs, acfg, scale, quant, dtype, log):
    """merge() under the --out lock: stage, write, move in."""
    stage = os.path.join(out_dir, STAGE)   # everything is written here first: an earlier model in --out (--force)
    if os.path.lexists(stage) and not is_stage(stage):   # stays whole until the new one is complete
        raise ValueError(f"{stage!r} is not a merge's own folder (no {STAGE_MARK} in it), and the merge writes "
                         "there: move it, then run the same command again")
    shutil.rmtree(stage, ignore_errors=True)   # a killed merge's
    os.makedirs(stage)
    open(os.path.join(stage, STAGE_MARK), "w").close()
    try:
        _merge_into(stage, base_path, adapter_dir, cfg_path, reader, files, pairs, acfg, scale, quant, dtype, log)
        moves = sorted((e for e in os.listdir(stage) if e != STAGE_MARK), key=lambda e: (e == "config.json", e))
        for e in moves:   # a file where a folder goes, or the reverse: said before the earlier model is touched
            dst = os.path.join(out_dir, e)
            if os.path.lexists(dst) and not os.path.islink(dst) and os.path.isdir(dst) != os.path.isdir(
                    os.path.join(stage, e)):
                raise ValueError(f"{dst!r} is a {'folder' if os.path.isdir(dst) else 'file'}, where the merge writes "
                                 f"a {'file' if os.path.isdir(dst) else 'folder'}: move it, then run the same command")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    cleared = _clear_out(out_dir)   # the earlier model goes only now, config.json first
    if log and cleared:
        log(f"removed from {out_dir} (--force): {', '.join(cleared[:6])}{' ...' if len(cleared) > 6 else ''}")
    try:
        for e in moves:   # renames; config.json last
            dst = os.path.join(out_dir, e)
            if os.path.isdir(dst) and not os.path.islink(dst):   # (additional_chat_templates/ of an earlier model)
                shutil.rmtree(dst)
            os.replace(os.path.join(stage, e), dst)   # a link or hard link there is replaced, never written through
        shutil.rmtree(stage)
    except OSError as e:
        raise MovesFailed(f"moving the merged files from {stage} into {out_dir} failed ({type(e).__name__}: {e}): "
                          f"the earlier model there is removed; the files not moved yet are in {stage}. Move them "
                          "into it (config.json last), or run the same command again") from e


class MovesFailed(OSError):
    """merge() failed once the earlier model in --out was removed: its message says where the new files are."""


def is_stage(path: str) -> bool:
    """`path` is a merge's own staging folder (its marker file inside), not a user's."""
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, STAGE_MARK))


def _merge_into(out_dir, base_path, adapter_dir, cfg_path, reader, files, pairs, acfg, scale, quant, dtype, log):
    """merge()'s writing: every file of the merged model into `out_dir` (its staging folder), config.json last."""
    if quant == "nf4":   # bitsandbytes imports torch's compiler stack: seconds, only when needed
        from model.qlora import nf4_round_trip
    from model.dora import fold
    if log:
        log(f"{len(pairs)} adapted weights (r {acfg['r']}, alpha {acfg['lora_alpha']}"
            f"{', rsLoRA' if acfg.get('use_rslora') else ''}{', DoRA' if acfg.get('use_dora') else ''}: "
            f"scale {scale:g}), {len(reader.where)} "
            f"tensors in {len(files)} files")
    weight_map, total = {}, 0
    for i, (fn, names) in enumerate(sorted(files.items())):
        out = {}
        for name in names:
            w = reader.get(name).float()
            if quant == "nf4" and _is_nf4(name, w):
                # every block Linear was 4-bit in training (apply_nf4), adapted or not
                w = nf4_round_trip(w)   # training's base, bit for bit (whatever device quantized it there)
            if name in pairs and "norm" in pairs[name]:   # --train-norms: the trained weight itself
                w = pairs[name]["norm"]
            elif name in pairs and "m" in pairs[name]:   # DoRA: rescaled per row, the norm over the same base W
                w = fold(w, pairs[name]["A"], pairs[name]["B"], scale, pairs[name]["m"])
            elif name in pairs:
                w = w + scale * pairs[name]["B"] @ pairs[name]["A"]
            out[name] = w.to(dtype).contiguous()
            del w
        base_name = os.path.basename(fn)
        save_file(out, os.path.join(out_dir, base_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, base_name))
        total += sum(t.numel() * t.element_size() for t in out.values())
        del out
        if log:
            log(f"{i + 1}/{len(files)} files written ({total / 1e6:.0f} MB as {dtype})")
    reader.close()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    if os.path.exists(os.path.join(adapter_dir, OVERRIDES)):   # --rope-scaling: the RoPE the adapter learned with
        with open(os.path.join(adapter_dir, OVERRIDES)) as f:
            rope = dict(json.load(f)["rope_parameters"])
        if "rope_parameters" in cfg:   # transformers 5's form (a top-level rope_scaling would win over it)
            cfg["rope_parameters"] = rope
            cfg.pop("rope_scaling", None)
            cfg.pop("rope_theta", None)
        else:   # the classic form: rope_theta and rope_scaling on top (which transformers 4 reads)
            cfg["rope_theta"] = rope.pop("rope_theta")
            cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    for fn in os.listdir(base_path):   # tokenizer and generation files, and remote code, travel with the weights
        if _copied(fn, "auto_map" in cfg):
            if os.path.isfile(os.path.join(base_path, fn)):
                shutil.copyfile(os.path.join(base_path, fn), os.path.join(out_dir, fn))
        elif fn == "additional_chat_templates" and os.path.isdir(os.path.join(base_path, fn)):   # (named templates)
            shutil.rmtree(os.path.join(out_dir, fn), ignore_errors=True)
            shutil.copytree(os.path.join(base_path, fn), os.path.join(out_dir, fn))
    if os.path.isfile(src := os.path.join(adapter_dir, TEMPLATE)):   # the run's --chat-template replaces the base's
        with open(src, encoding="utf-8") as f:
            _put_chat_template(out_dir, f.read(), cfg)
    with open(os.path.join(out_dir, "config.json.tmp"), "w") as f:   # last: what makes the folder load as a model
        json.dump(cfg, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(out_dir, "config.json.tmp"), os.path.join(out_dir, "config.json"))


if __name__ == "__main__":   # (a library: `-m model.export` did nothing and exited 0; review, helper 54)
    import sys
    print("model.export is the library the commands below use; it has no command of its own:\n"
          "  the adapter of a run's checkpoint:  python -m parallel.checkpoint RUN/ckpt --out DIR\n"
          "  an adapter folded into its base:    python -m model.merge --adapter RUN/adapter --out DIR\n"
          "(a finished run's adapter is already in RUN/adapter)", file=sys.stderr)
    sys.exit(2)
