"""`--train-norms` and `--train-embeddings`: the RMSNorm weights, and the input embedding, train beside LoRA (LongLoRA,
Chen et al. 2023: with LoRA alone a context extension falls short of full fine-tuning; trainable normalization and
embedding layers close most of the gap).

Contract:
- `trained_norms(model, layers)`: the norm modules that train, by our (and transformers') names: each adapted block's
  input_layernorm (not OLMo's: its blocks have none), post_attention_layernorm, (Gemma 3, OLMo) post_ and (Gemma 3)
  pre_feedforward_layernorm, (Qwen3, Gemma 3, OLMo) q_norm, k_norm, (Qwen3.5's linear layers) the gated norm
  linear_attn.norm, (Gemma 4's MoE block) pre_feedforward_layernorm_2, post_feedforward_layernorm_1 and _2, (Gemma 4
  E2B / E4B) post_per_layer_input_norm and the decoder's per_layer_projection_norm, and the final `model.norm`.
  `layers`: the adapted blocks (--lora-layers; None: all). Blocks below the lowest adapted one run no backward: theirs
  stay frozen.
- `train_norms(model, layers)`: those weights become trainable float32 masters (as LoRA's: FSDP2's mixed precision
  hands forward the compute dtype; model.rmsnorm.RMSNorm casts where nothing does). Anything with requires_grad is
  trained, clipped, checkpointed and exported (parallel/parallelize.lora_parameters).
- `train_embeddings(model)`: the input embedding `model.embed_tokens` trains as a float32 master too (a tied model's
  output head is the same weight: it trains through the loss as well; parallel.flags.check_model_flags refuses that
  under DPO). The decoder casts its rows, and a tied head, to the compute dtype where no mixed precision did
  (model.llama.Transformer).
- In an adapter they are peft's `modules_to_save` (`modules_to_save(names)`: the module names, which peft matches
  by suffix; their weights under "base_model.model.<module>.weight"), so `PeftModel.from_pretrained` computes with
  them and `merge_and_unload` writes them. `is_norm_weight(name)`, `is_embed_weight(name)`: a trained norm's or the
  embedding's tensor name, in any of our, peft's or an adapter file's spellings; `is_saved_weight`: either.
- `reference_trained(model, base, adapter, dtype, device)`: while entered, each trained norm, and a trained embedding,
  computes with its reference weight (DPO's reference model beside `model.qlora.adapters_off` / `reference_adapter`): a
  reference adapter's (`adapter`: read_init_adapter's tensors) where it has one, else the base checkpoint's (`base`:
  its path), whole on every rank in the compute dtype (norms: a few [D] per block; the embedding: V·D, which the
  planner counts).
- Weight decay never applies to the norms (`parallel.parallelize.lora_groups`), as transformers' Trainer keeps norms out
  of it (`get_decay_parameter_names`): decay would pull a gain toward 0, not toward its start.
"""

from __future__ import annotations

import re

import torch

BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
               "self_attn.q_norm", "self_attn.k_norm", "linear_attn.norm", "pre_feedforward_layernorm_2",
               "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "post_per_layer_input_norm")   # (the
# feedforward ones: Gemma 3's, OLMo's: gemma.py; linear_attn.norm: Qwen3.5's linear layers' gated norm,
# model/deltanet.py; the _1/_2 ones: Gemma 4's MoE block's, model/gemma4_moe.py; post_per_layer_input_norm and the
# decoder's per_layer_projection_norm: Gemma 4 E2B / E4B's per-layer inputs, model/gemma4_small.py)
ROOT_NORMS = ("model.per_layer_projection_norm", "model.norm")
_WEIGHT = re.compile(r"(^|\.)(model\.norm|model\.per_layer_projection_norm|model\.layers\.\d+\.(input_layernorm|"
                     r"post_attention_layernorm|post_per_layer_input_norm|"
                     r"pre_feedforward_layernorm(_2)?|post_feedforward_layernorm(_[12])?|self_attn\.q_norm|"
                     r"self_attn\.k_norm|linear_attn\.norm))(\.modules_to_save\.default)?\.weight$")
_EMBED = re.compile(r"(^|\.)(model\.embed_tokens)(\.modules_to_save\.default)?\.weight$")


def trained_norms(model, layers=None) -> list[str]:
    """The names of the norm modules --train-norms trains (module docstring), in model order."""
    have = dict(model.named_modules())
    names = [f"model.layers.{i}.{n}" for i in range(len(have["model.layers"])) if layers is None or i in layers
             for n in BLOCK_NORMS if f"model.layers.{i}.{n}" in have]
    return names + [n for n in ROOT_NORMS if n in have]


def train_norms(model, layers=None) -> None:
    """Make the --train-norms weights trainable float32 masters."""
    have = dict(model.named_modules())
    for name in trained_norms(model, layers):
        w = have[name].weight
        w.data = w.data.float()
        w.requires_grad_(True)


def train_embeddings(model) -> None:
    """Make the input embedding's weight a trainable float32 master (--train-embeddings); a tied model's output head
    is that same parameter. The embedding keeps the dtype it had as `compute_dtype`: its rows, and a tied head,
    compute in it."""
    embed = model.model.embed_tokens
    embed.compute_dtype = embed.weight.dtype
    embed.weight.data = embed.weight.data.float()
    embed.weight.requires_grad_(True)


def is_norm_weight(name: str) -> bool:
    """Whether `name` is a trained norm's weight (ours, peft's wrapped one, or an adapter file's key)."""
    return bool(_WEIGHT.search(name))


def is_embed_weight(name: str) -> bool:
    """Whether `name` is the input embedding's weight (ours, peft's wrapped one, or an adapter file's key)."""
    return bool(_EMBED.search(name))


def is_saved_weight(name: str) -> bool:
    """A norm's or the embedding's weight: what an adapter holds as peft's modules_to_save."""
    return is_norm_weight(name) or is_embed_weight(name)


def modules_to_save(names) -> list[str]:
    """peft's modules_to_save for the norm and embedding weights among `names` (any spelling is_saved_weight takes):
    their module names."""
    return sorted({(_WEIGHT.search(n) or _EMBED.search(n)).group(2) for n in names if is_saved_weight(n)},
                  key=lambda m: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", m)])


class reference_trained:
    """DPO's reference for --train-norms' and --train-embeddings' weights (module docstring)."""

    def __init__(self, model, base: str, adapter: dict | None = None, dtype=None, device=None):
        from model.load import CheckpointReader

        self.trained = {n: m for n, m in model.named_modules() if hasattr(m, "weight") and m.weight.requires_grad and
                        is_saved_weight(n + ".weight")}   # (the norms and the embedding: each takes `reference`)
        adapter, reader = adapter or {}, None
        self.weights = {}
        for n in self.trained:
            t = adapter.get(n + ".weight")
            if t is None:
                reader = reader or CheckpointReader(base)
                t = reader.get(n + ".weight")
            self.weights[n] = t.detach().to(device, dtype)
        if reader is not None:
            reader.close()

    def __enter__(self):
        for n, m in self.trained.items():
            m.reference = self.weights[n]

    def __exit__(self, *exc):
        for m in self.trained.values():
            m.reference = None


def cast_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A trained norm's float32 weight in x's dtype where nothing cast it (CPU bf16; FSDP2's mixed precision does
    on CUDA), so the norm's output keeps x's dtype as a frozen norm's does."""
    return weight if weight.dtype == x.dtype or not weight.requires_grad else weight.to(x.dtype)
