"""What a run records about its own code, so a resume can tell an edited fork from the run it continues.

A fork of train.py changes the math in code, not only in flags: LOSS_FN, the optimizer (`make_optimizer`), the LR
schedule (`lr_at`). train.py records each as a flag is recorded (config.json, every checkpoint's meta.json:
`loss`, `optimizer`, `schedule`), and parallel/resume.py refuses a resume where one differs.

Contract:
- `describe_code(fn) -> str`: "cross-entropy" for None (the fused default loss); else the callable's qualname and the
  source text of its definition (a lambda: the statement holding it; with several lambdas there, also its own
  constants and names), plus the numbers and strings it reads from its closure, its module or its defaults, and
  the descriptions of the fork's own functions it calls, imported or as a module's attributes (a helper the loss
  calls is the loss too; torch's and the standard library's are named only). The source is
  normalized (comments, docstrings and layout dropped: ast), so only an edit of the code itself is another record. A
  `functools.partial` adds its arguments; a callable object (an nn.Module loss, a class with __call__) is its
  class's source plus its plain attributes; `torch.compile` and `functools.wraps` wrappers are seen through. A
  callable with a `recorded_as` string attribute records that instead (two spellings of one code, named alike).
  Never raises (a part it cannot read is left out) and never holds a memory address: the same code describes alike
  in every process and launcher (`python train.py` and `import train` alike: no module names).
- `record(args, loss_fn, lr_fn, make_optimizer)`: sets args.loss, args.schedule, args.optimizer (the settings of the
  optimizer it builds on a dummy parameter) and args.optimizer_code (make_optimizer's code: it may split groups).
- `describe_optimizer(opt) -> dict`: {"class": ..., hyperparameter: value} of an optimizer's defaults as its first
  parameter group overrides them, without `lr`
  (the schedule sets it every step; --lr is a flag) and without the implementation switches (foreach, fused,
  capturable, differentiable) that change speed, not math. `same_optimizer(a, b)` compares two such records on
  the keys both have (another torch version may add a key with its neutral default).
- `first_difference(a, b) -> str`: where two recorded texts first differ, for the refusal.
- `NO_SOURCE` marks a record without source (a .pyc-only deployment): a resume cannot compare it and does not.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import re
import sysconfig
import textwrap

SPEED_ONLY = ("foreach", "fused", "capturable", "differentiable")
NO_SOURCE = "(no source)"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _plain(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or \
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float, str, bool, type(None))) for x in v)


def _value(v, seen) -> str:
    """A stable text for an argument: plain values as repr, callables described, anything else by its type."""
    if _plain(v):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_value(x, seen) for x in v) + ")"
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k!r}: {_value(x, seen)}" for k, x in items) + "}"
    if callable(v):
        return _describe(v, seen)
    return type(v).__qualname__


def _normalized(src: str) -> str:
    """The code without its comments, docstrings and layout (ast round trip), so rewording a comment or reflowing a
    line is the same code; a fragment that does not parse alone (a lambda cut out of a bracket) stays as written."""
    for text in (src, f"(\n{src}\n)"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return ast.unparse(tree)
    return src


def _source(obj) -> str | None:
    try:
        return _normalized(textwrap.dedent(inspect.getsource(obj)).strip())
    except (OSError, TypeError, IndentationError, SyntaxError):   # a builtin, `python -c`, a notebook cell gone
        return None


def _library(code_or_file) -> bool:
    f = getattr(code_or_file, "co_filename", code_or_file) or ""
    return any(d in f for d in ("site-packages", "dist-packages")) or f.startswith(sysconfig.get_paths()["stdlib"])


def _lines(code) -> str | None:
    """The full source lines a function's code spans (co_lines: line numbers with or without column positions)."""
    nums = [n for _, _, n in code.co_lines() if n is not None] + [code.co_firstlineno]
    lines = linecache.getlines(code.co_filename)
    got = "".join(lines[min(nums) - 1:max(nums)]) if lines else ""
    return _normalized(textwrap.dedent(got).strip()) if got.strip() else None


def _describe(fn, seen: set) -> str:
    fn = inspect.unwrap(fn) if callable(fn) else fn   # torch.compile / functools.wraps: the function itself
    if isinstance(getattr(fn, "recorded_as", None), str):
        return fn.recorded_as
    if isinstance(fn, functools.partial):
        return f"partial({_describe(fn.func, seen)}, args={_value(fn.args, seen)}, " \
               f"keywords={_value(fn.keywords, seen)})"
    if inspect.ismethod(fn) and not inspect.isclass(fn.__self__):   # Smooth(0.1).__call__: its object's settings too
        return f"{_describe(fn.__self__, seen)} .{fn.__func__.__name__}"
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if code is None:   # a callable object or a builtin: its class's code and its settings
        if inspect.isbuiltin(fn) or inspect.isroutine(fn):
            return name
        cls = type(fn)
        attrs = {k: v for k, v in sorted(vars(fn).items()) if not k.startswith("_") and _plain(v)} \
            if hasattr(fn, "__dict__") else {}
        src = _source(cls) if cls.__module__ not in ("builtins",) and not cls.__module__.startswith("torch") else None
        return f"{cls.__qualname__}{attrs or ''}" + (f": {src}" if src else "")
    if _library(code):   # torch's, the standard library's: named, not copied (they are not a fork's to edit)
        return f"{getattr(fn, '__module__', None) or '?'}.{name}"
    if id(code) in seen:   # recursion (a helper calling itself or the loss)
        return name
    seen.add(id(code))
    src = _source(fn)
    if fn.__name__ == "<lambda>":   # its whole lines (getsource stops at the first line of one opened in a bracket)
        src = _lines(code) or src
        if src and src.count("lambda") > 1:   # which of the statement's lambdas: its own literals and names
            consts = tuple(c for c in code.co_consts if _plain(c) and c is not None)
            src += f" [this lambda: literals {consts!r}, names {code.co_names}]"
    text = f"{name}: {src or NO_SOURCE}"
    reads = {}
    try:
        cv = inspect.getclosurevars(fn)
        scope = {**cv.globals, **cv.nonlocals}
    except (TypeError, ValueError):
        scope = {}
    defaults = dict(zip(code.co_varnames[code.co_argcount - len(fn.__defaults__ or ()):code.co_argcount],
                        fn.__defaults__ or ()))
    for k, v in sorted({**scope, **defaults, **(fn.__kwdefaults__ or {})}.items()):
        if _plain(v):
            reads[k] = v
        elif inspect.isfunction(u := inspect.unwrap(v) if callable(v) else v) and not _library(u.__code__):
            reads[k] = _describe(v, seen)   # a helper of the fork's own (this module's or another's): this code too
        elif callable(v) and not inspect.ismodule(v) and not inspect.isclass(v) and k in defaults:
            reads[k] = _value(v, seen)
        elif inspect.ismodule(v) and getattr(v, "__file__", None) and not _library(v.__file__):
            for attr in code.co_names:   # `import mysched; mysched.cosine(t)`: what it reads of the fork's module
                a = getattr(v, attr, None)
                if _plain(a) and a is not None or inspect.isfunction(a) and not _library(a.__code__):
                    reads[f"{k}.{attr}"] = a if _plain(a) else _describe(a, seen)
    if reads:
        text += " (reading " + ", ".join(f"{k}={v!r}" if _plain(v) else f"{k}=<{v}>" for k, v in reads.items()) + ")"
    return text


def describe_code(fn) -> str:
    """Module docstring."""
    if fn is None:
        return "cross-entropy"
    try:
        text = _describe(fn, set())
    except Exception:   # noqa: BLE001 - a description must never stop a run; the name alone is still a record
        text = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return _ADDRESS.sub("", text)


def record(args, loss_fn, lr_fn, make_optimizer) -> Exception | None:
    """train.py's code into `args` (`loss`, `schedule`, `optimizer`: recorded and compared as flags are). The optimizer
    is built once on a dummy parameter; a ValueError it raises (--lr nan) is returned, for train.py to raise once the
    flag checks, which name such a flag better, have run."""
    import torch

    args.loss, args.schedule = describe_code(loss_fn), describe_code(lr_fn)
    try:
        opt = make_optimizer([torch.nn.Parameter(torch.zeros(1))], args)
    except ValueError as e:
        return e
    args.optimizer, args.optimizer_code = describe_optimizer(opt), describe_code(make_optimizer)   # (param groups)
    return None


def not_a_sum(loss_fn) -> str | None:
    """Why train.py's LOSS_FN is not the SUM over its chunk's target rows (what makes every layout one process: train.py
    divides by the step's global target count), or None. Tried once at start-up on a random [8, 11] chunk: the whole
    must be its halves' sum, and rows with no target must add 0 (padding differs by layout). A call that raises, or
    a non-finite value on rows with targets, is no verdict (the run's own checks say those)."""
    import math

    import torch

    from loss import IGNORE_INDEX

    if loss_fn is None:
        return None
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(11, 11, generator=g), torch.randint(0, 11, (11,), generator=g)   # (rows 8..10: no target)
    y[[1, 6]] = IGNORE_INDEX
    try:
        with torch.no_grad():
            whole, a, b, none = (float(loss_fn(z[i:j], y[i:j] if i < 8 else torch.full((3,), IGNORE_INDEX)))
                                 for i, j in ((0, 8), (0, 4), (4, 8), (8, 11)))
    except Exception:   # noqa: BLE001 - no verdict: the run says what it raises
        return None
    if not all(math.isfinite(x) for x in (whole, a, b)):
        return None
    if none == 0 and math.isclose(whole, a + b, rel_tol=1e-2, abs_tol=1e-3):   # (NaN on no target: a mean's 0/0;
        # 1%: a sum in bf16 keeps ~3 digits, a mean is off by about 2x here; review, helper 59)
        return None
    return (f"LOSS_FN must return the SUM of its chunk's target rows' losses, rows with no target adding 0 (train.py "
            f"divides by the step's global target count, so every layout computes one process's loss; README: Forking "
            f"it): on a random chunk of 8 rows it gave {whole:.6g}, its halves {a:.6g} + {b:.6g}, 3 rows with no "
            f"target {none:.6g} (a mean, or a term over every row?)")


def describe_optimizer(opt) -> dict:
    """Module docstring."""
    group = {**opt.defaults, **opt.param_groups[0]}   # a fork's make_optimizer may set them per group
    hp = {k: v for k, v in group.items() if k not in ("lr", "params", "initial_lr") and k not in SPEED_ONLY}
    return {"class": type(opt).__qualname__, **{k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()}}


def same_optimizer(a: dict, b: dict) -> bool:
    norm = lambda v: list(v) if isinstance(v, tuple) else v   # noqa: E731
    return all(norm(a[k]) == norm(b[k]) for k in set(a) & set(b)) and a.get("class") == b.get("class")


def first_difference(a: str, b: str) -> str:
    """Module docstring: the first line that differs, with its number."""
    la, lb = str(a).splitlines() or [""], str(b).splitlines() or [""]
    for i in range(max(len(la), len(lb))):
        x, y = (la[i] if i < len(la) else "<end>"), (lb[i] if i < len(lb) else "<end>")
        if x != y:   # (a long line: 160 characters around its first difference, which a cut at 160 hid)
            k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            lo = max(0, k - 80)
            cut = lambda s, lo=lo: s if len(s) <= 160 else ("... " if lo else "") + s[lo:lo + 160] + (  # noqa: E731
                " ..." if lo + 160 < len(s) else "")
            return f"line {i + 1}: {cut(x)!r} there, {cut(y)!r} here"
    return "the same text"
