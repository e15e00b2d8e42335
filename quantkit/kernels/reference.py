"""Torch references for the quantized matmuls: exact dequantization, then an ordinary matmul.

These define what every kernel must compute. They are also the fallback path of the quantized
linear (any device, any bit width), so they favour clarity over speed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from quantkit.quant.fp8 import FP8_MAX  # largest finite float8_e4m3fn, defined once


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
