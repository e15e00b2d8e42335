"""ggml block layouts as bytes (numpy, no torch), packed and unpacked: Q8_0, Q4_0 and Q5_0 (blocks of 32
weights along a row), Q4_K and Q6_K (super-blocks of 256); and their values as ggml computes them.

Q8_0: one fp16 d, then 32 int8 codes; x = d q (34 bytes). Q4_0: one fp16 d, then 16 bytes of
nibbles in split-half order (byte j holds element j in its low nibble and element j + 16 in its
high nibble), codes q in 0..15; x = d (q - 8) (18 bytes). Q4_1: fp16 d, fp16 m, nibbles as Q4_0;
x = d q + m (20 bytes). Q6_K: 256 weights in 16 sub-blocks of
16, x = d s_j (q - 32) with q in 0..63, int8 sub-scales s_j and one fp16 d; bytes: 128 of low nibbles
(in each half of 128 weights, byte b holds weight b low and weight b + 64 high), 64 of high bit pairs
(byte b of a half holds weights b, b + 32, b + 64, b + 96 at bits 0, 2, 4, 6), 16 sub-scales, d
(210 bytes). Q5_0: fp16 d, 4 bytes of fifth bits (bit j of a little-endian uint32 for weight j), 16
bytes of nibbles as Q4_0; x = d (q - 16), q in 0..31 (22 bytes). Q4_K: 256 weights in 8 sub-blocks of
32, x = d sc_j q - dmin m_j with q in 0..15 and 6-bit sc_j, m_j; bytes: fp16 d, fp16 dmin, 12 bytes of
sub-scales and sub-minimums (bytes i and 4 + i hold sc_i and m_i in their low 6 bits and the top two bits
of sc_{4+i} / m_{4+i} in their top two; byte 8 + i holds the low nibbles of sc_{4+i} and m_{4+i}), then 128
bytes where byte b of 32-byte chunk c holds sub-block 2c's weight b low and sub-block 2c + 1's high
(144 bytes). Little-endian, as ggml writes them.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
SUPER = 256  # weights per K-quant super-block
TYPE_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 2 + 2 + BLOCK // 2, "Q5_0": 2 + 4 + BLOCK // 2,
              "Q4_K": 2 + 2 + 12 + SUPER // 2, "Q6_K": SUPER // 2 + SUPER // 4 + SUPER // 16 + 2}


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in ggml type `kind` (K-quants: super-blocks of 256; others: 32)."""
    return cols // (SUPER if kind.endswith("_K") else BLOCK) * TYPE_BYTES[kind]


def _blocks(rows: int, cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"a row of {cols} weights is not a whole number of {BLOCK}-weight blocks")
    return cols // BLOCK


def _with_scales(kind: str, d: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[rows, blocks, bytes] output with each 32-block's fp16 d in its first two bytes."""
    n = _blocks(rows, cols)
    out = np.empty((rows, n, TYPE_BYTES[kind]), dtype=np.uint8)
    out[:, :, :2] = np.ascontiguousarray(d, dtype="<f2").reshape(rows, n, 1).view(np.uint8)
    return out


def _split(kind: str, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(d float16 [rows, blocks], the blocks' remaining bytes [rows, blocks, bytes - 2]) of 32-blocks."""
    rows = raw.shape[0]
    n = _blocks(rows, cols)
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, n, TYPE_BYTES[kind])
    return np.ascontiguousarray(b[:, :, :2]).view("<f2").reshape(rows, n), b[:, :, 2:]


def pack_q8_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """codes int8 [rows, cols], d float16 [rows, cols / 32] -> uint8 [rows, cols / 32 * 34]."""
    rows, cols = codes.shape
    out = _with_scales("Q8_0", d, rows, cols)
    out[:, :, 2:] = np.ascontiguousarray(codes, dtype=np.int8).reshape(rows, cols // BLOCK, BLOCK).view(np.uint8)
    return out.reshape(rows, -1)


def unpack_q8_0(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `pack_q8_0`: (codes int8 [rows, cols], d float16 [rows, cols / 32])."""
    d, payload = _split("Q8_0", raw, cols)
    return np.ascontiguousarray(payload).view(np.int8).reshape(raw.shape[0], cols), d


def pack_q4_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q uint8 in 0..15 [rows, cols], d float16 [rows, cols / 32] -> uint8 [rows, cols / 32 * 18]."""
    rows, cols = q.shape
    if q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError("Q4_0 codes must lie in 0..15")
    out = _with_scales("Q4_0", d, rows, cols)
    g = q.astype(np.uint8).reshape(rows, cols // BLOCK, BLOCK)
    out[:, :, 2:] = g[:, :, : BLOCK // 2] | (g[:, :, BLOCK // 2 :] << 4)
    return out.reshape(rows, -1)


def unpack_q4_0(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `pack_q4_0`: (q uint8 in 0..15 [rows, cols], d float16 [rows, cols / 32])."""
    d, nib = _split("Q4_0", raw, cols)
    return np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(raw.shape[0], cols), d


def pack_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q uint8 in 0..15 [rows, cols], d and m float16 [rows, cols / 32] -> uint8 [rows, cols / 32 * 20]."""
    rows, cols = q.shape
    out = _with_scales("Q4_1", d, rows, cols)
    out[:, :, 2:4] = np.ascontiguousarray(m, dtype="<f2").reshape(rows, -1, 1).view(np.uint8)
    g = q.astype(np.uint8).reshape(rows, cols // BLOCK, BLOCK)
    out[:, :, 4:] = g[:, :, : BLOCK // 2] | (g[:, :, BLOCK // 2 :] << 4)
    return out.reshape(rows, -1)


def unpack_q4_1(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of `pack_q4_1`: (q uint8 in 0..15 [rows, cols], d, m float16 [rows, cols / 32])."""
    d, rest = _split("Q4_1", raw, cols)
    m = np.ascontiguousarray(rest[:, :, :2]).view("<f2").reshape(d.shape)
    nib = rest[:, :, 2:]
    return np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(raw.shape[0], cols), d, m


def pack_q6_k(q: np.ndarray, sub_scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q uint8 in 0..63 [rows, cols], sub_scales int8 [rows, cols / 16], d float16 [rows, cols / 256]
    -> uint8 [rows, cols / 256 * 210]."""
    rows, cols = q.shape
    if cols % SUPER:
        raise ValueError(f"a row of {cols} weights is not a whole number of {SUPER}-weight super-blocks")
    n = cols // SUPER
    g = q.astype(np.uint8).reshape(rows, n, 2, 128)  # two halves of 128 weights
    lo, hi = g & 0x0F, g >> 4
    ql = lo[..., :64] | (lo[..., 64:] << 4)  # [rows, n, 2, 64]
    h = hi.reshape(rows, n, 2, 4, 32)
    qh = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)  # [rows, n, 2, 32]
    out = np.empty((rows, n, TYPE_BYTES["Q6_K"]), dtype=np.uint8)
    out[:, :, :128] = ql.reshape(rows, n, 128)
    out[:, :, 128:192] = qh.reshape(rows, n, 64)
    out[:, :, 192:208] = np.ascontiguousarray(sub_scales, dtype=np.int8).reshape(rows, n, 16).view(np.uint8)
    out[:, :, 208:] = np.ascontiguousarray(d, dtype="<f2").reshape(rows, n, 1).view(np.uint8)
    return out.reshape(rows, -1)


def pack_q5_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q uint8 in 0..31 [rows, cols], d float16 [rows, cols / 32] -> uint8 [rows, cols / 32 * 22]."""
    rows, cols = q.shape
    out = _with_scales("Q5_0", d, rows, cols)
    g = q.astype(np.uint32).reshape(rows, cols // BLOCK, BLOCK)
    high = ((g >> 4) & 1) << np.arange(BLOCK, dtype=np.uint32)
    out[:, :, 2:6] = high.sum(axis=-1, dtype=np.uint32).astype("<u4").reshape(rows, -1, 1).view(np.uint8)
    lo = (g & 0x0F).astype(np.uint8)
    out[:, :, 6:] = lo[:, :, : BLOCK // 2] | (lo[:, :, BLOCK // 2 :] << 4)
    return out.reshape(rows, -1)


def pack_q4_k(q: np.ndarray, sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """q uint8 in 0..15 [rows, cols], sc / m uint8 in 0..63 [rows, cols / 32], d / dmin float16
    [rows, cols / 256] -> uint8 [rows, cols / 256 * 144]."""
    rows, cols = q.shape
    if cols % SUPER:
        raise ValueError(f"a row of {cols} weights is not a whole number of {SUPER}-weight super-blocks")
    n = cols // SUPER
    out = np.empty((rows, n, TYPE_BYTES["Q4_K"]), dtype=np.uint8)
    out[:, :, 0:2] = np.ascontiguousarray(d, dtype="<f2").reshape(rows, n, 1).view(np.uint8)
    out[:, :, 2:4] = np.ascontiguousarray(dmin, dtype="<f2").reshape(rows, n, 1).view(np.uint8)
    sc = sc.astype(np.uint8).reshape(rows, n, 8)
    m = m.astype(np.uint8).reshape(rows, n, 8)
    out[:, :, 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[:, :, 8:12] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    out[:, :, 12:16] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    g = q.astype(np.uint8).reshape(rows, n, 4, 2, 32)  # chunk, (low, high) sub-block, weight
    out[:, :, 16:] = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).reshape(rows, n, 128)
    return out.reshape(rows, -1)


def unpack_q5_0(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `pack_q5_0`: (q uint8 in 0..31 [rows, cols], d float16 [rows, cols / 32])."""
    d, rest = _split("Q5_0", raw, cols)
    rows = raw.shape[0]
    high = np.ascontiguousarray(rest[:, :, :4]).view("<u4").reshape(rows, -1, 1)
    bits = ((high >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    nib = rest[:, :, 4:]
    lo = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)
    return (lo | (bits << 4)).reshape(rows, cols), d


def _supers(raw: np.ndarray, kind: str, cols: int) -> np.ndarray:
    if cols % SUPER:
        raise ValueError(f"a row of {cols} weights is not a whole number of {SUPER}-weight super-blocks")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(raw.shape[0], cols // SUPER, TYPE_BYTES[kind])


def unpack_q4_k(raw: np.ndarray, cols: int) -> tuple[np.ndarray, ...]:
    """The inverse of `pack_q4_k`: (q 0..15 [rows, cols], sc, m uint8 0..63 [rows, cols / 32], d, dmin float16
    [rows, cols / 256])."""
    b = _supers(raw, "Q4_K", cols)
    rows, n = b.shape[:2]
    d = np.ascontiguousarray(b[:, :, 0:2]).view("<f2").reshape(rows, n)
    dmin = np.ascontiguousarray(b[:, :, 2:4]).view("<f2").reshape(rows, n)
    s = b[:, :, 4:16]
    sc = np.concatenate([s[..., 0:4] & 0x3F, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 0x3F, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[:, :, 16:].reshape(rows, n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    return q, sc.reshape(rows, -1), m.reshape(rows, -1), d, dmin


def unpack_q6_k(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of `pack_q6_k`: (q 0..63 [rows, cols], sub-scales int8 [rows, cols / 16], d float16
    [rows, cols / 256])."""
    b = _supers(raw, "Q6_K", cols)
    rows, n = b.shape[:2]
    ql = b[:, :, :128].reshape(rows, n, 2, 64)
    qh = b[:, :, 128:192].reshape(rows, n, 2, 32)
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [rows, n, 2, 128]
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    q = (lo | (hi << 4)).reshape(rows, cols)
    sub = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).reshape(rows, n * 16)
    d = np.ascontiguousarray(b[:, :, 208:]).view("<f2").reshape(rows, n)
    return q, sub, d


def dequantize(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """float32 [rows, cols] values of ggml blocks, in ggml's own arithmetic (float32, as
    `dequantize_row_*` computes them): Q8_0 d q, Q4_0 d (q - 8), Q4_1 d q + m, Q5_0 d (q - 16), Q4_K (d sc) q - dmin m,
    Q6_K (d s) (q - 32)."""
    rows = raw.shape[0]
    if kind == "Q4_1":
        q, d, m = unpack_q4_1(raw, cols)
        g = q.reshape(rows, -1, BLOCK).astype(np.float32) * d.astype(np.float32)[:, :, None]
        return (g + m.astype(np.float32)[:, :, None]).reshape(rows, cols)
    if kind in ("Q8_0", "Q4_0", "Q5_0"):
        if kind == "Q8_0":
            codes, d = unpack_q8_0(raw, cols)
            vals = codes.astype(np.float32)
        elif kind == "Q4_0":
            q, d = unpack_q4_0(raw, cols)
            vals = q.astype(np.float32) - 8.0
        else:
            q, d = unpack_q5_0(raw, cols)
            vals = q.astype(np.float32) - 16.0
        return (vals.reshape(rows, -1, BLOCK) * d.astype(np.float32)[:, :, None]).reshape(rows, cols)
    if kind == "Q4_K":
        q, sc, m, d, dmin = unpack_q4_k(raw, cols)
        step = (np.repeat(d.astype(np.float32), 8, axis=1) * sc.astype(np.float32))[:, :, None]
        off = (np.repeat(dmin.astype(np.float32), 8, axis=1) * m.astype(np.float32))[:, :, None]
        return (step * q.reshape(rows, -1, BLOCK).astype(np.float32) - off).reshape(rows, cols)
    if kind == "Q6_K":
        q, sub, d = unpack_q6_k(raw, cols)
        step = (np.repeat(d.astype(np.float32), 16, axis=1) * sub.astype(np.float32))[:, :, None]
        return (step * (q.reshape(rows, -1, 16).astype(np.float32) - 32.0)).reshape(rows, cols)
    raise ValueError(f"no block layout for {kind}")
