"""Bit packing of integer codes into int32 words, in compressed-tensors' `pack-quantized` layout.

Codes q in [-2^(b-1), 2^(b-1)-1] are stored offset-binary (q + 2^(b-1)) as one dense bit stream
along the packed dimension: element i sits at stream bits b*i .. b*i+b-1, stream bit k at bit k % 32
of word k // 32. For b = 2, 4, 8 no element straddles two words (element i of each run of 32/b is at
bits b*i of its word); for 3, 5, 6, 7 some do, their low bits at the top of one word and the rest at
the bottom of the next (compressed-tensors' `pack_to_int32`). Weights pack along the input dim
(dim 1), zero points along the output dim (dim 0).
"""

from __future__ import annotations

import math
import sys

import torch

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
_WHOLE_WORD_BITS = (2, 4, 8)  # widths that divide 32, so no value straddles two words
_ROW_CHUNK = 4096  # rows per step of the straddling path (its int64 temporaries stay small)


def packed_size(n: int, num_bits: int) -> int:
    return math.ceil(n * num_bits / 32)


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Pack int8 codes of a 2-D tensor into int32 along `dim` (tail padding bits are zero).

    Works in 1-byte codes and one int32 word array (no int64 copies: an 8B model's MLP weight is 59M
    codes, and int64 temporaries of it took over 1 GB)."""
    assert q.dtype == torch.int8 and q.ndim == 2, f"expected 2-D int8 codes, got {q.dtype} {tuple(q.shape)}"
    assert num_bits in SUPPORTED_BITS, f"packing supports {SUPPORTED_BITS} bits, not {num_bits}"
    u = (q.to(torch.int16) + (1 << (num_bits - 1))).to(torch.uint8)  # offset binary, in [0, 2^b)
    if dim == 0:
        u = u.t()
    if num_bits not in _WHOLE_WORD_BITS:
        packed = torch.cat([_pack_straddling(c, num_bits) for c in u.split(_ROW_CHUNK)])
        return packed.t().contiguous() if dim == 0 else packed.contiguous()
    per_word = 32 // num_bits
    rows, cols = u.shape
    words = packed_size(cols, num_bits)
    u = torch.nn.functional.pad(u, (0, words * per_word - cols))  # padding bits are 0, as compressed-tensors writes
    u = u.reshape(rows, words, per_word)  # [rows, words, per_word]
    if num_bits == 4 and sys.byteorder == "little":  # byte j of a word: elements 2j (low nibble) and 2j + 1
        packed = (u[:, :, 0::2] | (u[:, :, 1::2] << 4)).contiguous().view(torch.int32).reshape(rows, words)
    else:
        packed = torch.zeros(rows, words, dtype=torch.int32, device=q.device)
        for i in range(per_word):  # bits b*i .. b*i+b-1; the top field wraps into the sign bit, as int32 does
            packed |= u[:, :, i].to(torch.int32) << (num_bits * i)
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: int8 codes with `n` elements along `dim`."""
    assert packed.dtype == torch.int32 and packed.ndim == 2, "expected 2-D int32 words"
    assert num_bits in SUPPORTED_BITS, f"packing supports {SUPPORTED_BITS} bits, not {num_bits}"
    if num_bits not in _WHOLE_WORD_BITS:
        p = packed.t() if dim == 0 else packed
        q = torch.cat([_unpack_straddling(c, num_bits, n) for c in p.split(_ROW_CHUNK)])
        return q.t().contiguous() if dim == 0 else q.contiguous()
    per_word = 32 // num_bits
    if num_bits == 4 and dim == 1 and sys.byteorder == "little" and packed.is_contiguous():
        # little-endian words: element 2j is the low nibble of byte j, 2j + 1 the high one (1-byte ops)
        b = packed.view(torch.uint8)
        u = torch.stack([b & 15, b >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :n]
        return (u.to(torch.int8) - 8).contiguous()
    p = packed.t() if dim == 0 else packed
    shifts = torch.arange(per_word, dtype=torch.int32, device=p.device) * num_bits
    u = (p.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [rows, words, per_word]
    u = u.reshape(p.shape[0], -1)[:, :n]
    q = (u - (1 << (num_bits - 1))).to(torch.int8)
    return q.t().contiguous() if dim == 0 else q.contiguous()


def _stream_positions(num_bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the 32 elements of one run (which fill exactly num_bits words): each one's word and bit offset."""
    start = torch.arange(32, device=device, dtype=torch.int64) * num_bits
    return start // 32, start % 32


def _pack_straddling(u: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Dense packing of offset-binary codes u [rows, cols] (uint8) for widths that do not divide 32."""
    rows, cols = u.shape
    runs = math.ceil(cols / 32)
    v = torch.nn.functional.pad(u, (0, runs * 32 - cols)).to(torch.int64).reshape(rows, runs, 32)
    word, offset = _stream_positions(num_bits, u.device)
    out = torch.zeros(rows, runs, num_bits + 1, dtype=torch.int64, device=u.device)  # one spare word for the overflow
    out.index_add_(2, word, (v << offset) & 0xFFFFFFFF)  # fields do not overlap: adding is or-ing
    out.index_add_(2, word + 1, v >> (32 - offset))  # the bits that did not fit (0 where none)
    words = out[:, :, :num_bits].reshape(rows, runs * num_bits)[:, :packed_size(cols, num_bits)]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unpack_straddling(packed: torch.Tensor, num_bits: int, n: int) -> torch.Tensor:
    """Inverse of `_pack_straddling`: int8 codes [rows, n]."""
    rows = packed.shape[0]
    runs = math.ceil(n / 32)
    w = torch.nn.functional.pad(packed.to(torch.int64) & 0xFFFFFFFF, (0, runs * num_bits + 1 - packed.shape[1]))
    word, offset = _stream_positions(num_bits, packed.device)
    base = (torch.arange(runs, device=packed.device) * num_bits)[:, None] + word[None, :]  # [runs, 32]
    low, high = w[:, base], w[:, base + 1]
    u = ((low >> offset) | (high << (32 - offset))) & ((1 << num_bits) - 1)
    return (u.reshape(rows, runs * 32)[:, :n] - (1 << (num_bits - 1))).to(torch.int8)
