"""train.py's `lr_at` (--lr-schedule, --min-lr-ratio, --wsd-decay, --warmup) against transformers' own schedulers,
stepped as a training loop steps them (the LR each optimizer step trains at):

- after warmup, every schedule equals transformers': cosine = `get_cosine_with_min_lr_schedule_with_warmup`,
  linear = `get_linear_schedule_with_warmup` (to 0) and `get_wsd_schedule` with no stable phase and a linear decay
  (to a floor), constant = `get_constant_schedule_with_warmup`, wsd = `get_wsd_schedule` (cosine decay);
- warmup starts at --lr / --warmup, as `get_cosine_with_min_lr_schedule_with_warmup_lr_rate` warms up (the others
  train their first step at 0).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import transformers.optimization as hf

LR = 3e-4


def _hf_lrs(make, total: int) -> list[float]:
    """The LR of each of `total` steps under a transformers scheduler: read, step the optimizer, step the schedule."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched, out = make(opt), []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _ours(schedule: str, warmup: int, total: int, ratio=None, decay=None) -> list[float]:
    import train

    args = argparse.Namespace(lr=LR, warmup=warmup, lr_schedule=schedule, min_lr_ratio=ratio, wsd_decay=decay)
    return [train.lr_at(k, args, total) for k in range(total)]


def _same(ours, theirs, steps, label):
    for k in steps:
        assert math.isclose(ours[k], theirs[k], rel_tol=1e-12, abs_tol=1e-18), \
            f"{label} step {k}: ours {ours[k]!r}, transformers {theirs[k]!r}"


CASES = [(w, t) for t in (1, 2, 7, 40) for w in (0, 1, 3, 10) if w < t]


@pytest.mark.parametrize("warmup,total", CASES)
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.35, 1.0])
def test_cosine_is_transformers_cosine_with_min_lr(warmup, total, ratio):
    ours = _ours("cosine", warmup, total, ratio)
    theirs = _hf_lrs(lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr_rate=ratio),
                     total)
    _same(ours, theirs, range(warmup, total), f"cosine w{warmup} T{total} r{ratio}")
    warm = _hf_lrs(lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup_lr_rate(o, warmup, total,
                                                                                  min_lr_rate=ratio), total)
    _same(ours, warm, range(warmup), f"warmup w{warmup}")
    assert warmup == 0 or ours[0] == LR / warmup


@pytest.mark.parametrize("warmup,total", CASES)
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.35])
def test_linear_is_transformers_linear_decay(warmup, total, ratio):
    ours = _ours("linear", warmup, total, ratio)
    if ratio == 0:
        theirs = _hf_lrs(lambda o: hf.get_linear_schedule_with_warmup(o, warmup, total), total)
    else:   # a floor: transformers' WSD with no stable phase and a linear decay over the steps after warmup
        theirs = _hf_lrs(lambda o: hf.get_wsd_schedule(o, warmup, total - warmup, total, decay_type="linear",
                                                       min_lr_ratio=ratio), total)
    _same(ours, theirs, range(warmup, total), f"linear w{warmup} T{total} r{ratio}")


@pytest.mark.parametrize("warmup,total", CASES)
def test_constant_is_transformers_constant(warmup, total):
    ours = _ours("constant", warmup, total)
    _same(ours, _hf_lrs(lambda o: hf.get_constant_schedule_with_warmup(o, warmup), total), range(warmup, total),
          f"constant w{warmup} T{total}")


@pytest.mark.parametrize("warmup,total", CASES)
@pytest.mark.parametrize("decay", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("ratio", [0.0, 0.1])
def test_wsd_is_transformers_wsd(warmup, total, decay, ratio):
    """Warmup, flat at --lr, then a cosine decay over round(--wsd-decay × steps) to the floor (when those steps
    overlap warmup, the decay starts after it: transformers' would have a negative stable phase)."""
    ours = _ours("wsd", warmup, total, ratio, decay)
    n = round(decay * total)
    if total - n < warmup:
        theirs = _hf_lrs(lambda o: hf.get_wsd_schedule(o, warmup, total - warmup, total, min_lr_ratio=ratio), total)
    else:
        theirs = _hf_lrs(lambda o: hf.get_wsd_schedule(o, warmup, n, total, min_lr_ratio=ratio), total)
        assert all(x == LR for x in ours[warmup:total - n]), "the stable phase is --lr"
    _same(ours, theirs, range(warmup, total), f"wsd w{warmup} T{total} decay {decay} r{ratio}")


def test_past_the_end_the_lr_stays_at_its_floor():
    """A resume that trains past its run's --steps (`total`: the schedule's length) stays at the end's LR."""
    for schedule, ratio, decay in (("cosine", 0.1, None), ("linear", 0.2, None), ("wsd", 0.0, 0.3)):
        ours = _ours(schedule, 2, 10, ratio, decay)
        import train

        args = argparse.Namespace(lr=LR, warmup=2, lr_schedule=schedule, min_lr_ratio=ratio, wsd_decay=decay)
        assert [train.lr_at(k, args, 10) for k in (10, 11, 50)] == [LR * ratio] * 3, schedule
        assert ours[-1] > LR * ratio or ratio == 1
