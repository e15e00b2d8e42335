"""A checkpoint read one tensor at a time, with plain file reads.

Keys are module names (checkpoint names mapped through the architecture's renames), so a model
skeleton's state-dict keys look tensors up directly. Only the safetensors headers are read up
front; a tensor's bytes are read when it is asked for, straight into its own buffer. Unlike
memory-mapping (safetensors' `safe_open`), this leaves no file pages in the process's resident
memory: a job walking a 15 GB checkpoint holds what it keeps, not what it has read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from quantkit.errors import CheckpointError
from quantkit.formats.checkpoint import ST_DTYPES as DTYPES
from quantkit.formats.checkpoint import weight_files
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class _Entry:
    file: Path
    stored: str  # the name in the file
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _header(file: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data begins."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file (no header); re-create or re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{file}: corrupted or truncated safetensors file (header of {n} bytes in a "
                                  f"{size}-byte file); re-create or re-download it")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{file}: corrupted safetensors header ({exc}); re-create or re-download it") from exc
    return header, 8 + n


class LazyCheckpoint:
    def __init__(self, path: Path, to_module: Callable[[str], str] = lambda name: name):
        self.path = Path(path)
        self._where: dict[str, _Entry] = {}  # module key -> where its bytes are
        for file in weight_files(self.path):
            header, base = _header(file)
            size = file.stat().st_size
            for stored, info in header.items():
                if stored == "__metadata__":
                    continue
                try:
                    dtype = DTYPES[info["dtype"]]
                    begin, end = info["data_offsets"]
                    entry = _Entry(file, stored, dtype, tuple(info["shape"]), base + begin, base + end)
                except (KeyError, TypeError, ValueError) as exc:
                    raise CheckpointError(f"{file}: tensor {stored}: unreadable header entry ({exc})") from exc
                if entry.end > size or entry.end - entry.start != _numel(entry.shape) * dtype.itemsize:
                    raise CheckpointError(f"{file}: tensor {stored} lies past the end of the file or has the wrong "
                                          "size: the file is truncated or corrupted; re-create or re-download it")
                self._where[to_module(stored)] = entry

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def stored_name(self, key: str) -> str:
        return self._where[key].stored

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of tensor `key`, from the header (nothing is read)."""
        e = self._where[key]
        return e.dtype, e.shape

    def get(self, key: str) -> torch.Tensor:
        """The tensor of module key `key`, read from disk into a buffer of its own."""
        if key not in self._where:
            raise CheckpointError(f"{self.path}: tensor {key} is missing from the checkpoint")
        e = self._where[key]
        buf = torch.empty(e.end - e.start, dtype=torch.uint8, device="cpu")  # host memory, whatever the default device
        with open(e.file, "rb") as f:
            f.seek(e.start)
            got = f.readinto(memoryview(buf.numpy()))
        if got != e.end - e.start:
            raise CheckpointError(f"{e.file}: tensor {e.stored} is cut short; re-create or re-download the file")
        return buf.view(e.dtype).reshape(e.shape)

    def rows(self, key: str, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (1-D, int) of 2-D tensor `key`, read one by one: [len(index), columns]."""
        e = self._where[key]
        if len(e.shape) != 2:
            raise ValueError(f"tensor {e.stored} is not a matrix")
        row_bytes = e.shape[1] * e.dtype.itemsize
        out = torch.empty(len(index), row_bytes, dtype=torch.uint8, device="cpu")
        with open(e.file, "rb") as f:
            for k, r in enumerate(index.tolist()):
                if not 0 <= r < e.shape[0]:
                    raise IndexError(f"row {r} of {e.stored} (it has {e.shape[0]})")
                f.seek(e.start + r * row_bytes)
                if f.readinto(memoryview(out[k].numpy())) != row_bytes:
                    raise CheckpointError(f"{e.file}: tensor {e.stored} is cut short; re-create or re-download the file")
        return out.view(e.dtype)

    def row_block(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of tensor `key` (first dim), read in one go: [stop - start, ...]."""
        e = self._where[key]
        row_bytes = _numel(e.shape[1:]) * e.dtype.itemsize
        stop = min(stop, e.shape[0])
        buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8, device="cpu")
        with open(e.file, "rb") as f:
            f.seek(e.start + start * row_bytes)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise CheckpointError(f"{e.file}: tensor {e.stored} is cut short; re-create or re-download the file")
        return buf.view(e.dtype).reshape(stop - start, *e.shape[1:])

    def pieces(self, max_bytes: int = 64 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as 1-D pieces of at most `max_bytes` (whole elements), read one at a time: a
        pass over the checkpoint that never holds a whole large tensor."""
        for key in self._where:
            for piece in self.pieces_of(key, max_bytes):
                yield key, piece

    def pieces_of(self, key: str, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Tensor `key` as 1-D pieces of at most `max_bytes` (whole elements), read one at a time."""
        e = self._where[key]
        step = max(1, max_bytes // e.dtype.itemsize) * e.dtype.itemsize
        with open(e.file, "rb") as f:
            f.seek(e.start)
            for begin in range(e.start, max(e.end, e.start + 1), step):
                n = min(step, e.end - begin)
                buf = torch.empty(n, dtype=torch.uint8, device="cpu")
                if n and f.readinto(memoryview(buf.numpy())) != n:
                    raise CheckpointError(f"{e.file}: tensor {e.stored} is cut short; re-create or re-download the file")
                yield buf.view(e.dtype)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time (each is dropped by the caller before the next is read)."""
        for key in self._where:
            yield key, self.get(key)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
