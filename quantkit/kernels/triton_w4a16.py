"""Triton W4A16 GEMM: y = x @ W^T with int4 weights dequantized inside the K loop, fp32 accumulation.

Weight layout read by the kernel (made once at load by `repack` from compressed-tensors'
`weight_packed` [N, ceil(K/8)] int32): `qweight` [ceil(K/8), N] int32, word k//8 of column n holding
k's offset-binary nibble u = q + 8 at bits 4*(k%8); `scales` [G, N] and, when asymmetric,
`zeros` [G, N] (the integer zero points, as float32) with g = k // group_size. Per-channel weights
are group_size = K. W[n, k] = (u - 8 - zero) * scale is computed in float32 and cast to x's dtype
before the dot, as the torch reference does.

Two entry points share the kernel: a tiled GEMM for M > 16, and a split-K variant for decode sizes
(M <= 16): the K range is cut into SPLIT_K slices whose partial sums are added atomically into a
float32 output, so a GEMV fills the GPU even when N / BLOCK_N is small. Both are autotuned on
(M, N, K) on CUDA; under TRITON_INTERPRET=1 (tests on CPU) a fixed or given config runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from quantkit.kernels.select import interpreting

DECODE_MAX_M = 16


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :] * stride_qn, mask=wmask, other=0)
        u = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        g = offs_k // group_size
        scale = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=wmask, other=0.0)
        w = (u - 8).to(tl.float32)
        if HAS_ZP:
            zero = tl.load(z_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=wmask, other=0.0)
            w = w - zero
        w = (w * scale.to(tl.float32)).to(x.dtype)  # [BLOCK_K, BLOCK_N], exactly the reference's weight
        if DOT_FP32:  # the same products (bf16 x bf16 is exact in fp32), for the interpreter's broken bf16 dot
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w, out_dtype=tl.float32)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    ymask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=ymask)


def _cfg(bm, bn, bk, split, warps=4, stages=3):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


GEMM_CONFIGS = [
    _cfg(bm, bn, bk, 1, w, s)
    for bm, bn, bk, w, s in [(16, 64, 128, 4, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                             (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 32, 4, 4)]
]
DECODE_CONFIGS = [
    _cfg(16, bn, bk, split, w, s)
    for bn, bk, split, w, s in [(64, 128, 1, 4, 4), (64, 128, 4, 4, 4), (128, 128, 4, 4, 3), (64, 256, 8, 4, 3),
                                (128, 64, 8, 4, 4), (32, 256, 16, 4, 3), (64, 64, 16, 2, 4)]
]
INTERPRET_GEMM = _cfg(32, 32, 32, 1)
INTERPRET_DECODE = _cfg(16, 32, 32, 2)

_gemm_tuned = triton.autotune(configs=GEMM_CONFIGS, key=["M", "N", "K"])(_w4a16_kernel)
_decode_tuned = triton.autotune(configs=DECODE_CONFIGS, key=["M", "N", "K"], reset_to_zero=["y_ptr"])(_w4a16_kernel)


@dataclass
class W4A16Weight:
    """A 4-bit weight in the kernel's layout."""

    qweight: torch.Tensor  # [ceil(K/8), N] int32
    scales: torch.Tensor  # [G, N], as stored (read as float32)
    zeros: Optional[torch.Tensor]  # [G, N] float32 zero points, or None when symmetric
    group_size: int
    in_features: int
    out_features: int


def repack(weight_packed: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: int,
           in_features: int) -> W4A16Weight:
    """compressed-tensors 4-bit tensors ([N, ceil(K/8)] int32 packed along K, scale [N, G], unpacked
    integer zero points [N, G] or None) -> the kernel's layout. Nibble order is unchanged: only the
    word matrix is transposed so that a tile of N columns is contiguous."""
    zeros = None if zero_point is None else zero_point.float().t().contiguous()
    return W4A16Weight(weight_packed.t().contiguous(), scale.t().contiguous(), zeros, group_size,
                       in_features, weight_packed.shape[0])


def matmul(x: torch.Tensor, w: W4A16Weight, bias: Optional[torch.Tensor] = None,
           config: Optional[triton.Config] = None) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32) @ W^T -> [..., N] in x's dtype. config: force one
    (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) instead of the autotuned choice."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"W4A16: input width {x.shape[-1]} does not match the weight's in_features {w.in_features}")
    if x.device != w.qweight.device:
        raise ValueError(f"W4A16: input on {x.device}, weight on {w.qweight.device}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M, K, N = x2.shape[0], w.in_features, w.out_features
    if config is None and interpreting():
        config = INTERPRET_DECODE if M <= DECODE_MAX_M else INTERPRET_GEMM
    split = config.kwargs["SPLIT_K"] if config is not None else (None if M <= DECODE_MAX_M else 1)
    decode = split is None or split > 1
    y = torch.zeros((M, N), device=x.device, dtype=torch.float32) if decode else \
        torch.empty((M, N), device=x.device, dtype=x.dtype)
    # triton 3.9's interpreter multiplies bf16 tiles as raw bits: upcast the (already bf16-rounded) tiles there
    dot_fp32 = interpreting() and x.dtype == torch.bfloat16
    zeros = w.zeros if w.zeros is not None else w.scales  # a valid pointer; unread when HAS_ZP is False

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    args = (x2, w.qweight, w.scales, zeros, y, M, N, K, w.group_size)
    strides = (x2.stride(0), x2.stride(1), w.qweight.stride(0), w.qweight.stride(1),
               w.scales.stride(0), w.scales.stride(1), y.stride(0), y.stride(1))
    if config is not None:
        meta = dict(config.kwargs)
        _w4a16_kernel[grid(meta)](*args, *strides, HAS_ZP=w.zeros is not None, DOT_FP32=dot_fp32, **meta,
                                  num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        tuned = _decode_tuned if decode else _gemm_tuned
        tuned[grid](*args, *strides, HAS_ZP=w.zeros is not None, DOT_FP32=dot_fp32)
    y = y.to(x.dtype) if y.dtype != x.dtype else y
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], N)
