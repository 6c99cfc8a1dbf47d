"""The memory planner against measurement: real 2-step training runs on CPU ranks, planned vs measured peak.

For each configuration (cp 1, 2, 4; Ulysses, ring, hybrid; nf4 and none; AC on and off; --tiled-mlp,
--offload-activations, --ac-group, --ac-blocks, --ac-keep-attn, --tiled-attn, the blocked attention backward;
--dora; --lora-layers; 1k-16k tokens) this
spawns the ranks (gloo, one thread each, file:// rendezvous), runs `train.main([...])` for 2 optimizer steps
(step 2 runs with the AdamW state allocated) on a random Qwen2 checkpoint made here (hidden 256, 4 heads,
2 KV heads, intermediate 768, 4 layers, vocab 4096, untied; the rows named "v512": vocab 512, where a block's
backward, not the loss' logits block, sets the peak; "tied v16k": vocab 16,384, the head tied to the embedding;
rows named for another architecture, ARCHS: Gemma 3, OLMo 3, Qwen3-MoE, Granite, Ministral 3, Gemma 4 (no cp rows),
its random checkpoint of the same sizes, made from transformers' own config class) and synthetic text, and prints

    planned  = `parallel.plan.memory_plan(...).peak`: the live-tensor peak, WITHOUT the fragmentation factor
               and the runtime term (those are stated constants, not formulas to validate)
    measured = per rank, the RSS high-water mark (VmHWM) from the call of `build_model` to the end of the
               step loop, minus the RSS at that call; the max over ranks. The baseline holds every import
               (torch, transformers, peft, bitsandbytes: ~0.4 GB, which train.py's lifetime `peak_mem_gb`
               on CPU counts too), the process group and mesh, the tokenizer and the tokenized data: what
               a GPU run keeps in host memory, not on the device. VmHWM is reset to it through
               /proc/self/clear_refs. The window is model build + 2 steps; the final checkpoint and adapter
               export are skipped (patched out): they are not part of a step. Minus code MB:
    code MB  = the growth of file-backed RSS over the same window (RssFile): library code paged in the first
               time a kernel runs (torch, bitsandbytes). It is host memory on a GPU run, so it is subtracted
               from measured, and printed.
    ratio    = measured / planned (the goal: within 0.75-1.25)

The measured side still holds what the plan does not model (autograd and gloo bookkeeping, bitsandbytes'
and peft's small tensors, malloc's own slack): at these sizes, tens of MB. glibc's malloc runs with a fixed
mmap threshold (MALLOC_MMAP_THRESHOLD_=65536), so every tensor above 64 KB is its own mapping, returned to
the kernel when torch frees it: RSS then follows the live tensors the way CUDA's max_memory_allocated does.
With glibc's default dynamic threshold, blocks up to 32 MB stay in the heap after free and the RSS peak
includes memory that no tensor holds.

Run: .venv/bin/python bench/plan.py    (11 min on a shared, loaded 2-core machine: 8 min CPU, the Qwen2 rows; the
other architectures' 25 rows ~20 min more; --only NAME...: rows)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist import run_ranks  # noqa: E402

# (name, world size, max-len, flags): every flag is a train.py flag
CONFIGS = [
    ("cp1 nf4 1k", 1, 1024, ["--quant", "nf4"]),
    ("cp1 nf4 4k", 1, 4096, ["--quant", "nf4"]),
    ("cp1 none 4k no-AC", 1, 4096, ["--quant", "none", "--no-ac"]),
    ("dp2 none 2k", 2, 2048, ["--quant", "none", "--dp-shard", "2"]),
    ("cp2 ulysses nf4 4k", 2, 4096, ["--quant", "nf4", "--cp", "2", "--cp-impl", "ulysses"]),
    ("cp2 ring none 4k no-AC", 2, 4096, ["--quant", "none", "--cp", "2", "--cp-impl", "ring", "--no-ac"]),
    ("cp2 dp2 ulysses nf4 2k", 4, 2048, ["--quant", "nf4", "--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses"]),
    ("cp4 ulysses nf4 4k", 4, 4096, ["--quant", "nf4", "--cp", "4", "--cp-impl", "ulysses"]),
    ("cp4 ring none 4k", 4, 4096, ["--quant", "none", "--cp", "4", "--cp-impl", "ring"]),
    ("cp4 hybrid nf4 4k no-AC", 4, 4096, ["--quant", "nf4", "--cp", "4", "--cp-impl", "hybrid",
                                           "--ulysses-degree", "2", "--no-ac"]),
    ("cp1 nf4 4k tiled", 1, 4096, ["--quant", "nf4", "--tiled-mlp"]),
    ("cp1 nf4 4k tiled offload", 1, 4096, ["--quant", "nf4", "--tiled-mlp", "--offload-activations"]),
    ("cp2 dp2 ring nf4 4k tiled offload", 4, 4096, ["--quant", "nf4", "--cp", "2", "--dp-shard", "2", "--cp-impl",
                                                   "ring", "--tiled-mlp", "--offload-activations"]),
    ("cp1 nf4 4k tiled group2", 1, 4096, ["--quant", "nf4", "--tiled-mlp", "--ac-group", "2"]),
    ("cp1 nf4 8k group4", 1, 8192, ["--quant", "nf4", "--ac-group", "4"]),
    ("cp2 dp2 ulysses nf4 4k group2", 4, 4096, ["--quant", "nf4", "--cp", "2", "--dp-shard", "2", "--cp-impl",
                                                "ulysses", "--ac-group", "2"]),
    ("cp1 nf4 4k ac-blocks 2", 1, 4096, ["--quant", "nf4", "--ac-blocks", "2"]),
    ("cp1 nf4 8k keep-attn", 1, 8192, ["--quant", "nf4", "--ac-keep-attn"]),
    ("cp2 ring nf4 4k keep-attn", 2, 4096, ["--quant", "nf4", "--cp", "2", "--cp-impl", "ring", "--ac-keep-attn"]),
    # vocab 512: the loss phase's logits block is smaller than a block's backward, which then sets the peak
    ("cp1 nf4 16k v512", 1, 16384, ["--quant", "nf4"]),
    ("cp1 nf4 16k tiled v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp"]),
    ("cp1 nf4 16k tiled blocks4k v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp"]),
    ("cp1 nf4 16k tiled offload v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--offload-activations"]),
    ("cp1 nf4 16k tiled offload blocks4k v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp",
                                                          "--offload-activations"]),
    # --tiled-attn: the attention sublayer over query tiles (an eighth of the row; blocks4k: 1,024 rows)
    ("cp1 nf4 4k tiled-attn", 1, 4096, ["--quant", "nf4", "--tiled-attn"]),
    ("cp1 none 4k no-AC tiled-attn", 1, 4096, ["--quant", "none", "--no-ac", "--tiled-attn"]),
    ("dp2 nf4 4k tiled tiled-attn", 2, 4096, ["--quant", "nf4", "--dp-shard", "2", "--tiled-mlp", "--tiled-attn"]),
    ("cp1 nf4 16k tiled tiled-attn v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--tiled-attn"]),
    ("cp1 nf4 16k tiled tiled-attn blocks4k v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--tiled-attn"]),
    ("cp1 nf4 16k tiled tiled-attn offload v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--tiled-attn",
                                                            "--offload-activations"]),
    # --dora: each adapted projection keeps its LoRA sum for the magnitude's gradient (v512: the block sets the peak)
    ("cp1 nf4 4k dora", 1, 4096, ["--quant", "nf4", "--dora"]),
    ("cp1 nf4 4k tiled dora", 1, 4096, ["--quant", "nf4", "--tiled-mlp", "--dora"]),
    ("cp1 nf4 4k dropout", 1, 4096, ["--quant", "nf4", "--lora-dropout", "0.1"]),
    ("cp1 nf4 16k tiled dropout v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--lora-dropout", "0.1"]),
    ("cp1 nf4 4k dora dropout", 1, 4096, ["--quant", "nf4", "--dora", "--lora-dropout", "0.1"]),
    ("cp1 none 4k no-AC dora", 1, 4096, ["--quant", "none", "--no-ac", "--dora"]),
    ("cp1 nf4 16k dora v512", 1, 16384, ["--quant", "nf4", "--dora"]),
    ("cp1 nf4 16k tiled dora v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--dora"]),
    ("cp1 nf4 16k tiled tiled-attn dora v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--tiled-attn", "--dora"]),
    ("dp2 nf4 4k tiled tiled-attn dora", 2, 4096, ["--quant", "nf4", "--dp-shard", "2", "--tiled-mlp", "--tiled-attn",
                                                  "--dora"]),
    # --train-norms: the norms train (tiny), block 0's first norm saves its input
    ("cp1 nf4 4k train-norms", 1, 4096, ["--quant", "nf4", "--train-norms"]),
    ("cp1 nf4 16k tiled train-norms v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--train-norms"]),
    # --train-embeddings: the embedding's fp32 state and, last in backward, its gradient and reduce-scatter input
    ("cp1 nf4 4k train-embeddings", 1, 4096, ["--quant", "nf4", "--train-norms", "--train-embeddings"]),
    ("cp2 dp2 ring nf4 2k train-embeddings", 4, 2048, ["--quant", "nf4", "--cp", "2", "--dp-shard", "2", "--cp-impl",
                                                       "ring", "--train-norms", "--train-embeddings"]),
    # a tied model's embedding (its head) trained: the loss's float32 head gradient, then held through the backward
    # ("tied v16k": the same model, its head tied, vocab 16,384, where the [V, D] tensors count)
    ("cp1 nf4 4k train-embeddings tied v16k", 1, 4096, ["--quant", "nf4", "--train-embeddings"]),
    ("cp2 dp2 ring nf4 2k train-embeddings tied v16k", 4, 2048, ["--quant", "nf4", "--cp", "2", "--dp-shard", "2",
                                                                "--cp-impl", "ring", "--train-embeddings"]),
    # --lora-layers: the blocks below the lowest adapted one need no grad (no saved tensors, checkpoints, backward)
    # (2026-12, loaded 2-core CPU: planned / measured MB 129 / 133, 322 / 324, 460 / 429; all-blocks rows 136 / 140,
    # 412 / 415, 480 / 468)
    ("cp1 nf4 4k lora-layers 2-3", 1, 4096, ["--quant", "nf4", "--lora-layers", "2-3"]),
    ("cp1 none 4k no-AC lora-layers 1,3", 1, 4096, ["--quant", "none", "--no-ac", "--lora-layers", "1,3"]),
    ("cp1 nf4 16k lora-layers 3 v512", 1, 16384, ["--quant", "nf4", "--lora-layers", "3"]),
    # un-adapted blocks above the adapted one: the backward's peak may be theirs (no LoRA, DoRA or dropout tensors in
    # its phases; a larger recompute), planned apart from the adapted block's (review, helper 81)
    ("cp1 nf4 16k lora-layers 0 dora v512", 1, 16384, ["--quant", "nf4", "--lora-layers", "0", "--dora"]),
    ("cp1 nf4 16k tiled lora-layers 0 dropout v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--lora-layers", "0",
                                                                "--lora-dropout", "0.1"]),
]
# the other architectures (ARCHS: a row named "<arch> ..." runs that architecture's random checkpoint, the Qwen2 rows'
# sizes): per architecture nf4 with AC, --tiled-mlp, --tiled-mlp --offload-activations, and cp 2 (Ulysses)
ARCH_ROWS = [("nf4 4k", 1, 4096, ["--quant", "nf4"]),
             ("nf4 16k tiled", 1, 16384, ["--quant", "nf4", "--tiled-mlp"]),
             ("nf4 16k tiled offload", 1, 16384, ["--quant", "nf4", "--tiled-mlp", "--offload-activations"]),
             ("cp2 ulysses nf4 8k", 2, 8192, ["--quant", "nf4", "--cp", "2", "--cp-impl", "ulysses"]),
             ("nf4 16k v512", 1, 16384, ["--quant", "nf4"])]   # (vocab 512: the block's backward sets the peak)
SIZES = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, tie_word_embeddings=False)
FOUR = ["sliding_attention"] * 3 + ["full_attention"]   # Gemma 3, OLMo 3: three sliding layers, a full one
# architecture -> (transformers' config class, its keys beyond SIZES): windows of 1,024 tokens, shorter than the rows
ARCHS = {"gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=64, sliding_window=1024, layer_types=FOUR,
                                             tie_word_embeddings=True)),   # (as every Gemma 3)
         "olmo3": ("Olmo3Config", dict(sliding_window=1024, layer_types=FOUR)),
         "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                                              norm_topk_prob=True)),
         "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                           attention_multiplier=0.015625, logits_scaling=8.0)),
         "ministral3": ("Ministral3Config", dict(rope_parameters=dict(  # its default YaRN x16, from 2,048 tokens
             rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=2048, beta_fast=32.0,
             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
         # Gemma 4 (the 31B's form): the full layer its own head size (128) and 1 KV head, no v_proj; the softcap
         "gemma4": ("Gemma4TextConfig", dict(sliding_window=1024, layer_types=FOUR, global_head_dim=128,
                                             num_global_key_value_heads=1, attention_k_eq_v=True,
                                             hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
                                             tie_word_embeddings=True)),
         # Gemma 4 E2B's form (parallel/plan_small.py): per-layer inputs of 64, the last 3 of 6 layers KV-shared (layers
         # 1, full, and 2, sliding, store), their MLPs double-wide
         "gemma4_e2b": ("Gemma4TextConfig", dict(sliding_window=1024, layer_types=["sliding_attention",
                                                 "full_attention"] + FOUR[:3] + ["full_attention"], num_hidden_layers=6,
                                                 global_head_dim=128, hidden_size_per_layer_input=64,
                                                 vocab_size_per_layer_input=4096, num_kv_shared_layers=3,
                                                 use_double_wide_mlp=True, final_logit_softcapping=30.0,
                                                 tie_word_embeddings=True)),
         # Gemma 4's MoE block (the 26B-A4B's form): 8 experts of 192, top 2, beside the dense MLP in every block
         "gemma4_moe": ("Gemma4TextConfig", dict(sliding_window=1024, layer_types=FOUR, global_head_dim=128,
                                                 num_global_key_value_heads=1, attention_k_eq_v=True,
                                                 hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
                                                 tie_word_embeddings=True, enable_moe_block=True, num_experts=8,
                                                 top_k_experts=2, moe_intermediate_size=192))}
# (qwen3_moe: --lora-targets' default there is the attention's, model.lora_spec.run_targets)
CONFIGS += [(f"{a} {n}", w, s, f) for a in ARCHS for n, w, s, f in ARCH_ROWS
            if not (a.startswith("gemma4") and w > 1)]   # (--cp > 1 is refused for Gemma 4's per-layer shapes:
# parallel.mesh); Gemma 4's MoE unit under --tiled-mlp (1,024-token tiles) where the block's backward sets the peak
CONFIGS += [("gemma4_moe nf4 16k tiled v512", 1, 16384, ["--quant", "nf4", "--tiled-mlp"])]
# rows whose attention backward runs in blocks (parallel.kernels.BACKWARD_BLOCK, 65,536 by default, set lower
# here so a CPU run reaches it): planned and measured with the same block
BLOCKS = {"cp1 nf4 16k tiled blocks4k v512": 4096, "cp1 nf4 16k tiled offload blocks4k v512": 4096,
          "cp1 nf4 16k tiled tiled-attn blocks4k v512": 4096}
MB = 1e6
FRAGMENTATION = 1.10   # parallel.plan_totals.FRAGMENTATION, printed only


def make_assets(root: str, archs=()) -> tuple[str, str]:
    """A random Qwen2 checkpoint with a small BPE tokenizer, and long synthetic text records; `archs`: the ARCHS whose
    random checkpoints (made by transformers from its own config class) go beside it, as model_<arch>."""
    import transformers as T

    from data.demo import build_tokenizer

    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))))
             for _ in range(300)]
    texts = [" ".join(rng.choice(words) for _ in range(3000)) for _ in range(16)]
    tok = build_tokenizer(texts[:4], vocab_size=400)
    texts = [t + " " + t for t in texts]   # over 16k tokens each; the first 8k are those of the 3000 words
    model_dir = os.path.join(root, "model")
    tok.save_pretrained(model_dir)
    cfg = T.Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                        tie_word_embeddings=False, use_sliding_window=False, rope_theta=1e6)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(model_dir)
    tok.save_pretrained(model_dir + "_v512")   # the rows named "... v512": the same model with 512 tokens
    torch.manual_seed(0)
    cfg.vocab_size = 512
    T.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(model_dir + "_v512")
    tok.save_pretrained(model_dir + "_tied_v16k")   # "... tied v16k": 16,384 tokens, the head tied to the embedding
    torch.manual_seed(0)
    cfg.vocab_size, cfg.tie_word_embeddings = 16384, True
    T.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(model_dir + "_tied_v16k")
    for arch in archs:
        cls, keys = ARCHS[arch]
        for vocab, tail in ((4096, ""), (512, "_v512")):
            tok.save_pretrained(f"{model_dir}_{arch}{tail}")
            torch.manual_seed(0)
            cfg = getattr(T, cls)(**{**SIZES, **keys, "vocab_size": vocab}, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
            T.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(f"{model_dir}_{arch}{tail}")
    data = os.path.join(root, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return model_dir, data


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _worker(rank, world, argv, block=None):
    import peft  # noqa: F401 - model.qlora imports it as it builds the adapter, inside build_model: in the baseline

    import model.export
    import parallel.checkpoint
    import parallel.kernels
    import parallel.parallelize
    import train

    parallel.kernels.BACKWARD_BLOCK = block or parallel.kernels.BACKWARD_BLOCK

    peak, build = {}, parallel.parallelize.build_model

    def start(*a, **k):  # tokenizer, data and mesh exist (host memory on a GPU run): the baseline
        peak["base"], peak["file0"] = _status("VmRSS"), _status("RssFile")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")     # reset VmHWM to the current RSS
        return build(*a, **k)

    def stop(*a, **k):   # end of the step loop: read the high-water mark, skip the save
        peak.setdefault("hwm", _status("VmHWM"))
        peak.setdefault("file", _status("RssFile") - peak["file0"])

    parallel.parallelize.build_model = start
    parallel.checkpoint.save = model.export.export_adapter = stop
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(argv)
    return peak["hwm"] - peak["base"] - peak["file"], peak["file"]


def measure(world: int, argv: list[str], block=None) -> list[int]:
    return run_ranks(_worker, world, argv, block, timeout=900, pg_timeout=300, start="spawn")


def planned(world: int, argv: list[str], block=None) -> float:
    import train
    from model.load import read_args
    from parallel import kernels
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(argv)
    margs = read_args(args.model)
    dims, pack = validate(args, margs, world)
    default, kernels.BACKWARD_BLOCK = kernels.BACKWARD_BLOCK, block or kernels.BACKWARD_BLOCK
    try:
        return memory_plan(margs, dims, args, "cpu", pack).peak
    finally:
        kernels.BACKWARD_BLOCK = default


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", default=None, help="run only the configurations with these names")
    opt = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"   # read by glibc when each rank starts (see docstring)
    rows = [c for c in CONFIGS if opt.only is None or c[0] in opt.only]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = make_assets(tmp, sorted({n.split()[0] for n, *_ in rows} & ARCHS.keys()))
        print(f"{'config':<34}{'ranks':>6}{'planned MB':>12}{'measured MB':>13}{'ratio':>7}{'code MB':>9}"
              "   measured per rank")
        for name, world, max_len, flags in rows:
            arch = f"_{name.split()[0]}" if name.split()[0] in ARCHS else ""
            model = model_dir + arch + ("_v512" if name.endswith("v512") else "_tied_v16k" if name.endswith("tied v16k")
                                        else "")
            argv = ["--model", model, "--data", data, "--max-len", str(max_len), "--long-text", "truncate",
                    "--steps", "2", "--dtype", "fp32",
                    "--global-batch", str(world // _cp(flags)), "--no-progress",
                    "--out", os.path.join(tmp, "out", name.replace(" ", "_")), *flags]   # a run owns its --out
            plan = planned(world, argv, BLOCKS.get(name))
            meas, code = zip(*measure(world, argv, BLOCKS.get(name)))
            print(f"{name:<34}{world:>6}{plan / MB:>12.0f}{max(meas) / MB:>13.0f}{max(meas) / plan:>7.2f}"
                  f"{max(code) / MB:>9.0f}   " + " ".join(f"{m / MB:.0f}" for m in meas), flush=True)
    print(f"({time.time() - t0:.0f} s) planned: live-tensor peak, without the x{FRAGMENTATION:.2f} fragmentation "
          "and runtime terms.\nmeasured: VmHWM - RSS at build_model - code MB (library code paged in on first "
          "use, file-backed RSS growth), over build + 2 steps; max over ranks")


def _cp(flags):
    return int(flags[flags.index("--cp") + 1]) if "--cp" in flags else 1


if __name__ == "__main__":
    main()
