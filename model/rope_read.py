"""RoPE as config.json and `--rope-scaling` give it, read as transformers reads them: (theta, scaling) for
`ModelArgs` (what model/rope.py computes from them: the inverse frequencies, the cos/sin tables, the rotation).

Contract:
- `read_rope(cfg, max_pos)` -> (theta, scaling): config.json's RoPE as transformers 5 standardizes it (classic
  top-level `rope_theta`/`rope_scaling` or the newer `rope_parameters`; the function's docstring); scaling {} is
  plain RoPE. Per-layer-type RoPE and a rope_scaling that contradicts rope_parameters raise ValueError.
  `rope_theta(theta, scaling)`: the theta read, as a float, once it and the scaling's factor are numbers above 0.
- `rope_scaling_flag(spec, args=None)` reads `--rope-scaling` (the function's docstring); `keep_temperature` keeps
  Ministral 3's attention temperature in it, `read_ministral3` reads that model's RoPE and temperature.
- `put_rope(cfg, rope)`: the other way, an adapter's learned RoPE (its base_config_overrides.json) written into a
  config.json dict in the form that dict has (the merged model's config.json, data/demo_compare.py's base).
- `ROPE_TYPES`: the rope types `--rope-scaling` may name and `inv_freq` computes (besides Gemma 4's full layers'
  "proportional", which only their config.json gives).
"""

from __future__ import annotations

import json
import math

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers' Ministral3Config RoPE when config.json has none (its top-level rope_theta then unread)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                   "llama_4_scaling_beta": 0.1}


def is_real(v) -> bool:
    """A finite int or float, not a bool (config.json's numbers: JSON's true is no number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _scaling(d: dict) -> dict:
    """A RoPE dict's scaling in one spelling: no theta, `rope_type` for the old `type`, {} for the default."""
    sc = {k: v for k, v in d.items() if k != "rope_theta"}
    if "type" in sc:
        sc.setdefault("rope_type", sc.pop("type"))
    return {} if sc.get("rope_type", "default") == "default" else sc


def read_rope(cfg: dict, max_pos: int) -> tuple[float, dict]:
    """(theta, scaling) of a config.json, as transformers standardizes them: a classic `rope_scaling` replaces
    `rope_parameters` whole (theta then comes from the top level, 10000 without it); llama3 and YaRN take the top-level
    `original_max_position_embeddings` first, else their own, else max_position_embeddings; a YaRN factor of null
    is max_position_embeddings / that original length."""
    params, classic = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: rope_parameters per layer type ({sorted(params)}) are not supported")
    if classic:
        theta, scaling = cfg.get("rope_theta", 10000.0), _scaling(classic)
        if params and (params.get("rope_theta", theta) != theta or _scaling(params) != scaling):
            raise ValueError(
                f"config.json has both rope_scaling {classic} and rope_parameters {params}, and they disagree: "
                f"transformers reads rope_scaling with the top-level rope_theta ({theta}) and ignores rope_parameters, "
                "so a model trained on the other would meet other positions there. Keep one of them in config.json "
                "(the scaling inside rope_parameters, or rope_theta beside rope_scaling)")
    else:
        theta, scaling = params.get("rope_theta", cfg.get("rope_theta", 10000.0)), _scaling(params)
    if scaling.get("rope_type") in ("llama3", "yarn"):
        if "original_max_position_embeddings" in cfg:
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_pos)
    if scaling.get("rope_type") == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return theta, scaling


def rope_theta(theta, scaling: dict) -> float:
    """config.json's `theta` as a float, once it and `scaling`'s factor are finite numbers above 0, else a ValueError
    naming the value (until 2026-12-07 a theta or factor of 0 trained to NaN losses to a "done" run, a null or string
    theta was a traceback)."""
    if not (is_real(theta) and theta > 0):
        raise ValueError(f"config.json: rope_theta {theta!r} must be a number above 0 (RoPE's base, e.g. 10000 or "
                         "1000000; 0 or below makes every angle NaN): fix it in config.json (the checkpoint's own "
                         "value)")
    if (f := scaling.get("factor", 1.0)) is not None and not (is_real(f) and f > 0):
        raise ValueError(f"config.json: RoPE scaling {scaling}: factor {f!r} must be a number above 0 (how many times "
                         "the original context it stretches to, e.g. 4.0; 0 makes every angle NaN): fix it in "
                         "config.json (the checkpoint's own value)")
    return float(theta)


def read_ministral3(cfg: dict, max_pos: int) -> tuple[float, dict, float, float]:
    """(theta, scaling, beta, length) of a ministral3 config.json as transformers reads it: its class's YaRN
    (MINISTRAL3_ROPE) where config.json names no RoPE, and the attention temperature's llama_4_scaling_beta and
    original length from the RoPE dict its attention reads (rope_scaling in place of rope_parameters, as it takes
    them); without either transformers fails in forward, and this refuses."""
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        cfg = {**cfg, "rope_parameters": dict(MINISTRAL3_ROPE)}
    theta, scaling = read_rope(cfg, max_pos)
    beta = (cfg.get("rope_scaling") or cfg["rope_parameters"]).get("llama_4_scaling_beta")
    length = scaling.get("original_max_position_embeddings")   # (none: a plain or linear RoPE)
    if beta is None or length is None:
        raise ValueError(f"config.json: a ministral3 model scales q by rope_parameters' llama_4_scaling_beta and "
                         f"original_max_position_embeddings; its RoPE {scaling or 'default'} lacks "
                         f"{'llama_4_scaling_beta' if beta is None else 'original_max_position_embeddings'} "
                         "(transformers cannot run it either): use the checkpoint's own config.json")
    return theta, scaling, beta, length


def keep_temperature(sc: dict | None, spec: str, args) -> dict | None:
    """`--rope-scaling`'s dict `sc` for a model with an attention temperature (Ministral 3): transformers loaded with
    it (base_config_overrides.json) reads the temperature's beta and length from it, so it carries the beta, and a
    scaling of another original length (or none) is refused."""
    if sc is None or (n := args.attn_temperature_length) is None:
        return sc
    if sc.get("original_max_position_embeddings") != n:
        raise ValueError(f"--rope-scaling {spec}: this {args.model_type} model's attention temperature counts "
                         f"positions in its original length {n}, which RoPE's scaling must keep: pass yarn:F@{n} or a "
                         f"JSON object with \"original_max_position_embeddings\": {n}")
    return {**sc, "llama_4_scaling_beta": args.attn_temperature_beta}


def rope_scaling_flag(spec: str | None, args=None) -> dict | None:
    """`--rope-scaling`: None keeps config.json's scaling; "none" is plain RoPE ({}); "linear:F" or "yarn:F" scale
    by F, "yarn:F@N" with original length N (default, also of a llama3 or yarn object: the original length of
    config.json's own scaling, else its max_position_embeddings, as transformers takes it); a JSON object
    is transformers' rope_scaling form ({"rope_type": "llama3", "factor": 8, ...}): numbers finite and > 0 (a factor
    from 1 to 1024), `truncate` a bool, no other keys. Without `args` only the syntax is checked (start-up, before
    config.json is read); a bad value raises ValueError naming the forms."""
    if spec is None:
        return None
    forms = 'none, linear:F, yarn:F or yarn:F@N (F >= 1, N the original length) or a JSON object such as ' \
        '\'{"rope_type": "yarn", "factor": 4}\''
    if spec.strip() == "none":
        return {}
    if spec.lstrip().startswith("{"):
        try:
            sc = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--rope-scaling {spec}: not valid JSON ({e.msg}); pass {forms}") from None
        if not isinstance(sc, dict):
            raise ValueError(f"--rope-scaling {spec}: pass {forms}")
        sc = dict(sc)
        if "type" in sc and "rope_type" not in sc:
            sc["rope_type"] = sc.pop("type")
    else:
        kind, _, rest = spec.partition(":")
        factor, at, orig = rest.partition("@")
        try:
            sc = {"rope_type": kind.strip(), "factor": float(factor)}
            if at:
                sc["original_max_position_embeddings"] = int(orig)
        except ValueError:
            raise ValueError(f"--rope-scaling {spec}: pass {forms}") from None
        if at and sc["rope_type"] != "yarn":
            raise ValueError(f"--rope-scaling {spec}: @N (the original length) is YaRN's; pass {forms}")
        if sc["rope_type"] not in ("linear", "yarn"):
            raise ValueError(f"--rope-scaling {spec}: TYPE:F takes linear or yarn (other types: a JSON object); "
                             f"pass {forms}")
    if sc.get("rope_type") not in ROPE_TYPES:
        raise ValueError(f"--rope-scaling {spec}: rope type {sc.get('rope_type')!r} is not one of {ROPE_TYPES}")
    f = sc.get("factor")
    if sc["rope_type"] != "default" and not (is_real(f) and 1 <= f <= 1024):
        raise ValueError(f"--rope-scaling {spec}: the factor must be a number from 1 to 1024, got {f!r}")
    keys = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim", "low_freq_factor", "high_freq_factor"}
    for k, v in sc.items():
        if k == "rope_type" or k == "truncate" and isinstance(v, bool):
            continue
        if k == "truncate":
            raise ValueError(f"--rope-scaling {spec}: truncate must be true or false, got {v!r}")
        if k not in keys:
            raise ValueError(f"--rope-scaling {spec}: unknown key {k!r}; known: rope_type, truncate, "
                             f"{', '.join(sorted(keys))}")
        if not (is_real(v) and v > 0):
            raise ValueError(f"--rope-scaling {spec}: {k} must be a finite number > 0, got {v!r}")
    if sc["rope_type"] == "default":
        return {}
    for k, v in sc.items():   # one spelling per value: 4 and 4.0 are the same factor
        if k not in ("rope_type", "truncate"):
            sc[k] = int(v) if k == "original_max_position_embeddings" and v == int(v) else float(v)
    if args is not None and sc["rope_type"] in ("llama3", "yarn"):   # the model's own original length when
        sc.setdefault("original_max_position_embeddings",   # config.json scales (Llama 3.1: 8192, not its 131072; a
                      (args.rope_scaling or {}).get("original_max_position_embeddings", args.max_position_embeddings))
        # YaRN config's 32768 under 131072: yarn:8 is then its factor 4 doubled, as the warning advises), else as
        # read_rope takes it: max_position_embeddings
    return sc


def put_rope(cfg: dict, rope: dict) -> None:
    """The RoPE an adapter learned with (base_config_overrides.json's rope_parameters) into config dict `cfg`, in the
    form it has (also data/demo_compare.py's base). One per layer type (ModelArgs.rope_overrides: Gemma 3's, OLMo 3's)
    is the config's RoPE whole; a flat one into a config per layer type (an adapter from before 2026-12-07): its
    full-attention layers' (what --rope-scaling replaces; a flat dict there transformers reads as the full layers'
    default RoPE)."""
    if isinstance(rope.get("full_attention"), dict):   # per layer type (ModelArgs.rope_overrides: Gemma 3, OLMo 3):
        cfg["rope_parameters"] = rope   # in transformers 5's form, which the classic keys would override
        for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
            cfg.pop(key, None)
    elif "rope_parameters" in cfg:   # transformers 5's form (a top-level rope_scaling would win over it)
        per_type = isinstance((cfg["rope_parameters"] or {}).get("full_attention"), dict)
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "full_attention": rope} if per_type else rope
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
    else:   # the classic form: rope_theta and rope_scaling on top (which transformers 4 reads)
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
