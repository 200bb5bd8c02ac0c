#!/usr/bin/env bash
# The GPU check (benchmarks/gpu.py): one command, under 8 minutes on one GPU.
#   bash benchmarks/gpu.sh           # writes benchmarks/results/gpu.md
#   bash benchmarks/gpu.sh --quick   # small sizes, on any machine (CI: CPU)
# XLA's allocator takes memory as the step needs it, not 75% up front, so
# that the device's own memory figures mean what the steps used.
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
exec python -m benchmarks.gpu "$@"
