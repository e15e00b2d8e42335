"""SmoothQuant maths (Xiao et al., 2023): per-input-channel scales that move activation outliers
into the weights before both are quantized to int8.

Pure functions of tensors. A linear y = x W^T equals (x / s) (W * s)^T. SmoothQuant picks
s_j = max|x_j|^alpha / max|W_{:,j}|^(1 - alpha): alpha = 0 leaves the activations alone, alpha = 1
gives every activation channel the same range. The maximum of |W| is over every linear reading
the channel (q, k, v share one s). The caller folds s into the operator that produces x.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantizationError

# a channel whose activations or weights are (near) zero gets scale 1: dividing by it would blow up
_TINY = 1e-5


def weight_absmax(weights: list[torch.Tensor]) -> torch.Tensor:
    """Per input channel max |w| over every row of every weight [out, in]. [in], float32."""
    if not weights:
        raise QuantizationError("SmoothQuant needs at least one weight reading the smoothed channels")
    return torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)


def smoothing_scales(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act_absmax^alpha / w_absmax^(1 - alpha), 1 where either is below 1e-5. [in], float32."""
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationError(f"SmoothQuant alpha {alpha} is outside [0, 1]")
    if act_absmax.shape != w_absmax.shape:
        raise QuantizationError(f"activation maxima {tuple(act_absmax.shape)} and weight maxima "
                                f"{tuple(w_absmax.shape)} differ in shape")
    a, w = act_absmax.float(), w_absmax.float()
    s = a.clamp_min(_TINY).pow(alpha) / w.clamp_min(_TINY).pow(1.0 - alpha)
    ok = (a > _TINY) & (w > _TINY) & torch.isfinite(s) & (s > 0)
    return torch.where(ok, s, torch.ones_like(s))
