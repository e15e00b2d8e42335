"""Integer weight quantization maths (round-to-nearest grid, per channel or per group).

Conventions match compressed-tensors so stored values dequantize identically everywhere:
q in [qmin, qmax] = [-2^(b-1), 2^(b-1)-1]; w_hat = (q - zero_point) * scale;
symmetric scale = absmax / ((qmax - qmin) / 2) with zero_point 0; asymmetric scale =
(max - min) / (qmax - qmin) over a range widened to contain 0, zero_point = round(qmin - min/scale).
Scales are rounded to their storage dtype *before* quantizing, so the saved checkpoint
reproduces the in-memory model bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.quant.scale_search import search_scale
from quantkit.quant.schemes import QuantScheme


@dataclass
class QuantizedWeight:
    """A quantized linear weight: integer codes plus the parameters that dequantize them."""

    q: torch.Tensor  # [out, in] int8 codes in [qmin, qmax]
    scale: torch.Tensor  # [out, groups] storage dtype
    zero_point: Optional[torch.Tensor]  # [out, groups] int8, None when symmetric
    scheme: QuantScheme

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, self.scheme, dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dequantize()[start:stop]`, computing only those rows (an error sum a slice at a time)."""
        zp = None if self.zero_point is None else self.zero_point[start:stop]
        return dequantize(self.q[start:stop], self.scale[start:stop], zp, self.scheme, dtype)


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    out, inp = w.shape
    size = inp if scheme.strategy == "channel" else scheme.group_size
    if inp % size:
        raise ValueError(f"group_size {size} does not divide in_features {inp}")
    return w.reshape(out, inp // size, size)  # [out, groups, group_size]


def compute_qparams(
    w_min: torch.Tensor, w_max: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scales (rounded to scale_dtype, or to the scheme's own scale dtype) and int8 zero points from
    per-group value ranges."""
    scale_dtype = scheme.scale_torch_dtype(scale_dtype)
    w_min = torch.clamp(w_min.float(), max=0.0)  # 0 must be exactly representable
    w_max = torch.clamp(w_max.float(), min=0.0)
    if scheme.grid is not None:
        return _grid_qparams(w_min, w_max, scheme, scale_dtype)
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


def _grid_qparams(w_min: torch.Tensor, w_max: torch.Tensor, scheme: QuantScheme,
                  scale_dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """ggml's scale rules. q8_0: d = absmax / 127. q4_0: d = (the signed value of largest magnitude) / -8,
    so that value is code -8; as (scale, zero point): d > 0 -> (d, 0), d < 0 -> (-d, -1), i.e. x =
    -d (c + 1) with c = -(q - 8) - 1 in [-8, 7]."""
    tiny = torch.finfo(scale_dtype).tiny
    if scheme.grid == "q8_0":
        scale = torch.maximum(-w_min, w_max) / 127.0
        return torch.where(scale > tiny, scale, torch.ones_like(scale)).to(scale_dtype), None
    negative_extreme = -w_min >= w_max
    scale = torch.where(negative_extreme, -w_min, w_max) / 8.0
    scale = torch.where(scale > tiny, scale, torch.ones_like(scale)).to(scale_dtype)
    zp = torch.where(negative_extreme, 0, -1).to(torch.int8)
    return scale, zp


def searched_grid_qparams(cols: torch.Tensor, importance: torch.Tensor, scheme: QuantScheme,
                          scale_dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GGUF Q4_0 / Q8_0 parameters of one group per output row, chosen by the importance-weighted squared
    error sum_i h_i (x_i - x_hat_i)^2 (h: the inputs' mean square, diag H) among `scale_search`'s
    candidates (ggml's own rule among them); scales are float16 as the file stores them.

    cols: [group, out] (a group's columns), importance: [group]. Q4_0 returns (|d|, zero point 0 for d > 0,
    -1 for d < 0); Q8_0 (|d|, None)."""
    assert scheme.grid in ("q4_0", "q8_0"), "the searched scale is Q4_0's or Q8_0's"
    scale_dtype = scheme.scale_torch_dtype(scale_dtype)
    assert scale_dtype == torch.float16, "GGUF's block scales are float16"
    x = cols.float().t()  # [out, group]
    if scheme.grid == "q8_0":
        d = search_scale(x, importance, scheme.qmin, scheme.qmax, symmetric=True)
        return d.to(scale_dtype), None
    d = search_scale(x, importance, -8, 7)  # x = d c, c in [-8, 7] (ggml: c = q - 8)
    # as (scale, zero point): d > 0 -> (d, 0); d < 0 -> (-d, -1), x = -d (q' + 1) with q' = -c - 1 in [-8, 7]
    return d.abs().to(scale_dtype), torch.where(d > 0, 0, -1).to(torch.int8)


def searched_qparams(w: torch.Tensor, importance: torch.Tensor, scheme: QuantScheme,
                     scale_dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`searched_grid_qparams` of every group of w [out, in] (importance [in]): (scale, zero point) [out, groups]."""
    gs = scheme.group_size
    pairs = [searched_grid_qparams(w[:, g : g + gs].t(), importance[g : g + gs], scheme, scale_dtype)
             for g in range(0, w.shape[1], gs)]
    scale = torch.stack([s for s, _ in pairs], dim=1)
    return scale, (None if pairs[0][1] is None else torch.stack([z for _, z in pairs], dim=1))


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


def dequantize_columns(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], g_idx: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize` where column j belongs to group g_idx[j] (act-order checkpoints): (q - zero_point[:, g]) *
    scale[:, g], computed exactly in float32 and cast once."""
    w = q.float()
    if zero_point is not None:
        w = w - zero_point.float()[:, g_idx]
    return (w * scale.float()[:, g_idx]).to(dtype)


def dequantize_packed4(packed: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                       scheme: QuantScheme, dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """`dequantize` of 4-bit codes straight from their packed int32 words [out, in / 8] (little-endian,
    contiguous, no padding nibbles), or None where that does not apply (the caller unpacks instead).

    The nibbles are written into the working dtype's buffer directly and offset, shifted and scaled in
    place: two passes fewer than unpacking to int8 first (SmolLM2's 1536 x 576 layer in bf16: 0.69 against
    1.40 ms). Same working dtype, hence the same values, as `dequantize`."""
    if scheme.num_bits != 4 or sys.byteorder != "little" or not packed.is_contiguous() or packed.dim() != 2:
        return None
    out, words = packed.shape
    size = words * 8 if scheme.strategy == "channel" else scheme.group_size
    if size is None or (words * 8) % size or scale.shape != (out, words * 8 // size):
        return None
    work = dtype if dtype == scale.dtype and dtype in (torch.bfloat16, torch.float16) else torch.float32
    b = packed.view(torch.uint8)  # [out, in / 2]: element 2j in byte j's low nibble, 2j + 1 in its high one
    u = torch.empty(out, words * 4, 2, dtype=work, device=packed.device)
    u[..., 0] = b & 15
    u[..., 1] = b >> 4
    g = u.view(out, -1, size)  # [out, groups, gs], offset binary u = q + 8
    g.sub_(8)
    if zero_point is not None:
        g.sub_(zero_point.to(work).unsqueeze(-1))
    g.mul_(scale.to(work).unsqueeze(-1))
    return g.view(out, -1).to(dtype)


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
