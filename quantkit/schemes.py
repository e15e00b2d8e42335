"""Quantization schemes: what a quantized weight is (bits, type, symmetry, granularity), plus presets.

Field names follow compressed-tensors' `QuantizationArgs` so a scheme maps 1:1 onto the
`weights` entry of a checkpoint's `config_groups`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, model_validator

from quantkit.errors import RecipeError


class QuantScheme(BaseModel):
    """Weight quantization scheme; validated so that every instance is usable as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: int = 4
    type: Literal["int"] = "int"  # float (FP8) arrives with the FP8 plugin
    symmetric: bool = True
    strategy: Literal["channel", "group"] = "group"
    group_size: Optional[int] = 128  # columns sharing one scale; only for strategy "group"
    actorder: Optional[Literal["static"]] = None  # GPTQ column order; "static" keeps groups contiguous

    @model_validator(mode="after")
    def _check(self) -> "QuantScheme":
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
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def group_count(self, in_features: int) -> int:
        return 1 if self.strategy == "channel" else in_features // self.group_size

    def short(self) -> str:
        gran = "channel" if self.strategy == "channel" else f"g{self.group_size}"
        order = " actorder" if self.actorder else ""
        return f"int{self.num_bits} {'sym' if self.symmetric else 'asym'} {gran}{order}"


# Named presets are data: a recipe says `scheme: W4A16` or `scheme: {preset: W4A16, group_size: 64}`.
PRESETS: dict[str, dict] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
}


def resolve_scheme(preset: Optional[str], overrides: dict) -> QuantScheme:
    """Merge a preset with explicit fields; explicit fields win."""
    fields: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise RecipeError(f"unknown scheme preset {preset!r}; known presets: {', '.join(PRESETS)}")
        fields.update(PRESETS[preset])
    fields.update(overrides)
    if fields.get("strategy") == "channel" and "group_size" not in overrides:
        fields["group_size"] = None
    return QuantScheme(**fields)
