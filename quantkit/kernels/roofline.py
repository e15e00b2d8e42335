"""Rooflines: the read bandwidth a device reaches here, measured, and what a kernel's bytes make of it.

A memory-bound kernel (a one-token linear, a decode step) can go no faster than the bytes it must
read divided by that bandwidth; benchmarks print their figures as a share of it.
"""

from __future__ import annotations

import time
from typing import Union

import torch

BUFFER_FLOATS = 1 << 28  # 1 GiB of float32: far larger than any cache


def read_bandwidth(device: Union[str, torch.device] = "cpu", repeats: int = 6) -> float:
    """Bytes per second a sum over a 1 GiB float32 buffer reads on `device` (the best of `repeats`; the
    first also warms the device up)."""
    buf = torch.ones(BUFFER_FLOATS, device=device)
    sync = torch.cuda.synchronize if buf.device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        buf.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    del buf
    return BUFFER_FLOATS * 4 / best


def share(bytes_moved: int, seconds: float, bandwidth: float) -> float:
    """The fraction of `bandwidth` a kernel that moves `bytes_moved` in `seconds` reaches."""
    return bytes_moved / max(seconds, 1e-12) / bandwidth
