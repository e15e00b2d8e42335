"""Triton FP8 (e4m3) kernels: per-token activation quantization, and the scaled FP8 GEMM.

`quantize_per_token`: one program per row; amax over the row, scale = amax / 448 (float32),
q = x / scale rounded to e4m3 with saturation. The rounding to the e4m3 grid is done in float32
arithmetic (round half to even on the value's e4m3 spacing), so the final cast is exact on every
backend: triton 3.9's interpreter rounds some float32 -> e4m3 casts wrongly when the mantissa
carries into the exponent (31.6 -> 16 instead of 32), and the hardware cast needs no rounding.

`matmul`: y = (xq @ wq^T) * x_scale[m] * w_scale[n] (+ bias): e4m3 tiles multiplied with fp32
accumulation, scales (per token or per tensor; per channel or per tensor) applied in the epilogue.
On GPUs without FP8 tensor cores (compute capability < 8.9) the tiles are widened to bf16 first
(exact: every e4m3 value is a bf16 value) and the same dot runs on the bf16 tensor cores.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from quantkit.kernels.select import interpreting
from quantkit.quant.fp8 import FP8_MAX


@triton.jit
def _round_to_e4m3(v):
    """float32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), still as float32; the sign
    is kept, -0 included."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2^-6 e4m3 is subnormal: fixed spacing 2^-9
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    t = tl.abs(v) / ulp  # exact (power of two), t < 16
    magic = 8388608.0  # 2^23: adding and subtracting it rounds 0 <= t < 2^23 to an integer, ties to even
    r = ((t + magic) - magic) * ulp
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, eps, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), eps) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + offs, _round_to_e4m3(v).to(tl.float8e4nv), mask=offs < K)


def quantize_per_token(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., 1] float32); see `reference.fp8_quantize_per_token`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    q = torch.empty((M, K), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((M,), device=x.device, dtype=torch.float32)
    block = min(triton.next_power_of_2(K), 4096)
    if M:
        _quant_rows_kernel[(M,)](x2, q, s, K, x2.stride(0), q.stride(0), eps, FP8_MAX=FP8_MAX, BLOCK_K=block)
    return q.reshape(shape), s.reshape(*shape[:-1], 1)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    A_PER_TOKEN: tl.constexpr, B_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] of W^T
        if FP8_DOT:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(a.to(WIDE), b.to(WIDE), acc, out_dtype=tl.float32)
    if A_PER_TOKEN:
        a_scale = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
        acc = acc * a_scale[:, None]
    else:
        acc = acc * tl.load(as_ptr)
    if B_PER_CHANNEL:
        b_scale = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * b_scale[None, :]
    else:
        acc = acc * tl.load(bs_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


GEMM_CONFIGS = [_cfg(*c) for c in [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3),
                                   (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3)]]
INTERPRET_CONFIG = _cfg(32, 32, 32, 4, 1)
_gemm_tuned = triton.autotune(configs=GEMM_CONFIGS, key=["M", "N", "K"])(_fp8_gemm_kernel)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
           bias: Optional[torch.Tensor] = None, config: Optional[triton.Config] = None,
           fp8_dot: Optional[bool] = None) -> torch.Tensor:
    """xq [..., K] e4m3 with x_scale [..., 1] (per token) or [1] (per tensor); wq [N, K] e4m3 with
    w_scale [N] / [N, 1] (per channel) or [1] (per tensor) -> [..., N] in out_dtype."""
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 GEMM takes float8_e4m3fn operands, got {xq.dtype} and {wq.dtype}")
    shape = xq.shape
    a = xq.reshape(-1, shape[-1])
    M, K = a.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        raise ValueError(f"FP8 GEMM: input width {K} does not match the weight's {wq.shape[1]}")
    a_scale = x_scale.reshape(-1).float().contiguous()
    b_scale = w_scale.reshape(-1).float().contiguous()
    per_token = a_scale.numel() != 1
    per_channel = b_scale.numel() != 1
    if per_token and a_scale.numel() != M:
        raise ValueError(f"FP8 GEMM: {a_scale.numel()} activation scales for {M} tokens")
    if per_channel and b_scale.numel() != N:
        raise ValueError(f"FP8 GEMM: {b_scale.numel()} weight scales for {N} output channels")
    if fp8_dot is None:
        fp8_dot = interpreting() or has_fp8_tensor_cores(xq.device)
    c = torch.empty((M, N), device=xq.device, dtype=out_dtype)
    bias_arg = bias if bias is not None else b_scale
    args = (a, wq, a_scale, b_scale, bias_arg, c, M, N, K,
            a.stride(0), a.stride(1), wq.stride(0), wq.stride(1), c.stride(0), c.stride(1))
    # widened tiles: bf16 on the GPU; float32 under the interpreter, whose bf16 dot multiplies raw bits
    wide = tl.float32 if interpreting() else tl.bfloat16
    flags = dict(A_PER_TOKEN=per_token, B_PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, FP8_DOT=fp8_dot,
                 WIDE=wide)
    if config is None and interpreting():
        config = INTERPRET_CONFIG
    if config is not None:
        meta = config.kwargs
        grid = (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
        _fp8_gemm_kernel[grid](*args, **flags, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        _gemm_tuned[lambda m: (triton.cdiv(M, m["BLOCK_M"]), triton.cdiv(N, m["BLOCK_N"]))](*args, **flags)
    return c.reshape(*shape[:-1], N)
