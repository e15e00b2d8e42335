"""ggml's Q4_1, Q5_0, Q4_K and Q6_K grids as quantkit weights: their parameters fitted to weights (ggml's plain rule,
or searched under an importance such as diag(H)), codes on them, and their values in ggml's arithmetic.

Every grid here is affine per sub-block: x = step * c - offset, c an integer in [lo, hi].
- Q4_1: blocks of 32, step = d, offset = -m (fp16 d, m), c = q in [0, 15].
- Q5_0: blocks of 32, step = d (fp16, signed), c = q - 16 in [-16, 15], no offset.
- Q4_K: super-blocks of 256 = 8 sub-blocks of 32, step = d sc_j, offset = dmin m_j (fp16 d, dmin;
  6-bit sc_j, m_j), c = q in [0, 15].
- Q6_K: super-blocks of 256 = 16 sub-blocks of 16, step = d s_j (fp16 d, int8 s_j), c = q - 32 in [-32, 31];
  d = the largest (signed) sub-block scale / -128, as ggml sets it.
A fit is two-level for the K types: d (and dmin) per super-block, then each sub-block's 6- or 8-bit
scale against them, so GPTQ can fix d when it reaches a super-block and each sub-scale when it reaches
that sub-block (`SPAN`, `SUB`). The values `GGMLWeight.dequantize` computes are ggml's `dequantize_row_*`
in float32, bit for bit (a test compares them with gguf-py's dequantizer), and `to_blocks` gives the bytes
a GGUF file holds (`quantkit.quant.ggml_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from quantkit.quant import ggml_blocks
from quantkit.quant.scale_search import search_scale
from quantkit.quant.schemes import QuantScheme

KIND = {"q4_1": "Q4_1", "q5_0": "Q5_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}  # scheme grid -> ggml type (ggml blocks)
SPAN = {"Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}  # columns sharing the top-level parameters
SUB = {"Q4_1": 32, "Q5_0": 32, "Q4_K": 32, "Q6_K": 16}  # columns sharing one step
CODES = {"Q4_1": (0, 15), "Q5_0": (-16, 15), "Q4_K": (0, 15), "Q6_K": (-32, 31)}  # c as the solver sees it
CENTER = {"Q4_1": 0, "Q5_0": 16, "Q4_K": 0, "Q6_K": 32}  # the stored code is c + CENTER
SHRINK = tuple(1.0 - 0.05 * k for k in range(7))  # share of a range's extreme kept by a searched candidate
SHRINK_K = (1.0, 0.9, 0.8, 0.7)  # Q4_K: each end of a sub-block's range, independently
K4_STEPS = tuple(round(-0.9 + 0.05 * k, 2) for k in range(37))  # llama.cpp's Q4_K steps (rmin -0.9, 0.05, 36)
FP16_MAX = torch.finfo(torch.float16).max


def kind_of(scheme: QuantScheme) -> str:
    return KIND[scheme.grid]


def is_block_grid(scheme: Optional[QuantScheme]) -> bool:
    """A grid stored as ggml blocks (not expressible as compressed-tensors int weights)."""
    return scheme is not None and scheme.grid in KIND


@dataclass
class GGMLWeight:
    """One linear's weight on a ggml grid: the codes and parameters a GGUF block holds."""

    kind: str
    q: torch.Tensor  # uint8 [out, in]: ggml's stored codes (Q4_1, Q4_K 0..15, Q5_0 0..31, Q6_K 0..63)
    d: torch.Tensor  # float16 [out, in / SPAN]
    sub: Optional[torch.Tensor]  # Q4_K: sc uint8 [out, in / 32]; Q6_K: int8 [out, in / 16]; else None
    scheme: QuantScheme
    dmin: Optional[torch.Tensor] = None  # Q4_K: float16 [out, in / 256]; Q4_1: its m, float16 [out, in / 32]
    m: Optional[torch.Tensor] = None  # Q4_K: uint8 [out, in / 32]

    def steps(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(step, offset) float32 [out, in / SUB]: x = step * c - offset, exactly as ggml forms them."""
        return _steps(self.kind, self.d, self.sub, self.dmin, self.m)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        step, offset = self.steps()
        out, n = self.q.shape
        c = self.q.float().reshape(out, -1, SUB[self.kind]) - CENTER[self.kind]
        x = step.unsqueeze(-1) * c
        if offset is not None:
            x = x - offset.unsqueeze(-1)
        return x.reshape(out, n).to(dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dequantize()[start:stop]`, computing only those rows."""
        return self.rows(slice(start, stop)).dequantize(dtype)

    def to_blocks(self) -> np.ndarray:
        """The weight as GGUF's bytes, uint8 [out, bytes per row]."""
        q = self.q.cpu().numpy()
        d = self.d.cpu().numpy()
        if self.kind == "Q5_0":
            return ggml_blocks.pack_q5_0(q, d)
        if self.kind == "Q4_1":
            return ggml_blocks.pack_q4_1(q, d, self.dmin.cpu().numpy())
        if self.kind == "Q4_K":
            return ggml_blocks.pack_q4_k(q, self.sub.cpu().numpy(), self.m.cpu().numpy(), d, self.dmin.cpu().numpy())
        return ggml_blocks.pack_q6_k(q, self.sub.cpu().numpy(), d)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, cols: int, scheme: QuantScheme) -> "GGMLWeight":
        kind = kind_of(scheme)
        t = torch.from_numpy
        if kind == "Q5_0":
            q, d = ggml_blocks.unpack_q5_0(raw, cols)
            return cls(kind, t(q), t(d), None, scheme)
        if kind == "Q4_1":
            q, d, m = ggml_blocks.unpack_q4_1(raw, cols)
            return cls(kind, t(q), t(d), None, scheme, t(m))
        if kind == "Q4_K":
            q, sc, m, d, dmin = ggml_blocks.unpack_q4_k(raw, cols)
            return cls(kind, t(q), t(d), t(np.ascontiguousarray(sc)), scheme, t(dmin), t(np.ascontiguousarray(m)))
        q, sub, d = ggml_blocks.unpack_q6_k(raw, cols)
        return cls(kind, t(q), t(d), t(sub), scheme)

    def rows(self, rows: slice) -> "GGMLWeight":
        def cut(v):
            return None if v is None else v[rows].contiguous()

        return GGMLWeight(self.kind, cut(self.q), cut(self.d), cut(self.sub), self.scheme, cut(self.dmin), cut(self.m))

    def all_finite(self) -> bool:
        return bool(torch.isfinite(self.d.float()).all()) and (self.dmin is None or bool(torch.isfinite(self.dmin.float()).all()))


def _steps(kind, d, sub, dmin, m):
    d32 = d.float()
    if kind == "Q5_0":
        return d32, None
    if kind == "Q4_1":
        return d32, -dmin.float()  # x = d q + m
    per = SPAN[kind] // SUB[kind]
    step = d32.repeat_interleave(per, dim=-1) * sub.float()
    if kind == "Q6_K":
        return step, None
    return step, dmin.float().repeat_interleave(per, dim=-1) * m.float()


# -- codes on given steps ---------------------------------------------------------------------------

def codes(kind: str, x: torch.Tensor, step: torch.Tensor, offset: Optional[torch.Tensor]) -> torch.Tensor:
    """c (float, integer-valued, in CODES[kind]) of values x [..., n] on per-row step / offset [...]."""
    s = step.unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    y = x if offset is None else x + offset.unsqueeze(-1)
    lo, hi = CODES[kind]
    return (y / safe).round_().clamp_(lo, hi)


def _error(kind, x, h, step, offset) -> torch.Tensor:
    """sum_i h_i (x_i - x_hat_i)^2 over the last dim, for the candidates' steps [...]."""
    c = codes(kind, x, step, offset)
    xh = c * step.unsqueeze(-1)
    if offset is not None:
        xh = xh - offset.unsqueeze(-1)
    return ((xh - x).pow_(2) * h).sum(dim=-1)


def _fp16(v: torch.Tensor) -> torch.Tensor:
    """v rounded to float16 as ggml stores it (subnormals included), saturating at float16's largest."""
    return v.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def _signed_extreme(x: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)


# -- Q5_0 -----------------------------------------------------------------------------------------

def fit_q5_0(x: torch.Tensor, h: Optional[torch.Tensor]) -> torch.Tensor:
    """d float16 [...] of blocks x [..., 32]. h None: ggml's rule (the signed extreme on code -16); else the
    float16 d (either sign) of least h-weighted error, exactly (`scale_search.search_scale`)."""
    ext = _signed_extreme(x.float())
    if h is None:
        return _fp16(ext / -16.0)
    flat = x.float().reshape(-1, x.shape[-1])
    hf = h.float().expand_as(x).reshape(-1, x.shape[-1])
    return search_scale(flat, hf, -16, 15).reshape(x.shape[:-1]).to(torch.float16)


# -- Q4_1 -----------------------------------------------------------------------------------------

def fit_q4_1(x: torch.Tensor, h: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) float16 [...] of blocks x [..., 32]. h None: ggml's rule (d = (max - min) / 15, m = min); else
    the candidate with the least h-weighted error: each end of the range pulled toward its middle by SHRINK_K."""
    x = x.float()
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    d, m = _fp16((hi - lo) / 15.0), _fp16(lo)
    if h is None:
        return d, m
    best_err = _error("Q4_1", x, h, d.float(), -m.float())
    mid = (lo + hi) / 2
    for a in SHRINK_K:
        for b in SHRINK_K:
            lo_c, hi_c = mid - a * (mid - lo), mid + b * (hi - mid)
            dc, mc = _fp16((hi_c - lo_c) / 15.0), _fp16(lo_c)
            err = _error("Q4_1", x, h, dc.float(), -mc.float())
            better = err < best_err
            d, m = torch.where(better, dc, d), torch.where(better, mc, m)
            best_err = torch.where(better, err, best_err)
    return d, m


# -- Q4_K -----------------------------------------------------------------------------------------

def _k4_candidates(x: torch.Tensor, search: bool, h: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) float32 [..., n] candidates of sub-blocks x [..., 32]: the range [lo, hi] (widened to hold
    0) with each end shrunk by SHRINK_K (only the full range when not searching); x_hat = scale q - min.
    With importance h, also llama.cpp's family (`make_qkx3_quants`): codes at 1 / scale = (15 + r) / (hi - lo)
    for r in `K4_STEPS`, each with the h-weighted least-squares (scale, min) of its codes (min kept >= 0)."""
    lo = x.amin(dim=-1).clamp(max=0.0)
    hi = x.amax(dim=-1).clamp(min=0.0)
    shrink = SHRINK_K if search else (1.0,)
    a = torch.tensor(shrink, device=x.device)
    lo_c = (lo.unsqueeze(-1) * a).unsqueeze(-1)  # [..., n, 1]
    hi_c = (hi.unsqueeze(-1) * a).unsqueeze(-2)  # [..., 1, n]
    scale = ((hi_c - lo_c) / 15.0).flatten(-2)
    mins = (-lo_c).expand_as(hi_c - lo_c).flatten(-2)
    if h is None:
        return scale, mins
    ls_scale, ls_min = _k4_least_squares(x, h, lo, hi)
    return torch.cat([scale, ls_scale], -1), torch.cat([mins, ls_min], -1)


def _k4_least_squares(x, h, lo, hi) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's candidate family for an affine 4-bit sub-block, as (scale, min) [..., len(K4_STEPS)]."""
    r = torch.tensor(K4_STEPS, device=x.device)
    width = (hi - lo).clamp_min(1e-30).unsqueeze(-1)
    inv = (15.0 + r) / width  # [..., k]
    xe = x.unsqueeze(-2)  # [..., 1, 32]
    he = h.expand_as(x).unsqueeze(-2)
    q = ((xe - lo.unsqueeze(-1).unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 15)  # [..., k, 32]
    sw, sx = he.sum(-1), (he * xe).sum(-1)
    sl, sl2, sxl = (he * q).sum(-1), (he * q * q).sum(-1), (he * q * xe).sum(-1)
    det = sw * sl2 - sl * sl
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    scale = (sw * sxl - sx * sl) / safe
    offset = (sl2 * sx - sl * sxl) / safe  # x_hat = scale q + offset
    through_zero = ~ok | (offset > 0)  # ggml's min is <= 0 (and a degenerate fit has none): the scale alone
    scale = torch.where(through_zero, sxl / sl2.clamp_min(1e-30), scale)
    offset = torch.where(through_zero, torch.zeros_like(offset), offset)
    usable = scale > 0
    scale = torch.where(usable, scale, (width / 15.0).expand_as(scale))
    offset = torch.where(usable, offset, lo.unsqueeze(-1).expand_as(offset))
    return scale, -offset


def _best_float_k4(x: torch.Tensor, h: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's best unrounded (scale, min) [...] (the full range when h is None)."""
    scale, mins = _k4_candidates(x, h is not None, h)
    if h is None:
        return scale[..., 0], mins[..., 0]
    xe = x.unsqueeze(-2)  # [..., 1, 32]
    err = _error("Q4_K", xe, h.unsqueeze(-2), scale, mins)  # [..., n]
    pick = err.argmin(dim=-1, keepdim=True)
    return torch.gather(scale, -1, pick).squeeze(-1), torch.gather(mins, -1, pick).squeeze(-1)


def fit_q4_k_super(x: torch.Tensor, h: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, dmin) float16 [...] of super-blocks x [..., 256]: the largest of the sub-blocks' (best) scales and
    minimums over 63."""
    sub = x.float().reshape(*x.shape[:-1], 8, 32)
    hs = None if h is None else h.reshape(*h.shape[:-1], 8, 32)
    scale, mins = _best_float_k4(sub, hs)
    return _fp16(scale.amax(dim=-1) / 63.0), _fp16(mins.amax(dim=-1) / 63.0)


def _six_bits(v: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    r = ref.float()
    return torch.where(r == 0, torch.zeros_like(v), torch.round(v / torch.where(r == 0, torch.ones_like(r), r))).clamp(0, 63)


def fit_q4_k_sub(x: torch.Tensor, h: Optional[torch.Tensor], d: torch.Tensor, dmin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sc, m) uint8 [...] of sub-blocks x [..., 32] against their super-block's d, dmin [...]: the candidates'
    6-bit roundings, then (searching) each +-1, by the h-weighted error on the 6-bit steps."""
    x = x.float()
    d32, dm32 = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
    scale, mins = _k4_candidates(x, h is not None, h)
    sc, m = _six_bits(scale, d32), _six_bits(mins, dm32)  # [..., n]
    if h is None:
        return sc[..., 0].to(torch.uint8), m[..., 0].to(torch.uint8)
    xe, he = x.unsqueeze(-2), h.unsqueeze(-2)

    def best_of(sc, m):
        err = _error("Q4_K", xe, he, d32 * sc, dm32 * m)
        pick = err.argmin(dim=-1, keepdim=True)
        return torch.gather(sc, -1, pick), torch.gather(m, -1, pick)

    sc, m = best_of(sc, m)  # [..., 1]
    step = torch.tensor((-1.0, 0.0, 1.0), device=x.device)
    sc_n = (sc + step.repeat_interleave(3)).clamp(0, 63)
    m_n = (m + step.repeat(3)).clamp(0, 63)
    sc, m = best_of(sc_n, m_n)
    return sc.squeeze(-1).to(torch.uint8), m.squeeze(-1).to(torch.uint8)


# -- Q6_K -----------------------------------------------------------------------------------------

def _best_float_k6(x: torch.Tensor, h: Optional[torch.Tensor]) -> torch.Tensor:
    """Each 16-weight sub-block's best unrounded scale [...]: its signed extreme on code -32 (or, searching,
    on -32 or +31, shrunk by SHRINK, and each candidate's least-squares scale for its own codes, which finds
    the grid's scale again where the weights already sit on a Q6_K grid)."""
    ext = _signed_extreme(x)
    if h is None:
        return ext / -32.0
    cands = torch.stack([ext * f / lv for lv in (-32.0, 31.0) for f in SHRINK], dim=-1)  # [..., n]
    xe, he = x.unsqueeze(-2), h.unsqueeze(-2)
    c = codes("Q6_K", xe, cands, None)  # [..., n, 16]
    hc = he * c
    den = (hc * c).sum(dim=-1)
    ls = torch.where(den > 0, (hc * xe).sum(dim=-1) / torch.where(den > 0, den, torch.ones_like(den)), cands)
    cands = torch.cat([cands, ls], dim=-1)
    err = _error("Q6_K", xe, he, cands, None)
    return torch.gather(cands, -1, err.argmin(dim=-1, keepdim=True)).squeeze(-1)


def fit_q6_k_super(x: torch.Tensor, h: Optional[torch.Tensor]) -> torch.Tensor:
    """d float16 [...] of super-blocks x [..., 256]: ggml's rule, the sub-block scale of largest magnitude
    (signed) over -128, so that sub-block's scale is -128."""
    sub = x.float().reshape(*x.shape[:-1], 16, 16)
    hs = None if h is None else h.reshape(*h.shape[:-1], 16, 16)
    return _fp16(_signed_extreme(_best_float_k6(sub, hs)) / -128.0)


def fit_q6_k_sub(x: torch.Tensor, h: Optional[torch.Tensor], d: torch.Tensor) -> torch.Tensor:
    """s int8 [...] of sub-blocks x [..., 16] against d [...]: the best scale's rounding (searching: +-1 too)."""
    x = x.float()
    d32 = d.float()
    safe = torch.where(d32 == 0, torch.ones_like(d32), d32)
    s = torch.where(d32 == 0, torch.zeros_like(d32), torch.round(_best_float_k6(x, h) / safe)).clamp(-128, 127)
    if h is None:
        return s.to(torch.int8)
    cands = (s.unsqueeze(-1) + torch.tensor((-1.0, 0.0, 1.0), device=x.device)).clamp(-128, 127)
    err = _error("Q6_K", x.unsqueeze(-2), h.unsqueeze(-2), d32.unsqueeze(-1) * cands, None)
    return torch.gather(cands, -1, err.argmin(dim=-1, keepdim=True)).squeeze(-1).to(torch.int8)


# -- a whole matrix ---------------------------------------------------------------------------------

class Fitter:
    """A weight's ggml parameters, filled span by span and sub-block by sub-block (GPTQ's order) or all at
    once (`nearest`). `step_rows` / `offset_rows` [in / SUB, out] hold each sub-block's float32 step and
    offset as soon as it is fitted."""

    def __init__(self, scheme: QuantScheme, out_f: int, in_f: int, device):
        self.kind, self.scheme = kind_of(scheme), scheme
        kind = self.kind
        if in_f % SPAN[kind]:
            raise ValueError(f"{kind}: a row of {in_f} weights is not a whole number of {SPAN[kind]}-weight blocks")
        self.d = torch.zeros(out_f, in_f // SPAN[kind], dtype=torch.float16, device=device)
        nsub = in_f // SUB[kind]
        self.sub = None if kind in ("Q4_1", "Q5_0") else \
            torch.zeros(out_f, nsub, dtype=torch.uint8 if kind == "Q4_K" else torch.int8, device=device)
        self.dmin = torch.zeros_like(self.d) if kind in ("Q4_K", "Q4_1") else None
        self.m = torch.zeros(out_f, nsub, dtype=torch.uint8, device=device) if kind == "Q4_K" else None
        self.step_rows = torch.zeros(nsub, out_f, device=device)
        self.offset_rows = torch.zeros(nsub, out_f, device=device) if kind in ("Q4_K", "Q4_1") else None

    def fit_span(self, j: int, x: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        """The top-level parameters of the span starting at column j; x [out, SPAN] its current weights."""
        b = j // SPAN[self.kind]
        if self.kind == "Q5_0":
            self.d[:, b] = fit_q5_0(x, h)
            self.step_rows[b] = self.d[:, b].float()
        elif self.kind == "Q4_1":
            self.d[:, b], self.dmin[:, b] = fit_q4_1(x, h)
            self.step_rows[b] = self.d[:, b].float()
            self.offset_rows[b] = -self.dmin[:, b].float()
        elif self.kind == "Q4_K":
            self.d[:, b], self.dmin[:, b] = fit_q4_k_super(x, h)
        else:
            self.d[:, b] = fit_q6_k_super(x, h)

    def fit_sub(self, j: int, x: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        """The step of the sub-block starting at column j (K types); x [out, SUB] its current weights."""
        if self.kind in ("Q4_1", "Q5_0"):
            return
        k, b = j // SUB[self.kind], j // SPAN[self.kind]
        d = self.d[:, b]
        if self.kind == "Q4_K":
            sc, m = fit_q4_k_sub(x, h, d, self.dmin[:, b])
            self.sub[:, k], self.m[:, k] = sc, m
            self.offset_rows[k] = self.dmin[:, b].float() * m.float()
        else:
            sc = fit_q6_k_sub(x, h, d)
            self.sub[:, k] = sc
        self.step_rows[k] = d.float() * sc.float()

    def weight(self, c: torch.Tensor) -> GGMLWeight:
        """The result for solver codes c [out, in] (integer-valued, in CODES)."""
        q = (c + CENTER[self.kind]).to(torch.uint8)
        return GGMLWeight(self.kind, q, self.d, self.sub, self.scheme, self.dmin, self.m)


def nearest(w: torch.Tensor, scheme: QuantScheme, importance: Optional[torch.Tensor] = None) -> GGMLWeight:
    """Round-to-nearest onto the grid: ggml's plain parameter rule (importance None), or the searched one
    under per-input-column `importance` [in] (e.g. diag H), with codes rounded to nearest on them."""
    out_f, in_f = w.shape
    fit = Fitter(scheme, out_f, in_f, w.device)
    kind = fit.kind
    x = w.float()
    span, sub = SPAN[kind], SUB[kind]
    h = None if importance is None else importance.float().clamp_min(0.0)
    xs = x.reshape(out_f, -1, span)
    hs = None if h is None else h.reshape(1, -1, span)
    if kind == "Q5_0":
        fit.d.copy_(fit_q5_0(xs, hs))
    elif kind == "Q4_1":
        d, m = fit_q4_1(xs, hs)
        fit.d.copy_(d)
        fit.dmin.copy_(m)
    else:
        per = span // sub
        xsub = x.reshape(out_f, -1, sub)
        hsub = None if h is None else h.reshape(1, -1, sub)
        if kind == "Q4_K":
            d, dmin = fit_q4_k_super(xs, hs)
            fit.d.copy_(d)
            fit.dmin.copy_(dmin)
            sc, m = fit_q4_k_sub(xsub, hsub, d.repeat_interleave(per, dim=1), dmin.repeat_interleave(per, dim=1))
            fit.sub.copy_(sc)
            fit.m.copy_(m)
        else:
            d = fit_q6_k_super(xs, hs)
            fit.d.copy_(d)
            fit.sub.copy_(fit_q6_k_sub(xsub, hsub, d.repeat_interleave(per, dim=1)))
    step, offset = _steps(kind, fit.d, fit.sub, fit.dmin, fit.m)
    c = codes(kind, x.reshape(out_f, -1, sub), step, offset).reshape(out_f, in_f)
    return fit.weight(c)
