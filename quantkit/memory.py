"""Memory of the process: give freed heap memory back to the operating system between pipeline
layers, and read how much the machine has available.

The layer-by-layer pipeline frees and reallocates tens of MB of tensors per layer; glibc's
allocator keeps much of it (fragmented arenas, a raised mmap threshold), so resident memory
grows layer after layer although live tensors do not. `malloc_trim` returns it. Measured on
SmolLM2 GPTQ: peak RSS 1.56 GB without, about 0.85 GB with.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Optional


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None  # glibc only (not musl)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return free heap pages to the OS (glibc); False where that is not available."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def available_memory() -> Optional[int]:
    """Bytes the kernel reports as available for new allocations (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None
