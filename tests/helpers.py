"""Small shared builders for tests: tiny random checkpoints made with transformers, train.py argv and guards."""

import contextlib
import json
import math
import os

import torch
import transformers as T


def tiny_checkpoint(path, *, heads=6, kv_heads=2, head_dim=8, layers=2, vocab=128, tie=False,
                    inter=64, seed=0, max_shard_size="60KB", pad=None):
    """A random Qwen2 checkpoint (q/k/v bias; `pad`: its pad_token_id) saved sharded by transformers; returns the
    path."""
    cfg = T.Qwen2Config(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        tie_word_embeddings=tie, max_position_embeddings=4096, pad_token_id=pad)
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


def sgd_steps(model, ids, labels, pos, n=3, lr=5.0) -> list:
    """n SGD steps of `model` on one batch (the mean loss over its targets): [(loss, {name: grad})] per step, so a
    build under memory steps can be held to the plain build's numbers over steps whose weights moved."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    seen = []
    for _ in range(n):
        opt.zero_grad()
        loss, count = model(ids, position_ids=pos, labels=labels)
        (loss / count).backward()
        seen.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return seen


def eval_head(assets, n: int = 10) -> str:
    """The first `n` records of assets' training file as an eval file (written once): an evaluation every step of all
    40 costs more than the steps it evaluates."""
    path = os.path.join(os.path.dirname(assets["data"]), f"eval_head_{n}.jsonl")
    if not os.path.exists(path):
        with open(assets["data"]) as f, open(path + ".tmp", "w") as g:
            g.writelines(f.readlines()[:n])
        os.replace(path + ".tmp", path)
    return path


def train_argv(assets, out, *extra):
    data = [] if "--data" in extra else ["--data", assets["data"]]   # (given twice, --data is refused)
    return ["--model", assets["model"], *data, "--quant", "none", "--dtype", "fp32",
            "--steps", "3", "--global-batch", "8", "--max-len", "64", "--lora-r", "4", "--warmup", "1",
            "--lr", "1e-3", "--no-progress", "--out", out, "--data-cache",
            os.path.join(os.path.dirname(assets["data"]), "token_cache"), *extra]   # later runs read it


@contextlib.contextmanager
def no_weights():
    """Tripwires: building the model or opening the safetensors fails the test."""
    import model.export  # noqa: F401 - imported (binding the real CheckpointReader) before the wires are set
    import model.load
    import parallel.parallelize as pz

    def trip(*a, **k):
        raise AssertionError("a weight was about to be read before the start-up checks finished")

    saved = (pz.build_model, pz.CheckpointReader, model.load.CheckpointReader)
    pz.build_model = pz.CheckpointReader = model.load.CheckpointReader = trip
    try:
        yield
    finally:
        pz.build_model, pz.CheckpointReader, model.load.CheckpointReader = saved


@contextlib.contextmanager
def one_thread():
    """In-process runs use one thread, as every spawned rank does: on a shared 2-core machine a
    second OpenMP thread makes these tiny runs ~10x slower, not faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def startup_error(argv) -> str:
    """The message of the start-up error `train.main(argv)` raises (with the tripwires set)."""
    import train

    with no_weights():
        try:
            train.main(argv)
        except (ValueError, FileNotFoundError) as e:
            return str(e)
    raise AssertionError(f"train.main({argv}) did not fail")


def cp_layouts(world: int, splits):
    """(dims, attention core, name) for each (ulysses, ring) split of cp = world on an existing group."""
    from parallel.cp import cp_attention
    from parallel.mesh import ParallelDims

    for u, r in splits:
        dims = ParallelDims(world, dp_shard=1, cp=world, ulysses=u, ring=r)
        yield dims, cp_attention(dims.build_mesh("cpu"), dims), "ulysses" if r == 1 else "ring" if u == 1 else "hybrid"


def budget_between_ac_plans(argv, world=1):
    """A device memory for the run `argv` (train.py flags) on `world` ranks between the planned totals of AC on one
    block and of no AC, over parallel.plan_search.SAFETY: what `--fast` then picks is neither the default (AC on
    every block) nor --no-ac. Returns bytes."""
    import argparse

    import train
    from model.load import read_args
    from parallel import plan_search
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    args = train.build_parser().parse_args(argv)
    margs = read_args(args.model)
    dims, pack = validate(args, margs, world)
    total = lambda **kw: memory_plan(margs, dims, argparse.Namespace(**{**vars(args), **kw}), "cpu", pack).total
    one, none = total(ac_blocks=1), total(ac=False)
    assert one < none, (one, none)
    return (one + none) / 2 / plan_search.SAFETY


def bnb_checkpoint(src, dst, max_shard_size="60KB", device="cpu", dtype=torch.float32, **quant):
    """`src` quantized on `device` by transformers and bitsandbytes themselves (BitsAndBytesConfig(load_in_4bit=True,
    **quant)) and saved as the -bnb-4bit uploads are, sharded, with `src`'s tokenizer files beside it; returns the
    path."""
    import shutil

    q = T.BitsAndBytesConfig(load_in_4bit=True, **quant)
    T.AutoModelForCausalLM.from_pretrained(src, device_map=device, dtype=dtype, quantization_config=q
                                           ).save_pretrained(dst, max_shard_size=max_shard_size)
    for f in os.listdir(src):   # the tokenizer's files (not the weights, their index or config.json)
        if not f.endswith((".safetensors", ".index.json", "config.json")) or f == "tokenizer_config.json":
            shutil.copy(os.path.join(src, f), dst)
    return str(dst)


def step_of(model, ids):
    """One forward and backward of `model` on `ids` (labels = ids) from cleared gradients: (loss, {name: grad} of
    the trainable parameters)."""
    for p in model.parameters():
        p.grad = None
    s, n = model(ids, labels=ids)
    (s / n).backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return s.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def bnb_nf4(w: torch.Tensor):
    """bitsandbytes' NF4 of `w` with nested statistics, from its own primitives: quantize_4bit's codes and fp32
    absmax (compress_statistics=False), the absmax less its mean through quantize_blockwise (blocks of 256), as
    quantize_4bit(compress_statistics=True) does, but with the mean taken in float64, as training takes it
    (model.nf4.nested_state: bitsandbytes' float32 mean differs between CPU and CUDA in its last bit).
    Returns (packed codes, QuantState): `dequantize_4bit(packed, state)` is the base training computes with where
    w's width is a multiple of 64 (on CPU bitsandbytes 0.50.2 misreads other 2-D states: model/bnb.py)."""
    from bitsandbytes.functional import QuantState, quantize_4bit, quantize_blockwise

    packed, plain = quantize_4bit(w.float(), blocksize=64, compress_statistics=False, quant_type="nf4",
                                  quant_storage=torch.uint8)
    offset = plain.absmax.double().mean().float()
    qabsmax, state2 = quantize_blockwise(plain.absmax - offset, blocksize=256)
    return packed, QuantState(absmax=qabsmax, shape=plain.shape, dtype=torch.float32, blocksize=64,
                              quant_type="nf4", code=plain.code, offset=offset, state2=state2)


class DiesInAChildProcess:
    """A stand-in tokenizer for data.store.build's pool: used in any process but its maker's, it ends that process
    (os._exit), as the OOM killer would."""

    def __init__(self):
        self.pid = os.getpid()

    def __getattr__(self, name):
        if not name.startswith("__") and os.getpid() != self.__dict__.get("pid"):
            os._exit(9)
        raise AttributeError(name)


def tensorboard_scalars(out) -> dict:
    """OUT/tensorboard as TensorBoard draws it: {tag: [(step, value)]}, read by tensorboard's own EventAccumulator,
    which must agree with the loader `tensorboard --logdir --load_fast=false` serves from (it takes the first restart
    event it reads for the session's start: events it would still draw fail here; review, helper 61)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    drawn = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    served = plugin_event_accumulator.EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"tensors": 0})
    served.Reload()
    as_served = {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in served.Tensors(tag)]
                 for tag in served.Tags()["tensors"]}
    assert repr(as_served) == repr(drawn), f"tensorboard --logdir draws {as_served}, EventAccumulator {drawn}"
    return drawn


def wandb_runs(out, unfinished=()) -> dict:
    """OUT/wandb's offline runs as W&B holds them: {run id: {"name", "group", "config", "rows": [(step, {key:
    value})], "exit_code"}}, each .wandb file (wandb-core's record log: LevelDB's framing in 32 KiB blocks, each
    record a protobuf of wandb's own schema, wandb_internal_pb2.Record) read in order; a run resumed offline has one
    folder per start.
    `unfinished`: ids of runs whose files are read as they are (their service was killed: no exit record comes);
    every other run's file is waited for (finish() returns before wandb-core has written it all)."""
    import glob
    import re
    import time

    runs = {}
    start = lambda p: re.fullmatch(r"offline-run-(\d+_\d+)-(\w+?)(?:-(\d+))?", os.path.basename(os.path.dirname(p)))  # noqa
    for path in sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb")),   # in order of start:
                       key=lambda p: (start(p)[1], int(start(p)[3] or 0))):   # a second one in the same second is -1
        # (sorted as strings, ".../offline-run-T-ID-1/run-ID.wandb" came before ".../offline-run-T-ID/run-ID.wandb")
        for _ in range(300):   # wandb-core writes the log in its own process: a finished run's ends with "exit"
            data = open(path, "rb").read()
            if start(path)[2] in unfinished or any(r.HasField("exit") for r in _wandb_records(data)):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{path}: no exit record after 30 s (the run never finished)")
        run = None
        for rec in _wandb_records(data):
            if rec.HasField("run"):
                run = runs.setdefault(rec.run.run_id, {"name": rec.run.display_name, "group": rec.run.run_group,
                                                       "config": {}, "rows": []})
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update
                                      if not i.key.startswith("_")})   # (_wandb: its own)
            elif rec.HasField("history"):
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["rows"].append((rec.history.step.num, {k: v for k, v in row.items() if not k.startswith("_")}))
            elif rec.HasField("exit"):
                run["exit_code"] = rec.exit.exit_code   # (the last start's: 0 finished, else failed)
    return runs


def _wandb_records(data: bytes):
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    assert data[:4] == b":W&B", f"not a W&B record log ({data[:7]!r})"
    pos, part = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        n, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if n == 0 and kind == 0:   # the rest of a block: padding
            pos += left
            continue
        if pos + 7 + n > len(data):   # (a record still being written)
            return
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):   # (FULL or LAST: the record is whole)
            yield pb.Record.FromString(part)
            part = b""


def as_scalars(records) -> dict:
    """metrics.jsonl's records as TensorBoard holds them: each number a float32 at its step (null: NaN)."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                out.setdefault(k, []).append((r["step"], torch.tensor(math.nan if v is None else v).float().item()))
    return out


def lora_grads_and_peft(hf, targets, ours, peft_model, ids, labels) -> tuple:
    """(our loss sum, peft's, our LoRA gradients, peft's) on (ids, labels): peft on transformers' model `hf` with LoRA
    on `targets` holding our tensors, F.cross_entropy's sum over the same targets; both backward through / n."""
    from peft import LoraConfig, get_peft_model

    s, n = ours(ids, labels=labels)
    (s / n).backward()
    mine = {k: p.grad for k, p in peft_model.named_parameters() if p.requires_grad}
    ref_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0,
                                              init_lora_weights=False))
    state = {k: p.detach() for k, p in peft_model.named_parameters() if p.requires_grad}
    assert not ref_model.load_state_dict(state, strict=False).unexpected_keys
    ref_model.train()
    logits = ref_model(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="sum", ignore_index=-100)
    (ref / n).backward()
    theirs = {k: p.grad for k, p in ref_model.named_parameters() if p.requires_grad}
    return s.detach(), ref.detach(), mine, theirs


def assert_lora_grads_match_peft(hf, targets, ours, peft_model, ids, labels, n_tensors):
    """Our LoRA model's loss and every LoRA gradient on (ids, labels) = peft's on transformers' model `hf` with LoRA on
    `targets` holding our tensors (n_tensors of them), F.cross_entropy's mean over the same targets."""
    s, ref, mine, theirs = lora_grads_and_peft(hf, targets, ours, peft_model, ids, labels)
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5, msg="loss")
    assert theirs.keys() == mine.keys() and len(mine) == n_tensors, (len(mine), n_tensors)
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=f"grad {k}")


def assert_adapter_and_merge_match_peft(ckpt, cls, tmp_path, ids, targets, extra=()) -> tuple:
    """Our adapter (LoRA on `targets`, B nonzero) exported from `ckpt` loads in peft on transformers' `cls` with our
    logits, and `python -m model.merge` of it = peft's merge_and_unload (logits), loaded by `cls` with no key missing
    and none unexpected but `extra` (a stored MTP layer's); returns (the merged folder, the adapter's folder)."""
    from peft import PeftModel

    from model import merge
    from model.export import export_adapter
    from parallel.parallelize import BuildOptions

    ours, peft_model = build_nonzero_b(BuildOptions(ckpt, quant="none", lora_r=4, lora_alpha=8.0,
                                                    lora_targets=tuple(targets), seed=3))
    adapter, out = str(tmp_path / "a"), str(tmp_path / "merged")
    export_adapter(peft_model, adapter, ckpt, quant="none")
    with torch.no_grad():
        want = ours(ids)
    pm = PeftModel.from_pretrained(cls.from_pretrained(ckpt, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        got = pm(input_ids=ids).logits
        assert ((got - want).norm() / want.norm()).item() < 1e-5, "adapter in peft"
    assert merge.main(["--model", ckpt, "--adapter", adapter, "--out", out, "--dtype", "fp32"]) == 0
    merged_ref = pm.merge_and_unload()
    merged, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and sorted(info["unexpected_keys"]) == sorted(extra), info
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, merged_ref(input_ids=ids).logits
        assert ((a - b).norm() / b.norm()).item() < 1e-5, "merge"
    return out, adapter


def hf_as_trained(path, quant="none"):
    """The transformers model of a checkpoint in float32; for nf4 each block Linear holds the weight our NF4 layers
    compute with (`nf4_round_trip`), so peft on it is the reference for our nf4 model."""
    from model.nf4 import nf4_round_trip

    hf = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if quant == "nf4":
        with torch.no_grad():
            for n, m in hf.named_modules():
                if isinstance(m, torch.nn.Linear) and ".layers." in n:
                    m.weight.copy_(nf4_round_trip(m.weight))
    return hf


def hub_http():
    """The HTTP client library huggingface_hub talks through, the one its errors' responses come from: httpx2 from
    huggingface_hub 2, httpx before (1.x; the GPU machine's 1.33). Tests build the Hub's answers with it."""
    import importlib

    from huggingface_hub.errors import Response
    return importlib.import_module(Response.__module__.split(".")[0])


def hub_403(why: str, method: str, url: str) -> Exception:
    """The error huggingface_hub raises for the Hub's 403 answer with the reason `why` (its own hf_raise_for_status
    on such a response): its first line is the request id alone, the reason on the lines after."""
    from huggingface_hub.utils import hf_raise_for_status

    httpx2 = hub_http()
    try:
        hf_raise_for_status(httpx2.Response(403, headers={"X-Request-Id": "Root=1-abc", "X-Error-Message": why},
                                            json={"error": why}, request=httpx2.Request(method, url)))
    except Exception as e:   # noqa: BLE001 - whatever class this huggingface_hub raises is the point
        assert str(e).splitlines()[0] == "(Request ID: Root=1-abc)", str(e)   # (what model.hub.said is for)
        return e
    raise AssertionError("hf_raise_for_status raised nothing for a 403")



def saved_bytes(fn, exclude=()):
    """(fn's result, the bytes autograd keeps for backward while it runs): unique storages of the saved tensors that
    are still held when it returns, but those of the tensors `exclude` (parameters, inputs). A storage counts while
    any tensor saved on it lives: a graph branch the forward drops (a chunk loop's last state update) may save a view
    of a storage that live nodes keep too."""
    import weakref

    skip, held = {t.untyped_storage().data_ptr() for t in exclude}, {}

    def pack(t):
        held.setdefault(t.untyped_storage().data_ptr(), [t.untyped_storage().nbytes(), []])[1].append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(n for ptr, (n, refs) in held.items() if ptr not in skip and any(r() is not None for r in refs))


def planned_and_saved_activations(model, args, seq: int = 128, vocab: int = 128):
    """(planned, saved, the plan's activation terms) for one fp32 forward of `model` (one process) on `seq`
    random ids: saved = the bytes autograd keeps for backward (`saved_bytes`, parameters excluded, none freed during
    the forward); planned = `parallel.plan.memory_plan`'s saved-tensor, RoPE and final-norm terms for `args`
    (train.py's parsed flags), and its block checkpoints' under AC (--ac-blocks: the last blocks keep their saved
    tensors, so the forward's bytes are all in these terms)."""
    from parallel.mesh import validate
    from parallel.plan import memory_plan

    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(2))
    out, saved = saved_bytes(lambda: model(ids, labels=ids), list(model.parameters()))
    del out
    dims, pack_rows = validate(args, model.args, 1)
    terms = memory_plan(model.args, dims, args, "cpu", pack_rows).terms
    planned = sum(v for k, v in terms.items() if k.startswith(("activations: saved tensors", "activations: rope",
                                                                 "| or: final norm in")) or "block checkpoints" in k)
    return planned, saved, {k: v for k, v in terms.items() if k.startswith("activations")}
