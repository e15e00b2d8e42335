"""FP8 KV cache: a cache that stores keys/values on the FP8 grid, and the model's calibrated KV scales.

transformers' attention passes its keys (after RoPE) and values through `cache.update(k, v,
layer_idx, ...)` before attending; the caches here sit at that point (as does the calibration's
`quantkit.qmodules.kv.KVObserver`). `Fp8KVCache` quantizes every key/value to e4m3 with the layer's scales before storing it
(emulation: the values kept are exactly what an FP8 cache holds, in the compute dtype), so
attention reads what it would read from an FP8 cache. Scales: `self_attn.k_scale` /
`v_scale` ([1] per tensor, [kv_heads] per head), as compressed-tensors exports them.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache, StaticCache

from quantkit.qmodules.kv import attention_modules, head_view
from quantkit.quant.fp8 import fake_quantize

log = logging.getLogger(__name__)


class _Fp8Update:
    """Rounds keys and values to e4m3 with the layer's scales before the cache stores them."""

    scales: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k_scale, v_scale = self.scales[layer_idx]
        key_states = fake_quantize(key_states, head_view(k_scale))
        value_states = fake_quantize(value_states, head_view(v_scale))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class Fp8KVCache(_Fp8Update, DynamicCache):
    """A DynamicCache whose stored keys and values are rounded to e4m3 with per-layer scales."""

    def __init__(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], config=None):
        super().__init__(config=config)
        self.scales = scales


class Fp8StaticCache(_Fp8Update, StaticCache):
    """The preallocated StaticCache, with keys and values on the FP8 grid."""

    def __init__(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], config, max_cache_len: int):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.scales = scales


def kv_scales(model: nn.Module) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], bool]:
    """Each layer's (k_scale, v_scale) from the model's buffers; where a layer has none, 1.0 with a
    warning (an uncalibrated FP8 cache: values above 448 saturate). Returns (scales, calibrated)."""
    scales, missing = {}, []
    for idx, attn in attention_modules(model).items():
        k, v = getattr(attn, "k_scale", None), getattr(attn, "v_scale", None)
        if k is None or v is None:
            missing.append(idx)
            k = v = torch.ones(1, device=next(iter(attn.state_dict().values())).device)
        scales[idx] = (k.float(), v.float())
    if missing:
        log.warning("FP8 KV cache: %d of %d layers have no calibrated k_scale/v_scale; using 1.0 there "
                    "(quantize with a kv-cache recipe, e.g. fp8-kv, to calibrate them)", len(missing), len(scales))
    return scales, not missing


def cache_factory(model: nn.Module, kv_cache_dtype: Optional[str]):
    """A function making a fresh growing cache per call (None for the model's default), with the
    scales read (and any warning given) once."""
    if kv_cache_dtype in (None, "auto", "model"):
        return lambda: None
    make_cache(model, kv_cache_dtype)  # validates the dtype
    scales = kv_scales(model)[0]
    return lambda: Fp8KVCache(scales, config=model.config)


def make_cache(model: nn.Module, kv_cache_dtype: Optional[str], max_cache_len: Optional[int] = None):
    """The cache for generation / evaluation. max_cache_len: a preallocated StaticCache of that
    length; None: growing (None is returned for the model's default 16-bit cache)."""
    if kv_cache_dtype not in (None, "auto", "model", "fp8"):
        raise ValueError(f"kv cache dtype {kv_cache_dtype!r} is not supported; use fp8 or auto")
    fp8 = kv_cache_dtype == "fp8"
    if max_cache_len is None:
        return Fp8KVCache(kv_scales(model)[0], config=model.config) if fp8 else None
    if fp8:
        return Fp8StaticCache(kv_scales(model)[0], model.config, max_cache_len)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)
