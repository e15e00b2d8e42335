"""GPTQ solver (Frantar et al., 2022): quantize W column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian H = 2/n sum x x^T.

Pure function of (W, H, scheme): no modules, no hooks. Symbols follow the paper: W, H, Hinv, Q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def inverse_hessian_factor(H: torch.Tensor, dampening_frac: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1 (U^T U = (H + damp I)^-1), damp = dampening_frac * mean(diag H).

    One factorization and one triangular inverse: with J the order-reversing permutation and
    J (H + damp I) J = L L^T, U = J L^-1 J is upper triangular and U^T U = J L^-T L^-1 J = (H + damp I)^-1.
    (About twice as fast as inverting and factorizing again.)
    """
    H = H.clone()
    H.diagonal().add_(dampening_frac * torch.mean(torch.diag(H)))
    L, info = torch.linalg.cholesky_ex(H.flip(0, 1))
    if info.item() != 0:
        raise HessianError(f"Cholesky of the damped Hessian failed at column {H.shape[0] - info.item()}")
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
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
    W = W.detach().float().clone()  # [out, in]
    H = H.detach().float().clone()  # [in, in]
    out_f, n = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    static = actorder or scheme.strategy == "channel"
    if static:
        scale, zp = minmax_qparams(W, scheme, scale_dtype)  # [out, groups]
    else:
        groups = scheme.group_count(n)
        scale = torch.empty(out_f, groups, dtype=scale_dtype)
        zp = None if scheme.symmetric else torch.empty(out_f, groups, dtype=torch.int8)

    perm = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = inverse_hessian_factor(H, dampening_frac)
    gsize = n if scheme.strategy == "channel" else scheme.group_size
    if not static:  # keep groups inside one lazy block so their columns are up to date
        block_size = math.ceil(block_size / gsize) * gsize
    group_of = perm // gsize  # [in] group index of each permuted column

    # The column loop is the solver's hot path: it works on transposed blocks ([B, out], so one
    # column is one contiguous row) with per-column scales gathered up front when they are static.
    Qt = torch.empty(n, out_f, dtype=torch.float32)  # codes, transposed
    if static:
        s_cols = scale.float().t()[group_of]  # [in, out] scale of every (permuted) column
        z_cols = zp.float().t()[group_of] if zp is not None else torch.zeros_like(s_cols)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].t().contiguous()  # [B, out] block being quantized, updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        if static:
            s_blk, z_blk = s_cols[i1:i2], z_cols[i1:i2]
        else:  # filled group by group below, as each group's first column is reached
            s_blk, z_blk = torch.empty_like(W1), torch.zeros_like(W1)
        neg_inv_d = (-1.0 / torch.diagonal(Hinv1)).tolist()
        Q1 = Qt[i1:i2]
        # one column per step, written into preallocated rows (the loop runs once per input column)
        for i in range(i2 - i1):
            if not static and (i1 + i) % gsize == 0:
                _group_qparams(W1[i : i + gsize], int(group_of[i1 + i]), scheme, scale_dtype, scale, zp,
                               s_blk[i : i + gsize], z_blk[i : i + gsize])
            w, s, q, err = W1[i], s_blk[i], Q1[i], Err1[i]
            torch.div(w, s, out=q)
            if scheme.symmetric:
                q.round_().clamp_(scheme.qmin, scheme.qmax)
                torch.mul(q, s, out=err)
            else:
                z = z_blk[i]
                q.add_(z).round_().clamp_(scheme.qmin, scheme.qmax)
                torch.sub(q, z, out=err).mul_(s)
            err.sub_(w).mul_(neg_inv_d[i])  # (w - dequant(q)) / Hinv[i, i]
            if i + 1 < i2 - i1:
                W1[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1.0)  # W1[j] -= Hinv1[i, j] * err
        W[:, i2:] -= Err1.t() @ Hinv[i1:i2, i2:]  # lazy batch update of the remaining columns

    inv = torch.argsort(perm)
    Q = Qt[inv].t().to(torch.int8).contiguous()  # [out, in] in the original column order
    return GPTQResult(QuantizedWeight(Q, scale, zp, scheme), int(dead.sum()))


def _group_qparams(cols, g, scheme, scale_dtype, scale, zp, s_out, z_out) -> None:
    """Min/max parameters of group g from its current (error-compensated) columns [gs, out]."""
    s, z = compute_qparams(cols.amin(dim=0), cols.amax(dim=0), scheme, scale_dtype)
    scale[:, g] = s
    s_out.copy_(s.float().expand_as(s_out))
    if zp is not None:
        zp[:, g] = z
        z_out.copy_(z.float().expand_as(z_out))
