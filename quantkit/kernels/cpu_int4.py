"""W4A16 on CPU through `torch.ops.aten._weight_int4pack_mm_for_cpu`.

That op computes x @ W^T with W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n], u in [0, 16)
packed by `_convert_weight_to_int4pack_for_cpu`, for groups of 32, 64, 128 or 256 and N a multiple
of 16. compressed-tensors stores q = u - 8 in [-8, 7] and W = (q - zp) * scale, so
zero = -zp * scale (0 when symmetric). Per-channel weights use the largest supported group that
divides K with the scale repeated; N is padded to a multiple of 16 and the output sliced.
The repack happens once, when the model is loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.kernels import native

GROUP_SIZES = (256, 128, 64, 32)
# The op is a GEMV at heart: its time grows ~0.27 ms per token for a 4096 x 4096 weight here, so
# from about this many tokens on, dequantizing once and running a bf16 GEMM is faster (measured
# on 4096 x 4096, bf16: 128 tokens 37 vs 47 ms, 256 tokens 72 vs 53 ms). A quantized linear
# switches to its dequantize path above it (perplexity windows) unless the decode plan measured
# another limit for its kind (`runtime.decode_plan`: prompts of a generate).
MAX_TOKENS = 160
N_MULTIPLE = 16
ROW_BLOCK = 64  # the op packs rows in blocks of 64: packed weights of such blocks concatenate along N


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def kernel_group_size(in_features: int, group_size: int) -> Optional[int]:
    """The op's group size for a weight with `group_size` columns per scale (K for per-channel), or None."""
    if group_size in GROUP_SIZES and in_features % group_size == 0:
        return group_size
    if group_size == in_features:  # per channel: any supported divisor of K, scale repeated
        return next((g for g in GROUP_SIZES if in_features % g == 0), None)
    return None


def unsupported_reason(num_bits: int, in_features: int, group_size: int) -> Optional[str]:
    """Why this weight cannot use the CPU int4 op (None when it can)."""
    if not available():
        return "this torch build has no aten._weight_int4pack_mm_for_cpu"
    if num_bits != 4:
        return f"the CPU int4 op takes 4-bit weights, not {num_bits}-bit"
    if kernel_group_size(in_features, group_size) is None:
        return (f"group size {group_size} with in_features {in_features}: the CPU int4 op needs groups of "
                f"{', '.join(map(str, GROUP_SIZES))} dividing in_features")
    return None


@dataclass
class Int4PackedCPU:
    """A weight repacked for the CPU op, with the scales and zeros it reads in one dtype."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor  # [K / group, N_padded, 2]
    group_size: int
    out_features: int
    # one bf16 token through quantkit's own GEMV over this layout (`kernels.native`) instead of the op: set where
    # the decode plan measured it faster for the layer's kind (`runtime.decode_plan`), and `native_ok` holds
    native_one_token: bool = False

    @property
    def native_fits(self) -> bool:
        """Whether the native one-token GEMV takes this weight: bf16 scales, rows in whole blocks of the layout."""
        rows = layout_rows()
        return self.scale_zeros.dtype == torch.bfloat16 and rows is not None and self.packed.shape[0] % rows == 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the op runs in: inputs are cast to it, and its output is in it (`matmul` casts it back)."""
        return self.scale_zeros.dtype

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, cast_back: bool = True) -> torch.Tensor:
        """x @ W^T (+ bias); the op itself runs in the dtype of the scales (the input's, or bf16 for float32
        inputs where the decode plan chose and said so: a W4A16 layer's 16-bit activations). cast_back: the result in
        x's dtype; without it (and without a bias) it stays in the op's dtype, for a caller whose
        consumers promote it exactly (the lean decode step)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        if self.native_one_token and x2.shape[0] == 1 and self.dtype == torch.bfloat16:
            y = native.module().int4_gemv(self.packed, self.scale_zeros, x2[0], self.group_size,
                                          self.out_features, layout_rows()).view(1, -1)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        if (cast_back or bias is not None) and y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


LAYOUT_ROWS = {"AVX512": 64, "AVX2": 32}  # rows per block of the op's packed layout, by torch's CPU capability


def layout_rows() -> Optional[int]:
    """Rows per block of the layout the op packs in this process (None: a capability whose layout is not known)."""
    return LAYOUT_ROWS.get(torch.backends.cpu.get_cpu_capability())


def native_reason() -> Optional[str]:
    """Why quantkit's own one-token GEMV cannot run this op's layout here (None when it can): it reads the
    layout the op writes on an AVX-512 CPU (rows in blocks of 64) or an AVX2 one (blocks of 32), checked once
    against the op itself."""
    if not available():
        return "this torch build has no CPU int4 op"
    rows = layout_rows()
    if rows is None:
        return f"torch packs int4 for {torch.backends.cpu.get_cpu_capability()}: a layout the native GEMV does not read"
    if not native.int4_available(rows):
        return native.reason() or f"the native kernels were built without the {rows}-row layout's instructions"
    return _layout_check(rows)


@functools.lru_cache(maxsize=None)
def _layout_check(rows: int) -> Optional[str]:
    """None when the native GEMV and the op agree on a random 128 x 256 weight (groups of 64, zero points)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (128, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(128, 4, generator=g) * 0.05 + 0.01
    zero = torch.randint(-8, 8, (128, 4), generator=g)
    w = repack(codes, scale, zero, 64, torch.bfloat16)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    op = w.matmul(x).float()
    mine = native.module().int4_gemv(w.packed, w.scale_zeros, x[0], 64, 128, rows).float()
    err = (op[0] - mine).abs().max().item()
    bound = 0.02 * op.abs().max().item()  # two bf16 roundings of the same sums apart, not another layout
    return None if err <= bound else f"the native GEMV disagrees with the op here ({err:.3g} > {bound:.3g})"


def repack(codes: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: int,
           dtype: torch.dtype, inner_k_tiles: int = 2) -> Int4PackedCPU:
    """codes int8 [N, K] in [-8, 7], scale [N, G], zero_point int [N, G] or None -> the op's layout.

    dtype: the dtype the op runs in (the activations are cast to it); the scales are kept in it."""
    n, k = codes.shape
    kg = kernel_group_size(k, group_size)
    if kg is None:
        raise ValueError(f"CPU int4 op: unsupported group size {group_size} for in_features {k}")
    repeat = group_size // kg if group_size == k and kg != k else 1
    s = scale.float().repeat_interleave(repeat, dim=1)  # [N, K / kg]
    zero = torch.zeros_like(s) if zero_point is None else \
        -zero_point.float().repeat_interleave(repeat, dim=1) * s
    pad = (-n) % N_MULTIPLE
    u = codes.to(torch.int32) + 8
    if pad:
        u = torch.nn.functional.pad(u, (0, 0, 0, pad), value=8)  # padded rows are 0 after the -8
        s = torch.nn.functional.pad(s, (0, 0, 0, pad), value=1.0)
        zero = torch.nn.functional.pad(zero, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), inner_k_tiles)
    scale_zeros = torch.stack([s.t(), zero.t()], dim=-1).contiguous().to(dtype)  # [K / kg, N_pad, 2]
    return Int4PackedCPU(packed, scale_zeros, kg, n)
