"""Quantization schemes: what a quantized weight is (bits, type, symmetry, granularity), plus presets.

Field names follow compressed-tensors' `QuantizationArgs` so a scheme maps 1:1 onto the
`weights` entry of a checkpoint's `config_groups`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch
from pydantic import ConfigDict, field_validator, model_validator

from quantkit.errors import RecipeError
from quantkit.core.validation import StrictModel


class ActivationScheme(StrictModel):
    """Input-activation quantization of a linear (compressed-tensors' `input_activations`): FP8 e4m3
    (type float) or symmetric int8 (type int: s = absmax / 127, codes rounded half to even and saturated
    to [-128, 127], as vLLM's int8 kernels quantize) per token (dynamic) or tensor (one static scale from
    calibration); or microscaled floats per group
    of the hidden dimension (`quant.microscale`): NVFP4's (strategy tensor_group, group 16, dynamic
    "local": group scales at run time under a calibrated global scale) and MX's (strategy group, group 32,
    dynamic)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: Literal[4, 8] = 8
    type: Literal["float", "int"] = "float"
    strategy: Literal["token", "tensor", "group", "tensor_group"] = "token"  # token: per-token scales at run
    # time; tensor: one static scale; group / tensor_group: microscaled (above)
    group_size: Optional[int] = None  # group strategies only
    dynamic: Optional[Union[bool, Literal["local"]]] = None  # implied by the strategy
    observer: Literal["minmax", "mse"] = "minmax"  # static scales only: absmax / 448, or the MSE-best shrink of it

    @model_validator(mode="after")
    def _check(self) -> "ActivationScheme":
        if self.strategy in ("group", "tensor_group"):
            return self._check_micro()
        if self.num_bits != 8 or self.group_size is not None:
            raise ValueError(f"{self.strategy} activations take 8 bits and no group_size")
        if self.type == "int" and self.strategy == "tensor" and self.observer != "minmax":
            raise ValueError("static int8 activation scales take observer minmax (absmax / 127)")
        implied = self.strategy == "token"
        if self.dynamic is None:
            object.__setattr__(self, "dynamic", implied)
        elif self.dynamic != implied:
            raise ValueError(f"activation strategy {self.strategy!r} is {'dynamic' if implied else 'static'} here; "
                             f"drop `dynamic` or use strategy {'tensor' if implied else 'token'}")
        return self

    def _check_micro(self) -> "ActivationScheme":
        nv = self.strategy == "tensor_group"
        want = (4, 16, "local") if nv else (self.num_bits, 32, True)
        if self.type != "float" or (self.num_bits, self.group_size) != want[:2]:
            raise ValueError(f"{self.strategy} activations are {'NVFP4: 4-bit floats in groups of 16' if nv else 'MX: 4- or 8-bit floats in groups of 32'} "
                             f"(got type {self.type}, {self.num_bits} bits, group_size {self.group_size})")
        if self.dynamic is None:
            object.__setattr__(self, "dynamic", want[2])
        elif self.dynamic != want[2]:
            raise ValueError(f"{self.strategy} activations are dynamic={want[2]!r} (got {self.dynamic!r})")
        return self

    @property
    def microscaled(self) -> bool:
        return self.strategy in ("group", "tensor_group")


class QuantScheme(StrictModel):
    """Weight quantization scheme (plus, for FP8, the input activations'); validated so that every
    instance is usable as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: int = 4
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Literal["channel", "group", "tensor", "block", "tensor_group"] = "group"
    group_size: Optional[int] = 128  # columns sharing one scale; only for strategy "group"
    block_structure: Optional[tuple[int, int]] = None  # [rows, cols] sharing one scale; only for strategy "block"
    # GPTQ column order: "static" keeps groups contiguous; "group" (read from checkpoints only: AutoGPTQ's desc_act,
    # compressed-tensors' weight_g_idx) puts column j in group g_idx[j]
    actorder: Optional[Literal["static", "group"]] = None
    # None = weight-only (16-bit activations); FP8 weights take FP8 activations, int8 weights int8 ones (W8A8),
    # symmetric grouped int4 weights FP8 ones (W4AFP8)
    input_activations: Optional[ActivationScheme] = None
    observer: Literal["minmax", "mse"] = "minmax"  # FP8 weight scales: absmax / 448, or the MSE-best shrink of it
    # a GGUF grid (`quantkit.gguf`): ggml's own scale rule on group 32 with fp16 scales, so the codes are the
    # file's codes. q4_0 (x = d (q - 8), d = the group's signed extreme / -8) is stored asymmetric with
    # scale |d| and zero point 0 (d > 0) or -1 (d < 0); q8_0 (x = d q, d = absmax / 127) symmetric.
    # q4_1, q5_0, q4_k, q6_k are kept as ggml blocks (`quantkit.quant.ggml`; format ggml-blocks); q4_k_m is
    # llama.cpp's per-tensor mixture, resolved per linear into those grids and q8_0 (`quantkit.gguf.mixture`).
    grid: Optional[Literal["q4_0", "q8_0", "q4_1", "q5_0", "q4_k", "q6_k", "q4_k_m"]] = None
    scale_dtype: Optional[Literal["float16", "bfloat16", "float32"]] = None  # None: the checkpoint's dtype

    @model_validator(mode="before")
    @classmethod
    def _no_default_group(cls, data):
        """The one rule for a group size nobody gave: 128 for strategy group, none for the others."""
        if isinstance(data, dict) and data.get("strategy") in ("channel", "tensor", "block") and "group_size" not in data:
            data = {**data, "group_size": None}
        return data

    @field_validator("block_structure", mode="before")
    @classmethod
    def _block_list(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check(self) -> "QuantScheme":
        if self.actorder == "group" and (self.type != "int" or self.grid is not None or self.strategy != "group"):
            raise ValueError("actorder 'group' (a g_idx per column) is for int weights in groups")
        if self.type == "float" and self.strategy in ("group", "tensor_group"):
            self._check_micro()
            return self
        if self.type == "float":
            if self.num_bits != 8 or not self.symmetric:
                raise ValueError("float weights are FP8 e4m3: num_bits 8, symmetric")
            if self.strategy not in ("tensor", "channel", "block"):
                raise ValueError(f"FP8 weights take strategy tensor, channel or block, not {self.strategy!r}")
            if self.grid is not None or self.scale_dtype is not None:
                raise ValueError("grid and scale_dtype are for int weights (FP8 scales follow the checkpoint dtype)")
            if self.group_size is not None:
                raise ValueError("FP8 weights take no group_size; use strategy block with block_structure [128, 128]")
            if (self.strategy == "block") != (self.block_structure is not None):
                raise ValueError("strategy 'block' needs block_structure (e.g. [128, 128]), and only it takes one")
            if self.block_structure is not None and min(self.block_structure) <= 0:
                raise ValueError(f"block_structure {list(self.block_structure)} must be positive")
            if self.input_activations is not None and self.input_activations.type != "float":
                raise ValueError("FP8 weights take FP8 activations (input_activations type float)")
            return self
        if self.input_activations is not None:
            self._check_int_activations()
        if self.grid is not None:
            self._check_grid()
            if self.grid not in ("q4_0", "q8_0"):
                return self  # ggml's own layouts: the fields above are nominal
        if self.observer != "minmax":
            raise ValueError("observer 'mse' is for FP8 weights; int weights get their clipping from the "
                             "algorithm (AWQ's clip search, GPTQ's error compensation)")
        if self.strategy not in ("channel", "group"):
            raise ValueError(f"int weights take strategy group or channel, not {self.strategy!r}")
        if self.block_structure is not None:
            raise ValueError("block_structure is for FP8 block weights")
        if not 2 <= self.num_bits <= 8:
            raise ValueError(f"num_bits={self.num_bits} is not supported; int weights take 2 to 8 bits")
        if self.strategy == "group":
            if self.group_size is None or self.group_size <= 0:
                raise ValueError("strategy 'group' needs a positive group_size (e.g. 32, 64, 128)")
        elif self.group_size is not None:
            raise ValueError(f"strategy 'channel' takes no group_size (got {self.group_size}); "
                             "drop it or use strategy 'group'")
        return self

    def _check_micro(self) -> None:
        """NVFP4 (tensor_group: 4-bit elements, group 16) or MX (group: 4- or 8-bit elements, group 32), symmetric,
        scales in the format's own type; activations, if any, in the same format."""
        nv = self.strategy == "tensor_group"
        name = "NVFP4" if nv else f"MXFP{self.num_bits}"
        want = (4, 16) if nv else (self.num_bits, 32)
        if (self.num_bits, self.group_size) != want or self.num_bits not in (4, 8):
            raise ValueError(f"float weights in strategy {self.strategy} are {'NVFP4: num_bits 4, group_size 16' if nv else 'MX: num_bits 4 or 8, group_size 32'} "
                             f"(got num_bits {self.num_bits}, group_size {self.group_size}; presets NVFP4A16, "
                             "MXFP4A16, MXFP8A16); FP8 e4m3 weights take strategy tensor, channel or block")
        if not self.symmetric or self.grid is not None or self.scale_dtype is not None or self.block_structure:
            raise ValueError(f"{name} weights are symmetric with the format's own scale type (e4m3 / e8m0): drop "
                             "symmetric, grid, scale_dtype and block_structure")
        if self.observer != "minmax":
            raise ValueError(f"{name} weights take observer minmax (the format's own scale rule)")
        acts = self.input_activations
        if acts is not None and (acts.strategy != self.strategy or acts.num_bits != self.num_bits):
            raise ValueError(f"{name} weights take {name} activations (strategy {self.strategy}, {self.num_bits} bits) "
                             f"or none, not {acts.strategy} {acts.num_bits}-bit ones")

    def _check_int_activations(self) -> None:
        """Int weights with quantized activations: W8A8 (int8 weights, int8 activations) or W4AFP8 (grouped
        int4 weights, FP8 activations), symmetric, outside the GGUF grids."""
        acts = self.input_activations
        if self.grid is not None or not self.symmetric:
            raise ValueError("activation quantization takes symmetric int weights outside the GGUF grids "
                             "(presets W8A8, W4AFP8)")
        if acts.type == "int" and self.num_bits != 8:
            raise ValueError(f"int8 activations take int8 weights (W8A8), not {self.num_bits}-bit ones")
        if acts.type == "float" and (self.num_bits != 4 or self.strategy != "group" or acts.dynamic is not True):
            raise ValueError("FP8 activations with int weights are W4AFP8: 4-bit grouped weights, dynamic "
                             "per-token activations")

    def _check_grid(self) -> None:
        bits, symmetric, group = GRIDS[self.grid]
        if (self.num_bits, self.symmetric, self.strategy, self.group_size) != (bits, symmetric, "group", group):
            raise ValueError(f"grid {self.grid} is {bits}-bit {'symmetric' if symmetric else 'asymmetric'} "
                             f"group {group} (got {self.num_bits}-bit {'symmetric' if self.symmetric else 'asymmetric'} "
                             f"{self.strategy} {self.group_size}): drop the other fields or use preset "
                             f"{self.grid.upper()}")
        if self.scale_dtype not in (None, "float16"):
            raise ValueError(f"grid {self.grid} stores fp16 scales (got scale_dtype {self.scale_dtype})")
        if self.actorder is not None and self.grid not in ("q4_0", "q8_0"):
            raise ValueError(f"grid {self.grid}: actorder needs scales fixed before the solve; only Q4_0 and "
                             "Q8_0 support it")
        object.__setattr__(self, "scale_dtype", "float16")

    def scale_torch_dtype(self, default: torch.dtype) -> torch.dtype:
        """The dtype scales are rounded to: the scheme's own (a GGUF grid's fp16), else `default`."""
        return default if self.scale_dtype is None else getattr(torch, self.scale_dtype)

    @property
    def is_fp8(self) -> bool:
        """FP8 e4m3 with tensor, channel or block scales (compressed-tensors float-quantized)."""
        return self.type == "float" and not self.is_micro

    @property
    def is_micro(self) -> bool:
        """A microscaled float format: NVFP4 (tensor_group) or MXFP4 / MXFP8 (group), `quant.microscale`."""
        return self.type == "float" and self.strategy in ("group", "tensor_group")

    @property
    def micro_name(self) -> str:
        return "nvfp4" if self.strategy == "tensor_group" else f"mxfp{self.num_bits}"

    @property
    def needs_input_global(self) -> bool:
        """NVFP4 activations: their global scale is calibrated on the layer's inputs."""
        return self.input_activations is not None and self.input_activations.dynamic == "local"

    @property
    def activation_quantized(self) -> bool:
        """Int weights whose inputs are quantized too (W8A8, W4AFP8): compressed-tensors `int-quantized`."""
        return self.type == "int" and self.input_activations is not None

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
        if self.actorder == "group":  # a g_idx names each column's group: the last may be short (GPTQ allows it)
            return -(-in_features // self.group_size)
        return 1 if self.strategy == "channel" else in_features // self.group_size

    def short(self) -> str:
        order = " actorder" if self.actorder else ""
        if self.is_micro:
            return f"{self.micro_name}{order} {'a16' if self.input_activations is None else f'a{self.num_bits} dynamic per-group'}"
        if self.is_fp8:
            gran = f"block{list(self.block_structure)}" if self.strategy == "block" else self.strategy
            act = self.input_activations
            acts = "a16" if act is None else f"a8 {'dynamic per-token' if act.dynamic else f'static {act.observer}'}"
            return f"fp8 {gran}{' mse' if self.observer == 'mse' else ''}{order} {acts}"
        if self.grid is not None:
            return f"ggml {self.grid}"
        gran = "channel" if self.strategy == "channel" else f"g{self.group_size}"
        act = self.input_activations
        acts = "" if act is None else \
            f" a8 {'int8' if act.type == 'int' else 'fp8'} {'dynamic per-token' if act.dynamic else 'static per-tensor'}"
        return f"int{self.num_bits} {'sym' if self.symmetric else 'asym'} {gran}{order}{acts}"


# GGUF grids as quantkit int schemes: (num_bits, symmetric, group_size: the columns sharing one step), fp16
# scales for all. q4_0 and q8_0 are compressed-tensors int weights; the others ggml blocks (nominal fields).
GRIDS: dict[str, tuple[int, bool, int]] = {"q4_0": (4, False, 32), "q8_0": (8, True, 32), "q4_1": (4, False, 32),
                                           "q5_0": (5, True, 32),
                                           "q4_k": (4, False, 32), "q6_k": (6, True, 16), "q4_k_m": (4, False, 32)}

# Named presets are data: a recipe says `scheme: W4A16` or `scheme: {preset: W4A16, group_size: 64}`.
PRESETS: dict[str, dict] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None),
    # compressed-tensors' low-bit int presets: symmetric, group 128 (3, 5, 6, 7 bits straddle int32 words)
    **{f"W{b}A16": dict(num_bits=b, symmetric=True, strategy="group", group_size=128) for b in (2, 3, 5, 6, 7)},
    # FP8 e4m3 (compressed-tensors float-quantized): per-channel weights + dynamic per-token activations,
    # per-tensor weights + a static per-tensor activation scale, 128x128 blocks + dynamic per-token
    "FP8_DYNAMIC": dict(num_bits=8, type="float", strategy="channel", group_size=None,
                        input_activations={"strategy": "token"}),
    "FP8": dict(num_bits=8, type="float", strategy="tensor", group_size=None,
                input_activations={"strategy": "tensor", "observer": "minmax"}),
    "FP8_BLOCK": dict(num_bits=8, type="float", strategy="block", group_size=None, block_structure=[128, 128],
                      input_activations={"strategy": "token"}),
    # GGUF's Q4_0 and Q8_0 grids (`quantkit export gguf` writes them without rounding again)
    "Q4_0": dict(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_0"),
    "Q8_0": dict(num_bits=8, symmetric=True, strategy="group", group_size=32, grid="q8_0"),
    # ggml's Q4_1, Q5_0, Q4_K, Q6_K (kept as ggml blocks), and llama.cpp's Q4_K_M mixture of them (and Q8_0) per tensor
    "Q4_1": dict(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_1"),
    "Q5_0": dict(num_bits=5, symmetric=True, strategy="group", group_size=32, grid="q5_0"),
    "Q4_K": dict(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_k"),
    "Q6_K": dict(num_bits=6, symmetric=True, strategy="group", group_size=16, grid="q6_k"),
    "Q4_K_M": dict(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_k_m"),
    "FP8_WEIGHT": dict(num_bits=8, type="float", strategy="channel", group_size=None),
    # int8 weights (per channel, symmetric) and int8 activations (dynamic per token): compressed-tensors' W8A8
    "W8A8": dict(num_bits=8, symmetric=True, strategy="channel", group_size=None,
                 input_activations={"type": "int", "strategy": "token"}),
    # int4 weights (symmetric, group 128) and FP8 activations (dynamic per token): compressed-tensors' W4AFP8
    "W4AFP8": dict(num_bits=4, symmetric=True, strategy="group", group_size=128,
                   input_activations={"type": "float", "strategy": "token"}),
    # microscaled floats (`quant.microscale`): NVFP4 (e2m1, e4m3 scales per 16 under a global scale) and MX
    # (e2m1 or e4m3, e8m0 scales per 32), weight-only or with activations in the same format
    "NVFP4A16": dict(num_bits=4, type="float", strategy="tensor_group", group_size=16),
    "NVFP4": dict(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                  input_activations={"num_bits": 4, "strategy": "tensor_group", "group_size": 16}),
    "MXFP4A16": dict(num_bits=4, type="float", strategy="group", group_size=32),
    "MXFP4": dict(num_bits=4, type="float", strategy="group", group_size=32,
                  input_activations={"num_bits": 4, "strategy": "group", "group_size": 32}),
    "MXFP8A16": dict(num_bits=8, type="float", strategy="group", group_size=32),
    "MXFP8": dict(num_bits=8, type="float", strategy="group", group_size=32,
                  input_activations={"num_bits": 8, "strategy": "group", "group_size": 32}),
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
    if "group_size" not in overrides and fields.get("strategy", "group") in ("channel", "tensor", "block"):
        fields.pop("group_size", None)  # a preset's size does not follow it to another strategy (`_no_default_group`)
    return QuantScheme(**fields)
