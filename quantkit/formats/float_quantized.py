"""compressed-tensors `float-quantized`: FP8 e4m3 weights, scales in the model dtype, optional
static `input_scale`; the group's `input_activations` says how activations are quantized."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.errors import CheckpointError
from quantkit.formats.base import QuantFormat
from quantkit.quant.fp8 import Fp8Weight
from quantkit.core.registry import FORMATS
from quantkit.qmodules.fp8_linear import Fp8Linear
from quantkit.quant.schemes import ActivationScheme, QuantScheme


class FloatQuantized(QuantFormat):
    name = "float-quantized"

    def supports(self, scheme: QuantScheme) -> bool:
        return scheme.is_fp8

    def build_module(self, qw: Fp8Weight, bias: torch.Tensor | None) -> nn.Module:
        return Fp8Linear.from_quantized(qw, bias)

    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, scheme, scale_dtype)

    def weights_config(self, scheme: QuantScheme) -> dict:
        return {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": scheme.strategy, "group_size": None,
            "block_structure": list(scheme.block_structure) if scheme.block_structure else None,
            "dynamic": False, "actorder": None, "observer": scheme.observer, "observer_kwargs": {},
            "scale_dtype": None, "zp_dtype": None,
        }

    def activations_config(self, scheme: QuantScheme) -> Optional[dict]:
        acts = scheme.input_activations
        if acts is None:
            return None
        return {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": acts.strategy, "group_size": None,
            "block_structure": None, "dynamic": acts.dynamic, "actorder": None,
            "observer": None if acts.dynamic else ("mse" if acts.observer == "mse" else "static_minmax"),
            "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None,
        }

    def scheme_from_config(self, group: str, weights: dict, input_activations: Optional[dict] = None) -> QuantScheme:
        where = f"config_groups.{group}"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointError(f"{where}.weights: float-quantized needs type float, num_bits 8")
        acts = None
        if input_activations:
            strategy = input_activations.get("strategy")
            dynamic = bool(input_activations.get("dynamic"))
            if input_activations.get("type", "float") != "float" or input_activations.get("num_bits", 8) != 8:
                raise CheckpointError(f"{where}.input_activations: only FP8 (type float, 8 bits) is supported")
            if (strategy, dynamic) not in (("token", True), ("tensor", False)):
                raise CheckpointError(f"{where}.input_activations: strategy {strategy!r} with dynamic={dynamic} is not "
                                      "supported; supported: token (dynamic), tensor (static)")
            acts = ActivationScheme(strategy=strategy)
        try:
            return QuantScheme(num_bits=8, type="float", strategy=weights.get("strategy") or "tensor",
                               block_structure=weights.get("block_structure"), input_activations=acts)
        except ValueError as exc:
            raise CheckpointError(f"{where}.weights: {exc}") from None


FORMATS.add(FloatQuantized.name, FloatQuantized())
