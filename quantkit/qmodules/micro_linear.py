"""MicroLinear: a linear layer in a microscaled float format (NVFP4, MXFP4, MXFP8; `quant.microscale`).

Buffers are exactly the checkpoint's tensors (compressed-tensors 0.19):
- 4-bit elements: `weight_packed` (uint8 [out, in / 2], two e2m1 codes a byte, `quant.fp4`); 8-bit ones:
  `weight` (float8_e4m3fn [out, in]);
- `weight_scale` [out, in / group]: e4m3 for NVFP4, e8m0 bytes (uint8) for MX;
- NVFP4: `weight_global_scale` (float32 [1]) and, when activations are quantized, `input_global_scale`.

No CPU or Triton kernel runs these formats here: the forward emulates what an FP4 / MX GEMM computes.
Activations, when the scheme quantizes them, are quantized and dequantized per group of the hidden
dimension with the format's rule (`microscale.fake_quantize_input`); then the dequantized weight is
multiplied in the input's dtype, kept between forwards where the memory plan allows (`DenseCopy`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import KernelError
from quantkit.kernels.select import ENV, forced_kernel
from quantkit.qmodules.dense_copy import DenseCopy
from quantkit.quant import fp4, microscale
from quantkit.quant.fp8 import FP8_DTYPE
from quantkit.quant.microscale import MicroWeight
from quantkit.quant.schemes import QuantScheme


class MicroLinear(DenseCopy, nn.Module):
    fixed_dtype_buffers = ("weight_global_scale", "input_global_scale")  # float32 in the checkpoint, as the format says

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme,
                 scale_dtype: torch.dtype, device: Optional[torch.device] = None):
        super().__init__()
        if not scheme.is_micro:
            raise KernelError(f"MicroLinear holds NVFP4 / MX weights, not {scheme.short()}")
        if in_features % scheme.group_size:
            raise KernelError(f"{scheme.micro_name.upper()} needs in_features divisible by {scheme.group_size} "
                              f"(got {in_features})")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = in_features // scheme.group_size
        nv = scheme.strategy == "tensor_group"
        if scheme.num_bits == 4:
            self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                              device=device))
        else:
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        if nv:  # unit steps until loaded: e4m3 1.0, or e8m0 2^0
            scale = torch.ones(out_features, groups, device=device).to(FP8_DTYPE)
        else:
            scale = torch.full((out_features, groups), microscale.E8M0_BIAS, dtype=torch.uint8, device=device)
        self.register_buffer("weight_scale", scale)
        one = torch.ones(1, dtype=torch.float32, device=device)
        self.register_buffer("weight_global_scale", one.clone() if nv else None)
        self.register_buffer("input_global_scale", one.clone() if scheme.needs_input_global else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=scale_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.kernel_request: Optional[str] = forced_kernel()
        self.keep_dense = False
        self._dense = None

    @classmethod
    def from_quantized(cls, qw: MicroWeight, bias: Optional[torch.Tensor]) -> "MicroLinear":
        out_features, in_features = qw.q.shape
        dtype = bias.dtype if bias is not None else torch.float32
        mod = cls(in_features, out_features, bias is not None, qw.scheme, dtype, device=qw.q.device)
        if qw.scheme.num_bits == 4:
            mod.weight_packed.copy_(fp4.pack(fp4.codes(qw.q)))
        else:
            mod.weight.copy_(qw.q)
        mod.weight_scale.copy_(qw.scale)
        if mod.weight_global_scale is not None:
            mod.weight_global_scale.copy_(qw.global_scale.reshape(1))
        if mod.input_global_scale is not None:
            mod.input_global_scale.copy_(qw.input_global_scale.reshape(1))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def elements(self) -> torch.Tensor:
        """The quantized elements as float8_e4m3fn [out, in] (e2m1 values are exact there)."""
        if self.scheme.num_bits == 4:
            return fp4.values(fp4.unpack(self.weight_packed)).to(FP8_DTYPE)
        return self.weight

    def quantized_weight(self) -> MicroWeight:
        return MicroWeight(self.elements(), self.weight_scale, self.weight_global_scale, self.scheme,
                           self.input_global_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return microscale.dequantize(self.elements(), self.weight_scale, self.weight_global_scale, self.scheme, dtype)

    @property
    def dense_numel(self) -> int:
        return self.out_features * self.in_features

    def _dense_sources(self) -> tuple[torch.Tensor, ...]:
        first = self.weight_packed if self.scheme.num_bits == 4 else self.weight
        return (first, self.weight_scale) + (() if self.weight_global_scale is None else (self.weight_global_scale,))

    @property
    def kernel(self) -> str:
        if self.kernel_request not in (None, "torch"):
            raise KernelError(f"{ENV}={self.kernel_request}: {self.scheme.micro_name.upper()} layers run by emulation "
                              f"only here (unset {ENV}, or =torch)")
        return "torch"

    @property
    def dense_emulated(self) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kernel  # a forced kernel that cannot run says so
        acts = self.scheme.input_activations
        if acts is not None:
            x = microscale.fake_quantize_input(x, acts.num_bits, acts.group_size, self.input_global_scale).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._dense_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.short()}"
