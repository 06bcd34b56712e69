#!/usr/bin/env bash
# One-GPU check: ViT-B/16 fits in 16-mixed and bf16-mixed at 224 and 512 px (images/s, peak memory, MFU) and attention
# rollout on a batch of 512 x 512 slices; then the training pace of `vit-ct fit` of the demo against a plain loop on
# the GPU (benchmarks/training_pace.py --device cuda: images/s, the share of the step spent on the batch). Needs one
# CUDA GPU (exits 2 without one); a few minutes on an H100/H200.
#   benchmarks/gpu_check.sh                      # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --device cpu --tiny  # test the script on a CPU
# Extra arguments go to benchmarks/gpu_check.py (--steps, --batch-224, --batch-512, --peak-tflops, --json OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export WANDB_MODE="${WANDB_MODE:-offline}"
if [[ " $* " != *" --device cpu "* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$PYTHON" -m benchmarks.gpu_check "$@"
if [[ " $* " != *" --device cpu "* ]]; then
    "$PYTHON" -m benchmarks.training_pace --device cuda --epochs 3 --repeats 1
fi
