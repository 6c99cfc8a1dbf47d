"""`--train-norms`: the RMSNorm weights train beside LoRA as peft's `modules_to_save` trains them, and the adapter is
peft's.

Pins (CPU, float32, tiny transformers checkpoints with their norm weights drawn away from 1: a Qwen2 with q/k/v bias
and a Qwen3 with q/k norms; LoRA r 4 / alpha 8, B non-zero, every trained norm moved off the base's), against
transformers + peft on the same weights (nf4: the transformers model holding `nf4_round_trip(W)`):
- the trained tensors are LoRA's and every norm of the adapted blocks plus the final one, as peft's
  `modules_to_save` (with `layers_to_transform` for --lora-layers) makes them; the summed loss and every LoRA and
  norm gradient equal peft's (plain, nf4, Qwen3, --lora-layers 1, --dora);
- the exported adapter names them in modules_to_save, loads in `PeftModel.from_pretrained` with no missing or
  unexpected key and gives our logits; `model.merge` writes what peft's `merge_and_unload` holds; --init-adapter
  rebuilds the model (and is refused without --train-norms, naming it);
- an adapter holding norms its modules_to_save do not name for the installed peft (peft <= 0.21's "norm": every
  norm) computes as PeftModel loads it (each tensor into its weight): --init-adapter's logits and the merge are peft's;
- the optimizer's groups keep the norms out of weight decay, as transformers' Trainer (`get_decay_parameter_names`)
  does, and with LoRA+ put each tensor at peft's rate (create_loraplus_optimizer: the norms at B's);
- every memory step (AC, tiled MLP and attention, offload, --ac-keep-attn) trains as the plain build, norms included.
(Layouts: test_train's cp2×dp2 run; planner terms: test_plan.)

Run: .venv/bin/python -m pytest -q tests/test_norms.py
"""

import json
import os

import pytest
import torch

from tests.helpers import tiny_checkpoint

R, ALPHA, PAD = 4, 8.0, 7
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _drawn(path):
    """The checkpoint at `path` with its norm weights (and biases) drawn: a trained norm must differ from 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, max_shard_size="60KB")
    assert not os.path.exists(os.path.join(path, "model.safetensors"))   # (a stale file transformers would read)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import transformers as T

    qwen3 = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(T.Qwen3Config(
        vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=4096)).float().save_pretrained(
        qwen3, max_shard_size="60KB")   # (as _drawn saves it again: the same files, none left over)
    return {"qwen2": _drawn(tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), layers=2)), "qwen3": _drawn(str(qwen3)),
            "tied": _drawn(tiny_checkpoint(tmp_path_factory.mktemp("tied"), layers=2, tie=True)),
            # pad_token_id 7, which the batch holds as an input: transformers' embedding (padding_idx) and peft's
            # modules_to_save copy of it never train that row, nor does --train-embeddings (nor a tied head's row)
            "pad": _drawn(tiny_checkpoint(tmp_path_factory.mktemp("pad"), layers=2, pad=PAD)),
            "tied_pad": _drawn(tiny_checkpoint(tmp_path_factory.mktemp("tied_pad"), layers=2, tie=True, pad=PAD))}


def _batch(n=19, pad=None):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, n), generator=g)
    if pad is not None:   # (an input whose row a padding_idx keeps untrained)
        ids[:, [3, 11]] = pad
    return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1), torch.arange(n).expand(2, n)


def _ours(path, quant="none", layers=None, dora=False, emb=False, norms=True, **mem):
    """Our model with --train-norms (and --train-embeddings where `emb`), B ~ N(0, 0.05) and each trained norm and
    the trained embedding × (1 + 0.1·N(0, 1))."""
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b

    model, peft_model = build_nonzero_b(BuildOptions(path, quant=quant, lora_r=R, lora_alpha=ALPHA, lora_layers=layers,
                                                     dora=dora, train_norms=norms, train_embeddings=emb, seed=3,
                                                     **mem))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and (n.endswith("norm.weight") or "embed_tokens" in n):
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model, peft_model


def _peft_twin(path, quant, ours, layers=None, dora=False, targets=ALL):
    """peft on the transformers model: LoRA on `targets`, and the norms (and embedding) we train as modules_to_save,
    holding our tensors."""
    from peft import LoraConfig, get_peft_model

    from model.norms import modules_to_save
    from tests.helpers import hf_as_trained

    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    ref = get_peft_model(hf_as_trained(path, quant), LoraConfig(   # (a tied model: peft's head is its embedding)
        r=R, lora_alpha=ALPHA, target_modules=list(targets), init_lora_weights=False, use_dora=dora,
        layers_to_transform=layers, modules_to_save=modules_to_save(mine),
        ensure_weight_tying=ours.args.tie_embeddings and "model.embed_tokens.weight" in mine))
    theirs = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", ""): p
              for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(mine), (sorted(set(theirs) ^ set(mine)))
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(mine[n])
    return ref, mine, theirs


@pytest.mark.parametrize("family,quant,layers,dora,emb", [
    ("qwen2", "none", None, False, False), ("qwen2", "nf4", None, False, False), ("qwen3", "none", None, False, False),
    ("qwen2", "nf4", (1,), False, False), ("qwen3", "nf4", None, True, False), ("qwen2", "nf4", None, False, True),
    ("qwen3", "none", (0, 1), True, True), ("tied", "nf4", None, False, True), ("tied", "none", (0, 1), True, True),
    ("pad", "none", None, False, True), ("tied_pad", "nf4", None, False, True)],
    ids=["plain", "nf4", "qwen3_qk_norms", "lora_layers_1", "qwen3_nf4_dora", "embeddings_nf4",
         "qwen3_embeddings_dora_layers_0_1", "tied_embeddings_nf4", "tied_embeddings_dora_layers_0_1",
         "embeddings_pad_row", "tied_embeddings_pad_row"])
def test_loss_and_every_gradient_equal_peft_modules_to_save(ckpts, family, quant, layers, dora, emb):
    model, _ = _ours(ckpts[family], quant, layers, dora, emb)
    ref, mine, theirs = _peft_twin(ckpts[family], quant, model, None if layers is None else list(layers), dora)
    norms = sorted(n for n in mine if "norm" in n)
    per_block = 4 if family == "qwen3" else 2
    assert len(norms) == per_block * (2 if layers is None else len(layers)) + 1 and "model.norm.weight" in norms
    assert ("model.embed_tokens.weight" in mine) == emb
    if family == "tied":   # (trained through the head too: peft's ensure_weight_tying ties its head to it)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert ref.base_model.model.lm_head.modules_to_save["default"].weight is theirs["model.embed_tokens.weight"]
    ids, labels, pos = _batch(pad=PAD if "pad" in family else None)
    ours, _ = model(ids, position_ids=pos, labels=labels)
    ours.backward()
    logits = ref(input_ids=ids).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="sum")
    want.backward()
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg="summed loss")
    for n, p in mine.items():
        assert theirs[n].grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad {n}")
    if "pad" in family:   # (the pad row: no gradient through the lookup; a tied head's row gets the loss')
        grad = mine["model.embed_tokens.weight"].grad[PAD]
        assert (grad == 0).all() if family == "pad" else grad.abs().sum() > 0, grad


@pytest.mark.parametrize("family,emb", [("qwen2", False), ("qwen3", False), ("qwen2", True), ("tied", True)],
                         ids=["qwen2", "qwen3", "qwen2_embeddings", "tied_embeddings"])
def test_adapter_loads_in_peft_merges_as_peft_and_starts_a_run(ckpts, family, emb, tmp_path):
    """The exported adapter: peft loads it (a tied model's as peft writes one, the head under ensure_weight_tying)
    and computes our logits; the merge = peft's merge_and_unload; --init-adapter rebuilds the model, refused without
    the flags."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model.adapter_read import check_init_adapter
    from model.export import export_adapter
    from model.merged import merge
    from parallel.parallelize import BuildOptions, build_model, init_from_adapter

    path = ckpts[family]
    model, peft_model = _ours(path, emb=emb)
    export_adapter(peft_model, str(tmp_path / "adapter"), path)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        cfg = json.load(f)
    n_norms = (4 if family == "qwen3" else 2) * 2 + 1
    assert len(cfg["modules_to_save"]) == n_norms + emb and "model.norm" in cfg["modules_to_save"], \
        cfg["modules_to_save"]
    assert ("model.embed_tokens" in cfg["modules_to_save"]) == emb
    assert cfg.get("ensure_weight_tying", False) == (family == "tied"), cfg
    if family == "tied":   # (peft reads a tied head's tensor too, the embedding again: a KeyError without it)
        sd = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        assert torch.equal(sd["base_model.model.lm_head.weight"], sd["base_model.model.model.embed_tokens.weight"])
    ids, _, pos = _batch()
    with torch.no_grad():
        ours = model(ids, position_ids=pos)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     str(tmp_path / "adapter"))
    assert family != "tied" or peft.base_model.model.lm_head.weight is peft.base_model.model.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5, msg="peft's logits")
    want = peft.merge_and_unload().state_dict()
    merge(path, str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype=torch.float32)
    got = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        got.update(load_file(str(f)))
    norms = [k for k in want if k.endswith("norm.weight")] + ["model.embed_tokens.weight"] * emb
    assert len(norms) == n_norms + emb
    for k in norms:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"merged {k}")
    for k in want:
        if k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"merged {k}")
    if family == "tied":   # a tied checkpoint that stores its head as well: the merge replaces it with the embedding
        import shutil

        from safetensors.torch import save_file
        stored = shutil.copytree(path, tmp_path / "stores_head")
        save_file({"lm_head.weight": got["model.embed_tokens.weight"] * 0 + 1}, str(stored / "head.safetensors"))
        with open(stored / "model.safetensors.index.json") as f:
            index = json.load(f)
        index["weight_map"]["lm_head.weight"] = "head.safetensors"
        with open(stored / "model.safetensors.index.json", "w") as f:
            json.dump(index, f)
        merge(str(stored), str(tmp_path / "adapter"), str(tmp_path / "merged_head"), dtype=torch.float32)
        head = load_file(str(tmp_path / "merged_head" / "head.safetensors"))["lm_head.weight"]
        torch.testing.assert_close(head, want["lm_head.weight"], rtol=0, atol=0, msg="merged stored head")
    # --init-adapter: refused without --train-norms (--train-embeddings), naming it; with it, the model comes back
    with pytest.raises(ValueError, match="no --train-norms \\(pass --train-norms\\)"):
        check_init_adapter(str(tmp_path / "adapter"), R, ALPHA, ALL, train_embeddings=emb)
    if emb:
        with pytest.raises(ValueError, match="no --train-embeddings \\(pass --train-embeddings\\)"):
            check_init_adapter(str(tmp_path / "adapter"), R, ALPHA, ALL, train_norms=True)
    check_init_adapter(str(tmp_path / "adapter"), R, ALPHA, ALL, train_norms=True, train_embeddings=emb)
    again, _ = build_model(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, train_norms=True,
                                        train_embeddings=emb, seed=9), device="cpu")
    init_from_adapter(again, str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(again(ids, position_ids=pos), ours, rtol=1e-5, atol=1e-5, msg="--init-adapter")


def _short_argv(path, adapter, *flags):
    import train

    return train.build_parser().parse_args(["--model", path, "--lora-r", str(R), "--lora-alpha", str(ALPHA),
                                            "--init-adapter", adapter, *flags])


@pytest.mark.parametrize("family,mods", [
    ("qwen3", ["norm", "embed_tokens"]), ("qwen2", ["norm", "input_layernorm", "post_attention_layernorm",
                                                    "embed_tokens"]),
    ("qwen2", ["input_layernorm", "model.norm"]), ("tied", ["norm", "embed_tokens"])],
    ids=["qwen3_norm_embed", "qwen2_as_users_write_them", "qwen2_block_norms_and_full_name", "tied_norm_embed"])
def test_peft_short_modules_to_save_start_a_run_as_peft_computes(ckpts, family, mods, tmp_path):
    """peft's own adapter with modules_to_save in its short form (LoraConfig's, matched as name suffixes by the
    installed peft's rule: "norm" is every norm, Qwen3's q/k norms too, up to peft 0.21, model.norm alone from 0.22):
    what it saved is what model.adapter_read reads the names as; --init-adapter's checks take it (asking for the flags
    that train what it saved; a tied model's under peft's ensure_weight_tying), the model it starts gives PeftModel's
    logits, its export loads in peft again with them, and the merge writes what merge_and_unload holds."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model.export import export_adapter
    from model.load import read_args
    from model.merged import merge
    from model.saved_modules import peft_saves
    from parallel.flags import check_flags, check_model_flags
    from parallel.parallelize import BuildOptions, build_model

    path, emb = ckpts[family], "embed_tokens" in mods
    hf = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)   # noqa: E731
    theirs = get_peft_model(hf(), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL, init_lora_weights=False,
                                             modules_to_save=list(mods), ensure_weight_tying=family == "tied"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # (the saved modules moved off the base's: a start from the base's would show)
        for n, p in theirs.named_parameters():
            if ".modules_to_save.default." in n:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    theirs.save_pretrained(str(tmp_path / "peft"))
    saved = json.load(open(tmp_path / "peft" / "adapter_config.json"))["modules_to_save"]
    assert "norm" in saved or "input_layernorm" in saved, saved   # (the short form, as peft wrote it)
    held = [k for k in load_file(str(tmp_path / "peft" / "adapter_model.safetensors")) if ".lora_" not in k]
    # what the installed peft saved for the short names (up to 0.21 any name suffix: "norm" is every norm, q/k norms
    # too; 0.22 a whole dotted one: model.norm alone) is what our reading of them (peft_saves) names, module by module
    named = [n for n, _ in hf().named_modules() if n and any(peft_saves(n, e) for e in mods)]
    assert sorted(k.removeprefix("base_model.model.").removesuffix(".weight") for k in held
                  if k != "base_model.model.lm_head.weight") == sorted(named), (held, named)
    assert len(held) == len(named) + (family == "tied") and len(named) >= 1 + emb, held   # (tied: the head, the same)
    # the start-up checks: the flags that train what it saved asked for, by name; with them, accepted
    with pytest.raises(ValueError, match="no --train-norms \\(pass --train-norms\\)"):
        check_flags(_short_argv(path, str(tmp_path / "peft"), "--train-embeddings"))
    if emb:
        with pytest.raises(ValueError, match="no --train-embeddings \\(pass --train-embeddings\\)"):
            check_flags(_short_argv(path, str(tmp_path / "peft"), "--train-norms"))
    args = _short_argv(path, str(tmp_path / "peft"), "--train-norms", *["--train-embeddings"] * emb)
    check_flags(args)
    check_model_flags(args, read_args(path))
    ours, peft_model = build_model(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, train_norms=True,
                                                train_embeddings=emb, seed=9, init_adapter=args.init_adapter),
                                   device="cpu")
    ids, _, pos = _batch()
    with torch.no_grad():
        want = PeftModel.from_pretrained(hf(), str(tmp_path / "peft")).eval()(input_ids=ids).logits
        torch.testing.assert_close(ours(ids, position_ids=pos), want, rtol=1e-5, atol=1e-5, msg="--init-adapter")
        export_adapter(peft_model, str(tmp_path / "export"), path)
        again = PeftModel.from_pretrained(hf(), str(tmp_path / "export")).eval()
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5, msg="exported, in peft")
    merged = PeftModel.from_pretrained(hf(), str(tmp_path / "peft")).merge_and_unload().state_dict()
    merge(path, str(tmp_path / "peft"), str(tmp_path / "merged"), dtype=torch.float32)
    got = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert got.keys() <= merged.keys() and len(got) >= len(merged) - (family == "tied"), sorted(merged.keys() - got)
    for k in got:
        torch.testing.assert_close(got[k], merged[k], rtol=1e-5, atol=1e-6, msg=f"merged {k}")


def test_peft_short_modules_to_save_of_what_is_not_trained_here_are_refused(ckpts, tmp_path):
    """A short modules_to_save entry that peft matches to a module this trainer does not train (the head, a projection,
    a block's MLP) or to none is refused from adapter_config.json, naming the entry, what it matches and the fix."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from model.adapter_read import check_init_adapter

    path = ckpts["qwen2"]
    get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=ALL, modules_to_save=["lm_head"])).save_pretrained(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="modules_to_save \\['lm_head'\\] \\('lm_head' matches lm_head, not trained "
                                         "here: peft matches each as a name suffix.*merge_and_unload"):
        check_init_adapter(str(tmp_path / "a"), R, ALPHA, ALL, train_norms=True, train_embeddings=True)
    for mods, said in ((["norm", "o_proj"], "'o_proj' matches model.layers.N.self_attn.o_proj, not trained here"),
                       (["mlp"], "'mlp' matches model.layers.N.mlp, not trained here"),
                       (["layers.1"], "'layers.1' matches model.layers.1, not trained here"),
                       (["nrom"], "'nrom' matches no module of a Llama-family model")):
        cfg = json.load(open(tmp_path / "a" / "adapter_config.json"))
        json.dump({**cfg, "modules_to_save": mods}, open(tmp_path / "a" / "adapter_config.json", "w"))
        with pytest.raises(ValueError, match=f"modules_to_save {mods!r} \\(.*{said}".replace("[", "\\[")
                           .replace("]", "\\]")):
            check_init_adapter(str(tmp_path / "a"), R, ALPHA, ALL, train_norms=True, train_embeddings=True)


@pytest.mark.parametrize("mods", [["model.norm"], ["norm"]], ids=["full_name", "short_as_peft_0_21_saved_it"])
def test_trained_norms_beyond_modules_to_save_compute_as_peft_loads_them(ckpts, mods, tmp_path):
    """An adapter whose tensors hold trained norms its modules_to_save do not name for the installed peft (what peft up
    to 0.21 saved for "norm": every norm, which 0.22 reads as model.norm alone): PeftModel still computes with every
    one (its state-dict load puts a tensor of no saved module into the base's weight, asked of peft here), and so do
    we: --init-adapter (with --train-norms) starts the model giving PeftModel's logits, the merge is merge_and_unload's.
    """
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model.adapter_read import check_init_adapter
    from model.merged import merge
    from parallel.parallelize import BuildOptions, build_model

    path, a = ckpts["qwen2"], tmp_path / "a"
    hf = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)   # noqa: E731
    theirs = get_peft_model(hf(), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL, init_lora_weights=False,
                                             modules_to_save=["model.norm", "input_layernorm",
                                                              "post_attention_layernorm"]))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if ".modules_to_save.default." in n:
                p.mul_(1.5)
    theirs.save_pretrained(str(a))
    held = {k: v for k, v in load_file(str(a / "adapter_model.safetensors")).items() if ".lora_" not in k}
    assert len(held) == 5, sorted(held)   # (model.norm and 2 blocks' 2 norms: every norm, as 0.21's "norm" saved)
    cfg = json.load(open(a / "adapter_config.json"))
    json.dump({**cfg, "modules_to_save": mods}, open(a / "adapter_config.json", "w"))
    peft_model = PeftModel.from_pretrained(hf(), str(a)).eval()
    for k, v in held.items():   # the weight each norm computes with (peft's saved copy, else the base's own)
        m = peft_model.get_submodule(k.removesuffix(".weight"))
        w = m.modules_to_save["default"].weight if hasattr(m, "modules_to_save") else m.weight
        assert torch.equal(w, v), f"peft computes {k} without the adapter's"
    check_init_adapter(str(a), R, ALPHA, ALL, train_norms=True)
    ours, _ = build_model(BuildOptions(path, quant="none", lora_r=R, lora_alpha=ALPHA, train_norms=True, seed=9,
                                       init_adapter=str(a)), device="cpu")
    ids, _, pos = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, position_ids=pos), peft_model(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5, msg="--init-adapter")
    merge(path, str(a), str(tmp_path / "merged"), dtype=torch.float32)
    want = PeftModel.from_pretrained(hf(), str(a)).merge_and_unload().state_dict()
    got = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert got.keys() == want.keys(), sorted(want.keys() ^ got.keys())
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"merged {k}")


def test_weight_decay_skips_the_norms_as_transformers_trainer_does(ckpts):
    """The norms outside weight decay, the trained embedding inside it, as transformers' Trainer decides; LoRA+'s rates
    as peft's (the embedding, a saved module, at the LR)."""
    from peft.optimizers import create_loraplus_optimizer
    from transformers import Trainer

    from parallel.parallelize import lora_groups

    model, _ = _ours(ckpts["qwen3"], emb=True)
    ref, _, _ = _peft_twin(ckpts["qwen3"], "none", model)
    name = {id(p): n for n, p in model.named_parameters()}
    trained = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
               for n, p in ref.named_parameters() if p.requires_grad}
    decayed = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
               for n in Trainer.get_decay_parameter_names(None, ref)} & trained
    groups = lora_groups(model)
    assert {name[id(p)] for g in groups if g.get("weight_decay", 1) != 0 for p in g["params"]} == decayed
    # LoRA+: each tensor at peft's rate (create_loraplus_optimizer: A at the LR, B and the 1-D norms at 16x); the norms
    # still without decay (peft's LoRA+ decays them: its no-decay set is by class, nn.LayerNorm, which RMSNorm is not)
    opt = create_loraplus_optimizer(ref, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16)
    rate = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", ""): g["lr"] / 1e-3
            for g in opt.param_groups for n, p in ref.named_parameters() if any(p is q for q in g["params"])}
    plus = lora_groups(model, 16.0)
    assert {name[id(p)]: g.get("lr_ratio", 1.0) for g in plus for p in g["params"]} == rate
    assert rate["model.embed_tokens.weight"] == 1.0 and "model.embed_tokens.weight" in decayed
    assert {name[id(p)] for g in plus if g.get("weight_decay", 1) != 0 for p in g["params"]} == decayed


def test_the_model_line_counts_what_peft_trains(ckpts):
    """The run's `model:` line (parallel/notes.model_line): LoRA, the norms and the embedding apart, adding up to what
    peft's twin trains (`get_nb_trainable_parameters`), its LoRA tensors and its saved modules' each."""
    import argparse

    from model.config import ModelArgs
    from parallel.notes import model_line

    model, _ = _ours(ckpts["qwen3"], emb=True)
    ref, _, theirs = _peft_twin(ckpts["qwen3"], "none", model)
    count = lambda keep: sum(p.numel() for n, p in theirs.items() if keep(n))
    lora, emb = count(lambda n: ".lora_" in n), count(lambda n: "embed_tokens" in n)
    norms = count(lambda n: n.endswith("norm.weight"))
    assert lora + norms + emb == ref.get_nb_trainable_parameters()[0] and min(lora, norms, emb) > 0
    margs = ModelArgs.from_config_dict(json.load(open(os.path.join(ckpts["qwen3"], "config.json"))))
    args = argparse.Namespace(init_adapter="A", quant="none")
    m = lambda n: f"{n:,}"
    assert model_line(model, margs, args, None, torch.float32, 1.25) == (
        f"model: qwen3 {margs.n_params / 1e6:.1f}M params, LoRA {m(lora)} trainable + norms {m(norms)} + embedding "
        f"{m(emb)} from A, quant none, torch.float32, built in 1.2s")
    plain, _ = _ours(ckpts["qwen3"], norms=False)   # (a resume: no "from")
    assert model_line(plain, margs, args, "ckpt", torch.float32, 0.0).split(", LoRA ")[1].startswith(
        f"{m(sum(p.numel() for p in plain.parameters() if p.requires_grad))} trainable, quant none")


@pytest.mark.parametrize("mem", [dict(tiled_mlp=True, tiled_attn=True), dict(ac_keep_attn=True),
                                 dict(offload_activations=True, tiled_mlp=True), dict(ac_group=2)],
                         ids=["tiled_mlp_and_attn", "ac_keep_attn", "offload_tiled_mlp", "ac_group"])
def test_memory_steps_train_the_norms_as_the_plain_build(ckpts, mem):
    """One process, nf4 Qwen3 (q/k norms too) with the embedding trained as well, AC with each memory step (the tiles
    run the block norm over their rows and sum its weight's gradient; the recompute; kept attention; offloaded
    checkpoints, the first one the trained embedding's output, not its ids): three SGD steps give the plain build's
    losses and every LoRA, norm and embedding gradient."""
    ids, labels, pos = _batch(100)   # (tiled MLP: 200 tokens in 48-token tiles)

    from tests.helpers import sgd_steps

    steps = lambda **kw: sgd_steps(_ours(ckpts["qwen3"], "nf4", emb=True, **kw)[0], ids, labels, pos)

    for step, ((want, gw), (got, gg)) in enumerate(zip(steps(ac=False), steps(ac=True, **mem))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step} loss")
        assert sum("norm" in k for k in gg) == 9 and "model.embed_tokens.weight" in gg
        for k in gw:
            torch.testing.assert_close(gg[k], gw[k], rtol=1e-4, atol=1e-6, msg=f"step {step} grad {k}")


@pytest.mark.parametrize("emb", [False, True], ids=["norms", "norms_and_embedding"])
def test_dpo_reference_computes_with_the_base_or_the_adapters_norms(ckpts, tmp_path, emb):
    """DPO's reference model with --train-norms (and --train-embeddings): from the base, LoRA off AND the base
    checkpoint's norms and embedding (the transformers model's per-token losses), not the policy's trained ones; from a
    reference adapter, its LoRA, norms and embedding (peft's model of that adapter); the policy's own forward is as
    before once the reference has run."""
    from peft import PeftModel

    from model.adapter_read import read_init_adapter
    from model.export import export_adapter
    from parallel.preference import DPO, Preference
    from tests.helpers import hf_as_trained

    path = ckpts["qwen3"]
    ids, labels, pos = _batch()
    per_token = lambda logits: torch.nn.functional.cross_entropy(   # (0 off target, as the model's per_token)
        logits.reshape(-1, 128), labels.reshape(-1), ignore_index=-100, reduction="none")
    model, peft_model = _ours(path, emb=emb)
    export_adapter(peft_model, str(tmp_path / "adapter"), path)
    with torch.no_grad():
        own = model(ids, position_ids=pos, labels=labels, per_token=True)[0].reshape(-1)
        base = per_token(hf_as_trained(path)(input_ids=ids).logits)
        assert (own - base).abs().max() > 1e-3   # (the trained norms and LoRA move them)
        got = DPO(model, Preference("sigmoid", 0.1), base=path).reference(ids, pos, labels).reshape(-1)
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5, msg="the base as the reference")
        torch.testing.assert_close(model(ids, position_ids=pos, labels=labels, per_token=True)[0].reshape(-1), own,
                                   rtol=0, atol=0, msg="the policy after the reference")
        fresh, _ = _ours(path, emb=emb)   # another policy (its own moved norms), the adapter as its reference
        for p in fresh.parameters():
            if p.requires_grad:
                p.mul_(1.5)
        peft = PeftModel.from_pretrained(hf_as_trained(path), str(tmp_path / "adapter"))
        want = per_token(peft(input_ids=ids).logits)
        got = DPO(fresh, Preference("sigmoid", 0.1), reference=read_init_adapter(str(tmp_path / "adapter")),
                  base=path).reference(ids, pos, labels).reshape(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg="the adapter (LoRA, norms) as reference")
        torch.testing.assert_close(want, own, rtol=1e-5, atol=1e-5, msg="peft's model of the adapter = ours")


def test_train_embeddings_refuses_what_it_cannot_train(tmp_path):
    """--train-embeddings is refused before any weight is read: on a tied model under --objective dpo (its head is the
    same weight, and DPO's per-token losses take a frozen head) and with --lora-layers above block 0 (every block
    would need its backward)."""
    from tests.helpers import no_weights, startup_error, train_argv

    tied = tiny_checkpoint(tmp_path / "tied", tie=True)
    untied = tiny_checkpoint(tmp_path / "untied")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "a b c d e f g " * 4}) + "\n" for _ in range(4)))
    base = {"data": str(data), "dir": str(tmp_path)}
    with no_weights():
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(json.dumps({"prompt": "a b c", "chosen": " d e", "rejected": " f g"}) + "\n"
                                 for _ in range(4)))
        said = startup_error(train_argv({**base, "model": tied, "data": str(pairs)}, str(tmp_path / "o1"),
                                        "--train-embeddings", "--objective", "dpo"))
        assert "--train-embeddings with --objective dpo" in said and "ties its output head" in said and \
            "drop --train-embeddings" in said, said
        said = startup_error(train_argv({**base, "model": untied}, str(tmp_path / "o2"), "--train-embeddings",
                                        "--lora-layers", "1"))
        assert "--train-embeddings with --lora-layers 1" in said and "include block 0" in said, said


@pytest.mark.parametrize("name", ["model.embed_tokens", "embed_tokens"], ids=["full_name", "peft_short_name"])
def test_tied_embedding_adapter_without_weight_tying_is_refused(ckpts, tmp_path, name):
    """peft's own adapter of a tied model's embedding without ensure_weight_tying keeps the base's head in peft (the two
    untied: its logits are not a tied model's): --init-adapter and the merge refuse it, naming why, where either would
    tie the head to the trained embedding, also where modules_to_save names it as peft's suffix (embed_tokens); with
    ensure_weight_tying (peft's save, our export's form) both take it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import train
    from model.load import read_args
    from model.merged import merge
    from parallel.flags import check_model_flags

    path = ckpts["tied"]
    for tying in (False, True):
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(
            r=R, lora_alpha=ALPHA, target_modules=ALL, modules_to_save=[name], ensure_weight_tying=tying))
        peft.save_pretrained(str(tmp_path / str(tying)))
    argv = lambda a: train.build_parser().parse_args(["--model", path, "--lora-r", str(R), "--lora-alpha", str(ALPHA),
                                                      "--train-embeddings", "--init-adapter", a])   # noqa: E731
    with pytest.raises(ValueError, match="without peft's ensure_weight_tying.*this run would start with the head"):
        check_model_flags(argv(str(tmp_path / "False")), read_args(path))
    with pytest.raises(ValueError, match="without peft's ensure_weight_tying.*merge_and_unload"):
        merge(path, str(tmp_path / "False"), str(tmp_path / "merged_untied"), dtype=torch.float32)
    assert not os.path.exists(tmp_path / "merged_untied" / "config.json")
    check_model_flags(argv(str(tmp_path / "True")), read_args(path))
    merge(path, str(tmp_path / "True"), str(tmp_path / "merged_tied"), dtype=torch.float32)
