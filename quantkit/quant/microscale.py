"""Microscaled float formats: small float elements in short groups of a row, each group with its own scale.

Pure functions of tensors, with compressed-tensors 0.19's rules (what llm-compressor writes and vLLM reads):

- NVFP4 (strategy tensor_group, groups of 16): e2m1 elements; e4m3 group scales under one float32 global
  scale per tensor. global = 448 * 6 / amax(tensor); scale_g = e4m3(global * amax_g / 6), a zero one
  replaced by 0.125 (e4m3's epsilon); element = e2m1(x / (scale_g / global)); value = element * (scale_g /
  global), the division done first, in float32.
- MX (strategy group, groups of 32; MXFP4 e2m1 elements, MXFP8 e4m3 ones): power-of-two scales stored as
  e8m0 bytes (e + 127). amax_g is rounded to a power of two 2^p (up when its mantissa is 1.75 or more),
  e = p - top, top the element format's largest exponent (e2m1: 2, e4m3: 8), clamped to e8m0's range;
  element = round(x / 2^e), saturating (so a group's largest values may clip: amax 1.7 x 2^p gives 6.8 -> 6).

Quantized elements are held as float8_e4m3fn (e2m1 values are exact there; `quant.fp4`). Activations are
quantized with the same rules per group of their last dimension at run time; NVFP4's use a global scale
calibrated on the layer's inputs (compressed-tensors' `input_global_scale`), MX's need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.quant import fp4
from quantkit.quant.fp8 import FP8_DTYPE, FP8_MAX, to_fp8
from quantkit.quant.schemes import QuantScheme

E4M3_EPS = 0.125  # a zero NVFP4 group scale is stored as this (compressed-tensors' rule)
MX_TOP_EXPONENT = {4: 2, 8: 8}  # floor(log2(max)) of e2m1 (6) and e4m3 (448)
E8M0_BIAS = 127


def element_max(bits: int) -> float:
    return fp4.E2M1_MAX if bits == 4 else FP8_MAX


def round_elements(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (already divided by its scale) rounded to the element grid, saturating: e2m1 (4 bits) or e4m3 (8), float32."""
    return fp4.round_e2m1(x) if bits == 4 else to_fp8(x).float()


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., n] seen as [..., n / group, group]."""
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"a row of {n} values does not split into groups of {group}")
    return x.reshape(*x.shape[:-1], n // group, group)


# -- scales ------------------------------------------------------------------------------------------


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 [1]: 448 * 6 / amax (amax of zero or NaN: 1, no global scaling)."""
    a = amax.float().reshape(1).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * fp4.E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)


def nvfp4_group_scales(amax_g: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 group scales from each group's amax under `global_scale` (zeros become 0.125)."""
    s = to_fp8(global_scale.float() * (amax_g.float() / fp4.E2M1_MAX))
    return torch.where(s.float() == 0, torch.full_like(s, E4M3_EPS), s)


def mx_exponents(amax_g: torch.Tensor, bits: int) -> torch.Tensor:
    """e8m0 scale bytes (uint8, biased by 127) from each group's amax, for `bits`-bit elements."""
    raw = amax_g.float().view(torch.int32)
    rounded = (raw + (1 << 21)) & 0x7F800000  # mantissa >= 0.75 of the way to the next power of two: round up
    field = (rounded >> 23).to(torch.int32)  # the biased exponent of the power of two (0 for 0 and subnormals)
    return (field - MX_TOP_EXPONENT[bits]).clamp(0, 254).to(torch.uint8)


def e8m0_values(e: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) of e8m0 bytes (exact: the bits are built, e = 0 is the subnormal 2^-127)."""
    ei = e.to(torch.int32)
    bits = torch.where(ei > 0, ei << 23, torch.full_like(ei, 1 << 22))
    return bits.view(torch.float32)


# -- weights -------------------------------------------------------------------------------------------


@dataclass
class MicroWeight:
    """A weight [out, in] in a microscaled format: elements `q` (float8_e4m3fn), group scales `scale`
    ([out, in / group]: e4m3 for NVFP4, e8m0 bytes for MX), NVFP4's `global_scale` (float32 [1]) and, for
    NVFP4 activations, the inputs' calibrated `input_global_scale`."""

    q: torch.Tensor
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor]
    scheme: QuantScheme
    input_global_scale: Optional[torch.Tensor] = None

    def group_scales(self) -> torch.Tensor:
        """The float32 step of each group [out, in / group]."""
        return effective_scales(self.scale, self.global_scale, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.global_scale, self.scheme, dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q[start:stop], self.scale[start:stop], self.global_scale, self.scheme, dtype)


def effective_scales(scale: torch.Tensor, global_scale: Optional[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    if scheme.strategy == "tensor_group":
        return scale.float() / global_scale.float()
    return e8m0_values(scale)


def dequantize(q: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], scheme: QuantScheme,
               dtype: torch.dtype) -> torch.Tensor:
    """element x group step, in float32, cast to `dtype` once."""
    steps = effective_scales(scale, global_scale, scheme)
    w = grouped(q.float(), scheme.group_size) * steps.unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


def scales_for(w: torch.Tensor, scheme: QuantScheme, global_scale: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The group scales (and NVFP4's global scale: `global_scale`, else w's own) the nearest rounding of w
    [out, in] uses."""
    amax_g = grouped(w.float().abs(), scheme.group_size).amax(dim=-1)
    if scheme.strategy == "tensor_group":
        g = nvfp4_global_scale(amax_g.amax()) if global_scale is None else global_scale
        return nvfp4_group_scales(amax_g, g), g
    return mx_exponents(amax_g, scheme.num_bits), None


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, global_scale: Optional[torch.Tensor] = None) -> MicroWeight:
    """The nearest rounding of w [out, in] onto the scheme's microscaled grid."""
    scale, g = scales_for(w, scheme, global_scale)
    return MicroWeight(quantize_on(w, scale, g, scheme), scale, g, scheme)


SCALE_STEPS = (-2, -1, 0, 1)  # candidate scales: the nearest rule's and its neighbours on the scale grid


def searched_scales(w: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor,
                    global_scale: Optional[torch.Tensor] = None) -> MicroWeight:
    """Like `quantize_weight`, but each group's scale is the one among the nearest rule's and its neighbours on
    the scale grid (e4m3 values for NVFP4, powers of two for MX: SCALE_STEPS) whose nearest rounding has the
    smallest importance-weighted squared error, importance [in] weighing each column (GPTQ: diag(H)). A
    smaller scale clips a group's largest values and refines the rest; a larger one never clips."""
    base, g = scales_for(w, scheme, global_scale)
    wg = grouped(w.float(), scheme.group_size)
    imp = grouped(importance.float().reshape(1, -1), scheme.group_size)
    best_err, best = None, base
    for k in SCALE_STEPS:
        cand = _neighbour(base, k, scheme)
        steps = effective_scales(cand, g, scheme).unsqueeze(-1)
        err = ((round_elements(wg / steps, scheme.num_bits) * steps - wg).square() * imp).sum(-1)
        if best_err is None:
            best_err, best = err, cand
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, cand, best)
    return MicroWeight(quantize_on(w, best, g, scheme), best, g, scheme)


def _neighbour(scale: torch.Tensor, k: int, scheme: QuantScheme) -> torch.Tensor:
    """The scale k steps away on its own grid: e4m3 bit patterns of positive values are ordered (1..126: the
    smallest subnormal to 448), e8m0 bytes are exponents (0..254)."""
    if scheme.strategy == "tensor_group":
        bits = scale.view(torch.uint8).to(torch.int16) + k
        return bits.clamp(1, 126).to(torch.uint8).view(FP8_DTYPE)
    return (scale.to(torch.int16) + k).clamp(0, 254).to(torch.uint8)


def shared_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One NVFP4 global scale for linears that read the same input (q/k/v, gate/up): that of their joint
    amax. vLLM fuses such linears and applies one global scale to the fused weight (llm-compressor makes
    them equal the same way)."""
    return nvfp4_global_scale(torch.stack([w.float().abs().amax() for w in weights]).amax())


def quantize_group(weights: list[torch.Tensor], scheme: QuantScheme) -> list[MicroWeight]:
    """The nearest rounding of linears sharing an input, with a shared global scale for NVFP4."""
    g = shared_global_scale(weights) if scheme.strategy == "tensor_group" else None
    return [quantize_weight(w, scheme, g) for w in weights]


def quantize_on(w: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor],
                scheme: QuantScheme) -> torch.Tensor:
    """Elements (float8_e4m3fn) of w on given scales."""
    steps = effective_scales(scale, global_scale, scheme).unsqueeze(-1)
    q = round_elements(grouped(w.float(), scheme.group_size) / steps, scheme.num_bits)
    return q.reshape(w.shape).to(FP8_DTYPE)


# -- activations ---------------------------------------------------------------------------------------


def fake_quantize_input(x: torch.Tensor, bits: int, group: int, global_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """x quantized per group of its last dimension and dequantized (float32): NVFP4's rule when a global
    scale is given, else MX's."""
    xg = grouped(x.float(), group)
    amax_g = xg.abs().amax(dim=-1)
    if global_scale is not None:
        steps = nvfp4_group_scales(amax_g, global_scale).float() / global_scale.float()
    else:
        steps = e8m0_values(mx_exponents(amax_g, bits))
    steps = steps.unsqueeze(-1)
    return (round_elements(xg / steps, bits) * steps).reshape(x.shape)
