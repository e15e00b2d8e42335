#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for bench/gpu.sh on a lent GPU machine. That machine reaches no network and
# takes at most 64 MiB from here (working tree + carried paths); its image has torch, triton, transformers,
# safetensors, accelerate, click, pyyaml and pytest, but not pydantic or greenlet, which quantkit imports.
# This puts into .gpu/ (about 6 MB):
#   whl/      wheels of what the image lacks, in the versions installed here (CPython $1, manylinux x86-64)
#   smollm2/  SmolLM2-135M's config and tokenizer: its weights (270 MB) cannot travel, so gpu.sh builds
#             random weights of its shape there (bench/random_model.py)
# Usage, here: bash bench/gpu_carry.sh [PYTHON_VERSION, default 3.12, the image's]
# then the device tool: run(command="bash bench/gpu.sh", carry=[".gpu"], timeout_s=600)
set -euo pipefail
PYV=${1:-3.12}
PY=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."
rm -rf .gpu
mkdir -p .gpu/whl .gpu/smollm2
pkgs=$("$PY" -c 'from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "greenlet")))')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl $pkgs
model=$("$PY" -c "from quantkit.checkpoints.demo import fetch; print(fetch('smollm2-135m'))")
for f in config.json tokenizer.json tokenizer_config.json generation_config.json chat_template.jinja; do
  if [ -f "$model/$f" ]; then cp "$model/$f" .gpu/smollm2/; fi
done
echo "carry .gpu ($(du -sh .gpu | cut -f1)): $(ls .gpu/whl | tr '\n' ' ')"
