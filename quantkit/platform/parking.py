"""A matrix that waits on disk while the memory it would take is needed for something else.

GPTQ holds each group's Hessian H [n, n] while the solver factorizes its own copy of it: on an 8B
model's down_proj (n = 14336) that is two 822 MB matrices at once. H is only read before the solve (the
solver's copy is built from it) and after it (the error report, a dampening retry), so it can wait in a
file meanwhile: `Parked(H)` writes it to an unlinked temporary file (nothing is left behind if the
process dies) and drops its own reference; the solver reads it back a block of rows at a time
(`rows`), the report as a whole (`load`). The values read back are the bytes written: nothing changes
but where they wait. The file goes when the object is closed or collected.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch


class Parked:
    """A 2-D tensor's values in an unlinked temporary file, read back by rows or whole on its device.

    The caller must drop its own references to the tensor for its memory to be freed."""

    def __init__(self, t: torch.Tensor, directory: Optional[str] = None):
        if t.dim() != 2:
            raise ValueError(f"Parked holds 2-D tensors, got shape {tuple(t.shape)}")
        self.shape = t.shape
        self.dtype = t.dtype
        self.device = t.device
        self._diag = torch.diagonal(t).clone() if t.shape[0] == t.shape[1] else None
        self._file = tempfile.TemporaryFile(dir=directory, prefix="quantkit-parked-")
        host = t.detach().contiguous().cpu()
        view = memoryview(host.reshape(-1).view(torch.uint8).numpy())
        written = 0
        while written < len(view):
            written += self._file.write(view[written:])
        self._file.flush()
        self._row_bytes = self.shape[1] * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self._row_bytes

    def diagonal(self) -> torch.Tensor:
        """The diagonal (kept in memory: n values)."""
        if self._diag is None:
            raise ValueError("diagonal of a non-square parked tensor")
        return self._diag

    def rows(self, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows start..stop as a new tensor on the tensor's device (or into `out`, [stop - start, cols])."""
        stop = min(stop, self.shape[0])
        host = torch.empty(stop - start, self.shape[1], dtype=self.dtype)
        buf = memoryview(host.reshape(-1).view(torch.uint8).numpy())
        got, offset = 0, start * self._row_bytes
        while got < len(buf):
            n = os.preadv(self._file.fileno(), [buf[got:]], offset + got)
            if n <= 0:
                raise OSError(f"parked tensor's file is cut short ({got} of {len(buf)} bytes at row {start})")
            got += n
        if out is not None:
            return out.copy_(host)
        return host if self.device.type == "cpu" else host.to(self.device)

    def load(self) -> torch.Tensor:
        """The whole tensor again, on its device."""
        if self.device.type == "cpu":
            return self.rows(0, self.shape[0])
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        step = max(1, (64 << 20) // self._row_bytes)  # 64 MB of host memory at a time
        for r in range(0, self.shape[0], step):
            self.rows(r, r + step, out=out[r : r + step])
        return out

    def close(self) -> None:
        self._file.close()

    def __del__(self):
        try:
            self._file.close()
        except Exception:
            pass
