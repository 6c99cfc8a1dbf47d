"""The README's references to the code are the code's: a new user copies them (review, helper 102).

- the layout table names every module of model/, parallel/ and data/ in its folder's row, and every file it names
  there exists;
- every `tests/test_x.py::name`, `test_x.py -k sel` and bare `test_name` the README cites selects a test;
- every "`parallel/x.py`'s `NAME`" and "`mod.NAME`" of a project module is defined there;
- every `--flag` it spells is one of train.py's, `--plan`'s, or a command's the README runs (model.merge,
  parallel.checkpoint, data.show, data.demo_compare, bench/*.py, torchrun, Slurm, pip);
- the packages `make install` installs from requirements.txt are the ones its install paragraph lists.
Plain text reads: no model, no process group.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import runpy
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SKIP = {"__init__.py"}


def _src(paths):
    return "\n".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in paths)


@pytest.mark.parametrize("folder", ["model", "parallel", "data"])
def test_layout_table_names_every_module(folder):
    row = next(r for r in README.splitlines() if r.startswith(f"| `{folder}/` |"))
    named = set(re.findall(r"`(\w+\.py)`", row))
    have = {os.path.basename(f) for f in glob.glob(os.path.join(ROOT, folder, "*.py"))} - SKIP
    assert have - named == set(), f"README's `{folder}/` row does not name {sorted(have - named)}"
    assert named - have == set(), f"README's `{folder}/` row names {sorted(named - have)}, which do not exist"


def _tests():
    return {os.path.relpath(f, ROOT): open(f, encoding="utf-8").read()
            for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)}


def test_cited_tests_exist():
    tests, bad = _tests(), []
    defs = {n for s in tests.values() for n in re.findall(r"def (test_\w+)", s)}
    for f, name in re.findall(r"(tests/(?:gpu/)?test_\w+\.py)::(\w+)", README):
        if not re.search(rf"def {name}\b", tests.get(f, "")):
            bad.append(f"{f}::{name}")
    for f, sel in re.findall(r"(test_\w+)(?:\.py)? -k (\w+)", README):
        names = re.findall(r"def (test_\w+)", tests.get(f"tests/{f}.py", ""))
        if not any(sel in n for n in names):
            bad.append(f"{f} -k {sel}")
    for name in set(re.findall(r"`(test_\w+)`", README)):
        if f"tests/{name}.py" not in tests and f"tests/gpu/{name}.py" not in tests and name not in defs:
            bad.append(name)
    assert not bad, f"the README cites tests that select nothing: {bad}"


def _modules():
    mods = {}
    for f in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")):
        if "/.venv" not in f:
            mods.setdefault(os.path.basename(f)[:-3], []).append(os.path.relpath(f, ROOT))
    return mods


def _defines(name, src):
    return re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*(?::[^=\n]*)?=|^\s*(?:from \S+ )?import .*\b{name}\b",
                     src, re.M) is not None


def test_cited_names_are_defined():
    mods, bad = _modules(), []
    for path, name in re.findall(r"`((?:\w+/)*\w+)\.py`'s `(\w+)`", README):
        files = [path + ".py"] if "/" in path else mods.get(path, [])   # `test_qlora.py`'s: tests/test_qlora.py
        if not all(os.path.exists(os.path.join(ROOT, f)) for f in files) or not _defines(name, _src(files)):
            bad.append(f"{path}.py's {name}")
    for mod, name in set(re.findall(r"`(?:\w+\.)?(\w+)\.(\w+)(?:\(\))?`", README)):
        if mod in mods and mod not in ("__init__",) and name not in ("py", "json", "jsonl", "png") \
                and name not in mods and not _defines(name, _src(mods[mod])):
            bad.append(f"{mod}.{name}")
    assert not bad, f"the README names what its module does not define: {sorted(bad)}"


def _help(*cmd):
    """What `python CMD --help` prints, run in this process (runpy, as the interpreter runs a script or `-m`; six
    interpreters importing torch cost ~20 s of a core, the same flags: checked against subprocesses 2026-12-07)."""
    out, argv = io.StringIO(), sys.argv
    module = cmd[0] == "-m"
    sys.argv = [cmd[1] if module else os.path.join(ROOT, cmd[0]), *cmd[2 if module else 1:], "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            # (runpy runs an imported module's code once more as __main__, in its own namespace: said, harmless here)
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            if module:
                runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:   # (argparse's --help exits 0)
        assert not e.code, f"{cmd} --help exited {e.code}: {out.getvalue()[-2000:]}"
    finally:
        sys.argv = argv
    return out.getvalue()


def test_spelled_flags_exist():
    known = set()
    for cmd in (["train.py"], ["train.py", "--plan"], ["-m", "model.merge"], ["-m", "parallel.checkpoint"],
                ["-m", "data.show"], ["-m", "data.demo_compare"]):
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", _help(*cmd)))
    for f in glob.glob(os.path.join(ROOT, "bench", "*.py")):
        known |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)", open(f, encoding="utf-8").read()))
    known |= {"--nproc_per_node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--rdzv",
              "--signals-to-handle", "--shutdown-timeout", "--signal", "--logdir", "--nodes", "--ntasks-per-node",
              "--gpus-per-node", "--cpus-per-task", "--no-index", "--no-deps", "--target", "--no-build-isolation",
              "--extra-index-url", "--dist", "--commit-message"}   # torchrun, tensorboard, Slurm, pip, pytest, hf:
    # not ours
    spelled = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", README))
    assert spelled - known == set(), f"the README spells flags no command has: {sorted(spelled - known)}"


def test_install_paragraph_lists_requirements():
    reqs = [re.split(r"[<>=\s#]", line, maxsplit=1)[0] for line in open(os.path.join(ROOT, "requirements.txt"))
            if line.strip() and not line.startswith("#")]
    para = re.search(r"then `requirements.txt` \(([^)]*)\)", README).group(1)
    listed = {p.strip() for p in para.split(",")}
    missing = [r for r in reqs if r != "torch" and r not in listed]
    assert not missing, f"README's install paragraph leaves out {missing} (requirements.txt installs them)"
