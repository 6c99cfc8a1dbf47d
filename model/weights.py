"""Streaming weights from safetensors into a built model: the one loading path (trainer, tests, demo).

Contract of `load_weights(model, reader, device)`: every non-LoRA parameter of `model` (peft-wrapped
names allowed; plain tensors or FSDP2 DTensor shards) is filled from the checkpoint tensor by tensor.
Each rank reads only the dim-0 rows of its own shard (one byte range of the safetensors file); an NF4
weight is read and quantized only in the 64-blocks of the rank's shard (blocks are independent), and
only its fp32 absmax, 4 bytes per 64 weights, is all-gathered for bitsandbytes' nested statistics. The
result is bit-identical to every rank quantizing the whole tensor. No rank holds a full block tensor (the
frozen root tensors, embeddings, final norm and lm_head, are whole on every rank: parallel/fsdp.py). A parameter in
host memory (Gemma 4 E2B / E4B's per-layer table: parallel/host_table.py; every one on CPU) is read in pieces of
HOST_CHUNK bytes straight into it, never whole beside it. Names and shapes are checked against the safetensors
headers before any tensor is read. A bitsandbytes 4-bit upload's weights (model/prequant.py): an NF4 layer takes its
rank's blocks of codes and the scales as stored; any other parameter, the rows it holds dequantized.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from model.nf4 import BLOCKSIZE, NF4Linear, nest_absmax, pad_absmax, quantize_blocks, quantize_weight
from model.prequant import nf4_parts
from model.qlora import set_param


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows [start, stop) of the global parameter that this rank's shard holds (FSDP2 and
    HSDP shard dim 0 like torch.chunk: ceil(rows / W) per rank, the last ones short or empty)."""
    start, stop = 0, p.shape[0]
    if isinstance(p, DTensor):
        for dim, pl in enumerate(p.placements):
            if isinstance(pl, Shard):
                if pl.dim != 0:
                    raise ValueError(f"expected FSDP2's dim-0 sharding, got {p.placements}")
                chunk = -(-(stop - start) // p.device_mesh.size(dim))
                first = start + p.device_mesh.get_local_rank(dim) * chunk
                start, stop = min(first, stop), min(first + chunk, stop)
        assert stop - start == p.to_local().shape[0], (p.placements, start, stop, p.to_local().shape)
    return start, stop


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _gather_blocks(p: torch.Tensor, local: torch.Tensor, total: int) -> torch.Tensor:
    """All ranks' dim-0 pieces of a sharded parameter's companion tensor, in order: [total]."""
    if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
        return local
    dim = next(d for d, pl in enumerate(p.placements) if isinstance(pl, Shard))
    group, w = p.device_mesh.get_group(dim), p.device_mesh.size(dim)
    chunk = -(-total // w)
    padded = torch.zeros(chunk, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(w)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:total]


def _load_nf4(m: NF4Linear, name: str, reader, device) -> None:
    """Each rank reads and quantizes only the 64-blocks of its own shard (NF4 blocks are independent),
    the fp32 absmax (4 bytes per block) is all-gathered, and every rank nests it identically."""
    b0, b1 = local_rows(m.weight)
    if name in reader.packed:   # a bitsandbytes NF4 upload's: its codes and scales as stored (model/prequant.py)
        codes, qabsmax, m.quant_state = nf4_parts(reader, name, b0, b1, m.quant_storage, device)
        _local(m.weight).view(-1).view(torch.uint8).copy_(codes)
        a0, a1 = local_rows(m.absmax)
        _local(m.absmax).copy_(pad_absmax(m, qabsmax)[a0:a1])
        return
    flat = reader.get_flat(name, b0 * BLOCKSIZE, b1 * BLOCKSIZE).to(device)
    codes, absmax = quantize_blocks(flat) if b1 > b0 else (flat.new_empty(0, dtype=torch.uint8),
                                                           flat.new_empty(0, dtype=torch.float32))
    del flat
    qabsmax = pad_absmax(m, nest_absmax(m, _gather_blocks(m.weight, absmax, m.weight.shape[0])))
    _local(m.weight).view(-1).view(torch.uint8).copy_(codes)
    a0, a1 = local_rows(m.absmax)
    _local(m.absmax).copy_(qabsmax[a0:a1])


HOST_CHUNK = 1 << 28   # bytes read at a time into a host-resident parameter


def _copy_rows(dst: torch.Tensor, reader, name: str, start: int, stop: int) -> None:
    """Rows [start, stop) of `name` into `dst`; into host memory in pieces of HOST_CHUNK bytes, so a table kept in
    host memory (Gemma 4's per-layer one: 5.6 GB on E4B) never has a second whole copy beside it while it loads."""
    step = stop - start if dst.device.type != "cpu" else max(1, HOST_CHUNK // max(1, dst[:1].nbytes))
    for a in range(start, stop, step) if stop > start else [start]:
        b = min(a + step, stop)
        dst[a - start:b - start].copy_(reader.get_rows(name, a, b))


@torch.no_grad()
def load_weights(model, reader, device: torch.device, lean: bool = True) -> None:
    """Fill every non-LoRA parameter of `model` (peft-wrapped names allowed) from the checkpoint.

    lean (default): each rank reads only the rows of its shard and quantizes only its own NF4 blocks.
    lean=False: the earlier path (every rank reads every whole tensor and quantizes it whole), kept
    for bench/load.py's side-by-side timing and as the tests' bitwise reference.
    """
    nf4 = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    absmax = {f"{n}.absmax" for n in (k.removesuffix(".weight") for k in nf4)}
    params = [(n, p) for n, p in model.named_parameters() if "lora_" not in n and n not in absmax]
    ckpt = lambda n: n.replace(".base_layer", "")
    reader.check([ckpt(n) for n, _ in params])
    reader.check_shapes({ckpt(n): (nf4[n].out_features, nf4[n].in_features) if n in nf4 else p.shape
                         for n, p in params})   # before any tensor is read
    for name, p in params:
        if name in nf4 and (lean or ckpt(name) in reader.packed):
            _load_nf4(nf4[name], ckpt(name), reader, device)
        elif name in nf4:
            codes, qabsmax = quantize_weight(nf4[name], reader.get(ckpt(name)), device)
            set_param(p, codes)
            set_param(nf4[name].absmax, qabsmax)
        elif lean:
            _copy_rows(_local(p), reader, ckpt(name), *local_rows(p))
        else:
            set_param(p, reader.get(ckpt(name)).to(device=device, dtype=p.dtype))
