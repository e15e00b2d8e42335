"""Which matmul a quantized linear runs: the fastest that can run here, or the one forced by
`QUANTKIT_KERNEL` (triton | cuda | cpu | torch; unset or `auto` chooses).

The variable is read once, when a model is loaded (or a quantized module is made): each module
keeps its `kernel_request`, and `use_kernel(model, name)` changes it afterwards; nothing reads
the environment per forward.

- `triton`: CUDA tensors, 4-bit weights, triton importable, compute capability >= 8.0 (bf16
  tensor cores). Also allowed on CPU tensors under TRITON_INTERPRET=1 (tests).
- `cuda`: torch's own CUDA int4 op (`kernels.cuda_int4`) for bf16 inputs: it computes in bf16, so a
  model in another dtype never takes it automatically. Where it and Triton can both run, the
  automatic choice times both on the layer's shape at one token (`fastest`, once per shape per process).
- `cpu`: CPU tensors, 4-bit weights whose groups the int4 op supports (`kernels.cpu_int4`).
- `torch`: dequantize then matmul; any device and bit width: the reference and last resort.

A forced kernel that cannot run raises `KernelError` saying why; the automatic choice falls back
quietly only between paths that compute the same result (speed differs, quality does not).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import nn

from quantkit.errors import KernelError
from quantkit.kernels import cpu_int4, cuda_int4

ENV = "QUANTKIT_KERNEL"
KERNELS = ("triton", "cuda", "cpu", "torch")


_FROM_ENV = object()  # choose_int_kernel's default: the kernel QUANTKIT_KERNEL names now


def forced_kernel() -> Optional[str]:
    """The kernel named by QUANTKIT_KERNEL, or None for the automatic choice."""
    return kernel_name(os.environ.get(ENV, ""))


def kernel_name(value: Optional[str]) -> Optional[str]:
    """A kernel request (`auto`, empty or None: the automatic choice, returned as None), checked."""
    value = (value or "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in KERNELS:
        raise KernelError(f"{ENV}={value!r} names no kernel; use one of: auto, {', '.join(KERNELS)}")
    return value


def use_kernel(model: nn.Module, name: Optional[str]) -> int:
    """Make every quantized linear of `model` (or `model` itself) request kernel `name` (None or
    `auto`: the automatic choice) from its next forward on. Returns how many modules changed."""
    request = kernel_name(name)
    count = 0
    for module in model.modules():
        if hasattr(module, "kernel_request"):
            module.kernel_request = request
            count += 1
    return count


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unsupported_reason(device: torch.device, num_bits: int) -> Optional[str]:
    """Why the Triton W4A16 kernel cannot run an int linear of `num_bits` on `device` (None: it can)."""
    if num_bits != 4:
        return f"the Triton kernel takes 4-bit weights, not {num_bits}-bit"
    return triton_device_reason(device)


def triton_device_reason(device: torch.device) -> Optional[str]:
    """Why no Triton kernel can run on `device` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'quantkit[triton]')"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0)"
        return None
    if device.type == "cpu" and interpreting():
        return None
    return f"Triton runs on CUDA devices (or on CPU under TRITON_INTERPRET=1), not on {device.type}"


def cpu_unsupported_reason(device: torch.device, num_bits: int, in_features: int, group_size: int) -> Optional[str]:
    if device.type != "cpu":
        return f"the CPU int4 path runs on CPU tensors, not on {device.type}"
    return cpu_int4.unsupported_reason(num_bits, in_features, group_size)


def int_kernels(device: torch.device, num_bits: int, in_features: int, group_size: int, out_features: int = 16,
                dtype: torch.dtype = torch.bfloat16, forced=_FROM_ENV) -> tuple[str, ...]:
    """The kernels that can run an integer-weight linear on `device` for `dtype` inputs (group_size =
    in_features when per channel), best first: the forced one alone (`forced`: the module's kernel request,
    None: automatic; by default what QUANTKIT_KERNEL says now), else every candidate that can (several only
    on CUDA, where the caller measures: `fastest`); torch's reference is always last."""
    reasons = {
        "triton": lambda: triton_unsupported_reason(device, num_bits),
        "cuda": lambda: cuda_int4.unsupported_reason(device, num_bits, in_features, out_features, group_size),
        "cpu": lambda: cpu_unsupported_reason(device, num_bits, in_features, group_size),
        "torch": lambda: None,
    }
    forced = forced_kernel() if forced is _FROM_ENV else forced
    if forced is not None:
        reason = reasons[forced]()
        if reason is None and forced == "cuda" and dtype != torch.bfloat16:
            reason = f"it computes in bfloat16 and the inputs are {str(dtype).removeprefix('torch.')}"
        if reason is not None:
            raise KernelError(f"{ENV}={forced} cannot run this layer ({num_bits}-bit, in_features {in_features}, "
                              f"group {group_size}, {device}): {reason}. Unset {ENV} to choose automatically.")
        return (forced,)
    if device.type == "cuda":
        order = ("cuda", "triton", "torch") if dtype == torch.bfloat16 else ("triton", "torch")
    else:
        order = ("cpu", "torch")
    return tuple(k for k in order if reasons[k]() is None)


def choose_int_kernel(device: torch.device, num_bits: int, in_features: int, group_size: int,
                      forced=_FROM_ENV) -> str:
    """The first kernel `int_kernels` names (no measuring; CPU and forced choices have one candidate)."""
    return int_kernels(device, num_bits, in_features, group_size, forced=forced)[0]


_FASTEST: dict[tuple, str] = {}


def fastest(key: tuple, runs: dict, repeats: int = 20) -> str:
    """The name of the fastest of `runs` (name -> a function making one call; on CUDA), measured once per `key`
    (the device, shape and dtype) in this process: the median of `repeats` timed calls after a warm-up."""
    if key not in _FASTEST:
        seconds = {}
        for name, run in runs.items():
            run()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            seconds[name] = sorted(times)[len(times) // 2]
        _FASTEST[key] = min(seconds, key=seconds.get)
    return _FASTEST[key]
