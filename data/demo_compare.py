"""Before/after: the base model's and the fine-tuned model's greedy answers on held-out prompts.

    python -m data.demo_compare runs/demo            # what `make demo` prints at the end
    python -m data.demo_compare OUT --n 5            # any run whose eval data are chat or prompt records

Contract: reads `OUT/config.json` (the run's resolved flags: `model`, `quant`, `eval_data` or, for a run with
--eval-split, `eval_split_records` (the held-out lines of each --data file), paths as typed, relative to `cwd` (the
directory the run started in; runs from before 2026-12-04 record none: this directory), the text of
its `--chat-template`, which replaces the base tokenizer's as it did in training, and the date such a
template rendered, `template_date`, which the prompts render too, whatever today is), takes the
first `--n` held-out conversations or prompt/completion records (or preference pairs with a prompt: a DPO run's),
and for each prints the prompt (the conversation up to its last user turn; a record's prompt, encoded as training
encoded it), the expected answer (its last assistant turn; the completion; a pair's chosen one, and its rejected one
beside it), and the greedy answers of
1. the transformers model of the base checkpoint (`AutoModelForCausalLM.from_pretrained`; a Mistral 3 or Gemma 3
   wrapper's, model/wrapper.py: `AutoModelForImageTextToText`, prompted with text only), and
2. the same model with the exported adapter loaded by `peft.PeftModel.from_pretrained(base, OUT/adapter)`.
A run with --rope-scaling: both with the RoPE it trained with (OUT/adapter/base_config_overrides.json, in config.json
as model.merge writes it: model/rope_read.put_rope; a wrapper's in its text_config), not config.json's: the base column
is the model before fine-tuning as training saw it, the one the adapter was fit against (the header line says so).
Nothing here runs the trainer's decoder: the adapter is checked in the ecosystem it is for.
With `--quant nf4` (the default) the base's block Linear weights are first replaced by their NF4
round trip (training's own, `model.nf4.nf4_round_trip`), i.e. exactly the base the adapter was trained against. A
4-bit upload's (model/prequant.py) 4-bit layers become float32 Linear layers holding the weights training computed
with, its float tensors float32 (`as_trained`), as a float checkpoint's model computes. Exit status 1 when a tuned
answer is wrong (`--check`), so a script can assert the demo learned; 2, with the way out, for a directory it cannot
compare (no config.json, a run without held-out data, no adapter/ yet), checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import warnings

# bitsandbytes (imported by peft) warns at import on CPUs with AVX512-BF16 that an optional
# kernels-community download is missing; nothing a user can act on, and the fallback is used.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda r: "kernels-community" not in r.getMessage())


def nf4_round_trip(model) -> None:
    """Replace each decoder block's attention/MLP Linear weight (an MoE block's experts' and shared expert's too, not
    its router) by training's NF4 of it (`model.nf4.nf4_round_trip`: the same bits; a multimodal wrapper's: its
    language model's, named as ours by model/wrapper.py). A 4-bit upload's layers (bitsandbytes' Linear4bit, whose
    weights are the packed codes) are left as transformers loaded them: those are the weights training computed with
    (until 2026-12-06 their codes were quantized as if they were weights, and
    the base answered garbage)."""
    import torch

    from model.nf4 import nf4_round_trip as base_of
    from model.wrapper import WRAPPERS, internal_names

    wrapper = getattr(model.config, "model_type", None)   # a multimodal wrapper's language model: its module names
    ours = internal_names([n for n, _ in model.named_modules()], wrapper if wrapper in WRAPPERS else None)   # as ours
    with torch.no_grad():
        for name, mod in ((n, model.get_submodule(m)) for n, m in ours.items()):
            parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}
            if isinstance(mod, torch.nn.Linear) and parts[:2] == ["model", "layers"] and (len(parts) == 5 or parts[
                    4] == "shared_expert") and not hasattr(mod.weight, "quant_state"):   # (Qwen3.5-MoE's shared expert)
                mod.weight.copy_(base_of(mod.weight).to(mod.weight.dtype))
            elif parts[3:] == ["mlp", "experts"] and getattr(mod, "gate_up_proj", None) is not None:   # transformers
                half = mod.gate_up_proj.shape[1] // 2   # 5's fused experts (Qwen3-MoE): each expert's gate, up and down
                for w in (w for e in range(mod.gate_up_proj.shape[0])   # as stored (and trained: model/moe.py)
                          for w in (mod.gate_up_proj[e, :half], mod.gate_up_proj[e, half:], mod.down_proj[e])):
                    w.copy_(base_of(w).to(w.dtype))


def as_trained(model, quant: str) -> None:
    """A 4-bit upload's transformers model, computing as training did: each bitsandbytes Linear4bit becomes a float32
    Linear holding its codes × scales (under nf4 with fp32 block scales nested as training nests them,
    model/prequant.nf4_parts), and the float tensors transformers keeps in the upload's bf16 (asked for float32) are
    float32. As loaded, the model computed in bf16 (the upload's bnb_4bit_compute_dtype, and bitsandbytes' CPU
    inference kernel, which casts the scales to bf16 in eval mode) from un-nested scales: logits 5e-3 off training's."""
    import torch

    from model.bnb import dequantize
    from model.nf4 import nested_state

    fours = [(n, m) for n, m in model.named_modules() if hasattr(getattr(m, "weight", None), "quant_state")]
    with torch.no_grad():
        for name, mod in fours:
            st = copy.copy(mod.weight.quant_state)
            if quant == "nf4" and not st.nested:   # (under nf4 training takes only nf4 in 64-blocks: prequant)
                qabsmax, st = nested_state(st.absmax.float(), st.shape, torch.float32)
                st.absmax = qabsmax
            st.dtype = torch.float32
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight = torch.nn.Parameter(dequantize(mod.weight.data, st), requires_grad=False)
            if mod.bias is not None:
                lin.bias = torch.nn.Parameter(mod.bias.detach().float(), requires_grad=False)
            model.set_submodule(name, lin)
        for t in [*model.parameters(), *model.buffers()]:   # (transformers refuses model.float() on a quantized one)
            if t.is_floating_point():
                t.data = t.data.float()


def encode(tok, prompt: list[dict] | str, day: str | None = None, tools: list | None = None) -> dict:
    """The prompt's input_ids as training encoded it (with the record's tools); a chat template that writes the date
    writes `day` (the run's template_date), not today's."""
    if isinstance(prompt, str):   # a prompt/completion record
        return tok(prompt, add_special_tokens=True, return_tensors="pt")
    from data.templates import on_day
    with on_day(tok, day):
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                       **({"tools": tools} if tools else {}))
    return tok(text, add_special_tokens=False, return_tensors="pt")


def generate(model, tok, prompt: list[dict] | str, max_new_tokens: int, stop: list[int], day: str | None = None,
             tools: list | None = None) -> str:
    import torch

    enc = encode(tok, prompt, day, tools)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                             pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def trained_rope(run_dir: str) -> dict | None:
    """The RoPE a --rope-scaling run trained with (its adapter's base_config_overrides.json), or None: config.json's."""
    from model.export import OVERRIDES

    path = os.path.join(run_dir, "adapter", OVERRIDES)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return dict(json.load(f)["rope_parameters"])


def compare(run_dir: str, n: int = 3, max_new_tokens: int = 40) -> list[dict]:
    """[{prompt, expected, base, tuned}] for the first `n` held-out conversations or prompt records of the run."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from data.jsonl import load_jsonl
    from data.load import load_tokenizer
    from data.mix import data_files
    from model.wrapper import WRAPPERS

    hf_logging.set_verbosity_error()   # generation-config notes are about defaults we set explicitly
    hf_logging.disable_progress_bar()  # a "Loading weights" bar for a 14 MB file
    # peft asks transformers a deprecated question when it wraps the model; not the user's to fix
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    cfg_path, adapter = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "adapter")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{run_dir!r} has no config.json: pass a train.py run's --out directory")
    with open(cfg_path) as f:
        cfg = json.load(f)
    held = cfg.get("eval_split_records")   # {file: [lines]}: --eval-split's records of --data
    if not cfg.get("eval_data") and not held:
        raise ValueError(f"{cfg_path} names no eval_data (the run had no --eval-data" + (
            ", and is from before config.json kept its --eval-split records" if cfg.get("eval_split") else "") +
            "): the prompts come from a run's held-out records; train with --eval-data FILE or --eval-split")
    if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        ckpt = os.path.join(run_dir, "ckpt")
        raise ValueError(f"{run_dir!r} has no adapter/ yet (the run has not finished): " + (
            f"finish it with --resume {ckpt}, or export a checkpoint's with `python -m parallel.checkpoint {ckpt} "
            f"--out {adapter}`" if os.path.isfile(os.path.join(ckpt, "latest")) else
            "it saved no checkpoint either; rerun it"))
    files = list(held) if held else data_files(cfg["eval_data"])
    at = lambda f: os.path.join(cfg.get("cwd", ""), f)   # (paths as typed: relative to where the run started)
    shas = cfg.get("data_sha256")
    if held and shas:   # the lines name records of the bytes the run read: a file changed since names others
        from data.store import file_sha256
        was = dict(zip(data_files(cfg["data"]), [shas] if isinstance(shas, str) else shas))
        if changed := [f for f in files if f in was and os.path.isfile(at(f)) and file_sha256(at(f)) != was[f]]:
            raise ValueError(f"{', '.join(changed)} changed since the run (its sha256 differs from config.json's "
                             "data_sha256): its held-out lines would name other records; restore the file")
    prompted = lambda r: "messages" in r or "prompt" in r or "pair" in r and "text" not in r["pair"][0]
    recs = [r for f in files for r in load_jsonl(at(f)) if prompted(r) and (not held or r["line"] in held[f])][:n]
    if not recs:
        raise ValueError(f"{' '.join(files)}{' (its held-out records)' * bool(held)} has no chat or prompt/completion "
                         "records (or preference pairs with a prompt) to prompt with")
    tok = load_tokenizer(cfg["model"])   # (training's: a multimodal checkpoint's processor template too)
    stop = [t for t in (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id) if t is not None]
    if cfg.get("chat_template_text"):   # the run's --chat-template, and the token that ends its turns
        from data.templates import end_of_turn
        tok.chat_template = cfg["chat_template_text"]
        stop += end_of_turn(tok)[1]
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(cfg["model"], local_files_only=True)
    wrapped = config.model_type in WRAPPERS   # (a multimodal wrapper, model/wrapper.py: its generation class, which
    # AutoModelForCausalLM lacks for Mistral 3; text prompts)
    if rope := trained_rope(run_dir):   # --rope-scaling: config.json with training's RoPE, as a merge writes it
        from model.rope_read import put_rope
        raw = type(config).get_config_dict(cfg["model"], local_files_only=True)[0]   # (config.json's dict)
        put_rope(raw["text_config"] if wrapped else raw, rope)
        config = type(config).from_dict({**raw, "model_type": config.model_type})   # (AutoConfig's class and type)
    auto = AutoModelForImageTextToText if wrapped else AutoModelForCausalLM
    model = auto.from_pretrained(cfg["model"], config=config, dtype=torch.float32, local_files_only=True)
    if cfg.get("quant", "nf4") == "nf4":
        nf4_round_trip(model)
    as_trained(model, cfg.get("quant", "nf4"))   # (after: its Linear layers are no float checkpoint's to round)
    model.eval()
    rows = []
    answer = lambda r: r["completion"].strip() if "prompt" in r else \
        next(m for m in r["messages"][::-1] if m["role"] == "assistant")["content"].strip()
    for rec in recs:
        rec, rejected = rec["pair"] if "pair" in rec else (rec, None)   # (a pair: its chosen side is expected)
        if "prompt" in rec:
            rows.append({"prompt": rec["prompt"], "expected": answer(rec)})
        else:
            msgs = rec["messages"]
            rows.append({"prompt": msgs[:max(i for i, m in enumerate(msgs) if m["role"] == "assistant")],
                         "expected": answer(rec)})
        if rejected:
            rows[-1]["rejected"] = answer(rejected)
        rows[-1]["tools"] = rec.get("tools")   # (what the template wrote in training)
    for r in rows:
        r["base"] = generate(model, tok, r["prompt"], max_new_tokens, stop, cfg.get("template_date"), r["tools"])
    tuned = PeftModel.from_pretrained(model, adapter)
    tuned.eval()
    for r in rows:
        r["tuned"] = generate(tuned, tok, r["prompt"], max_new_tokens, stop, cfg.get("template_date"), r["tools"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("run_dir", help="a run's --out directory (config.json, adapter/)")
    p.add_argument("--n", type=int, default=3, help="held-out prompts to show")
    p.add_argument("--max-new-tokens", type=int, default=40, help="greedy decoding length limit")
    p.add_argument("--check", action="store_true", help="exit 1 unless every tuned answer is the expected one")
    args = p.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1:
        p.error(f"--n {args.n} and --max-new-tokens {args.max_new_tokens} must both be at least 1")
    try:
        rows = compare(args.run_dir, args.n, args.max_new_tokens)
    except ValueError as e:   # (DataError too): what is wrong and the way out, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    rope = trained_rope(args.run_dir)
    print(f"before/after on {len(rows)} held-out prompts (greedy; transformers, then peft with "
          f"{os.path.join(args.run_dir, 'adapter')}" + (
              f"; both with the RoPE the run trained with, {rope}, not config.json's" if rope else "") + "):")
    for r in rows:
        ok = r["tuned"] == r["expected"]
        shown = r["prompt"][-200:] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
        rejected = f"  rejected: {r['rejected']}\n" if "rejected" in r else ""
        print(f"\n  prompt:   {shown}\n  expected: {r['expected']}\n{rejected}"
              f"  base:     {r['base']}\n  tuned:    {r['tuned']}   [{'right' if ok else 'wrong'}]")
    right = sum(r["tuned"] == r["expected"] for r in rows)
    print(f"\n{right}/{len(rows)} tuned answers right, {sum(r['base'] == r['expected'] for r in rows)} base answers")
    return 1 if args.check and right < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
