#!/usr/bin/env bash
# The one device call of a GPU session: optional wheels -> `make test-gpu` -> `make bench-gpu`, all
# logs and bench/gpu-results.json copied to $OUT, inside 570 s of wall time (the device tool allows
# 600 s per command). Not run by CI or `make test`.
#
# The GPU machine's python3 (a venv with torch 2.11+cu130, transformers, peft, pytest) has no network
# and lacks bitsandbytes (NF4, needed) and liger-kernel (optional peer row). Bring them as wheels in
# the ignored .whl/ folder, fetched on a machine with network, e.g.
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl bitsandbytes==0.50.2 liger-kernel==0.8.5
# (bitsandbytes wheels are py3-none-manylinux x86_64 and carry their CUDA libraries; liger-kernel is
# pure Python on the machine's own Triton). They are installed with --no-index --no-deps into
# /tmp/site and put first on PYTHONPATH. The tree that travels is capped at 64 MiB: check the wheel
# sizes (`du -sh .whl`) before carrying them.
#
# Device tool call:  run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Knobs (environment): TEST_S (default 150) and the rest for the bench, BENCH_ARGS (e.g. "--case 32k").
# The long case (524,288 tokens, 8 layers, one step each with --tiled-mlp --offload-activations and with
# --tiled-mlp --tiled-attn, peak vs plan; ~2.5 min a step by FLOPs) does not fit next to the tests: give it a
# device call of its own,
#   run(command="TEST_S=0 BENCH_ARGS='--case long' bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
TOTAL=570
TEST_S=${TEST_S:-150}

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -5
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "gpus", torch.cuda.device_count(),
      "capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
for d in ("transformers", "peft", "accelerate", "bitsandbytes", "liger-kernel", "flash-attn", "pytest"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
EOF
} 2>&1 | tee "$OUT/env.txt"

echo "== demo assets (the tokenizer and the model the GPU tests train; built once, on the CPU)"
timeout 150 python3 -c "from data.demo import make_demo; make_demo('runs/demo_assets')" 2>&1 | tail -3

if [ "$TEST_S" -gt 0 ]; then
  echo "== make test-gpu (cap ${TEST_S}s)"
  timeout "$TEST_S" make test-gpu 2>&1 | tee "$OUT/test-gpu.log"
  echo "test-gpu exit ${PIPESTATUS[0]} after $((SECONDS - T0))s" | tee -a "$OUT/test-gpu.log"
fi

LEFT=$((TOTAL - (SECONDS - T0)))
echo "== make bench-gpu (cap ${LEFT}s, bench budget $((LEFT - 20))s)"
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" make bench-gpu ARGS="--budget $((LEFT - 20)) ${BENCH_ARGS:-}" 2>&1 | tee "$OUT/bench-gpu.log"
  echo "bench-gpu exit ${PIPESTATUS[0]} after $((SECONDS - T0))s" | tee -a "$OUT/bench-gpu.log"
else
  echo "no time left for bench-gpu" | tee "$OUT/bench-gpu.log"
fi
cp bench/gpu-results.json "$OUT/" 2>/dev/null || echo "no bench/gpu-results.json"
echo "done after $((SECONDS - T0))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
