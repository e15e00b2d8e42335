#!/usr/bin/env bash
# The GPU check, as one script for a lent GPU machine: kernel and device tests on CUDA (not the
# interpreter), quantizes on CUDA held against the same quantizes on the CPU, a generate and an eval on
# CUDA, the 8B-shaped model on CUDA, then the kernel table; wall time and peak GPU memory for each.
#
# The lent machine reaches no network and takes 64 MiB from here, so first, here:
#   bash bench/gpu_carry.sh            # .gpu/: wheels its image lacks, SmolLM2's config and tokenizer
# then with the device tool: run(command="bash bench/gpu.sh", carry=[".gpu"], timeout_s=600)
# On a GPU machine of your own (with quantkit installed and network): bash bench/gpu.sh
#
# The model is SmolLM2-135M's shape with random weights (bench/random_model.py; its real weights do not
# travel): figures of time and memory, and CUDA against CPU on the same weights, not quality against
# the real model. Each step runs under its own time limit, all within QUANTKIT_GPU_DEADLINE seconds
# (default 540, inside one 600 s call); a failing step is reported and the next one runs. Log and
# summary go to $OUT (the device tool brings them back) or a temporary directory.
# Environment: PY (python3), QUANTKIT_GPU_CHECK_DEVICE (cuda; "cpu" runs the same steps on the CPU, to
# try this script without a GPU), QUANTKIT_GPU_MODEL (a model directory instead of the random one),
# QUANTKIT_GPU_BIG_LAYERS (decoder layers of the 8B-shaped model, default 2), QUANTKIT_GPU_SET (more
# --set KEY=VALUE for the SmolLM2 quantizes), QUANTKIT_GPU_LIMIT_SCALE (times each step's limit, default 1),
# QUANTKIT_GPU_PART (all: everything; tests: only the kernel and device tests, with the whole deadline;
# steps: everything but those tests; serve: the random model and a GPTQ of it served on the device, the engine's
# tests there, and bench/serve.py at 1 and 16 clients for each). On a lent H200 (2026-12-04) the 140 tests took more than 230 s, most of it
# Triton autotuning every (M, N, K) they try, so a full check there is two calls back to back while the
# machine is warm: QUANTKIT_GPU_PART=tests, then QUANTKIT_GPU_PART=steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEV=${QUANTKIT_GPU_CHECK_DEVICE:-cuda}
DEADLINE=${QUANTKIT_GPU_DEADLINE:-540}
BIG_LAYERS=${QUANTKIT_GPU_BIG_LAYERS:-2}
SCALE=${QUANTKIT_GPU_LIMIT_SCALE:-1}
PART=${QUANTKIT_GPU_PART:-all}
case $PART in all | tests | steps | serve) ;; *) echo "QUANTKIT_GPU_PART=$PART: use all, tests, steps or serve"; exit 2 ;; esac
RESULTS=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
LOG=$RESULTS/gpu.log
SUMMARY=$RESULTS/gpu-summary.md
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "$DEV" = cpu ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
: >"$LOG"
printf '| step | status | seconds |\n|---|---|---|\n' >"$SUMMARY"

if [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then  # what the image lacks, carried as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .gpu/whl/*.whl || { echo "installing the carried wheels failed (built for another Python? bench/gpu_carry.sh VERSION)"; exit 1; }
  export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

finish() {  # the summary table into the log and onto the screen; the scratch directory removed
  echo "=== summary ($DEV, $SECONDS s)" | tee -a "$LOG"
  tee -a "$LOG" <"$SUMMARY"
  rm -rf "$WORK"
}

step() {  # step NAME LIMIT CMD...: CMD under min(LIMIT, time left), logged; its status and time in the summary
  local name=$1 limit=$(($2 * SCALE)) left=$((DEADLINE - SECONDS)); shift 2
  if [ "$left" -lt 20 ]; then printf '| %s | skipped: out of time | 0 |\n' "$name" >>"$SUMMARY"; return 99; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit} s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} status
  case $rc in 0) status=ok ;; 124 | 137) status="timed out" ;; *) status="failed ($rc)" ;; esac
  printf '| %s | %s | %d |\n' "$name" "$status" $((SECONDS - t0)) >>"$SUMMARY"
  return "$rc"
}

QK=("$PY" -m quantkit)
step environment 60 "$PY" -c "
import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
if '$DEV' != 'cpu':
    assert torch.cuda.is_available(), 'no CUDA device'
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, 'GiB')
from quantkit.platform import compute; print(compute.machine_summary())" || { cat "$SUMMARY"; exit 1; }

if [ "$PART" != steps ]; then
  [ "$PART" = tests ] && TESTS_LIMIT=$DEADLINE || TESTS_LIMIT=200
  step "kernel and device tests" "$TESTS_LIMIT" "$PY" -m pytest -q -p no:cacheprovider -rf --durations=5 \
    tests/test_kernels.py tests/test_devices.py
  if [ "$PART" = tests ]; then finish; exit 0; fi
fi

if [ "$PART" = serve ]; then
  if [ -d .gpu/smollm2 ]; then LIKE=.gpu/smollm2; else LIKE=$("$PY" -m quantkit models fetch smollm2-135m | tail -1 | sed 's/^Cached at //'); fi
  MODEL=${QUANTKIT_GPU_MODEL:-$WORK/smollm2-random}
  [ -d "$MODEL" ] || step "random SmolLM2-shaped model" 90 "$PY" bench/random_model.py "$LIKE" "$MODEL" || { finish; exit 1; }
  step "gptq-w4a16 on $DEV" 150 "${QK[@]}" quantize "$MODEL" --recipe gptq-w4a16 --set stages.0.scheme.group_size=64 \
    --device "$DEV" -o "$WORK/gptq-$DEV" --no-progress
  step "engine and server tests" 120 "$PY" -m pytest -q -p no:cacheprovider -rf tests/test_engine.py tests/test_serve.py \
    -m "not slow"
  for M in "$MODEL" "$WORK/gptq-$DEV"; do
    step "serve $(basename "$M") on $DEV, 1 and 16 clients" 150 "$PY" bench/serve.py throughput "$M" --device "$DEV" \
      --clients 1,16 --requests 8 --max-tokens 64
  done
  finish; exit 0
fi

# first of the steps: the kernels against bf16 F.linear (W4A16 GEMV and tinygemm at M=1..16, FP8 at M >= 256)
step "kernel table" 150 "$PY" bench/kernel_speed.py --device "$DEV" --shapes llama3-8b --m 1,16,256,2048 --budget 0.2

MODEL=${QUANTKIT_GPU_MODEL:-}
if [ -z "$MODEL" ]; then
  if [ -d .gpu/smollm2 ]; then LIKE=.gpu/smollm2; else LIKE=$("$PY" -m quantkit models fetch smollm2-135m | tail -1 | sed 's/^Cached at //'); fi
  MODEL=$WORK/smollm2-random
  step "random SmolLM2-shaped model" 90 "$PY" bench/random_model.py "$LIKE" "$MODEL" || { cat "$SUMMARY"; exit 1; }
fi

EXTRA=()
for kv in ${QUANTKIT_GPU_SET:-}; do EXTRA+=(--set "$kv"); done
G64=(--set stages.0.scheme.group_size=64 "${EXTRA[@]}")  # the quantizing stage: 0, or 1 after AWQ's smoothing
G64_AWQ=(--set stages.1.scheme.group_size=64 "${EXTRA[@]}")
step "gptq-w4a16 on $DEV" 150 "${QK[@]}" quantize "$MODEL" --recipe gptq-w4a16 "${G64[@]}" --device "$DEV" \
  -o "$WORK/gptq-$DEV" --no-progress
step "generate on $DEV" 60 "${QK[@]}" generate "$WORK/gptq-$DEV" "It is a truth universally acknowledged" -n 16 \
  --device "$DEV"
# warm figures: the CLI's one generate above also pays for compiling and autotuning the kernels
step "decode: bf16 against W4A16 and transformers on $DEV" 120 "$PY" bench/decode.py "$MODEL" "$WORK/gptq-$DEV" \
  --hf --runs 2 -n 64 --device "$DEV"
# the same RTN in float32 on both devices: codes and scales must agree to the bit
F32=(--set calibration.dtype=float32)
step "rtn-w4a16 float32 on cpu" 60 "${QK[@]}" quantize "$MODEL" --recipe rtn-w4a16 "${G64[@]}" "${F32[@]}" \
  --device cpu -o "$WORK/rtn-ref-cpu" --no-progress
step "rtn-w4a16 float32 on $DEV" 60 "${QK[@]}" quantize "$MODEL" --recipe rtn-w4a16 "${G64[@]}" "${F32[@]}" \
  --device "$DEV" -o "$WORK/rtn-$DEV" --no-progress
step "rtn: $DEV against cpu, bit for bit" 60 "$PY" bench/compare_checkpoints.py "$WORK/rtn-ref-cpu" "$WORK/rtn-$DEV" \
  --require-identical
step "8B-shaped model, $BIG_LAYERS layers: write" 90 "$PY" bench/big_model.py write "$WORK/big8b" --layers "$BIG_LAYERS" \
  ${LIKE:+--tokenizer "$LIKE"}
step "8B-shaped gptq-w4a16 16 x 256 on $DEV" 150 "$PY" bench/big_model.py quantize "$WORK/big8b" gptq-w4a16 \
  --set calibration.num_samples=16 --set calibration.seq_len=256 --device "$DEV" -o "$WORK/big8b-q"
rm -rf "$WORK/big8b" "$WORK/big8b-q"
step "awq-w4a16 on $DEV" 150 "${QK[@]}" quantize "$MODEL" --recipe awq-w4a16 "${G64_AWQ[@]}" --device "$DEV" \
  -o "$WORK/awq-$DEV" --no-progress
step "gptq-w4a16 on cpu" 150 "${QK[@]}" quantize "$MODEL" --recipe gptq-w4a16 "${G64[@]}" --device cpu \
  -o "$WORK/gptq-ref-cpu" --no-progress
step "gptq: $DEV against cpu" 60 "$PY" bench/compare_checkpoints.py "$WORK/gptq-ref-cpu" "$WORK/gptq-$DEV"
step "eval: both GPTQs against the original on $DEV" 90 "${QK[@]}" eval compare "$WORK/gptq-$DEV" "$WORK/gptq-ref-cpu" \
  --original "$MODEL" --device "$DEV" --dtype float32 --seq-len 512 --max-windows 4 --no-progress

finish
