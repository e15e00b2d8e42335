"""One decoder layer's calibration activations, batch by batch, within a memory budget.

The quantize job keeps every calibration batch's input to the current layer. Up to `budget` bytes
stay in memory (on the device they compute on); the batches beyond it wait in files of a spill
directory and are read back one at a time when a loop reaches them. The next layer's activations
are made while this layer's are consumed (`drain`), and both share one budget, so the bytes in
memory never pass it. Spilled bytes are the tensors' own, so results are identical either way.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import torch


@dataclass
class Budget:
    """Bytes of activations allowed in memory (None: no limit), and what is held and spilled."""

    limit: Optional[int] = None
    held: int = 0
    peak: int = 0  # most bytes held at once
    spilled_bytes: int = 0  # written to disk, summed over the run
    spilled_batches: int = 0

    def take(self, nbytes: int) -> bool:
        if self.limit is not None and self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return True

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes


@dataclass
class _Spilled:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device


Slot = Union[torch.Tensor, _Spilled, None]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Activations:
    """A sequence of per-batch tensors, in memory within `budget`, the rest in `spill_dir`."""

    def __init__(self, budget: Optional[Budget] = None, spill_dir: Optional[Path] = None):
        self.budget = budget or Budget()
        self.spill_dir = spill_dir
        self._slots: list[Slot] = []
        self._counter = 0

    # -- filling ---------------------------------------------------------------------------------

    def append(self, t: torch.Tensor) -> None:
        if self.budget.take(_nbytes(t)):
            self._slots.append(t)
            return
        if self.spill_dir is None:
            raise RuntimeError("activations exceed their memory budget and have no spill directory")
        fd, name = tempfile.mkstemp(prefix="batch-", suffix=".bin", dir=self.spill_dir)
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(raw))
        self._slots.append(_Spilled(Path(name), t.dtype, tuple(t.shape), t.device))
        self.budget.spilled_bytes += raw.nbytes
        self.budget.spilled_batches += 1

    def successor(self) -> "Activations":
        """An empty sequence for the next layer, sharing this one's budget and spill directory."""
        return Activations(self.budget, self.spill_dir)

    # -- reading ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i: int) -> torch.Tensor:
        slot = self._slots[i]
        if slot is None:
            raise IndexError(f"activation batch {i} was already consumed")
        return slot if isinstance(slot, torch.Tensor) else _read(slot)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self._slots)):
            yield self[i]

    def drain(self) -> Iterator[torch.Tensor]:
        """Each batch once, released (from memory or disk) as soon as the next one is asked for."""
        for i in range(len(self._slots)):
            t = self[i]
            self._release(i)
            yield t
            del t

    def _release(self, i: int) -> None:
        slot = self._slots[i]
        if isinstance(slot, torch.Tensor):
            self.budget.give_back(_nbytes(slot))
        elif isinstance(slot, _Spilled):
            slot.path.unlink(missing_ok=True)
        self._slots[i] = None

    def clear(self) -> None:
        for i in range(len(self._slots)):
            self._release(i)
        self._slots = []

    @property
    def spilled(self) -> int:
        """How many of the batches are on disk."""
        return sum(isinstance(s, _Spilled) for s in self._slots)


def _read(s: _Spilled) -> torch.Tensor:
    buf = torch.empty(_numel(s.shape) * s.dtype.itemsize, dtype=torch.uint8, device="cpu")
    with open(s.path, "rb") as f:
        got = f.readinto(memoryview(buf.numpy()))
    if got != buf.numel():
        raise OSError(f"spilled activations {s.path} are cut short ({got} of {buf.numel()} bytes)")
    return buf.view(s.dtype).reshape(s.shape).to(s.device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
