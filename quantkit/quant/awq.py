"""AWQ maths (Lin et al., 2023): activation-aware per-input-channel scales, and weight clipping.

Pure functions of tensors: no modules, no hooks. A linear y = x W^T is unchanged by
y = (x / s) (W * s)^T; quantizing W * s instead of W protects the input channels that carry
large activations. Candidate scales s = x_mean^r / w_mean^(1-r) for a grid of exponents r; the
caller scores each on the real block output. Clipping then shrinks each group's weight range
where that lowers the group's output error E[(x_g . (w_g - q(w_g)))^2] = d^T C_g d, C_g being
the group's input second moment. `clip_refine` then re-chooses the factors against the whole
row's error d^T H d with the full input Hessian H, whose off-diagonal blocks couple the groups:
one group's rounding error can partly cancel another's.
"""

from __future__ import annotations

import torch

from quantkit.quant import microscale
from quantkit.quant.intq import _grouped, rtn
from quantkit.quant.schemes import QuantScheme


def fake_quantize(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of w [out, in], in float32 (int grids, NVFP4 and MX)."""
    if scheme.is_micro:
        return microscale.quantize_weight(w.float(), scheme).dequantize(torch.float32)
    return rtn(w, scheme, scale_dtype).dequantize(torch.float32)


def weight_magnitude(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Per input channel mean of |w| relative to its group's max |w|, over every output row. [in]"""
    w = torch.cat([x.float() for x in weights])  # [sum(out), in]
    g = _grouped(w.abs(), scheme)  # [out, groups, gs]
    g = g / (g.amax(dim=-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool = True) -> torch.Tensor:
    """Scales for exponent `ratio`: x_mean^r / w_mean^(1-r) (or x_mean^r), normalised so that
    max * min = 1 (the geometric middle of the range sits at 1). [in], float32."""
    x_mean, w_mean = x_mean.float(), w_mean.float()
    if duo:
        s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
    else:
        s = x_mean.pow(ratio)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def diagonal_blocks(hessian: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The weight groups' blocks on the diagonal of an [in, in] matrix: [groups, gs, gs]."""
    n = hessian.shape[0]
    groups = scheme.group_count(n)
    gs = n // groups
    blocks = hessian.reshape(groups, gs, groups, gs).diagonal(dim1=0, dim2=2)  # [gs, gs, groups]
    return blocks.permute(2, 0, 1).contiguous()


def clip_search(
    w: torch.Tensor,
    moments: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """The best shrink factor of each (row, group) range: [out, groups] in (1 - max_shrink, 1].

    Candidate f scales the group's [min, max] range to [f min, f max]; the weights are clamped
    to it and quantized; the error is d^T C_g d with d = w - q. f = 1 (no clipping) is always a
    candidate, so no group ends up worse than plain round-to-nearest.
    """
    w = w.float()
    g = _grouped(w, scheme)  # [out, groups, gs]
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    C = moments.float()
    best_err = torch.full(g.shape[:2], float("inf"), device=w.device)
    best = torch.ones(g.shape[:2], device=w.device)
    for f in clip_candidates(n_grid, max_shrink):
        clipped = torch.maximum(torch.minimum(g, hi * f), lo * f).reshape(w.shape)
        d = _grouped(w - fake_quantize(clipped, scheme, scale_dtype), scheme)  # [out, groups, gs]
        dt = d.transpose(0, 1)  # [groups, out, gs]
        err = ((dt @ C) * dt).sum(dim=-1).t()  # [out, groups]: d^T C_g d per row and group
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, f), best)
    return best


def clip_candidates(n_grid: int, max_shrink: float) -> list[float]:
    """Shrink factors searched: 1, 1 - 1/n, ... down to (not below) 1 - max_shrink."""
    return [1.0 - step / n_grid for step in range(max(1, int(max_shrink * n_grid)))]


def clip_refine(
    w: torch.Tensor,
    factors: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    sweeps: int = 2,
) -> torch.Tensor:
    """Coordinate descent on the clip factors [out, groups] of w against each row's full error
    d^T H d (H: [in, in] input second moment, d = w - q): group by group, every row takes the
    candidate that lowers its error most given the other groups' current errors. The current
    choice is always a candidate, so no row's error ever grows."""
    w = w.float()
    groups = factors.shape[1]
    if groups < 2 or sweeps <= 0:
        return factors
    H = hessian.float()
    cands = clip_candidates(n_grid, max_shrink)
    f_values = torch.tensor(cands, device=w.device)
    # every candidate's error for every group: [cands, out, in]
    errs = torch.stack([w - fake_quantize(apply_clip(w, torch.full_like(factors, f), scheme), scheme, scale_dtype)
                        for f in cands])
    choice = torch.stack([(factors - f).abs() for f in cands]).argmin(dim=0)  # [out, groups]
    gs = w.shape[1] // groups
    cand_idx = choice.repeat_interleave(gs, dim=1)  # [out, in]
    d = errs.gather(0, cand_idx.unsqueeze(0)).squeeze(0)  # current errors [out, in]
    r = d @ H  # [out, in]: H d per row
    rows = torch.arange(w.shape[0], device=w.device)
    for _ in range(sweeps):
        changed = 0
        for g in range(groups):
            cols = slice(g * gs, (g + 1) * gs)
            delta = errs[:, :, cols] - d[:, cols]  # [cands, out, gs]
            gain = 2 * (delta * r[:, cols]).sum(-1) + ((delta @ H[cols, cols]) * delta).sum(-1)  # [cands, out]
            best = gain.argmin(dim=0)  # [out]
            moved = best != choice[:, g]
            if not bool(moved.any()):
                continue
            changed += int(moved.sum())
            step = delta[best, rows]  # [out, gs]
            d[:, cols] += step
            r += step @ H[cols, :]
            choice[:, g] = best
        if changed == 0:
            break
    return f_values[choice]


def apply_clip(w: torch.Tensor, factors: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """w [out, in] with each (row, group) clamped to its range shrunk by `factors` [out, groups]."""
    g = _grouped(w.float(), scheme)
    f = factors.float().unsqueeze(-1)
    lo, hi = g.amin(dim=-1, keepdim=True) * f, g.amax(dim=-1, keepdim=True) * f
    return torch.maximum(torch.minimum(g, hi), lo).reshape(w.shape)
