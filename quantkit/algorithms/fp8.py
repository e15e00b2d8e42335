"""FP8 (e4m3) weights, and the input activations' static scales, as a pipeline stage.

Weights: scales per tensor, channel or block from the absmax or its MSE-best shrink (the
scheme's `observer`; `quantkit.quant.fp8`). Activations:
dynamic per-token schemes need nothing at quantization time (the stage then runs without
calibration data); static per-tensor schemes observe every calibration input of each linear and
set its `input_scale` from the absmax (observer `minmax`) or the MSE-best shrink of it (`mse`,
over a random sample of the input values).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.errors import QuantizationError
from quantkit.quant.fp8 import Fp8Weight, mse_scale, quantize_weight, scale_from_absmax
from quantkit.registry import ALGORITHMS


class FP8Config(AlgorithmConfig):
    mse_samples: int = Field(1 << 16, ge=1024)  # input values kept per linear for the mse observer
    seed: int = 0


@ALGORITHMS.register("fp8")
class FP8(Algorithm):
    name = "fp8"
    Config = FP8Config
    supports_fp8 = True
    config: FP8Config

    def __init__(self, config: FP8Config, scheme):
        super().__init__(config, scheme)
        if scheme is None or not scheme.is_fp8:
            raise QuantizationError("the fp8 stage needs an FP8 scheme: FP8_DYNAMIC, FP8, FP8_BLOCK or FP8_WEIGHT")
        acts = scheme.input_activations
        self.static = acts is not None and not acts.dynamic
        self.needs_calibration = self.static  # dynamic or weight-only: no calibration data at all
        self._absmax: dict[str, torch.Tensor] = {}
        self._samples: dict[str, list[torch.Tensor]] = {}
        self._gen = torch.Generator().manual_seed(config.seed)

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        self._absmax.clear()
        self._samples.clear()

    def observe(self, name: str, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1)
        m = x.abs().amax()
        self._absmax[name] = torch.maximum(self._absmax[name], m) if name in self._absmax else m
        if self.scheme.input_activations.observer == "mse":
            keep = min(x.numel(), self.config.mse_samples)
            idx = torch.randint(0, x.numel(), (keep,), generator=self._gen)
            self._samples.setdefault(name, []).append(x[idx])

    def quantize_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]],
                       scale_dtype: torch.dtype) -> dict[str, Fp8Weight]:
        out = {}
        block = self.scheme.block_structure
        for name, lin in linears.items():
            qw = quantize_weight(lin.weight.data, self.scheme.strategy, scale_dtype, block, self.scheme.observer)
            qw.scheme = self.scheme
            if self.static:
                if name not in self._absmax:
                    raise QuantizationError(f"{name}: no calibration input was observed for its static activation scale")
                absmax = self._absmax[name]
                if self.scheme.input_activations.observer == "mse":
                    samples = torch.cat(self._samples[name])
                    if samples.numel() > self.config.mse_samples:  # an even subsample of every batch's sample
                        samples = samples[torch.randperm(samples.numel(), generator=self._gen)[: self.config.mse_samples]]
                    qw.input_scale = mse_scale(torch.cat([samples, absmax.reshape(1)]), float(absmax), scale_dtype)
                else:
                    qw.input_scale = scale_from_absmax(absmax.reshape(1), scale_dtype)
                self.report[name] = {"input_scale": float(qw.input_scale)}
            out[name] = qw
        return out
