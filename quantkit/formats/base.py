"""The QuantFormat contract: one compressed-tensors format name <-> one quantized module type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.schemes import QuantScheme


class QuantFormat(ABC):
    """A named, versioned on-disk layout for quantized linear modules."""

    name: ClassVar[str]

    @abstractmethod
    def supports(self, scheme: QuantScheme) -> bool: ...

    @abstractmethod
    def build_module(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module:
        """The in-memory quantized module holding `qw` (its state_dict is what is saved).

        The module must have `dequantize(dtype) -> Tensor` returning the weight it computes with.
        """

    @abstractmethod
    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        """A module shaped like `linear`, ready for `load_state_dict` from a checkpoint."""

    @abstractmethod
    def weights_config(self, scheme: QuantScheme) -> dict:
        """The `weights` entry of a config group (compressed-tensors QuantizationArgs)."""

    def activations_config(self, scheme: QuantScheme) -> dict | None:
        """The group's `input_activations` entry (None: activations stay in 16 bits)."""
        return None

    @abstractmethod
    def scheme_from_config(self, group: str, weights: dict, input_activations: dict | None = None) -> QuantScheme:
        """Parse a config group's `weights` (and `input_activations`), rejecting what this format cannot run."""
