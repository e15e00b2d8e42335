"""FP8 (e4m3) quantization maths: saturating casts, weight scales, activation scale observers.

Pure functions of tensors. Dequantized value = fp8 value x scale, scale = absmax / 448
(compressed-tensors' convention). Casts saturate at +-448 and never produce inf or NaN for
finite input. Weight strategies: per tensor, per output channel, or per [bn, bk] block.
Weight scales come from the absmax (observer `minmax`) or the MSE-best shrink of it per scale
(`mse`, data-free). Activation scales are either dynamic (per token, at run time; `kernels.reference`) or static
(per tensor, from calibration statistics) with an observer: `minmax` (absmax / 448) or `mse`
(the absmax shrink factor whose quantize-dequantize error over sampled values is smallest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from quantkit.quant.schemes import QuantScheme

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TINY = 1e-12  # an all-zero tensor still gets a positive scale (its codes are 0)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3 (round to nearest even; |x| > 448 -> +-448). NaN stays NaN."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_absmax(absmax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """absmax / 448 in scale_dtype (rounded there once: what the checkpoint stores)."""
    return (absmax.float().clamp(min=TINY) / FP8_MAX).to(scale_dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of x / scale (scale broadcast against x), saturating."""
    return to_fp8(x.float() / scale.float())


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 with `scale` and dequantized, in x's dtype."""
    return (quantize(x, scale).float() * scale.float()).to(x.dtype)


@dataclass
class Fp8Weight:
    """A weight in e4m3 with its scales: [1] per tensor, [out, 1] per channel, [out/bn, in/bk] per
    block; and, for static activation quantization, the input's scale [1]."""

    q: torch.Tensor
    scale: torch.Tensor
    strategy: str  # "tensor" | "channel" | "block"
    block: Optional[tuple[int, int]] = None
    scheme: Optional[QuantScheme] = None
    input_scale: Optional[torch.Tensor] = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.q, self.scale, self.strategy, self.block, dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dequantize()[start:stop]`, computing only those rows (a block strategy's from the block rows
        they fall in)."""
        if self.strategy == "block":
            bn = self.block[0]
            first = start // bn  # the slab of whole block rows holding start..stop
            slab = dequantize_weight(self.q[first * bn : stop], self.scale[first : -(-stop // bn)], "block", self.block,
                                     dtype)
            return slab[start - first * bn :]
        scale = self.scale[start:stop] if self.strategy == "channel" else self.scale
        return dequantize_weight(self.q[start:stop], scale, self.strategy, self.block, dtype)


def _block_view(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] -> [out/bn, bn, in/bk, bk], zero-padded to whole blocks."""
    bn, bk = block
    out, inp = w.shape
    pad_r, pad_c = (-out) % bn, (-inp) % bk
    if pad_r or pad_c:
        w = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    return w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)


def _expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    bn, bk = block
    return scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


WEIGHT_MSE_SHRINKS = tuple(1.0 - 0.01 * i for i in range(21))  # absmax x 1.00, 0.99, ..., 0.80


def quantize_weight(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype,
                    block: Optional[tuple[int, int]] = None, observer: str = "minmax") -> Fp8Weight:
    """FP8 quantization of a weight [out, in] with one scale per tensor, output channel or block.

    observer "minmax": scale = absmax / 448. "mse": each scale is the absmax x f / 448, f in
    WEIGHT_MSE_SHRINKS, whose quantize-dequantize squared error over its own weights is smallest
    (data-free; f = 1 is a candidate, so it is never worse than minmax on that error)."""
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"unknown FP8 weight strategy {strategy!r}; use tensor, channel or block")
    if strategy == "block" and block is None:
        raise ValueError("block strategy needs a block structure, e.g. [128, 128]")
    if observer not in ("minmax", "mse"):
        raise ValueError(f"unknown FP8 weight observer {observer!r}; use minmax or mse")
    w = w.float()
    absmax = _per_unit(w.abs(), strategy, block, "amax")
    expand = (lambda s: _expand_block_scale(s, block, w.shape)) if strategy == "block" else (lambda s: s)
    scale = scale_from_absmax(absmax, scale_dtype)
    if observer == "mse":
        best = _per_unit((fake_quantize(w, expand(scale)) - w).pow(2), strategy, block, "sum")
        for f in WEIGHT_MSE_SHRINKS[1:]:
            cand = scale_from_absmax(absmax * f, scale_dtype)
            err = _per_unit((fake_quantize(w, expand(cand)) - w).pow(2), strategy, block, "sum")
            better = err < best
            scale, best = torch.where(better, cand, scale), torch.where(better, err, best)
    return Fp8Weight(quantize(w, expand(scale)), scale, strategy, tuple(block) if strategy == "block" else None)


def _per_unit(x: torch.Tensor, strategy: str, block: Optional[tuple[int, int]], how: str) -> torch.Tensor:
    """Reduce x [out, in] to one value per scale: [1] per tensor, [out, 1] per channel, [out/bn, in/bk] per block."""
    if strategy == "tensor":
        return (x.amax() if how == "amax" else x.sum()).reshape(1)
    if strategy == "channel":
        return x.amax(dim=1, keepdim=True) if how == "amax" else x.sum(dim=1, keepdim=True)
    v = _block_view(x, block)
    return v.amax(dim=(1, 3)) if how == "amax" else v.sum(dim=(1, 3))


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, strategy: str, block: Optional[tuple[int, int]],
                      dtype: torch.dtype) -> torch.Tensor:
    s = _expand_block_scale(scale, block, q.shape) if strategy == "block" else scale.float()
    return (q.float() * s).to(dtype)


class InputScaleObserver:
    """Accumulates one linear's calibration inputs for its static per-tensor activation scale:
    the running absmax (observer `minmax`: absmax / 448) and, for `mse`, an even random sample of
    `samples` input values per batch (the scale is then `mse_scale` over the sample and the absmax)."""

    def __init__(self, observer: str, samples: int, generator: torch.Generator):
        if observer not in ("minmax", "mse"):
            raise ValueError(f"unknown activation observer {observer!r}; use minmax or mse")
        self.observer, self.samples, self._gen = observer, samples, generator
        self.absmax: Optional[torch.Tensor] = None
        self._kept: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1)
        m = x.abs().amax()
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
        if self.observer == "mse":
            idx = torch.randint(0, x.numel(), (min(x.numel(), self.samples),), generator=self._gen)
            self._kept.append(x[idx])

    def reduce(self, max_: Callable[[torch.Tensor], torch.Tensor], gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Combine this observer with its copies on the other ranks of a distributed run: the absmax by
        `max_` (in place), the mse sample by `gather` (every rank's values, in rank order)."""
        if self.absmax is None:
            raise ValueError("no input was observed")
        self.absmax = max_(self.absmax.clone())
        if self.observer == "mse":
            self._kept = [gather(torch.cat(self._kept))]

    def scale(self, scale_dtype: torch.dtype) -> torch.Tensor:
        """The static input scale [1]."""
        if self.absmax is None:
            raise ValueError("no input was observed")
        if self.observer == "minmax":
            return scale_from_absmax(self.absmax.reshape(1), scale_dtype)
        kept = torch.cat(self._kept)
        if kept.numel() > self.samples:  # an even subsample of every batch's sample
            kept = kept[torch.randperm(kept.numel(), generator=self._gen)[: self.samples]]
        return mse_scale(torch.cat([kept, self.absmax.reshape(1)]), float(self.absmax), scale_dtype)


def expanded_scale(qw: "Fp8Weight") -> torch.Tensor:
    """qw's scale broadcast to one value per weight element [out, in] (float32)."""
    if qw.strategy == "block":
        return _expand_block_scale(qw.scale, qw.block, qw.q.shape)
    return qw.scale.float().expand(qw.q.shape)


def column_scales(qw: "Fp8Weight") -> tuple[torch.Tensor, int]:
    """qw's scale as (S, width): float32 [out, groups of columns], each column c scaled by S[:, c // width]
    (a tensor's or a channel's scale: one group of all the columns; a block's: its bk columns). The
    compact form of `expanded_scale` that GPTQ's FP8 solve reads a column at a time."""
    out, inp = qw.q.shape
    if qw.strategy == "block":
        bn, bk = qw.block
        return qw.scale.float().repeat_interleave(bn, 0)[:out], bk
    return qw.scale.float().reshape(-1, 1).expand(out, 1), inp


def mse_scale(samples: torch.Tensor, absmax: float, scale_dtype: torch.dtype, grid: int = 40,
              max_shrink: float = 0.6) -> torch.Tensor:
    """The static scale absmax * f / 448, f in (1 - max_shrink, 1], whose quantize-dequantize
    squared error over `samples` is smallest (clipping a few outliers can buy precision for the rest).
    f = 1 (min-max) is always a candidate."""
    x = samples.float().reshape(-1)
    best, best_err = None, float("inf")
    for step in range(max(1, int(grid * max_shrink))):
        scale = scale_from_absmax(torch.tensor([absmax * (1 - step / grid)], device=x.device), scale_dtype)
        err = float((fake_quantize(x, scale) - x).pow(2).sum())
        if err < best_err:
            best, best_err = scale, err
    return best
