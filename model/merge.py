"""Fold a trained LoRA adapter into its base checkpoint: a plain Hugging Face model directory out.

    python -m model.merge --model BASE_DIR --adapter RUN/adapter --out MERGED_DIR
    python -m model.merge --model BASE_DIR --adapter RUN/adapter --out MERGED_DIR --quant none --dtype fp32
    python -m model.merge --adapter RUN/adapter --out MERGED_DIR    # the base the adapter names

--model may be a Hub id (org/name[@revision], model/hub.fetch_checkpoint); without it the base is the one the
adapter names (adapter_config.json: a path, or a Hub id with the commit trained on, fetched into the hub cache).

W' = W + (lora_alpha / r) · B @ A (lora_alpha / sqrt(r) with use_rslora) for every adapted projection
(`model.merged.merge`); for a DoRA adapter (use_dora, `--dora`) W' = m / ‖W + s·B A‖ ⊙ (W + s·B A), the norm per
output row and m its lora_magnitude_vector (`model.dora.fold`, peft's merge_and_unload). With --quant nf4 W is the
dequantized 4-bit base, i.e. exactly the weights the adapter was trained against (the DoRA norm taken over it too);
with --quant none it is the checkpoint's own weight. When --quant is not given it is read from the
training run: the adapter's trained_on.json (train.py and `python -m parallel.checkpoint` write it), else
ADAPTER_DIR/../config.json (train.py's run config, beside RUN/adapter); without either the merge asks for --quant.
The base must be the one trained on: an adapter whose trained_on.json records the base's model_sha256 (train.py's,
for a local --model) is refused on a base whose files differ (another checkpoint of the same shapes, or one edited
since), unless --any-base; one trained on a Hub model (adapter_config.json: its id and commit) is refused on any base
but that commit's snapshot in the hub cache, unless --any-base. An adapter whose B @ A does not fit the base's weights
is refused before anything is written, and so is a DoRA adapter missing a projection's magnitude or holding one of
another shape than the weight's rows. An adapter with more than plain LoRA or DoRA (alpha/rank patterns, trained
biases, saved modules) is refused: one scale per adapter is all it folds in. --out may not be, or lie inside, the base
or the adapter (symlinks resolved). The merge writes into OUT/.merge-tmp and moves its files into --out once all are
written, config.json last (with --force, an earlier model's config.json, weight files and index go only then, and links
in --out are replaced, never written through): a merge stopped while writing leaves --out as it was, and one killed
in the moves no folder that loads (a failure there names where the new files are); a failure while writing (a full
disk) is one line and exit 2. A .merge-tmp without the merge's marker file is the user's: refused, never removed.
Tokenizer, chat-template (additional_chat_templates/ too) and generation files of BASE_DIR are copied to OUT_DIR.
The merge streams one base safetensors file at a time (same file names out, plus model.safetensors.index.json), so
host memory peaks at one shard plus the adapter: a 70B merge fits in the RAM of an ordinary node.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # also as a plain script

from model.merge_base import adapter_base, other_base, run_quant  # noqa: E402  (after the path, for a plain script)

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _wrapper_of(path: str) -> str | None:
    """The multimodal wrapper a checkpoint's config.json names (model/wrapper.py), else None (unreadable: None, said
    later)."""
    from model.stored import _wrapper

    try:
        return _wrapper(os.path.join(path, "config.json"))
    except ValueError:
        return None


def _quantized(path: str) -> bool:
    """Whether a checkpoint's config.json names a quantization_config (a bitsandbytes 4-bit upload)."""
    with open(os.path.join(path, "config.json")) as f:
        return "quantization_config" in json.load(f)


def check_inputs(args) -> list[str]:
    """Every problem with the paths, each naming the path and what it should hold."""
    from model.adapter_read import not_an_adapter, not_plain_lora, read_adapter_config
    from model.merge_out import STAGE, is_stage

    errors = []
    base = getattr(args, "base_flag", "--model")   # (no --model: the base the adapter names)
    fix = "" if base == "--model" else "; pass --model BASE_DIR"
    if not os.path.isdir(args.model):
        errors.append(f"{base} {args.model!r} is not a directory (want a HF checkpoint: config.json + "
                      f"*.safetensors){fix}")
    elif not os.path.isfile(os.path.join(args.model, "config.json")):
        errors.append(f"{base} {args.model!r} has no config.json{fix}")
    elif not any(f.endswith(".safetensors") for f in os.listdir(args.model)):
        errors.append(f"{base} {args.model!r} has no *.safetensors{fix}")
    elif (w := _wrapper_of(args.model)) and _quantized(args.model):   # (its vision tower is stored 4-bit too)
        errors.append(f"{base} {args.model!r} is a {w} multimodal checkpoint stored 4-bit (bitsandbytes: config.json's "
                      "quantization_config): its vision tower is stored packed, which the merged float checkpoint "
                      "cannot hold as stored; merge into the unquantized checkpoint it was made from")
    if not_adapter := not_an_adapter(args.adapter, "--adapter"):
        errors.append(not_adapter)
    if not args.out:
        return errors + ["--out is empty: pass a directory for the merged model"]
    out = os.path.realpath(args.out)   # what is written: a symlink to the base is the base, 'new/..' its parent
    before = len(errors)
    for name, d in ((f"the {base} directory" if base == "--model" else "the base directory adapter_config.json names",
                     args.model), ("the --adapter directory", args.adapter)):
        d = os.path.realpath(d)
        if out == d or out.startswith(d + os.sep):
            errors.append(f"--out {args.out!r} is {'' if out == d else 'inside '}{name}; merging would overwrite it")
        elif d.startswith(out + os.sep):   # (--force would not make it safe: config.json and shards land beside it)
            errors.append(f"--out {args.out!r} holds {name}; merging there would mix the merged model into it (a "
                          "run's config.json replaced): pass a directory of its own")
    if os.path.isfile(os.path.join(out, "metrics.jsonl")):
        errors.append(f"--out {args.out!r} is a train.py run directory (metrics.jsonl); pass a directory of its own")
    # a run's checkpoint folder, or its exports (adapter/, adapter_best/, kept as .abandoned on a resume from an
    # older step), which it rotates or replaces: a merge there is lost (the run's own folder: refused above; until
    # 2026-12-06 only ckpt/ was: review, helper 80). parallel/outdir.inside_a_run says it for train.py's --out.
    run = lambda d: any(os.path.isfile(os.path.join(d, *f)) for f in (("metrics.jsonl",), ("ckpt", "latest")))
    owned = lambda n: n in ("ckpt", "adapter", "adapter_best") or re.fullmatch(r"adapter(_best)?\.abandoned(-\d+)?", n)
    if hit := next((d for d in (out, *_parents(out)) if owned(os.path.basename(d)) and run(os.path.dirname(d))), None):
        what = "checkpoint folder" if os.path.basename(hit) == "ckpt" else "adapter folder"
        errors.append(f"--out {args.out!r} is {'' if hit == out else 'inside '}a run's {what} {hit!r}, which "
                      "train.py rotates or replaces: pass a directory of its own")
    unfit = len(errors) > before   # (--force would be refused for it: "pass --force" would be advice that fails)
    # one alpha / r for every module is all the merge folds in (DoRA: merged.merge folds its magnitudes; the experts'
    # LoRA: its per-expert pairs, model.expert_lora.per_expert)
    cfg = None
    try:   # (a folder that is no adapter: said above)
        cfg = None if not_adapter else read_adapter_config(args.adapter, "--adapter")
    except ValueError as e:
        errors.append(str(e))
    if cfg and (wrong := not_plain_lora(cfg, dora=True, experts=True)):
        errors.append(f"--adapter {args.adapter!r} has " + "; ".join(wrong) + ": its merge would not be the "
                      "model it trained (peft's merge_and_unload merges such adapters)")
    if os.path.isfile(out):
        errors.append(f"--out {args.out!r} is a file, not a directory")
    elif os.path.isdir(out) and [e for e in os.listdir(out) if not (e == STAGE and is_stage(os.path.join(out, e)))] \
            and not args.force and not unfit:   # (a killed merge's own stage: the merge clears it)
        errors.append(f"--out {args.out!r} is not empty (stale shards would shadow the merge); "
                      "pass --force to write into it anyway")
    return errors


def _parents(path: str):
    """`path`'s ancestors, nearest first."""
    while (up := os.path.dirname(path)) != path:
        yield (path := up)


def _fail(message) -> int:
    """Say why the merge stops, on stderr, and its exit code: 2."""
    print(f"merge: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],   # (python -OO: no docstrings)
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="base HF checkpoint dir (or Hub id) the adapter was trained on; "
                   "default: the one adapter_config.json names")
    p.add_argument("--adapter", required=True,
                   help="PEFT adapter dir (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--out", required=True, help="output dir for the merged HF checkpoint")
    p.add_argument("--quant", default=None, choices=["nf4", "none"],
                   help="base the adapter was trained against; default: ADAPTER/trained_on.json's \"quant\", "
                        "else ADAPTER/../config.json's (train.py's run config); neither: pass it")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="dtype of the merged weights (default: bf16, also for an fp32 run)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out directory: an earlier model there (config.json, weight files, "
                        "index) is replaced once the new one is written (in OUT/.merge-tmp), links there are "
                        "replaced (their targets untouched); other files stay")
    p.add_argument("--any-base", action="store_true",
                   help="merge into --model even if its files are not the base the adapter records it trained on")
    args = p.parse_args(argv)

    from model.adapter_read import not_an_adapter, read_adapter_config
    if why := not_an_adapter(args.adapter, "--adapter"):   # first: a run's folder or a checkpoint is named as
        return _fail(why)   # such (without --model it was "pass --model"; review, helper 53)
    try:   # then its adapter_config.json, whole (without --model, a broken one was said as naming no base)
        read_adapter_config(args.adapter, "--adapter")
    except ValueError as e:
        return _fail(e)
    args.base_flag = "--model" if args.model else "the base adapter_config.json names,"
    args.model = args.model or adapter_base(args.adapter)
    if args.model is None:
        return _fail(f"--model not given, and {args.adapter!r} has no adapter_config.json naming a base model; "
                     "pass --model BASE_DIR")
    from model.hub import fetch_checkpoint
    try:
        args.model = fetch_checkpoint(args.model)
    except FileNotFoundError as e:
        return _fail(e)
    errors = check_inputs(args)
    if not errors and not args.any_base and (why := other_base(args.adapter, args.model)):
        errors.append(why)
    if errors:
        return _fail("\n       ".join(errors))
    if args.quant is None:
        args.quant, where = run_quant(args.adapter)
        if args.quant is None:   # guessing would round a full-precision run's every block weight to 4 bits
            return _fail(f"{args.adapter!r} does not say which base it was trained against (no trained_on.json, no "
                         "run config.json beside it): pass --quant nf4 (a QLoRA adapter, trained on the 4-bit base) "
                         "or --quant none (trained on the base as stored)")
        source = f"from {where}"
    else:
        source = "from --quant"
        if (ran := run_quant(args.adapter))[0] not in (None, args.quant):   # allowed: a QLoRA adapter into the full
            print(f"merge: note: --quant {args.quant}, but {ran[1]} says the adapter trained against the "   # base
                  f"{'4-bit (nf4)' if ran[0] == 'nf4' else 'full-precision'} base: folding it into "
                  f"{'the 4-bit round trip of the base' if args.quant == 'nf4' else 'the base as stored'}, "
                  "not the weights it trained with", flush=True)
    print(f"merge: base {args.model}, adapter {args.adapter} -> {args.out}", flush=True)
    print(f"merge: quant {args.quant} ({source}), dtype {args.dtype}", flush=True)

    import torch

    from model.merge_out import MovesFailed
    from model.merged import merge

    t0 = time.time()
    try:
        merge(args.model, args.adapter, os.path.realpath(args.out), quant=args.quant,   # (the directory checked)
              dtype=getattr(torch, DTYPES[args.dtype]), log=lambda msg: print(f"merge: {msg}", flush=True),
              force=args.force)
    except (ValueError, KeyError, MovesFailed) as e:   # an adapter or base it cannot fold (checked before anything is
        return _fail(e)   # written); MovesFailed, after the earlier model went: where the new files are
    except OSError as e:   # a full disk, a read-only --out: said in one line, with what is left
        return _fail(f"writing {args.out!r} failed ({type(e).__name__}: {e}); it is as it was (the merge writes into "
                     f"{os.path.join(args.out, '.merge-tmp')} and moves the files in at the end): free space or fix "
                     "the path, then run the same command again")
    print(f"merge: done in {time.time() - t0:.1f}s: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
