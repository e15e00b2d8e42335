"""quantkit's native one-token CPU kernels against torch's, back to back in one process.

Usage: python bench/native_kernels.py [--reps 200] [--cold 64]
Prints the CPU, torch's capability and a table: for each kernel and shape, the median microseconds of
torch's way and the native one and their ratio. GEMVs are timed hot (one weight, cache-warm) and cold
(--cold copies of the weight read in turn, as a decode step reads its layers from memory); attention over
a static cache of 4096 slots at several lengths (SmolLM2's 9 query / 3 kv heads of 64); RMSNorm of one row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.kernels import cpu_int4, native  # noqa: E402
from quantkit.platform import compute, timing  # noqa: E402
from quantkit.runtime import row_norm  # noqa: E402

GEMV_SHAPES = ((49152, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096))
INT4_SHAPES = ((1536, 576, 64), (576, 1536, 64), (4096, 4096, 128), (14336, 4096, 128))
LENGTHS = (64, 512, 2048)


def _median_us(run, reps: int, per_call: int = 1) -> float:
    return timing.median_seconds(run, reps, samples=7, per_call=per_call) * 1e6


def _row(table: list, kernel: str, shape: str, ours, theirs, reps: int, per_call: int = 1) -> None:
    t_theirs, t_ours = _median_us(theirs, reps, per_call), _median_us(ours, reps, per_call)
    table.append(f"| {kernel} | {shape} | {t_theirs:.1f} | {t_ours:.1f} | {t_theirs / t_ours:.2f}x |")


def gemv_rows(table: list, reps: int, cold: int) -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in GEMV_SHAPES:
        copies = max(1, min(cold, (256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(k, generator=g).to(torch.bfloat16)
        _row(table, f"bf16 GEMV (F.linear), {copies} cold copies", f"{n} x {k}",
             lambda: [native.gemv_bf16(w, x) for w in ws], lambda: [F.linear(x[None], w) for w in ws],
             max(1, reps // copies), copies)


def int4_rows(table: list, reps: int, cold: int) -> None:
    g = torch.Generator().manual_seed(0)
    rows = cpu_int4.layout_rows()
    for n, k, group in INT4_SHAPES:
        copies = max(1, min(cold, (256 << 20) // (n * k // 2)))
        ws = [cpu_int4.repack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8),
                              torch.rand(n, k // group, generator=g) * 0.05, None, group, torch.bfloat16)
              for _ in range(copies)]
        x = torch.randn(1, k, generator=g).to(torch.bfloat16)
        mod = native.module()
        _row(table, f"int4 GEMV (the op), {copies} cold copies", f"{n} x {k} g{group}",
             lambda: [mod.int4_gemv(w.packed, w.scale_zeros, x[0], group, n, rows) for w in ws],
             lambda: [w.matmul(x) for w in ws], max(1, reps // copies), copies)


def attention_rows(table: list, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)
        keys, values = (torch.randn(1, 3, 4096, 64, generator=g).to(dtype) for _ in range(2))
        for length in LENGTHS:
            _row(table, f"one-query attention (SDPA), {str(dtype).removeprefix('torch.')}", f"{length} positions",
                 lambda: native.module().attend_one(q.view(1, 9, 64), keys, values, None, length, 0.125),
                 lambda: F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length], scale=0.125,
                                                        enable_gqa=True), max(1, reps // 4))


def norm_rows(table: list, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (576, 4096):
            x = torch.randn(1, 1, width, generator=g).to(dtype)
            w = torch.randn(width, generator=g).to(dtype)
            _row(table, f"RMSNorm (torch's fused op), {str(dtype).removeprefix('torch.')}", f"1 x {width}",
                 lambda: native.module().rms_norm(x.view(1, width), w, 1e-5), lambda: row_norm.reference(x, w, 1e-5),
                 reps * 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--cold", type=int, default=64, help="Copies of each GEMV weight read in turn.")
    args = parser.parse_args()
    print(compute.machine_summary())
    if native.module() is None:
        sys.exit(f"native kernels not built: {native.reason()}")
    print(f"native build {native.build_id()} ({' '.join(native.flags())}); int4 layout rows: {cpu_int4.layout_rows()}, "
          f"native int4: {cpu_int4.native_reason() or 'yes'}")
    table = ["| kernel (torch's way) | shape | torch us | native us | native speed-up |",
             "| --- | --- | --- | --- | --- |"]
    gemv_rows(table, args.reps, args.cold)
    if cpu_int4.native_reason() is None:
        int4_rows(table, args.reps, args.cold)
    attention_rows(table, args.reps)
    norm_rows(table, args.reps)
    print("\n".join(table))


if __name__ == "__main__":
    main()
