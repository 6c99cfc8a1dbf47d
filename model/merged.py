"""An adapter folded into its base: a full Hugging Face checkpoint, streamed one base file at a time.

Contract:
- `merge(base_path, adapter_dir, out_dir, quant)`: a full checkpoint (config, tokenizer files,
  bf16 safetensors in the base's file layout + model.safetensors.index.json) with
  W' = W + (alpha / r) · B @ A (alpha / sqrt(r) for a use_rslora adapter) for every adapted projection, or for a
  use_dora adapter W' = m / ‖W + s·B A‖_row ⊙ (W + s·B A) (`model.dora.fold`, m its lora_magnitude_vector), streamed
  one base file at a time; an adapter's chat_template.jinja (a run with --chat-template) becomes the merged
  tokenizer's template. With quant="nf4" every block Linear weight (adapted or not) is the dequantized NF4
  weight, i.e. exactly the base the adapter was trained against (a bitsandbytes 4-bit base's: its weights as
  stored, dequantized, model/prequant.py; one not NF4 in 64-blocks is refused before anything is written;
  quantization_config leaves the merged config.json; GPT-OSS's MXFP4 experts are written as their dequantized BF16
  form, gate_up_proj and down_proj: model/gpt_oss.py). A `--train-norms` adapter's norm weights (peft's
  modules_to_save) replace the base's; so does a `--train-embeddings` one's embedding (a tied model's head with
  it, where its checkpoint stores one). GLM-4.5's router tensors are written in their stored dtype where finer than
  `dtype` (float32 as transformers loads them and training held them, model/glm4_moe.py).
- The --out folder's lock, the staging folder the files are written into first and what they replace there:
  model/merge_out.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.adapter_read import tied_head, untied_embedding
from model.expert_lora import per_expert
from model.export import OVERRIDES, TEMPLATE, _put_chat_template, save_file
from model.glm4_moe import ROUTER_TENSORS
from model.load import CheckpointReader, _check_dir, read_args
from model.merge_out import STAGE, STAGE_MARK, MovesFailed, _clear_out, _copied, _hold, is_stage
from model.norms import is_saved_weight
from model.prequant import check_quant
from model.rope_read import put_rope
from model.saved_modules import saves_trained
from model.wrapper import stored_parts, to_ours


def _is_nf4(name: str, shape) -> bool:
    """The weights `model.nf4.apply_nf4` quantizes: Linear weights of a block's attention (Qwen3.5's linear_attn: not
    its conv1d, A_log, dt_bias, norm) and MLP, an MoE block's experts' (model.layers.{i}.mlp.experts.{e}.{proj}.weight),
    Qwen3.5-MoE's shared expert's and its gate (mlp.shared_expert.{proj}.weight, mlp.shared_expert_gate.weight), not
    its router (mlp.gate.weight); Gemma 4's experts (model.layers.{i}.experts.{e}.{gate|up|down}.weight: a
    CheckpointReader's views of the fused tensors), not its router (router.proj.weight)."""
    parts = name.split(".")   # model.layers.{i}.{self_attn|mlp}.{proj}.weight
    if parts[3:4] == ["experts"] and len(parts) == 7:   # Gemma 4's, beside the MLP: experts.{e}.{gate|up|down}.weight
        return len(shape) == 2
    if parts[3:5] == ["mlp", "experts"] and len(parts) == 8:
        parts = parts[:4] + parts[6:]
    if parts[3:5] == ["mlp", "shared_expert"] and len(parts) == 7:
        parts = parts[:4] + parts[5:]
    return (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] in ("self_attn", "linear_attn", "mlp")
            and parts[4] not in ("gate", "router") and parts[5] == "weight" and len(shape) == 2)


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
    lora = {to_ours(k): v for k, v in lora.items()}   # (made on a multimodal wrapper: its language model's, ours)
    if acfg.get("target_parameters"):   # the experts' fused LoRA, split (the base's config.json read only then:
        lora = per_expert(lora, acfg["target_parameters"], read_args(base_path))   # the merge fixes some it refuses)
    tied_head(lora, adapter_dir)   # (a tied model's head, written for peft beside its trained embedding: the same)
    if (why := untied_embedding(acfg)) and read_args(base_path).tie_embeddings:   # (a tied checkpoint would tie the
        raise ValueError(f"adapter {adapter_dir!r} {why}, which a tied checkpoint cannot hold: merge it with peft's "
                         "merge_and_unload (it writes the head apart and unties it)")   # trained one to the head)
    dora = bool(acfg.get("use_dora"))   # (model.merge checked the rest of adapter_config.json: not_plain_lora)
    mag = ".lora_magnitude_vector"   # peft's key for DoRA's magnitude, one per output row
    norms = saves_trained(acfg)   # --train-norms' and --train-embeddings' weights: they replace the base's
    other = sorted(k for k in lora if ".lora_A." not in k and ".lora_B." not in k and not (dora and mag in k)
                   and not (norms and is_saved_weight(k)))
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
        if norms and is_saved_weight(k):
            pairs[k.removeprefix("base_model.model.")] = {"norm": v.float()}
            continue
        name, which = k.removeprefix("base_model.model.").rsplit(".lora_", 1)
        which = which.split(".")[0]
        pairs.setdefault(name + ".weight", {})["m" if which == "magnitude_vector" else which] = v.float()
    reader = CheckpointReader(base_path)
    if "model.embed_tokens.weight" in pairs and "lm_head.weight" in reader.where and \
            read_args(base_path).tie_embeddings:   # a tied checkpoint that stores its head too: the same
        pairs["lm_head.weight"] = pairs["model.embed_tokens.weight"]   # trained embedding replaces it
    missing = sorted(set(pairs) - set(reader.where))
    if missing:   # before anything is written
        raise ValueError(f"adapter targets {missing[:5]} that the base checkpoint {base_path!r} lacks")
    bad = [why for name, ab in sorted(pairs.items()) if (why := _misfit(name, ab, reader.shape(name), acfg["r"]))]
    if bad:   # before anything is written (was a RuntimeError at the first such shard, files written before it)
        raise ValueError(f"adapter {adapter_dir!r} does not fit the base {base_path!r}: {len(bad)} of {len(pairs)} "
                         f"LoRA pairs ({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); pass the base it was "
                         "trained on")
    bad = [why for name, ab in sorted(pairs.items()) if dora and (why := _no_magnitude(name, ab, reader.shape(name)))]
    if bad:   # without its magnitude a projection's DoRA rescaling would be dropped, not folded
        none = all("m" not in ab for ab in pairs.values())   # (a plain LoRA adapter's config saying use_dora?)
        raise ValueError(f"DoRA adapter {adapter_dir!r} (use_dora in adapter_config.json): {len(bad)} of {len(pairs)} "
                         f"projections lack a magnitude that fits ({'; '.join(bad[:3])}"
                         f"{' ...' if len(bad) > 3 else ''}); every adapted projection needs its "
                         "lora_magnitude_vector, one number per output row: export the adapter again (`python -m "
                         "parallel.checkpoint RUN/ckpt --out DIR`, or peft's save_pretrained), which writes them all"
                         + ("; a plain LoRA adapter's adapter_config.json says use_dora: false" if none else ""))
    check_quant(reader.packed, quant, base_path, fix="merge with --quant none (an adapter of this base trained on "
                "its weights dequantized, which --quant none merges into)")   # (an fp4 upload; before writing)
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


def _merge_into(out_dir, base_path, adapter_dir, cfg_path, reader, files, pairs, acfg, scale, quant, dtype, log):
    """merge()'s writing: every file of the merged model into `out_dir` (its staging folder), config.json last."""
    if quant == "nf4":   # bitsandbytes imports torch's compiler stack: seconds, only when needed
        from model.nf4 import nf4_round_trip
        from model.prequant import nf4_base
    from model.dora import fold
    if log:
        log(f"{len(pairs)} adapted weights (r {acfg['r']}, alpha {acfg['lora_alpha']}"
            f"{', rsLoRA' if acfg.get('use_rslora') else ''}{', DoRA' if acfg.get('use_dora') else ''}: "
            f"scale {scale:g}), {len(reader.where)} "
            f"tensors in {len(files)} files" + (f"; the base's MXFP4 experts ({len(reader.mxfp4)} fused tensors) are "
                                                 f"written dequantized, the BF16 form transformers loads, in {dtype}"
                                                 if reader.mxfp4 else ""))
    with open(cfg_path) as f:   # (its model_type: GLM-4.5's router is written as stored, model/glm4_moe.py)
        cfg = json.load(f)
    as_stored = ROUTER_TENSORS if cfg.get("model_type") == "glm4_moe" else ()
    stored, rest = stored_parts(base_path, reader.wrapper) if reader.wrapper else ({}, {})   # a multimodal wrapper:
    weight_map, total = {}, 0   # its language model under the stored keys, its other parts copied (bit for bit)
    for i, fn in enumerate(sorted(set(files) | {f for f, keys in rest.items() if keys})):
        out = _copy(fn, rest.get(fn, []))
        for name in files.get(fn, []):
            # every block Linear was 4-bit in training (apply_nf4), adapted or not: training's base, bit for bit
            # (whatever device quantized it there; a 4-bit upload's as stored, model/prequant.py)
            nf4 = quant == "nf4" and _is_nf4(name, reader.shape(name))
            w = nf4_base(reader, name) if nf4 and name in reader.packed else reader.get(name).float()
            if nf4 and name not in reader.packed:
                w = nf4_round_trip(w)
            if name in pairs and "norm" in pairs[name]:   # --train-norms: the trained weight itself
                w = pairs[name]["norm"]
            elif name in pairs and "m" in pairs[name]:   # DoRA: rescaled per row, the norm over the same base W
                w = fold(w, pairs[name]["A"], pairs[name]["B"], scale, pairs[name]["m"])
            elif name in pairs:
                w = w + scale * pairs[name]["B"] @ pairs[name]["A"]
            if name in reader.views:   # Gemma 4, GPT-OSS: an expert's part of the fused tensor it is written into
                src, first, _ = reader.views[name]
                fused = out.setdefault(stored.get(src, src), torch.empty(reader.raw[src][0][1], dtype=dtype))
                if name in reader.slabs:   # (GPT-OSS: its slab's interleaved, transposed part; model/gpt_oss.py)
                    shape, _, put = reader.slabs[name]
                    put(fused.view(-1)[first:first + torch.Size(shape).numel()].view(shape), w)
                else:
                    fused.view(-1)[first:first + w.numel()] = w.reshape(-1)
            else:
                out[stored.get(name, name)] = w.to(torch.promote_types(dtype, reader.meta[name][0]) if name.endswith(
                    as_stored) else dtype).contiguous()
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
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("quantization_config", None)   # a 4-bit base's: the merged weights are float
    if os.path.exists(os.path.join(adapter_dir, OVERRIDES)):   # --rope-scaling: the RoPE the adapter learned with
        with open(os.path.join(adapter_dir, OVERRIDES)) as f:
            rope = dict(json.load(f)["rope_parameters"])
        put_rope(cfg["text_config"] if reader.wrapper else cfg, rope)   # (a wrapper's: its language model's)
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


def _copy(fn: str, keys: list) -> dict:
    """The tensors `keys` of the safetensors file `fn`, as stored (a wrapper's vision tower and projector)."""
    with safe_open(fn, "pt") as f:
        return {k: f.get_tensor(k) for k in keys}
