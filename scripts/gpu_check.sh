#!/usr/bin/env bash
# One call on a CUDA machine whose image already has torch (+ triton, FLA, and optionally
# mamba-ssm / causal-conv1d / flash-attn): run the GPU tests and the kernel benchmark with
# that image's python3. Results land in benchmarks/results/ (and in $OUT when it is set).
# With two or more GPUs the gpu tests include tensor- and context-parallel runs over NCCL
# (tests/*/test_{tensor,context}_parallel.py); with one they skip.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda)"
nvidia-smi -L 2>/dev/null | sed 's/^/gpu: /'
$PY -m pytest -m gpu -q -rs -p no:cacheprovider 2>&1 | tail -40
$PY -m benchmarks.kernels --lengths 4096 16384 65536
if [ -n "${OUT:-}" ]; then cp -r benchmarks/results "$OUT/"; fi
