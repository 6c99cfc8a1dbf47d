"""Gemma 4 E2B / E4B's parts (model/gemma4_small.py: per-layer embeddings, KV sharing, the KV-shared layers'
double-wide MLP) compute what transformers does, on every layout.

Pins (CPU; a tiny random Gemma4ForCausalLM made and saved by transformers: 6 layers sliding, full, sliding, sliding,
full, full with attention_k_eq_v, the last 3 KV-shared: layers 1 (full) and 2 (sliding) store, 3-5 reuse; per-layer
inputs of 8 per layer; double-wide MLPs on 3-5; every norm weight and layer_scalar drawn away from 1):
- logits = transformers' (float32) on rows far from position 0 and on a packed row; the reuse layers have no k/v
  projections or norms, their MLPs twice as wide; config.json read as Gemma4TextConfig reads it (kv_sharing_modes,
  the defaults), n_params = the model's parameters, bad values refused naming the key; --tiled-attn refused on KV
  sharing (the memory plan and the start-up check: tests/test_plan_small.py);
- LoRA's loss and every LoRA gradient = peft's on Gemma4ForCausalLM (every projection named; the storing layers'
  k_proj gets the reuse layers' gradient through the K/V they hand on): plain, under AC with --tiled-mlp, and under
  --ac-group 3 (the storing blocks' K/V leave a group's checkpoint) with --offload-activations off;
- the wrapper (Gemma4ForConditionalGeneration, E2B's form): logits = transformers'; our adapter with --train-norms
  (the per-layer norms among them, moved off the base) loads in peft with our logits; `python -m model.merge` =
  peft's merge_and_unload, and transformers loads the merged checkpoint;
- the per-layer table in host memory (the default, parallel/host_table.py) = on the device (--ple-on-device): logits,
  loss and LoRA gradients bit for bit, both = peft's; a move of the model leaves the table on the host;
- float64, cp 2 Ulysses with --offload-activations and cp 2 ring with --tiled-mlp, the table in host memory: loss and
  every LoRA gradient = one process's with the table on the device, on every rank (tests/test_gemma4_layouts.py's
  harness; packed rows whose documents cross the shards); FSDP2 leaves the table whole, a plain host tensor.

Run: .venv/bin/python -m pytest -q tests/test_gemma4_small.py
"""

import pytest
import torch
import transformers as T

import model
from tests.test_gemma4 import ALL, CONFIG, _hf, _ids, _lora_grads, _perturb, rel

S, F = "sliding_attention", "full_attention"
TYPES = [S, F, S, S, F, F]
SMALL = {**CONFIG, "num_hidden_layers": 6, "layer_types": TYPES, "hidden_size_per_layer_input": 8,
         "vocab_size_per_layer_input": 128, "num_kv_shared_layers": 3, "use_double_wide_mlp": True}
MODES = [None, "store", "store", "reuse", "reuse", "reuse"]
N_LORA = 7 + 6 + 7 + 5 + 5 + 5   # block 1 (full, k_eq_v): no v_proj; the reuse blocks: no k_proj, v_proj


def _perturb_small(m):
    _perturb(m)
    with torch.no_grad():   # (transformers draws the per-layer table as any embedding: make it act)
        for n, p in m.named_parameters():
            if "per_layer" in n and "norm" not in n:
                p.mul_(4)


def save_small(path, **cfg) -> str:
    """The tiny E2B form (module docstring; `cfg` over SMALL's keys) made by transformers, saved at `path`."""
    torch.manual_seed(0)
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**{**SMALL, **cfg}, attention_k_eq_v=True)).float().eval()
    _perturb_small(hf)
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_small(tmp_path_factory.mktemp("gemma4_small"))


def test_logits_match_transformers(ckpt):
    hf, ours = _hf(ckpt, final_logit_softcapping=2.0), model.from_pretrained(ckpt).eval()
    ours.args.logit_softcap = 2.0
    # (transformers 5.17, the GPU machine's, has no kv_sharing_modes: there the logits below pin the roles)
    assert list(getattr(hf.config, "kv_sharing_modes", MODES)) == MODES == list(ours.args.small.modes)
    blocks = ours.model.layers
    assert [b.self_attn.k_proj is None and b.self_attn.k_norm is None and b.self_attn.v_norm is None
            for b in blocks] == [m == "reuse" for m in MODES]
    assert [b.mlp.up_proj.out_features for b in blocks] == [64] * 3 + [128] * 3
    ids = _ids()
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[1500], [0]])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        assert rel(ours(ids, position_ids=pos), ref) < 1e-5, "whole rows"
        packed = torch.cat([torch.arange(15), torch.arange(22)])[None]
        want = torch.cat([hf(input_ids=ids[:1, :15]).logits, hf(input_ids=ids[:1, 15:]).logits], 1)
        assert rel(ours(ids[:1], position_ids=packed), want) < 1e-5, "packed row"


def test_config_read_as_transformers_reads_it(ckpt, tmp_path):
    from parallel.parallelize import BuildOptions, build_model

    base = {**T.Gemma4TextConfig(**SMALL).to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    a = model.ModelArgs.from_config_dict(base)
    assert (a.small.ple, a.small.ple_vocab, a.small.double_wide) == (8, 128, True)
    assert [a.has(i, "k_proj") for i in range(6)] == [True] * 3 + [False] * 3
    assert [a.projections(i)["down_proj"] for i in range(6)] == [(64, 48)] * 3 + [(128, 48)] * 3
    ours = model.from_pretrained(ckpt)
    assert model.load.read_args(ckpt).n_params == sum(p.numel() for n, p in ours.named_parameters()
                                                      if "_norm." not in n or "layernorm" in n or "per_layer" in n)
    dflt = model.ModelArgs.from_config_dict({k: v for k, v in base.items() if not k.endswith("per_layer_input")})
    assert (dflt.small.ple, dflt.small.ple_vocab) == (256, 262144)   # (Gemma4TextConfig's defaults)
    dense = model.ModelArgs.from_config_dict({**base, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0})
    assert dense.small is None and dense.n_params == sum(p.numel() for n, p in model.llama.Transformer(
        dense).named_parameters() if "_norm." not in n or "layernorm" in n)
    hub = {k: v for k, v in base.items() if k != "per_layer_config"}   # (the hub's form: global_head_dim)
    for over, said in (({"num_kv_shared_layers": 6}, "num_kv_shared_layers 6 of 6"),
                       ({"num_kv_shared_layers": -1}, "num_kv_shared_layers -1"),
                       ({"layer_types": [S, S, S, F, F, F]}, "none of the first 3 layers"),
                       ({"vocab_size_per_layer_input": 0}, "vocab_size_per_layer_input 0")):
        with pytest.raises(ValueError, match=said):
            model.ModelArgs.from_config_dict({**hub, **over})
    with pytest.raises(ValueError, match="--tiled-attn with KV-shared layers"):
        build_model(BuildOptions(ckpt, quant="none", tiled_attn=True))


@pytest.mark.parametrize("mem", [dict(ac=False), dict(ac=False, ple_on_device=True), dict(ac=True, tiled_mlp=True),
                                 dict(ac=True, ac_group=3)],
                         ids=["plain", "ple_on_device", "ac_tiled_mlp", "ac_group_3"])
def test_lora_grads_match_peft_on_transformers(ckpt, mem):
    s, ref, mine, theirs = _lora_grads(ckpt, ALL, mem)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5, msg="loss")
    assert theirs.keys() == mine.keys() and len(mine) == N_LORA * 2, sorted(set(mine) ^ set(theirs))
    for k in mine:
        assert rel(mine[k], theirs[k]) < 1e-4, f"grad {k}"


def test_kernel_core_with_ac_equals_sdpa(ckpt):
    """One process as train.py runs it: parallel.kernels' core under AC (the reuse blocks' checkpoints take the shared
    K/V as inputs) = torch's SDPA without AC: loss and every LoRA gradient (float64)."""
    from parallel.cp import local_attention
    from tests.test_gemma4_layouts import _batch, _build, _grads

    ids, labels, pos = _batch()
    out = []
    for kw in (dict(ac=False), dict(ac=True, attention=local_attention())):
        m, _ = _build(ckpt, **kw)
        s, n = m(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        out.append((s.detach(), _grads(m)))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-9, atol=0)
    assert len(out[1][1]) == N_LORA * 2 and all(rel(g, out[0][1][k]) < 1e-9 for k, g in out[1][1].items())


def test_host_table_equals_the_device_table_and_stays_on_the_host(ckpt):
    """The per-layer table in host memory (the default, parallel/host_table.py) = on the device (--ple-on-device): the
    same logits, loss and LoRA gradients, bit for bit (the same rows, gathered elsewhere); the table is a HostEmbedding
    whose weight a move of the model (what puts it on an accelerator; here the meta device) leaves in host memory, with
    its values, while every other tensor moves."""
    from parallel.host_table import HostEmbedding, apply_host_table
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b
    from tests.test_gemma4_layouts import _batch, _grads

    ids, labels, pos = _batch()
    out = {}
    for dev in (False, True):
        m, _ = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8, seed=3, lora_targets=ALL,
                                            ple_on_device=dev))
        with torch.no_grad():
            y = m(ids, position_ids=pos)
        s, n = m(ids, position_ids=pos, labels=labels)
        (s / n).backward()
        out[dev] = m, y, s.detach(), _grads(m)
    (host, y, s, g), (dev, y_dev, s_dev, g_dev) = out[False], out[True]
    assert torch.equal(y, y_dev) and torch.equal(s, s_dev), "logits, loss: host table = device table"
    assert g.keys() == g_dev.keys() and len(g) == N_LORA * 2 and all(torch.equal(g[k], g_dev[k]) for k in g), "grads"
    table = host.model.embed_tokens_per_layer
    assert type(table) is HostEmbedding and type(dev.model.embed_tokens_per_layer) is torch.nn.Embedding
    with torch.no_grad():   # one rows buffer for every call (the longest so far); what a call returns is its own
        first, buf = table(ids), table.rows.data_ptr()
        few = ids[:1, :9].flip(1)
        assert torch.equal(table(few), table.weight[few]) and table.rows.data_ptr() == buf, "a shorter call"
        assert torch.equal(first, table.weight[ids]), "an earlier call's rows, after the buffer was written again"
    want = table.weight.detach().clone()
    host.to("meta"), dev.to("meta")
    assert table.weight.device.type == "cpu" and torch.equal(table.weight, want), "the table stays in host memory"
    assert dev.model.embed_tokens_per_layer.weight.is_meta, "--ple-on-device: the table moves with the model"
    assert all(p.is_meta for n, p in host.named_parameters() if not n.startswith("model.embed_tokens_per_layer.")), \
        "every other parameter moves"
    trained = torch.nn.Module()   # (a fork training the table: refused, it would need the device's)
    trained.model = torch.nn.Module()
    trained.model.embed_tokens_per_layer = torch.nn.Embedding(4, 2)
    with pytest.raises(ValueError, match="the per-layer embedding table is frozen.*--ple-on-device"):
        apply_host_table(trained)


def test_host_table_loads_in_pieces(ckpt, monkeypatch):
    """model/weights.py reads a host-resident parameter in pieces of HOST_CHUNK bytes straight into it (never a whole
    second copy of E4B's 5.6 GB table beside it): here 16 rows a read, the table = the checkpoint's tensor."""
    from safetensors.torch import load_file

    from model import load, weights
    from parallel.parallelize import BuildOptions, build_model

    reads, get_rows = [], load.CheckpointReader.get_rows
    monkeypatch.setattr(weights, "HOST_CHUNK", 16 * 6 * 8 * 4)   # (16 rows of L·P = 48 float32)
    monkeypatch.setattr(load.CheckpointReader, "get_rows", lambda self, n, a, b: reads.append((n, a, b)) or get_rows(
        self, n, a, b))
    ours, _ = build_model(BuildOptions(ckpt, quant="none"))
    name = "model.embed_tokens_per_layer.weight"
    assert [r[1:] for r in reads if r[0] == name] == [(a, a + 16) for a in range(0, 128, 16)], reads
    want = load_file(f"{ckpt}/model.safetensors")[name]
    assert torch.equal(ours.model.embed_tokens_per_layer.weight, want), "the table as stored"


def test_train_runs_with_the_table_in_host_memory(assets, tmp_path):
    """train.py, 3 steps on the fixture tokenizer's chat records, this tiny E2B (its per-layer table over the
    tokenizer's vocabulary): the default run (the table in host memory) logs every step's loss and grad norm and saves
    the adapter of the --ple-on-device run (which records the flag)."""
    import json

    import train
    from tests.fixtures import make_tokenizer
    from tests.helpers import one_thread, train_argv
    from tests.test_train import _compare

    tok = make_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    cfg = {**SMALL, "vocab_size": len(tok), "vocab_size_per_layer_input": len(tok), "pad_token_id": 0,
           "eos_token_id": 0, "bos_token_id": None}
    hf = T.Gemma4ForCausalLM(T.Gemma4TextConfig(**cfg)).float()
    _perturb_small(hf)
    hf.save_pretrained(tmp_path / "model")
    a = {**assets, "model": str(tmp_path / "model")}
    with one_thread():
        for name, flags in (("host", []), ("device", ["--ple-on-device"])):
            train.main(train_argv(a, str(tmp_path / name), *flags))
    _compare("Gemma 4 E2B's table in host memory", str(tmp_path / "host"), str(tmp_path / "device"))
    assert json.loads((tmp_path / "device" / "config.json").read_text())["ple_on_device"] is True


@pytest.mark.timeout(300)
def test_cp2_ulysses_and_ring_equal_one_process(ckpt):
    """float64; cp 2 Ulysses with --offload-activations (the sliding layers' 2 KV heads split, the full layers' one
    replicated), cp 2 ring with --tiled-mlp, the per-layer table in host memory (one process's on the device): the K/V
    a reuse layer takes are its rank's shard, as its own would be; FSDP2 leaves the table out, whole on the host."""
    from tests.dist import run_ranks

    cases = [(2, "ulysses", None, dict(offload_activations=True)), (2, "ring", None, dict(tiled_mlp=True))]
    assert run_ranks(_layouts_host_table, 2, ckpt, cases, timeout=280) == [True, True]


def _layouts_host_table(rank, world_size, path, cases):
    from torch.distributed.tensor import DTensor

    from parallel.host_table import HostEmbedding
    from parallel.mesh import ParallelDims
    from tests.test_gemma4_layouts import _build, _layouts

    assert _layouts(rank, world_size, path, cases, N_LORA)
    meshes = ParallelDims.from_args(world_size, 1, -1, 2, "ring", None, 4, 2).build_mesh("cpu")
    m, _ = _build(path, fsdp_mesh=meshes.fsdp)
    table, blocks = m.model.embed_tokens_per_layer, [p for n, p in m.named_parameters() if ".layers." in n]
    assert all(isinstance(p, DTensor) for p in blocks), f"rank {rank}: FSDP2 shards the blocks"
    assert type(table) is HostEmbedding and not isinstance(table.weight, DTensor), f"rank {rank}: table not sharded"
    assert table.weight.shape == (128, 6 * 8) and table.weight.device.type == "cpu", f"rank {rank}: whole, on the host"
    return True


# ----------------------------------------------------------------------------- the wrapper


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    from tests.test_gemma4 import VISION

    cfg = T.Gemma4Config(text_config=dict(SMALL, model_type="gemma4_text", attention_k_eq_v=True),
                         vision_config=VISION, audio_config=None)
    torch.manual_seed(0)
    m = T.Gemma4ForConditionalGeneration(cfg).float()
    _perturb_small(m)
    path = tmp_path_factory.mktemp("gemma4_small_wrapper")
    m.save_pretrained(path)
    return str(path)


def test_wrapper_logits_adapter_and_merge(wrapped, tmp_path):
    from model import merge
    from model.export import export_adapter
    from model.load import from_pretrained
    from parallel.parallelize import BuildOptions
    from tests.helpers import build_nonzero_b
    from tests.test_gemma4 import _peft_loaded

    ref = T.Gemma4ForConditionalGeneration.from_pretrained(wrapped).eval()
    ids = _ids(23)
    with torch.no_grad():
        assert rel(from_pretrained(wrapped)(ids), ref(input_ids=ids).logits) < 1e-5, "wrapper logits"
    ours, peft_model = build_nonzero_b(BuildOptions(wrapped, quant="none", lora_r=4, lora_alpha=8.0, lora_targets=ALL,
                                                    seed=3, train_norms=True))
    trained = [n for n, p in ours.named_parameters() if p.requires_grad and "lora_" not in n]
    assert "model.per_layer_projection_norm.weight" in trained and sum("post_per_layer_input_norm" in n
                                                                       for n in trained) == 6, trained
    with torch.no_grad():   # (moved off the base: the adapter must carry them)
        for n, p in ours.named_parameters():
            if p.requires_grad and "lora_" not in n:
                p.add_(torch.randn_like(p) * 0.2)
        want = ours(ids)
    export_adapter(peft_model, str(tmp_path / "a"), wrapped, quant="none")
    pm = _peft_loaded(wrapped, str(tmp_path / "a"))
    with torch.no_grad():
        assert rel(pm(input_ids=ids).logits, want) < 1e-5, "peft with our adapter"
    assert len([n for n, _ in pm.named_modules() if n.endswith(".lora_A")]) == N_LORA
    out = str(tmp_path / "merged")
    assert merge.main(["--model", wrapped, "--adapter", str(tmp_path / "a"), "--out", out, "--dtype", "fp32"]) == 0
    merged_ref = pm.merge_and_unload()
    got, info = T.Gemma4ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert rel(got(input_ids=ids).logits, merged_ref(input_ids=ids).logits) < 1e-5, "merged"
