"""GPT-OSS's MXFP4 release (openai/gpt-oss-20b, 120b as shipped: the experts' `*_blocks` / `*_scales`, model/gpt_oss.py)
reads as transformers dequantizes it, trains with train.py, and merges into the BF16 form transformers loads.

Pins (CPU; a tiny random GptOssForCausalLM made by transformers 5.25 (tests/test_gpt_oss.py's _save: 2 layers, 6
experts top 2, widths 32 so the in dims are whole 32-blocks), its experts written in MXFP4 from random codes (every
byte, scales 2^-5 .. 2^2), the rest bf16, config.json's quantization_config as the Hub's; the reference is
transformers' own: from_pretrained with Mxfp4Config(dequantize=True), which runs on CPU, and its
convert_moe_packed_tensors):
- dequantize = convert_moe_packed_tensors, every code and scale byte, bit for bit (float32 and bf16);
- every expert weight built here = the transposed, de-interleaved part of transformers' dequantized gate_up_proj /
  down_proj, bit for bit; the logits = transformers'; an expert's read touches only its own bytes of the blocks and
  scales; --quant nf4 builds the same NF4 codes as from the BF16 form (transformers' dequantized weights saved);
- `python -m model.merge` of an MXFP4 base: the fused BF16 tensors, no blocks/scales nor quantization_config, loaded
  by plain transformers = peft's merge_and_unload on transformers' dequantized model; its log says so;
- refusals name the tensor: blocks not uint8, scales missing or not blocks' shape, fused shape against config.json;
  quant_method mxfp4 on another model_type;
- train.py --quant nf4 on it: 1 rank = the BF16 form's run; cp 2 ring (2 ranks) = 1 rank.

Run: .venv/bin/python -m pytest -q tests/test_gpt_oss_mxfp4.py
"""

import json
import os
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import model
from tests.test_gpt_oss import ATTN, _save, clamp_as_configured  # noqa: F401 (autouse: the reference clamps as configured)

QCFG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}


def rel(a, b):
    return ((a - b).float().norm() / b.float().norm()).item()


def _mxfp4(src, dst, seed=7):
    """The checkpoint at `src` with its fused experts replaced by random MXFP4 codes and scales (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, n_in, n_out = v.shape
            out[k + "_blocks"] = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
            out[k + "_scales"] = torch.randint(122, 130, (E, n_out, n_in // 32), generator=g, dtype=torch.uint8)
        else:
            out[k] = v.to(torch.bfloat16)
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "config.json" and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": QCFG}, f, indent=1)
    return str(dst)


def _hf(path):
    """transformers' dequantized model, float32 throughout: transformers 5.17 leaves the dequantized experts bf16
    under dtype=float32 (5.25 casts them; their values are exact in either), so its experts ran in bf16 (logits 9e-3
    off)."""
    return T.AutoModelForCausalLM.from_pretrained(path, quantization_config=T.Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32).float().eval()


def _save_bf16_form(hf, dst):
    """transformers' dequantized model `hf` saved in bf16 without quantization_config: its state dict by its own names,
    which is what save_pretrained writes under transformers 5.25 (checked alike, names and bytes, 2026-12-07); 5.17's
    save_pretrained of a dequantized MXFP4 model writes the experts as 'gate_up_proj$' and 'down_proj$', once."""
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    d = tmp_path_factory.mktemp("mxfp4")
    return _mxfp4(_save(d / "bf16", intermediate_size=32), d / "mx")


def test_dequantize_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from model.gpt_oss import dequantize

    blocks = torch.arange(256, dtype=torch.uint8).view(2, 4, 2, 16)   # every byte: both nibbles, each code
    scales = torch.tensor([100, 120, 126, 127, 128, 130, 140, 160], dtype=torch.uint8).view(2, 4, 1).expand(2, 4, 2)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales.contiguous(), dtype=dtype)
        got = dequantize(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape == (2, 64, 4) and torch.equal(got, want), dtype


def test_loads_as_transformers_dequantizes_it(mx, tmp_path):
    from model.load import CheckpointReader
    from parallel.parallelize import BuildOptions, build_model

    hf = _hf(mx)
    ours = model.from_pretrained(mx).eval()
    for i, blk in enumerate(ours.model.layers):
        x = hf.model.layers[i].mlp.experts
        for e, ex in enumerate(blk.mlp.experts):
            for w, want in ((ex.gate_proj.weight, x.gate_up_proj[e][:, 0::2].mT),
                            (ex.up_proj.weight, x.gate_up_proj[e][:, 1::2].mT),
                            (ex.down_proj.weight, x.down_proj[e].mT), (ex.gate_proj.bias, x.gate_up_proj_bias[e][0::2]),
                            (ex.down_proj.bias, x.down_proj_bias[e])):
                assert torch.equal(w, want), f"layer {i} expert {e}"
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(ids), hf(input_ids=ids).logits) < 1e-5, "logits"
    reader, seen = CheckpointReader(mx), []
    get_bytes = reader.get_bytes
    reader.get_bytes = lambda n, a, b: seen.append((n, a, b)) or get_bytes(n, a, b)
    reader.get("model.layers.1.mlp.experts.4.up_proj.weight")
    p = "model.layers.1.mlp.experts.gate_up_proj"
    assert seen == [(f"{p}_blocks", 4 * 64 * 16, 5 * 64 * 16), (f"{p}_scales", 4 * 64, 5 * 64)], seen
    # --quant nf4: the same NF4 codes as from the BF16 form (transformers' dequantized weights, saved as bf16)
    bf16 = tmp_path / "bf16_form"
    _save_bf16_form(hf, bf16)
    assert not any(k.endswith(("_blocks", "_scales")) for k in load_file(bf16 / "model.safetensors"))
    built = [build_model(BuildOptions(p, quant="nf4", lora_targets=ATTN, ac=False), device="cpu")[0].state_dict()
             for p in (mx, str(bf16))]
    assert built[0].keys() == built[1].keys() and any(".experts.3.down_proj.weight" in k for k in built[0])
    for k, v in built[0].items():   # (bytes: an NF4 weight's codes are stored in a float tensor, NaNs among them)
        assert torch.equal(v.reshape(-1).view(torch.uint8), built[1][k].reshape(-1).view(torch.uint8)), k


def test_merge_writes_the_bf16_form_transformers_loads(mx, tmp_path, capsys):
    from peft import PeftModel

    from model import merge
    from model.export import export_adapter
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    _, peft_model = build_nonzero_b(BuildOptions(mx, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ATTN, seed=3))
    export_adapter(peft_model, str(tmp_path / "a"), mx, quant="none")
    out = str(tmp_path / "merged")
    assert merge.main(["--model", mx, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "bf16"]) == 0
    said = capsys.readouterr().out
    assert "MXFP4 experts (4 fused tensors) are written dequantized, the BF16 form transformers loads" in said, said
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert not any(k.endswith(("_blocks", "_scales")) for k in stored)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 32, 64)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    hf = _hf(mx)
    for i in range(2):   # the experts, as transformers dequantizes them (exact in bf16)
        for k in ("gate_up_proj", "down_proj"):
            assert torch.equal(stored[f"model.layers.{i}.mlp.experts.{k}"].float(),
                               getattr(hf.model.layers[i].mlp.experts, k)), (i, k)
    want = PeftModel.from_pretrained(hf, str(tmp_path / "a")).merge_and_unload()
    got, info = T.GptOssForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(got(input_ids=ids).logits, want(input_ids=ids).logits) < 2e-2, "merge (bf16)"


def _edit(mx, dst, change):
    d = shutil.copytree(mx, dst)
    sd = load_file(os.path.join(d, "model.safetensors"))
    change(sd)
    save_file(sd, os.path.join(d, "model.safetensors"))
    return str(d)


def test_bad_blocks_and_scales_are_refused_naming_them(mx, tmp_path):
    from model.load import CheckpointReader, read_args
    from model.load_checks import check_config_shapes

    p = "model.layers.1.mlp.experts.down_proj"
    cases = {
        "int8": (lambda sd: sd.update({f"{p}_blocks": sd[f"{p}_blocks"].view(torch.int8)}),
                 f"{p}_blocks torch.int8 [6, 32, 1, 16]"),
        "no_scales": (lambda sd: sd.pop(f"{p}_scales"), f"{p}_scales missing"),
        "scales_shape": (lambda sd: sd.update({f"{p}_scales": sd[f"{p}_scales"][:, :16].contiguous()}),
                         f"{p}_blocks [6, 32, 1, 16], {p}_scales [6, 16, 1]"),
    }
    for what, (change, says) in cases.items():
        d = _edit(mx, tmp_path / what, change)
        for check in (lambda d=d: CheckpointReader(d), lambda d=d: check_config_shapes(d, read_args(d))):
            with pytest.raises(ValueError, match="MXFP4 experts") as e:
                check()
            assert says in str(e.value) and "re-download" in str(e.value), (what, str(e.value))
    # blocks of another width than config.json's: the fused tensor named, as its BF16 form's shape
    d = _edit(mx, tmp_path / "narrow", lambda sd: sd.update({f"{p}_blocks": sd[f"{p}_blocks"][:, :16].contiguous(),
                                                             f"{p}_scales": sd[f"{p}_scales"][:, :16].contiguous()}))
    with pytest.raises(ValueError, match=f"{p} in .*: checkpoint \\[6, 32, 16\\], config.json implies \\[6, 32, 32\\]"):
        check_config_shapes(d, read_args(d))
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        model.ModelArgs.from_config_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                          "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8,
                                          "quantization_config": QCFG})


def _bf16_form(mx, dst):
    """transformers' dequantized model of `mx`, saved in bf16 (the BF16 form), with its tokenizer."""
    _save_bf16_form(_hf(mx), dst)
    for f in os.listdir(mx):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(mx, f), dst)
    return str(dst)


def _ring(rank, world_size, assets, out):
    import train
    from tests.helpers import train_argv

    train.main(train_argv(assets, out, "--quant", "nf4", "--lora-targets", "attn", "--cp", "2", "--cp-impl", "ring",
                          "--steps", "2"))
    return True


@pytest.mark.timeout(400)
def test_train_nf4_on_mxfp4_as_on_the_bf16_form_and_cp2_ring(tmp_path_factory):
    """train.py --quant nf4, 2 steps: the MXFP4 checkpoint trains as its BF16 form (the same NF4 weights) and cp 2 ring
    (2 ranks) as 1 rank (test_train's tolerances). Two steps, not 3: on a 2-core AMD EPYC (2026-12-07) ring's float32
    round-off (summed in another order than one rank's) grew ~10x a step through this tiny model's AdamW updates, to
    2.6e-4 of the grad norm at step 3 (step 1: 1.5e-6, step 2: 2.7e-5), with the same experts chosen for every token
    in both runs (the closest 2nd/3rd router logits 3.4e-4 apart) and every adapter tensor off by about as much: no
    discrete difference; the second step already runs after an optimizer update."""
    import train
    from tests.dist import run_ranks
    from tests.fixtures import make_chat_jsonl, make_tokenizer
    from tests.helpers import one_thread, train_argv
    from tests.test_train import _compare

    d = tmp_path_factory.mktemp("mxfp4_run")
    tok = make_tokenizer(d / "bf16")
    src = _save(d / "bf16", vocab_size=len(tok), hidden_size=64, intermediate_size=64, head_dim=16, sliding_window=8,
                num_local_experts=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    mx = _mxfp4(src, d / "mx")
    make_chat_jsonl(str(d / "chat.jsonl"), 40, seed=1)
    runs = {}
    for name, path in (("mx", mx), ("bf16", _bf16_form(mx, d / "bf16_form"))):
        runs[name] = str(d / f"run_{name}")
        with one_thread():
            train.main(train_argv({"model": path, "data": str(d / "chat.jsonl")}, runs[name], "--quant", "nf4",
                                  "--lora-targets", "attn", "--steps", "2"))
    _compare("MXFP4 = its BF16 form", runs["mx"], runs["bf16"], steps=(1, 2))
    ring = str(d / "run_ring")
    assert run_ranks(_ring, 2, {"model": mx, "data": str(d / "chat.jsonl")}, ring, timeout=350) == [True, True]
    _compare("cp 2 ring = 1 rank", ring, runs["mx"], steps=(1, 2))
