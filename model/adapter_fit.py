"""--init-adapter's LoRA tensors against this model, read from the adapter's safetensors header (no weight): an adapter
of another model, a damaged or hand-edited one, or one that needs flags this run lacks is refused before the data,
not when its tensors are copied in.

Contract: `init_adapter_fits(path, shapes, r, n_layers, layers, tied, has)` (parallel/flags.py's check_model_flags
calls it) returns None or raises a ValueError naming the adapter, what does not fit and the fix. The adapter's config
(rank, alpha, targets, template) is model.adapter_read.check_init_adapter's.
"""

from __future__ import annotations

import json
import os
import re

from model.lora_spec import sublayer


def init_adapter_fits(path: str, shapes: dict, r: int, n_layers: int, layers=None, tied: bool = False,
                      has=None) -> None:
    """--init-adapter's LoRA tensors (their safetensors header) fit this model's projections (`shapes`: name -> (in,
    out); `has(layer, name)`: whether that block holds it, ModelArgs.has: Qwen3.5's attention projections are in its
    full layers only, linear_attn's in the others) at rank r: an adapter of another model is said before the data, not
    when its tensors are copied in. `tied`:
    the model's head is its input embedding; an adapter that trains that embedding without peft's ensure_weight_tying
    kept the base's head in peft (untied), which a run here cannot start from."""
    from model.adapter_read import untied_embedding
    from model.stored import read_header
    from model.wrapper import made_on, to_ours, to_peft
    header, _ = read_header(os.path.join(path, "adapter_model.safetensors"))
    form = made_on(header)   # (made on a wrapper: its exclude_modules name the wrapper's modules)
    header = {to_ours(k): h for k, h in header.items()}   # (a wrapper's names: a vision tower's LoRA is refused)
    with open(os.path.join(path, "adapter_config.json")) as f:   # (check_init_adapter read it: a list of names)
        cfg = json.load(f)
    if tied and (why := untied_embedding(cfg)):
        raise ValueError(f"--init-adapter {path!r} {why}: this run would start with the head tied to it, not the "
                         "function it learned; start from an adapter saved with ensure_weight_tying "
                         "(--train-embeddings writes one), or merge it with peft's merge_and_unload and train on that")
    bad, halves = [], {}
    for k, h in sorted(header.items()):
        if not (m := re.search(r"layers\.(\d+)\.(?:self_attn|linear_attn|mlp)\.(\w+)\.lora_(A|B|magnitude_vector)\b",
                               k)) or \
                m[2] not in shapes:
            continue
        halves.setdefault(f"layer {m[1]} {m[2]}", set()).add(m[3])
        i, o = shapes[m[2]]
        want = {"A": (r, i), "B": (o, r), "magnitude_vector": (o,)}[m[3]]
        if int(m[1]) >= n_layers:
            bad.append(f"{k} (layer {m[1]}; the model has {n_layers})")
        elif tuple(h[1]) != want:
            bad.append(f"{k} {list(h[1])}, this model's {list(want)}")
    need = {"A", "B"} | ({"magnitude_vector"} if cfg.get("use_dora") else set())   # (DoRA's: the three)
    stray = [k for k, v in halves.items() if v - need]
    if stray:   # DoRA's magnitudes under a config that says plain LoRA: a start would drop them
        raise ValueError(f"--init-adapter {path!r} holds DoRA's lora_magnitude_vector for {len(stray)} projections "
                         f"({'; '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}) but its adapter_config.json "
                         "has no use_dora: true: a hand-edited adapter; pass the adapter as it was saved (with --dora)")
    half = [f"{k} (only lora_{' and lora_'.join(sorted(v))})" for k, v in halves.items() if v != need]
    if half:   # (the other half would keep this run's init: B 0 drops the module's change, a random A garbles it;
        # review, helper 50)
        raise ValueError(f"--init-adapter {path!r} holds " + ("one half of a LoRA pair" if len(need) == 2 else
                                                              "some of DoRA's lora_A, lora_B and lora_magnitude_vector")
                         + f" for {len(half)} projections "
                         f"({'; '.join(half[:3])}{' ...' if len(half) > 3 else ''}): a damaged or hand-edited "
                         "adapter; pass the adapter as it was saved")
    if layers is not None and (out := sorted({int(k.split()[1]) for k in halves} - set(layers))):
        raise ValueError(f"--init-adapter {path!r} adapts blocks {','.join(map(str, out))}, which --lora-layers "
                         f"leaves out (its LoRA there would be dropped): pass --lora-layers covering them")
    if bad:
        raise ValueError(f"--init-adapter {path!r} does not fit this --model: {len(bad)} LoRA tensors differ "
                         f"({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): it was trained on another model; "
                         "pass an adapter of this one")
    # every projection its config names, in every layer it was trained on (peft's layers_to_transform: those only;
    # an int is one layer), holds tensors: a projection without them would start at B = 0, silently not the adapter
    # it was (a cut or hand-edited file)
    layers = cfg.get("layers_to_transform")
    layers = range(n_layers) if layers is None else [layers] if isinstance(layers, int) else layers
    ex = cfg.get("exclude_modules") or ()   # peft's: those modules get no LoRA (a regex matched in full, or names
    excluded = lambda key: bool(re.fullmatch(ex, key)) if isinstance(ex, str) else key in ex or any(   # matched as
        key.endswith("." + e) for e in ex)   # suffixes; a wrapper's names), so no tensors there is the adapter as saved
    targets = cfg.get("target_modules") if isinstance(cfg.get("target_modules"), list) else ()   # (a regex: its
    missing = [f"layer {i} {t}" for t in targets if t in shapes for i in layers   # tensors say what it adapted)
               if 0 <= i < n_layers and (has is None or has(i, t)) and f"layer {i} {t}" not in halves
               and not excluded(to_peft(f"model.layers.{i}.{sublayer(t)}.{t}", None, form))]
    if cfg.get("layers_to_transform") is not None and (extra := sorted(
            k for k in halves if int(k.split()[1]) not in layers)):   # (peft would not load them: another function)
        raise ValueError(f"--init-adapter {path!r}: its adapter_config.json has layers_to_transform {list(layers)}, "
                         f"but adapter_model.safetensors holds tensors for {len(extra)} projections outside them "
                         f"({'; '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}), which peft does not load: a "
                         "hand-edited adapter; pass the adapter as it was saved")
    if missing:
        where = f" in layers {list(layers)}" if cfg.get("layers_to_transform") is not None else ""
        raise ValueError(f"--init-adapter {path!r}: its adapter_config.json names target_modules "
                         f"{cfg['target_modules']!r}{where}, but adapter_model.safetensors holds no tensors for "
                         f"{len(missing)} of those projections ({'; '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}): a damaged or hand-edited adapter, or one of a model "
                         f"with fewer layers (this one has {n_layers}); pass the adapter as it was saved")
