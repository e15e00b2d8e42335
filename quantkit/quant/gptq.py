"""GPTQ solver (Frantar et al., 2022): quantize W column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian H = 2/n sum x x^T.

Pure functions of (W, H, scheme): no modules, no hooks. Symbols follow the paper: W, H, Hinv, Q.
The grid is an int scheme's (`gptq_quantize`: scales min/max per group, fixed up front or as each
group is reached), e4m3 on given scales (`gptq_quantize_fp8`: the scales of the nearest
rounding, fixed up front; each column is rounded to nearest e4m3 of w / s, saturating), or one of
ggml's block grids (`gptq_quantize_ggml`: Q5_0, Q4_K, Q6_K; each super-block's d as it is reached,
each sub-block's scale as its first column is reached, from the error-compensated weights).
"""

from __future__ import annotations

import math
from typing import Optional
from dataclasses import dataclass

import torch

from quantkit.quant import fp4, ggml
from quantkit.quant.fp8 import FP8_DTYPE, FP8_MAX
from quantkit.quant.intq import (QuantizedWeight, compute_qparams, minmax_qparams, searched_grid_qparams,
                                 searched_qparams)
from quantkit.quant.schemes import QuantScheme


class HessianError(ArithmeticError):
    """The damped Hessian is not positive definite (Cholesky failed or produced inf/NaN)."""


ERROR_ELEMENTS = 1 << 22  # rows of W per slice of the error sums: this many elements (temporaries of 16 MB each)
ERROR_BLOCK = 1024  # columns per block of `hessian_error`'s upper triangle (at least; n / 8 for wide H)


@dataclass
class SolveError:
    """GPTQ's objective as the solver met it, tallied for free. With U the solver's upper factor
    (U^T U = (H + damp I)^-1) and e_j = (w_j - q_j) / U_jj its scaled error at column j (w_j as
    compensated by then), the weights' error is W - W_hat = e U row by row, so under the damped Hessian
    tr((W - W_hat)(H + damp I)(W - W_hat)^T) = |e|^2 exactly (U (H + damp I) U^T = I); the undamped
    error is that less damp |W - W_hat|^2 over the live columns. A dead column (H zero there) counts nothing in
    H, but the solver saw it as a zero weight of Hessian 1 + damp, which a grid without an exact zero (Q4_K's
    offsets) rounds to some W_hat: that (1 + damp) |W_hat|^2 comes off too. This saves the report a product
    with H per linear (an 8B down_proj's: 6 s)."""

    damped_rows: torch.Tensor  # float64 [out]: sum of e^2 over the columns, per row of the (stacked) weight
    damp: float  # added to diag(H) by the solve
    dead: torch.Tensor  # bool [in]: columns no input reached (H zero there; the solver zeroed them)

    def hessian_error(self, W: torch.Tensor, W_hat, rows: slice = slice(None)) -> float:
        """tr((W - W_hat) H (W - W_hat)^T) for these rows of the solved weight (W: the original rows, W_hat: the
        result, dequantized or quantized (see `_differences`)), equal to `hessian_error(W, W_hat, H)` up to
        float rounding."""
        live = dead = 0.0
        any_dead = bool(self.dead.any())
        for D, W_hat_r in _differences(W, W_hat):
            if any_dead:
                D[:, self.dead] = 0.0  # H counts nothing there
                dead += float(W_hat_r[:, self.dead].square().sum(dtype=torch.float64))  # the solver's error there
            live += float(torch.dot(D.view(-1), D.view(-1)))
        return float(self.damped_rows[rows].sum()) - self.damp * live - (1.0 + self.damp) * dead


@dataclass
class GPTQResult:
    weight: "QuantizedWeight | torch.Tensor | ggml.GGMLWeight"  # int grid; e4m3 codes [out, in]; a ggml grid
    dead_columns: int  # input columns that never saw a non-zero activation
    error: SolveError


def hessian_error(W: torch.Tensor, W_hat, H: torch.Tensor) -> float:
    """tr((W - W_hat) H (W - W_hat)^T): the layer-output error GPTQ minimises (up to a constant). W_hat: the
    dequantized weight, or a quantized one, dequantized a slice of rows at a time (`_differences`).

    H is symmetric, so only its upper triangle is multiplied, a block of columns at a time: with D = W - W_hat,
    the trace is the sum over column blocks a of D_a H_aa D_a^T + 2 D_a H_a,>a D_>a^T, about half the
    multiply-adds of (D H) * D (an 8B down_proj, 4096 x 14336, back to back: 4.2 against 5.7 s)."""
    H = H.float()
    out_f, n = W.shape
    block = max(ERROR_BLOCK, n // 8)
    step = min(_error_rows(n), out_f)
    # buffers reused for every slice and block (temporaries made afresh, under glibc's mmap threshold, were left
    # scattered in the heap: +110 MB resident at an 8B layer's peak)
    P_buf, M_buf = (torch.empty(step * n, dtype=torch.float32, device=W.device) for _ in range(2))
    total = 0.0
    for D, _ in _differences(W, W_hat):  # [k, in]
        k = D.shape[0]
        for j in range(0, n, block):
            e = min(j + block, n)
            # this block's rows of the upper triangle
            P = torch.mm(D[:, j:e], H[j:e, j:], out=P_buf[: k * (n - j)].view(k, n - j))
            total += float(torch.mul(P[:, : e - j], D[:, j:e], out=M_buf[: k * (e - j)].view(k, e - j)).sum())
            if e < n:
                total += 2.0 * float(torch.mul(P[:, e - j :], D[:, e:], out=M_buf[: k * (n - e)].view(k, n - e)).sum())
    return total


def _differences(W: torch.Tensor, W_hat):
    """(D, W_hat rows) for successive slices of rows, D = W - W_hat float32 [k, in] in one reused buffer
    (valid until the next slice). W_hat: a dense tensor, or a quantized weight whose rows are dequantized
    a slice at a time (`dequantize_rows`), so that a whole float32 copy (and dequantization's two or three
    whole-size temporaries: an 8B down_proj's 235 MB each, at the layer's memory peak) is never made."""
    out_f, n = W.shape
    step = min(_error_rows(n), out_f)
    buf = torch.empty(step * n, dtype=torch.float32, device=W.device)
    for r in range(0, out_f, step):
        k = min(step, out_f - r)
        rows = W_hat[r : r + k].float() if isinstance(W_hat, torch.Tensor) else W_hat.dequantize_rows(r, r + k)
        yield torch.sub(W[r : r + k].float(), rows, out=buf[: k * n].view(k, n)), rows


def _error_rows(n: int) -> int:
    """Rows per slice of the error sums for rows of n columns (an 8B down_proj's 14336: 292 rows; 1024 rows
    made 430 MB of temporaries, and the layer's peak)."""
    return max(1, ERROR_ELEMENTS // n)


def _solve_error(row_error: torch.Tensor, diag: torch.Tensor, perm: torch.Tensor, dampening_frac: float,
                 dead: torch.Tensor) -> SolveError:
    """The solve's `SolveError`: its damping as `inverse_hessian_factor` adds it (the mean of diag(H), dead
    entries 1, in the solver's order)."""
    return SolveError(row_error, float(dampening_frac * torch.mean(diag[perm])), dead)


def activation_target(W: torch.Tensor, H_q: torch.Tensor, D: torch.Tensor, dampening_frac: float) -> torch.Tensor:
    """The weight W' whose GPTQ on H_q minimises sum ||W x - W_hat q(x)||^2, the layer's error when its kernel
    multiplies quantized activations q(x) instead of x (asymmetric calibration, as in GPTAQ): with H_q = 2/n sum
    q(x) q(x)^T and C = 2/n sum x q(x)^T, that sum is ||(W' - W_hat) q(x)||^2 + const for W' H_q = W C.
    Given D = C - H_q = 2/n sum (x - q(x)) q(x)^T (summed directly: the difference of two near-equal sums would
    lose its digits), returned as W + W D (H_q + damp I)^-1 (float32), so that W' = W where q is the identity
    (damp = dampening_frac * mean diag(H_q), as the solve adds). W: [out, in]."""
    Hd = H_q.float().clone()
    Hd.diagonal().add_(dampening_frac * torch.mean(Hd.diagonal()))
    W = W.float()
    correction = torch.linalg.solve(Hd, D.float().t() @ W.t()).t()  # W D Hd^-1 (Hd symmetric)
    return W + correction


def inverse_hessian_factor(H: torch.Tensor, dampening_frac: float, perm: Optional[torch.Tensor] = None,
                           dead: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1 (U^T U = (H + damp I)^-1), damp = dampening_frac * mean(diag H).

    One factorization and one triangular inverse: with J the order-reversing permutation and
    J (H + damp I) J = L L^T, U = J L^-1 J is upper triangular and U^T U = J L^-T L^-1 J = (H + damp I)^-1.
    (About twice as fast as inverting and factorizing again.)

    perm: factor the permuted Hessian H[perm][:, perm] instead; dead: columns never reached by an input,
    whose (zero) diagonal entries count as 1. H itself is left as it is. Memory: one reversed (and
    permuted) copy of H, factorized, inverted and reversed in place: n^2 floats beyond H, plus
    [n, 256] panels (there were about 7 n^2). H may also be a row source (`shape`, `rows(start, stop)`,
    `diagonal()`, as `quantkit.platform.parking.Parked`): then the copy is the only n^2 floats in memory.
    """
    n = H.shape[0]
    if not isinstance(H, torch.Tensor):  # a row source (`quantkit.platform.parking.Parked`): the copy filled by row blocks
        Hf = _reversed_copy(H, perm)
    elif perm is None:
        Hf = H.detach().float().flip(0, 1)  # J H J: the one copy of H made here
    else:
        rp = perm.flip(0)
        Hf = H.detach().float()[rp[:, None], rp[None, :]]  # J P H P^T J in one copy
    if dead is not None:
        Hf.diagonal()[(dead if perm is None else dead[perm]).flip(0)] = 1.0
    Hf.diagonal().add_(dampening_frac * torch.mean(Hf.diagonal().flip(0)))  # the mean in the solver's order
    # L in place: LAPACK works column-major, and the column-major view of the symmetric Hf is Hf itself;
    # its upper factor U0 (U0^T U0 = Hf) read row-major is L. (A row-major out= costs a hidden n^2 copy.)
    info = torch.empty((), dtype=torch.int32, device=Hf.device)
    torch.linalg.cholesky_ex(Hf.mT, upper=True, out=(Hf.mT, info))
    U = Hf
    if info.item() != 0:
        raise HessianError(f"Cholesky of the damped Hessian failed at column {n - info.item()}")
    _invert_lower_in_place(U)  # L^-1
    _reverse_in_place(U)  # J L^-1 J
    if not all_finite(U):
        raise HessianError("the inverse Hessian factor is not finite")
    return U


INVERT_BLOCK = 256  # columns per block of the in-place triangular inverse
COPY_ROWS = 512  # rows per block read from a row source into the solver's copy


def _reversed_copy(H, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """J P H P^T J (perm None: J H J) as one new float32 matrix, from a row source read a block of rows at a
    time: row i of H lands at the position of i in the reversed order, its columns in that order."""
    n = H.shape[0]
    block = H.rows(0, min(COPY_ROWS, n)).float()
    rp = (torch.arange(n, device=block.device) if perm is None else perm.to(block.device)).flip(0)
    pos = torch.empty_like(rp)
    pos[rp] = torch.arange(n, device=rp.device)  # where each row of H goes
    Hf = torch.empty(n, n, dtype=torch.float32, device=block.device)
    for r in range(0, n, COPY_ROWS):
        if r:
            block = H.rows(r, min(r + COPY_ROWS, n)).float()
        Hf.index_copy_(0, pos[r : r + block.shape[0]], block[:, rp])
    return Hf


def _invert_lower_in_place(A: torch.Tensor, block: int = INVERT_BLOCK) -> None:
    """A (lower triangular, zeros above) := A^-1, block column by block column from the last (LAPACK's
    trtri order): each block column below the diagonal becomes -inv(A22) A21 inv(A11) from the trailing
    part already inverted, then the diagonal block is inverted. Temporaries: one [n, block] panel."""
    n = A.shape[0]
    for j in range(((n - 1) // block) * block, -1, -block):
        e = min(j + block, n)
        diag = A[j:e, j:e]
        if e < n:
            panel = A[e:, e:] @ A[e:, j:e]  # inv(A22) A21 (the trailing part is lower triangular: zeros above)
            A[e:, j:e] = torch.linalg.solve_triangular(diag, panel, upper=False, left=False).neg_()
        eye = torch.eye(e - j, dtype=A.dtype, device=A.device)
        diag.copy_(torch.linalg.solve_triangular(diag, eye, upper=False))


def _reverse_in_place(A: torch.Tensor, block: int = INVERT_BLOCK) -> None:
    """A := J A J (both orders reversed: A[i, j] <- A[n-1-i, n-1-j]), swapping row blocks from the two ends."""
    n = A.shape[0]
    top, bottom = 0, n
    while bottom - top >= 2 * block:
        upper = A[top : top + block].flip(0, 1)  # copies
        A[top : top + block] = A[bottom - block : bottom].flip(0, 1)
        A[bottom - block : bottom] = upper
        top, bottom = top + block, bottom - block
    if bottom > top:  # the middle rows: reverse them among themselves
        A[top:bottom] = A[top:bottom].flip(0, 1)


def all_finite(t: torch.Tensor, rows: int = 1024) -> bool:
    """torch.isfinite(t).all(), a slice of rows at a time (on a whole n x n matrix isfinite's
    temporaries peak at ~1.75 times the matrix)."""
    return all(bool(torch.isfinite(t[r : r + rows]).all()) for r in range(0, t.shape[0], rows))


def gptq_quantize(
    W: "torch.Tensor | list[torch.Tensor]",
    H: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
    overwrite: bool = False,
    scale_search: bool = False,
) -> GPTQResult:
    """Quantize W [out, in] given the input Hessian H [in, in] (float32).

    Without act-order, group scales are computed as their first column is reached, from the
    error-compensated weights. With act-order, columns are visited by decreasing diag(H), and
    scales are fixed beforehand per contiguous group of the original order ("static" groups),
    so the checkpoint needs no g_idx. overwrite: W (float32) may serve as the working copy.
    scale_search (GGUF Q4_0 / Q8_0 grids): each group's scale is `searched_grid_qparams`'s, of least
    diag(H)-weighted error, instead of ggml's plain rule: on the compensated weights as the group is
    reached, or with act-order on the original weights before the solve.

    W may be a list of weights sharing the input (stacked on the output dim, as one matrix): the working
    copy is then filled from them, already in visiting order, so no unpermuted stack is ever made.
    """
    if scale_search and scheme.grid not in ("q4_0", "q8_0"):
        raise ValueError("scale_search is for the Q4_0 and Q8_0 grids")
    W, diag, dead, perm, scale, zp = _working_copy(W, H, scheme, scale_dtype, actorder, overwrite, scale_search)
    out_f, n = W.shape
    static = actorder or scheme.strategy == "channel"
    if not static:
        groups = scheme.group_count(n)
        scale = torch.empty(out_f, groups, dtype=scheme.scale_torch_dtype(scale_dtype), device=W.device)
        zp = None if scheme.symmetric else torch.empty(out_f, groups, dtype=torch.int8, device=W.device)
    Hinv = inverse_hessian_factor(H, dampening_frac, perm if actorder else None, dead)
    gsize = n if scheme.strategy == "channel" else scheme.group_size
    if not static:  # keep groups inside one lazy block so their columns are up to date
        block_size = math.ceil(block_size / gsize) * gsize
    round_column = _int_rounder(scheme, scale_dtype, scale, zp, static, (perm // gsize).tolist(), gsize,
                                diag if scale_search else None, out_f, n, W.device)
    Qt, row_error = _solve_columns(W, Hinv, block_size, round_column, torch.int8)
    del W, Hinv  # the working copy and the factor go before the codes are reordered (this was GPTQ's peak)
    Q = _codes_in_order(Qt, perm if actorder else None)  # [out, in] int8 in the original column order
    return GPTQResult(QuantizedWeight(Q, scale, zp, scheme), int(dead.sum()),
                      _solve_error(row_error, diag, perm, dampening_frac, dead))


def _working_copy(W, H: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, actorder: bool,
                  overwrite: bool, scale_search: bool = False):
    """(the float32 working copy in visiting order, diag(H), dead columns, the visiting order, and the
    scales / zero points fixed beforehand where they are static, else None) for one weight or a list
    sharing the input."""
    if isinstance(W, (list, tuple)):
        return _stack_permuted(W, H, scheme, scale_dtype, actorder, scale_search)
    W, diag, dead = _prepare(W, H, overwrite)
    static = actorder or scheme.strategy == "channel"
    scale, zp = _static_qparams(W, diag, scheme, scale_dtype, scale_search) if static else (None, None)
    perm = _order(diag, actorder)
    if actorder:
        W = W[:, perm]
    return W, diag, dead, perm, scale, zp


def _int_rounder(scheme: QuantScheme, scale_dtype: torch.dtype, scale: torch.Tensor, zp, static: bool,
                 group_of: list[int], gsize: int, diag: Optional[torch.Tensor], out_f: int, n: int,
                 device: torch.device):
    """The solve's column rounding onto the int grid: round_column(j, W1, i, q, deq) writes column j's codes
    into q and its dequantized values into deq; a group's scales are made (into `scale` / `zp`) as its first
    column is reached unless `static`. diag: diag(H), for the Q4_0 / Q8_0 scale search (None: ggml's plain rule)."""
    if static:  # each group's scales (and zero points) as one float32 row: [groups, out]
        s_rows = scale.float().t().contiguous()
        z_rows = zp.float().t().contiguous() if zp is not None else None
    else:  # filled group by group, as each group's first column is reached
        s_rows = torch.empty(scheme.group_count(n), out_f, device=device)
        z_rows = None if zp is None else torch.zeros_like(s_rows)

    def round_column(j: int, W1: torch.Tensor, i: int, q: torch.Tensor, deq: torch.Tensor) -> None:
        g = group_of[j]
        if not static and j % gsize == 0:
            _group_qparams(W1[i : i + gsize], g, scheme, scale_dtype, scale, zp, s_rows[g],
                           None if z_rows is None else z_rows[g], None if diag is None else diag[j : j + gsize])
        w, s = W1[i], s_rows[g]
        torch.div(w, s, out=q)
        if scheme.symmetric:
            q.round_().clamp_(scheme.qmin, scheme.qmax)
            torch.mul(q, s, out=deq)
        else:
            z = z_rows[g]
            q.add_(z).round_().clamp_(scheme.qmin, scheme.qmax)
            torch.sub(q, z, out=deq).mul_(s)

    return round_column


def gptq_quantize_fp8(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
    overwrite: bool = False,
    columns_per_scale: int = 1,
    element_bits: int = 8,
) -> GPTQResult:
    """e4m3 codes [out, in] of W [out, in] on fixed scales (`GPTQResult`: with the count of dead columns and
    the solve's error tally). `scale` [out, ceil(in / columns_per_scale)] scales column c by
    scale[:, c // columns_per_scale]: a per-element [out, in] scale as it stands, or the compact form of a
    tensor's, channel's or block's (`quant.fp8.column_scales`), which never expands to W's shape (an 8B
    gate/up pair's: 470 MB).

    Dequantized value = code x scale, as in `quantkit.quant.fp8`. The scales stay those given (the
    nearest rounding's), so the codes can replace the nearest codes in the same checkpoint layout.
    element_bits 4: the elements are e2m1 (NVFP4, MXFP4: `quant.fp4`), returned as e4m3 holding them exactly.
    """
    W, diag, dead = _prepare(W, H, overwrite)
    out_f, n = W.shape
    if scale.shape != (out_f, -(-n // columns_per_scale)):
        raise ValueError(f"scale must be [out, in / columns_per_scale] = [{out_f}, {-(-n // columns_per_scale)}] "
                         f"for a weight of {tuple(W.shape)}, got {tuple(scale.shape)}")
    perm = _order(diag, actorder)
    if actorder:
        W = W[:, perm]
    Hinv = inverse_hessian_factor(H, dampening_frac, perm if actorder else None, dead)
    s_groups = scale.float().t().contiguous()  # [groups, out]
    group_of = (perm // columns_per_scale).tolist()  # each (permuted) column's scale group

    def round_column(j: int, W1: torch.Tensor, i: int, q: torch.Tensor, deq: torch.Tensor) -> None:
        s = s_groups[group_of[j]]
        torch.div(W1[i], s, out=q)
        if element_bits == 4:
            q.copy_(fp4.round_e2m1(q))  # nearest e2m1, saturating at 6
        else:
            q.copy_(q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))  # nearest e4m3, saturating (exact in float32)
        torch.mul(q, s, out=deq)

    Qt, row_error = _solve_columns(W, Hinv, block_size, round_column, FP8_DTYPE)
    del W, Hinv
    codes = _codes_in_order(Qt, perm if actorder else None).view(FP8_DTYPE)  # [out, in], original column order
    return GPTQResult(codes, int(dead.sum()), _solve_error(row_error, diag, perm, dampening_frac, dead))


def gptq_quantize_ggml(
    W: "torch.Tensor | list[torch.Tensor]",
    H: torch.Tensor,
    scheme: QuantScheme,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    overwrite: bool = False,
    scale_search: bool = True,
) -> tuple[ggml.GGMLWeight, int]:
    """W [out, in] (or weights sharing the input, stacked) on a ggml block grid (`quantkit.quant.ggml`), and
    the count of dead columns. Left to right (no act-order: the grid's blocks are contiguous). When the
    solver reaches a super-block (256 columns; Q5_0: a block of 32) its d (and dmin) are fitted to its
    current, error-compensated weights; when it reaches a sub-block, that sub-block's scale (and minimum)
    against them; GPTQ then picks each code on those steps. scale_search: fits weigh each column's error
    by diag(H) among searched candidates (`ggml.fit_*`); else ggml's plain rule."""
    if isinstance(W, (list, tuple)):
        W, diag, dead, _, _, _ = _stack_permuted(W, H, scheme, torch.float16, False)
    else:
        W, diag, dead = _prepare(W, H, overwrite)
    out_f, n = W.shape
    fit = ggml.Fitter(scheme, out_f, n, W.device)
    kind = fit.kind
    span, sub = ggml.SPAN[kind], ggml.SUB[kind]
    lo, hi = ggml.CODES[kind]
    Hinv = inverse_hessian_factor(H, dampening_frac, None, dead)
    block_size = math.ceil(block_size / span) * span  # a span's columns are all in one lazy block
    importance = diag if scale_search else None

    def h_of(j: int, width: int) -> Optional[torch.Tensor]:
        return None if importance is None else importance[j : j + width]

    def round_column(j: int, W1: torch.Tensor, i: int, q: torch.Tensor, deq: torch.Tensor) -> None:
        if j % span == 0:
            fit.fit_span(j, W1[i : i + span].t(), h_of(j, span))
        k = j // sub
        if j % sub == 0:
            fit.fit_sub(j, W1[i : i + sub].t(), h_of(j, sub))
        s = fit.step_rows[k]
        w = W1[i]
        if fit.offset_rows is not None:
            off = fit.offset_rows[k]
            torch.add(w, off, out=q)
        else:
            off = None
            q.copy_(w)
        q.div_(torch.where(s == 0, torch.ones_like(s), s)).round_().clamp_(lo, hi)
        torch.mul(q, s, out=deq)
        if off is not None:
            deq.sub_(off)

    Qt, row_error = _solve_columns(W, Hinv, block_size, round_column, torch.int8)
    del W, Hinv
    return GPTQResult(fit.weight(_codes_in_order(Qt, None)), int(dead.sum()),
                      _solve_error(row_error, diag, _order(diag, False), dampening_frac, dead))


def _codes_in_order(Qt: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """The solver's codes [in, out] in visiting order as [out, in] in the original column order (perm:
    the visiting order, None when it is the original one). One reordered copy at most besides the result."""
    if perm is not None:  # row perm[k] of the original order is visited row k
        Qt = torch.empty_like(Qt).index_copy_(0, perm, Qt)
    return Qt.t().contiguous()


def _solve_columns(W: torch.Tensor, Hinv: torch.Tensor, block_size: int, round_column,
                   code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPTQ column loop over W [out, in] (already in visiting order; updated in place).

    round_column(j, W1, i, q, deq) rounds column j (row i of the current transposed block W1),
    writing its codes into q and its dequantized values into deq. Each column's error, scaled by
    1 / Hinv[j, j], is pushed onto the block's later columns at once and onto the columns after the
    block in one matrix product per block ("lazy batch updates"), accumulated in place. Returns the codes
    transposed [in, out], in `code_dtype` (int8; FP8 codes as their bytes, uint8), so no float32 copy of
    the codes is ever whole, and each row's sum of squared scaled errors (float64 [out], `SolveError`).

    This is the solver's hot path: it works on transposed blocks ([B, out], so one column is one
    contiguous row) and writes into preallocated rows (it runs once per input column).
    """
    out_f, n = W.shape
    fp8 = code_dtype == FP8_DTYPE
    Qt = torch.empty(n, out_f, dtype=torch.uint8 if fp8 else code_dtype, device=W.device)
    Q1 = torch.empty(min(block_size, n), out_f, dtype=torch.float32, device=W.device)  # this block's codes
    row_error = torch.zeros(out_f, dtype=torch.float64, device=W.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].t().contiguous()  # [B, out] block being quantized, updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        neg_inv_d = (-1.0 / torch.diagonal(Hinv1)).tolist()
        for i in range(i2 - i1):
            err = Err1[i]
            round_column(i1 + i, W1, i, Q1[i], err)
            err.sub_(W1[i]).mul_(neg_inv_d[i])  # (w - dequant(q)) / Hinv[i, i]
            if i + 1 < i2 - i1:
                W1[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1.0)  # W1[j] -= Hinv1[i, j] * err
        block = Q1[: i2 - i1]
        Qt[i1:i2] = block.to(FP8_DTYPE).view(torch.uint8) if fp8 else block.to(code_dtype)
        row_error += Err1.square().sum(dim=0, dtype=torch.float64)
        if i2 < n:  # lazy batch update of the remaining columns, in place
            W[:, i2:].addmm_(Err1.t(), Hinv[i1:i2, i2:], alpha=-1.0)
    return Qt, row_error


def _prepare(W: torch.Tensor, H: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 working copy of W (W itself when `overwrite` and it is float32) with the columns whose
    input was always zero ("dead") zeroed; H's diagonal as the solver sees it (dead entries 1); the dead
    mask. H itself is not copied."""
    given = W
    W = W.detach().float()  # [out, in]
    if W.data_ptr() == given.data_ptr() and not overwrite:
        W = W.clone()
    diag = H.diagonal().to(torch.float32, copy=True)  # (H: a tensor or a row source)
    dead = diag == 0
    diag[dead] = 1.0
    W[:, dead] = 0.0
    return W, diag, dead


def _static_qparams(w: torch.Tensor, diag: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype,
                    scale_search: bool):
    """Scales (and zero points) [out, groups] fixed before the solve: min/max, or searched under diag(H)."""
    return searched_qparams(w, diag, scheme, scale_dtype) if scale_search else minmax_qparams(w, scheme, scale_dtype)


def _stack_permuted(weights: list[torch.Tensor], H: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype,
                    actorder: bool, scale_search: bool = False):
    """`_prepare` + `_order` + the static scales for weights stacked on the output dim, with the float32
    working copy written straight in visiting order (row blocks of it, one weight at a time)."""
    n = weights[0].shape[1]
    diag = H.diagonal().to(torch.float32, copy=True)
    dead = diag == 0
    diag[dead] = 1.0
    perm = _order(diag, actorder)
    out_f = sum(w.shape[0] for w in weights)
    W = torch.empty(out_f, n, dtype=torch.float32, device=weights[0].device)
    static = actorder or scheme.strategy == "channel"
    scales, zps, start = [], [], 0
    for w in weights:
        rows = W[start : start + w.shape[0]]
        start += w.shape[0]
        if static:  # from the original order, dead columns as zeros
            s, z = _static_qparams(w.float().masked_fill(dead, 0.0) if bool(dead.any()) else w, diag, scheme,
                                   scale_dtype, scale_search)
            scales.append(s)
            zps.append(z)
        if actorder:
            if w.dtype == torch.float32:
                torch.index_select(w, 1, perm, out=rows)
            else:
                rows.copy_(w[:, perm])
        else:
            rows.copy_(w)
    W[:, dead[perm] if actorder else dead] = 0.0
    scale = torch.cat(scales) if static else None
    zp = torch.cat(zps) if static and zps[0] is not None else None
    return W, diag, dead, perm, scale, zp


def _order(diag: torch.Tensor, actorder: bool) -> torch.Tensor:
    """Column visiting order: by decreasing diag(H) with act-order, else left to right."""
    return torch.argsort(diag, descending=True) if actorder else torch.arange(diag.shape[0], device=diag.device)


def _group_qparams(cols, g, scheme, scale_dtype, scale, zp, s_out, z_out, importance=None) -> None:
    """Parameters of group g from its current (error-compensated) columns [gs, out] (min/max, or searched
    with `importance`), written to the scale table and to the group's float32 rows s_out / z_out [out]."""
    if importance is not None:
        s, z = searched_grid_qparams(cols, importance, scheme, scale_dtype)
    else:
        s, z = compute_qparams(cols.amin(dim=0), cols.amax(dim=0), scheme, scale_dtype)
    scale[:, g] = s
    s_out.copy_(s.float())
    if zp is not None:
        zp[:, g] = z
        z_out.copy_(z.float())
