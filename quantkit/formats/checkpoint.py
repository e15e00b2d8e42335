"""Reading and writing Hugging Face style checkpoint directories (safetensors shards + config.json)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from quantkit.errors import CheckpointError

IGNORED_EXTRA_KEYS = ("rotary_emb.inv_freq",)  # written by old exporters, recomputed at init
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# files copied verbatim from the source model so tokenizer and generation defaults travel along
PASSTHROUGH_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint; refuses pickle-based weights."""
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{path / INDEX_FILE}: unreadable shard index ({exc})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise CheckpointError(
            f"{path}: only pickle weights (.bin/.pt) found; quantkit loads safetensors only, since pickle "
            "files can execute code. Convert the checkpoint to safetensors first."
        )
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint, file by file; corrupted files raise CheckpointError naming them."""
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own types for truncation/corruption
            raise CheckpointError(
                f"{file}: corrupted or truncated safetensors file ({type(exc).__name__}: {exc}); "
                "re-create or re-download it"
            ) from exc


def read_config(path: Path, check: bool = True) -> dict:
    """config.json of a model directory, its fields checked (`formats.model_config.check`; `check=False`: only
    that it is a JSON object, for readers that build no model from it)."""
    from quantkit.formats import model_config

    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object of the model's settings, got {type(raw).__name__}")
    if check:
        model_config.check(raw, file)
    return raw


DEFAULT_SHARD_BYTES = 2 << 30
# safetensors' dtype names, and the order its writer lays tensors out in (this rank, then the name)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
ST_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


class _StreamedShard:
    """One safetensors file built as tensors come: each tensor's bytes go to a data file at once (so
    none is held), and `close` writes the header and the data in safetensors' own order, giving the
    bytes `safetensors.torch.save_file` would write for the same tensors."""

    def __init__(self, path: Path):
        self.path, self.data_path = path, path.with_name(path.name + ".data")
        self._data = open(self.data_path, "wb")
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # key -> (dtype, shape, start, nbytes)
        self.nbytes = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.entries:
            raise ValueError(f"tensor {key} written twice")
        if t.dtype not in ST_NAMES:
            raise ValueError(f"tensor {key}: dtype {t.dtype} cannot be written to safetensors here")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._data.write(memoryview(raw))
        self.entries[key] = (ST_NAMES[t.dtype], tuple(t.shape), self.nbytes, raw.nbytes)
        self.nbytes += raw.nbytes

    def add_pieces(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], pieces) -> None:
        """A tensor given as 1-D pieces in order (a large tensor copied without ever being whole in memory)."""
        if key in self.entries:
            raise ValueError(f"tensor {key} written twice")
        start = self.nbytes
        for piece in pieces:
            raw = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._data.write(memoryview(raw))
            self.nbytes += raw.nbytes
        expected = math.prod(shape) * dtype.itemsize
        if self.nbytes - start != expected:
            raise ValueError(f"tensor {key}: pieces of {self.nbytes - start} bytes for shape {list(shape)}")
        self.entries[key] = (ST_NAMES[dtype], tuple(shape), start, expected)

    def close(self) -> None:
        self._data.close()
        text, offsets = _header({k: (d, s, n) for k, (d, s, _, n) in self.entries.items()})
        with open(self.path, "wb") as out, open(self.data_path, "rb") as src:
            out.write(text)
            for key in offsets:
                _copy_range(src, out, self.entries[key][2], self.entries[key][3])
        os.unlink(self.data_path)


def _header(entries: dict[str, tuple[str, tuple[int, ...], int]]) -> tuple[bytes, dict[str, int]]:
    """The size prefix and JSON header of a safetensors file holding `entries` (key: (dtype name, shape, nbytes)),
    as safetensors' own writer lays it out (by dtype rank, then name); and each tensor's offset after the header, in
    that order."""
    order = sorted(entries, key=lambda k: (ST_ORDER.index(entries[k][0]), k))
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, offset = {}, 0
    for key in order:
        dtype, shape, nbytes = entries[key]
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[key] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


class _PlannedShard:
    """A shard whose tensors (names, dtypes, shapes) are known before any is written: the header goes first and each
    tensor straight to its place, so the data is written once (a `_StreamedShard` writes it twice). The same bytes."""

    def __init__(self, path: Path, plan: dict[str, tuple[str, tuple[int, ...], int]]):
        self.path, self.plan = path, plan
        text, offsets = _header(plan)
        self._at = {k: len(text) + o for k, o in offsets.items()}
        self._file = open(path, "wb")
        self._file.write(text)
        self.entries: dict[str, tuple] = {}
        self.nbytes = sum(n for _, _, n in plan.values())

    def _check(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if key in self.entries or self.plan.get(key, (None,))[:2] != (ST_NAMES.get(dtype), tuple(shape)):
            raise ValueError(f"tensor {key} ({dtype}, {list(shape)}): not what the plan of {self.path.name} has, "
                             "or written twice")
        self.entries[key] = self.plan[key]
        self._file.seek(self._at[key])

    def add(self, key: str, t: torch.Tensor) -> None:
        self._check(key, t.dtype, tuple(t.shape))
        self._file.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def add_pieces(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], pieces) -> None:
        self._check(key, dtype, shape)
        for piece in pieces:
            self._file.write(memoryview(piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self._file.close()
        missing = [k for k in self.plan if k not in self.entries]
        if missing:
            raise ValueError(f"{self.path.name}: planned tensors never written: {', '.join(missing[:4])}")


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype a checkpoint stores its float tensors in (config.json's dtype / torch_dtype)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"config.json: unsupported dtype {name!r}")
    return dtype


def _copy_range(src, out, start: int, nbytes: int, chunk: int = 64 << 20) -> None:
    src.seek(start)
    while nbytes:
        block = src.read(min(chunk, nbytes))
        if not block:
            raise OSError(f"{src.name}: ended early while writing {out.name}")
        out.write(block)
        nbytes -= len(block)


class ShardWriter:
    """Writes tensors as they come into safetensors shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own), then the index: one `model.safetensors` when a
    single shard holds everything. Each tensor goes to disk when it is added, so nothing is held
    in memory; the files are byte for byte what safetensors' `save_file` writes for the same shards."""

    def __init__(self, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 plan: Optional[list[tuple[str, torch.dtype, tuple[int, ...]]]] = None):
        """plan: every tensor to come, in order (name, dtype, shape): each is then written once, straight into its
        place in its shard (the shards split as they would without a plan), and nothing else may be added."""
        self.out, self.max_shard_bytes = Path(out), max_shard_bytes
        self._shards: list = []
        self.total_bytes = 0
        self._planned: dict[str, _PlannedShard] = {}
        self._has_plan = plan is not None
        if plan is not None:
            self._make_planned(plan)

    def _make_planned(self, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        groups: list[dict] = []
        size = 0
        for key, dtype, shape in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if not groups or (groups[-1] and size + nbytes > self.max_shard_bytes):
                groups.append({})
                size = 0
            groups[-1][key] = (ST_NAMES[dtype], tuple(shape), nbytes)
            size += nbytes
        for i, group in enumerate(groups or [{}]):
            shard = _PlannedShard(self.out / f".shard-{i + 1:05d}.safetensors", group)
            self._shards.append(shard)
            self._planned.update({k: shard for k in group})

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._shard_for(nbytes, key).add(key, tensor)
        self.total_bytes += nbytes

    def _shard_for(self, nbytes: int, key: str):
        """The shard the next tensor of `nbytes` goes to (a new one when it would pass max_shard_bytes; the planned
        one with a plan)."""
        if self._has_plan:
            if key not in self._planned:
                raise ValueError(f"tensor {key} is not in the writer's plan")
            return self._planned[key]
        current = self._shards[-1] if self._shards else None
        if current is None or (current.entries and current.nbytes + nbytes > self.max_shard_bytes):
            if current is not None:
                current.close()
            current = _StreamedShard(self.out / f".shard-{len(self._shards) + 1:05d}.safetensors")
            self._shards.append(current)
        return current

    def add_pieces(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], pieces) -> None:
        """`add` for a tensor given as 1-D pieces in order (`LazyCheckpoint.pieces_of`): never whole in memory."""
        nbytes = math.prod(shape) * dtype.itemsize
        self._shard_for(nbytes, key).add_pieces(key, dtype, shape, pieces)
        self.total_bytes += nbytes

    def close(self) -> list[Path]:
        """Finish the last shard, name the shards and write the index; returns the weight files."""
        if not self._shards:
            self._shards.append(_StreamedShard(self.out / ".shard-00001.safetensors"))
        for shard in self._shards if self._has_plan else self._shards[-1:]:  # (streamed ones closed as they filled)
            shard.close()
        if len(self._shards) == 1:
            os.replace(self._shards[0].path, self.out / SINGLE_FILE)
            return [self.out / SINGLE_FILE]
        n, weight_map, files = len(self._shards), {}, []
        for i, shard in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(shard.path, self.out / name)
            weight_map.update({k: name for k in shard.entries})
            files.append(self.out / name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return files


def write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write tensors as one file, or as shards plus an index when over `max_shard_bytes`."""
    writer = ShardWriter(out, max_shard_bytes)
    for key, t in tensors.items():
        writer.add(key, t)
    writer.close()


def copy_passthrough(src: Optional[Path], out: Path) -> None:
    if src is None:
        return
    for name in PASSTHROUGH_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
