"""DenseCopy: the dequantized weight of an emulated quantized linear, kept between forwards when allowed.

A layer that runs by emulation (FP8 without FP8 hardware, W4AFP8) multiplies by its dequantized weight.
With `keep_dense` (set by `fp8_linear.plan_dense_cache` when the copies fit in memory) that copy is kept
in `_dense` as (key, weight), keyed by dtype, device and the versions of `weight` and `weight_scale`, so an
in-place write or a move rebuilds it; the offloader frees `_dense` when it evicts a layer.
"""

from __future__ import annotations

from typing import Optional

import torch


class DenseCopy:
    """Mixin for an nn.Module with `weight`, `weight_scale` and `dequantize(dtype)` (or its own
    `_dense_sources`); subclasses say through `dense_emulated` whether their forward uses the dense copy."""

    keep_dense: bool = False
    _dense: Optional[tuple[tuple, torch.Tensor]] = None

    @property
    def dense_emulated(self) -> bool:
        raise NotImplementedError

    @property
    def dense_numel(self) -> int:
        """Elements of the dense copy (out x in)."""
        return self.weight.numel()

    def _dense_sources(self) -> tuple[torch.Tensor, ...]:
        """The tensors the dense copy is computed from (an in-place write to one bumps its version)."""
        return self.weight, self.weight_scale

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in `dtype`: kept while weight, scales and dtype are unchanged
        (in-place writes bump a tensor's version; moving the module replaces its buffers)."""
        if not self.keep_dense:
            self._dense = None
            return self.dequantize(dtype)
        sources = self._dense_sources()
        key = (dtype, sources[0].device, *((t.data_ptr(), t._version) for t in sources))
        if self._dense is None or self._dense[0] != key:
            self._dense = None  # free the old copy before making the new one
            self._dense = (key, self.dequantize(dtype))
        return self._dense[1]
