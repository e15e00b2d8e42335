"""Fold per-channel scales between an operator and the linears that read its output.

For channel scales s: the smooth operator's output channel c is divided by s[c] and each balance
linear's input column c is multiplied by s[c], so the composition computes the same function.
Used by AWQ (and by any activation-smoothing transform). Arithmetic is float32; the results are
rounded to the checkpoint's storage dtype (when computing in a wider dtype, so that the exported
checkpoint holds exactly the in-memory weights) and kept in the parameters' own dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantizationError


def repeated_heads_index(smooth_channels: int, balance_channels: int, head_dim: int,
                         device: torch.device | None = None) -> torch.Tensor:
    """Which smooth output channel feeds each balance input channel when heads are repeated.

    Grouped-query attention: v_proj has kv_heads * head_dim outputs, and o_proj reads heads *
    head_dim inputs, head h using kv head h // (heads / kv_heads). [balance_channels] int64.
    """
    if smooth_channels % head_dim or balance_channels % smooth_channels:
        raise QuantizationError(f"cannot map {balance_channels} inputs onto {smooth_channels} repeated outputs "
                                f"with head_dim {head_dim}")
    heads, rep = balance_channels // head_dim, balance_channels // smooth_channels
    h = torch.arange(heads, device=device).repeat_interleave(head_dim)
    d = torch.arange(head_dim, device=device).repeat(heads)
    return (h // rep) * head_dim + d


@torch.no_grad()
def fold_scales(smooth: nn.Module, balance: list[nn.Module], scales: torch.Tensor, norm_weight_offset: float = 0.0,
                balance_index: torch.Tensor | None = None, storage_dtype: torch.dtype | None = None) -> None:
    """Divide `smooth`'s output channels by `scales` and multiply the `balance` inputs by them.

    `smooth` is a linear (its weight rows and bias are divided) or a norm whose output is
    normalised(x) * (norm_weight_offset + weight) (+ bias): its effective weight is divided.
    Each balance module has a weight [out, in] applied as x @ weight^T (a linear, or e.g. an MoE
    router). With `balance_index` (see `repeated_heads_index`), balance input j gets scales[balance_index[j]].
    `storage_dtype`: every new value is rounded to it first (default: the parameter's own dtype).
    """
    store = lambda param, value: _set(param, value, storage_dtype)  # noqa: E731
    s = scales.float()
    if isinstance(smooth, nn.Linear):
        if smooth.out_features != s.numel():
            raise QuantizationError(f"scales of size {s.numel()} do not fit {smooth.out_features} output channels")
        store(smooth.weight, smooth.weight.float() / s[:, None])
    else:
        weight = getattr(smooth, "weight", None)
        if weight is None or weight.numel() != s.numel():
            raise QuantizationError(f"cannot fold {s.numel()} scales into {type(smooth).__name__}: "
                                    "it has no per-channel weight of that size")
        store(weight, (norm_weight_offset + weight.float()) / s - norm_weight_offset)
    bias = getattr(smooth, "bias", None)
    if bias is not None:
        store(bias, bias.float() / s)
    sb = s if balance_index is None else s[balance_index]
    for mod in balance:
        weight = getattr(mod, "weight", None)
        if weight is None or weight.dim() != 2 or weight.shape[1] != sb.numel():
            raise QuantizationError(f"scales of size {sb.numel()} do not fit {type(mod).__name__} "
                                    f"with weight {tuple(weight.shape) if weight is not None else None}")
        store(weight, weight.float() * sb[None, :])


def _set(param: torch.Tensor, value: torch.Tensor, storage_dtype: torch.dtype | None) -> None:
    if storage_dtype is not None:
        value = value.to(storage_dtype)
    param.data = value.to(param.dtype)
