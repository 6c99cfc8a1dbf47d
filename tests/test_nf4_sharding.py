"""NF4 quantization state is sharded with its weight, and stays bit-exact through load, resume and merge.

Pins (gloo on CPU, float32 storage, a tiny Qwen2 checkpoint built by transformers):
- `quantize_blocks` on any split of a weight into whole 64-blocks, then `nest_absmax` over the joined
  fp32 absmax, equals bitsandbytes' own whole-tensor quantization bit for bit (codes, uint8 absmax, nested scales,
  offset; `tests.helpers.bnb_nf4`: its primitives, with the nested offset's mean in float64, which is within one
  float32 ulp of `quantize_4bit(compress_statistics=True)`'s), and dequantizes to the same weight, which is
  `nf4_round_trip` (the merge's base);
- an NF4 layer on CPU computes with the QLoRA paper's NF4 code book indexed by the packed codes, times each 64-block's
  scale (the nested scales dequantized flat), at widths that are not multiples of 64 too (48, 80: bitsandbytes
  0.50.2's CPU `dequantize_4bit` of a 2-D state takes other blocks' scales there): its dequantized weight, forward,
  input gradient, and `nf4_round_trip`;
- on 4 ranks (FSDP2 over all four) every rank's local `absmax` parameter is its 1/4 dim-0 shard
  (not the whole state), the lean loader's shards equal the whole-tensor loader's (lean=False) as
  integers, and the gathered codes and absmax, and the dequantized weight, equal bitsandbytes'
  quantization of the checkpoint tensor in one process (`bnb_nf4`);
- a DCP checkpoint (parallel/checkpoint.save) holds no base weight and no absmax (frozen state is
  re-read from safetensors), and after `load` into a freshly built model on 4 ranks the NF4 state is
  unchanged and the LoRA tensors are restored.

Run: .venv/bin/python -m pytest -q tests/test_nf4_sharding.py
"""

import os

import pytest
import torch

from tests.dist import run_ranks
from tests.helpers import bnb_nf4, tiny_checkpoint


def _u8(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


def test_blockwise_quantization_equals_bitsandbytes_whole_tensor():
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from model.nf4 import NF4Linear, nest_absmax, nf4_round_trip, quantize_blocks

    g = torch.Generator().manual_seed(0)
    # rows a multiple of 64 wide: the reference, bitsandbytes 0.50.2's CPU dequantize_4bit of a 2-D state, takes
    # other blocks' scales at a width like 160 (model/bnb.py)
    for out_f, in_f, cuts in [(96, 64, [0, 7, 40, 96]), (640, 128, [0, 1, 2, 1279, 1280]),
                              (320, 256, [0, 333, 334, 1000, 1280])]:
        w = torch.randn(out_f, in_f, generator=g) * 0.05
        packed, ref = bnb_nf4(w)
        _, f32 = quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")   # its float32 mean
        assert abs(f32.offset - ref.offset) <= torch.finfo(torch.float32).eps * abs(ref.offset), "offset: 1 ulp"
        flat = w.reshape(-1)
        parts = [quantize_blocks(flat[a * 64: b * 64]) for a, b in zip(cuts, cuts[1:])]
        codes = torch.cat([c for c, _ in parts])
        m = NF4Linear(in_f, out_f, bias=False, compress_statistics=True, quant_type="nf4",
                      quant_storage=torch.float32, device="meta")
        qabsmax = nest_absmax(m, torch.cat([a for _, a in parts]))
        tag = f"{out_f}x{in_f} cut at {cuts}"
        assert torch.equal(codes, packed.view(-1)), f"codes {tag}"
        assert torch.equal(qabsmax, ref.absmax), f"absmax codes {tag}"
        st = m.quant_state
        assert torch.equal(st.state2.absmax, ref.state2.absmax) and torch.equal(st.offset, ref.offset), tag
        st.absmax = qabsmax
        assert torch.equal(dequantize_4bit(codes.view(-1, 1), st).float(), dequantize_4bit(packed, ref)), tag
        assert torch.equal(nf4_round_trip(w), dequantize_4bit(packed, ref)), f"the merge's base {tag}"


# The 16 NF4 values as printed in the QLoRA paper (Dettmers et al. 2023, appendix E), lowest code first.
NF4_PAPER = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


@pytest.mark.parametrize("out_f,in_f", [(16, 48), (24, 80), (48, 16), (16, 64)])
def test_nf4_layer_on_cpu_computes_with_the_code_book_times_block_scales(out_f, in_f):
    from bitsandbytes.functional import dequantize_blockwise, get_4bit_type

    from model.nf4 import NF4Linear, nf4_round_trip, pack_nf4_weights, quantize_weight

    g = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)   # rows of unlike scales
    packed, ref = bnb_nf4(w)
    book = torch.tensor(NF4_PAPER)
    assert torch.equal(get_4bit_type("nf4", device="cpu"), book), "bitsandbytes' NF4 code book is the paper's"
    b = packed.view(-1)
    codes = torch.stack([b >> 4, b & 15], 1).view(-1).long()   # two codes a byte, the first in the high nibble
    scales = dequantize_blockwise(ref.absmax, ref.state2) + ref.offset   # one float32 scale a 64-block
    want = (book[codes] * scales.repeat_interleave(64)).view(out_f, in_f)

    m = NF4Linear(in_f, out_f, bias=True, compress_statistics=True, quant_type="nf4", quant_storage=torch.float32,
                  device="meta")
    pack_nf4_weights(torch.nn.ModuleList([m]))
    codes_p, absmax_p = quantize_weight(m, w, "cpu")
    m.weight = torch.nn.Parameter(codes_p, requires_grad=False)
    m.absmax = torch.nn.Parameter(absmax_p, requires_grad=False)
    m.bias = torch.nn.Parameter(torch.randn(out_f, generator=g), requires_grad=False)
    tag = f"[{out_f}, {in_f}]"
    assert torch.equal(m.dequantized(), want), f"{tag}: dequantized weight"
    assert torch.equal(nf4_round_trip(w), want), f"{tag}: nf4_round_trip (the merge's base)"
    x = torch.randn(3, 5, in_f, generator=g, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, want, m.bias), msg=f"{tag}: forward")
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ want, msg=f"{tag}: input gradient")


def _shard_rank(rank, world_size, path, ckpt_dir):
    import torch.distributed as dist
    from bitsandbytes.functional import dequantize_4bit

    from model.load import CheckpointReader
    from model.nf4 import NF4Linear
    from model.weights import load_weights
    from parallel import checkpoint
    from parallel.mesh import ParallelDims
    from parallel.parallelize import BuildOptions, build_model, lora_parameters
    from tests.helpers import build_nonzero_b

    mesh = ParallelDims(world_size).build_mesh("cpu").fsdp
    cfg = BuildOptions(path, quant="nf4", lora_r=4, lora_alpha=8, seed=2)
    model, _ = build_nonzero_b(cfg, fsdp_mesh=mesh, device="cpu")
    whole, _ = build_model(cfg, fsdp_mesh=mesh, device="cpu")
    reader = CheckpointReader(path)
    load_weights(whole, reader, torch.device("cpu"), lean=False)     # every rank quantizes whole tensors
    mods, whole_mods = dict(model.named_modules()), dict(whole.named_modules())
    n = 0
    for name, m in mods.items():
        if not isinstance(m, NF4Linear):
            continue
        n += 1
        w = reader.get(name.replace(".base_layer", "") + ".weight")
        packed, ref = bnb_nf4(w)
        blocks = w.numel() // 64
        rows = -(-blocks // 4)                                     # fp32 storage: 4 absmax codes per element
        local = m.absmax.to_local()
        assert local.shape[0] == len(range(rank * -(-rows // 4), min(rows, (rank + 1) * -(-rows // 4)))), \
            f"{name}: local absmax {tuple(local.shape)} is not rank {rank}'s quarter of {rows} rows"
        assert m.weight.to_local().shape[0] <= -(-blocks // 4), f"{name}: codes shard"
        assert torch.equal(_u8(m.weight.to_local()), _u8(whole_mods[name].weight.to_local())), f"{name}: lean codes"
        assert torch.equal(_u8(local), _u8(whole_mods[name].absmax.to_local())), f"{name}: lean absmax"
        assert torch.equal(_u8(m.weight.full_tensor()), _u8(packed)), f"{name}: gathered codes vs bnb"
        st = m.state()
        assert torch.equal(st.absmax, ref.absmax), f"{name}: gathered absmax vs bnb"
        assert torch.equal(st.state2.absmax, ref.state2.absmax) and torch.equal(st.offset, ref.offset), name
        assert torch.equal(m.dequantized(), dequantize_4bit(packed, ref)), f"{name}: dequantized vs bnb"
    assert n == 14, n
    reader.close()

    # resume: the DCP checkpoint holds LoRA + optimizer only; the rebuilt model re-reads its NF4 state
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-3)
    loss, cnt = model(torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(rank)),
                      labels=torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(9)))
    (loss / cnt).backward()
    opt.step()
    saved = checkpoint.save(ckpt_dir, model, opt, step=1)
    import torch.distributed.checkpoint as dcp
    keys = list(dcp.FileSystemReader(saved).read_metadata().state_dict_metadata)
    frozen = [k for k in keys if k.startswith("model.") and "lora_" not in k]
    assert not frozen, f"checkpoint holds frozen tensors: {frozen[:4]}"
    assert any("lora_A" in k for k in keys), keys[:4]
    fresh, _ = build_model(BuildOptions(path, quant="nf4", lora_r=4, lora_alpha=8, seed=5), fsdp_mesh=mesh,
                           device="cpu")
    fopt = torch.optim.AdamW(lora_parameters(fresh), lr=1e-3)
    assert checkpoint.load(ckpt_dir, fresh, fopt) == 1
    fresh_p = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        q = fresh_p[name]
        if p.requires_grad:
            assert torch.equal(q.to_local(), p.to_local()), f"resumed LoRA {name}"
        elif ".layers." in name:
            assert torch.equal(_u8(q.to_local()), _u8(p.to_local())), f"resumed frozen {name}"
        else:   # the frozen root (embeddings, final norm, lm_head): whole on every rank, not FSDP2's
            assert not hasattr(p, "to_local") and torch.equal(q, p), f"resumed frozen {name}"
    dist.barrier()
    return n


@pytest.mark.timeout(300)
def test_absmax_sharded_over_four_ranks_and_exact_through_resume(tmp_path):
    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, head_dim=16)   # (widths of 64: bitsandbytes' 2-D reference)
    ckpt_dir = str(tmp_path / "dcp")
    os.makedirs(ckpt_dir)
    assert run_ranks(_shard_rank, 4, path, ckpt_dir, timeout=280) == [14] * 4
