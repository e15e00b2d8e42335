"""Round-to-nearest (RTN): min/max scales per channel or group, no calibration data needed."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.quant import ggml
from quantkit.quant.intq import QuantizedWeight, rtn
from quantkit.core.registry import ALGORITHMS


class RTNConfig(AlgorithmConfig):
    """RTN takes no arguments: the scheme says everything."""


@ALGORITHMS.register("rtn")
class RTN(Algorithm):
    name = "rtn"
    Config = RTNConfig
    needs_calibration = False

    def quantize_layer(
        self, linears: dict[str, nn.Linear], groups: list[list[str]], scale_dtype: torch.dtype
    ) -> dict[str, QuantizedWeight]:
        assert self.scheme is not None, "RTN needs a scheme"
        if ggml.is_block_grid(self.scheme):  # ggml's own parameter rule (llama-quantize without an imatrix)
            return {name: ggml.nearest(lin.weight.data, self.scheme) for name, lin in linears.items()}
        return {name: rtn(lin.weight.data, self.scheme, scale_dtype) for name, lin in linears.items()}
