"""Importance-weighted scale search for one-scale blocks (GGUF's Q4_0 and Q8_0): x ~ d c, c an integer in
[qmin, qmax], one d per block, chosen to minimise sum_i h_i (x_i - d c_i)^2 with c = round(x / d) clamped.

h is the inputs' mean square (diag of the calibration Hessian), the weight llama.cpp's importance matrix
gives each column. Per block, all blocks at once:
- Q4_0 (either sign of d): the exact float16 optimum over every d (`sweep`): no float16 scale, so none of
  llama.cpp's `make_qx_quants` candidates (the extreme on -(8 + 0.1 k), k in -9..9, each with the
  least-squares d of its codes) nor ggml's plain rule, has a smaller error;
- Q8_0 (d > 0, 256 codes: an exact sweep would be 16x the events): every float16 d that puts the block's
  |extreme| on a target code between qmax - 4 and qmax + 1 (`WINDOW`), ggml's rule, then the winner's
  least-squares d and its float16 neighbours.
Errors are measured with the float16 d the file stores and the nearest codes at it. Pure maths; no model here.
"""

from __future__ import annotations

import torch

WINDOW = (-4, 1)  # 8-bit grids: |extreme| on target codes qmax - 4 .. qmax + 1, every float16 d between
WINDOW_STEPS = 84  # float16 values from the window's low end: a ratio of 128 / 123 spans at most 84 (10-bit mantissa)
TINY16, F16_MAX = float(torch.finfo(torch.float16).tiny), float(torch.finfo(torch.float16).max)
ROWS = 512  # blocks searched at once (bounds the [rows, candidates, n] working set)


def block_error(x: torch.Tensor, h: torch.Tensor, d: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """sum_i h_i (x_i - d c_i)^2 per candidate, c the nearest code at d. x [R, n], h [n] or [R, n],
    d [R, k] (float32, nonzero) -> [R, k]."""
    xe = x.unsqueeze(1)  # [R, 1, n]
    de = d.unsqueeze(-1)  # [R, k, 1]
    c = (xe / de).round_().clamp_(qmin, qmax)
    r = c.mul_(de).sub_(xe).pow_(2)
    return (r * (h.unsqueeze(-2) if h.dim() == 2 else h)).sum(-1)


def least_squares(x: torch.Tensor, h: torch.Tensor, d: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """The least-squares d [R, k] of the codes each candidate d [R, k] gives (d itself where they are all 0)."""
    xe = x.unsqueeze(1)
    c = (xe / d.unsqueeze(-1)).round_().clamp_(qmin, qmax)
    hw = h.unsqueeze(-2) if h.dim() == 2 else h
    num = (c * xe * hw).sum(-1)
    den = (c * c * hw).sum(-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), d)


def _fp16(d: torch.Tensor, tiny: float) -> torch.Tensor:
    """d as float16 stores it, back in float32; magnitudes below `tiny` (and zeros) become +-tiny."""
    m = torch.finfo(torch.float16).max
    d16 = d.clamp(-m, m).to(torch.float16).float()
    sign = torch.where(d16 < 0, -1.0, 1.0)
    return torch.where(d16.abs() < tiny, sign * tiny, d16)


def _fp16_bracket(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float16 values just below and just above each u > 0 (both u where it is one), in float32,
    within float16's normal range."""
    u16 = u.clamp(TINY16, F16_MAX).to(torch.float16)
    bits = u16.view(torch.int16).to(torch.int32)
    up = u16.to(u.dtype) > u
    down = u16.to(u.dtype) < u
    lower = torch.where(up, bits - 1, bits).clamp(0x0400, 0x7BFF)
    upper = torch.where(down, bits + 1, bits).clamp(0x0400, 0x7BFF)
    return tuple(b.to(torch.int16).view(torch.float16).to(u.dtype) for b in (lower, upper))


def _neighbours(d: torch.Tensor) -> torch.Tensor:
    """d [R] (float16 values) and its float16 neighbours at 1 and 2 units in the last place: [R, 5]."""
    bits = d.to(torch.float16).view(torch.int16).to(torch.int32)
    steps = torch.tensor((-2, -1, 0, 1, 2), dtype=torch.int32, device=d.device)
    near = (bits.unsqueeze(-1) + steps).clamp(-32767, 32767)  # int16 view: sign-magnitude ordering per sign
    sign_kept = (near >= 0) == (bits.unsqueeze(-1) >= 0)
    near = torch.where(sign_kept, near, bits.unsqueeze(-1))
    out = near.to(torch.int16).view(torch.float16).float()
    return torch.where(torch.isfinite(out), out, d.unsqueeze(-1))


def window(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Every float16 d > 0 [R, WINDOW_STEPS] that puts the blocks' |extreme| on a target code in qmax + WINDOW
    (past the window's top end: its top value repeated)."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(float(torch.finfo(torch.float16).tiny))
    lo, hi = amax / (qmax + WINDOW[1]), amax / (qmax + WINDOW[0])
    bits = lo.clamp(max=torch.finfo(torch.float16).max).to(torch.float16).view(torch.int16).to(torch.int32)
    steps = torch.arange(WINDOW_STEPS, dtype=torch.int32, device=x.device)
    d = (bits + steps).clamp(max=0x7BFF).to(torch.int16).view(torch.float16).float()  # 0x7BFF: float16's largest
    top = hi.to(torch.float16).float()
    return torch.minimum(d, top)


def sweep(x: torch.Tensor, h: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best float16 d [R] of blocks x [R, n] over both signs, exactly, and a bound on its error minus
    sum h x^2 [R] (the error of the codes of the interval that chose it; its own nearest codes do no worse).

    Write d = sign * u, u > 0. As 1/u grows, each code c_i = round(x_i / d) steps by one in magnitude at
    1/u = (k + 0.5) / |x_i| (k = 0, 1, ... up to the clamp of its side), so A = sum h x c sign and
    B = sum h c^2 are cumulative sums over those events in order, and between two events the codes are
    fixed and E(u) = S - 2 u A + u^2 B is a parabola whose least value in the interval is at A / B
    clamped to it. The two signs share every event but the one past code qmax - 1 (only the side
    with the longer range, -qmin > qmax, has it), so one sort serves both. The float16 d nearest an
    interval's optimum on each side are the only ones that interval can prefer (a parabola), so the
    least parabola value over those two per interval is the float16 optimum: every float16 d at once."""
    R, n = x.shape
    L = max(qmax, -qmin)
    ax = x.abs()
    k = torch.arange(L, dtype=x.dtype, device=x.device)
    _, idx = ((k + 0.5) / ax.unsqueeze(-1)).reshape(R, n * L).sort(dim=-1)  # events by 1/u (float32 order)
    # the sums in float64: E - S = u (u B - 2 A) cancels against S when the error is small
    i = idx // L
    kk = (idx - i * L).double()
    last = kk == L - 1  # events past qmax - 1 exist only on the long side
    ax64, h64 = ax.double(), h.double().expand(R, n)
    s = (kk + 0.5) / ax64.gather(-1, i)
    dA = (h64 * ax64).gather(-1, i)
    dB = h64.gather(-1, i).mul_(kk.mul(2).add_(1))
    pos = x.gather(-1, i) > 0
    u_hi = s.reciprocal()
    u_lo = torch.cat([u_hi[:, 1:], torch.zeros_like(u_hi[:, :1])], -1)
    best_e, best_d = None, None
    for sign in (1.0, -1.0):
        # sign * x > 0 reaches code qmax (short side when -qmin > qmax): its last event does not happen
        keep = ~(last & (pos if sign > 0 else ~pos)) if -qmin > qmax else torch.ones_like(last)
        A = torch.where(keep, dA, 0.0).cumsum(-1)
        B = torch.where(keep, dB, 0.0).cumsum(-1)
        u = torch.minimum(torch.maximum(A / B, u_lo), u_hi)
        for v in _fp16_bracket(u):  # the float16 values on either side of each interval's optimum
            E = (v * B - 2 * A).mul_(v)  # the interval's parabola at v (>= the error at v with its own codes)
            E.masked_fill_(~(B > 0) | ~torch.isfinite(E), float("inf"))
            e, j = E.min(-1)
            d = sign * v.gather(-1, j.unsqueeze(-1)).squeeze(-1).float()
            if best_e is None:
                best_e, best_d = e, d
            else:
                better = e < best_e
                best_e, best_d = torch.where(better, e, best_e), torch.where(better, d, best_d)
    return best_d, best_e.float()


def search_scale(x: torch.Tensor, h: torch.Tensor, qmin: int, qmax: int, symmetric: bool = False) -> torch.Tensor:
    """The searched d (float32 holding a float16 value) [R] of blocks x [R, n] under importance h [n] or [R, n].

    symmetric: d > 0 (a grid whose stored scale has no sign); else d takes either sign (Q4_0: the extreme
    on code -8 or on +7). An all-zero block gets d = the smallest normal float16 (its codes are 0)."""
    x = x.float()
    h = h.float().clamp_min(0.0)
    out = torch.empty(x.shape[0], device=x.device)
    for r in range(0, x.shape[0], ROWS):
        hr = h[r : r + ROWS] if h.dim() == 2 else h
        out[r : r + ROWS] = _search_rows(x[r : r + ROWS], hr, qmin, qmax, symmetric)
    return out


def _search_rows(x: torch.Tensor, h: torch.Tensor, qmin: int, qmax: int, symmetric: bool) -> torch.Tensor:
    ext = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    if not symmetric:  # exact over every float16 d; ggml's rule beside it costs one evaluation
        plain = _fp16(ext / qmin, TINY16)
        return _pick(x, h, torch.cat([plain, sweep(x, h, qmin, qmax)[0].unsqueeze(-1)], -1), qmin, qmax)
    plain = _fp16(ext.abs() / qmax, TINY16)
    best = _pick(x, h, torch.cat([plain, _fp16(window(x, qmax), TINY16)], dim=-1), qmin, qmax)
    polish = _fp16(least_squares(x, h, best.unsqueeze(-1), qmin, qmax), TINY16)
    cand = _fp16(torch.cat([_neighbours(best), polish], dim=-1), TINY16).abs().clamp_min(TINY16)
    return _pick(x, h, cand, qmin, qmax)


def _pick(x, h, cand, qmin, qmax) -> torch.Tensor:
    err = block_error(x, h, cand, qmin, qmax)
    return torch.gather(cand, -1, err.argmin(-1, keepdim=True)).squeeze(-1)
