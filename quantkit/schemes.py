"""Quantization schemes: what a quantized weight is (bits, type, symmetry, granularity), plus presets.

Field names follow compressed-tensors' `QuantizationArgs` so a scheme maps 1:1 onto the
`weights` entry of a checkpoint's `config_groups`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, field_validator, model_validator

from quantkit.errors import RecipeError
from quantkit.validation import StrictModel


class ActivationScheme(StrictModel):
    """FP8 input-activation quantization of a linear (compressed-tensors' `input_activations`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: Literal[8] = 8
    type: Literal["float"] = "float"
    strategy: Literal["token", "tensor"] = "token"  # token: per-token scales at run time; tensor: one static scale
    dynamic: Optional[bool] = None  # implied by the strategy (token: dynamic, tensor: static)
    observer: Literal["minmax", "mse"] = "minmax"  # static scales only: absmax / 448, or the MSE-best shrink of it

    @model_validator(mode="after")
    def _check(self) -> "ActivationScheme":
        implied = self.strategy == "token"
        if self.dynamic is None:
            object.__setattr__(self, "dynamic", implied)
        elif self.dynamic != implied:
            raise ValueError(f"activation strategy {self.strategy!r} is {'dynamic' if implied else 'static'} here; "
                             f"drop `dynamic` or use strategy {'tensor' if implied else 'token'}")
        return self


class QuantScheme(StrictModel):
    """Weight quantization scheme (plus, for FP8, the input activations'); validated so that every
    instance is usable as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: int = 4
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Literal["channel", "group", "tensor", "block"] = "group"
    group_size: Optional[int] = 128  # columns sharing one scale; only for strategy "group"
    block_structure: Optional[tuple[int, int]] = None  # [rows, cols] sharing one scale; only for strategy "block"
    actorder: Optional[Literal["static"]] = None  # GPTQ column order; "static" keeps groups contiguous
    input_activations: Optional[ActivationScheme] = None  # FP8 only: None = weight-only (16-bit activations)
    observer: Literal["minmax", "mse"] = "minmax"  # FP8 weight scales: absmax / 448, or the MSE-best shrink of it

    @model_validator(mode="before")
    @classmethod
    def _no_default_group(cls, data):
        if isinstance(data, dict) and data.get("strategy") in ("channel", "tensor", "block") and "group_size" not in data:
            data = {**data, "group_size": None}
        return data

    @field_validator("block_structure", mode="before")
    @classmethod
    def _block_list(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check(self) -> "QuantScheme":
        if self.type == "float":
            if self.num_bits != 8 or not self.symmetric:
                raise ValueError("float weights are FP8 e4m3: num_bits 8, symmetric")
            if self.strategy not in ("tensor", "channel", "block"):
                raise ValueError(f"FP8 weights take strategy tensor, channel or block, not {self.strategy!r}")
            if self.group_size is not None:
                raise ValueError("FP8 weights take no group_size; use strategy block with block_structure [128, 128]")
            if (self.strategy == "block") != (self.block_structure is not None):
                raise ValueError("strategy 'block' needs block_structure (e.g. [128, 128]), and only it takes one")
            if self.block_structure is not None and min(self.block_structure) <= 0:
                raise ValueError(f"block_structure {list(self.block_structure)} must be positive")
            return self
        if self.input_activations is not None:
            raise ValueError("activation quantization is FP8 only here: int weights run with 16-bit activations")
        if self.observer != "minmax":
            raise ValueError("observer 'mse' is for FP8 weights; int weights get their clipping from the "
                             "algorithm (AWQ's clip search, GPTQ's error compensation)")
        if self.strategy not in ("channel", "group"):
            raise ValueError(f"int weights take strategy group or channel, not {self.strategy!r}")
        if self.block_structure is not None:
            raise ValueError("block_structure is for FP8 block weights")
        if self.num_bits not in (2, 4, 8):
            raise ValueError(f"num_bits={self.num_bits} is not supported; use 2, 4 or 8")
        if self.strategy == "group":
            if self.group_size is None or self.group_size <= 0:
                raise ValueError("strategy 'group' needs a positive group_size (e.g. 32, 64, 128)")
        elif self.group_size is not None:
            raise ValueError(f"strategy 'channel' takes no group_size (got {self.group_size}); "
                             "drop it or use strategy 'group'")
        return self

    @property
    def is_fp8(self) -> bool:
        return self.type == "float"

    @property
    def has_static_input(self) -> bool:
        """Activations quantized with a static (calibrated) scale."""
        return self.input_activations is not None and not self.input_activations.dynamic

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def group_count(self, in_features: int) -> int:
        return 1 if self.strategy == "channel" else in_features // self.group_size

    def short(self) -> str:
        order = " actorder" if self.actorder else ""
        if self.is_fp8:
            gran = f"block{list(self.block_structure)}" if self.strategy == "block" else self.strategy
            act = self.input_activations
            acts = "a16" if act is None else f"a8 {'dynamic per-token' if act.dynamic else f'static {act.observer}'}"
            return f"fp8 {gran}{' mse' if self.observer == 'mse' else ''}{order} {acts}"
        gran = "channel" if self.strategy == "channel" else f"g{self.group_size}"
        return f"int{self.num_bits} {'sym' if self.symmetric else 'asym'} {gran}{order}"


# Named presets are data: a recipe says `scheme: W4A16` or `scheme: {preset: W4A16, group_size: 64}`.
PRESETS: dict[str, dict] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    # FP8 e4m3 (compressed-tensors float-quantized): per-channel weights + dynamic per-token activations,
    # per-tensor weights + a static per-tensor activation scale, 128x128 blocks + dynamic per-token
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="channel", group_size=None,
                        input_activations={"strategy": "token"}),
    "FP8": dict(num_bits=8, type="float", strategy="tensor", group_size=None,
                input_activations={"strategy": "tensor", "observer": "minmax"}),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="block", group_size=None, block_structure=[128, 128],
                      input_activations={"strategy": "token"}),
    "FP8_WEIGHT": dict(num_bits=8, type="float", strategy="channel", group_size=None),
}


def resolve_scheme(preset: Optional[str], overrides: dict) -> QuantScheme:
    """Merge a preset with explicit fields; explicit fields win."""
    fields: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise RecipeError(f"unknown scheme preset {preset!r}; known presets: {', '.join(PRESETS)}")
        fields.update(PRESETS[preset])
    base_acts = fields.get("input_activations")
    fields.update(overrides)
    if isinstance(base_acts, dict) and isinstance(overrides.get("input_activations"), dict):
        fields["input_activations"] = {**base_acts, **overrides["input_activations"]}  # override single fields
    if fields.get("strategy") in ("channel", "tensor", "block") and "group_size" not in overrides:
        fields["group_size"] = None
    return QuantScheme(**fields)
