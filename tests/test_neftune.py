"""NEFTune (`--neftune-alpha A`, parallel/neftune.py): transformers' scale, and noise the layout never changes.

Pins:
- scale: one unpacked sample of S tokens without padding takes noise (the block-0 input of our decoder with the noise
  minus without) within transformers' `neftune_post_forward_hook` bound A / sqrt(S·d) (that hook's own noise reaches
  it too), reaching it, mean ~0, std ~bound / sqrt(3); in a packed row of two documents (L1 != L2) and padding, each
  document takes its own bound (transformers' hook on that document alone), the padding none;
- keys: a micro-batch's tokens take the same noise packed or padded in rows, alone or beside others, on every cp shard
  (Ulysses, ring, hybrid: unsharded back), and other noise at another stream position or seed;
- train.py end to end (gloo, the tiny Qwen2 of conftest, 2 steps of --global-batch 4, evaluated on the first 10 chat
  records: `SHORT`): 1 rank with --neftune-alpha 5
  = cp2 × dp_shard2 Ulysses with the tiled MLP and offload = cp2 × dp_shard2 ring with 2 packed documents a row
  (every step's loss and grad norm, the adapter) = --micro-batch 2 (packed, and --no-pack) = --micro-batch auto =
  --no-ac; without the flag the losses differ; the eval loss before training is the flag-less run's (no noise in
  evaluation); stopped after step 1 and resumed, the run's step 2 ends as the uninterrupted one's;
- the planner: AC's first checkpoint keeps the noised embedding output (no ids to look up again), offloaded too;
- refusals, before any weight is read: with --objective dpo, alpha <= 0, nan, inf.

Run: .venv/bin/python -m pytest -q tests/test_neftune.py
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re

import pytest
import torch

from parallel.mesh import ParallelDims
from parallel.neftune import add_noise, keys
from tests.dist import run_ranks
from tests.helpers import one_thread, startup_error, train_argv
from tests.test_train import _adapter, _compare, _metrics

ONE = ParallelDims(1, dp_shard=1, cp=1)


def _tiny(d=256, vocab=100):
    from model.config import ModelArgs
    from model.llama import Transformer

    torch.manual_seed(0)
    m = ModelArgs(model_type="qwen2", vocab_size=vocab, dim=d, n_layers=1, n_heads=4, n_kv_heads=2,
                  intermediate_size=64)
    return Transformer(m).eval()


def _block0_input(model, ids, noise=None):
    """The decoder's block-0 input (the embedding output, noised or not) for `ids`."""
    got = []
    h = model.model.layers[0].register_forward_pre_hook(lambda mod, a: got.append(a[0].clone()))
    with torch.no_grad():
        model(ids, noise=noise)
    h.remove()
    return got[0]


def _transformers_delta(model, ids, alpha):
    """transformers' neftune_post_forward_hook on our embedding: its noise for `ids` alone."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    emb = model.model.embed_tokens
    emb.neftune_noise_alpha = alpha
    emb.train()
    h = emb.register_forward_hook(neftune_post_forward_hook)
    with torch.no_grad():
        noisy = emb(ids)
    h.remove()
    emb.eval()
    with torch.no_grad():
        return noisy - emb(ids)


def _uniform_within(delta, bound, label):
    """delta's elements: within [-bound, bound], reaching it, mean ~0, std ~bound / sqrt(3) (tolerances from n)."""
    n, sd = delta.numel(), bound / math.sqrt(3)
    assert delta.abs().max() <= bound * (1 + 1e-6), f"{label}: {delta.abs().max()} above the bound {bound}"
    assert delta.abs().max() > 0.99 * bound, f"{label}: max {delta.abs().max()} far below the bound {bound}"
    assert abs(delta.mean()) < 5 * sd / math.sqrt(n), f"{label}: mean {delta.mean()}"
    assert abs(delta.std() / sd - 1) < 5 * math.sqrt(0.8 / (4 * n)) + 1e-3, f"{label}: std {delta.std()} vs {sd}"


def test_scale_is_transformers_bound_per_document():
    A, d = 5.0, 256
    model = _tiny(d)
    S = 64
    ids = torch.randint(0, 100, (1, S))
    k = keys([S], [3], pack=False, dims=ONE, cp_rank=0)
    ours = _block0_input(model, ids, lambda x: add_noise(x, k, A, 0)) - _block0_input(model, ids)
    theirs = _transformers_delta(model, ids, A)
    bound = A / math.sqrt(S * d)
    _uniform_within(theirs, bound, "transformers' hook, one sample")   # (their bound is A / sqrt(S·d))
    _uniform_within(ours, bound, "ours, one sample")
    # packed: two documents of 40 and 17 tokens, padded to 64 (a cp divisor of 64): each its own bound
    L1, L2 = 40, 17
    ids = torch.randint(0, 100, (1, 64))
    k = keys([L1, L2], [8, 9], pack=True, dims=ParallelDims(1, dp_shard=1, cp=1), cp_rank=0)
    k = torch.cat([k, torch.full((1, 64 - L1 - L2, 3), -1)], 1)
    ours = _block0_input(model, ids, lambda x: add_noise(x, k, A, 0)) - _block0_input(model, ids)
    for (a, b), label in (((0, L1), "document 1"), ((L1, L1 + L2), "document 2")):
        theirs = _transformers_delta(model, ids[:, a:b], A)   # that document alone: its length is the hook's S
        _uniform_within(theirs, A / math.sqrt((b - a) * d), f"transformers' hook, {label}")
        _uniform_within(ours[:, a:b], A / math.sqrt((b - a) * d), f"ours, {label}")
    assert torch.equal(ours[:, L1 + L2:], torch.zeros_like(ours[:, L1 + L2:])), "padding is noised"


def _noise(lengths, stream, pack, dims, d=32, seed=7):
    """Each sample's [n, d] noise, laid out as `pack` and `dims` lay it (every cp shard's, unsharded back)."""
    from parallel.cp import unshard_sequence

    parts = []
    for r in range(dims.cp):
        k = keys(lengths, stream, pack, dims, r)
        x = torch.zeros(*k.shape[:2], d)
        add_noise(x, k, 5.0, seed)
        parts.append(x)
    full = unshard_sequence(parts, dims)
    if pack:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return [full[0, s:s + n] for s, n in zip(starts, lengths)]
    return [full[b, :n] for b, n in enumerate(lengths)]


def test_a_token_takes_the_same_noise_on_every_layout():
    lengths, stream = [7, 12, 5], [18, 19, 20]
    want = _noise(lengths, stream, False, ONE)
    layouts = {"packed": (True, ONE),
               "ulysses 2": (True, ParallelDims(2, dp_shard=1, cp=2, ulysses=2, ring=1)),
               "ring 2": (True, ParallelDims(2, dp_shard=1, cp=2, ulysses=1, ring=2)),
               "ring 2 padded rows": (False, ParallelDims(2, dp_shard=1, cp=2, ulysses=1, ring=2)),
               "hybrid 2 x 2": (True, ParallelDims(4, dp_shard=1, cp=4, ulysses=2, ring=2))}
    for label, (pack, dims) in layouts.items():
        got = _noise(lengths, stream, pack, dims)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), label
    alone = _noise([12], [19], False, ONE)[0]   # the second sample alone in its micro-batch (another rank's cut)
    assert torch.equal(alone, want[1]), "alone"
    assert not torch.equal(_noise([12], [20], False, ONE)[0], want[1]), "another stream position, the same noise"
    assert not torch.equal(_noise(lengths, stream, False, ONE, seed=8)[1], want[1]), "another seed, the same noise"
    assert all(w.abs().min() > 0 for w in want)
    from parallel.neftune import NEFTune
    n = NEFTune(5.0, 7, torch.tensor([0, 7, 12, 5]), 8, 1, 4, True, ONE, 0)   # data rank 1 of 4: positions 2, 3
    idxs = [[1, 2], [3], []]   # (an idle micro-batch last: --micro-batch auto's padding)
    assert n(2, idxs, 2) is None
    x = torch.zeros(1, 5, 32)
    n(2, idxs, 1)(x)   # step 2's positions 16.. + 2 (rank 1's share) + 2 (the micro-batch before)
    assert torch.equal(x[0], want[2]), "micro-batch 1 of data rank 1: not stream position 20"


@pytest.mark.parametrize("how", ["offload", "group"])
def test_planner_counts_the_noised_first_checkpoint(tmp_path, how):
    """AC's first checkpoint keeps the noised embedding output, as --train-embeddings' (ac._FromIds' lookup would lose
    the noise): offload moves L block inputs, not L - 1, and --ac-group 2 keeps ceil(L/2) group inputs, not one fewer;
    the plan with --neftune-alpha says so, against what a real forward keeps."""
    import train
    from parallel.mesh import validate
    from parallel.parallelize import BuildOptions, build_model
    from parallel.plan import memory_plan
    from tests.helpers import tiny_checkpoint
    from tests.test_plan import term

    path = tiny_checkpoint(tmp_path / "ckpt", heads=4, kv_heads=2, head_dim=16, layers=4, vocab=256, inter=96,
                           max_shard_size="50MB")
    opts = {"offload": dict(offload_activations=True), "group": dict(ac_group=2)}[how]
    model, _ = build_model(BuildOptions(path, quant="nf4", dtype=torch.float32, ac=True, **opts), device="cpu")
    T, D = 128, model.args.dim
    ids = torch.randint(0, 256, (1, T))
    k = keys([T], [0], True, ONE, 0)
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        model(ids, labels=ids, noise=lambda x: add_noise(x, k, 5.0, 0))
    flags = {"offload": ["--offload-activations"], "group": ["--ac-group", "2"]}[how]
    args = train.build_parser().parse_args(["--model", path, "--max-len", str(T), "--global-batch", "1",
                                            "--neftune-alpha", "5", *flags])
    dims, pack_rows = validate(args, model.args, 1)
    if how == "offload":
        moved = model.model.layers[0].forward.hooks.moved
        p = memory_plan(model.args, dims, args, "cuda", pack_rows)
        assert moved == 4 and p.host == moved * p.host_each, (moved, p.host / p.host_each)
    else:
        p = memory_plan(model.args, dims, args, "cpu", pack_rows)
        inputs = held.count(((1, T, D), torch.float32)) - 1   # (the final norm's input: the loss phase's)
        assert inputs == 2 and term(p, "activations: 2 group") == inputs * 4 * T * D


# ----------------------------------------------------------------------------- train.py end to end

NEF = ["--neftune-alpha", "5"]
SHORT = ["--steps", "2", "--global-batch", "4"]   # every run of `runs` (nothing resumes after step 1)
FOUR = {"cp2_dp2_ulysses_mem": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ulysses", "--tiled-mlp",
                                "--offload-activations", *NEF],
        "cp2_dp2_ring_pack_mb2": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "2", *NEF],
        # cut by tokens: a data rank with fewer cuts runs idle rows (no sample: no noise) beside the other's
        # (unit-tested in test_a_token_takes_the_same_noise_on_every_layout: its idle micro-batch last)
        "cp2_dp2_ring_mb_auto": ["--cp", "2", "--dp-shard", "2", "--cp-impl", "ring", "--micro-batch", "auto", *NEF]}


def _four_ranks(rank, world_size, assets, root):
    import train

    for name, flags in FOUR.items():
        train.main(train_argv(assets, os.path.join(root, name), *SHORT, *flags))


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    import train
    from tests.helpers import eval_head

    root = str(tmp_path_factory.mktemp("neftune"))
    evals = ["--eval-data", eval_head(assets)]
    one = {"ref": [*NEF, "--save-every", "1", "--keep-ckpts", "3", *evals], "plain": evals,
           "mb2": [*NEF, "--micro-batch", "2"], "mb2_no_pack": [*NEF, "--micro-batch", "2", "--no-pack"],
           "mb_auto": [*NEF, "--micro-batch", "auto"], "no_ac": [*NEF, "--no-ac"],
           # the weights ref ended at, evaluated before a step of a run without the flag
           "at_ref": ["--init-adapter", os.path.join(root, "ref", "adapter"), "--steps", "1", *evals]}
    said = {}
    with one_thread():
        for name, flags in one.items():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                train.main(train_argv(assets, os.path.join(root, name), *SHORT, *flags))
            said[name] = out.getvalue()
        train.main(train_argv(assets, os.path.join(root, "resumed"), *SHORT, *NEF, *evals, "--resume",
                              os.path.join(root, "ref", "ckpt", "step_000001")))
    run_ranks(_four_ranks, 4, assets, root, timeout=540, pg_timeout=120)
    return root, said


@pytest.mark.timeout(900)
def test_every_layout_trains_as_one_rank(runs):
    root, _ = runs
    ref = os.path.join(root, "ref")
    for name in ("mb2", "mb2_no_pack", "mb_auto", "no_ac", *FOUR):
        _compare(name, os.path.join(root, name), ref, steps=(1, 2))
    plain, noisy = _metrics(os.path.join(root, "plain")), _metrics(ref)
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(plain, noisy)), (plain, noisy)   # the noise is on


@pytest.mark.timeout(900)
def test_no_noise_in_evaluation(runs):
    """The eval loss before training (the same weights in both runs) is the flag-less run's, to the digit; so is the one
    after step 2 (the adapter it exported, evaluated by a run without the flag before its first step), which the 2 steps
    moved by over 100 x that 1e-6 (6.7e-3 until the assets model's attention was sharpened, q and k x 14 on
    2026-12-07; 1.5e-4 since: the check was > 1e-3)."""
    root, said = runs
    before = lambda name: float(re.search(r"eval_loss before training (\S+)", said[name]).group(1))
    assert before("ref") == before("plain"), (before("ref"), before("plain"))
    last = _metrics(os.path.join(root, "ref"))[-1]["eval_loss"]
    assert abs(last - before("at_ref")) <= 1e-6, (last, before("at_ref"))
    assert abs(last - before("ref")) > 100 * 1e-6, "trained: the weights moved"


@pytest.mark.timeout(900)
def test_resumed_after_step_1_ends_as_the_uninterrupted_run(runs):
    root, _ = runs
    _compare("resumed from step 1", os.path.join(root, "resumed"), os.path.join(root, "ref"), steps=(2,))
    a, b = _adapter(os.path.join(root, "resumed")), _adapter(os.path.join(root, "ref"))
    assert all(torch.equal(a[k], b[k]) for k in b), "a 1-rank resume is the same arithmetic: bit for bit"


@pytest.mark.parametrize("flags,phrases", [
    (["--objective", "dpo", "--neftune-alpha", "5"], ["--neftune-alpha 5 with --objective dpo",
                                                      "drop --neftune-alpha"]),
    (["--neftune-alpha", "0"], ["--neftune-alpha must be a finite number above 0", "got 0"]),
    (["--neftune-alpha", "-1"], ["--neftune-alpha must be a finite number above 0", "got -1"]),
    (["--neftune-alpha", "nan"], ["--neftune-alpha must be a finite number above 0", "got nan"]),
    (["--neftune-alpha", "inf"], ["--neftune-alpha must be a finite number above 0", "got inf"]),
], ids=["dpo", "zero", "negative", "nan", "inf"])
def test_refused_before_any_weight(assets, tmp_path, flags, phrases):
    out = str(tmp_path / "out")
    msg = startup_error(train_argv(assets, out, *flags))
    assert all(p in msg for p in phrases), msg
    assert not os.path.exists(out)


def test_resume_keeps_the_alpha():
    """--neftune-alpha defines the run (parallel/resume.py's RUN_DEFINING): a resume with another alpha, or without it,
    is refused naming it; a checkpoint from before the flag resumes without it."""
    from parallel import resume
    from tests.test_runs import CKPT

    for was, now in ((5.0, 1.0), (5.0, None), (None, 5.0)):
        with pytest.raises(ValueError, match="neftune"):
            resume.check_resume({**CKPT, "neftune_alpha": was}, {**CKPT, "neftune_alpha": now})
    resume.check_resume(dict(CKPT), {**CKPT, "neftune_alpha": None})   # (recorded before the flag: none)
    resume.check_resume({**CKPT, "neftune_alpha": 5.0}, {**CKPT, "neftune_alpha": 5.0})
