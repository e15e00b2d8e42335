"""The Python API: quantize a model in memory, look at it, save it (what `llmcompressor.oneshot` users write).

    import quantkit
    model, report = quantkit.quantize("smollm2-135m", "gptq-w4a16", num_samples=16, seq_len=256)
    print(report.summary())
    quantkit.save(model, "./smollm2-gptq")

`quantize` takes a checkpoint (a local directory, a demo name, a .gguf file) or a transformers model
already in memory, and a recipe (a name, a YAML file or a `Recipe`). The model is quantized in place
(its linears become packed int / FP8 modules that compute as the checkpoint will) and returned with
its report; `save` writes it as a compressed-tensors checkpoint, atomically, with the same
config, recipe.yaml and quantkit.json as `quantkit quantize`. Both are the one quantize flow
(`quantkit.flow.job.run`), which the CLI runs too (streaming layers from disk with `--load layers`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from quantkit.errors import QuantizationError
from quantkit.flow.job import Options, run
from quantkit.flow.recipe import Recipe, load_recipe
from quantkit.flow.record import QuantizeRecord
from quantkit.flow.write import write_whole
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES

log = logging.getLogger(__name__)
RECORD_ATTR = "quantkit_record"  # the attribute of a model quantized by `quantize` that `save` reads
__all__ = ["quantize", "save", "Quantized", "QuantizeRecord"]


class Quantized(NamedTuple):
    """`quantize`'s answer: unpack it (`model, report = quantkit.quantize(...)`) or read its fields."""

    model: nn.Module
    report: QuantizeRecord


def quantize(
    model: Union[str, Path, nn.Module],
    recipe: Union[str, Path, Recipe],
    *,
    overrides: Sequence[str] = (),
    dataset: Union[str, Sequence[str], None] = None,
    num_samples: Optional[int] = None,
    seq_len: Optional[int] = None,
    batches: Optional[list[torch.Tensor]] = None,
    tokenizer=None,
    dtype: Union[str, torch.dtype] = "auto",
    device: Union[str, torch.device, None] = "cpu",
    progress: bool = False,
    notify: Callable[[str], None] = log.info,
) -> Quantized:
    """Quantize `model` with `recipe` in memory; returns (model, report).

    model: a float checkpoint (local directory, demo name, .gguf file), loaded whole, or a transformers
    causal LM already in memory (quantized in place; keep a copy if you need the original).
    recipe: a recipe name (`quantkit recipes`), a YAML file, or a `Recipe`; `overrides` are `--set` items
    (`stages.0.scheme.group_size=64`), and `dataset`, `num_samples`, `seq_len` set the calibration ones.
    dataset: a shipped text name or a .txt/.jsonl/.parquet file, or the calibration texts themselves
    (a list of strings). batches: calibration token ids ([batch, seq] tensors) instead of any text.
    tokenizer: for text calibration of an in-memory model (default: the one saved beside the checkpoint
    the model came from). dtype: the compute dtype ("auto": the machine's fast one that holds the
    weights exactly, `quantkit.platform.compute`). device: where each decoder layer is calibrated ("auto" takes
    CUDA when present); the model itself stays where it is.
    """
    recipe = _recipe(recipe, overrides, dataset, num_samples, seq_len)
    texts = None if dataset is None or isinstance(dataset, str) else list(dataset)
    opts = Options(device=device, dtype=dtype, progress=progress, notify=notify, texts=texts, batches=batches,
                   tokenizer=tokenizer)
    net, record = run(model, recipe, opts)
    setattr(net, RECORD_ATTR, record)
    return Quantized(net, record)


def save(model: nn.Module, path: Union[str, Path], *, overwrite: bool = False,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra_metadata: Optional[dict] = None) -> Path:
    """Write a model quantized by `quantize` to `path` as a compressed-tensors checkpoint (vLLM and
    transformers load it). Atomic: nothing appears at `path` unless every file was written; an existing
    `path` is replaced only with `overwrite` (and never the model's source)."""
    record = getattr(model, RECORD_ATTR, None)
    if not isinstance(record, QuantizeRecord):
        raise QuantizationError("quantkit.save writes a model returned by quantkit.quantize (it reads what "
                                f"was quantized how from model.{RECORD_ATTR}); this model has none")
    return write_whole(model, record, Path(path), overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                       extra_metadata=extra_metadata)


def _recipe(recipe, overrides, dataset, num_samples, seq_len) -> Recipe:
    items = list(overrides)
    if isinstance(dataset, str):
        items.append(f"calibration.dataset={dataset}")
    if num_samples is not None:
        items.append(f"calibration.num_samples={num_samples}")
    if seq_len is not None:
        items.append(f"calibration.seq_len={seq_len}")
    if isinstance(recipe, Recipe):
        return recipe.with_overrides(items) if items else recipe
    return load_recipe(str(recipe), items)
