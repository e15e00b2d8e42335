"""The llama-family RMSNorm of a decode step's rows: torch's fused op, or quantkit's native kernel
(`kernels.native.rms_norm`: one call instead of torch's composite of about eight), whichever a probe
measured faster here for the dtype (cached per machine and native build).

Both compute the module's formula (normalize in float32; a 16-bit input is rounded back before the weight
multiplies it in its dtype; float32 multiplies the weight in float32). torch's path is bit-identical to the
module; the native kernel sums the squares in another order, so an output may differ from it in the last
bits (bf16: equal on tests/test_generate.py's inputs). On a 2-core AMD EPYC with avx512_bf16 one
576-wide bf16 row took 19.3 us through torch and 2.9 us natively (SmolLM2: 61 norms a token).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from quantkit.kernels import native
from quantkit.platform import compute, timing

IMPLS = ("torch", "native")
WIDTHS = (576, 4096)  # one row each: a small and an 8B-sized hidden state


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, as the module computes it, by the faster implementation here."""
    if impl(x.dtype) == "native" and weight.dtype == x.dtype and x.is_contiguous() and weight.is_contiguous():
        return native.module().rms_norm(x.view(-1, x.shape[-1]), weight, eps).view_as(x)
    return reference(x, weight, eps)


def gemma_rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Gemma 3's RMSNorm of x by its module `norm` (normalized and multiplied by 1 + weight in float32, rounded
    once): the native kernel where the probe chose it for the llama norm (the same kernel, one flag apart), else
    the module itself (bit-identical to it by definition; the native one within a few ulps, as above)."""
    w = norm.weight
    if impl(x.dtype) == "native" and w.dtype == x.dtype and x.is_contiguous() and w.is_contiguous():
        return native.module().rms_norm(x.view(-1, x.shape[-1]), w, norm.eps, True).view_as(x)
    return norm(x)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused op in the module's arithmetic: bit-identical to the module (tests/test_generate.py)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _seconds(dtype: torch.dtype, name: str, width: int, reps: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    run = (lambda: native.module().rms_norm(x.view(1, width), w, 1e-5)) if name == "native" else \
        (lambda: reference(x, w, 1e-5))
    return timing.median_seconds(run, reps, samples=5)


def timings(dtype: torch.dtype, timer: Callable[[torch.dtype, str, int], float] = _seconds,
            cache_file=None) -> dict[str, float]:
    """Seconds summed over WIDTHS for each implementation, measured once per machine, dtype and build."""
    name = f"rms norm {str(dtype).removeprefix('torch.')}|native {native.build_id()}"
    return compute.cached_timings(name, {n: (lambda n=n: sum(timer(dtype, n, w) for w in WIDTHS)) for n in IMPLS},
                                  cache_file)


@functools.lru_cache(maxsize=None)
def impl(dtype: torch.dtype) -> str:
    """"native" where the kernel is built, runs `dtype` and the probe found it faster, else "torch"."""
    if dtype not in (torch.bfloat16, torch.float32) or native.module() is None:
        return "torch"
    t = timings(dtype)
    return "native" if t["native"] < t["torch"] else "torch"
