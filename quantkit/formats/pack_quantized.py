"""compressed-tensors `pack-quantized`: int weights packed 32/b per int32, scales in the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import CheckpointError
from quantkit.formats.base import QuantFormat
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.packing import SUPPORTED_BITS, unpack_int32
from quantkit.core.registry import FORMATS
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.quant.schemes import QuantScheme


class PackQuantized(QuantFormat):
    name = "pack-quantized"

    def supports(self, scheme: QuantScheme) -> bool:
        # ggml's block grids (format ggml-blocks) and the Q4_K_M mixture are not compressed-tensors int weights
        return (scheme.type == "int" and scheme.num_bits in SUPPORTED_BITS and scheme.grid in (None, "q4_0", "q8_0")
                and scheme.input_activations is None)  # with quantized activations: int-quantized

    def build_module(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module:
        return PackedIntLinear.from_quantized(qw, bias)

    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        return PackedIntLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, scale_dtype)

    def weights_config(self, scheme: QuantScheme) -> dict:
        return {
            "num_bits": scheme.num_bits,
            "type": scheme.type,
            "symmetric": scheme.symmetric,
            "strategy": scheme.strategy,
            "group_size": scheme.group_size,
            "block_structure": None,
            "dynamic": False,
            "actorder": scheme.actorder,
            "observer": "minmax",
            "observer_kwargs": {},
            "scale_dtype": None if scheme.scale_dtype is None else f"torch.{scheme.scale_dtype}",
            "zp_dtype": None if scheme.symmetric else "torch.int8",
        }

    def scheme_from_config(self, group: str, weights: dict, input_activations: dict | None = None) -> QuantScheme:
        if input_activations:
            raise CheckpointError(f"config_groups.{group}: activation quantization with format {self.name!r} "
                                  "(int weights) is not supported")
        where = f"config_groups.{group}.weights"
        if weights.get("type", "int") != "int":
            raise CheckpointError(f"{where}: pack-quantized with type {weights.get('type')!r} is not supported")
        if weights.get("dynamic"):
            raise CheckpointError(f"{where}: dynamic weight quantization is not meaningful")
        strategy = weights.get("strategy") or ("group" if (weights.get("group_size") or 0) > 0 else "channel")
        if strategy not in ("group", "channel"):
            raise CheckpointError(f"{where}: strategy {strategy!r} is not supported; supported: group, channel")
        scale_dtype = weights.get("scale_dtype")
        if scale_dtype is not None:
            scale_dtype = str(scale_dtype).removeprefix("torch.")
        try:
            return QuantScheme(
                scale_dtype=scale_dtype,
                actorder=_actorder(weights.get("actorder")),
                num_bits=weights["num_bits"],
                symmetric=weights.get("symmetric", True),
                strategy=strategy,
                group_size=weights.get("group_size") if strategy == "group" else None,
            )
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None


def read_int_weight(ckpt, module: str, scheme: QuantScheme):
    """(codes [out, in] int8, scale, zero points or None, g_idx or None) of int linear `module` as a checkpoint
    stores it (`ckpt`: a LazyCheckpoint): pack-quantized's packed words, or int-quantized's int8 `weight`."""
    scale = ckpt.get(module + ".weight_scale")
    if module + ".weight_packed" in ckpt:
        rows, cols = (int(v) for v in ckpt.get(module + ".weight_shape"))
        codes = unpack_int32(ckpt.get(module + ".weight_packed"), scheme.num_bits, cols, dim=1)
    else:
        codes = ckpt.get(module + ".weight")
        rows, cols = codes.shape
    zp = None
    if not scheme.symmetric:
        zp = unpack_int32(ckpt.get(module + ".weight_zero_point"), scheme.num_bits, rows, dim=0)
    g_idx = ckpt.get(module + ".weight_g_idx").to(torch.int32) if module + ".weight_g_idx" in ckpt else None
    return codes, scale, zp, g_idx


def _actorder(value) -> str | None:
    """compressed-tensors' actorder as quantkit's: "weight" (or "static") keeps groups contiguous; "group"
    stores weight_g_idx, each column's group (the module then holds it)."""
    if value in ("static", "weight"):
        return "static"
    return "group" if value == "group" else None


FORMATS.add(PackQuantized.name, PackQuantized())
