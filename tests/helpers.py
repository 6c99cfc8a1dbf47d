"""Small shared builders for tests: tiny random checkpoints made with transformers."""

import torch
import transformers as T


def tiny_checkpoint(path, *, heads=6, kv_heads=2, head_dim=8, layers=2, vocab=128, tie=False,
                    inter=64, seed=0, max_shard_size="60KB"):
    """A random Qwen2 checkpoint (q/k/v bias) saved sharded by transformers; returns the path."""
    cfg = T.Qwen2Config(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        tie_word_embeddings=tie, max_position_embeddings=4096)
    torch.manual_seed(seed)
    hf = T.AutoModelForCausalLM.from_config(cfg).float()
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


def build_nonzero_b(opts, b_std=0.05, **kw):
    """`build_model`, then LoRA B ~ N(0, b_std) (seeded per name, like A, so it is the same for every
    layout): with the real B = 0 the base-weight paths would get no LoRA gradient at all."""
    from model.qlora import init_lora
    from parallel.parallelize import build_model

    model, peft_model = build_model(opts, **kw)
    init_lora(model, opts.seed, b_std)
    return model, peft_model
