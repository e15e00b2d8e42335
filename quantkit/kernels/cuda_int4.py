"""W4A16 on CUDA through torch's built-in int4 kernel (`aten._weight_int4pack_mm`, "tinygemm").

The op computes x @ W^T for bf16 x with W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n], u in [0, 16)
repacked by `aten._convert_weight_to_int4pack` from a uint8 [N, K / 2] tensor holding element 2j in
the high nibble of byte j and 2j + 1 in the low one (the CUDA order since torch 2.5; the CPU op
takes int32 codes instead, `kernels.cpu_int4`). compressed-tensors stores q = u - 8 and
W = (q - zp) * scale, so zero = -zp * scale, as on the CPU. Groups of 32, 64, 128 or 256 dividing K
(per-channel weights take the largest, the scale repeated), K a multiple of inner_k_tiles x 16, N a
multiple of 8; compute capability 8.0 or later. The repack happens once, when the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

GROUP_SIZES = (256, 128, 64, 32)
N_MULTIPLE = 8
INNER_K_TILES = (8, 4, 2)  # the largest that divides K / 16 is taken


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack")


def kernel_group_size(in_features: int, group_size: int) -> Optional[int]:
    """The op's group size for a weight with `group_size` columns per scale (K for per channel), or None."""
    if group_size in GROUP_SIZES and in_features % group_size == 0:
        return group_size
    if group_size == in_features:
        return next((g for g in GROUP_SIZES if in_features % g == 0), None)
    return None


def inner_k_tiles(in_features: int) -> Optional[int]:
    return next((t for t in INNER_K_TILES if in_features % (t * 16) == 0), None)


def unsupported_reason(device: torch.device, num_bits: int, in_features: int, out_features: int,
                       group_size: int) -> Optional[str]:
    """Why this weight cannot use torch's CUDA int4 op on `device` (None when it can)."""
    if device.type != "cuda":
        return f"torch's int4 op runs on CUDA tensors, not on {device.type}"
    if not available():
        return "this torch build has no aten._weight_int4pack_mm"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0)"
    if num_bits != 4:
        return f"the int4 op takes 4-bit weights, not {num_bits}-bit"
    if kernel_group_size(in_features, group_size) is None:
        return (f"group size {group_size} with in_features {in_features}: the op needs groups of "
                f"{', '.join(map(str, GROUP_SIZES))} dividing in_features")
    if inner_k_tiles(in_features) is None:
        return f"in_features {in_features} is not a multiple of 32"
    if out_features % N_MULTIPLE:
        return f"out_features {out_features} is not a multiple of {N_MULTIPLE}"
    return None


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> uint8 [N, K / 2], element 2j in byte j's high nibble (the op's input)."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] << 4) | u[:, 1::2]


@dataclass
class Int4PackedCUDA:
    """A weight repacked for the CUDA op, with its bf16 scales and zeros."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor  # [K / group, N, 2] bf16
    group_size: int
    out_features: int

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x @ W^T (+ bias) in x's dtype; the op itself runs in bf16 (a bf16 model's activations as they are)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), self.packed, self.group_size, self.scale_zeros)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def scale_zeros(scale: torch.Tensor, zero_point: Optional[torch.Tensor], repeat: int) -> torch.Tensor:
    """scale [N, G] and integer zero points [N, G] (None: symmetric) -> the op's [G * repeat, N, 2] bf16 table."""
    s = scale.float().repeat_interleave(repeat, dim=1)  # [N, K / kg]
    zero = torch.zeros_like(s) if zero_point is None else -zero_point.float().repeat_interleave(repeat, dim=1) * s
    return torch.stack([s.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)


def repack(codes: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: int) -> Int4PackedCUDA:
    """codes int8 [N, K] in [-8, 7], scale [N, G], zero_point int [N, G] or None (all on the CUDA device) -> the
    op's layout."""
    n, k = codes.shape
    kg = kernel_group_size(k, group_size)
    tiles = inner_k_tiles(k)
    if kg is None or tiles is None or n % N_MULTIPLE:
        raise ValueError(f"CUDA int4 op: unsupported weight {n} x {k} with group size {group_size}")
    repeat = group_size // kg if group_size == k and kg != k else 1
    packed = torch.ops.aten._convert_weight_to_int4pack(pack_nibbles(codes).contiguous(), tiles)
    return Int4PackedCUDA(packed, scale_zeros(scale, zero_point, repeat), kg, n)
