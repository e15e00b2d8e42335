#!/usr/bin/env bash
# The GPU check, as one script: kernel and device tests on CUDA (not the interpreter), a quantize and a
# generate on CUDA with their wall time and peak GPU memory, then the kernel table.
# Usage (on a machine with CUDA, from the repository root): bash bench/gpu.sh [python]
set -euo pipefail
PY=${1:-python}
export HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), 'triton', triton.__version__)"
"$PY" -m pytest -q tests/test_kernels.py tests/test_devices.py
QK="$PY -m quantkit"
OUT=$(mktemp -d)
MODEL=${QUANTKIT_GPU_MODEL:-smollm2-135m}
$QK models fetch "$MODEL" || true
for spec in gptq-w4a16:0 awq-w4a16:1; do
  recipe=${spec%:*}; stage=${spec#*:}
  /usr/bin/time -f "$recipe on cuda: %e s wall, %M KB peak RSS" \
    $QK quantize "$MODEL" --recipe "$recipe" --set "stages.$stage.scheme.group_size=64" --device cuda \
      -o "$OUT/$recipe" --no-progress 2>&1 | grep -E "device|Peak|Quantized|wall"
done
$QK generate "$OUT/gptq-w4a16" "It is a truth universally acknowledged" -n 64 --device cuda
$QK eval ppl "$MODEL" "$OUT/gptq-w4a16" --device cuda --max-windows 4 --no-progress
"$PY" bench/kernel_speed.py --device cuda --budget 0.2
rm -rf "$OUT"
