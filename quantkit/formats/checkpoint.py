"""Reading and writing Hugging Face style checkpoint directories (safetensors shards + config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.errors import CheckpointError

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
            ) from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: invalid JSON ({exc})") from None


def write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 2 << 30) -> None:
    """Write tensors as one file, or as shards plus an index when over `max_shard_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def copy_passthrough(src: Optional[Path], out: Path) -> None:
    if src is None:
        return
    for name in PASSTHROUGH_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
