"""Reading and writing Hugging Face style checkpoint directories (safetensors shards + config.json)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: invalid JSON ({exc})") from None


DEFAULT_SHARD_BYTES = 2 << 30


class ShardWriter:
    """Writes tensors as they come into safetensors shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own), then the index: one `model.safetensors` when a
    single shard holds everything. Only the shard being filled is held in memory. A shard's bytes
    depend only on which tensors it holds (safetensors orders them itself), so writing a model in
    one go or layer by layer gives identical files."""

    def __init__(self, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out, self.max_shard_bytes = Path(out), max_shard_bytes
        self._current: dict[str, torch.Tensor] = {}
        self._size = 0
        self._written: list[tuple[Path, list[str]]] = []  # (temporary file, keys)
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._size + nbytes > self.max_shard_bytes:
            self._flush()
        self._current[key] = tensor.contiguous()
        self._size += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out / f".shard-{len(self._written) + 1:05d}.safetensors"
        save_file(self._current, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._current)))
        self._current, self._size = {}, 0

    def close(self) -> list[Path]:
        """Write what is held, name the shards and write the index; returns the weight files."""
        if self._current or not self._written:
            self._flush()
        if len(self._written) == 1:
            os.replace(self._written[0][0], self.out / SINGLE_FILE)
            return [self.out / SINGLE_FILE]
        n, weight_map, files = len(self._written), {}, []
        for i, (path, keys) in enumerate(self._written):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.out / name)
            weight_map.update({k: name for k in keys})
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
