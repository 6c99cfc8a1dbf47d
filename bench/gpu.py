"""One-GPU benchmark, side by side in one invocation: this trainer vs HF + bitsandbytes + peft (+ Liger).

Per case it writes a random-init checkpoint from a config in bench/configs (bf16 safetensors, one
shard per decoder layer plus one for embeddings/norm/lm_head, so a case with fewer layers links the
shards it needs; a reduced layer count also cuts transformers' `layer_types`) with the demo
tokenizer, and a JSONL of random-token texts. Every run then trains on the same token ids, one
sample of --tokens tokens per step, NF4 base weights, LoRA r 16 / alpha 32 on all seven projections,
activation (gradient) checkpointing, AdamW, grad-norm clip 1.0:
- ours:  `train.py` (a subprocess; s/step and peak from its metrics.jsonl; `run_train`);
- hf:    transformers `from_pretrained` + BitsAndBytesConfig NF4 + peft + gradient checkpointing,
         `.train()` (from_pretrained returns eval mode, where HF skips checkpointing), SDPA;
- liger: the same model with `apply_liger_kernel_to_<model_type>` (fused linear cross-entropy,
         RMSNorm, SwiGLU, RoPE) applied after the hf row, in the same process (no second load).
liger-kernel is an optional benchmark-only dependency: when it is not importable the row is skipped
with the reason. Each run: 1 warm-up step, then the median of the timed steps; tokens/s; peak
allocated GB (ours and hf: the whole process, load included; liger: from its first step); the
tokens/s ratio of each run to each other run. Results go to bench/gpu-results.json after every run.

Cases (sized from an H200 run of 2026-11-30: each 32k row of ours ~45 s with its load, the two peers ~95 s, each
128k row ~50 s, the 28-layer checkpoint ~35 s; "all" ~430 s, inside the 8 minutes):
- 32k = 32,768 tokens, all layers: ours, hf, liger, and "ours+fastest": the memory flags parallel/plan_speed.py
  estimates fastest among those whose planned live peak is at most 0.97 x the liger row's measured peak (the
  planner's live peak measured 0.97-1.02 of the allocated one on the H200), e.g. --tiled-mlp --ac-keep-attn
  --ac-blocks 23 at 32k and --ac-keep-attn --ac-blocks 7 at 128k; the flags and why are in the row ("chosen");
  "ours+fastest+compile" (any case, with --runs) adds --compile; --cap-gb gives the cap without a liger row;
  "ours+dpo" (the fast case, or --runs): --objective dpo on pairs of two 16,384-token texts, rows as long as the
  others (its "vs ours" is what DPO's reference forward costs, ~0.8x by the FLOPs); "ours+orpo" the same pairs
  with --dpo-loss orpo, which has no reference forward (its "vs ours" is the per-sequence loss's own cost, ~1x);
  "ours+dpo-cached" --dpo-cache-ref on one of those pairs every step (the warm-up step keeps its reference, the
  timed steps read it, as a second epoch's do: against "ours+dpo", what the cache saves, ~1.25x by the FLOPs);
  "ours+dpo-prompt" and "ours+dpo-prompt-shared" DPO on pairs whose sides share a prompt of 7/8 of their tokens,
  without and with --dpo-share-prompt (the shared row processes ~9/16 of the tokens, its `step_tokens`; its
  tokens/s counts the pairs' unshared tokens, as the other's, so their ratio is what sharing saves);
- 128k = 131,072 tokens, 8 layers: the same rows (hf without Liger is skipped there: its [tokens, vocab] logits
  alone are 131,072 × 152,064 × 4 B = 80 GB; pass --runs to force); "all" is these two;
- mem = the 128k shape with the long-context memory flags, each one's tokens/s cost against plain "ours":
  --tiled-mlp, --offload-activations, --tiled-mlp --ac-group 4, --tiled-mlp --tiled-attn;
- fast = the 32k shape with each speed flag apart: --ac-keep-attn, --compile, --compile --tiled-mlp --ac-keep-attn,
  and "ours+fit-ac" (--ac-blocks N with the fewest checkpointed blocks the planner fits in 95% of this device),
  "ours+dpo", "ours+orpo", "ours+dpo-cached", "ours+dpo-prompt" and "ours+dpo-prompt-shared";
- long (one step takes minutes): 524,288 tokens, 8 layers, ours with --tiled-mlp --offload-activations and with
  --tiled-mlp --tiled-attn, one step each;
- dora = 32,768 tokens, 8 layers: ours, "ours+dora" (--dora), hf, and "hf+dora" (HF + bitsandbytes + peft's
  use_dora, its own process): what DoRA costs each, and ours against peft's at it.
- norms = 32,768 tokens, 8 layers: ours, "ours+norms" (--train-norms) and "ours+norms+emb" (with --train-embeddings):
  what training the RMSNorm weights, and the input embedding, costs.
- sft = 32,768 tokens, 8 layers: ours, "ours+neftune" (--neftune-alpha 5), "ours+dft" (--sft-loss dft), hf, and
  "hf+neftune" (the hf model with transformers' own NEFTune: the embedding forward hook Trainer registers for
  neftune_noise_alpha 5, its activate_neftune on the peft model, in train mode; after the hf row, in its process,
  and removed before a liger row): what NEFTune's hashed noise and DFT's weighting cost, and NEFTune against HF's.
Any row runs in any case with --runs; "ours+fast" (--runs only) is train.py --fast: the flags it picks for this
device (95% of it), read back from the run's config.json for the plan comparison.
Every "ours" row also prints its peak against the planner's for the same flags (on CUDA allocated bytes against the
planner's peak of live tensors, and the allocator's reserved peak against that x FRAGMENTATION; on CPU the RSS
against `train.py --plan`'s total, imports included) and its first step's peak per phase (`train.py --mem-phases`:
forward, loss, the last block's MLP, o_proj, attention and q/k/v backward, the rest), which says which planner term a
mismatch is in.
--budget caps the wall time (default 470 s, inside 8 minutes with checkpoint writing): a run that
would cross it is cut and reported as such. Without CUDA (or with --smoke) a tiny configuration runs
in seconds on CPU (float32, no quantization: bitsandbytes NF4 and Liger need CUDA), which
tests/test_bench_gpu.py runs so this script cannot rot.

Run: make bench-gpu                       (all cases; on a GPU machine: PYTHONPATH=/tmp/site:. make bench-gpu)
     python bench/gpu.py --case 128k --runs ours,liger
     python bench/gpu.py --smoke          (CPU, seconds)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from parallel.alloc import default_allocator

default_allocator()   # every row (ours, and the peers in their subprocess) with train.py's allocator setting

import torch

CASES = {"32k": (32768, None), "128k": (131072, 8), "mem": (131072, 8), "fast": (32768, None),
         "long": (524288, 8), "dora": (32768, 8), "norms": (32768, 8), "sft": (32768, 8)}   # tokens, layers (None: all)
NEFTUNE_ALPHA = 5   # "ours+neftune"'s --neftune-alpha and "hf+neftune"'s neftune_noise_alpha (the paper's usual 5)
# our runs with other flags: selective AC (--ac-keep-attn, a speed flag), the long-context memory flags (what
# each costs in tokens/s at 128k), and the long case
FLAG_ROWS = {"ours+keep-attn": ["--ac-keep-attn"], "ours+tiled+keep-attn": ["--tiled-mlp", "--ac-keep-attn"],
             "ours+tiled": ["--tiled-mlp"], "ours+offload": ["--offload-activations"],
            "ours+tiled+group4": ["--tiled-mlp", "--ac-group", "4"],
            "ours+tiled+offload": ["--tiled-mlp", "--offload-activations"],
            "ours+tiled-attn": ["--tiled-mlp", "--tiled-attn"],
            "ours+tiled-attn+offload": ["--tiled-mlp", "--tiled-attn", "--offload-activations"],
            "ours+compile": ["--compile"],
            "ours+compile+tiled+keep-attn": ["--compile", "--tiled-mlp", "--ac-keep-attn"],
            "ours+fast": ["--fast"],   # what train.py --fast picks for this device (its config.json says which)
            "ours+dpo": ["--objective", "dpo"],   # DPO on pairs of two tokens/2 texts: the same tokens a row as "ours"
            "ours+orpo": ["--objective", "dpo", "--dpo-loss", "orpo"],   # the same pairs, no reference forward
            # --dpo-cache-ref on one of those pairs, every step: the warm-up step computes and keeps its reference,
            # the timed ones read it (as a second epoch's steps): what the cache saves, against "ours+dpo"
            "ours+dpo-cached": ["--objective", "dpo", "--dpo-cache-ref"],
            # DPO on pairs whose sides share a prompt of 7/8 of their tokens (write_prompt_pairs), as they come and
            # with --dpo-share-prompt (the prompt once): what sharing saves, s/step against s/step
            "ours+dpo-prompt": ["--objective", "dpo"],
            "ours+dpo-prompt-shared": ["--objective", "dpo", "--dpo-share-prompt"],
            "ours+dora": ["--dora"],   # DoRA, against "hf+dora": HF + bitsandbytes + peft's use_dora
            "ours+norms": ["--train-norms"],   # the RMSNorm weights trained too: what they cost
            "ours+norms+emb": ["--train-norms", "--train-embeddings"],   # and the input embedding (LongLoRA's)
            # the SFT options: NEFTune's noise (~20 int64 passes over [tokens, hidden]) against "hf+neftune", and
            # DFT's [c, 1] weighting in the fused loss
            "ours+neftune": ["--neftune-alpha", str(NEFTUNE_ALPHA)], "ours+dft": ["--sft-loss", "dft"]}
# rows of HF's model (bench's --peer process), in the order one process runs them: hf+neftune hooks the hf model's
# embeddings and unhooks them before liger (whose patch stays); hf+dora loads its own
PEERS = ("hf", "hf+neftune", "liger", "hf+dora")
ROW_DATA = {"ours+dpo-prompt": "prompt_pairs", "ours+dpo-prompt-shared": "prompt_pairs",   # else DPO rows: "pairs"
            "ours+dpo-cached": "one_pair"}
# "ours+fit-ac": --ac-blocks N with the planner's fewest N that fit this device (train.py --plan's "faster:")
FIT_AC = "ours+fit-ac"
# "ours+fastest": the memory flags parallel.plan_speed ranks fastest among those whose planned live peak is at most
# LIGER_MARGIN x the liger row's measured peak in the same case (at most 95% of the device without one)
FASTEST, LIGER_MARGIN = "ours+fastest", 0.97   # the planner's live peak measured 0.97-1.021 of the real one on the H200
FASTEST_COMPILE = "ours+fastest+compile"        # the same flags with --compile
DEFAULT_RUNS = {"32k": ["ours", "hf", "liger", FASTEST],
                "128k": ["ours", "hf", "liger", FASTEST],
                "mem": ["ours", "ours+tiled", "ours+offload", "ours+tiled+group4", "ours+tiled-attn"],
                "fast": ["ours", "ours+keep-attn", "ours+compile", "ours+compile+tiled+keep-attn", FIT_AC, "ours+dpo",
                         "ours+orpo", "ours+dpo-cached", "ours+dpo-prompt", "ours+dpo-prompt-shared"],
                "long": ["ours+tiled+offload", "ours+tiled-attn"],
                "dora": ["ours", "ours+dora", "hf", "hf+dora"],
                "norms": ["ours", "ours+norms", "ours+norms+emb"],
                "sft": ["ours", "ours+neftune", "ours+dft", "hf", "hf+neftune"]}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOKE_DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2048)
# the smoke mode's rows (CPU, tests/test_bench_gpu.py): those whose bench-side logic differs (the peers and NEFTune's
# hook in their process, the fit-ac and fastest searches, a row's flags against its plan, the DPO data: pairs, one pair,
# pairs sharing a prompt); a row that only passes train.py a flag (orpo, dora, norms, neftune, dft, tiled-attn) runs
# with --runs, and its flags meet train.py's start-up checks in the test
SMOKE_RUNS = ["ours", "hf", "liger", FIT_AC, FASTEST, "ours+tiled+offload", "ours+dpo", "ours+dpo-cached",
              "ours+dpo-prompt", "ours+dpo-prompt-shared", "hf+neftune"]
HF_128K_REASON = "HF without Liger materializes [tokens, vocab] logits (80 GB fp32 at 128k); --runs to force"


# ----------------------------------------------------------------------------- checkpoint + data

def cut_layers(cfg: dict, layers: int) -> dict:
    """The config with its first `layers` decoder layers: num_hidden_layers, and transformers'
    per-layer lists (`layer_types`) cut to match, or loading refuses the mismatch."""
    cfg = dict(cfg, num_hidden_layers=layers)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    return cfg


_SHAPES: dict = {}   # repr(ModelArgs) -> {parameter name: shape} (a tied head: not listed)


def _tensors(margs, layer, gen, dtype, device):
    """HF-named random tensors of one decoder layer (layer >= 0) or of the non-layer weights (-1): the names and shapes
    of our own decoder's parameters (built on the meta device: whatever norms, biases and q/k norms the architecture
    has, Gemma's and OLMo's included), a norm's weight its identity (0 where it is an offset from 1, else 1), biases 0,
    Gemma 4's layer_scalar 1, the rest N(0, 0.02)."""
    from model.llama import Transformer

    if (shapes := _SHAPES.get(repr(margs))) is None:   # (once per config, not per layer)
        with torch.device("meta"):
            shapes = _SHAPES[repr(margs)] = {n: tuple(p.shape) for n, p in Transformer(margs).named_parameters()}
    p = f"model.layers.{layer}."
    mine = {n: s for n, s in shapes.items() if n.startswith(p)} if layer >= 0 else {
        n: s for n, s in shapes.items() if not n.startswith("model.layers.")}
    ident = 0.0 if margs.norm_offset == 1.0 else 1.0
    out = {}
    for n, s in mine.items():
        if n.endswith(("norm.weight", ".bias", "layer_scalar")):   # (Gemma 4's layer_scalar: 1, transformers' init)
            out[n] = torch.full(s, 0.0 if n.endswith(".bias") else 1.0 if n.endswith("layer_scalar") else ident,
                                dtype=dtype)
        else:
            out[n] = (torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return out


def write_checkpoint(base_cfg: dict, layers: int, tokens: int, work: str, smoke: bool) -> str:
    """Random-init checkpoint dir for `layers` layers; shards are shared between cases (cached)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from data.demo import demo_tokenizer
    from model.config import ModelArgs

    cfg = dict(base_cfg, **(SMOKE_DIMS if smoke else {}))
    dtype = torch.float32 if smoke else torch.bfloat16
    cfg.update(torch_dtype=str(dtype).split(".")[1], use_cache=False,
               max_position_embeddings=max(cfg.get("max_position_embeddings", 0), tokens))
    cfg.pop("dtype", None)
    os.makedirs(work, exist_ok=True)   # the demo's tokenizer, without its pretrained model (data.demo)
    tok = AutoTokenizer.from_pretrained(str(demo_tokenizer(os.path.join(work, "tokenizer"))), local_files_only=True)
    cfg.update(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    margs = ModelArgs.from_config_dict(cut_layers(cfg, layers))   # (Gemma 4's last layer is full whatever its type)
    shards = os.path.join(work, "shards")
    os.makedirs(shards, exist_ok=True)
    stamp_path = os.path.join(shards, "stamp.json")
    # what the shards' tensors depend on: not the layer count, nor the case's length (the long case, then 128k, kept
    # rewriting every shard of a warm machine's second call)
    stamp = {k: v for k, v in cfg.items()
             if k not in ("num_hidden_layers", "layer_types", "max_window_layers", "max_position_embeddings")}
    old = json.load(open(stamp_path)) if os.path.isfile(stamp_path) else None
    if old != stamp:   # another config: every shard is stale
        for f in os.listdir(shards):
            os.remove(os.path.join(shards, f))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for layer in [-1, *range(layers)]:
        kind = f"-{margs.layer_types[layer].split('_')[0]}" if layer >= 0 and margs.per_layer_attn else ""   # (Gemma
        # 4: a layer's shapes are its type's, and a cut's last layer is full: one shard per index and type)
        name = "rest.safetensors" if layer < 0 else f"layer-{layer:03d}{kind}.safetensors"
        path = os.path.join(shards, name)
        tensors = _tensors(margs, layer, gen, dtype, device)
        if not os.path.isfile(path):
            tmp = path + ".tmp"
            save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
            os.replace(tmp, path)
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    if device == "cuda":   # the runs are other processes: leave them the memory
        torch.cuda.empty_cache()
    ckpt = os.path.join(work, f"ckpt-{layers}l")
    os.makedirs(ckpt, exist_ok=True)
    for name in set(weight_map.values()):
        link = os.path.join(ckpt, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "shards", name), link)
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cut_layers(cfg, layers), f, indent=1)
    tok.save_pretrained(ckpt)
    return ckpt


def write_data(ckpt: str, tokens: int, n: int, path: str) -> list[list[int]]:
    """`n` texts of random tokens, each at least `tokens` long after re-encoding; returns the ids
    every run trains on (the trainer's own tokenization truncated to `tokens`)."""
    from data import load_jsonl, load_tokenizer, tokenize_records

    tok = load_tokenizer(ckpt)
    g = torch.Generator().manual_seed(1)
    lo, hi = len(tok.all_special_ids) + 1, len(tok)
    with open(path, "w") as f:
        for _ in range(n):
            text = ""
            while len(tok(text, add_special_tokens=False)["input_ids"]) < tokens:
                text += tok.decode(torch.randint(lo, hi, (tokens // 4 + 64,), generator=g).tolist())
            f.write(json.dumps({"text": text}) + "\n")
    samples, _ = tokenize_records(load_jsonl(path), tok, tokens, path, long_text="truncate")
    ids = [s["input_ids"] for s in samples]
    assert len(ids) == n and all(len(x) == tokens for x in ids), [len(x) for x in ids]
    return ids


def write_pairs(ckpt: str, tokens: int, n: int, path: str) -> None:
    """`n` preference pairs {"chosen", "rejected"} of two random texts of `tokens` tokens each (write_data's), which
    differ from their first token: DPO rows as long as the supervised rows of 2 × `tokens`."""
    write_data(ckpt, tokens, 2 * n, path + ".texts")
    texts = [json.loads(line)["text"] for line in open(path + ".texts")]
    with open(path, "w") as f:
        f.writelines(json.dumps({"chosen": a, "rejected": b}) + "\n" for a, b in zip(texts[0::2], texts[1::2]))


def write_prompt_pairs(ckpt: str, tokens: int, n: int, path: str) -> None:
    """`n` pairs {"prompt", "chosen", "rejected"} of about `tokens` tokens a side: a random text's first 7/8 the
    prompt, its rest the chosen answer, another text's rest the rejected one."""
    from data import load_tokenizer

    write_data(ckpt, tokens, 2 * n, path + ".texts")
    tok = load_tokenizer(ckpt)
    ids = [tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"][:tokens]
           for line in open(path + ".texts")]
    cut = tokens * 7 // 8
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": tok.decode(a[:cut]), "chosen": tok.decode(a[cut:]),
                                 "rejected": tok.decode(b[cut:])}) + "\n" for a, b in zip(ids[0::2], ids[1::2]))


# ----------------------------------------------------------------------------- runs

def peak_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def ours_argv(spec: dict, out: str, flags=()) -> list[str]:
    return ["--model", spec["ckpt"], "--data", spec["data"], "--max-len", str(spec["tokens"]), "--global-batch",
            "1", "--steps", str(spec["steps"]), "--quant", spec["quant"], "--dtype", spec["dtype"], "--lora-r", "16",
            "--lora-alpha", "32", "--lr", "2e-4", "--warmup", "1", "--out", out, "--no-progress", "--mem-phases",
            "--long-text", "truncate",   # one sample per record, `tokens` long (write_data): the peers' tokens
            *(["--mem-trace"] if spec.get("mem_trace") else []), *flags]


def planned_gb(spec: dict, flags=()) -> tuple[float, float]:
    """The planner's (peak of live tensors, device total) for this run: the first is what CUDA's
    max_memory_allocated measures; the second is train.py --plan's number (x FRAGMENTATION + runtime), the one
    a CPU's RSS (imports included) is compared with."""
    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(ours_argv(spec, "unused", flags))
    margs = read_args(spec["ckpt"])
    dims, pack = validate(args, margs, 1)
    plan = memory_plan(margs, dims, args, "cuda" if torch.cuda.is_available() else "cpu", pack)
    return plan.peak / 1e9, plan.total / 1e9


def planner_inputs(spec: dict, extra=()):
    """(args, margs, dims, pack, target, mem): the planner's view of our run on this device, one process."""
    import train
    from model.load import read_args
    from parallel.mesh import validate
    from parallel.plan_search import _budget

    args = train.build_parser().parse_args(ours_argv(spec, "unused", extra))
    args.gpu_mem = None   # (the planner's own flag: this device's memory)
    margs = read_args(spec["ckpt"])
    dims, pack = validate(args, margs, 1)
    target, mem, _ = _budget(args, 1)
    return args, margs, dims, pack, target, mem


def fit_ac_flags(spec: dict) -> list[str] | None:
    """--ac-blocks N for the fewest checkpointed blocks the planner fits in 95% of this device (None: only all)."""
    from parallel.plan_search import fewest_ac_blocks

    args, margs, dims, pack, target, mem = planner_inputs(spec)
    found = fewest_ac_blocks(args, margs, dims, target, mem, float("inf"), pack)
    return None if found is None else ["--ac-blocks", str(found[0])]


def fastest_flags(spec: dict, liger_gb: float | None, source: str = "liger's",
                  extra: tuple = ()) -> tuple[list[str], str]:
    """(flags, why) of the "ours+fastest" rows: parallel.plan_speed's fastest memory flags whose planned live peak
    fits LIGER_MARGIN x the liger row's measured peak (allocated; `source` names where it came from: --cap-gb
    carries one from an earlier run) and whose planned total fits 95% of the device, or, without a peak, the
    latter alone. `extra` (e.g. --compile) joins the run's flags before the search, so its start-up checks
    filter the candidates."""
    from parallel.plan_search import SAFETY
    from parallel.plan_speed import fastest
    from parallel.plan_totals import GB

    args, margs, dims, pack, target, mem = planner_inputs(spec, extra)
    if liger_gb:   # and the device: a cap above it must not pick flags that cannot run here
        cap, key = LIGER_MARGIN * liger_gb * GB, (lambda p: p.peak if p.total <= SAFETY * mem else float("inf"))
        why = f"live peak <= {LIGER_MARGIN} x {source} {liger_gb:.2f} GB"
    else:
        cap, key, why = SAFETY * mem, None, f"planned total <= 95% of the device ({source})"
    found = fastest(args, margs, dims, target, cap, float("inf"), pack, key)
    if not found:
        raise RuntimeError(f"no flag set fits {cap / GB:.1f} GB ({why})")
    flags, plan, est = found[0]
    return flags.split(), f"{why}: {plan.peak / GB:.2f} GB live planned, est. {est:.2f} s/step at H200 rates"


def run_order(mine: list[str], peers: list[str]) -> list[list[str]]:
    """Plain "ours" first, then the peers in one group (one load; Liger's peak is the fastest rows' cap), then every
    other row of ours."""
    one = [p for p in peers if p != "hf+dora"]   # (hf+dora: another peft model, its own process)
    return [["ours"]] * ("ours" in mine) + [one] * bool(one) + [["hf+dora"]] * ("hf+dora" in peers) + [
        [r] for r in mine if r != "ours"]


# what a forked row would import again in each child otherwise (train.main imports these lazily: ~2.5 s of a core a
# row); model.bnb before peft, which imports bitsandbytes (model/bnb.py)
FORK_PRELOAD = ["train", "model.bnb", "peft", "data", "transformers.models.auto.tokenization_auto"]


def _train_cli(argv: list[str], log: str | None = None, env: dict | None = None):
    """A forked row's body: what `python train.py ARGV` runs, its exit code the process's; with `log`, its output
    goes to that file. `env`: the caller's environment at the call, as a fresh interpreter gets it (a forkserver's is
    that of its own start)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import train
    sys.exit(train.cli(argv))


def run_train(argv: list[str], timeout: float | None, fork: bool = False, log: str | None = None) -> None:
    """train.py with `argv`, a process of its own (CalledProcessError on a non-zero exit, TimeoutExpired past
    `timeout`): a fresh interpreter, or with `fork` (without CUDA: the smoke mode's rows after "ours",
    bench/micro_batch.py's runs) a child of a forkserver that imported train and FORK_PRELOAD once: a fresh interpreter
    spends ~4 s of a core importing torch, transformers and peft, most of a tiny row's time. Where CUDA is, every row
    is a fresh interpreter (its own context and peak). `log` (fork only): the child's output goes to that file."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *argv]
    if not fork:
        subprocess.run(cmd, check=True, timeout=timeout, cwd=ROOT)
        return
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_PRELOAD)
    p = ctx.Process(target=_train_cli, args=(list(argv), log, dict(os.environ)))
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise subprocess.TimeoutExpired(cmd, timeout)
    if p.exitcode:
        raise subprocess.CalledProcessError(p.exitcode, cmd)


def run_ours(spec: dict, out: str, timeout: float, flags=(), profile=False, pairs: str = "pairs",
             fork: bool = False) -> dict:
    """One train.py run (`run_train`; `fork`: the smoke mode's); with `profile`, one more step at the end under
    `--profile` (not timed: the profiler slows it), whose time by kernel category is kept (OUT/profile.txt's head)
    and printed. `pairs`: the spec's file a DPO row trains on."""
    if "--objective" in flags:   # a DPO row: pairs of two texts of half the tokens (write_pairs), so a row as long
        spec = dict(spec, data=spec[pairs], tokens=spec["tokens"] // 2)   # (--max-len is per side)
    extra = ["--steps", str(spec["steps"] + 1), "--profile", str(spec["steps"] + 1),
             "--schedule-steps", str(spec["steps"])] if profile else []   # the timed steps' lr as without it
    run_train([*ours_argv(spec, out, flags), *extra], timeout, fork)
    if "--fast" in flags:   # the flags the run chose, as typed: the plan below and the table need them
        chosen = json.load(open(os.path.join(out, "config.json")))["fast_flags"]
        flags = [f for f in flags if f != "--fast"] + chosen.split()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if not r.get("profiled")]
    times = [r.get("step_time_s") or r["tokens"] / r["tokens_per_s"] for r in rows]
    peak = max(r["peak_mem_gb"] for r in rows)
    live, total = planned_gb(spec, flags)
    cuda = torch.cuda.is_available()
    plan = live if cuda else total   # like with like: allocated bytes vs live tensors; RSS vs the total
    with open(os.path.join(out, "mem_phases.json")) as f:   # step 1's peak per phase (train.py --mem-phases)
        phases = json.load(f)
    res = dict(times=times, peak_gb=peak, loss=rows[-1]["loss"], planned_gb=plan, peak_vs_plan=peak / plan,
               plan_basis="live tensors" if cuda else "total", planned_total_gb=total,
               flags=list(flags), mem_phases=phases["ranks"][0] or phases["why"],
               step_tokens=rows[-1]["tokens"])   # (what a step processed: fewer with --dpo-share-prompt)
    if cuda:   # the allocator's reserved high-water mark against the planner's live peak x FRAGMENTATION
        from parallel.plan_totals import FRAGMENTATION
        res.update(reserved_gb=max(r["peak_reserved_gb"] for r in rows), planned_reserved_gb=live * FRAGMENTATION)
    if profile:
        res["profile"] = os.path.join(out, "profile.txt")
        with open(res["profile"]) as f:   # the wall time, the busy time and its categories
            res["profile_head"] = f.read().split("\n\ntop ")[0]
    return res


def peer_main(spec_path: str):
    """HF + bnb + peft (+ Liger) in this process; writes {row: result} next to the spec."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = json.load(open(spec_path))
    ids = json.load(open(spec["ids"]))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    kw = dict(dtype=torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32, attn_implementation="sdpa")
    if spec["quant"] == "nf4":
        kw.update(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=torch.bfloat16),
                  device_map={"": 0})
    model = AutoModelForCausalLM.from_pretrained(spec["ckpt"], **kw)
    if spec["quant"] != "nf4":
        model.to(device)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM", use_dora=spec["rows"] == ["hf+dora"]))
    model.train()   # from_pretrained returns eval mode, where HF skips gradient checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    results = {}
    probe = torch.tensor([ids[0][:8]], device=device)   # (a few tokens: does the embedding add noise in this row)
    for row in spec["rows"]:
        # transformers' NEFTune as Trainer turns it on for neftune_noise_alpha: its forward hook on the peft model's
        # input embeddings (noise in train mode only; the model is in it)
        hook = None
        if row == "hf+neftune":   # (imported here: a transformers without it fails this row, not hf's and liger's)
            from transformers.integrations.neftune import activate_neftune
            hook = activate_neftune(model, NEFTUNE_ALPHA)
        if row == "liger":
            import liger_kernel.transformers as lk
            base = model.get_base_model()
            getattr(lk, f"apply_liger_kernel_to_{base.config.model_type}")(model=base)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        opt = torch.optim.AdamW(params, lr=2e-4)
        times, loss = [], None
        for step in range(spec["steps"]):
            x = torch.tensor([ids[step % len(ids)]], device=device)
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = loss.item()   # waits for the device
            times.append(time.perf_counter() - t0)
        results[row] = dict(times=times, peak_gb=peak_gb(device), loss=loss)
        with torch.no_grad():   # (two lookups of the same tokens differ only under the noise)
            emb = model.get_input_embeddings()
            results[row]["embedding_noise"] = not torch.equal(emb(probe), emb(probe))
        if hook is not None:   # (the rows after it, liger's, without the noise)
            from transformers.integrations.neftune import deactivate_neftune
            deactivate_neftune(model, hook)
        if cuda:   # the allocator's high-water mark too, as for our rows (what an out-of-memory error meets)
            results[row]["reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
        del opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        json.dump(results, open(spec["result"], "w"))


def run_peers(spec: dict, rows: list[str], work: str, timeout: float) -> dict:
    """The peer rows in one subprocess; rows it did not finish carry the error."""
    spec = dict(spec, rows=rows, ids=os.path.join(work, "ids.json"), result=os.path.join(work, "peer-result.json"))
    json.dump(spec.pop("ids_list"), open(spec["ids"], "w"))
    path = os.path.join(work, "peer-spec.json")
    json.dump(spec, open(path, "w"))
    if os.path.exists(spec["result"]):
        os.remove(spec["result"])
    error = "did not run"
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--peer", path], check=True, timeout=timeout,
                       cwd=ROOT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        error = f"{type(e).__name__} (see the log above): {e}"
    done = json.load(open(spec["result"])) if os.path.exists(spec["result"]) else {}
    return {r: done.get(r, {"error": error}) for r in rows}


def liger_missing() -> str | None:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not importable ({e}); it is an optional benchmark-only dependency"
    return None if torch.cuda.is_available() else "Liger's Triton kernels need CUDA"


# ----------------------------------------------------------------------------- main

def summarize(rows: dict, warmup: int, tokens: int) -> None:
    done = {n: r for n, r in rows.items() if "times" in r}
    for r in done.values():
        timed = r["times"][warmup:] or r["times"]
        r["s_per_step"] = statistics.median(timed)
        r["tokens_per_s"] = tokens / r["s_per_step"]
    for n, r in done.items():
        r["ratio"] = {p: r["tokens_per_s"] / q["tokens_per_s"] for p, q in done.items() if p != n}


def print_case(name: str, case: dict) -> None:
    rows = case["rows"]
    peers = [n for n in rows if "tokens_per_s" in rows[n]]
    print(f"\ncase {name}: {case['tokens']:,} tokens, {case['layers']} layers, {case['quant']}, {case['dtype']}, "
          f"{case['warmup']} warm-up + {case['steps'] - case['warmup']} timed steps; ours uses attention "
          f"{case['attention']}", flush=True)
    print("| run | s/step | tokens/s | peak alloc GB | peak reserved GB | "
          + " | ".join(f"vs {p}" for p in peers) + " |")
    print("|---|---|---|---|---|" + "---|" * len(peers))
    for n, r in rows.items():
        if "tokens_per_s" not in r:
            print(f"| {n} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + str(r.get('error'))} |")
            continue
        ratios = " | ".join("" if p == n else f"{r['ratio'][p]:.2f}x" for p in peers)
        res = f"{r['reserved_gb']:.1f}" if "reserved_gb" in r else "-"   # (footnote below)
        print(f"| {n} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_gb']:.1f} | {res} | {ratios} |",
              flush=True)
    if any("reserved_gb" in r for r in rows.values()):
        print("(peak reserved: our rows over the whole run, load included; the peers per row, after empty_cache)")
    for n, r in rows.items():
        if "planned_gb" in r:
            print(f"{' '.join([n, *r['flags']])}: peak {r['peak_gb']:.2f} GB vs planned {r['planned_gb']:.2f} GB "
                  f"({r['plan_basis']}; measured / planned {r['peak_vs_plan']:.3f}; --plan's total "
                  f"{r['planned_total_gb']:.2f} GB)", flush=True)
            if "reserved_gb" in r:
                print(f"  reserved {r['reserved_gb']:.2f} GB vs planned live x fragmentation "
                      f"{r['planned_reserved_gb']:.2f} GB ({r['reserved_gb'] / r['planned_reserved_gb']:.3f})")
            if r.get("profile_head"):
                print(f"  profile ({r['profile']}): " + r["profile_head"].replace("\n", "\n  "), flush=True)
            ph = r.get("mem_phases")
            print("  step 1 peak per phase (GB): " + (", ".join(f"{k} {v}" for k, v in ph) if isinstance(ph, list)
                                                       else str(ph)), flush=True)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("transformers", "peft", "bitsandbytes", "liger-kernel", "flash-attn"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if torch.cuda.is_available():
        out["cuda"], out["cudnn"] = torch.version.cuda, torch.backends.cudnn.version()
    out["alloc_conf"] = {k: os.environ[k] for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if k in os.environ}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="all", choices=[*CASES, "all"],
                    help="which case(s) to run (all: 32k and 128k; mem: 128k with the memory flags; fast: 32k with "
                    "the speed flags that spend memory; long: 512k tokens, ours with the memory flags; dora: "
                    "--dora against peft's DoRA; norms: --train-norms' cost; sft: --neftune-alpha against HF's "
                    "NEFTune, and --sft-loss dft)")
    ap.add_argument("--config", default=os.path.join(ROOT, "bench", "configs", "qwen2.5-7b"), help="config dir")
    ap.add_argument("--tokens", type=int, default=None, help="override the case's tokens per step")
    ap.add_argument("--layers", type=int, default=None, help="override the case's layer count")
    ap.add_argument("--runs", default=None, help="comma list of ours,hf,liger," + ",".join(
                    [FIT_AC, FASTEST, FASTEST_COMPILE, *FLAG_ROWS])
                    + " (default per case: DEFAULT_RUNS; smoke: SMOKE_RUNS)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--timed", type=int, default=None, help="timed steps (default 3 at 32k, 2 at 128k)")
    ap.add_argument("--budget", type=float, default=470.0, help="wall-clock cap in seconds for the whole script")
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-gpu"), help="checkpoints and run dirs")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "gpu-results.json"), help="results JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU-sized configuration (forced without CUDA)")
    ap.add_argument("--profile", nargs="?", const="ours", default="", metavar="ROWS",
                    help="these of our rows (comma list; bare: ours) run one more step under train.py --profile "
                    "(untimed): its time by kernel category, printed and in the results")
    ap.add_argument("--cap-gb", type=float, default=None, help="the ours+fastest rows' memory cap: a Liger peak (GB) "
                    "from an earlier run, instead of this run's liger row")
    ap.add_argument("--mem-trace", action="store_true", help="our rows run train.py --mem-trace: what is alive at "
                    "step 1's peak, by the line that allocated it, in the log (CUDA; step 1 is slowed slightly)")
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)   # internal: run the HF peers of a spec
    args = ap.parse_args(argv)
    if args.peer:
        return peer_main(args.peer)
    if args.cap_gb is not None and (args.cap_gb <= 0 or args.case == "all"):
        ap.error(f"--cap-gb {args.cap_gb}: give a positive Liger peak in GB for one --case (each case has its own)")
    t_start = time.time()
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if smoke:
        print("smoke mode: " + ("--smoke" if cuda else "no CUDA") + ": tiny config, CPU, float32, no quantization",
              flush=True)
    from model.config import ModelArgs
    from parallel import kernel_choice
    base_cfg = json.load(open(os.path.join(args.config, "config.json")))
    cases = ["32k", "128k"] if args.case == "all" else [args.case]
    if smoke:
        cases = ["32k"]
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": smoke,
               "device": torch.cuda.get_device_name() if cuda and not smoke else "cpu",
               "config": os.path.basename(os.path.normpath(args.config)), "versions": versions(), "cases": {}}
    for name in cases:
        tokens, layers = CASES[name]
        tokens = args.tokens or (128 if smoke else tokens)
        layers = args.layers or (2 if smoke else (layers or base_cfg["num_hidden_layers"]))
        timed = args.timed or (1 if name == "long" and not smoke else 2 if smoke or tokens > 65536 else 3)
        warmup = 0 if name == "long" and not smoke else args.warmup   # one step is the long case
        steps = warmup + timed
        runs = args.runs.split(",") if args.runs else SMOKE_RUNS if smoke else DEFAULT_RUNS[name]
        work = os.path.join(args.work, name)
        os.makedirs(work, exist_ok=True)
        ckpt = write_checkpoint(base_cfg, layers, tokens, args.work, smoke)
        data = os.path.join(work, "data.jsonl")
        ids = write_data(ckpt, tokens, steps, data)
        pairs = os.path.join(work, "pairs.jsonl")
        if any("--objective" in FLAG_ROWS.get(r, ()) and ROW_DATA.get(r) != "prompt_pairs" for r in runs):
            write_pairs(ckpt, tokens // 2, steps, pairs)
        one_pair = os.path.join(work, "one_pair.jsonl")   # (its first pair alone: "ours+dpo-cached")
        if os.path.exists(pairs):
            with open(pairs) as f, open(one_pair, "w") as g:
                g.write(f.readline())
        prompt_pairs = os.path.join(work, "prompt_pairs.jsonl")
        if any(ROW_DATA.get(r) == "prompt_pairs" for r in runs):
            write_prompt_pairs(ckpt, tokens // 2, steps, prompt_pairs)
        margs = ModelArgs.from_config_dict(json.load(open(os.path.join(ckpt, "config.json"))))
        quant, dtype = ("none", "fp32") if smoke else ("nf4", "bf16")
        attention = kernel_choice.backend_order(
            "cuda" if not smoke else "cpu", torch.bfloat16 if not smoke else torch.float32, margs.head_dim,
            tokens, tokens, torch.cuda.get_device_capability() if cuda and not smoke else (0, 0),
            cuda and not smoke and kernel_choice._cudnn_usable(), kernel_choice._fa is not None)[0]
        case = dict(tokens=tokens, layers=layers, quant=quant, dtype=dtype, warmup=warmup, steps=steps,
                    attention=attention, rows={})
        results["cases"][name] = case
        print(f"case {name}: checkpoint and data ready after {time.time() - t_start:.0f}s", flush=True)
        spec = dict(ckpt=ckpt, data=data, tokens=tokens, steps=steps, quant=quant, dtype=dtype, ids_list=ids,
                    mem_trace=args.mem_trace, pairs=pairs, prompt_pairs=prompt_pairs, one_pair=one_pair)
        rows = case["rows"]
        mine_all = ("ours", FIT_AC, FASTEST, FASTEST_COMPILE, *FLAG_ROWS)
        unknown = [r for r in runs if r not in (*PEERS, *mine_all)]
        if unknown:
            raise SystemExit(f"--runs: unknown {unknown}; choose from {','.join(PEERS)},{','.join(mine_all)}")
        rows.update({r: {} for r in ("ours", *PEERS, *mine_all[1:]) if r in runs})   # table order
        why_liger = liger_missing()
        peers = []
        for row in ("ours", *PEERS):
            if row not in runs:
                continue
            if row.startswith("hf") and tokens > 65536 and not args.runs:   # (every HF row: the logits)
                rows[row] = {"skipped": HF_128K_REASON}
            elif row == "liger" and why_liger:
                rows[row] = {"skipped": why_liger}
                print(f"liger row skipped: {why_liger}", flush=True)
            elif row != "ours":
                peers.append(row)
        for group in run_order([r for r in mine_all if r in runs], peers):
            left = args.budget - (time.time() - t_start)
            if left < 10:
                rows.update({r: {"skipped": f"time budget of {args.budget:.0f}s spent"} for r in group})
            elif group[0] in mine_all:
                why = None
                try:
                    if group[0] in (FASTEST, FASTEST_COMPILE):
                        liger = rows.get("liger", {})
                        cap, source = (args.cap_gb, "--cap-gb") if args.cap_gb is not None else (
                            liger.get("peak_gb"), "liger's" if "peak_gb" in liger else
                            "the liger row has no peak: " + str(liger.get("skipped", liger.get("error", "not run"))))
                        extra = ["--compile"] * (group[0] == FASTEST_COMPILE)
                        flags, why = fastest_flags(spec, cap, source, extra)
                        flags += extra
                        print(f"{group[0]}: {' '.join(flags) or '(no flags)'} ({why})", flush=True)
                    else:
                        flags = fit_ac_flags(spec) if group[0] == FIT_AC else FLAG_ROWS.get(group[0], [])
                    rows[group[0]] = {"skipped": "only AC on every block fits 95% of this device (the plain row)"} \
                        if flags is None else run_ours(spec, os.path.join(work, f"ours-{time.time_ns()}"), left, flags,
                                                        group[0] in args.profile.split(","),
                                                        ROW_DATA.get(group[0], "pairs"),
                                                        fork=not cuda and group[0] != "ours")   # (run_train)
                    if why:
                        rows[group[0]]["chosen"] = why
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError, ValueError,
                        OSError) as e:   # the row's error is kept and printed; the other rows still run
                    rows[group[0]] = {"error": f"{type(e).__name__} (see the log above): {e}"}
            else:
                rows.update(run_peers(spec, group, work, left))
            summarize(rows, warmup, tokens)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        print_case(name, case)
    results["wall_s"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out} after {results['wall_s']:.0f}s", flush=True)
    return results


if __name__ == "__main__":
    main()
    gc.freeze()   # (its results written: skip the exit-time collections over torch's objects, as train.py does)
