"""train.py's checks on the weight files at start-up, before any weight is read: headers (and a 4-bit weight's few
hundred bytes of quant state) only.

Contract:
- `check_weight_headers(path, quant)`: every safetensors file the loader reads is there and whole, and a bitsandbytes
  4-bit checkpoint is one `quant` can take (model/prequant.py), else the error names the file or flag and the fix;
  `check_config_quant(path, quant, name)`: the latter from config.json alone (a Hub id before its weights are fetched;
  `--plan`, which reads nothing else).
- `check_config_shapes(path, margs, quant)`: the embedding's and each block projection's shapes (an MoE block's router
  and experts: Gemma 4's fused tensors as stored, model/gemma4_moe.py; GPT-OSS's MXFP4 ones as their BF16 form) are
  config.json's (a packed 4-bit weight's: the float shape it stands for), else an error names them; returns the
  start-up notes (more blocks stored than config.json builds; what a 4-bit or MXFP4 checkpoint trains against), or
  None.
"""

from __future__ import annotations

import os
import re

from model import gpt_oss, prequant
from model.gemma4_moe import stored_shapes
from model.lora_spec import sublayer
from model.stored import _read_json, stored_weights
from model.wrapper import looked_for


def check_weight_headers(path: str, quant: str | None = None) -> None:
    """Every safetensors file the loader reads is there with a header that fits it (read_header: a few KB each), so
    a missing shard, a Git LFS pointer or a truncated download is said at start-up, before a run directory or process
    group exists; so is a bitsandbytes 4-bit checkpoint that `quant` cannot take as stored (prequant.check_quant)."""
    if os.path.isdir(path):
        prequant.check_quant(stored_weights(path)[1], quant, path)


def check_config_quant(path: str, quant: str | None, name: str) -> None:
    """A Hub id's snapshot holding config.json alone: a bitsandbytes 4-bit checkpoint that `quant` cannot take as stored
    (its quantization_config's bnb_4bit_quant_type) is said now, not once its weights are downloaded."""
    if os.path.isfile(cfg := os.path.join(path, "config.json")):
        prequant.check_quant({}, quant, f"--model {name}", config=_read_json(cfg).get("quantization_config"))


def check_config_shapes(path: str, margs, quant: str | None = None) -> str | None:
    """The weight headers against config.json's sizes, for the tensors every supported decoder has (the embedding, each
    layer's projections): weights that are not config.json's (another size of the family, a config.json copied
    from elsewhere) are said before the data are tokenized; the loader checks every tensor once the model is built.
    Returns the notes to log, else None: the weights hold more blocks than config.json's num_hidden_layers (allowed: a
    cut-down model for a quick run; transformers builds the first ones alike); a bitsandbytes 4-bit checkpoint, what
    the run trains against (prequant.describe)."""
    if not os.path.isdir(path):
        return None
    want = {"model.embed_tokens.weight": (margs.vocab_size, margs.dim)}
    for i in range(margs.n_layers):
        for name, (n_in, n_out) in margs.projections(i).items():   # (Gemma 4's full layers: their own shapes)
            if not margs.has(i, name):   # (Qwen3.5: attention in its full layers, linear_attn in the others)
                continue
            block = sublayer(name)
            if block == "mlp" and margs.moe and margs.moe.clamp:   # GPT-OSS's router and fused experts
                want.update(gpt_oss.stored_shapes(margs, i))
                continue
            if block == "mlp" and margs.moe and margs.moe.sparse(i) and not margs.moe.beside:   # Qwen3-MoE's router
                # and experts (model/moe.py)
                want[f"model.layers.{i}.mlp.gate.weight"] = (margs.moe.experts, margs.dim)
                shape = (margs.dim, margs.moe.width) if name == "down_proj" else (margs.moe.width, margs.dim)
                want.update({f"model.layers.{i}.mlp.experts.{e}.{name}.weight": shape
                             for e in range(margs.moe.experts)})
                if margs.moe.groups:   # (GLM-4.5's router's correction bias: model/glm4_moe.py)
                    want[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = (margs.moe.experts,)
                if margs.moe.shared:   # (Qwen3.5-MoE's shared expert and its gate; GLM-4.5's shared experts, no gate)
                    wide = (margs.dim, margs.moe.shared) if name == "down_proj" else (margs.moe.shared, margs.dim)
                    want[f"model.layers.{i}.mlp.shared_expert{'s' * bool(margs.moe.groups)}.{name}.weight"] = wide
                    if not margs.moe.groups:
                        want[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = (1, margs.dim)
                continue
            want[f"model.layers.{i}.{block}.{name}.weight"] = (n_out, n_in)
        if margs.moe and margs.moe.beside:   # Gemma 4's router and fused experts beside the MLP (model/gemma4_moe.py)
            want.update(stored_shapes(margs, i))
    raw, packed, meta = stored_weights(path)
    prequant.check_quant(packed, quant, path)
    have = {n: (tuple(h[1]), os.path.basename(raw[n][1])) for n, h in meta.items()}
    mxfp4 = gpt_oss.mxfp4_tensors(meta)   # (GPT-OSS's MXFP4 experts: as their BF16 form's fused tensors)
    have.update({w: (shape, os.path.basename(raw[b][1])) for w, (b, _, shape) in mxfp4.items()})
    missing = sorted(n for n in want if n not in have)
    if (fused := next((n for n in have if n.endswith("mlp.experts.gate_up_proj")), None)) and not margs.moe.clamp:
        raise ValueError(f"{path!r}: {fused} holds the experts fused ([E, 2·I, D]); the experts are read one by one, "
                         "as the Hub's Qwen3-MoE checkpoints and transformers 5's save_pretrained store them "
                         "(mlp.experts.E.gate_proj.weight ...): save it again with transformers 5, or pass the Hub's")
    if missing:
        raise ValueError(f"{path!r}: the checkpoint lacks {len(missing)} tensors its config.json implies "
                         f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                         f"{f'; as a {w} language model, under {looked_for(w)}' if (w := margs.wrapper) else ''}): "
                         "config.json is not these weights' (num_hidden_layers?), or the download is incomplete")
    bad = [f"{n} in {os.path.join(path, have[n][1])}: checkpoint {list(have[n][0])}, config.json implies {list(s)}"
           for n, s in want.items() if have[n][0] != tuple(s)]
    if bad:
        raise ValueError(f"{len(bad)} tensor shapes disagree with config.json (wrong config.json for these "
                         "weights?):\n  " + "\n  ".join(bad[:10]) + (" ..." if len(bad) > 10 else ""))
    # (the routers: never quantized, --quant nf4 keeps them in the compute dtype)
    proj = [n for n in want if n != "model.embed_tokens.weight" and not n.endswith(".mlp.gate.weight")
            and ".router." not in n]
    notes = [prequant.describe(packed, proj, quant, path)] + [
        f"note: {path} stores GPT-OSS's experts in MXFP4: they are dequantized to bf16 as they are read (exactly), "
        f"{'then quantized to NF4 (--quant nf4)' if quant == 'nf4' else 'held in the compute dtype'}" if mxfp4 else ""]
    blocks = {int(m.group(1)) for n in have if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if blocks and max(blocks) >= margs.n_layers:
        notes.append(f"note: {path} holds the weights of {max(blocks) + 1} blocks and config.json's num_hidden_layers "
                     f"is {margs.n_layers}: the run builds and trains the first {margs.n_layers} (as transformers "
                     "loads it" + ("; GLM's multi-token-prediction layers are those, unread)" if margs.moe and
                                   margs.moe.groups else ")"))
    return "\n".join(n for n in notes if n) or None
