"""Bit packing of integer codes into int32 words, in compressed-tensors' `pack-quantized` layout.

Codes q in [-2^(b-1), 2^(b-1)-1] are stored offset-binary (q + 2^(b-1)); along the packed
dimension, element i of each run of 32/b elements sits at bits b*i .. b*i+b-1 of its word.
Weights pack along the input dim (dim 1), zero points along the output dim (dim 0).
"""

from __future__ import annotations

import math
import sys

import torch

SUPPORTED_BITS = (2, 4, 8)  # widths that divide 32, so no value straddles two words


def packed_size(n: int, num_bits: int) -> int:
    return math.ceil(n * num_bits / 32)


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Pack int8 codes of a 2-D tensor into int32 along `dim` (tail padding bits are zero).

    Works in 1-byte codes and one int32 word array (no int64 copies: an 8B model's MLP weight is 59M
    codes, and int64 temporaries of it took over 1 GB)."""
    assert q.dtype == torch.int8 and q.ndim == 2, f"expected 2-D int8 codes, got {q.dtype} {tuple(q.shape)}"
    assert num_bits in SUPPORTED_BITS, f"packing supports {SUPPORTED_BITS} bits, not {num_bits}"
    per_word = 32 // num_bits
    u = (q.to(torch.int16) + (1 << (num_bits - 1))).to(torch.uint8)  # offset binary, in [0, 2^b)
    if dim == 0:
        u = u.t()
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
