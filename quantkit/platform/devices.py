"""Which device a command computes on: `--device auto|cpu|cuda[:N]|mps`, resolved once and checked.

`auto` takes the first CUDA device when torch sees one and says so; otherwise the CPU (MPS only when
asked for: some of quantkit's statistics need float64, which MPS lacks). A device that is asked for
and missing is an error naming it and what torch does see: never a silent CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from quantkit.errors import QuantkitError

CHOICES = "auto|cpu|cuda[:N]|mps"
DEFAULT = "auto"


class DeviceError(QuantkitError):
    """A --device names no device, or one this machine does not have."""


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    reason: str  # in words, e.g. "asked for", "auto: CUDA NVIDIA H200"

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    def describe(self) -> str:
        return f"device {self.device} ({self.reason})"


def _cuda_missing() -> str:
    if torch.version.cuda is None:
        return "this torch is a CPU-only build (torch.version.cuda is None)"
    return f"torch {torch.__version__} was built for CUDA {torch.version.cuda} but finds no usable CUDA device or driver"


def resolve(spec: Union[str, torch.device, None] = DEFAULT, option: str = "--device") -> DeviceChoice:
    """The device `spec` names, checked to exist. `option` names the setting in error messages: a CLI
    flag ("--device") or a Python argument ("device")."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or DEFAULT).strip().lower()
    flag = option.startswith("--")
    asked = f"{option} {spec}" if flag else f"{option}={spec!r}"
    cpu = f"{option} cpu" if flag else f"{option}='cpu'"
    if text == "auto":
        if torch.cuda.is_available():
            return DeviceChoice(torch.device("cuda", 0), f"auto: CUDA {torch.cuda.get_device_name(0)}")
        return DeviceChoice(torch.device("cpu"), "auto: no CUDA device")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"{asked} names no device; use one of {CHOICES}") from None
    if device.type == "cpu":
        return DeviceChoice(torch.device("cpu"), "asked for")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{asked}: no CUDA device here: {_cuda_missing()}; "
                              f"use {cpu} (or auto, which takes CUDA only when present)")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise DeviceError(f"{asked}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return DeviceChoice(torch.device("cuda", index), f"asked for: CUDA {torch.cuda.get_device_name(index)}")
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            built = torch.backends.mps.is_built()
            why = "this macOS or machine has no Metal device" if built else "this torch is built without MPS"
            raise DeviceError(f"{asked}: MPS is not available ({why}); use {cpu}")
        return DeviceChoice(torch.device("mps"), "asked for")
    raise DeviceError(f"{asked}: quantkit runs on {CHOICES}, not {device.type}")


def to_device(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor in it (nested in tuples, lists and dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(v, device) for v in obj)
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes allocated on an accelerator since the last reset (0 for the CPU and for MPS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
