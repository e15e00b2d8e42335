"""The Algorithm contract that the sequential pipeline drives, one decoder layer at a time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from quantkit.quant.intq import QuantizedWeight
from quantkit.schemes import QuantScheme


class AlgorithmConfig(BaseModel):
    """Base of every algorithm's `args`; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Algorithm(ABC):
    """One recipe stage. Lifecycle per decoder layer, driven by the pipeline:

    1. `begin_layer(linears, groups)`;
    2. if `needs_calibration`: `observe(name, x)` is called with the input of every targeted
       linear for every calibration batch (x: [batch, seq, in_features]);
    3. `quantize_layer(...)` returns the quantized weights of that layer's targeted linears;
       per-module figures it wants logged go into `self.report[name]`.
    """

    name: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    needs_calibration: ClassVar[bool] = False
    produces_weights: ClassVar[bool] = True  # False for transforms that only rewrite float weights
    supports_actorder: ClassVar[bool] = False  # may the scheme say actorder: static

    def __init__(self, config: AlgorithmConfig, scheme: Optional[QuantScheme]):
        self.config = config
        self.scheme = scheme
        self.report: dict[str, dict] = {}

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        """Called before the layer's calibration forward; `groups` as in quantize_layer."""

    def observe(self, name: str, x: torch.Tensor) -> None:
        """Collect statistics from one calibration batch's input to linear `name`."""

    @abstractmethod
    def quantize_layer(
        self,
        linears: dict[str, nn.Linear],
        groups: list[list[str]],
        scale_dtype: torch.dtype,
    ) -> dict[str, QuantizedWeight]:
        """Quantize one decoder layer's targeted linears (full names -> modules).

        `groups` partitions the names into linears that read the same input.
        """
