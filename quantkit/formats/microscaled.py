"""compressed-tensors' microscaled float formats: `nvfp4-pack-quantized` (NVFP4), `mxfp4-pack-quantized`
(MXFP4) and `mxfp8-quantized` (MXFP8), all held by `MicroLinear`.

The config entries are compressed-tensors 0.19's presets (NVFP4A16 / NVFP4, MXFP4A16 / MXFP4, MXFP8A16 /
MXFP8): float weights, symmetric, strategy tensor_group (group 16, scale_dtype float8_e4m3fn) or group
(group 32, scale_dtype uint8: e8m0), activations in the same format or none.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.core.registry import FORMATS
from quantkit.errors import CheckpointError
from quantkit.formats.base import QuantFormat
from quantkit.qmodules.micro_linear import MicroLinear
from quantkit.quant.microscale import MicroWeight
from quantkit.quant.schemes import ActivationScheme, QuantScheme


class _Microscaled(QuantFormat):
    """One microscaled format: which (strategy, element bits) it stores."""

    strategy: str
    bits: int

    def supports(self, scheme: QuantScheme) -> bool:
        return scheme.is_micro and (scheme.strategy, scheme.num_bits) == (self.strategy, self.bits)

    def build_module(self, qw: MicroWeight, bias: torch.Tensor | None) -> nn.Module:
        return MicroLinear.from_quantized(qw, bias)

    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        return MicroLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, scale_dtype)

    def _args(self, scheme: QuantScheme) -> dict:
        return {
            "num_bits": self.bits, "type": "float", "symmetric": True, "group_size": scheme.group_size,
            "strategy": self.strategy, "block_structure": None, "actorder": None,
            "scale_dtype": "torch.float8_e4m3fn" if self.strategy == "tensor_group" else "torch.uint8",
            "zp_dtype": None, "observer_kwargs": {},
        }

    def weights_config(self, scheme: QuantScheme) -> dict:
        return {**self._args(scheme), "actorder": scheme.actorder, "dynamic": False, "observer": "minmax"}

    def activations_config(self, scheme: QuantScheme) -> Optional[dict]:
        acts = scheme.input_activations
        if acts is None:
            return None
        local = acts.dynamic == "local"
        return {**self._args(scheme), "dynamic": acts.dynamic, "observer": "static_minmax" if local else None}

    def scheme_from_config(self, group: str, weights: dict, input_activations: Optional[dict] = None) -> QuantScheme:
        where = f"config_groups.{group}"
        if (weights.get("type"), weights.get("num_bits"), weights.get("strategy")) != ("float", self.bits, self.strategy):
            raise CheckpointError(f"{where}.weights: {self.name} needs type float, num_bits {self.bits}, strategy "
                                  f"{self.strategy} (got {weights.get('type')}, {weights.get('num_bits')}, "
                                  f"{weights.get('strategy')})")
        if not weights.get("symmetric", True):
            raise CheckpointError(f"{where}.weights: asymmetric {self.name} weights are not supported")
        acts = None
        if input_activations:
            try:
                acts = ActivationScheme(num_bits=input_activations.get("num_bits", 8),
                                        type=input_activations.get("type", "float"),
                                        strategy=input_activations.get("strategy"),
                                        group_size=input_activations.get("group_size"),
                                        dynamic=input_activations.get("dynamic"))
            except ValueError as exc:
                raise CheckpointError(f"{where}.input_activations: not supported ({exc})") from None
        try:
            return QuantScheme(num_bits=self.bits, type="float", strategy=self.strategy,
                               group_size=weights.get("group_size"),
                               actorder="static" if weights.get("actorder") in ("static", "weight") else None,
                               input_activations=acts)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None


class NVFP4PackQuantized(_Microscaled):
    name, strategy, bits = "nvfp4-pack-quantized", "tensor_group", 4


class MXFP4PackQuantized(_Microscaled):
    name, strategy, bits = "mxfp4-pack-quantized", "group", 4


class MXFP8Quantized(_Microscaled):
    name, strategy, bits = "mxfp8-quantized", "group", 8


for _fmt in (NVFP4PackQuantized(), MXFP4PackQuantized(), MXFP8Quantized()):
    FORMATS.add(_fmt.name, _fmt)
