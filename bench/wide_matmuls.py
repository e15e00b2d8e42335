"""What widening 16-bit matmuls to float32 GEMMs (`quantkit.kernels.wide_matmul`) gains on this CPU.

Usage: python bench/wide_matmuls.py [--rows 1,16,64,512] [--quantize MODEL] [--dtype bfloat16]

Prints the CPU line, then a linear's time at a few shapes and row counts three ways, back to back in
this process: the 16-bit dtype on torch's own kernels, widened, and float32 (the speed widening
aims at). With --quantize, also the wall time of `awq-w4a16` on MODEL at the real-model test's small
calibration (8 x 256 tokens, 10 x 10 search grid) with the 16-bit dtype forced, native then widened,
and in float32 for reference, each with its mean AWQ error ratio (the numbers should agree to the
noise of a bf16 search). Imitate an AVX2 CPU on an AVX-512 one with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # [out, in]: SmolLM2's MLP, and an 8B-sized projection


def _best_us(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def gemm_table(dtype, rows: list[int]) -> None:
    import torch
    import torch.nn.functional as F

    from quantkit.kernels.wide_matmul import MIN_ROWS, widening

    print(f"linear, best of 5 (us); widened only from {MIN_ROWS} rows in use")
    print(f"| out x in | rows | {dtype} native | widened | float32 | widened vs native |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for out, inp in SHAPES:
        w = torch.randn(out, inp, generator=g).to(dtype)
        w32 = w.float()
        for m in rows:
            x = torch.randn(m, inp, generator=g).to(dtype)
            x32 = x.float()
            native = _best_us(lambda: F.linear(x, w))
            with widening(dtype):
                wide = _best_us(lambda: F.linear(x, w))
            f32 = _best_us(lambda: F.linear(x32, w32))
            print(f"| {out} x {inp} | {m} | {native:.0f} | {wide:.0f} | {f32:.0f} | {native / wide:.2f}x |")


def quantize_times(model: str, dtype_name: str) -> None:
    from quantkit.platform import compute
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    small = ["stages.rtn.scheme.group_size=64", "calibration.num_samples=8", "calibration.seq_len=256",
             "stages.awq.args.search_samples=2", "stages.awq.args.n_grid=10", "stages.awq.args.clip_n_grid=10"]
    real = compute.needs_wide_matmuls
    print(f"\nawq-w4a16 on {model}, 8 x 256 calibration, 10 x 10 grid")
    print("| compute | matmuls | seconds | mean AWQ error ratio |")
    print("|---|---|---|---|")
    for name, wide in ((dtype_name, False), (dtype_name, True), ("float32", False)):
        compute.needs_wide_matmuls = (lambda *a, **k: wide) if name != "float32" else real
        recipe = load_recipe("awq-w4a16", small + [f"calibration.dtype={name}"])
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            report = quantize(model, recipe, Path(tmp) / "out", progress=False, notify=lambda line: None)
            seconds = time.perf_counter() - t
        ratios = [r["awq_error_vs_unscaled"] for r in report.result.layers]
        how = "widened" if wide else ("native" if name != "float32" else "float32")
        print(f"| {name} | {how} | {seconds:.1f} | {sum(ratios) / len(ratios):.4f} |", flush=True)
    compute.needs_wide_matmuls = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quantize", metavar="MODEL", help="also time awq-w4a16 on this model three ways")
    args = parser.parse_args()
    import torch

    from quantkit.platform.compute import machine_summary

    print(machine_summary())
    gemm_table(getattr(torch, args.dtype), [int(r) for r in args.rows.split(",")])
    if args.quantize:
        quantize_times(args.quantize, args.dtype)


if __name__ == "__main__":
    main()
