# Every target runs inside .venv at the repo root. `make test` installs first when needed.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
NPROC   ?= 4

.PHONY: install install-gpu wheels test test-compat test-gpu demo lint bench bench-gpu plot clean

install: $(STAMP)

# torch goes in first: on a machine without CUDA the CPU wheel (torch==2.13.0+cpu: a pip source that holds it, as
# this project's CI machine has on disk, else PyTorch's CPU index; PyPI's own Linux wheel is a ~4.6 GB CUDA build), so
# no CUDA build is pulled by a dependency; a CUDA machine keeps the torch it already has.
$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch present: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch>=2.6"; \
	else $(PIP) install -q "torch==2.13.0+cpu" 2>/dev/null || \
	     $(PIP) install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu; fi
	$(PIP) install -q -r requirements.txt
	touch $(STAMP)

# Optional: flash-attn 2 for CUDA (compiles against the installed torch; never needed by `make test`).
install-gpu: install
	$(PIP) install -q packaging ninja
	$(PIP) install -q flash-attn --no-build-isolation

# Two pytest workers, each taking whole test files (a file's module fixtures, e.g. test_train's 4-rank runs, are built
# once): most tests keep one core busy, so on 2 cores the suite takes about half the time (2026-12-03: 552 s vs
# 807-1010 s serial). The costliest files first (tests/conftest.py's COSTLIEST_FIRST; --no-loadscope-reorder keeps that
# order), so neither worker is left alone on a long file at the end. TEST_WORKERS=0 runs it in this process, one test
# at a time.
TEST_WORKERS ?= 2
PYTEST_N = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PY) -m pytest -q $(PYTEST_N) tests --ignore=tests/gpu

# test-gpu and bench-gpu: on a machine whose python3 already imports a CUDA torch, that python3 runs
# them as is (no venv, no download: GPU machines may have no network, and their python3 may itself be a
# venv, which `python3 -m venv --system-site-packages` would not see through). Optional packages
# missing there (bitsandbytes, liger-kernel) come as wheels in the ignored .whl/ folder:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:. make test-gpu bench-gpu           (bench/gpu_session.sh does all of it)
# Anywhere else they run in .venv (`make install` first); bench-gpu then runs its CPU smoke mode.
HOST_CUDA = python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null

# The wheels a GPU session carries in .whl/ (on a machine with network; the GPU machine has none): python 3.12,
# x86_64; pip matches manylinux tags exactly and bitsandbytes 0.50.2 is tagged 2_24. About 43 MB (the device
# tool carries 64 MiB in all).
WHEELS ?= bitsandbytes==0.50.2 liger-kernel==0.8.5
wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl $(WHEELS)
	@du -sh .whl; ls .whl

test-gpu:
	@if $(HOST_CUDA); then echo "python3 with CUDA torch"; python3 -m pytest -q tests/gpu; \
	else $(MAKE) install && $(PY) -m pytest -q tests/gpu; fi

# The CPU suite under another torch (default 2.11.0, the GPU machine's) and the transformers and peft that machine
# had when it was last measured (2026-11-30), in its own .venv-compat: API changes that `make test` on the pinned CPU
# wheel and the newest libraries cannot see (2026-11-30: --compile failed under 2.11). PyPI's Linux torch wheels are
# CUDA builds: ~4.6 GB in the venv; they run on a machine without a GPU. Not part of CI.
COMPAT_TORCH ?= 2.11.0
COMPAT_PINS ?= transformers==5.17.0 peft==0.21.0
test-compat:
	test -x .venv-compat/bin/python || python3 -m venv .venv-compat
	.venv-compat/bin/pip install -q "torch==$(COMPAT_TORCH)" -r requirements.txt $(COMPAT_PINS)
	.venv-compat/bin/python -m pytest -q $(PYTEST_N) tests --ignore=tests/gpu

# One GPU: this trainer vs HF + bitsandbytes + peft (+ Liger), 32k x 28 layers and 128k x 8 layers,
# under 8 minutes; writes bench/gpu-results.json. ARGS passes flags, e.g. ARGS="--case 128k".
bench-gpu:
	@if $(HOST_CUDA); then python3 bench/gpu.py $(ARGS); else $(MAKE) install && $(PY) bench/gpu.py $(ARGS); fi

# The assets (corpus, tokenizer, a base pretrained on the corpus) are built once, with every core, and
# cached in runs/demo_assets; then LoRA on 4 gloo ranks, then the base's and the tuned model's answers.
demo: install
	$(PY) -c 'import sys; from data.demo import main; main(sys.argv[1:])' runs/demo_assets
	OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node $(NPROC) train.py --cp 2 --dp-shard 2 --out runs/demo --overwrite
	$(PY) -m data.demo_compare runs/demo
	$(PY) bench/plot.py runs/demo/metrics.jsonl runs/demo/loss.png

plot: install
	$(PY) bench/plot.py "$(or $(RUN),runs/demo)/metrics.jsonl" "$(or $(RUN),runs/demo)/loss.png"

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) bench/attention.py
	$(PY) bench/loss.py
	$(PY) bench/plan.py
	$(PY) bench/load.py

# What `make demo` and the tests made; never runs/ itself, where train.py's default --out keeps your runs.
clean:
	rm -rf runs/demo runs/demo_assets .pytest_cache
