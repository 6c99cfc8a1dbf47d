"""What train.py builds to train, against peft's own: `--lora-plus-ratio R` (LoRA+) groups the LoRA tensors as peft's
`create_loraplus_optimizer` does (each B at R × the LR, each A at the LR), and three AdamW steps on the same gradients
through train.py's `make_optimizer` and `set_lr` move every LoRA tensor as peft's optimizer moves its twin on the
transformers model (also with --dora: the magnitudes in B's group, as peft puts 1-D tensors; 4 ranks = 1 with the
flag, and its resume: tests/test_train.py); `--lora-targets all-linear` adapts the projections peft's "all-linear"
adapts."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers import tiny_checkpoint


@pytest.mark.parametrize("ratio,weight_decay,dora", [(16.0, 0.0, False), (4.0, 0.1, False), (4.0, 0.1, True)])
def test_lora_plus_steps_as_peft_create_loraplus_optimizer(tmp_path, ratio, weight_decay, dora):
    import transformers as T
    from peft import LoraConfig, get_peft_model
    from peft.optimizers import create_loraplus_optimizer

    import train
    from model.lora_spec import LORA_TARGETS
    from parallel.parallelize import BuildOptions, build_model, lora_groups

    ckpt = tiny_checkpoint(tmp_path / "ckpt", layers=2)
    model, peft_model = build_model(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=5, dora=dora))
    hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32),
                        LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                                   use_dora=dora))
    ours = {k: p for k, p in peft_model.named_parameters() if p.requires_grad}
    theirs = {k: p for k, p in hf.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 14 * (3 if dora else 2)
    with torch.no_grad():
        for k, p in theirs.items():
            p.copy_(ours[k])

    args = argparse.Namespace(lr=3e-3, weight_decay=weight_decay, warmup=0, lr_schedule="constant", min_lr_ratio=None,
                              wsd_decay=None, lora_plus_ratio=ratio)
    groups = lora_groups(model, args.lora_plus_ratio)
    opt = train.make_optimizer(groups, args)
    ref = create_loraplus_optimizer(hf, torch.optim.AdamW, lr=args.lr, loraplus_lr_ratio=ratio,
                                    loraplus_weight_decay=weight_decay, weight_decay=weight_decay, betas=(0.9, 0.999))
    name = {id(p): k for k, p in ours.items()} | {id(p): k for k, p in theirs.items()}
    mine = [{name[id(p)] for p in g["params"]} for g in opt.param_groups]
    peft_groups = [{name[id(p)] for p in g["params"]} for g in ref.param_groups]   # A, embedding, B, B without decay
    assert mine == [peft_groups[0], peft_groups[2] | peft_groups[3]] and not peft_groups[1], (mine, peft_groups)
    assert all(".lora_B." in k or dora and ".lora_magnitude_vector." in k for k in mine[1])   # (peft: DoRA's
    assert len(mine[1]) == 14 * (2 if dora else 1)   # magnitudes, 1-D, at B's rate)

    g = torch.Generator().manual_seed(0)
    for step in range(3):
        train.set_lr(opt, train.lr_at(step, args, 3))
        for k, p in ours.items():
            p.grad = torch.randn(p.shape, generator=g)
            theirs[k].grad = p.grad.clone()
        opt.step()
        ref.step()
    assert [grp["lr"] for grp in opt.param_groups] == [args.lr, args.lr * ratio]
    moved = {"A": 0.0, "B": 0.0}
    for k, p in ours.items():
        torch.testing.assert_close(p.detach(), theirs[k].detach(), rtol=1e-6, atol=1e-7, msg=k)
    start, _ = build_model(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=5, dora=dora))
    for k, p in start.named_parameters():
        if p.requires_grad and "magnitude" not in k:
            moved["B" if "lora_B" in k else "A"] += (dict(model.named_parameters())[k] - p).abs().mean().item()
    assert moved["B"] > 2 * moved["A"], f"B should move about {ratio}x as far as A: {moved}"


def test_lora_targets_shorthands_are_peft_all_linear_and_the_sublayers(tmp_path):
    """--lora-targets all-linear = the modules peft's target_modules="all-linear" wraps on the transformers model
    (every linear layer but the head); attn and mlp its attention's and MLP's; written among names, each once, in
    place; the result (less the names of Qwen3.5's linear layers a model without them drops: model_targets, as
    check_model_flags does) is what the run records and builds with (Qwen3.5's: tests/test_qwen3_5_hybrid.py)."""
    import transformers as T
    from peft import LoraConfig, get_peft_model

    import train
    from model.load import read_args
    from model.lora_spec import model_targets

    path = tiny_checkpoint(tmp_path / "ckpt", layers=2)
    hf = get_peft_model(T.AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=2, target_modules="all-linear"))
    wrapped = {n.split(".")[-1] for n, m in hf.named_modules() if hasattr(m, "lora_A")}
    parse = lambda t: list(model_targets(train.build_parser().parse_args(   # noqa: E731
        [] if t is None else ["--lora-targets", t]).lora_targets.split(","), read_args(path)))
    assert set(parse("all-linear")) == wrapped and len(wrapped) == 7, wrapped
    assert parse("all-linear") == parse("attn,mlp") == parse(None)
    assert {n for n in wrapped if n in parse("attn")} == {n for n in wrapped if ".self_attn." in next(
        k for k, _ in hf.named_modules() if k.endswith("." + n))}
    assert parse("v_proj,attn") == ["v_proj", "q_proj", "k_proj", "o_proj"] and parse("mlp,down_proj") == [
        "gate_proj", "up_proj", "down_proj"]
