#!/usr/bin/env bash
# One call on a CUDA machine: install the CUDA extras, run the GPU tests and the kernel benchmark.
#   bash scripts/gpu_check.sh            (results land in benchmarks/results/ and $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
.venv/bin/pip install -q -c constraints.txt '.[cuda]' || echo "cuda extras did not install; GPU tests fall back where they can"
.venv/bin/python -c "import torch; print('cuda', torch.cuda.is_available(), torch.version.cuda)"
.venv/bin/python -m pytest -m gpu -q -x --timeout=300 2>&1 | tail -30
.venv/bin/python -m benchmarks.kernels --lengths 4096 16384 65536
if [ -n "${OUT:-}" ]; then cp -r benchmarks/results "$OUT/"; fi
