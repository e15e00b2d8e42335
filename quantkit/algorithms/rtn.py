"""Round-to-nearest (RTN): min/max scales per channel or group, no calibration data needed.

Microscaled float schemes (NVFP4, MXFP4, MXFP8) round with their format's own scale rule
(`quant.microscale`), NVFP4's linears that read one input sharing a global scale. NVFP4 activations' global
scale and static per-tensor int8 activation scales (W8A8 static) come from the calibration inputs (then, and
only then, this stage reads data).
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.algorithms.fp8 import StaticInputScales
from quantkit.quant import ggml, microscale
from quantkit.quant.intq import QuantizedWeight, rtn
from quantkit.core.registry import ALGORITHMS


class RTNConfig(AlgorithmConfig):
    """RTN takes no arguments: the scheme says everything."""


@ALGORITHMS.register("rtn")
class RTN(Algorithm):
    name = "rtn"
    Config = RTNConfig
    needs_calibration = False
    supports_micro = True

    def __init__(self, config: RTNConfig, scheme):
        super().__init__(config, scheme)
        self._inputs = StaticInputScales(scheme, 1024, 0) if scheme is not None and \
            (scheme.needs_input_global or scheme.has_static_input) else None

    def needs_data(self) -> bool:
        # NVFP4 activations' global scale, static int8 activation scales: from the calibration inputs (unless given)
        return self.needs_calibration or (self._inputs is not None and self._inputs.given is None)

    def take_input_scales(self, scales: dict[str, torch.Tensor]) -> None:
        if self._inputs is not None:
            self._inputs.give(scales)

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        self._leader = {name: group[0] for group in groups for name in group}
        if self._inputs is not None:
            self._inputs.clear()

    def observe(self, name: str, x: torch.Tensor) -> None:
        if self._inputs is not None and self._leader.get(name, name) == name:
            self._inputs.add(name, x)

    def quantize_layer(
        self, linears: dict[str, nn.Linear], groups: list[list[str]], scale_dtype: torch.dtype
    ) -> dict[str, QuantizedWeight]:
        assert self.scheme is not None, "RTN needs a scheme"
        if self.scheme.is_micro:
            return self._micro(linears, groups)
        if ggml.is_block_grid(self.scheme):  # ggml's own parameter rule (llama-quantize without an imatrix)
            return {name: ggml.nearest(lin.weight.data, self.scheme) for name, lin in linears.items()}
        out = {name: rtn(lin.weight.data, self.scheme, scale_dtype) for name, lin in linears.items()}
        if self._inputs is not None:  # static int8 activations (W8A8): one scale per input-sharing group
            for group in groups:
                scale = self._inputs.scale(group[0], scale_dtype)
                for name in group:
                    out[name].input_scale = scale
        return out

    def _micro(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> dict:
        out = {}
        for group in groups:
            weights = microscale.quantize_group([linears[n].weight.data for n in group], self.scheme)
            input_global = self._inputs.global_scale(group[0]) if self._inputs is not None else None
            for name, qw in zip(group, weights):
                qw.input_global_scale = input_global
                out[name] = qw
        return out
