"""FP8 KV-cache scale calibration as a pipeline stage.

After the layer's weight stages have run, the calibration batches go through the layer once
more with a `KVObserver` in place of the cache: it sees the keys after RoPE and the values as
attention will cache them (computed with the quantized k/v projections). k_scale / v_scale =
absmax / 448, per tensor (what vLLM reads) or per KV head (`strategy: head`), are registered as
buffers `k_scale` / `v_scale` on the layer's attention module, so they are exported with it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from quantkit.calibration import distributed
from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.errors import QuantizationError
from quantkit.quant.fp8 import scale_from_absmax
from quantkit.core.registry import ALGORITHMS
from quantkit.calibration.driver import drive_layer
from quantkit.qmodules.kv import KVObserver


class KVCacheConfig(AlgorithmConfig):
    strategy: Literal["tensor", "head"] = "tensor"


@ALGORITHMS.register("kv_cache")
class KVCacheScales(Algorithm):
    name = "kv_cache"
    Config = KVCacheConfig
    kind = "attention"  # a layer-level stage: no linear targets, no scheme
    needs_calibration = True
    config: KVCacheConfig

    def scheme_config(self) -> dict:
        """compressed-tensors' `kv_cache_scheme`."""
        return {
            "num_bits": 8, "type": "float", "symmetric": True,
            "strategy": "tensor" if self.config.strategy == "tensor" else "attn_head",
            "group_size": None, "block_structure": None, "dynamic": False, "actorder": None,
            "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None,
        }

    @torch.no_grad()
    def calibrate_layer(self, layer: nn.Module, attention: str, hidden: list[torch.Tensor], kwargs: list[dict],
                        scale_dtype: torch.dtype) -> dict:
        attn = layer.get_submodule(attention)
        observer = KVObserver()
        drive_layer(layer, hidden, kwargs, cache=observer)
        idx = attn.layer_idx
        if idx not in observer.k_absmax:
            raise QuantizationError(f"kv_cache: layer {idx}'s attention never called its cache; "
                                    "this architecture cannot calibrate KV-cache scales")
        k, v = observer.k_absmax[idx], observer.v_absmax[idx]
        world = distributed.current()  # a distributed run: the absmax over every rank's batches
        k, v = world.max_(k, f"layer {idx}: key absmax"), world.max_(v, f"layer {idx}: value absmax")
        if self.config.strategy == "tensor":
            k, v = k.amax().reshape(1), v.amax().reshape(1)
        for name, absmax in (("k_scale", k), ("v_scale", v)):
            attn.register_buffer(name, scale_from_absmax(absmax, scale_dtype))
        return {"k_scale": [round(float(x), 6) for x in attn.k_scale], "v_scale": [round(float(x), 6) for x in attn.v_scale]}
