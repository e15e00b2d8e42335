"""GGMLLinear: a linear layer whose weight is kept as ggml blocks (Q4_1, Q5_0, Q4_K, Q6_K), the bytes a GGUF file holds.

Its state dict is the checkpoint's `weight_ggml` (uint8 [out, bytes per row]) and `weight_shape`; the grid is
the module's scheme (from the checkpoint's config). It runs by dequantizing in ggml's own arithmetic
(`quantkit.quant.ggml`) once per device and dtype and keeping that float weight outside the state dict: no
packed kernel runs these types here (the format exists to carry calibrated K-quants to `quantkit export
gguf`), so a model of them takes a 16-bit model's memory when it runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.quant.ggml import GGMLWeight, kind_of
from quantkit.quant.ggml_blocks import row_bytes
from quantkit.quant.schemes import QuantScheme


class GGMLLinear(nn.Module):
    """y = x @ W^T + b with W stored as ggml blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme,
                 dtype: torch.dtype = torch.bfloat16, device: Optional[torch.device] = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.kind = kind_of(scheme)
        self.register_buffer("weight_ggml", torch.zeros(out_features, row_bytes(self.kind, in_features),
                                                        dtype=torch.uint8, device=device))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self._float: Optional[tuple] = None  # ((device, dtype, version), dequantized weight)

    @classmethod
    def from_quantized(cls, gw: GGMLWeight, bias: Optional[torch.Tensor]) -> "GGMLLinear":
        out_features, in_features = gw.q.shape
        mod = cls(in_features, out_features, bias is not None, gw.scheme,
                  bias.dtype if bias is not None else torch.bfloat16, device=gw.q.device)
        mod.weight_ggml.copy_(torch.from_numpy(gw.to_blocks()))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def quantized_weight(self) -> GGMLWeight:
        return GGMLWeight.from_blocks(self.weight_ggml.cpu().numpy(), self.in_features, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype).to(self.weight_ggml.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype, self.weight_ggml._version)
        if self._float is None or self._float[0] != key:
            self._float = (key, self.dequantize(x.dtype).to(x.device))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._float[1], bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.short()}"
