"""Integer weight quantization maths (round-to-nearest grid, per channel or per group).

Conventions match compressed-tensors so stored values dequantize identically everywhere:
q in [qmin, qmax] = [-2^(b-1), 2^(b-1)-1]; w_hat = (q - zero_point) * scale;
symmetric scale = absmax / ((qmax - qmin) / 2) with zero_point 0; asymmetric scale =
(max - min) / (qmax - qmin) over a range widened to contain 0, zero_point = round(qmin - min/scale).
Scales are rounded to their storage dtype *before* quantizing, so the saved checkpoint
reproduces the in-memory model bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.schemes import QuantScheme


@dataclass
class QuantizedWeight:
    """A quantized linear weight: integer codes plus the parameters that dequantize them."""

    q: torch.Tensor  # [out, in] int8 codes in [qmin, qmax]
    scale: torch.Tensor  # [out, groups] storage dtype
    zero_point: Optional[torch.Tensor]  # [out, groups] int8, None when symmetric
    scheme: QuantScheme

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, self.scheme, dtype)


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    out, inp = w.shape
    size = inp if scheme.strategy == "channel" else scheme.group_size
    if inp % size:
        raise ValueError(f"group_size {size} does not divide in_features {inp}")
    return w.reshape(out, inp // size, size)  # [out, groups, group_size]


def compute_qparams(
    w_min: torch.Tensor, w_max: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scales (rounded to scale_dtype) and int8 zero points from per-group value ranges."""
    w_min = torch.clamp(w_min.float(), max=0.0)  # 0 must be exactly representable
    w_max = torch.clamp(w_max.float(), min=0.0)
    levels = float(scheme.qmax - scheme.qmin)
    if scheme.symmetric:
        scale = torch.maximum(-w_min, w_max) / (levels / 2)
    else:
        scale = (w_max - w_min) / levels
    tiny = torch.finfo(scale_dtype).tiny
    scale = torch.where(scale > tiny, scale, torch.full_like(scale, 1.0)).to(scale_dtype)
    if scheme.symmetric:
        return scale, None
    zp = torch.round(scheme.qmin - w_min / scale.float()).clamp(scheme.qmin, scheme.qmax)
    return scale, zp.to(torch.int8)


def minmax_qparams(
    w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Round-to-nearest parameters from each group's min and max. w: [out, in]."""
    g = _grouped(w.float(), scheme)
    return compute_qparams(g.amin(dim=-1), g.amax(dim=-1), scheme, scale_dtype)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], scheme: QuantScheme
) -> torch.Tensor:
    """Integer codes for w [out, in] under per-group scale/zero_point [out, groups]."""
    g = _grouped(w.float(), scheme)  # [out, groups, gs]
    x = g / scale.float().unsqueeze(-1)  # one float32 working copy, then in place
    if zero_point is not None:
        x.add_(zero_point.float().unsqueeze(-1))
    x.round_().clamp_(scheme.qmin, scheme.qmax)
    return x.to(torch.int8).reshape(w.shape)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    scheme: QuantScheme,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(q - zero_point) * scale, computed exactly in float32 then cast once to dtype.

    When dtype is the 16-bit dtype of the scales, the same values are computed in that dtype
    (half the memory traffic): q - zero_point is a small integer, exact in it, and the product
    of two 16-bit floats is exact in float32, so torch's one rounding of it is the same rounding."""
    work = dtype if dtype == scale.dtype and dtype in (torch.bfloat16, torch.float16) else torch.float32
    g = _grouped(q.to(work), scheme)  # [out, groups, gs]
    if zero_point is not None:
        g = g - zero_point.to(work).unsqueeze(-1)
    return (g * scale.to(work).unsqueeze(-1)).reshape(q.shape).to(dtype)


def rtn(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Round-to-nearest quantization of a weight matrix [out, in]."""
    scale, zp = minmax_qparams(w, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zp, scheme), scale, zp, scheme)


SQNR_CHUNK = 1 << 20  # elements per float64 slice: whole-matrix float64 copies of a 14336 x 4096 weight took ~1.9 GB


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better), in float64 one slice at a time."""
    ref, app = reference.reshape(-1), approx.reshape(-1)
    if ref.device.type == "mps":  # no float64 there
        ref, app = ref.cpu(), app.cpu()
    signal = noise = torch.zeros((), dtype=torch.float64, device=ref.device)
    for start in range(0, ref.numel(), SQNR_CHUNK):
        r = ref[start : start + SQNR_CHUNK].double()
        signal = signal + r.pow(2).sum()
        noise = noise + (r - app[start : start + SQNR_CHUNK].double()).pow(2).sum()
    return float(10 * torch.log10(signal / noise.clamp_min(1e-300)))
