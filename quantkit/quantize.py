"""The quantize job: resolve the model, calibrate, run the pipeline, export the checkpoint."""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from quantkit import __version__
from quantkit import compute
from quantkit.arch.adapter import adapter_for
from quantkit.atomic import check_output_free
from quantkit.calibration.data import load_text, make_chunks, tokenize
from quantkit.errors import QuantizationError
from quantkit.export import export_checkpoint
from quantkit.formats.checkpoint import read_config
from quantkit.formats.compressed_tensors import build_quantization_config
from quantkit.models.resolve import resolve_model
from quantkit.pipeline import QuantizationResult, build_stages, quantize_model
from quantkit.recipe import Recipe
from quantkit.runtime.loader import checkpoint_dtype, load, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class QuantizeReport:
    output: Path
    source: Path
    result: QuantizationResult
    seconds: float
    compute: compute.ComputeChoice


def default_output(source: Path, recipe: Recipe) -> Path:
    return Path.cwd() / f"{source.name}-{recipe.name}"


def calibration_batches(source: Path, recipe: Recipe, needs_bos: bool) -> list[torch.Tensor]:
    cal = recipe.calibration
    tokenizer = load_tokenizer(source)
    ids = tokenize(tokenizer, load_text(cal.dataset, cal.text_column))
    bos = tokenizer.bos_token_id if needs_bos else None
    chunks = make_chunks(ids, cal.num_samples, cal.seq_len, cal.seed, bos, label=cal.dataset)
    return list(chunks.split(cal.batch_size))  # [batch, seq_len] each


def quantize(
    model_spec: Optional[str],
    recipe: Recipe,
    output: Optional[Path] = None,
    overwrite: bool = False,
    progress: bool = True,
    notify: Callable[[str], None] = log.info,
) -> QuantizeReport:
    """Quantize a checkpoint with `recipe` and write the result to `output`; `notify` gets the
    one-line messages a user should see (the compute dtype chosen)."""
    start = time.perf_counter()
    source = resolve_model(model_spec)
    out = Path(output) if output else default_output(source, recipe)
    check_output_free(out, overwrite)  # before minutes of work, not after
    raw = read_config(source)
    if raw.get("quantization_config"):
        raise QuantizationError(f"{source} is already quantized ({raw['quantization_config'].get('quant_method')}); "
                                "quantize the original float checkpoint")
    adapter = adapter_for(raw.get("model_type", "?"))
    storage_dtype = checkpoint_dtype(raw)
    choice = compute.choose(storage_dtype, "cpu", recipe.calibration.dtype, "calibration.dtype")
    notify(choice.describe())
    model = load(source, dtype=choice.dtype)
    stages = build_stages(model, adapter, recipe)
    batches = None
    if any(s.algorithm.needs_calibration for s in stages):
        batches = calibration_batches(source, recipe, adapter.needs_bos)
    result = quantize_model(model, adapter, stages, batches, storage_dtype, progress)
    metadata = {
        "quantkit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": str(source),
        "recipe": recipe.name,
        "compute": choice.to_json(),
        "quantize_seconds": round(result.seconds, 2),
        "layers": result.layers,
    }
    export_checkpoint(
        model, out, storage_dtype=storage_dtype, source=source,
        quantization_config=build_quantization_config(model, result.quantized, result.kv_cache_scheme),
        extra_files={"recipe.yaml": recipe.to_yaml(), "quantkit.json": json.dumps(metadata, indent=2) + "\n"},
        overwrite=overwrite,
    )
    return QuantizeReport(out, source, result, time.perf_counter() - start, choice)
