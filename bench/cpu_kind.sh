#!/usr/bin/env bash
# The per-CPU-kind figures of the execution issue, as one script: run it on each kind of CPU (an
# AVX2-only one, an AVX-512 one with bf16/AMX) and keep its log. Sections run in the order given
# (default: all), each printing the CPU line first; long ones (matrix ~1-2 h, peers ~1 h on AVX2).
#
# Usage (from the repository root, after `make install`):
#   bash bench/cpu_kind.sh [decode] [matrix] [peers] [suite] 2>&1 | tee /tmp/cpu-kind.log
#   WORK=/tmp/cpu-kind  PEER_PYTHON=/path/to/llmcompressor-venv/bin/python  (made in WORK when unset)
#
# decode: quantkit 16-bit vs W4A16 (rtn-w4a16 g64) vs transformers, bench/decode.py; on a CPU with fast bf16
#         also as the float32 policy would run there (--policy-as AVX2).
# matrix: every shipped recipe on both demo models (bench/recipe_matrix.py), the settings of the AVX2
#         column in the README (8 x 128 calibration, AWQ grid 10, 2 windows); setups native and, where
#         the CPU has more than AVX2, avx2 (imitated) too. Where bf16 is slow, the other policy's choice is
#         covered by forcing it: float32 and bfloat16 side by side at 2 x 128 calibration tokens (bf16
#         GEMMs are emulated there: 7-9x slower than float32 in nn.Linear's layout, ~100x row-major).
# peers:  GPTQ and AWQ against llm-compressor 0.14 (bench/vs_llmcompressor.py); the peer in bf16 and float32
#         where bf16 is fast, float32 only where it is not (bf16 is 100-200x slower there).
# suite:  `make test` wall time with the policy's choice, then with the other choice forced: float32 on a
#         fast-bf16 CPU; on one without, bf16 forced for `make test-fast` (the slow real-model tests left out).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-/tmp/cpu-kind}
export HF_HUB_OFFLINE=1
mkdir -p "$WORK"
SECTIONS=("$@")
[ ${#SECTIONS[@]} -eq 0 ] && SECTIONS=(decode matrix peers suite)
CAP=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
FAST_BF16=$("$PY" -c "import torch; from quantkit.platform import compute; print(int(torch.bfloat16 in compute.fast_16bit('cpu')[0]))")
cpu() { "$PY" -c "from quantkit.platform.compute import machine_summary; print(machine_summary())"; }
status=0
run() { echo "+ $*"; "$@" || { echo "FAILED ($?): $*"; status=1; }; }

for section in "${SECTIONS[@]}"; do
  echo "=== $section ($(date -u +%FT%TZ)); capability $CAP, fast bf16: $FAST_BF16"
  cpu
  case $section in
    decode)
      W4="$WORK/smollm2-rtn-w4a16-g64"
      [ -f "$W4/quantkit.json" ] || run "$PY" -m quantkit quantize smollm2-135m --recipe rtn-w4a16 \
        --set stages.0.scheme.group_size=64 -o "$W4" --overwrite --no-progress
      run "$PY" bench/decode.py smollm2-135m "$W4" --hf --runs 5
      [ "$FAST_BF16" = 1 ] && run "$PY" bench/decode.py smollm2-135m "$W4" --hf --runs 5 --policy-as AVX2
      ;;
    matrix)
      setups=native; [ "$CAP" != AVX2 ] && [ "$CAP" != DEFAULT ] && setups=native,avx2
      run "$PY" bench/recipe_matrix.py smollm2-135m gemma3-270m --setups "$setups" --samples 8 --seq-len 128 \
        --awq-grid 10 --windows 2 --work "$WORK/matrix"
      [ "$FAST_BF16" = 1 ] || run "$PY" bench/recipe_matrix.py smollm2-135m gemma3-270m --setups float32,bfloat16 \
        --samples 2 --seq-len 128 --awq-grid 10 --windows 2 --work "$WORK/matrix-bf16"
      ;;
    peers)
      PEER=${PEER_PYTHON:-$WORK/llmc/bin/python}
      if [ ! -x "$PEER" ]; then  # torch's CPU build first, so llm-compressor's own torch requirement is met by it
        run "$PY" -m venv "$WORK/llmc" && run "$WORK/llmc/bin/pip" install --quiet torch==2.13.0 \
          && run "$WORK/llmc/bin/pip" install --quiet llmcompressor==0.14.0.1
      fi
      dtypes=float32; [ "$FAST_BF16" = 1 ] && dtypes=bfloat16,float32
      for algo in gptq awq; do
        run "$PY" bench/vs_llmcompressor.py smollm2-135m "$algo" --peer-python "$PEER" --peer-dtypes "$dtypes" \
          --keep "$WORK/vs-$algo"
      done
      ;;
    suite)
      start=$(date +%s); run make test; echo "make test (policy's choice): $(( $(date +%s) - start )) s"
      if [ "$FAST_BF16" = 1 ]; then
        start=$(date +%s); run env QUANTKIT_COMPUTE_DTYPE=float32 make test
        echo "make test (float32 forced): $(( $(date +%s) - start )) s"
      else  # bf16 GEMMs are emulated here: the real-model tests would not fit; the rest checks the bf16 paths
        start=$(date +%s); run env QUANTKIT_COMPUTE_DTYPE=bfloat16 make test-fast
        echo "make test-fast (bfloat16 forced; slow real-model tests left out): $(( $(date +%s) - start )) s"
      fi
      ;;
    *) echo "unknown section '$section' (decode, matrix, peers, suite)"; status=2 ;;
  esac
done
exit $status
