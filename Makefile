# Every target runs inside .venv at the repo root. `make test` installs first when needed.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed
NPROC   ?= 4

.PHONY: install install-gpu test test-gpu demo lint bench plot clean

install: $(STAMP)

# torch goes in first: on a machine without CUDA the CPU wheel (torch==2.13.0, on disk here) so no
# multi-GB CUDA build is pulled by a dependency; a CUDA machine keeps the torch it already has.
$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch present: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch>=2.6"; \
	else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -r requirements.txt
	touch $(STAMP)

# Optional: flash-attn 2 for CUDA (compiles against the installed torch; never needed by `make test`).
install-gpu: install
	$(PIP) install -q packaging ninja
	$(PIP) install -q flash-attn --no-build-isolation

test: install
	$(PY) -m pytest -q tests --ignore=tests/gpu

test-gpu: install
	$(PY) -m pytest -q tests/gpu

# The assets (corpus, tokenizer, a base pretrained on the corpus) are built once, with every core, and
# cached in runs/demo_assets; then LoRA on 4 gloo ranks, then the base's and the tuned model's answers.
demo: install
	$(PY) -m data.demo runs/demo_assets
	OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node $(NPROC) train.py --cp 2 --dp-shard 2
	$(PY) -m data.demo_compare runs/demo
	$(PY) bench/plot.py runs/demo/metrics.jsonl runs/demo/loss.png

plot: install
	$(PY) bench/plot.py $(or $(RUN),runs/demo)/metrics.jsonl $(or $(RUN),runs/demo)/loss.png

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) bench/attention.py
	$(PY) bench/loss.py
	$(PY) bench/plan.py

clean:
	rm -rf runs .pytest_cache
