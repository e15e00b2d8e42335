"""Triton W4A16 GEMM: y = x @ W^T with int4 weights dequantized inside the K loop, fp32 accumulation.

Weight layout read by the kernel (made once at load by `repack` from compressed-tensors'
`weight_packed` [N, ceil(K/8)] int32): `qweight` [ceil(K/8), N] int32, word k//8 of column n holding
k's offset-binary nibble u = q + 8 at bits 4*(k%8); `scales` [G, N] and, when asymmetric,
`zeros` [G, N] (the integer zero points, as float32) with g = k // group_size. Per-channel weights
are group_size = K. W[n, k] = (u - 8 - zero) * scale is computed in float32 and cast to x's dtype
before the dot, as the torch reference does.

Two kernels: a tiled GEMM for M > 16 (`_w4a16_kernel`), and for decode sizes (M <= 16) a split-K
GEMV (`_w4a16_gemv_kernel`) that loads each packed int32 word once, unpacks its eight nibbles in
registers, and applies a group's scale once per output column after the products when a K step lies
inside one group; the K range is cut into SPLIT_K slices whose partial sums are added atomically into
a float32 output, so it fills the GPU even when N / BLOCK_N is small. (The first decode path ran the
GEMM kernel with split K: each word was loaded eight times and every weight scaled before the dot;
on an H200 it reached 0.16-0.31x torch's bf16 F.linear.) Both are autotuned on (M, N, K) on CUDA;
under TRITON_INTERPRET=1 (tests on CPU) a fixed or given config runs instead.
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
    _store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc, mask_m[:, None] & mask_n[None, :],
           SPLIT_K)


@triton.jit
def _w4a16_gemv_kernel(
    # pointers: x [M, K], packed words [K / 8, N], scales [G, N], zeros [G, N] (float), y [M, N] (float32 when split)
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (the last dimension of every tensor is contiguous)
    stride_xm, stride_qk, stride_sg, stride_ym,
    # meta-parameters
    GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """y[m, n] (+)= sum_k x[m, k] * W[n, k] over this program's K slice; BLOCK_W packed words (8 k each) per step."""
    BLOCK_K: tl.constexpr = BLOCK_W * 8
    ONE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0  # every K step lies inside one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    words = tl.cdiv(K, 8)
    per_split = tl.cdiv(tl.cdiv(words, SPLIT_K), BLOCK_W) * BLOCK_W
    w_start = pid_k * per_split
    w_end = tl.minimum(w_start + per_split, words)
    shifts = tl.arange(0, 8) * 4  # nibble i of a word holds element 8 * word + i
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        wmask = (offs_w[:, None] < w_end) & mask_n[None, :]
        packed = tl.load(qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :], mask=wmask, other=0)  # [BW, BN]
        u = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BW, 8, BN]
        q = tl.reshape(u, (BLOCK_K, BLOCK_N)).to(tl.float32) - 8.0  # [BK, BN], k = 8 * word + nibble
        offs_k = w0 * 8 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)  # [BM, BK]
        if ONE_GROUP:
            g = (w0 * 8) // GROUP_SIZE
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
            if HAS_ZP:
                q = q - tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)[None, :]
            part = _gemv_dot(x, q, BLOCK_M, DOT_FP32)
            acc += part * scale[None, :]
        else:
            g = offs_k // GROUP_SIZE
            smask = mask_k[:, None] & mask_n[None, :]
            scale = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=smask, other=0.0).to(tl.float32)
            if HAS_ZP:
                q = q - tl.load(z_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=smask, other=0.0)
            acc += _gemv_dot(x, q * scale, BLOCK_M, DOT_FP32)
    _store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask_m[:, None] & mask_n[None, :], SPLIT_K)


@triton.jit
def _store(y_ptrs, acc, ymask, SPLIT_K: tl.constexpr):
    """The float32 tile `acc` into y: cast to y's dtype, or added atomically when K is split."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=ymask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=ymask)


@triton.jit
def _gemv_dot(x, w, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr):
    """x [BM, BK] @ w [BK, BN] (w in float32, its values exact in x's dtype when unscaled) -> float32 [BM, BN]:
    one row by multiply-and-sum on the CUDA cores, more by tl.dot (tensor cores; BLOCK_M >= 16)."""
    if BLOCK_M == 1:
        return tl.sum(tl.trans(x.to(tl.float32)) * w, axis=0)[None, :]
    if DOT_FP32:  # the interpreter's bf16 dot is broken: the same products in float32
        return tl.dot(x.to(tl.float32), w, out_dtype=tl.float32)
    return tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)


def _cfg(bm, bn, bk, split, warps=4, stages=3):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


GEMM_CONFIGS = [
    _cfg(bm, bn, bk, 1, w, s)
    for bm, bn, bk, w, s in [(16, 64, 128, 4, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                             (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 32, 4, 4)]
]
def _gemv_cfg(bn, bw, split, warps=4, stages=3):
    return triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": split}, num_warps=warps, num_stages=stages)


GEMV_CONFIGS = [
    _gemv_cfg(bn, bw, split, w, s)
    for bn, bw, split, w, s in [(32, 16, 1, 2, 4), (64, 16, 1, 4, 4), (128, 8, 1, 4, 4), (64, 16, 2, 4, 4),
                                (64, 16, 4, 4, 4), (128, 16, 4, 4, 3), (32, 32, 4, 2, 4), (64, 32, 8, 4, 3),
                                (128, 8, 8, 4, 4), (256, 8, 4, 8, 3), (64, 8, 16, 2, 4), (32, 16, 8, 1, 4)]
]
INTERPRET_GEMM = _cfg(32, 32, 32, 1)
INTERPRET_GEMV = _gemv_cfg(32, 4, 2)

_gemm_tuned = triton.autotune(configs=GEMM_CONFIGS, key=["M", "N", "K"])(_w4a16_kernel)
_gemv_tuned = triton.autotune(configs=GEMV_CONFIGS, key=["M", "N", "K"], reset_to_zero=["y_ptr"])(_w4a16_gemv_kernel)


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
    """x [..., K] (fp16 / bf16 / fp32) @ W^T -> [..., N] in x's dtype. config: force one instead of the
    autotuned choice: BLOCK_N / BLOCK_W / SPLIT_K for the GEMV kernel, BLOCK_M / BLOCK_N / BLOCK_K /
    SPLIT_K for the GEMM one (by default the GEMV up to DECODE_MAX_M rows)."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"W4A16: input width {x.shape[-1]} does not match the weight's in_features {w.in_features}")
    if x.device != w.qweight.device:
        raise ValueError(f"W4A16: input on {x.device}, weight on {w.qweight.device}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    gemv = x2.shape[0] <= DECODE_MAX_M if config is None else "BLOCK_W" in config.kwargs
    y = _gemv(x2, w, config) if gemv else _gemm(x2, w, config)
    y = y.to(x.dtype) if y.dtype != x.dtype else y
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], w.out_features)


def _gemv(x2: torch.Tensor, w: W4A16Weight, config: Optional[triton.Config]) -> torch.Tensor:
    """x2 [M <= 16, K] @ W^T by the GEMV kernel: [M, N] in float32 (split K) or x's dtype."""
    M, K, N = x2.shape[0], w.in_features, w.out_features
    if config is None and interpreting():
        config = INTERPRET_GEMV
    split = config.kwargs["SPLIT_K"] if config is not None else None
    y = torch.empty((M, N), device=x2.device, dtype=x2.dtype) if split == 1 else \
        torch.zeros((M, N), device=x2.device, dtype=torch.float32)
    zeros = w.zeros if w.zeros is not None else w.scales  # a valid pointer; unread when HAS_ZP is False
    # one row: multiply-and-sum; more: tl.dot on a 16-row tile (its smallest)
    fixed = dict(GROUP_SIZE=w.group_size, HAS_ZP=w.zeros is not None, BLOCK_M=1 if M == 1 else 16,
                 DOT_FP32=interpreting() and x2.dtype == torch.bfloat16)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    args = (x2, w.qweight, w.scales, zeros, y, M, N, K, x2.stride(0), w.qweight.stride(0), w.scales.stride(0),
            y.stride(0))
    if config is not None:
        meta = dict(config.kwargs)
        _w4a16_gemv_kernel[grid(meta)](*args, **fixed, **meta, num_warps=config.num_warps,
                                       num_stages=config.num_stages)
    else:
        _gemv_tuned[grid](*args, **fixed)
    return y


def _gemm(x2: torch.Tensor, w: W4A16Weight, config: Optional[triton.Config]) -> torch.Tensor:
    """x2 [M, K] @ W^T by the tiled GEMM kernel (split K when the config asks): [M, N]."""
    M, K, N = x2.shape[0], w.in_features, w.out_features
    if config is None and interpreting():
        config = INTERPRET_GEMM
    split = config.kwargs["SPLIT_K"] if config is not None else 1
    y = torch.zeros((M, N), device=x2.device, dtype=torch.float32) if split > 1 else \
        torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    # triton 3.9's interpreter multiplies bf16 tiles as raw bits: upcast the (already bf16-rounded) tiles there
    dot_fp32 = interpreting() and x2.dtype == torch.bfloat16
    zeros = w.zeros if w.zeros is not None else w.scales

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
        _gemm_tuned[grid](*args, *strides, HAS_ZP=w.zeros is not None, DOT_FP32=dot_fp32)
    return y
