"""The AutoGPTQ / GPTQModel and AutoAWQ (GEMM) tensor layouts, to and from quantkit's integer codes.

Pure maths, no files. quantkit's codes are compressed-tensors' (`quant.intq`): q in [-2^(b-1), 2^(b-1) - 1],
w = (q - zero_point) * scale, zero points in the same range. The two foreign layouts store unsigned codes
u = q + 2^(b-1) in [0, 2^b) and define w = (u - z) * s, so z = zero_point + 2^(b-1).

GPTQ (`quant_method: gptq`): `qweight` int32 [in * b / 32, out], the codes of W^T packed along the input
dim as one dense little-endian bit stream (element i at stream bits b*i .. b*i+b-1; 3-bit elements straddle
words, 32 of them fill 3 words); `qzeros` int32 [groups, out * b / 32], packed the same way along the output
dim; `scales` [groups, out]; `g_idx` int32 [in], the group of each input column (act-order: not sorted).
Format v1 (`checkpoint_format: gptq`, AutoGPTQ's) stores z - 1 (so z = 0 cannot be written: it wraps to
2^b - 1, read back as 2^b); v2 (`gptq_v2`, GPTQModel's) stores z.

AWQ GEMM (`quant_method: awq`, `version: gemm`, 4 bits): `qweight` int32 [in, out / 8], each word holding 8
output columns of one input row with nibble k carrying column 8c + AWQ_ORDER[k]; `qzeros` int32
[groups, out / 8] interleaved the same way; `scales` [groups, out]. Groups are contiguous runs of inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.quant.packing import pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds column AWQ_ORDER[k] of its 8
GPTQ_BITS = (2, 3, 4, 8)


@dataclass
class IntCodes:
    """One linear's weight in quantkit's convention: codes [out, in] int8, scale [out, groups], zero_point
    [out, groups] int8 (None: symmetric, i.e. every z = 2^(b-1)), g_idx [in] int32 (None: contiguous groups)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: Optional[torch.Tensor]
    g_idx: Optional[torch.Tensor]
    num_bits: int


class LayoutError(ValueError):
    """Values a layout cannot hold (the message says which and why)."""


def _unsigned_to_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def _zeros_to_codes(z: torch.Tensor, bits: int, version: int) -> torch.Tensor:
    """Stored zero points (unsigned, as unpacked) to quantkit's signed zero points."""
    z = z.to(torch.int16) + (1 if version == 1 else 0)
    if int(z.max()) > (1 << bits) - 1:
        bad = int((z > (1 << bits) - 1).sum())
        raise LayoutError(f"{bad} zero point(s) stored as {(1 << bits) - 1}, which GPTQ v1 reads as {1 << bits}: a "
                          f"grid no {bits}-bit zero point holds (v1's wrap-around of a zero of 0)")
    return (z - (1 << (bits - 1))).to(torch.int8)


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx is the contiguous layout (column j in group j // group_size)."""
    expected = torch.arange(g_idx.numel(), dtype=torch.int64) // group_size
    return bool(torch.equal(g_idx.to(torch.int64).cpu(), expected))


def gptq_to_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                  bits: int, group_size: int, version: int) -> IntCodes:
    """A GPTQ linear's tensors as quantkit codes (g_idx kept only where it is not the contiguous layout; zero
    points dropped where every one is the midpoint 2^(b-1), i.e. a symmetric grid)."""
    if bits not in GPTQ_BITS:
        raise LayoutError(f"bits {bits}: GPTQ layouts are read for {GPTQ_BITS} bits")
    inp = qweight.shape[0] * 32 // bits
    q = unpack_int32(qweight.t().contiguous(), bits, inp, dim=1)  # offset binary: u - 2^(b-1)
    return IntCodes(q, scales.t().contiguous(), gptq_zero_points(qzeros, bits, scales.shape[1], version),
                    gptq_groups(g_idx, group_size, inp), bits)


def gptq_zero_points(qzeros: torch.Tensor, bits: int, out: int, version: int) -> Optional[torch.Tensor]:
    """GPTQ's stored zeros [groups, out * b / 32] as quantkit zero points [out, groups] (None: all the midpoint,
    a symmetric grid)."""
    z = unpack_int32(qzeros, bits, out, dim=1).to(torch.int16) + (1 << (bits - 1))  # unsigned as stored
    zp = _zeros_to_codes(z, bits, version).t().contiguous()
    return None if bool((zp == 0).all()) else zp


def gptq_groups(g_idx: Optional[torch.Tensor], group_size: int, inp: int) -> Optional[torch.Tensor]:
    """GPTQ's g_idx as int32, or None where it is the contiguous layout of whole groups (or absent). A layout
    whose last group is short (group_size not dividing the inputs) keeps it, made if absent."""
    size = group_size if group_size > 0 else inp
    if inp % size:
        return (torch.arange(inp, dtype=torch.int32) // size) if g_idx is None else g_idx.to(torch.int32).contiguous()
    if g_idx is None or trivial_g_idx(g_idx, size):
        return None
    return g_idx.to(torch.int32).contiguous()


def codes_to_gptq(codes: IntCodes, version: int) -> dict[str, torch.Tensor]:
    """quantkit codes as a GPTQ linear's qweight / qzeros / scales / g_idx (v1 refuses a zero of 0, which it
    cannot store)."""
    bits = codes.num_bits
    if bits not in GPTQ_BITS:
        raise LayoutError(f"{bits}-bit codes: GPTQ layouts hold {GPTQ_BITS} bits")
    out, inp = codes.q.shape
    groups = codes.scale.shape[1]
    zp = codes.zero_point if codes.zero_point is not None else torch.zeros(out, groups, dtype=torch.int8)
    z = zp.to(torch.int16).t() + (1 << (bits - 1))  # [groups, out] unsigned
    if version == 1:
        if bool((z == 0).any()):
            raise LayoutError(f"{int((z == 0).sum())} zero point(s) are 0, which GPTQ v1 cannot store (it writes "
                              "z - 1); write checkpoint_format gptq_v2 instead")
        z = z - 1
    qweight = pack_int32(codes.q, bits, dim=1).t().contiguous()
    qzeros = pack_int32(_unsigned_to_codes(z, bits), bits, dim=1)
    g_idx = codes.g_idx if codes.g_idx is not None else torch.arange(inp, dtype=torch.int32) // (inp // groups)
    return {"qweight": qweight, "qzeros": qzeros, "scales": codes.scale.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def _awq_unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n / 8] AWQ words -> [rows, n] unsigned nibbles in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 15  # [rows, words, 8]: nibble k = column AWQ_ORDER[k]
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return nibbles[:, :, inverse].reshape(words.shape[0], n).to(torch.uint8)


def _awq_pack(u: torch.Tensor) -> torch.Tensor:
    """[rows, n] unsigned nibbles -> [rows, n / 8] AWQ words."""
    rows, n = u.shape
    if n % 8:
        raise LayoutError(f"AWQ packs 8 output columns per word; {n} is not a multiple of 8")
    v = u.to(torch.int32).reshape(rows, n // 8, 8)[:, :, list(AWQ_ORDER)]
    words = torch.zeros(rows, n // 8, dtype=torch.int32, device=u.device)
    for k in range(8):  # the top nibble wraps into the sign bit, as int32 does
        words |= v[:, :, k] << (4 * k)
    return words


def awq_to_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> IntCodes:
    """An AWQ GEMM linear's tensors as quantkit 4-bit codes (zero points dropped only where all are 8)."""
    u = _awq_unpack(qweight, scales.shape[1])  # [in, out]
    return IntCodes(_unsigned_to_codes(u, 4).t().contiguous(), scales.t().contiguous(),
                    awq_zero_points(qzeros, scales.shape[1]), None, 4)


def awq_zero_points(qzeros: torch.Tensor, out: int) -> Optional[torch.Tensor]:
    """AWQ's stored zeros [groups, out / 8] as quantkit zero points [out, groups] (None: all 8, symmetric)."""
    zp = _unsigned_to_codes(_awq_unpack(qzeros, out), 4).t().contiguous()
    return None if bool((zp == 0).all()) else zp


def codes_to_awq(codes: IntCodes) -> dict[str, torch.Tensor]:
    """quantkit 4-bit codes (contiguous groups) as an AWQ GEMM linear's qweight / qzeros / scales."""
    if codes.num_bits != 4:
        raise LayoutError(f"{codes.num_bits}-bit codes: AWQ GEMM holds 4 bits only")
    if codes.g_idx is not None:
        raise LayoutError("act-order groups (a g_idx): AWQ has no g_idx; export gptq instead")
    out = codes.q.shape[0]
    zp = codes.zero_point if codes.zero_point is not None else torch.zeros(out, codes.scale.shape[1], dtype=torch.int8)
    u = (codes.q.t().to(torch.int16) + 8).to(torch.uint8)
    z = (zp.t().to(torch.int16) + 8).to(torch.uint8)
    return {"qweight": _awq_pack(u), "qzeros": _awq_pack(z), "scales": codes.scale.t().contiguous()}
