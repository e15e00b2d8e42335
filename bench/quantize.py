"""Benchmark a recipe on a model: quantize wall time, peak RSS, and perplexity against the original.

Usage: python bench/quantize.py MODEL RECIPE [--set k=v ...] [--windows 16] [--seq-len 2048]
Prints one table; the perplexity protocol is evals/PROTOCOL.md.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dataset", default="emma")
    parser.add_argument("--skip-baseline", action="store_true", help="Only score the quantized model.")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: also score the original through an FP8 KV cache with scales 1.0, and the "
                             "quantized model through one with its calibrated scales")
    args = parser.parse_args()

    from quantkit.eval.ppl_table import evaluate_one
    from quantkit.calibration.data import load_text
    from quantkit.checkpoints.resolve import resolve_model
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    with tempfile.TemporaryDirectory(prefix="quantkit-bench-") as tmp:
        rss_before = peak_rss_gb()
        start = time.perf_counter()
        report = quantize(args.model, recipe, Path(tmp) / "q", progress=False)
        wall = time.perf_counter() - start
        rss = peak_rss_gb()
        text = load_text(args.dataset)
        source = str(resolve_model(args.model))
        base = None if args.skip_baseline else evaluate_one(source, text, args.seq_len, args.windows, False)
        fp8kv = args.kv_cache_dtype == "fp8"
        base_kv1 = evaluate_one(source, text, args.seq_len, args.windows, False, "fp8") if fp8kv else None
        quant = evaluate_one(str(report.output), text, args.seq_len, args.windows, False, "fp8" if fp8kv else None)
    from quantkit.platform import compute

    print(compute.machine_summary())
    print(f"model {args.model}  recipe {recipe.name}  overrides {' '.join(args.overrides) or '-'}")
    print(f"quantize: {report.compute.describe()}; perplexity in float32 (the protocol)")
    print(f"quantize wall time      {wall:8.1f} s   (pipeline {report.result.seconds:.1f} s)")
    for phase, seconds in report.result.timings.items():
        print(f"  {phase:<40} {seconds:7.1f} s")
    print(f"peak RSS after quantize {rss:8.2f} GB  (before {rss_before:.2f} GB)")
    if base:
        print(f"ppl original            {base['ppl']:8.3f}   ({base['windows']} x {args.seq_len} tokens of {args.dataset})")
    if base_kv1:
        print(f"ppl original, FP8 KV cache with scales 1.0   {base_kv1['ppl']:8.3f}"
              + (f"   delta {base_kv1['ppl'] - base['ppl']:+.3f}" if base else ""))
    label = "ppl quantized" + (", FP8 KV cache with its calibrated scales" if base_kv1 else "")
    print(f"{label:<24}{quant['ppl']:8.3f}" + (f"   delta {quant['ppl'] - base['ppl']:+.3f}" if base else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
