"""compressed-tensors `int-quantized`: int weights stored unpacked as int8 with their scales, for schemes
whose activations are quantized too (W8A8: int8 x int8; W4AFP8: int4 weights, FP8 activations).

compressed-tensors picks this format for any int-weight scheme with `input_activations`; the
tensors are `weight` (int8 codes) and `weight_scale` (symmetric: no zero point), and with static int8
activations `input_scale` [1].
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.core.registry import FORMATS
from quantkit.errors import CheckpointError
from quantkit.formats.base import QuantFormat
from quantkit.qmodules.int_act_linear import IntActLinear
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.schemes import ActivationScheme, QuantScheme


class IntQuantized(QuantFormat):
    name = "int-quantized"

    def supports(self, scheme: QuantScheme) -> bool:
        return scheme.activation_quantized

    def build_module(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module:
        return IntActLinear.from_quantized(qw, bias)

    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        return IntActLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, scale_dtype)

    def weights_config(self, scheme: QuantScheme) -> dict:
        return {
            "num_bits": scheme.num_bits, "type": "int", "symmetric": True, "strategy": scheme.strategy,
            "group_size": scheme.group_size, "block_structure": None, "dynamic": False, "actorder": scheme.actorder,
            "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None,
        }

    def activations_config(self, scheme: QuantScheme) -> Optional[dict]:
        acts = scheme.input_activations
        return {
            "num_bits": 8, "type": acts.type, "symmetric": True, "strategy": acts.strategy, "group_size": None,
            "block_structure": None, "dynamic": acts.dynamic, "actorder": None,
            "observer": None if acts.dynamic else "minmax", "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None,
        }

    def scheme_from_config(self, group: str, weights: dict, input_activations: Optional[dict] = None) -> QuantScheme:
        where = f"config_groups.{group}"
        if not input_activations:
            raise CheckpointError(f"{where}: int-quantized without input_activations (weight-only int weights) "
                                  "is not supported; quantkit writes those as pack-quantized")
        acts_type = input_activations.get("type", "int")
        if input_activations.get("num_bits", 8) != 8 or acts_type not in ("int", "float"):
            raise CheckpointError(f"{where}.input_activations: only 8-bit int or FP8 activations are supported")
        acts_strategy, dynamic = input_activations.get("strategy"), input_activations.get("dynamic")
        if (acts_strategy, bool(dynamic)) not in (("token", True), ("tensor", False)) or \
                (acts_strategy == "tensor" and acts_type != "int"):
            raise CheckpointError(f"{where}.input_activations: strategy {acts_strategy!r} with dynamic={dynamic} is not "
                                  "supported; supported: token (dynamic), and tensor (static) for int8")
        if not input_activations.get("symmetric", True) or not weights.get("symmetric", True):
            raise CheckpointError(f"{where}: asymmetric int-quantized weights or activations are not supported")
        if weights.get("type", "int") != "int":
            raise CheckpointError(f"{where}.weights: int-quantized needs type int")
        strategy = weights.get("strategy") or ("group" if (weights.get("group_size") or 0) > 0 else "channel")
        try:
            return QuantScheme(num_bits=weights["num_bits"], symmetric=True, strategy=strategy,
                               group_size=weights.get("group_size") if strategy == "group" else None,
                               actorder="static" if weights.get("actorder") in ("static", "weight") else None,
                               input_activations=ActivationScheme(type=acts_type, strategy=acts_strategy))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None


FORMATS.add(IntQuantized.name, IntQuantized())
