#!/bin/bash
# The issue-17 table: six recipes on a demo model, then ONE `quantkit eval` over all of them on emma and
# persuasion (perplexity, KLD, top-1 against the original). Checkpoints already in OUT are reused.
#   bash bench/eval_table.sh smollm2-135m /tmp/evtab [--max-windows 16]
# SmolLM2's int4 recipes use group 64 (its GGUF source is Q4_1 at 32: group 32 would be lossless; 576 % 128 != 0).
set -euo pipefail
MODEL=${1:-smollm2-135m}
OUT=${2:-/tmp/evtab}
shift 2 || true
Q="${QUANTKIT:-.venv/bin/quantkit}"
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
ckpts=()
for recipe in rtn-w4a16 gptq-w4a16 awq-w4a16 awq-gptq-w4a16 fp8-dynamic gptq-fp8-dynamic; do
  dir="$OUT/$MODEL-$recipe"
  ckpts+=("$dir")
  [ -f "$dir/quantkit.json" ] && continue
  set_args=()
  if [ "$MODEL" = smollm2-135m ]; then
    case $recipe in
      rtn-w4a16|gptq-w4a16) set_args=(--set stages.0.scheme.group_size=64);;
      awq-w4a16|awq-gptq-w4a16) set_args=(--set stages.1.scheme.group_size=64);;
    esac
  fi
  "$Q" quantize "$MODEL" --recipe "$recipe" "${set_args[@]}" -o "$dir" --no-progress
done
"$Q" eval "${ckpts[@]}" --original "$MODEL" --dataset emma,persuasion --json "$OUT/$MODEL-eval.json" "$@"
