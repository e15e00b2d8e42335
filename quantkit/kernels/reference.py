"""Torch references for the quantized matmuls: exact dequantization, then an ordinary matmul.

These define what every kernel must compute. They are also the fallback path of the quantized
linear (any device, any bit width), so they favour clarity over speed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from quantkit.quant import microscale
from quantkit.quant.fp8 import FP8_MAX  # largest finite float8_e4m3fn, defined once
from quantkit.quant.schemes import QuantScheme


def int_weight_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    group_size: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [..., K] @ W^T with W[n, k] = (codes[n, k] - zero_point[n, g]) * scale[n, g], g = k // group_size.

    codes: int8 [N, K]; scale: [N, G]; zero_point: int [N, G] or None (symmetric). The weight is
    dequantized in float32 and cast once to x's dtype, as the packed linear's torch path does.
    """
    g = torch.arange(codes.shape[1], device=codes.device) // group_size
    w = codes.float()
    if zero_point is not None:
        w = w - zero_point.float()[:, g]
    w = (w * scale.float()[:, g]).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_quantize_per_token(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization: scale = amax(row) / 448 (float32), q = sat(x / scale).

    Returns (q [..., K] float8_e4m3fn, scale [..., 1] float32). A zero row gets scale eps / 448,
    so its codes are 0 and nothing divides by zero.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=eps) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(xq [M, K] e4m3 * x_scale [M, 1] or [1]) @ (wq [N, K] e4m3 * w_scale [N, 1] or [1])^T in float32,
    cast to out_dtype: products of e4m3 values are exact in float32, the sum is an fp32 reduction."""
    acc = xq.float() @ wq.float().t()
    acc = acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


INT8_MAX = 127


def int8_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric int8 quantization as vLLM's int8 kernels do it: s = amax(row) / 127
    (float32), q = x * (127 / amax) rounded half to even and saturated to [-128, 127].

    Returns (q [..., K] int8, s [..., 1] float32). A zero row gets codes 0 and scale 0.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-128, INT8_MAX).to(torch.int8)
    return q, amax / INT8_MAX


def int8_static_scale(absmax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """A static per-tensor int8 activation scale [1]: absmax / 127 of the calibration inputs, in scale_dtype
    (what the checkpoint stores; a zero absmax gives the smallest positive scale, so codes stay 0)."""
    return (absmax.float().reshape(1).clamp(min=1e-12) / INT8_MAX).to(scale_dtype)


def int8_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Static per-tensor int8 quantization as vLLM's `scaled_int8_quant` with a given scale: q = x / s rounded
    half to even, saturated to [-128, 127]. Returns (q [..., K] int8, s broadcast to [..., 1] float32)."""
    s = scale.float().reshape(1)
    q = torch.round(x.float() / s).clamp_(-128, INT8_MAX).to(torch.int8)
    return q, s.expand(*x.shape[:-1], 1)


def int8_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(xq [M, K] int8 * x_scale [M, 1]) @ (wq [N, K] int8 * w_scale [N, 1])^T: the integer products summed
    exactly (float64 holds every int8 x int8 sum below 2^53), then scaled in float32 as
    x_scale * (w_scale * acc), plus the bias in float32, cast to out_dtype."""
    acc = (xq.double() @ wq.double().t()).float()
    return _int8_epilogue(acc, x_scale, w_scale, out_dtype, bias)


def _int8_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = x_scale.float().reshape(-1, 1) * (w_scale.float().reshape(1, -1) * acc)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def int8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq_t: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`int8_matmul_reference` through torch's int8 GEMM (`torch._int_mm`: oneDNN with VNNI / AMX on the
    CPU, exact int32 accumulation), `wq_t` the weight codes transposed [K, N] (a transposed view of the [N, K]
    codes is the fast layout on the CPU); the same result bit for bit
    while every sum fits int32 (K <= 133000)."""
    acc = torch._int_mm(xq, wq_t).float()
    return _int8_epilogue(acc, x_scale, w_scale, out_dtype, bias)


def input_fake_quantizer(scheme: QuantScheme) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """What the scheme's kernels do to a linear's input, as x -> quantized and dequantized x (float32): NVFP4 (its
    global scale from x itself, as calibration will set it), MX, dynamic per-token FP8 or int8 (the rules above).
    None where the inputs stay as they are or take a static scale (not calibrated yet when AWQ searches)."""
    acts = scheme.input_activations
    if acts is None or not (acts.microscaled or acts.dynamic):
        return None
    if acts.microscaled:
        def micro(x: torch.Tensor) -> torch.Tensor:
            gs = microscale.nvfp4_global_scale(x.abs().amax().float()) if acts.dynamic == "local" else None
            return microscale.fake_quantize_input(x, acts.num_bits, acts.group_size, gs)
        return micro
    per_token = fp8_quantize_per_token if acts.type == "float" else int8_quantize_per_token

    def dynamic(x: torch.Tensor) -> torch.Tensor:
        q, s = per_token(x)
        return q.float() * s
    return dynamic
