"""`ggml-blocks`: quantkit's checkpoint format for linears on ggml's Q4_1, Q5_0, Q4_K and Q6_K grids, which
compressed-tensors cannot express (Q4_K's per-sub-block minimum is no integer zero point): each such
linear is stored as the GGUF bytes themselves (`weight_ggml`), its config group naming the ggml type.

A checkpoint with these groups is quantkit's (recipe gptq-q4_k_m) and is meant for `quantkit export gguf`,
which copies the bytes; quantkit loads it (eval, generate), vLLM and transformers do not (they refuse the
unknown format). The rest of such a checkpoint (Q8_0 tensors) stays pack-quantized.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import CheckpointError
from quantkit.formats.base import QuantFormat
from quantkit.qmodules.ggml_linear import GGMLLinear
from quantkit.quant.ggml import KIND, GGMLWeight, is_block_grid
from quantkit.core.registry import FORMATS
from quantkit.quant.schemes import PRESETS, QuantScheme


class GGMLBlocks(QuantFormat):
    name = "ggml-blocks"

    def supports(self, scheme: QuantScheme) -> bool:
        return is_block_grid(scheme)

    def build_module(self, qw: GGMLWeight, bias: torch.Tensor | None) -> nn.Module:
        return GGMLLinear.from_quantized(qw, bias)

    def empty_module(self, linear: nn.Linear, scheme: QuantScheme, scale_dtype: torch.dtype) -> nn.Module:
        return GGMLLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, scale_dtype)

    def weights_config(self, scheme: QuantScheme) -> dict:
        return {"num_bits": scheme.num_bits, "type": "int", "symmetric": scheme.symmetric, "strategy": "group",
                "group_size": scheme.group_size, "dynamic": False, "ggml_type": KIND[scheme.grid]}

    def scheme_from_config(self, group: str, weights: dict, input_activations: dict | None = None) -> QuantScheme:
        where = f"config_groups.{group}.weights"
        kind = weights.get("ggml_type")
        if input_activations:
            raise CheckpointError(f"config_groups.{group}: format {self.name!r} holds weights only")
        if kind not in KIND.values():
            raise CheckpointError(f"{where}.ggml_type: {kind!r} is not one of {', '.join(KIND.values())}")
        return QuantScheme(**PRESETS[kind])


FORMATS.add(GGMLBlocks.name, GGMLBlocks())
