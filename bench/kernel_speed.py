"""Quantized matmul kernels against torch's 16-bit (or float32) matmul, on the linear shapes of Llama-3-8B and Qwen3-4B.

Usage: python bench/kernel_speed.py [--device cpu|cuda] [--m 1,16,64,256,2048] [--shapes square,llama3-8b,qwen3-4b]
                               [--peak-gbps X] [--budget 0.3]
CPU: the int4 op (`kernels.cpu_int4`) alone, and the quantized linear as the runner uses it (the op up to
160 tokens, then dequantize + bf16 GEMM); at M=1 also its torch dequantize path. CUDA: Triton W4A16 (per M,
the split-K GEMV up to 16 rows or the tiled GEMM, autotuned), torch's own int4 op (tinygemm), the quantized
linear's automatic choice between them, Triton FP8 and cuBLASLt FP8 (`torch._scaled_mm`; per-token x
per-channel, activation quantization included and also alone). Every figure also as a share of the read
bandwidth measured on the device (`kernels.roofline`). Each figure is the median of repeated runs in
this process, back to back with the bf16 baseline of the same shape; speedup = bf16 time / time.
GB/s counts the bytes each kernel must move: packed weights + scales + activations in + out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # model: [(name, N, K)] of its decoder linears (out_features, in_features)
    "square": [("2048^2", 2048, 2048), ("4096^2", 4096, 4096), ("8192^2", 8192, 8192)],
    "llama3-8b": [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096), ("down", 4096, 14336)],
    "qwen3-4b": [("q", 4096, 2560), ("k/v", 1024, 2560), ("o", 2560, 4096), ("gate/up", 9728, 2560),
                 ("down", 2560, 9728)],
}
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
             "A100-SXM4-40GB": 1555, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008}
GROUP = 128


def timed(fn, device: torch.device, budget: float) -> float:
    """Median seconds of fn() over repeated runs filling about `budget` seconds (at least 3)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    reps = max(3, min(200, int(budget / once)))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def int4_weight(n: int, k: int, device: torch.device):
    from quantkit.quant.intq import rtn
    from quantkit.quant.schemes import QuantScheme

    w = torch.randn(n, k, device="cpu") * 0.02
    qw = rtn(w, QuantScheme(num_bits=4, group_size=GROUP), torch.bfloat16)
    return qw


def peak_bandwidth(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def bench_cpu(shapes, ms, budget, dt, bandwidth):
    from quantkit.kernels import cpu_int4
    from quantkit.qmodules.int_linear import PackedIntLinear
    from quantkit.kernels.select import use_kernel

    d = str(dt).removeprefix("torch.")
    print(row(["model", "linear", "N x K", "M", "kernel", "us", "TFLOPS", "GB/s", "of read BW", f"{d} us",
               f"speedup vs {d}", f"{d} mv us", f"speedup vs {d} mv"]))
    print(row(["---"] * 13))
    dev = torch.device("cpu")
    for model, linear, n, k in shapes:
        qw = int4_weight(n, k, dev)
        packed = cpu_int4.repack(qw.q, qw.scale, None, GROUP, dt)
        module = PackedIntLinear.from_quantized(qw, None)
        w_bf16 = qw.dequantize(dt)  # the dense baseline, in the compute dtype
        weight_bytes = n * k // 2 + qw.scale.numel() * 2
        act = dt.itemsize
        for m in ms:
            x = torch.randn(m, k, dtype=dt)
            t_bf16 = timed(lambda: torch.nn.functional.linear(x, w_bf16), dev, budget)
            # one token: torch.mv is this CPU's fastest 16-bit GEMV (F.linear is up to ~2x slower): the stricter baseline
            t_mv = timed(lambda: torch.mv(w_bf16, x.view(-1)), dev, budget) if m == 1 else None
            runs = [("int4 op", lambda: packed.matmul(x)), ("PackedIntLinear (auto)", lambda: module(x))]
            if m == 1:
                runs.append(("PackedIntLinear (torch path)", lambda: module(x)))
            for name, fn in runs:
                use_kernel(module, "torch" if "torch path" in name else "auto")
                t = timed(fn, dev, budget)
                moved = weight_bytes + act * m * (k + n)
                print(row([model, linear, f"{n} x {k}", m, name, f"{t * 1e6:.0f}", f"{2 * m * n * k / t / 1e12:.3f}",
                           f"{moved / t / 1e9:.1f}", f"{moved / t / bandwidth:.0%}", f"{t_bf16 * 1e6:.0f}",
                           f"{t_bf16 / t:.2f}x",
                           "-" if t_mv is None else f"{t_mv * 1e6:.0f}", "-" if t_mv is None else f"{t_mv / t:.2f}x"]))
            use_kernel(module, None)
            sys.stdout.flush()


def bench_cuda(shapes, ms, budget, peak, bandwidth):
    from quantkit.kernels import cuda_fp8, cuda_int4, triton_fp8, triton_w4a16
    from quantkit.qmodules.int_linear import PackedIntLinear
    from quantkit.quant.packing import pack_int32

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, datasheet bandwidth {peak or '?'} GB/s, "
          f"measured read bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(row(["model", "linear", "N x K", "M", "kernel", "us", "TFLOPS", "GB/s", "of read BW", "bf16 us",
               "speedup vs bf16"]))
    print(row(["---"] * 11))
    fp8_ok = cuda_fp8.unsupported_reason(dev, 16, 16, True, torch.bfloat16) is None
    for model, linear, n, k in shapes:
        qw = int4_weight(n, k, dev)
        w4 = triton_w4a16.repack(pack_int32(qw.q, 4, 1).to(dev), qw.scale.to(dev), None, GROUP, k)
        tiny = cuda_int4.repack(qw.q.to(dev), qw.scale.to(dev), None, GROUP)
        module = PackedIntLinear.from_quantized(qw, None).to(dev)
        w_bf16 = qw.dequantize(torch.bfloat16).to(dev)
        w_scale = (w_bf16.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        w_fp8 = (w_bf16.float() / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        w4_bytes = n * k // 2 + qw.scale.numel() * 2
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            t_bf16 = timed(lambda: torch.nn.functional.linear(x, w_bf16), dev, budget)
            xq, xs = triton_fp8.quantize_per_token(x)
            module(x)  # its automatic choice (timed between the two int4 kernels at one token), made once
            runs = [
                ("triton w4a16", lambda: triton_w4a16.matmul(x, w4), w4_bytes + 2 * m * (k + n)),
                ("torch int4 (tinygemm)", lambda: tiny.matmul(x), w4_bytes + 2 * m * (k + n)),
                (f"PackedIntLinear (auto: {module.kernel})", lambda: module(x), w4_bytes + 2 * m * (k + n)),
                ("triton fp8 (quant+gemm)", lambda: triton_fp8.matmul(*triton_fp8.quantize_per_token(x), w_fp8,
                                                                      w_scale, torch.bfloat16),
                 n * k + 4 * n + 3 * m * k + 2 * m * n),
                ("triton fp8 gemm", lambda: triton_fp8.matmul(xq, xs, w_fp8, w_scale, torch.bfloat16),
                 n * k + 4 * n + m * k + 2 * m * n),
            ]
            if fp8_ok:
                runs += [("scaled_mm fp8 (quant+gemm)", lambda: cuda_fp8.matmul(*triton_fp8.quantize_per_token(x),
                                                                                w_fp8, w_scale, torch.bfloat16),
                          n * k + 4 * n + 3 * m * k + 2 * m * n),
                         ("scaled_mm fp8 gemm", lambda: cuda_fp8.matmul(xq, xs, w_fp8, w_scale, torch.bfloat16),
                          n * k + 4 * n + m * k + 2 * m * n)]
            for name, fn, moved in runs:
                t = timed(fn, dev, budget)
                print(row([model, linear, f"{n} x {k}", m, name, f"{t * 1e6:.1f}", f"{2 * m * n * k / t / 1e12:.1f}",
                           f"{moved / t / 1e9:.0f}", f"{moved / t / bandwidth:.0%}", f"{t_bf16 * 1e6:.1f}",
                           f"{t_bf16 / t:.2f}x"]))
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--m", default="1,16,64,256,2048")
    parser.add_argument("--shapes", default="square,llama3-8b,qwen3-4b")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (default: known GPUs)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of repeated runs per figure")
    parser.add_argument("--dtype", default="auto", help="CPU activation dtype: auto (the machine's fast dtype for a "
                                                        "bf16 checkpoint, `quantkit.platform.compute`), bfloat16, float32")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    shapes = [(model, *s) for model in args.shapes.split(",") for s in SHAPES[model]]
    from quantkit.platform import compute

    from quantkit.kernels.roofline import read_bandwidth

    print(compute.machine_summary())
    bandwidth = read_bandwidth(args.device)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s on {args.device} (a sum over a 1 GiB float32 buffer, best of 6): "
          f"'of read BW' is each kernel's bytes per second against it (a weight read once per call)")
    if args.device == "cuda":
        print(f"group size {GROUP}, bf16 activations")
        bench_cuda(shapes, ms, args.budget, peak_bandwidth(torch.device("cuda"), args.peak_gbps), bandwidth)
    else:
        choice = compute.choose(torch.bfloat16, "cpu", args.dtype, "--dtype")
        print(f"group size {GROUP}; {choice.describe()}")
        bench_cpu(shapes, ms, args.budget, choice.dtype, bandwidth)


if __name__ == "__main__":
    main()
