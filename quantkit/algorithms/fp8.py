"""FP8 (e4m3) weights, and the input activations' static scales, as a pipeline stage.

Weights: scales per tensor, channel or block from the absmax or its MSE-best shrink (the
scheme's `observer`; `quantkit.quant.fp8`). Activations:
dynamic per-token schemes need nothing at quantization time (the stage then runs without
calibration data); static per-tensor schemes observe every calibration input of each linear and
set its `input_scale` from the absmax (observer `minmax`) or the MSE-best shrink of it (`mse`,
over a random sample of the input values).
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
from pydantic import Field
from torch import nn

from quantkit.calibration import distributed
from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.errors import QuantizationError
from quantkit.quant.fp8 import Fp8Weight, InputScaleObserver, quantize_weight
from quantkit.quant.microscale import nvfp4_global_scale
from quantkit.kernels.reference import int8_static_scale
from quantkit.core.registry import ALGORITHMS


class FP8Config(AlgorithmConfig):
    mse_samples: int = Field(1 << 16, ge=1024)  # input values kept per linear for the mse observer
    seed: int = 0


@ALGORITHMS.register("fp8")
class FP8(Algorithm):
    name = "fp8"
    Config = FP8Config
    supports_int = False
    supports_fp8 = True
    config: FP8Config

    def __init__(self, config: FP8Config, scheme):
        super().__init__(config, scheme)
        if scheme is None or not scheme.is_fp8:
            raise QuantizationError("the fp8 stage needs an FP8 scheme: FP8_DYNAMIC, FP8, FP8_BLOCK or FP8_WEIGHT")
        self._inputs = StaticInputScales(scheme, config.mse_samples, config.seed)

    def needs_data(self) -> bool:
        # dynamic or weight-only, or static scales given: no calibration data at all
        return self.scheme.has_static_input and self._inputs.given is None

    def take_input_scales(self, scales: dict[str, torch.Tensor]) -> None:
        self._inputs.give(scales)

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        self._inputs.clear()

    def observe(self, name: str, x: torch.Tensor) -> None:
        self._inputs.add(name, x)

    def quantize_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]],
                       scale_dtype: torch.dtype) -> dict[str, Fp8Weight]:
        out = {}
        for name, lin in linears.items():
            qw = nearest_fp8(lin.weight.data, self.scheme, scale_dtype)
            if self.scheme.has_static_input:
                qw.input_scale = self._inputs.scale(name, scale_dtype)
                self.report[name] = {"input_scale": float(qw.input_scale)}
            out[name] = qw
        return out


def nearest_fp8(weight: torch.Tensor, scheme, scale_dtype: torch.dtype) -> Fp8Weight:
    """The scheme's FP8 weight by nearest rounding (scales from its observer)."""
    qw = quantize_weight(weight, scheme.strategy, scale_dtype, scheme.block_structure, scheme.observer)
    qw.scheme = scheme
    return qw


class StaticInputScales:
    """Per-linear static activation scales for an FP8 scheme with a static `input_activations`
    (observer from the scheme), or NVFP4 activations' global scales (from the inputs' absmax); a stage
    keeps one and feeds it the inputs it observes."""

    def __init__(self, scheme, samples: int, seed: int):
        acts = scheme.input_activations
        self._observer = acts.observer if scheme.has_static_input else "minmax" if scheme.needs_input_global else None
        self._samples = samples
        self._seed = seed
        self._int8 = scheme.has_static_input and acts.type == "int"  # static int8: absmax / 127
        self._by_name: dict[str, InputScaleObserver] = {}
        self.given: Optional[dict[str, torch.Tensor]] = None  # {linear: its scale}, taken instead of observed

    def give(self, scales: dict[str, torch.Tensor]) -> None:
        """Take these scales (a run's `input_scale` / `input_global_scale` per linear) instead of observing inputs."""
        self.given = dict(scales)

    def clear(self) -> None:
        self._by_name.clear()

    def add(self, name: str, x: torch.Tensor) -> None:
        if self._observer is None or self.given is not None:
            return
        if name not in self._by_name:
            # a generator per linear, seeded from its name: its samples do not depend on which layers ran
            # before it in this process (a resumed run draws the same ones)
            gen = torch.Generator().manual_seed((self._seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
            self._by_name[name] = InputScaleObserver(self._observer, self._samples, gen)
        self._by_name[name].add(x)

    def scale(self, name: str, scale_dtype: torch.dtype) -> torch.Tensor:
        """The static input scale of `name`; in a distributed run a collective call: every rank asks for the
        same names in the same order and gets the scale of all ranks' inputs."""
        if self.given is not None:
            return self._given(name).to(scale_dtype).reshape(1)
        observer = self._reduced(name)
        if self._int8:
            return int8_static_scale(observer.absmax, scale_dtype)
        return observer.scale(scale_dtype)

    def global_scale(self, name: str) -> torch.Tensor:
        """NVFP4 activations: the global scale (float32 [1]) of `name`'s inputs, 448 * 6 / absmax (collective,
        as `scale`)."""
        if self.given is not None:
            return self._given(name).float().reshape(1)
        return nvfp4_global_scale(self._reduced(name).absmax)

    def _given(self, name: str) -> torch.Tensor:
        if name not in self.given:
            raise QuantizationError(f"{name}: no activation scale was given for it (given for {len(self.given)} "
                                    "linears); calibrate instead")
        return self.given[name].detach().clone()

    def _reduced(self, name: str) -> InputScaleObserver:
        if name not in self._by_name:
            raise QuantizationError(f"{name}: no calibration input was observed for its static activation scale")
        world = distributed.current()
        if world.active:
            self._by_name[name].reduce(lambda t: world.max_(t, f"{name}: input absmax"),
                                       lambda t: world.gather_(t, f"{name}: mse input sample"))
        return self._by_name[name]
