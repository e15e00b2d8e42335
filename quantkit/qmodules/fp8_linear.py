"""Fp8Linear: a linear layer with e4m3 weights (compressed-tensors `float-quantized`).

Buffers are exactly the checkpoint's tensors: `weight` (float8_e4m3fn [out, in]), `weight_scale`
([1] per tensor, [out, 1] per channel, [out/bn, in/bk] per block) and, for static activation
quantization, `input_scale` ([1]). Activations are quantized as the scheme says (dynamic per
token, or static with input_scale) before the matmul, so the effect of FP8 activations is in
every output: on CUDA through cuBLASLt's FP8 GEMM (`torch._scaled_mm`, `kernels.cuda_fp8`) where the
device has FP8 tensor cores, else the Triton FP8 GEMM (per-tensor / per-channel weights), elsewhere
by emulation (quantize-dequantize with the same scales, then a matmul in the input's dtype).

Emulation dequantizes the weight; `keep_dense` keeps that copy (per dtype, device and weight
version) instead of redoing it at every forward: ~6x faster single-token decode on SmolLM2, at
the memory of a dense copy. `plan_dense_cache` turns it on for a loaded model when the copies fit
in a share of the available memory (QUANTKIT_FP8_DENSE=auto|1|0).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import KernelError
from quantkit.kernels.reference import fp8_quantize_per_token
from quantkit.kernels.select import ENV, forced_kernel, triton_device_reason
from quantkit.platform.memory import available_memory
from quantkit.qmodules.dense_copy import DenseCopy
from quantkit.quant.fp8 import FP8_DTYPE, Fp8Weight, dequantize_weight, quantize
from quantkit.quant.schemes import QuantScheme

log = logging.getLogger(__name__)

DENSE_ENV = "QUANTKIT_FP8_DENSE"
DENSE_SHARE = 0.3  # auto: keep dense copies when they take at most this share of the available memory


class Fp8Linear(DenseCopy, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme,
                 scale_dtype: torch.dtype, device: Optional[torch.device] = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        if scheme.strategy == "tensor":
            scale_shape = (1,)
        elif scheme.strategy == "channel":
            scale_shape = (out_features, 1)
        else:
            bn, bk = scheme.block_structure
            scale_shape = (-(-out_features // bn), -(-in_features // bk))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=scale_dtype, device=device))
        if scheme.has_static_input:
            self.register_buffer("input_scale", torch.ones(1, dtype=scale_dtype, device=device))
        else:
            self.input_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=scale_dtype, device=device), requires_grad=False) if bias else None
        self.keep_dense = False  # emulation: keep the dequantized weight between forwards (`DenseCopy`)
        self._dense = None
        self.kernel_request: Optional[str] = forced_kernel()  # as PackedIntLinear's: read once, not per forward

    @classmethod
    def from_quantized(cls, qw: Fp8Weight, bias: Optional[torch.Tensor]) -> "Fp8Linear":
        out_features, in_features = qw.q.shape
        mod = cls(in_features, out_features, bias is not None, qw.scheme, qw.scale.dtype, device=qw.q.device)
        mod.weight.copy_(qw.q)
        mod.weight_scale.copy_(qw.scale.reshape(mod.weight_scale.shape))
        if mod.input_scale is not None:
            mod.input_scale.copy_(qw.input_scale.reshape(1))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, self.scheme.strategy, self.scheme.block_structure, dtype)

    @property
    def kernel(self) -> str:
        return self._choose(self.weight.device)

    def _choose(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
        """"cuda" (torch._scaled_mm), "triton" or "torch" (emulation) for inputs on `device` in `dtype`: the
        forced kernel, else on CUDA cuBLASLt's FP8 GEMM where it can run (`kernels.cuda_fp8`), else Triton."""
        forced = self.kernel_request
        usable = self.scheme.strategy != "block" and self.scheme.input_activations is not None
        reason = triton_device_reason(device) if usable else "block weights / weight-only FP8 run emulated"
        scaled = self._scaled_mm_reason(device, dtype or self.weight_scale.dtype) if usable else reason
        if forced == "triton" and reason:
            raise KernelError(f"{ENV}=triton cannot run this FP8 layer: {reason}")
        if forced == "cuda" and scaled:
            raise KernelError(f"{ENV}=cuda cannot run this FP8 layer: {scaled}")
        if forced == "cpu":
            raise KernelError(f"{ENV}=cpu: there is no CPU FP8 kernel; FP8 layers run by emulation (unset {ENV}, or =torch)")
        if forced in ("torch", "triton", "cuda"):
            return forced
        if device.type == "cuda" and scaled is None:
            return "cuda"
        return "triton" if device.type == "cuda" and not reason else "torch"

    def _scaled_mm_reason(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        from quantkit.kernels import cuda_fp8

        rowwise = self.scheme.strategy == "channel" or self.input_scale is None
        return cuda_fp8.unsupported_reason(device, self.out_features, self.in_features, rowwise, dtype)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is None:  # dynamic per token
            return fp8_quantize_per_token(x)
        return quantize(x, self.input_scale), self.input_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = self.scheme.input_activations
        kernel = self._choose(x.device, x.dtype)
        if kernel in ("triton", "cuda"):
            from quantkit.kernels import cuda_fp8, triton_fp8

            if self.input_scale is None:
                xq, xs = triton_fp8.quantize_per_token(x)
            else:
                xq, xs = self._quantize_input(x)
            gemm = cuda_fp8.matmul if kernel == "cuda" else triton_fp8.matmul
            return gemm(xq, xs, self.weight, self.weight_scale, x.dtype, self.bias)
        if acts is not None:  # emulation: the values the FP8 GEMM would multiply
            xq, xs = self._quantize_input(x)
            x = (xq.float() * xs).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._dense_weight(x.dtype), bias)

    @property
    def dense_emulated(self) -> bool:
        """Whether the forward multiplies by the dequantized weight (no FP8 kernel runs here)."""
        try:
            return self.kernel == "torch"
        except KernelError:  # a forced kernel that cannot run: the forward will say so
            return False

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.short()}"


def plan_dense_cache(model: nn.Module, dtype: torch.dtype) -> int:
    """Let the model's emulated layers (FP8, W4AFP8, NVFP4 / MX: `DenseCopy`) keep their dequantized weights when allowed:
    QUANTKIT_FP8_DENSE=1 always, =0 never, =auto (default) when the copies in `dtype` take at most
    DENSE_SHARE of the available memory (otherwise a warning says decoding will be slow).
    Returns the bytes the copies will take (0 when not kept)."""
    mode = os.environ.get(DENSE_ENV, "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        raise KernelError(f"{DENSE_ENV}={mode!r}: use auto, 1 (keep dense FP8 weights) or 0 (dequantize per forward)")
    layers = [m for m in model.modules() if isinstance(m, DenseCopy) and m.dense_emulated]
    if not layers:
        return 0
    need = sum(m.dense_numel for m in layers) * torch.finfo(dtype).bits // 8
    if mode == "auto":
        avail = available_memory()
        keep = avail is not None and need <= DENSE_SHARE * avail
        if not keep:
            log.warning("%d FP8 layers run emulated and will dequantize their weights at every forward (slow): "
                        "dense copies would take %.2f GB, over %.0f%% of the available %s; set %s=1 to keep them anyway",
                        len(layers), need / 1e9, 100 * DENSE_SHARE,
                        "memory (unknown)" if avail is None else f"{avail / 1e9:.1f} GB", DENSE_ENV)
    else:
        keep = mode == "1"
    for m in layers:
        m.keep_dense = keep
    return need if keep else 0
