"""Exact maps between quantkit's int weights (codes, scale, zero point; compressed-tensors' convention
x = (c - z) s) and ggml's Q4_0 / Q8_0 blocks (x = d (q - 8), x = d q), and Q4_1 (x = d q + m) for any zero point.

Q4_0 is asymmetric int4 group 32 with fp16 scales and zero points in {0, -1}: z = 0 is d = s,
q = c + 8; z = -1 is d = -s, q = 7 - c (x = s (c + 1) = -s (q - 8)). Symmetric int4 group 32 is
Q4_0 with d = s. Q8_0 is symmetric int8 group 32 with d = s. Every map here is exact in both
directions, or refuses: a weight that is not on a ggml grid is never rounded again silently.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from quantkit.errors import CheckpointError
from quantkit.quant.schemes import QuantScheme

GROUP = 32


def ggml_type_of(scheme: QuantScheme) -> Optional[str]:
    """The ggml type an int scheme's weights are stored in exactly, or None (given fp16-exact scales and,
    for asymmetric int4, zero points in {0, -1}: `q4_0_blocks` checks those per tensor)."""
    if scheme.type != "int" or scheme.strategy != "group" or scheme.group_size != GROUP:
        return None  # (act-order "static" keeps each group's columns in place: no g_idx, the same blocks)
    if scheme.num_bits == 8 and scheme.symmetric:
        return "Q8_0"
    if scheme.num_bits == 4:
        return "Q4_0"
    return None


def fp16_scale(scale: torch.Tensor, what: str) -> np.ndarray:
    """The scales as float16, refusing any that float16 does not hold exactly."""
    s16 = scale.to(torch.float16)
    if not bool(torch.isfinite(s16).all()) or not torch.equal(s16.to(scale.dtype), scale):
        raise CheckpointError(f"{what}: its scales are not all exact in float16 (stored as {scale.dtype}); GGUF holds "
                         "fp16 scales: quantize with a GGUF recipe (gptq-q4_0, gptq-q8_0) to get them")
    return s16.numpy()


def q4_0_blocks(codes: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                what: str) -> tuple[np.ndarray, np.ndarray]:
    """(q uint8 0..15 [out, in], d float16 [out, in / 32]) of int4 group-32 codes in [-8, 7]."""
    s = fp16_scale(scale, what)
    c = codes.to(torch.int16).numpy().reshape(codes.shape[0], -1, GROUP)
    if zero_point is None:
        return (c + 8).astype(np.uint8).reshape(codes.shape), s
    z = zero_point.to(torch.int16).numpy()
    if not np.isin(z, (0, -1)).all():
        raise CheckpointError(f"{what}: zero points other than 0 and -1 are not on the Q4_0 grid (x = d (q - 8)); "
                         "quantize with recipe gptq-q4_0 or awq-q4_0")
    neg = (z == -1)[:, :, None]
    q = np.where(neg, 7 - c, c + 8).astype(np.uint8).reshape(codes.shape)
    d = np.where(z == -1, -s, s).astype(np.float16)
    return q, d


def q4_1_weight(codes: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], what: str):
    """Asymmetric int4 group-32 weights as Q4_1 blocks (x = d q + m: q = c + 8, d = s, m = -s (z + 8)), a GGMLWeight;
    refused where a d or an m is not exact in float16 (then x = d q + m, summed in float32 as ggml does, is exactly
    (c - z) s: both terms are exact and so is their sum's true value)."""
    from quantkit.quant.ggml import GGMLWeight
    from quantkit.quant.schemes import PRESETS

    d = torch.from_numpy(fp16_scale(scale, what))
    z = torch.zeros_like(scale, dtype=torch.int16) if zero_point is None else zero_point.to(torch.int16)
    m = -(z.float() + 8) * scale.float()
    m16 = m.to(torch.float16)
    if not torch.equal(m16.float(), m):
        bad = int((m16.float() != m).sum())
        raise CheckpointError(f"{what}: {bad} block minimum(s) -s (z + 8) are not exact in float16, which Q4_1 stores")
    q = (codes.to(torch.int16) + 8).to(torch.uint8)
    return GGMLWeight("Q4_1", q, d, None, QuantScheme(**PRESETS["Q4_1"]), dmin=m16)


def int_from_q4_0(q: np.ndarray, d: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse: (codes int8 [-8, 7], fp16 scale >= 0, int8 zero point in {0, -1}) for Q4_0 blocks."""
    neg = np.signbit(d)
    g = q.astype(np.int16).reshape(q.shape[0], -1, GROUP)
    c = np.where(neg[:, :, None], 7 - g, g - 8).astype(np.int8).reshape(q.shape)
    return (torch.from_numpy(c), torch.from_numpy(np.abs(d).astype(np.float16)),
            torch.from_numpy(np.where(neg, -1, 0).astype(np.int8)))


def q8_0_blocks(codes: torch.Tensor, scale: torch.Tensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [out, in], d float16 [out, in / 32]) of symmetric int8 group-32 weights."""
    return codes.to(torch.int8).numpy(), fp16_scale(scale, what)


def nearest_q6_k(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest onto Q6_K (for tensors no algorithm calibrates: embeddings, the output matrix).
    Each sub-block of 16 gets the scale that puts its signed extreme on code -32; d = max |scale| / 127
    (fp16); sub-scales round to int8 against d; codes round against d * s_j. Returns (q 0..63, s_j, d)."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // 16, 16)
    amax_i = x.abs().argmax(dim=-1, keepdim=True)
    extreme = torch.gather(x, -1, amax_i).squeeze(-1)  # [rows, subs]
    sub = extreme / -32.0
    sup = sub.reshape(rows, cols // 256, 16)
    d = (sup.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [rows, supers]
    d32 = d.float().clamp_min(torch.finfo(torch.float16).tiny)
    sc = torch.round(sup / d32.unsqueeze(-1)).clamp(-128, 127)  # [rows, supers, 16]
    step = (d.float().unsqueeze(-1) * sc).reshape(rows, cols // 16, 1)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    q = torch.round(x / safe).clamp(-32, 31)
    q = torch.where(step == 0, torch.zeros_like(q), q)
    return ((q + 32).to(torch.uint8).reshape(rows, cols).numpy(), sc.to(torch.int8).reshape(rows, -1).numpy(),
            d.numpy())


def nearest_q5_0(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest onto Q5_0 (ggml's rule: d = the block's signed extreme / -16). Returns (q 0..31, d)."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // GROUP, GROUP)
    extreme = torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = (extreme / -16.0).to(torch.float16)
    d32 = d.float().unsqueeze(-1)
    safe = torch.where(d32 == 0, torch.ones_like(d32), d32)
    q = torch.where(d32 == 0, torch.zeros_like(x), torch.round(x / safe)).clamp(-16, 15) + 16
    return q.to(torch.uint8).reshape(rows, cols).numpy(), d.numpy()


def nearest_q4_k(w: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Round-to-nearest onto Q4_K: each 32-weight sub-block's min/max range (widened to hold 0) gives a
    scale (max - min) / 15 and a minimum -min; d, dmin = their largest / 63 (fp16); sub-scales and
    sub-minimums round to 6 bits against them; codes round against d sc_j with offset dmin m_j.
    Returns (q 0..15, sc, m, d, dmin)."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // 256, 8, 32)
    lo = x.amin(dim=-1).clamp(max=0.0)
    hi = x.amax(dim=-1).clamp(min=0.0)
    scale, mins = (hi - lo) / 15.0, -lo  # [rows, supers, 8]
    d = (scale.amax(dim=-1) / 63.0).to(torch.float16)
    dmin = (mins.amax(dim=-1) / 63.0).to(torch.float16)

    def six_bits(v, ref):
        r = ref.float().unsqueeze(-1)
        return torch.where(r == 0, torch.zeros_like(v), torch.round(v / torch.where(r == 0, torch.ones_like(r), r)))\
            .clamp(0, 63)

    sc, m = six_bits(scale, d), six_bits(mins, dmin)
    step = (d.float().unsqueeze(-1) * sc).unsqueeze(-1)
    offset = (dmin.float().unsqueeze(-1) * m).unsqueeze(-1)
    q = torch.where(step == 0, torch.zeros_like(x), torch.round((x + offset) / torch.where(step == 0, 1.0, step)))
    q = q.clamp(0, 15)
    return (q.to(torch.uint8).reshape(rows, cols).numpy(), sc.to(torch.uint8).reshape(rows, -1).numpy(),
            m.to(torch.uint8).reshape(rows, -1).numpy(), d.numpy(), dmin.numpy())
