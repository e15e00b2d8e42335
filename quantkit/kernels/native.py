"""quantkit's own one-token CPU kernels (`native_cpu.cpp`), compiled for this CPU on first use.

Two kernels: a bf16 GEMV (a one-token 16-bit linear or LM head: float32 sums, one rounding to bf16 at
the end, as F.linear's output) and a GEMV over the CPU int4 op's own packed layout (the layout
`_convert_weight_to_int4pack_for_cpu` writes on an AVX-512 CPU, so no second copy of a weight). Both
split rows over torch's own threads. On a 2-core AMD EPYC with avx512_bf16 (no AMX) torch's one-token
bf16 `F.linear` read SmolLM2's 49152 x 576 head at 12.6 GB/s; the dot product built on `vdpbf16ps`
at 26 GB/s (4.4 -> 2.2 ms).

The source is compiled once per machine (CPU flags, torch version, the source's hash) with
`-O3 -march=native` by torch's extension builder into quantkit's cache (about 30 s; two processes
building at once wait for one another). Whether a kernel is *used* is measured, never assumed:
`platform.compute` times the GEMV against torch's and `kernels.cpu_int4` the int4 GEMV against the
op, per machine; each native int4 result is checked against the op once before it is trusted.
QUANTKIT_NATIVE=0 turns them off; QUANTKIT_NATIVE_ARCH=haswell (any -march) builds for another CPU (an AVX2
machine imitated on this one); a failed build is said once and leaves torch's kernels in use.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from quantkit.platform import compute

log = logging.getLogger(__name__)

ENV = "QUANTKIT_NATIVE"
ARCH_ENV = "QUANTKIT_NATIVE_ARCH"  # the -march to build for (default native): e.g. haswell imitates an AVX2 CPU
HERE = Path(__file__).parent
SOURCES = (HERE / "native_cpu.cpp", HERE / "native_stack.cpp")  # compiled together into one extension
HEADERS = (HERE / "native_cpu.h",)


def arch_flags(arch: str) -> tuple[str, ...]:
    """The compiler flags of a build for CPUs of `arch` (a -march value). -fopenmp: torch's at::parallel_for is
    inline OpenMP (torch's CPU build), so without it every kernel ran on one thread; the extension then links
    libgomp.so.1, which resolves to the one torch has already loaded (one thread pool)."""
    return ("-O3", f"-march={arch}", "-fopenmp")


FLAGS = arch_flags("native")


def flags() -> tuple[str, ...]:
    """The compiler flags of this process's build: FLAGS, or for -march=$QUANTKIT_NATIVE_ARCH."""
    arch = os.environ.get(ARCH_ENV, "").strip()
    return FLAGS if arch in ("", "native") else arch_flags(arch)


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no")


def build_key(source: bytes, cpu_flags: str, torch_version: str, flags: tuple[str, ...] = FLAGS) -> str:
    """The build's identity: a different source, CPU (its flags: -march=native), torch or compiler flags
    builds anew."""
    digest = hashlib.sha256(b"\0".join([source, cpu_flags.encode(), torch_version.encode(),
                                        " ".join(flags).encode()])).hexdigest()
    return digest[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def build_id(build_flags: Optional[tuple[str, ...]] = None) -> str:
    """This machine's build key for `build_flags` (default `flags()`): probe figures of the native kernels are
    cached under it, so a changed kernel is measured again."""
    source = b"\0".join(p.read_bytes() for p in SOURCES + HEADERS)
    return build_key(source, _cpu_flags(), torch.__version__, build_flags or flags())


def build(build_flags: Optional[tuple[str, ...]] = None, directory: Optional[Path] = None):
    """Compile (or find already compiled) the kernels with `build_flags` (default `flags()`); the loaded module."""
    from torch.utils import cpp_extension

    from quantkit.platform.paths import cache_dir

    build_flags = build_flags or flags()
    key = build_id(build_flags)
    folder = directory or cache_dir() / "native" / key
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print("quantkit: building its CPU kernels for this machine (once, about 30 s) ...", file=sys.stderr)
    return cpp_extension.load(name=f"quantkit_native_{key}", sources=[str(p) for p in SOURCES],
                              extra_cflags=list(build_flags), extra_ldflags=[f for f in build_flags if f == "-fopenmp"],
                              build_directory=str(folder), verbose=False)


@functools.lru_cache(maxsize=None)
def module():
    """The compiled kernels, or None (turned off, not a CPU build it can compile for, or the build failed:
    `reason` says which)."""
    return _load()[0]


def reason() -> Optional[str]:
    """Why the native kernels are not in use (None when they are loaded)."""
    return _load()[1]


@functools.lru_cache(maxsize=None)
def _load():
    if disabled():
        return None, f"{ENV}=0"
    if not sys.platform.startswith("linux"):
        return None, "built only on Linux"
    try:
        return build(), None
    except Exception as exc:  # a missing compiler, ninja or headers: torch's kernels stay in use, said once
        why = f"could not build quantkit's CPU kernels ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        print(f"quantkit: {why}; torch's kernels are used instead", file=sys.stderr)
        return None, why


def gemv_bf16(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 @ x [K] bf16 -> [N] bf16 (float32 sums, rounded once)."""
    return module().gemv_bf16(weight, x)


def int4_available(block_rows: int) -> bool:
    """Whether the built kernels read the int4 op's layout with `block_rows` rows per block."""
    mod = module()
    return mod is not None and bool(mod.int4_available(block_rows))


compute.register_gemv(compute.NATIVE_GEMV, lambda dtype: dtype == torch.bfloat16 and module() is not None, gemv_bf16,
                      build_id)
