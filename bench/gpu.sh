#!/usr/bin/env bash
# The GPU check, as one script: kernel tests on the device (not the interpreter), then the kernel table.
# Usage (on a machine with CUDA, from the repository root): bash bench/gpu.sh [python]
set -euo pipefail
PY=${1:-python}
export HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), 'triton', triton.__version__)"
"$PY" -m pytest -q tests/test_kernels.py
"$PY" bench/kernels.py --device cuda --budget 0.2
