"""`--lora-layers SPEC`: LoRA on some blocks only, as peft's `layers_to_transform` adapts them.

Pins (CPU, float32, a tiny 3-block Qwen2 made by transformers, LoRA r 4 / alpha 8, B non-zero):
- the spelling: ranges and indices written back sorted and joined ("8-11,4" -> "4,8-11"), "all" is None, bad ones
  refused naming the part; an index past the model's blocks refused before any weight is read;
- our model with `--lora-layers 1-2` (plain and nf4; also with --dora) has LoRA tensors on blocks 1 and 2 only, and
  its summed loss and every LoRA gradient equal peft's with `layers_to_transform=[1, 2]` on the transformers model;
- block 0, below the lowest adapted block, runs with nothing to differentiate: its output needs no grad, and the
  forward (no AC) saves fewer tensors than with every block adapted, fewer still with block 2 alone;
- the exported adapter says `layers_to_transform` and loads in `peft.PeftModel.from_pretrained` with our logits;
  `--init-adapter` with LoRA on a block outside `--lora-layers` is refused; a resume keeps the flag.
(Layouts: test_qlora's "--lora-layers" case; a 4-rank run = 1 rank: test_train.)

Run: .venv/bin/python -m pytest -q tests/test_lora_layers.py
"""

import argparse
import os

import pytest
import torch

from tests.helpers import tiny_checkpoint

R, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("base"), layers=3)


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 19), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1), torch.arange(19).expand(2, 19)


def _ours(path, quant, layers=(1, 2), dora=False, ac=True):
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    return build_nonzero_b(BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA, lora_layers=layers, dora=dora,
                                        seed=3, ac=ac))


def test_the_spelling():
    from model.lora_spec import lora_layers, lora_layers_arg

    assert lora_layers_arg("all") is None and lora_layers(None) is None
    assert lora_layers_arg("8-11,4") == "4,8-11" and lora_layers("4,8-11") == (4, 8, 9, 10, 11)
    assert lora_layers_arg("1,2,3,5") == "1-3,5" and lora_layers_arg(" 20-27 ") == "20-27"
    for bad in ("x", "3-1", "-2", "", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a block index or a range"):
            lora_layers_arg(bad)


@pytest.mark.parametrize("quant,dora", [("none", False), ("nf4", False), ("nf4", True)], ids=["plain", "nf4", "dora"])
def test_loss_and_gradients_equal_peft_layers_to_transform(ckpt, quant, dora):
    from peft import LoraConfig, get_peft_model

    from tests.helpers import hf_as_trained

    model, _ = _ours(ckpt, quant, dora=dora)
    mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".")[2] for n in mine} == {"1", "2"} and len(mine) == 2 * 7 * (3 if dora else 2), sorted(mine)
    ref = get_peft_model(hf_as_trained(ckpt, quant), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL,
                                                                layers_to_transform=[1, 2], use_dora=dora,
                                                                init_lora_weights=False))
    theirs = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(mine)
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(mine[n])
    ids, labels, pos = _batch()
    ours, _ = model(ids, position_ids=pos, labels=labels)
    ours.backward()
    logits = ref(input_ids=ids).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg="summed loss")
    for n, p in mine.items():
        torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad {n}")


def test_blocks_below_the_lowest_run_no_backward(ckpt):
    """Without AC (every saved tensor passes autograd's hooks): block 0's output needs no grad and the forward saves
    fewer tensors; with only block 2 adapted, fewer still (block 1 then runs no backward either)."""
    ids, labels, pos = _batch()
    saved = {}
    for name, layers in (("all", None), ("1-2", (1, 2)), ("2", (2,))):
        model, _ = _ours(ckpt, "nf4", layers, ac=False)
        out, n = {}, []
        model.model.layers[0].register_forward_hook(lambda m, a, o, out=out: out.setdefault("block 0", o))
        with torch.autograd.graph.saved_tensors_hooks(lambda t, n=n: n.append(1) or t, lambda t: t):
            model(ids, position_ids=pos, labels=labels)
        saved[name] = len(n)
        assert out["block 0"].requires_grad == (layers is None), name
    assert saved["2"] < saved["1-2"] < saved["all"], saved


def test_the_adapter_says_its_layers_and_loads_in_peft(ckpt, tmp_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from model.export import export_adapter

    model, peft_model = _ours(ckpt, "none")
    export_adapter(peft_model, str(tmp_path / "adapter"), ckpt)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["layers_to_transform"] == [1, 2]
    ids, _, pos = _batch()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
                                     str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, model(ids, position_ids=pos), rtol=1e-5, atol=1e-5)


def test_refusals_and_resume(ckpt, tmp_path):
    import train
    from model.export import export_adapter
    from model.load import read_args
    from parallel.flags import check_model_flags
    from parallel.resume import check_resume

    margs = read_args(ckpt)
    parse = lambda *f: train.build_parser().parse_args(["--model", ckpt, "--lora-r", "4", *f])   # noqa: E731
    with pytest.raises(ValueError, match=r"--lora-layers 2-3: the model has blocks 0-2; pass indices below 3"):
        check_model_flags(parse("--lora-layers", "2-3"), margs)
    _, peft_model = _ours(ckpt, "none", layers=None)   # LoRA on every block
    export_adapter(peft_model, str(tmp_path / "all"), ckpt)
    check_model_flags(parse("--init-adapter", str(tmp_path / "all")), margs)
    with pytest.raises(ValueError, match=r"adapts blocks 0, which --lora-layers leaves out"):
        check_model_flags(parse("--init-adapter", str(tmp_path / "all"), "--lora-layers", "1-2"), margs)
    check_resume({"lora_r": 4}, {"lora_r": 4, "lora_layers": None})   # (a run from before the flag: every block)
    with pytest.raises(ValueError, match="--lora-layers: the checkpoint has all, this run '1-2'"):
        check_resume({"lora_r": 4}, {"lora_r": 4, "lora_layers": "1-2"})
    assert os.path.isdir(tmp_path / "all")


def test_offload_copies_no_input_of_a_block_that_runs_no_backward(ckpt):
    """--offload-activations with LoRA on block 2 alone: block 0's input is the token ids' lookup, block 1 runs
    nothing to differentiate (not even a checkpoint), so block 2's input is the one copied to host; the step's
    gradients equal the run without AC."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    ids, labels, pos = _batch()
    grads = {}
    for name, mem in (("plain", dict(ac=False)), ("offload", dict(ac=True, offload_activations=True))):
        model, _ = build_nonzero_b(BuildOptions(ckpt, quant="nf4", lora_r=R, lora_alpha=ALPHA, lora_layers=(2,),
                                                seed=3, **mem))
        s, n = model(ids, position_ids=pos, labels=labels)
        s.backward()
        grads[name] = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
        if name == "offload":
            moved = model.model.layers[0].forward.hooks.moved
    assert moved == 1, f"{moved} block inputs copied to host, want block 2's alone"
    for k, g in grads["plain"].items():
        torch.testing.assert_close(grads["offload"][k], g, rtol=1e-5, atol=1e-7, msg=k)
