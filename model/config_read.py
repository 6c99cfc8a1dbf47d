"""config.json read into `ModelArgs` as transformers reads it (`ModelArgs.from_config_dict` is `read_config`).

Contract:
- `ModelArgs.from_config_dict(cfg)` accepts the classic hub format (top-level `rope_theta`,
  `rope_scaling`) and the newer `rope_parameters` format, for the Llama family: Llama 2/3
  (llama3 rope scaling), Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim), Mistral and Ministral, and
  Ministral 3 (`ministral3`: YaRN, Llama 4's attention temperature `attn_temperature_beta`/`_length`; model/rope_read.py
  reads them, model/rope.py applies them),
  Gemma 3 text, OLMo 2/3, SmolLM3 (NoPE layers) and Granite 3 (its multipliers) (`gemma3_text`, `olmo2`, `olmo3`,
  `smollm3`, `granite`: model/gemma.py; their keys model/arch_fields.py), Qwen3-MoE (`qwen3_moe`: model/moe.py),
  Qwen3.5 (`qwen3_5_text`: gated attention, partial RoPE, Gated DeltaNet layers; model/arch_fields.py), Qwen3.5-MoE
  (`qwen3_5_moe_text`: Qwen3.5's with model/moe.py's MLP and a shared expert, whose width, shared_expert_intermediate_
  size, is `intermediate_size` here: the one MLP of that name in a block), GPT-OSS (`gpt_oss`: attention sinks, q/k/v/o
  biases by default, every MLP its MoE block: model/gpt_oss.py), Phi-3 / Phi-4 (`phi3`: fused qkv_proj and
  gate_up_proj, partial RoPE, LongRoPE: model/phi3.py), GLM-4.5 / 4.6 (`glm4_moe`: q/k/v biases, partial RoPE, a
  sigmoid group-limited router with shared experts: model/glm4_moe.py). A multimodal wrapper (Mistral 3,
  `mistral3`; Gemma 3, `gemma3`; Qwen3.5, `qwen3_5`; Qwen3.5-MoE, `qwen3_5_moe`) is read as its language model
  (its `text_config` and the outer keys that act on it: model/wrapper.py), `args.wrapper` naming it. Anything else
  raises `ValueError` naming the supported architectures, as does a checkpoint quantized already otherwise than in
  bitsandbytes 4-bit or GPT-OSS's MXFP4 (a `quantization_config`: AWQ, GPTQ, FP8, bnb 8-bit; model/prequant.py) and
  one whose `architectures` names no *ForCausalLM (a classifier's, reward or embedding model's: no language-model head).
  Read as transformers 5 reads it (its class defaults for missing keys); keys this decoder does not implement
  (another `hidden_act`, attention dropout, per-layer-type RoPE, a rope_scaling that contradicts rope_parameters)
  are refused, never ignored.
- The sliding windows `args.window(layer)` answers from (model/config.py) are read here: `sliding_window` and
  `layer_types` as each class's config applies them.
"""

from __future__ import annotations

from dataclasses import replace

from model.arch_fields import FIELDS, SLIDING_WINDOW, SUPPORTED
from model.prequant import check_config
from model.rope import inv_freq
from model.rope_read import is_real, read_ministral3, read_rope, rope_theta
from model.wrapper import unwrap

# config classes' pad_token_id where config.json has none (transformers 5's; every other class's is None)
PAD_DEFAULTS = {"gemma3_text": 0, "gemma4_text": 0, "ministral3": 11, "olmo2": 1, "olmo3": 1, "phi3": 32000,
                "smollm3": 128004}


def read_config(cls, cfg: dict):
    """`cls` (ModelArgs) from config.json's dict `cfg`, as the module docstring says (`ModelArgs.from_config_dict`)."""
    cfg, wrapper = unwrap(cfg)   # a multimodal wrapper (Mistral 3, Gemma 3): its language model's config, as
    # transformers reads it (model/wrapper.py)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        archs = cfg.get("architectures")
        raise ValueError(
            f"unsupported architecture model_type={mt!r}{f' (the text_config of a {wrapper})' if wrapper else ''} "
            f"(architectures={archs}); supported: Llama 2/3 (llama), Mistral (mistral, ministral), Ministral 3 "
            "(ministral3), Qwen2/2.5 (qwen2), Qwen3 (qwen3), Gemma 3 text (gemma3_text), OLMo 2 (olmo2), OLMo 3 "
            "(olmo3), SmolLM3 (smollm3), Granite 3 dense (granite; not Granite 4's granitemoehybrid), Qwen3-MoE "
            "(qwen3_moe), Qwen3.5 (qwen3_5_text), Qwen3.5-MoE (qwen3_5_moe_text), Gemma 4 dense (gemma4_text), GPT-OSS "
            "(gpt_oss), Phi-3 / Phi-4 (phi3), GLM-4.5 / 4.6 (glm4_moe), and "
            "the language model of Mistral 3 (mistral3), Gemma 3 (gemma3), Gemma 4 (gemma4), Qwen3.5 (qwen3_5) and "
            "Qwen3.5-MoE (qwen3_5_moe) wrappers of these")
    archs = [a] if isinstance(a := cfg.get("architectures") or [], str) else a
    if archs and not any(str(a).endswith("ForCausalLM") for a in archs):   # a reward model's score head, an
        raise ValueError(   # embedding model's weights without `model.`: no lm_head (a tied one: the embedding)
            f"config.json: architectures {archs} is not a causal language model (*ForCausalLM): a classifier, "
            "reward or embedding model has no language-model head to train; pass the causal LM checkpoint it was "
            "made from")
    q = cfg.get("quantization_config")   # AWQ, GPTQ, FP8, bnb 8-bit: packed weights, which the checks below would call
    if q and not (mt == "gpt_oss" and isinstance(q, dict) and q.get("quant_method") == "mxfp4"):   # another
        check_config(q)   # config.json's; bitsandbytes 4-bit: model/prequant.py reads them; GPT-OSS's MXFP4 experts:
        # model/gpt_oss.py
    flags = SUPPORTED[mt]
    if mt == "mistral" and "layer_types" in cfg:   # transformers' AutoConfig reads this as Ministral
        mt = "ministral"
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish") and mt not in ("gemma3_text", "gemma4_text"):   # (Gemma's: arch_fields; also
        # Qwen3.5's conv's)
        raise ValueError(f"config.json: hidden_act {act!r} is not supported: this decoder's MLP is SwiGLU (silu)")
    if cfg.get("attention_dropout"):
        raise ValueError(f"config.json: attention_dropout {cfg['attention_dropout']!r} is not supported (the "
                         "attention kernels run without dropout); set it to 0.0 in config.json")
    for where, d in (("", cfg), ("rope_parameters.", cfg.get("rope_parameters")), ("rope_scaling.",
                                                                                  cfg.get("rope_scaling"))):
        # (Phi, GLM...; the Llama-family classes here ignore it, or fail on a scaled RoPE; Qwen3.5 reads it)
        if isinstance(d, dict) and d.get("partial_rotary_factor") not in (None, 1, 1.0) and not mt.startswith(
                ("qwen3_5", "phi3", "glm4_moe")):
            raise ValueError(f"config.json: {where}partial_rotary_factor {d['partial_rotary_factor']!r} is not "
                             "supported: RoPE here rotates the whole head_dim (remove it only if the model was "
                             "trained so)")
    for key in ("rope_parameters", "rope_scaling"):   # (a string or a list: a traceback until 2026-12-07)
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"config.json: {key} {cfg[key]!r} must be an object, e.g. {{\"rope_type\": \"yarn\", "
                             "\"factor\": 4.0}, or null for plain RoPE: fix it in config.json")
    max_pos = cfg.get("max_position_embeddings", flags["max_pos"])
    # (the attention temperature's beta, length: Ministral 3's alone; other classes ignore llama_4_scaling_beta)
    gemma = FIELDS[mt](cfg, max_pos) if mt in FIELDS else {}   # (model/arch_fields.py)
    theta, scaling, beta, length = read_ministral3(cfg, max_pos) if mt == "ministral3" else (
        gemma["rope_theta"], gemma["rope_scaling"], None, None) if "rope_theta" in gemma else (
        *read_rope(cfg, max_pos), None, None)
    attn_bias = bool(cfg.get("attention_bias", mt == "gpt_oss"))   # (GptOssConfig's default: true)
    # Sliding windows as transformers applies them: Mistral on every layer; Ministral (and Mistral with a
    # layer_types key) on the layers layer_types names (all when it is null); Qwen2/3 only with use_sliding_window,
    # on the layers `layer_types` names or, without it, from layer max_window_layers on; Llama never.
    window, layer_types = cfg.get("sliding_window", SLIDING_WINDOW), None
    if mt in ("llama", "granite", "qwen3_5_text", "qwen3_5_moe_text", "glm4_moe"):   # (these classes have no window)
        window = None
    if mt == "ministral3":   # its class's default is no window; a window applies on every layer
        window = cfg.get("sliding_window")
    if mt == "ministral":
        layer_types = cfg.get("layer_types")
    if mt == "qwen3_moe":   # every layer slides with use_sliding_window (Qwen3MoeConfig: no layer types)
        window = window if cfg.get("use_sliding_window", False) else None
    if mt in ("qwen2", "qwen3"):
        window = window if cfg.get("use_sliding_window", False) else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(cfg["num_hidden_layers"])]
    eps = cfg.get("rms_norm_eps", flags.get("eps", 1e-6))
    if not (is_real(eps) and 0 <= eps < 1):   # (below 0: NaN rows)
        raise ValueError(f"config.json: rms_norm_eps {eps!r} must be a small number >= 0 (RMSNorm divides by "
                         "sqrt(mean(x²) + eps); e.g. 1e-6, the checkpoint's own value): fix it in config.json")
    args = cls(
        model_type=mt,
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads", flags["kv"]),
        head_dim=cfg.get("head_dim", flags["head_dim"]),
        intermediate_size=cfg["intermediate_size"] if mt != "qwen3_5_moe_text" else cfg.get(
            "shared_expert_intermediate_size", 512),   # (Qwen3.5-MoE: its shared expert's; module docstring)
        norm_eps=eps,
        rope_theta=rope_theta(theta, scaling),   # (numbers above 0)
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", mt in ("gemma3_text", "gemma4_text", "smollm3"))),
        pad_token_id=cfg.get("pad_token_id", PAD_DEFAULTS.get(mt)),
        qkv_bias=attn_bias if flags["qkv_bias"] is None else flags["qkv_bias"],
        o_bias=attn_bias and flags["qkv_bias"] is None,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and flags["mlp_bias"],
        qk_norm=flags["qk_norm"],
        sliding_window=window,
        layer_types=layer_types if window is not None else None,
        wrapper=wrapper,
        attn_temperature_beta=beta,
        attn_temperature_length=length,
    )
    if gemma:   # (its layer types also pick each layer's RoPE table, with no window too)
        args = replace(args, **{k: v for k, v in gemma.items() if k not in ("rope_theta", "rope_scaling")})
    try:   # now, not at the first forward: a RoPE config.json that cannot be computed is a start-up error
        inv_freq(args)
        if args.local_rope is not None:
            inv_freq(args.local_args())
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"config.json: RoPE {args.rope_parameters()} cannot be computed ({type(e).__name__}: "
                         f"{e}); transformers cannot load it either: fix it in config.json") from None
    return args
