"""Fold per-channel scales between an operator and the linears that read its output.

For channel scales s: the smooth operator's output channel c is divided by s[c] and each balance
linear's input column c is multiplied by s[c], so the composition computes the same function.
Used by AWQ (and by any activation-smoothing transform). Arithmetic is float32, then the
parameters are cast back to their own dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantizationError


@torch.no_grad()
def fold_scales(smooth: nn.Module, balance: list[nn.Linear], scales: torch.Tensor, norm_weight_offset: float = 0.0) -> None:
    """Divide `smooth`'s output channels by `scales` and multiply the `balance` inputs by them.

    `smooth` is a linear (its weight rows and bias are divided) or a norm whose output is
    normalised(x) * (norm_weight_offset + weight) (+ bias): its effective weight is divided.
    """
    s = scales.float()
    if isinstance(smooth, nn.Linear):
        if smooth.out_features != s.numel():
            raise QuantizationError(f"scales of size {s.numel()} do not fit {smooth.out_features} output channels")
        _set(smooth.weight, smooth.weight.float() / s[:, None])
    else:
        weight = getattr(smooth, "weight", None)
        if weight is None or weight.numel() != s.numel():
            raise QuantizationError(f"cannot fold {s.numel()} scales into {type(smooth).__name__}: "
                                    "it has no per-channel weight of that size")
        _set(weight, (norm_weight_offset + weight.float()) / s - norm_weight_offset)
    bias = getattr(smooth, "bias", None)
    if bias is not None:
        _set(bias, bias.float() / s)
    for lin in balance:
        if lin.in_features != s.numel():
            raise QuantizationError(f"scales of size {s.numel()} do not fit a linear with {lin.in_features} inputs")
        _set(lin.weight, lin.weight.float() * s[None, :])


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype)
