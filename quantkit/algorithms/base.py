"""The Algorithm contract that the sequential pipeline drives, one decoder layer at a time."""

from __future__ import annotations

import copy
from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Optional

import torch
from pydantic import ConfigDict
from torch import nn

from quantkit.quant.fp8 import Fp8Weight
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.schemes import QuantScheme
from quantkit.core.validation import StrictModel

if TYPE_CHECKING:
    from quantkit.arch.adapter import ArchitectureAdapter


@dataclass
class LayerContext:
    """What a transform stage gets for one decoder layer (see `Algorithm.transform_layer`)."""

    layer: nn.Module
    prefix: str  # full name of the layer + ".", e.g. "model.layers.3."
    linears: dict[str, nn.Linear]  # the stage's targets in this layer, by full name
    schemes: dict[str, QuantScheme]  # how the stage that quantizes each target will quantize it
    hidden: list[torch.Tensor]  # the layer's calibration inputs, per batch
    kwargs: list[dict]  # the layer's keyword arguments, per batch
    adapter: "ArchitectureAdapter"
    scale_dtype: torch.dtype


KINDS = ("weights", "transform", "attention")
Kind = Literal["weights", "transform", "attention"]


class AlgorithmConfig(StrictModel):
    """Base of every algorithm's `args`; unknown keys are errors, booleans are not numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Algorithm(ABC):
    """One recipe stage. Lifecycle per decoder layer, driven by the pipeline:

    1. `begin_layer(linears, groups)`;
    2. if `needs_calibration`: `observe(name, x)` is called with the input of every targeted
       linear for every calibration batch (x: [batch, seq, in_features]);
    3. `quantize_layer(...)` returns the quantized weights of that layer's targeted linears;
       per-module figures it wants logged go into `self.report[name]`.

    An algorithm declares its `kind`:
    - "weights" (RTN, GPTQ, FP8): quantizes its target linears to its scheme (steps 1-3);
    - "transform" (AWQ scaling): no scheme of its own; the pipeline gives it, per target, the scheme of
      the later stage that quantizes that target, and calls `transform_layer(ctx)` instead of steps 1-3;
    - "attention" (KV-cache scales): no linear targets and no scheme; after a layer's weights are
      quantized, `calibrate_layer(...)` observes its attention's keys and values.
    and whether it needs calibration data: `needs_calibration`, or `needs_data()` where that depends on
    the stage's scheme (FP8 with static input scales does, dynamic FP8 does not).
    """

    name: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    kind: ClassVar[Kind] = "weights"
    needs_calibration: ClassVar[bool] = False
    produces_weights: ClassVar[bool] = True  # derived from kind (kind == "weights"); kept for readers
    supports_actorder: ClassVar[bool] = False  # may the scheme say actorder: static
    supports_int: ClassVar[bool] = True  # quantizes int schemes
    supports_fp8: ClassVar[bool] = False  # quantizes FP8 (e4m3) schemes
    supports_micro: ClassVar[bool] = False  # quantizes microscaled float schemes (NVFP4, MXFP4, MXFP8)
    any_grid: ClassVar[bool] = False  # a transform that prepares weights for every grid (int, FP8, ggml, NVFP4)
    rewrites_outside: ClassVar[bool] = False  # a transform whose `transform_model` rewrites embeddings / lm_head

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__ and cls.__dict__.get("produces_weights") is False:
            cls.kind = "transform"  # a plugin written before `kind`: produces_weights = False meant a transform
        if cls.kind not in KINDS:
            raise TypeError(f"algorithm {cls.__name__}: kind {cls.kind!r} is not one of {', '.join(KINDS)}")
        cls.produces_weights = cls.kind == "weights"

    def needs_data(self) -> bool:
        """Whether this stage needs calibration data (for its scheme)."""
        return self.needs_calibration

    def take_input_scales(self, scales: dict[str, torch.Tensor]) -> None:
        """Static activation scales given per linear (`input_scale` / `input_global_scale`, as a run of the same
        scheme wrote them) to take instead of calibrating them: round-to-nearest stages (`rtn`, `fp8`) take them
        and then need no data for them (the domain check's counterpart takes its run's); others ignore them."""

    def true_sequential(self) -> bool:
        """Whether each input-sharing group is to be calibrated on the inputs the layer makes with the groups
        before it already quantized (one lock-step forward per layer, `calibration.lockstep`): then `observe`
        sees only the inputs of groups not yet quantized, and `quantize_layer` is called once per group, in
        the order the layer reaches them."""
        return False

    def __init__(self, config: AlgorithmConfig, scheme: Optional[QuantScheme]):
        self.config = config
        self.scheme = scheme
        self.report: dict[str, dict] = {}

    def for_scheme(self, scheme: QuantScheme) -> "Algorithm":
        """This stage with another scheme, for the layers that get it (a fallback group size): it shares
        this one's statistics of the current layer and its report."""
        clone = copy.copy(self)
        clone.scheme = scheme
        return clone

    @classmethod
    def quantizes(cls, scheme: QuantScheme) -> bool:
        """Whether this algorithm can quantize weights to `scheme` (int, FP8 or microscaled)."""
        if scheme.is_micro:
            return cls.produces_weights and cls.supports_micro
        return cls.produces_weights and (cls.supports_fp8 if scheme.is_fp8 else cls.supports_int)

    def transform_model(self, model: nn.Module, adapter: "ArchitectureAdapter") -> None:
        """For transforms: rewrite what lies outside the decoder layers (embeddings, final norm, lm_head) once,
        before the first layer's calibration inputs are captured. Most transforms need nothing here."""

    def transform_layer(self, ctx: LayerContext) -> None:
        """For transforms (`produces_weights = False`): rewrite the layer's float weights in place,
        leaving its function (nearly) unchanged. Called instead of observe/quantize_layer."""
        raise NotImplementedError(f"{self.name} is a transform stage but does not implement transform_layer")

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        """Called before the layer's calibration forward; `groups` as in quantize_layer."""

    def observe(self, name: str, x: torch.Tensor) -> None:
        """Collect statistics from one calibration batch's input to linear `name`."""

    def quantize_layer(
        self,
        linears: dict[str, nn.Linear],
        groups: list[list[str]],
        scale_dtype: torch.dtype,
    ) -> dict[str, "QuantizedWeight | Fp8Weight"]:
        """Quantize one decoder layer's targeted linears (full names -> modules).

        `groups` partitions the names into linears that read the same input.
        """
        raise NotImplementedError(f"{self.name} produces weights but does not implement quantize_layer")
