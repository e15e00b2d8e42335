"""Write a (quantized or float) model as a Hugging Face checkpoint directory, atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from quantkit.arch.adapter import checkpoint_namer
from quantkit.atomic import atomic_output_dir
from quantkit.formats.checkpoint import copy_passthrough, write_json, write_weights


def export_tensors(model: nn.Module, storage_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict to save: float tensors in the storage dtype, tied weights stored once."""
    tensors, seen = {}, {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    ckpt = checkpoint_namer(model)
    for key, t in model.state_dict().items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen:
            if tied:
                continue  # e.g. lm_head.weight tied to embed_tokens.weight
            t = t.clone()
        seen[ptr] = key
        wide_float = t.is_floating_point() and t.element_size() >= 2  # FP8 codes are stored as they are
        tensors[ckpt(key)] = t.to(storage_dtype) if wide_float else t
    return tensors


def export_checkpoint(
    model: nn.Module,
    out: Path,
    *,
    storage_dtype: torch.dtype,
    source: Optional[Path] = None,
    quantization_config: Optional[dict] = None,
    extra_files: Optional[dict[str, str]] = None,
    overwrite: bool = False,
) -> Path:
    """Save `model` to `out`; nothing appears at `out` unless every file was written."""
    with atomic_output_dir(out, overwrite) as tmp:
        write_weights(tmp, export_tensors(model, storage_dtype))
        config = model.config.to_diff_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = str(storage_dtype).removeprefix("torch.")
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
        write_json(tmp / "config.json", config)
        copy_passthrough(source, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out)
