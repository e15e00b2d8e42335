"""Write a (quantized or float) model as a Hugging Face checkpoint directory, atomically."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from quantkit.plugins.catalog import checkpoint_namer
from quantkit.checkpoints.atomic import atomic_output_dir
from quantkit.checkpoints.finite import check_output
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES, copy_passthrough, write_json, write_weights
from quantkit.formats.lazy import LazyCheckpoint

log = logging.getLogger(__name__)


def export_tensors(model: nn.Module, storage_dtype: torch.dtype,
                   stored: Optional[LazyCheckpoint] = None) -> dict[str, torch.Tensor]:
    """The state dict to save: float tensors in the storage dtype, tied weights stored once; with `stored`
    (the source checkpoint, when the compute dtype rounded its weights), the tensors that are still only
    that rounding as the source stored them (`as_stored_exactly`)."""
    tensors, seen = {}, {}
    keep = fixed_dtype_keys(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    ckpt = checkpoint_namer(model)
    for key, t in model.state_dict().items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen:
            if tied:
                continue  # e.g. lm_head.weight tied to embed_tokens.weight
            t = t.clone()
        seen[ptr] = key
        if key in keep:
            tensors[ckpt(key)] = t
        else:
            source = stored.get(key) if stored is not None and key in stored and _wide_float(t) else None
            tensors[ckpt(key)] = as_stored_exactly(t, source, storage_dtype)
    return tensors


def fixed_dtype_keys(module: nn.Module) -> set[str]:
    """State-dict keys (relative to `module`) kept in their own dtype rather than the storage dtype: the
    scales of schemes that fix theirs (a GGUF grid's fp16 scales, which the codes were chosen against), and
    the buffers a module names in `fixed_dtype_buffers` (NVFP4's float32 global scales)."""
    keys = set()
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        if getattr(getattr(m, "scheme", None), "scale_dtype", None) is not None:
            keys.add(prefix + "weight_scale")
        keys.update(prefix + b for b in getattr(m, "fixed_dtype_buffers", ()))
    return keys


def as_stored(t: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """A tensor as the checkpoint keeps it: wide floats in the storage dtype (FP8 codes as they are)."""
    return t.to(storage_dtype) if _wide_float(t) else t


def _wide_float(t: torch.Tensor) -> bool:
    """A float of 16 bits or more: stored in the checkpoint dtype, and possibly a compute dtype's rounding
    of a stored tensor. FP8 codes are neither (kept as they are; their source is never read)."""
    return t.is_floating_point() and t.element_size() >= 2


def as_stored_exactly(t: torch.Tensor, source: Optional[torch.Tensor], storage_dtype: torch.dtype) -> torch.Tensor:
    """`as_stored(t)`, except where `t` is only a narrower compute dtype's rounding of the source's tensor
    of the same name (`source`): then the source's own values. A compute dtype narrower than the
    checkpoint (bf16 asked for on a float32 one) rounds every weight it loads; the tensors that no stage
    changed or quantized (embeddings, norms, routers) are still exactly that rounding when written, and
    go back to the file as they were instead of rounded."""
    if (source is not None and _wide_float(t) and source.is_floating_point() and t.dtype != source.dtype
            and t.shape == source.shape and torch.equal(t, source.to(t.dtype))):
        return as_stored(source, storage_dtype)
    return as_stored(t, storage_dtype)


def export_checkpoint(
    model: nn.Module,
    out: Path,
    *,
    storage_dtype: torch.dtype,
    source: Optional[Path] = None,
    quantization_config: Optional[dict] = None,
    extra_files: Optional[dict[str, str]] = None,
    overwrite: bool = False,
    protect: Sequence[Path] = (),
    keep_remote_code: bool = False,
    notify: Callable[[str], None] = log.warning,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    stored: Optional[LazyCheckpoint] = None,
) -> Path:
    """Save `model` to `out`; nothing appears at `out` unless every file was written.

    Every float tensor (weights, scales) is checked to be finite first. `protect`: paths --overwrite
    must not replace (the source). `stored`: the source checkpoint when the compute dtype was narrower
    than it (see `export_tensors`). For the other files see `write_model_files`."""
    tensors = export_tensors(model, storage_dtype, stored)
    check_output(tensors)
    with atomic_output_dir(out, overwrite, protect) as tmp:
        write_weights(tmp, tensors, max_shard_bytes)
        write_model_files(tmp, model, storage_dtype, source, quantization_config, extra_files, keep_remote_code, notify)
    return Path(out)


def write_model_files(tmp: Path, model: nn.Module, storage_dtype: torch.dtype, source: Optional[Path],
                      quantization_config: Optional[dict], extra_files: Optional[dict[str, str]],
                      keep_remote_code: bool, notify: Callable[[str], None]) -> None:
    """Everything of a checkpoint directory but the weights: config.json (with quantization_config),
    the source's tokenizer and generation files, and `extra_files`. The config's `auto_map` (remote
    code) is dropped, with a message to `notify`, unless `keep_remote_code`, which also copies the
    source's .py files (quantkit never runs them)."""
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(storage_dtype).removeprefix("torch.")
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    if config.get("auto_map") and not keep_remote_code:
        notify(f"dropped auto_map from the written config.json (it points at remote code: "
               f"{', '.join(sorted(config.pop('auto_map')))}); pass --trust-remote-code to keep it with the .py files")
    write_json(tmp / "config.json", config)
    copy_passthrough(source, tmp)
    if keep_remote_code and source is not None and config.get("auto_map"):
        for py in sorted(Path(source).glob("*.py")):
            shutil.copy2(py, tmp / py.name)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
