"""The KV-cache scale observer for calibration, and the broadcast of a KV scale over attention states.

transformers' attention passes its keys (after RoPE) and values through `cache.update(k, v,
layer_idx, ...)` before attending. `KVObserver` stands at that point during calibration: it records
each layer's absmax (per tensor and per KV head) and returns the states unchanged; the FP8 caches
of the runtime (`quantkit.runtime.kv_cache`) stand there when a model runs.
"""

from __future__ import annotations

import torch
from torch import nn


class KVObserver:
    """Stands in for a cache during calibration: keeps absmax of keys and values per KV head."""

    def __init__(self):
        self.k_absmax: dict[int, torch.Tensor] = {}
        self.v_absmax: dict[int, torch.Tensor] = {}

    @staticmethod
    def _per_head(x: torch.Tensor) -> torch.Tensor:
        return x.detach().abs().float().amax(dim=(0, 2, 3))  # [batch, heads, seq, dim] -> [heads]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for store, x in ((self.k_absmax, key_states), (self.v_absmax, value_states)):
            m = self._per_head(x)
            store[layer_idx] = torch.maximum(store[layer_idx], m) if layer_idx in store else m
        return key_states, value_states


def head_view(scale: torch.Tensor) -> torch.Tensor:
    """A [1] or [heads] scale broadcast against [batch, heads, seq, dim]."""
    return scale.float().reshape(1, -1, 1, 1)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """layer_idx -> attention module, for every module with a `layer_idx` and k/v projections."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            found[idx] = module
    return found
