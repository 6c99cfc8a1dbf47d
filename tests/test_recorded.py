"""What a run records about train.py's code (parallel/recorded.py), so a resume tells an edited fork from its run.

Pins: describe_code tells apart losses whose code differs, however spelled (a def reading a module constant and
calling a helper in its module, when the constant or the helper changes; lambdas sharing a line; a lambda opened
inside a bracket with its body on the next line; closure values; defaults; partial arguments; a callable object's
settings; an nn.Module loss's settings), sees through torch.compile, never raises, holds no memory address, and
gives the same text in another interpreter, also one without column positions (PYTHONNODEBUGRANGES), and from
another launcher's module name; describe_optimizer tells AdamW from Adam and other betas, and compares on the
keys both records have; first_difference names the first line that differs.

Run: .venv/bin/python -m pytest -q tests/test_recorded.py
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from parallel.recorded import describe_code, describe_optimizer, first_difference, same_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORK = '''
import torch.nn.functional as F
EPS = {eps}


def z_loss(z):
    return {zw} * z.logsumexp(-1).pow(2).sum()


def LOSS_FN(logits, labels):
    return F.cross_entropy(logits, labels, reduction="sum", label_smoothing=EPS) + z_loss(logits)


PAIR = (lambda z, y: 2 * z.sum(), lambda z, y: 3 * z.sum())
OPENED = (
    lambda z, y:
    z.sum() {op} 2
)


def scaled(k):
    return lambda z, y: z.sum() * k


def with_default(z, y, eps={eps}):
    return z.sum() * eps


class Smooth:
    def __init__(self, eps):
        self.eps = eps

    def __call__(self, z, y):
        return F.cross_entropy(z, y, reduction="sum", label_smoothing=self.eps)
'''


def fork(tmp_path, name, eps=0.1, zw=1e-4, op="*"):
    """A module as a fork's train.py would hold it, loaded from its own file."""
    d = tmp_path / name
    d.mkdir()
    (d / "fork.py").write_text(FORK.format(eps=eps, zw=zw, op=op))
    spec = importlib.util.spec_from_file_location(f"fork_{name}", d / "fork.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_describe_code_tells_edited_losses_apart(tmp_path):
    a, same, eps, zw, op = (fork(tmp_path, "a"), fork(tmp_path, "same"), fork(tmp_path, "eps", eps=0.2),
                            fork(tmp_path, "zw", zw=1.0), fork(tmp_path, "op", op="/"))
    assert describe_code(None) == "cross-entropy"
    d = describe_code
    assert d(a.LOSS_FN) == d(same.LOSS_FN), "the same code in another file (or module name) described otherwise"
    assert d(a.LOSS_FN).startswith("LOSS_FN: def LOSS_FN(logits, labels):") and "EPS=0.1" in d(a.LOSS_FN), d(a.LOSS_FN)
    assert d(a.LOSS_FN) != d(eps.LOSS_FN), "the module constant the loss reads"
    assert d(a.LOSS_FN) != d(zw.LOSS_FN), "the helper the loss calls"
    assert d(a.PAIR[0]) != d(a.PAIR[1]), "two lambdas of one line"
    assert "z.sum() * 2" in d(a.OPENED) and d(a.OPENED) != d(op.OPENED), d(a.OPENED)
    assert d(a.scaled(2)) != d(a.scaled(3)) and "k=2" in d(a.scaled(2)), d(a.scaled(2))
    assert d(a.with_default) != d(eps.with_default), "a default"
    assert d(a.Smooth(0.1)) != d(a.Smooth(0.2)) and d(a.Smooth(0.1).__call__) != d(a.Smooth(0.2).__call__)
    assert d(functools.partial(a.with_default, eps=0.1)) != d(functools.partial(a.with_default, eps=0.2))
    ce = lambda eps: describe_code(torch.nn.CrossEntropyLoss(label_smoothing=eps, reduction="sum"))  # noqa: E731
    assert ce(0.1) != ce(0.2) and "label_smoothing" in ce(0.1), ce(0.1)
    assert d(torch.compile(a.LOSS_FN)) == d(a.LOSS_FN), "torch.compile's wrapper described instead of the function"
    lib = d(functools.partial(F.cross_entropy, reduction="sum", weight=torch.sum))
    assert lib.startswith("partial(torch.nn.functional.cross_entropy,") and "def " not in lib and "0x" not in lib, lib


def test_comments_docstrings_and_layout_are_not_the_code(tmp_path):
    (tmp_path / "m1.py").write_text('def f(z, y):\n    """Old words."""\n    return z.sum() * 2  # why\n')
    (tmp_path / "m2.py").write_text('def f(z, y):\n    """New words,\n    two lines."""\n    # a comment\n'
                                    '    return (z.sum()\n            * 2)\n')
    (tmp_path / "m3.py").write_text('def f(z, y):\n    """Old words."""\n    return z.sum() * 3  # why\n')
    mods = []
    for n in ("m1", "m2", "m3"):
        spec = importlib.util.spec_from_file_location(n, tmp_path / f"{n}.py")
        mods.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(mods[-1])
    one, two, three = (describe_code(m.f) for m in mods)
    assert one == two == "f: def f(z, y):\n    return z.sum() * 2", (one, two)
    assert three != one


def test_describe_code_is_the_same_in_another_interpreter(tmp_path):
    fork(tmp_path, "a")
    code = ("import importlib.util, sys; sys.path.insert(0, {root!r}); from parallel.recorded import describe_code; "
            "s = importlib.util.spec_from_file_location('other_name', {path!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(repr([describe_code(f) for f in (m.LOSS_FN, *m.PAIR, m.OPENED)]))")
    code = code.format(root=ROOT, path=str(tmp_path / "a" / "fork.py"))
    a = fork(tmp_path, "b")
    want = repr([describe_code(f) for f in (a.LOSS_FN, *a.PAIR, a.OPENED)])
    for env, flags in (({}, []), ({"PYTHONNODEBUGRANGES": "1"}, []), ({"PYTHONHASHSEED": "3"}, ["-OO"])):
        r = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True,
                           env={**os.environ, **env})
        assert r.returncode == 0 and r.stdout.strip() == want, (env, flags, r.stdout, r.stderr, want)
    r = subprocess.run([sys.executable, "-OO", "-c", "import train; train.build_parser()"], capture_output=True,
                       text=True, cwd=ROOT)   # (no docstrings there: the parser's description came from one)
    assert r.returncode == 0, r.stderr[-600:]


def test_describe_code_never_raises():
    class Odd:   # a callable whose class source is not readable and whose attributes are not plain
        __slots__ = ()

        def __call__(self, z, y):
            return z.sum()
    for f in (Odd(), torch.sum, print, functools.partial(print, end=""), eval("lambda z, y: z.sum()")):
        assert isinstance(describe_code(f), str) and "0x" not in describe_code(f), f


def test_a_helper_in_another_module_of_the_fork_is_part_of_the_code(tmp_path, monkeypatch):
    for floor, name in ((0.1, "a"), (0.5, "b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mysched.py").write_text(f"import math\n\n\ndef cosine(t):\n    return {floor} + "
                                                    "0.5 * (1 + math.cos(math.pi * t))\n")
        (tmp_path / name / "fork.py").write_text("from mysched import cosine\n\n\ndef lr_at(step, args, total):\n"
                                                 "    return args.lr * cosine(step / total)\n")
        (tmp_path / name / "fork2.py").write_text("import mysched\n\n\ndef lr_at(step, args, total):\n"
                                                  "    return args.lr * mysched.cosine(step / total)\n")
    got = []
    for name in ("a", "b"):
        monkeypatch.syspath_prepend(str(tmp_path / name))
        for m in ("mysched", "fork", "fork2"):
            sys.modules.pop(m, None)
        got.append((describe_code(__import__("fork").lr_at), describe_code(__import__("fork2").lr_at)))
    for m in ("mysched", "fork", "fork2"):
        sys.modules.pop(m, None)
    for i, how in enumerate(("imported", "a module attribute")):
        assert "0.1 + 0.5" in got[0][i] and got[0][i] != got[1][i], (how, got)


def test_describe_optimizer_and_the_keys_both_record():
    p = [torch.nn.Parameter(torch.zeros(1))]
    grouped = describe_optimizer(torch.optim.AdamW([{"params": p, "weight_decay": 0.1, "betas": (0.9, 0.95)}]))
    assert grouped["weight_decay"] == 0.1 and grouped["betas"] == [0.9, 0.95], "a group's own settings"
    adamw = describe_optimizer(torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1))
    assert adamw["class"] == "AdamW" and adamw["betas"] == [0.9, 0.999] and "lr" not in adamw and "foreach" not in adamw
    assert same_optimizer(adamw, describe_optimizer(torch.optim.AdamW(p, lr=5e-2, weight_decay=0.1))), "lr is a flag"
    assert not same_optimizer(adamw, describe_optimizer(torch.optim.AdamW(p, betas=(0.9, 0.95), weight_decay=0.1)))
    assert not same_optimizer(adamw, describe_optimizer(torch.optim.Adam(p, weight_decay=0.1)))
    older = {k: v for k, v in adamw.items() if k != "decoupled_weight_decay"}   # a torch without that key
    assert same_optimizer(older, adamw)


def test_first_difference_names_the_line():
    assert first_difference("def f(z):\n    return z", "def f(z):\n    return 2 * z") == \
        "line 2: '    return z' there, '    return 2 * z' here"
    assert first_difference("a", "a\nb") == "line 2: '<end>' there, 'b' here"


def test_a_loss_fn_that_is_not_a_sum_is_refused_at_start_up(tmp_path):
    """LOSS_FN must return the SUM over its chunk's target rows (train.py divides by the step's global target count):
    a mean, or a term over every row (padding differs by layout), trained another loss on every layout but one and
    no check said so (review, helper 58). Checked on a random chunk against F.cross_entropy's own sum; a function that
    raises or is non-finite there gives no verdict (the run says those)."""
    import torch
    import torch.nn.functional as F

    from loss import IGNORE_INDEX
    from parallel.recorded import not_a_sum

    ce = lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE_INDEX, reduction="sum")   # noqa: E731
    kept = lambda z, y: (y != IGNORE_INDEX).float()   # noqa: E731
    assert not_a_sum(None) is None and not_a_sum(ce) is None
    assert not_a_sum(lambda z, y: ce(z, y) + 1e-4 * (torch.logsumexp(z, 1) ** 2 * kept(z, y)).sum()) is None   # z-loss
    mean = not_a_sum(lambda z, y: F.cross_entropy(z, y, ignore_index=IGNORE_INDEX))
    assert mean.startswith("LOSS_FN must return the SUM of its chunk's target rows' losses") and "(a mean" in mean
    assert "3 rows with no target" in not_a_sum(lambda z, y: ce(z, y) + 1e-4 * (torch.logsumexp(z, 1) ** 2).sum())
    assert not_a_sum(lambda z, y: ce(z, y) * float("nan")) is None   # (NaN on rows with targets)
    for scale in (0.5, 1, 2, 3, 10):   # a sum in bf16 or fp16 is one (it keeps ~3 digits; review, helper 59)
        for dt in (torch.bfloat16, torch.float16):
            assert not_a_sum(lambda z, y, s=scale, d=dt: ce((s * z).to(d), y)) is None, (scale, dt)
    assert not_a_sum(lambda z, y: ce(z, y) / len(y)) is not None   # (divided by the chunk's rows: a mean too)
    assert not_a_sum(lambda z, y: 1 / 0) is None


def test_a_long_line_is_shown_around_its_difference():
    """The refusal of an edited loss shows the first differing line around its first difference: two 300-character
    lines that differ at character 250 (a partial's keywords) were cut at 160 and printed alike (review, helper 58)."""
    from parallel.recorded import first_difference

    a, b = "x" * 250 + "0.1" + "y" * 50, "x" * 250 + "0.2" + "y" * 50
    said = first_difference(a, b)
    assert "0.1" in said and "0.2" in said and said.startswith("line 1: '... x"), said
    assert first_difference("short 1", "short 2") == "line 1: 'short 1' there, 'short 2' here"
