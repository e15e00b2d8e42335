"""llm-compressor's side of bench/vs_llmcompressor.py; runs in llm-compressor's own venv (no quantkit here).

Usage: PEER_PYTHON bench/llmc_peer.py --model DIR --tokens FILE.json --algo ALGO --group 64
           --dtype bfloat16|float32 --out DIR [--alpha 0.5]
Quantizes with llm-compressor's `oneshot` on exactly the token sequences in FILE (the same ones
quantkit calibrates on) and prints one JSON line with the seconds of load, oneshot and save. ALGO:
gptq / awq (W4A16 symmetric, the given group size), w8a8-smoothquant (SmoothQuant with strength alpha,
then GPTQ to its W8A8 preset), w8a8-dynamic (its W8A8 preset, round to nearest), w4afp8 (GPTQ to its
W4AFP8 preset, static act-order), nvfp4a16 / mxfp8 (its NVFP4A16 / MXFP8 presets, round to nearest), nvfp4 / mxfp4
(GPTQ to its NVFP4 / MXFP4 presets, static act-order).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--algo", choices=["gptq", "awq", "w8a8-smoothquant", "w8a8-dynamic", "w4afp8",
                                                 "nvfp4a16", "nvfp4", "mxfp4", "mxfp8"], required=True)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for faster host-to-GPU copies, which
        # raises on a CPU-only torch ("Cannot access accelerator device"); pinning changes no value
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    tokens = json.load(open(args.tokens))
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=args.group)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if args.algo == "gptq":  # quantkit's gptq-w4a16: static act-order, block 128, dampening 0.01
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01,
                              actorder="static")
    elif args.algo == "awq":  # quantkit's awq-w4a16: duo scaling "both", 20 grid points, then round-to-nearest
        recipe = [AWQModifier(duo_scaling="both", n_grid=20), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    elif args.algo == "w8a8-smoothquant":  # quantkit's w8a8-smoothquant: smoothing, then GPTQ block 128, damp 0.01
        recipe = [SmoothQuantModifier(smoothing_strength=args.alpha),
                  GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"], block_size=128, dampening_frac=0.01)]
    elif args.algo in ("w8a8-dynamic", "nvfp4a16", "mxfp8"):  # quantkit's round-to-nearest recipes
        preset = {"w8a8-dynamic": "W8A8", "nvfp4a16": "NVFP4A16", "mxfp8": "MXFP8"}[args.algo]
        recipe = QuantizationModifier(scheme=preset, targets=["Linear"], ignore=["lm_head"])
    else:  # quantkit's w4afp8, nvfp4, mxfp4: GPTQ with static act-order
        preset = {"w4afp8": "W4AFP8", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}[args.algo]
        recipe = GPTQModifier(scheme=preset, targets=["Linear"], ignore=["lm_head"], block_size=128,
                              dampening_frac=0.01, actorder="static")
    ds = Dataset.from_dict({"input_ids": tokens, "attention_mask": [[1] * len(t) for t in tokens]})

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    t1 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=max(len(t) for t in tokens),
            num_calibration_samples=len(tokens), shuffle_calibration_samples=False)
    t2 = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    t3 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "oneshot_s": t2 - t1, "save_s": t3 - t2, "total_s": t3 - t0,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
