"""The step-time model's AC recompute GEMMs (parallel/plan_speed.py) = the GEMMs a real block recompute runs.

Pins: on CPU, NF4, AC on every block, a Llama-type block (Qwen2) and a Gemma 3 block (model/gemma.py's SandwichBlock,
`outputs_saved`), with and without --tiled-mlp: the base weights a token that every block linear's base multiplies
while `recomputing()` (its forward counted on the rows it runs: the tiles too, not the zeros a skipped base returns)
= what the step-time model adds for AC, (matmul with AC - without) · MATMUL / 2T. A Llama block's recompute skips
the 4-bit down_proj (and with --tiled-mlp the whole MLP); Gemma's reads the MLP's output (its post-feedforward norm
saves it), so down_proj runs there, and with --tiled-mlp its forward tiles do. Until 2026-12-07 the model skipped
down_proj, and with --tiled-mlp the MLP, in every model's recompute (an underestimate of every Gemma's).

Run: .venv/bin/python -m pytest -q tests/test_plan_speed_recompute.py
"""

import pytest
import torch
import transformers as T

import train
from model.load import read_args
from parallel.mesh import validate
from parallel.plan_speed import RATES, step_seconds
from parallel.recompute import _UnreadOutput, recomputing
from tests import test_gemma3
from tests.helpers import build_nonzero_b, tiny_checkpoint
from tests.test_gemma4 import ALL

B, S = 2, 29


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    llama = tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), inter=96)
    torch.manual_seed(0)
    gemma = tmp_path_factory.mktemp("gemma3")
    T.Gemma3ForCausalLM(T.Gemma3TextConfig(**test_gemma3.CONFIG)).float().save_pretrained(gemma,
                                                                                          max_shard_size="60KB")
    from tests.test_gemma4_small import SMALL  # (Gemma 4 E2B's form: PLE, KV sharing, double-wide MLPs)
    torch.manual_seed(0)
    small = tmp_path_factory.mktemp("gemma4_small")
    T.Gemma4ForCausalLM(T.Gemma4TextConfig(**SMALL, attention_k_eq_v=True)).float().save_pretrained(small)
    return {"llama": llama, "gemma": str(gemma), "gemma4_small": str(small)}


def recomputed_weights(path, tiled: bool) -> float:
    """Base weights a token that the blocks' recompute multiplies, counted on a real step."""
    from parallel.parallelize import BuildOptions

    model, _ = build_nonzero_b(BuildOptions(path, quant="nf4", lora_r=4, lora_alpha=8, seed=3, ac=True,
                                            tiled_mlp=tiled))
    done = [0]
    for i, block in enumerate(model.model.layers):
        bases = [m.base_layer for m in block.modules() if hasattr(m, "base_layer")]
        assert len(bases) == sum(model.args.has(i, t) for t in ALL), bases   # every projection adapted and counted
        bases += [m for n, m in block.named_modules() if n.startswith("per_layer_")]   # (E2B's PLE Linears: frozen)
        for base in bases:
            holder = base.forward if isinstance(base.forward, _UnreadOutput) else base   # (the skip wraps it)

            def counting(x, inner=holder.forward, size=base.in_features * base.out_features):
                if recomputing():
                    done[0] += x.reshape(-1, x.shape[-1]).shape[0] * size
                return inner(x)
            holder.forward = counting
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(5))
    s, n = model(ids, labels=ids)
    (s / n).backward()
    return done[0] / (B * S)


def modelled_weights(path, tiled: bool) -> float:
    m = read_args(path)
    got = []
    for ac in ((), ("--no-ac",)):
        args = train.build_parser().parse_args(["--max-len", str(S), "--quant", "nf4", "--dtype", "bf16",
                                                "--global-batch", "1", *ac, *(("--tiled-mlp",) if tiled else ())])
        dims, pack = validate(args, m, 1)
        got.append(step_seconds(m, dims, args, "cuda", pack)[1]["matmul"])
    return (got[0] - got[1]) * RATES["MATMUL"] / (2 * S)


@pytest.mark.parametrize("tiled", [False, True], ids=["ac", "tiled_mlp"])
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_recompute_gemms_are_the_real_recomputes(ckpts, name, tiled):
    real = recomputed_weights(ckpts[name], tiled)
    m = read_args(ckpts[name])
    D, F, L = m.dim, m.intermediate_size, m.n_layers
    attn = m.n_heads * m.head_dim * D * 2 + 2 * m.n_kv_heads * m.head_dim * D   # q, o; k, v
    # (tiled: the feed-forward unit, Gemma's post norm included, is skipped by a recompute: parallel/memory.py)
    mlp = {("llama", False): 2 * D * F, ("llama", True): 0, ("gemma", False): 3 * D * F, ("gemma", True): 0}
    assert real == L * (attn + mlp[name, tiled]), (name, tiled, real)   # (what the recompute ran: as described)
    assert modelled_weights(ckpts[name], tiled) == pytest.approx(real, rel=1e-9), (name, tiled)


def test_recompute_gemms_with_per_layer_inputs(ckpts):
    """Gemma 4 E2B's form: its blocks read the feed-forward unit's output after it (the per-layer input branch), so a
    recompute runs the unit's tiles with --tiled-mlp (parallel/memory.py), and the step-time model says so
    (plan_speed_block.unit_read); reuse layers recompute no k/v projections, the double-wide MLPs at their width."""
    for tiled in (False, True):
        real = recomputed_weights(ckpts["gemma4_small"], tiled)
        assert modelled_weights(ckpts["gemma4_small"], tiled) == pytest.approx(real, rel=1e-9), tiled
