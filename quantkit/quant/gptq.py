"""GPTQ solver (Frantar et al., 2022): quantize W column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian H = 2/n sum x x^T.

Pure functions of (W, H, scheme): no modules, no hooks. Symbols follow the paper: W, H, Hinv, Q.
The grid is an int scheme's (`gptq_quantize`: scales min/max per group, fixed up front or as each
group is reached) or e4m3 on given scales (`gptq_quantize_fp8`: the scales of the nearest
rounding, fixed up front; each column is rounded to nearest e4m3 of w / s, saturating).
"""

from __future__ import annotations

import math
from typing import Optional
from dataclasses import dataclass

import torch

from quantkit.quant.fp8 import FP8_DTYPE, FP8_MAX
from quantkit.quant.intq import QuantizedWeight, compute_qparams, minmax_qparams
from quantkit.schemes import QuantScheme


class HessianError(ArithmeticError):
    """The damped Hessian is not positive definite (Cholesky failed or produced inf/NaN)."""


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    dead_columns: int  # input columns that never saw a non-zero activation


def hessian_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W - W_hat) H (W - W_hat)^T): the layer-output error GPTQ minimises (up to a constant)."""
    D = W.float() - W_hat.float()  # [out, in]
    return float(((D @ H.float()) * D).sum(dtype=torch.float64))


def inverse_hessian_factor(H: torch.Tensor, dampening_frac: float, perm: Optional[torch.Tensor] = None,
                           dead: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1 (U^T U = (H + damp I)^-1), damp = dampening_frac * mean(diag H).

    One factorization and one triangular inverse: with J the order-reversing permutation and
    J (H + damp I) J = L L^T, U = J L^-1 J is upper triangular and U^T U = J L^-T L^-1 J = (H + damp I)^-1.
    (About twice as fast as inverting and factorizing again.)

    perm: factor the permuted Hessian H[perm][:, perm] instead; dead: columns never reached by an input,
    whose (zero) diagonal entries count as 1. H itself is left as it is. Memory: the reversed (and
    permuted) copy that is factorized, its factor, and the inverse written over an identity matrix: at
    most 3 n^2 floats at once, a fifth of an 8B model's down projection solve's old peak less.
    """
    n = H.shape[0]
    if perm is None:
        Hf = H.detach().float().flip(0, 1)  # J H J: the one copy of H made here
    else:
        rp = perm.flip(0)
        Hf = H.detach().float()[rp[:, None], rp[None, :]]  # J P H P^T J in one copy
    if dead is not None:
        Hf.diagonal()[(dead if perm is None else dead[perm]).flip(0)] = 1.0
    Hf.diagonal().add_(dampening_frac * torch.mean(Hf.diagonal().flip(0)))  # the mean in the solver's order
    L, info = torch.linalg.cholesky_ex(Hf)
    del Hf
    if info.item() != 0:
        raise HessianError(f"Cholesky of the damped Hessian failed at column {n - info.item()}")
    eye = torch.eye(n, dtype=L.dtype, device=L.device)
    U = torch.linalg.solve_triangular(L, eye, upper=False, out=eye)  # L^-1, in place of the identity
    del L
    U = U.flip(0, 1)
    if not torch.isfinite(U).all():
        raise HessianError("the inverse Hessian factor is not finite")
    return U


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
) -> GPTQResult:
    """Quantize W [out, in] given the input Hessian H [in, in] (float32).

    Without act-order, group scales are computed as their first column is reached, from the
    error-compensated weights. With act-order, columns are visited by decreasing diag(H), and
    scales are fixed beforehand per contiguous group of the original order ("static" groups),
    so the checkpoint needs no g_idx.
    """
    W, diag, dead = _prepare(W, H)
    out_f, n = W.shape
    static = actorder or scheme.strategy == "channel"
    if static:
        scale, zp = minmax_qparams(W, scheme, scale_dtype)  # [out, groups]
    else:
        groups = scheme.group_count(n)
        scale = torch.empty(out_f, groups, dtype=scale_dtype, device=W.device)
        zp = None if scheme.symmetric else torch.empty(out_f, groups, dtype=torch.int8, device=W.device)

    perm = _order(diag, actorder)
    if actorder:
        W = W[:, perm]
    Hinv = inverse_hessian_factor(H, dampening_frac, perm if actorder else None, dead)
    gsize = n if scheme.strategy == "channel" else scheme.group_size
    if not static:  # keep groups inside one lazy block so their columns are up to date
        block_size = math.ceil(block_size / gsize) * gsize
    group_of = perm // gsize  # [in] group index of each permuted column
    if static:  # per-column scales gathered up front: [in, out]
        s_cols = scale.float().t()[group_of].contiguous()
        z_cols = zp.float().t()[group_of].contiguous() if zp is not None else torch.zeros_like(s_cols)
    else:  # filled group by group, as each group's first column is reached
        s_cols, z_cols = torch.empty(n, out_f, device=W.device), torch.zeros(n, out_f, device=W.device)

    def round_column(j: int, W1: torch.Tensor, i: int, q: torch.Tensor, deq: torch.Tensor) -> None:
        if not static and j % gsize == 0:
            _group_qparams(W1[i : i + gsize], int(group_of[j]), scheme, scale_dtype, scale, zp,
                           s_cols[j : j + gsize], z_cols[j : j + gsize])
        w, s = W1[i], s_cols[j]
        torch.div(w, s, out=q)
        if scheme.symmetric:
            q.round_().clamp_(scheme.qmin, scheme.qmax)
            torch.mul(q, s, out=deq)
        else:
            z = z_cols[j]
            q.add_(z).round_().clamp_(scheme.qmin, scheme.qmax)
            torch.sub(q, z, out=deq).mul_(s)

    Qt = _solve_columns(W, Hinv, block_size, round_column)
    Q = Qt[torch.argsort(perm)].t().to(torch.int8).contiguous()  # [out, in] in the original column order
    return GPTQResult(QuantizedWeight(Q, scale, zp, scheme), int(dead.sum()))


def gptq_quantize_fp8(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
) -> tuple[torch.Tensor, int]:
    """e4m3 codes [out, in] of W [out, in] on the fixed per-element scales `scale` [out, in] (a
    per-tensor, per-channel or per-block scale expanded to W's shape), and the count of dead columns.

    Dequantized value = code x scale, as in `quantkit.quant.fp8`. The scales stay those given (the
    nearest rounding's), so the codes can replace the nearest codes in the same checkpoint layout.
    """
    W, diag, dead = _prepare(W, H)
    out_f, n = W.shape
    if scale.shape != W.shape:
        raise ValueError(f"scale must be expanded to the weight's shape {tuple(W.shape)}, got {tuple(scale.shape)}")
    perm = _order(diag, actorder)
    if actorder:
        W = W[:, perm]
    Hinv = inverse_hessian_factor(H, dampening_frac, perm if actorder else None, dead)
    s_cols = scale.float()[:, perm].t().contiguous()  # [in, out]: the scales of each (permuted) column

    def round_column(j: int, W1: torch.Tensor, i: int, q: torch.Tensor, deq: torch.Tensor) -> None:
        s = s_cols[j]
        torch.div(W1[i], s, out=q)
        q.copy_(q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))  # nearest e4m3, saturating (exact in float32)
        torch.mul(q, s, out=deq)

    Qt = _solve_columns(W, Hinv, block_size, round_column)
    codes = Qt[torch.argsort(perm)].t().contiguous().to(FP8_DTYPE)  # [out, in], original column order
    return codes, int(dead.sum())


def _solve_columns(W: torch.Tensor, Hinv: torch.Tensor, block_size: int, round_column) -> torch.Tensor:
    """The GPTQ column loop over W [out, in] (already in visiting order; updated in place).

    round_column(j, W1, i, q, deq) rounds column j (row i of the current transposed block W1),
    writing its codes into q and its dequantized values into deq. Each column's error, scaled by
    1 / Hinv[j, j], is pushed onto the block's later columns at once and onto the columns after the
    block in one matrix product per block ("lazy batch updates"). Returns the codes transposed [in, out].

    This is the solver's hot path: it works on transposed blocks ([B, out], so one column is one
    contiguous row) and writes into preallocated rows (it runs once per input column).
    """
    out_f, n = W.shape
    Qt = torch.empty(n, out_f, dtype=torch.float32, device=W.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].t().contiguous()  # [B, out] block being quantized, updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        neg_inv_d = (-1.0 / torch.diagonal(Hinv1)).tolist()
        for i in range(i2 - i1):
            err = Err1[i]
            round_column(i1 + i, W1, i, Qt[i1 + i], err)
            err.sub_(W1[i]).mul_(neg_inv_d[i])  # (w - dequant(q)) / Hinv[i, i]
            if i + 1 < i2 - i1:
                W1[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1.0)  # W1[j] -= Hinv1[i, j] * err
        W[:, i2:] -= Err1.t() @ Hinv[i1:i2, i2:]  # lazy batch update of the remaining columns
    return Qt


def _prepare(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 working copy of W with the columns whose input was always zero ("dead") zeroed; H's
    diagonal as the solver sees it (dead entries 1); the dead mask. H itself is not copied."""
    W = W.detach().float().clone()  # [out, in]
    diag = torch.diag(H).float()  # a copy
    dead = diag == 0
    diag[dead] = 1.0
    W[:, dead] = 0.0
    return W, diag, dead


def _order(diag: torch.Tensor, actorder: bool) -> torch.Tensor:
    """Column visiting order: by decreasing diag(H) with act-order, else left to right."""
    return torch.argsort(diag, descending=True) if actorder else torch.arange(diag.shape[0], device=diag.device)


def _group_qparams(cols, g, scheme, scale_dtype, scale, zp, s_out, z_out) -> None:
    """Min/max parameters of group g from its current (error-compensated) columns [gs, out]."""
    s, z = compute_qparams(cols.amin(dim=0), cols.amax(dim=0), scheme, scale_dtype)
    scale[:, g] = s
    s_out.copy_(s.float().expand_as(s_out))
    if zp is not None:
        zp[:, g] = z
        z_out.copy_(z.float().expand_as(z_out))
