"""FP4 e2m1 numbers: rounding onto the grid, 4-bit codes and their packing two to a byte.

Pure functions of tensors. e2m1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Rounding is to
the nearest grid value, ties to the value with an even mantissa bit (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at +-6: the rule compressed-tensors' `cast_to_fp4`
applies. A code is the magnitude's index into the grid (bits 0-2) with the sign in bit 3 (a negative
value that rounds to zero keeps its sign: code 8, as compressed-tensors packs it). Two codes share a
byte: element 2j in the low nibble, element 2j + 1 in the high one.

Every e2m1 value is exact in e4m3, so quantized elements are held as float8_e4m3fn tensors (the same
dtype as FP8 codes) and turned into codes only when packed.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |x| reaching a bound moves it one grid step up; `>` bounds send the tie down, `>=` bounds up
_ONE_BITS = 0x3F800000  # float32 1.0: magnitudes below 1 take the spacing of [1, 2)
_HALVE = 1 << 23  # one off a float32's exponent: 2^e -> 2^(e - 1), the grid's spacing in [2^e, 2^(e + 1))
_UPPER_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def magnitude_index(a: torch.Tensor) -> torch.Tensor:
    """Grid index 0..7 of the nearest e2m1 magnitude to each |x| in `a` (ties to even), as uint8."""
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for bound, inclusive in _UPPER_BOUNDS:
        idx += (a >= bound if inclusive else a > bound).to(torch.uint8)
    return idx


def _grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest e2m1 value (float32; NaN becomes 0: quantized tensors are checked finite first).

    The grid's spacing is 0.5 below 2, then the power of two of |x| over 2 (1 in [2, 4), 2 in [4, 6]), so each
    magnitude is divided by its spacing (a power of two, exact), rounded half to even and multiplied back: the
    bounds and ties of `magnitude_index` exactly (tested bit for bit), in a few elementwise passes."""
    x = x.float()
    s = x.abs().nan_to_num_(0.0).clamp_(max=E2M1_MAX)
    spacing = ((s.view(torch.int32) & 0x7F800000).clamp_(min=_ONE_BITS) - _HALVE).view(torch.float32)
    return torch.round(s / spacing).mul_(spacing).copysign_(x)


def round_e2m1_reference(x: torch.Tensor) -> torch.Tensor:
    """`round_e2m1` by the grid's bounds (`magnitude_index`): the tests' reference."""
    x = x.float()
    mag = _grid(x.device)[magnitude_index(x.abs().nan_to_num(0.0)).long()]
    return torch.where(torch.signbit(x), -mag, mag)


def codes(values: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (uint8 0..15) of e2m1 values (any float dtype holding grid values exactly)."""
    v = values.float()
    return magnitude_index(v.abs()) | (torch.signbit(v).to(torch.uint8) << 3)


def values(code: torch.Tensor) -> torch.Tensor:
    """The e2m1 values (float32) of 4-bit codes."""
    mag = _grid(code.device)[(code & 7).long()]
    return torch.where((code & 8).bool(), -mag, mag)


def pack(code: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] (n even) as bytes [..., n / 2]: element 2j in the low nibble, 2j + 1 in the high."""
    if code.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {code.shape[-1]}")
    c = code.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n / 2] as codes [..., n]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
