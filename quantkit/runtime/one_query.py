"""One query's attention per sequence over the lean decode step's static KV cache: torch's SDPA or
quantkit's native kernel (`kernels.native.attend_one`), whichever a probe measured faster here for the
cache's dtype.

On a 2-core AMD EPYC with avx512_bf16 (no AMX), bf16 SDPA for one query of SmolLM2's heads (9 query heads
over 3 kv heads of 64) took 238 us over 300 cached positions and 3.9 ms over 2000: 30 layers made a step
at a 2000-token context 4x slower than the layers' linears. The native kernel reads each key and value row
once for the query heads that share it (float32 scores and softmax, one rounding of the output): 34 us and
215 us there, with SDPA's error against a float64 reference or less. Float32 SDPA was as fast as the native
kernel, so the choice is measured per dtype (`impl`), once per machine, and cached.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from quantkit.kernels import native
from quantkit.platform import compute, timing

LENGTHS = (64, 512, 2048)  # cached positions the probe times, summed: short chats to long documents
SHAPE = (9, 3, 64)  # query heads, kv heads, head dim of the probe (SmolLM2's)
IMPLS = ("sdpa", "native")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, mask: Optional[torch.Tensor],
           scale: float) -> torch.Tensor:
    """q [B, H, 1, D] over the first `length` slots of keys / values [B, H_kv, S, D] (a static cache, or a view
    of a gathered paged context: rows of D contiguous); mask: additive [B, 1, 1, length] in q's dtype, or None.
    Returns [B, H, 1, D]."""
    if impl(q.dtype) == "native" and q.dtype == keys.dtype == values.dtype and keys.stride(-1) == 1 \
            and values.stride(-1) == 1:
        b, h, _, d = q.shape
        flat = None if mask is None else mask[:, 0, 0].float().contiguous()
        return native.module().attend_one(q.reshape(b, h, d).contiguous(), keys, values, flat, length,
                                          scale).view(b, h, 1, d)
    return F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length], attn_mask=mask,
                                          scale=scale, enable_gqa=q.shape[1] != keys.shape[1])


def available(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float32) and native.module() is not None


def _seconds(dtype: torch.dtype, name: str, length: int, reps: int = 20) -> float:
    """Median seconds of one call by `name` over `length` positions of a 4096-slot cache of SHAPE."""
    heads, kv_heads, dim = SHAPE
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, dim, generator=g).to(dtype)
    keys, values = (torch.randn(1, kv_heads, 4096, dim, generator=g).to(dtype) for _ in range(2))
    if name == "native":
        qf = q.reshape(1, heads, dim)
        run = lambda: native.module().attend_one(qf, keys, values, None, length, 0.125)  # noqa: E731
    else:
        run = lambda: F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length],  # noqa: E731
                                                     scale=0.125, enable_gqa=True)
    return timing.median_seconds(run, 1, samples=reps)


def timings(dtype: torch.dtype, timer: Callable[[torch.dtype, str, int], float] = _seconds,
            cache_file=None) -> dict[str, float]:
    """Seconds summed over LENGTHS for each implementation, measured once per machine and dtype (cached)."""
    name = f"one-query attention {str(dtype).removeprefix('torch.')}|native {native.build_id()}"
    return compute.cached_timings(name, {n: (lambda n=n: sum(timer(dtype, n, length) for length in LENGTHS))
                                         for n in IMPLS}, cache_file)


@functools.lru_cache(maxsize=None)
def impl(dtype: torch.dtype) -> str:
    """"native" where the kernel runs `dtype` and the probe found it faster, else "sdpa"."""
    if not available(dtype):
        return "sdpa"
    t = timings(dtype)
    return "native" if t["native"] < t["sdpa"] else "sdpa"
