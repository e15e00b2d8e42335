"""IntActLinear: int weights whose input activations are quantized too (compressed-tensors `int-quantized`).

Buffers are exactly the checkpoint's tensors: `weight` (the int codes as int8 [out, in], unpacked) and
`weight_scale` ([out, 1] per channel, [out, in / group] per group), symmetric. Two schemes:

- W8A8: int8 weights per channel, int8 activations dynamic per token (`kernels.reference.
  int8_quantize_per_token`) or static per tensor (`input_scale` [1], calibrated: `int8_quantize_static`). The integer products are summed exactly, through torch's int8 GEMM
  (`torch._int_mm`, oneDNN with VNNI / AMX on a CPU) where it runs, else in float64; both give the same
  bits. Then y = x_scale * (w_scale * acc) + bias in float32, cast to the input's dtype.
- W4AFP8: int4 weights in groups, FP8 e4m3 activations dynamic per token: the activations are
  quantized and dequantized (`fp8_quantize_per_token`), then multiplied by the dequantized weight in
  float32 (kept between forwards where the memory plan allows: `DenseCopy`, as FP8 emulation does).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels.reference import (fp8_quantize_per_token, int8_matmul, int8_matmul_reference,
                                        int8_quantize_per_token, int8_quantize_static)
from quantkit.kernels.select import forced_kernel
from quantkit.errors import KernelError
from quantkit.qmodules.dense_copy import DenseCopy
from quantkit.quant.intq import QuantizedWeight, dequantize
from quantkit.quant.schemes import QuantScheme

MAX_EXACT_K = 133_000  # int32 holds every sum of K products of int8 codes (127 * 128 * K < 2^31)


class IntActLinear(DenseCopy, nn.Module):
    """y = quantize(x) @ (codes * scale)^T + b, the activation quantization as the scheme says."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme,
                 scale_dtype: torch.dtype, device: Optional[torch.device] = None):
        super().__init__()
        if not scheme.activation_quantized:
            raise KernelError(f"IntActLinear holds int weights with quantized activations, not {scheme.short()}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.group_count(in_features)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=scale_dtype, device=device))
        static = scheme.has_static_input  # W8A8 with one calibrated int8 scale for the input
        self.register_buffer("input_scale", torch.ones(1, dtype=scale_dtype, device=device) if static else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=scale_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.kernel_request: Optional[str] = forced_kernel()
        self.keep_dense = False  # W4AFP8: keep the dequantized weight between forwards (`DenseCopy`)
        self._dense = None

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor]) -> "IntActLinear":
        out_features, in_features = qw.q.shape
        mod = cls(in_features, out_features, bias is not None, qw.scheme, qw.scale.dtype, device=qw.q.device)
        mod.weight.copy_(qw.q)
        mod.weight_scale.copy_(qw.scale.reshape(mod.weight_scale.shape))
        if mod.input_scale is not None:
            mod.input_scale.copy_(qw.input_scale.reshape(1))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight, self.weight_scale, None, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, None, self.scheme, dtype)

    @property
    def kernel(self) -> str:
        return self._choose(self.weight.device)

    def _choose(self, device: torch.device) -> str:
        """"int8-gemm" (torch._int_mm) or "torch" (exact reference) for W8A8; "torch" for W4AFP8."""
        forced = self.kernel_request
        if self.scheme.input_activations.type != "int":
            if forced not in (None, "torch"):
                raise KernelError(f"QUANTKIT_KERNEL={forced}: W4AFP8 layers run by emulation only (unset it, "
                                  "or =torch)")
            return "torch"
        if forced in (None, "cpu") and self.in_features <= MAX_EXACT_K and device.type == "cpu":
            return "int8-gemm"  # on CUDA torch._int_mm needs more than 16 rows: the reference runs there
        if forced not in (None, "torch"):
            raise KernelError(f"QUANTKIT_KERNEL={forced} cannot run this W8A8 layer on {device.type}: use torch")
        return "torch"

    @property
    def dense_emulated(self) -> bool:
        """W4AFP8 multiplies by the dequantized weight; W8A8 multiplies the int8 codes."""
        return self.scheme.input_activations.type != "int"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.scheme.input_activations.type == "int":
            xq, xs = int8_quantize_per_token(x2) if self.input_scale is None else \
                int8_quantize_static(x2, self.input_scale)
            if self._choose(x.device) == "int8-gemm":
                # the codes as stored ([out, in]) seen transposed: oneDNN's int8 GEMM reads that layout as is
                # (SmolLM2's 1536 x 576 at one token: 13 us; a contiguous [in, out] copy: 246 us)
                y = int8_matmul(xq, xs, self.weight.t(), self.weight_scale, x.dtype, self.bias)
            else:
                y = int8_matmul_reference(xq, xs, self.weight, self.weight_scale, x.dtype, self.bias)
        else:
            self._choose(x.device)  # a forced kernel that cannot run says so
            xq, xs = fp8_quantize_per_token(x2)
            w = self._dense_weight(torch.float32)
            y = F.linear(xq.float() * xs, w, None if self.bias is None else self.bias.float()).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.short()}"
