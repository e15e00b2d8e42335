"""16-bit matmuls run as float32 GEMMs, for CPUs whose own 16-bit GEMMs are slow.

A bf16 (or fp16) matmul accumulates in float32 and rounds its result to 16 bits once; on a CPU
without fast bf16 kernels torch computes that in a slow loop (an AVX2 EPYC: 0.3 GFLOPS against 30
in float32; an AVX-512 Xeon without AMX: a 512 x 576 x 1536 linear 7.2 ms in bf16, 3.6 ms as
below). `WideMatmuls` computes the same thing on the float32 kernels: widen the 16-bit operands
(exact), multiply in float32, round the product to the 16-bit dtype. The numbers are those of a
16-bit GEMM up to the order of the float32 additions, the same freedom any two GEMM kernels have
(SmolLM2's logits: 1.1e-2 relative from float32 either way). Everything else (elementwise ops,
attention, norms, storage) stays 16-bit.

`compute.choose` decides where this applies (`ComputeChoice.wide_matmuls`: a 16-bit dtype asked
for on a CPU that does not compute it fast, or a 16-bit model that fits in memory only as stored);
calibration runs inside `widened(choice)`, and the loader wraps a model's forwards with
`wrap_forward`. A large operand (a weight) is widened into one float32 buffer that the mode keeps
for as long as it is entered: a fresh 64-235 MB allocation per call cost more in page faults than
the conversion itself (an AVX-512 Xeon without AMX, 4096 x 4096 at 64 / 256 rows: 34.0 / 56.3 ms
fresh, 15.7 / 40.6 reused, native bf16 14.6 / 52.3; converting block by block into a small buffer
was slower still: narrow GEMMs and strided copies).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

WIDENED_DTYPES = (torch.bfloat16, torch.float16)

# the products whose 16-bit CPU kernels are the slow part: the GEMM forms a transformer layer calls (a GEMV,
# torch.mv, is memory-bound and stays native)
MATMULS = frozenset({
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm, torch.einsum,
})

# widen a product only when its left operand has this many rows: widening converts the whole weight to
# float32 at every call, which a GEMV (decode's one token, a few rows) does not earn back. Measured (a 576
# -> 1536 linear / a 4096 -> 4096 one, us): AVX2-limited torch, 1 row native 116 / 1590 vs widened 373 / 20750,
# 64 rows 6248 / 86287 vs 1321 / 39359; an AVX-512 Xeon without AMX, 64 rows 795 / 14660 vs 905 / 33660,
# 512 rows 7200 vs 3600 (the first shape); the 100x-slow bf16 of an AVX2 EPYC gains at every size
MIN_ROWS = 64

# an operand with this many elements is widened into the mode's reused buffer rather than a fresh tensor
# (smaller ones come from the allocator's warm heap, where reusing gains nothing: a 1536 x 576 weight)
SCRATCH_MIN = 1 << 20

_BIAS_FIRST = frozenset({torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm})  # (bias, a, b)
_active = threading.local()  # the dtypes this thread already widens (one mode per dtype is enough)


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):  # einsum's operand list
            yield from (t for t in a if isinstance(t, torch.Tensor))


class Scratch:
    """One float32 buffer, grown to the largest operand asked for, that widened operands are copied into."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def holding(self, t: torch.Tensor) -> torch.Tensor:
        """`t` widened to float32 in the buffer (contiguous, t's shape); valid until the next call."""
        n = t.numel()
        if self.buffer is None or self.buffer.numel() < n:
            self.buffer = None  # the old one goes before the new one comes
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                self.buffer = torch.empty(n, dtype=torch.float32)
        return self.buffer[:n].view(t.shape).copy_(t)

    def release(self) -> None:
        self.buffer = None


def _widen(a, big, scratch):
    if isinstance(a, torch.Tensor):
        return scratch.holding(a) if a is big else a.float()
    if isinstance(a, (list, tuple)):
        return type(a)(_widen(t, big, scratch) for t in a)
    return a


def widened_call(func, args: tuple, kwargs: dict, scratch: Scratch | None = None):
    """`func(*args, **kwargs)` with every 16-bit operand widened to float32 and the product rounded back.
    With `scratch`, the largest operand (from SCRATCH_MIN elements) is widened into its buffer, unless
    autograd would keep it for a backward pass (the next call overwrites it)."""
    tensors = list(_tensors(args, kwargs))
    big = max(tensors, key=torch.Tensor.numel)
    if (scratch is None or big.numel() < SCRATCH_MIN
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        big = None
    out = func(*(_widen(a, big, scratch) for a in args), **{k: _widen(v, big, scratch) for k, v in kwargs.items()})
    return out.to(tensors[0].dtype)  # float32 -> 16 bits: a new tensor, never a view of the buffer


def rows(t: torch.Tensor) -> int:
    """A product's rows on the left operand's side: every dimension but the last (one for a vector)."""
    return t.numel() // t.shape[-1] if t.dim() and t.shape[-1] else 1


def wants_widening(func, args: tuple, kwargs: dict, dtype: torch.dtype) -> bool:
    """Whether this call is a matmul whose tensor operands are all `dtype` on the CPU, with at least
    MIN_ROWS rows on the left (no `out=`: a caller's output buffer is filled natively, as asked)."""
    if func not in MATMULS or "out" in kwargs:
        return False
    tensors = list(_tensors(args, kwargs))
    if not tensors or not all(t.dtype == dtype and t.device.type == "cpu" for t in tensors):
        return False
    left = tensors[1] if func in _BIAS_FIRST and len(tensors) > 1 else tensors[0]
    return rows(left) >= MIN_ROWS


class WideMatmuls(TorchFunctionMode):
    """Inside it, CPU matmuls whose operands are all `dtype` run as float32 GEMMs rounded back to `dtype`."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        assert dtype in WIDENED_DTYPES, f"only 16-bit matmuls are widened, not {dtype}"
        self.dtype = dtype
        self.scratch = Scratch()  # this thread's: a mode is entered on one thread's stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if wants_widening(func, args, kwargs, self.dtype):
            return widened_call(func, args, kwargs, self.scratch)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        self.scratch.release()  # the buffer lives as long as the mode is entered
        return super().__exit__(*exc)


def widening_active(dtype: torch.dtype) -> bool:
    """Whether this thread's matmuls in `dtype` are being widened now (inside `widening(dtype)`)."""
    return dtype in _active.__dict__.get("dtypes", ())


@contextlib.contextmanager
def widening(dtype: torch.dtype) -> Iterator[None]:
    """`WideMatmuls(dtype)` for the duration, entered once per thread however deeply nested."""
    active = _active.__dict__.setdefault("dtypes", [])
    if dtype in active:
        yield
        return
    active.append(dtype)
    try:
        with WideMatmuls(dtype):
            yield
    finally:
        active.remove(dtype)


def widened(choice) -> contextlib.AbstractContextManager:
    """The context a compute choice's forwards run in: widening where `choice.wide_matmuls`, else nothing."""
    return widening(choice.dtype) if choice.wide_matmuls else contextlib.nullcontext()


def wrap_forward(model: torch.nn.Module, choice) -> None:
    """Make the model's forwards run inside `widened(choice)`: the model itself, its decoder stack and its
    head, since eval, lm-eval and generate's prefill call the latter two directly. A call too small for
    any product to be widened (a decode step's one token) skips the mode and its per-op overhead.
    Nothing changes where the choice does not widen."""
    if not choice.wide_matmuls:
        return
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in dict.fromkeys(m for m in (model, decoder, head) if m is not None):
        _wrap(module, choice.dtype)


def _wrap(module: torch.nn.Module, dtype: torch.dtype) -> None:
    forward = module.forward

    @functools.wraps(forward)  # transformers reads forward's signature (generate's input preparation)
    def widened_forward(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and (first.numel() if not first.is_floating_point() else rows(first)) < MIN_ROWS:
            return forward(*args, **kwargs)  # token ids or hidden states of a few positions: GEMVs only
        with widening(dtype):
            return forward(*args, **kwargs)

    module.forward = widened_forward
