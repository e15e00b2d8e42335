"""FP8 GEMM on CUDA through torch's `_scaled_mm` (cuBLASLt), on devices with FP8 tensor cores.

y = (xq * x_scale) @ (wq * w_scale)^T + bias for e4m3 operands: per-tensor scales on both sides in any
output dtype, or row-wise scales (per token x per channel, a per-tensor side broadcast to rows) with a
bf16 output, which is what cuBLASLt's row-wise mode produces (so a model in another dtype does not take
it: `unsupported_reason`). The weight is read as it is stored ([N, K] row-major is the column-major
second operand the call wants); K and N must be multiples of 16.
"""

from __future__ import annotations

from typing import Optional

import torch


def unsupported_reason(device: torch.device, n: int, k: int, rowwise: bool, out_dtype: torch.dtype) -> Optional[str]:
    """Why `_scaled_mm` cannot run an [n, k] FP8 weight here (None when it can)."""
    if device.type != "cuda":
        return f"torch._scaled_mm runs on CUDA tensors, not on {device.type}"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch build has no torch._scaled_mm"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability(device)} has no FP8 tensor cores (8.9 or later)"
    if n % 16 or k % 16:
        return f"a {n} x {k} weight: both sizes must be multiples of 16"
    if rowwise and out_dtype != torch.bfloat16:
        return f"row-wise scales give bf16 outputs, not {str(out_dtype).removeprefix('torch.')}"
    return None


def matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
           out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """xq [..., K] e4m3 with x_scale [..., 1] (per token) or [1] (per tensor); wq [N, K] e4m3 with w_scale
    [N] / [N, 1] (per channel) or [1] -> [..., N] in out_dtype (the argument order of `triton_fp8.matmul`)."""
    shape = xq.shape
    a = xq.reshape(-1, shape[-1]).contiguous()
    m, n = a.shape[0], wq.shape[0]
    sa, sb = x_scale.reshape(-1).float(), w_scale.reshape(-1).float()
    if sa.numel() == 1 and sb.numel() == 1:  # per tensor: scalars, any output dtype
        sa, sb = sa.reshape(()), sb.reshape(())
    else:  # row-wise: [M, 1] and [1, N]
        sa = sa.expand(m).reshape(m, 1).contiguous()
        sb = sb.expand(n).reshape(1, n).contiguous()
    b16 = None if bias is None else bias.to(out_dtype)
    y = torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=sb, bias=b16, out_dtype=out_dtype)
    return y.reshape(*shape[:-1], n)
