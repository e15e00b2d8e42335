"""How a quantize run's results reach the disk: a model in memory written whole, or a layer-by-layer run whose
finished layers go to its resumable state (`quantkit.flow.resume`) and are assembled into shards at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from torch import nn

from quantkit.checkpoints.atomic import atomic_output_dir
from quantkit.checkpoints.export import export_checkpoint, write_model_files
from quantkit.checkpoints.quantization_config import build_quantization_config
from quantkit.flow import resume as resume_mod
from quantkit.flow.onload import OnloadedModel
from quantkit.flow.pipeline import QuantizationResult, quantize_model, rewrites_outside, transform_outside
from quantkit.flow.record import QuantizeRecord
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES, ShardWriter
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.plugins.catalog import adapter_for, format_for
from quantkit.quant.schemes import QuantScheme


def write_whole(model: nn.Module, record: QuantizeRecord, out: Path, *, overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, keep_remote_code: bool = False,
                notify: Optional[Callable[[str], None]] = None, extra_metadata: Optional[dict] = None) -> Path:
    """Write a quantized model in memory as a compressed-tensors checkpoint, atomically (`export_checkpoint`);
    the tensors that are still only the compute dtype's rounding of the source are written as stored."""
    result = record.result
    source = record.source
    return export_checkpoint(
        model, Path(out), storage_dtype=record.storage_dtype, source=source,
        quantization_config=build_quantization_config(model, result.quantized, result.kv_cache_scheme, result.layers),
        extra_files=record.files(extra_metadata), overwrite=overwrite, protect=[source] if source is not None else [],
        keep_remote_code=keep_remote_code, notify=notify, max_shard_bytes=max_shard_bytes,
        stored=None if record.rounded_from is None else LazyCheckpoint(
            record.rounded_from, adapter_for(model.config.model_type).to_module_name))


def run_layers(model, adapter, stages, batches, record: QuantizeRecord, state: "resume_mod.RunState",
               onloaded: OnloadedModel, *, progress: bool, activations, overwrite: bool, max_shard_bytes: int,
               keep_remote_code: bool, notify, before_files: Callable[[], None]) -> QuantizationResult:
    """The pipeline over an onloaded model, each finished layer kept in the run's state and the shards
    assembled from the parts at the end, inside an atomic output directory (an interrupted run leaves nothing)."""
    source, storage = record.source, record.storage_dtype
    with atomic_output_dir(record.output, overwrite, protect=[source]) as tmp:
        part = None if state.has("head") else state.part("head")
        _outside(model, adapter, stages, onloaded)
        onloaded.begin(part, needs_embeddings=batches is not None)  # None: written by the stopped run
        if part is not None:
            state.keep("head", part)
        start = state.finished
        result = quantize_model(
            model, adapter, stages, batches, storage, progress, store=_PartStore(onloaded, state),
            device=record.device.device, activations=activations, start_layer=start,
            resume_hidden=state.hidden() if start and batches is not None else None, result=restored(state.report),
            on_layer_done=lambda li, inputs, res: state.layer_done(li, inputs.hidden if inputs else None,
                                                                   report_of(res)))
        part = state.part("tail")
        onloaded.writer = part
        onloaded.end()
        state.keep("tail", part)
        writer = ShardWriter(tmp, max_shard_bytes)
        n = len(adapter.layers(model))
        state.assemble(writer, ["head", *(resume_mod.layer_part(i) for i in range(n)), "tail"])
        writer.close()
        record.result = result
        before_files()
        write_model_files(tmp, model, storage, source,
                          build_quantization_config(model, result.quantized, result.kv_cache_scheme, result.layers),
                          record.files(), keep_remote_code, notify)
    return result


def run_silent(model, adapter, stages, batches, storage_dtype, device, activations,
               onloaded: Optional[OnloadedModel]) -> QuantizationResult:
    """A rank other than 0 of a distributed run: the same work on its share of the batches (its part of
    every collective), nothing written."""
    if onloaded is None:
        return quantize_model(model, adapter, stages, batches, storage_dtype, False, device=device,
                              activations=activations)
    _outside(model, adapter, stages, onloaded)
    onloaded.begin(None, needs_embeddings=batches is not None)
    result = quantize_model(model, adapter, stages, batches, storage_dtype, False, store=_DiscardStore(onloaded),
                            device=device, activations=activations)
    onloaded.end(write=False)
    return result


def _outside(model, adapter, stages, onloaded: OnloadedModel) -> None:
    """A stage that rewrites the tensors outside the decoder layers (rotate) gets them in memory, rewrites them
    before any is written or read for calibration, and they are written from the model."""
    if rewrites_outside(stages):
        onloaded.materialize_outside()
        transform_outside(model, adapter, stages)


class _DiscardStore:
    """Layers loaded as usual and emptied when done, their tensors written by rank 0 only."""

    def __init__(self, onloaded: OnloadedModel):
        self.onloaded = onloaded

    def load_layer(self, index: int, layer: nn.Module) -> None:
        self.onloaded.load_layer(index, layer)

    def finish_layer(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")


class _PartStore:
    """The pipeline's layer store for a resumable run: each finished layer's tensors go to a part file of the
    run's state (`quantkit.flow.resume`) instead of straight to the output shards."""

    def __init__(self, onloaded: OnloadedModel, state: "resume_mod.RunState"):
        self.onloaded, self.state = onloaded, state

    def load_layer(self, index: int, layer: nn.Module) -> None:
        self.onloaded.load_layer(index, layer)

    def finish_layer(self, index: int, layer: nn.Module) -> None:
        part = self.state.part(resume_mod.layer_part(index))
        self.onloaded.writer = part
        self.onloaded.finish_layer(index, layer)
        self.state.keep(resume_mod.layer_part(index), part)


def report_of(result: QuantizationResult) -> dict:
    """What a resumed run needs of the finished layers' report (JSON)."""
    return {"layers": result.layers, "kv_scales": result.kv_scales, "kv_cache_scheme": result.kv_cache_scheme,
            "quantized": {name: scheme.model_dump(mode="json") for name, (_, scheme) in result.quantized.items()},
            "timings": result.timings}


def restored(report: dict) -> QuantizationResult:
    """The finished layers' report of a stopped run, read back (`report_of`'s inverse)."""
    result = QuantizationResult()
    result.layers = list(report.get("layers", []))
    result.kv_scales = list(report.get("kv_scales", []))
    result.kv_cache_scheme = report.get("kv_cache_scheme")
    result.timings = dict(report.get("timings", {}))
    for name, data in report.get("quantized", {}).items():
        scheme = QuantScheme.model_validate(data)
        result.quantized[name] = (format_for(scheme), scheme)
    return result
