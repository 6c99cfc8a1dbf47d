"""A checkpoint's adapter: what `python -m parallel.checkpoint` and --keep-best's OUT/adapter_best write.

Contract:
- `export(path, out_dir)`: the PEFT adapter of a checkpoint, as train.py exports at the end, without resuming and
  without building the model (one process reads the LoRA tensors from the DCP files, any layout they were saved
  from); also `python -m parallel.checkpoint OUT/ckpt[/step_N] --out DIR` (refuses a non-empty DIR, one inside
  the ckpt folder, NaN/Inf).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from model.expert_lora import expert_dims
from parallel.checkpoint_folders import STEP_RE, _previous_good, read_meta, resolve
from parallel.guard import NonFiniteError


def export(path: str, out_dir: str, replace: bool = False, model: str | None = None) -> str:
    """Write the PEFT adapter of checkpoint `path` (a step folder, or a ckpt folder's newest good one) to `out_dir`;
    return the step folder read. `replace` (--keep-best's adapter_best): an adapter already there is swapped out once
    the new one is whole (model.export.write_adapter), not refused. `model`: the run's base, moved since (the adapter
    names it; its files must be the ones the run recorded)."""
    from model.export import half_written, peft_keys, write_adapter
    from model.hub import hub_snapshot, same_model
    from model.load import read_args
    from model.lora_spec import lora_layers
    from model.norms import is_saved_weight
    from model.qlora import lora_config
    from model.stored import _wrapper
    if not out_dir:
        raise ValueError("--out is empty: pass a new directory")
    real_out = os.path.realpath(out_dir)   # what is written ('new/..' is its parent, a link its target): checked
    if os.path.isfile(real_out):
        raise ValueError(f"--out {out_dir!r} is a file: pass a new directory")
    if not replace and os.path.isdir(real_out) and os.listdir(real_out) and not half_written(real_out):
        raise ValueError(f"--out {out_dir!r} exists and is not empty" + (f" (it is {real_out!r})" if real_out !=
                         os.path.abspath(out_dir) else "") + ": pass a new directory")   # (a killed export into it
        # may be written again)
    path = resolve(path, flag="checkpoint")
    real_step = os.path.realpath(path)
    linked_from = os.path.realpath(os.path.dirname(os.path.abspath(path)))   # (a link to a step folder: the folder
    is_ckpt = STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.isfile(os.path.join(linked_from,
                                                                                                     "latest"))
    for ckpt_dir in {os.path.dirname(real_step), *([linked_from] if is_ckpt else [])}:   # it is in, and the ckpt
        # folder the link is in)
        if real_out == ckpt_dir or real_out.startswith(ckpt_dir + os.sep):
            raise ValueError(f"--out {out_dir!r} is inside the checkpoint folder {ckpt_dir!r}, which the run rotates "
                             "and rewrites: pass a directory outside it (e.g. beside it, "
                             f"{os.path.join(os.path.dirname(ckpt_dir), 'adapter_' + os.path.basename(real_step))!r})")
    from parallel.outdir import inside_a_run
    if why := inside_a_run(out_dir, but=os.path.dirname(os.path.dirname(real_step))):   # (another run's ckpt/ or
        raise ValueError(f"--out {why}: pass a directory outside it")   # adapter/: its rotation or export removes it)
    args = read_meta(path).get("args", {})
    if not {"model", "lora_r", "lora_alpha", "lora_dropout", "lora_targets"} <= set(args):
        raise ValueError(f"{path}/meta.json lacks the run's LoRA flags: not a train.py checkpoint")
    if model is not None:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"--model {model!r} is not a model directory (no config.json): pass the run's base")
        if args.get("model_sha256") and not same_model(model, args["model_sha256"]):
            raise ValueError(f"--model {model!r} is not the base this run trained on (its files differ from the "
                             f"model_sha256 {path}/meta.json records): pass that base")
        if (hub := hub_snapshot(args["model"])) and hub_snapshot(os.path.realpath(model)) != hub \
                and hub_snapshot(model) != hub:   # (a Hub base records no fingerprint: its snapshot is the check)
            raise ValueError(f"--model {model!r} is not the base this run trained on: that is the Hub snapshot {hub} "
                             f"({path}/meta.json); pass its snapshot directory in the hub cache")
        args = {**args, "model": os.path.abspath(model)}
    elif args.get("rope_scaling") is not None and not os.path.isdir(args["model"]):
        raise ValueError(f"the run's base {args['model']!r} (meta.json) is gone, and its --rope-scaling is written "
                         "from the base's config.json: pass --model DIR, the base where it is now")
    try:   # (a damaged file, or a step a live run's rotation removes while this reads it: said, not a traceback)
        md = dcp.FileSystemReader(path).read_metadata()   # the LoRA tensors' names and shapes; not the optimizer's
        # (only LoRA's: a tied model's checkpoint written before _state also holds lm_head.weight, the embedding under
        # its tied name; train.py's own export writes LoRA A and B alone)
        lora = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items()
                if k.startswith("model.") and hasattr(m, "size") and (any(f".lora_{x}." in k for x in (
                    "A", "B", "magnitude_vector")) or is_saved_weight(k))}   # (--train-norms', --train-embeddings')
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": lora}, checkpoint_id=path, no_dist=True)   # one process, whatever layout saved it
    except (Exception, CheckpointException) as e:   # noqa: BLE001 - (DCP's CheckpointException: a BaseException)
        prev = _previous_good(os.path.dirname(os.path.normpath(path)), read_meta(path)["step"]) \
            if os.path.isfile(os.path.join(path, "meta.json")) else None
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {str(e).strip()[:300]})"
                         + (f"; the previous good one is {prev!r}: export that one" if prev else "")) from None
    if model is not None and (why := _misfit(lora, read_args(model, args.get("rope_scaling")))):   # (a run that
        raise ValueError(f"--model {model!r} is not the base this run trained on: {why}; pass that base")   # records
    # no fingerprint, the demo's: any base was taken, the mistake found only by the merge or peft; review, helper 81)
    bad = [k for k, v in lora.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(f"{path} holds NaN or Inf in {', '.join(bad[:4])}: no adapter written")
    rope, meta = args.get("rope_scaling"), read_meta(path)
    wrapper = meta["wrapper"] if "wrapper" in meta else _wrapper(os.path.join(args["model"], "config.json")) \
        if os.path.isfile(os.path.join(args["model"], "config.json")) else None   # (a checkpoint from before the key)
    write_adapter(peft_keys(lora), lora_config(args["lora_r"], args["lora_alpha"], args["lora_dropout"],
                                               args["lora_targets"].split(","), args.get("rslora", False),
                                               args.get("dora", False), lora_layers(args.get("lora_layers"))),
                  out_dir, args["model"],
                  read_args(args["model"], rope).rope_overrides() if rope is not None else None,
                  args.get("chat_template_text"), args.get("quant", "nf4"),   # (runs that record none: the default)
                  args.get("model_sha256"), tied=meta.get("tie_embeddings", False), wrapper=wrapper)   # (a checkpoint
    # from before the key trained no tied embedding: refused then; the base's config.json is not read, it may be gone)
    return path


def _misfit(tensors: dict, m) -> str | None:
    """Why the trained `tensors` (our names: LoRA A [r, in], B [out, r], DoRA's magnitude [out], trained norms and the
    embedding) do not fit the model of ModelArgs `m`, or None."""
    for k, t in tensors.items():
        parts, shape = k.split("."), tuple(t.shape)
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= m.n_layers:
            return f"{k} is in block {parts[2]}, and the model has {m.n_layers}"
        layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None   # (Gemma 4: shapes per block)
        proj = {n: (o, i) for n, (i, o) in m.projections(layer).items()}   # (out, in; Qwen3.5's q_proj: query, gate)
        hd = m.head_dim if layer is None else m.attn_dims(layer)[2]
        name = next((p for p in parts if p in proj), None)
        out, inp = expert_dims(m, k) or proj.get(name, (None, None))   # (the experts' LoRA: model/expert_lora.py)
        want = (shape[0], inp) if ".lora_A." in k else (out, shape[1]) if ".lora_B." in k else (out,) \
            if "lora_magnitude_vector" in k else (m.vocab_size, m.dim) if "embed_tokens" in k else \
            (hd * (1 if not m.qk_norm_whole else m.n_heads if "q_norm" in k else m.n_kv_heads),) \
            if k.endswith(("q_norm.weight", "k_norm.weight")) else (m.dim,)   # (OLMo's q/k norms: H·Hd, K·Hd)
        if shape != want:
            return f"{k} is {list(shape)}, the model's is {list(want)}"
    return None
