"""The Python API: quantize a model in memory, look at it, save it (what `llmcompressor.oneshot` users write).

    import quantkit
    model, report = quantkit.quantize("smollm2-135m", "gptq-w4a16", num_samples=16, seq_len=256)
    print(report.summary())
    quantkit.save(model, "./smollm2-gptq")

`quantize` takes a checkpoint (a local directory, a demo name, a .gguf file) or a transformers model
already in memory, and a recipe (a name, a YAML file or a `Recipe`). The model is quantized in place
(its linears become packed int / FP8 modules that compute as the checkpoint will) and returned with
its report; `save` writes it as a compressed-tensors checkpoint, atomically, with the same
config, recipe.yaml and quantkit.json as `quantkit quantize`. The CLI job streams layers from disk
instead (`--load layers`); both run the same pipeline (`quantkit.pipeline`) and write the same files.
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from quantkit import compute, devices
from quantkit.calibration.data import load_text, make_chunks, tokenize
from quantkit.catalog import adapter_for
from quantkit.errors import QuantizationError
from quantkit.export import export_checkpoint
from quantkit.finite import check_source
from quantkit.kernels.wide_matmul import widened
from quantkit.formats import model_config
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES, read_config
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.models.resolve import resolve_model
from quantkit.pipeline import QuantizationResult, Stage, build_stages, quantize_model
from quantkit.quantization_config import build_quantization_config
from quantkit.recipe import Recipe, load_recipe
from quantkit.loader import checkpoint_dtype, compute_choice, load, load_tokenizer
from quantkit.version import __version__

log = logging.getLogger(__name__)
RECORD_ATTR = "quantkit_record"  # the attribute of a model quantized by `quantize` that `save` reads


@dataclass
class QuantizeRecord:
    """What `quantize` did to a model: the report a user reads and what `save` writes beside the weights."""

    recipe: Recipe
    source: Optional[Path]  # the checkpoint directory it came from (tokenizer files are copied from it)
    storage_dtype: torch.dtype  # the dtype the checkpoint is written in (the source's)
    compute: compute.ComputeChoice
    device: devices.DeviceChoice
    result: QuantizationResult
    group_size_fallbacks: list[dict] = field(default_factory=list)
    created: str = ""
    # the checkpoint `quantize` loaded in a compute dtype narrower than it: `save` writes the tensors that
    # are still only that rounding as stored (an in-memory model handed to `quantize` is written as it is)
    rounded_from: Optional[Path] = None
    # calibration data not named by the recipe (texts or token ids handed to `quantize`), in words; None: the
    # recipe's calibration.dataset (or no stage calibrated)
    calibration_data: Optional[str] = None

    @property
    def quantized(self) -> dict:
        """module name -> (format, scheme) of every quantized linear."""
        return self.result.quantized

    def summary(self) -> str:
        """One paragraph: what was quantized how, where the time went, the worst errors."""
        schemes: dict[str, int] = {}
        for _fmt, scheme in self.result.quantized.values():
            schemes[scheme.short()] = schemes.get(scheme.short(), 0) + 1
        lines = [f"recipe {self.recipe.name}: {len(self.result.quantized)} linears quantized "
                 f"({', '.join(f'{n} x {s}' for s, n in schemes.items()) or 'none'}) in {self.result.seconds:.1f} s, "
                 f"{self.compute.describe()}"]
        if self.result.kv_cache_scheme:
            lines.append(f"KV cache scales for {len(self.result.kv_scales)} layers "
                         f"({self.result.kv_cache_scheme.get('strategy')})")
        measured = [row for row in self.result.layers if row.get("sqnr_db") is not None]
        worst = sorted(measured, key=lambda row: row["sqnr_db"])[:3]
        if worst:
            lines.append("lowest SQNR: " + ", ".join(f"{row['name']} {row['sqnr_db']:.1f} dB" for row in worst))
        return "\n".join(lines)

    def metadata(self) -> dict:
        """quantkit.json's common part (the CLI job adds its memory, load and resume figures)."""
        return {
            "quantkit_version": __version__,
            "created": self.created,
            "source": str(self.source) if self.source is not None else None,
            "recipe": self.recipe.name,
            "overrides": self.recipe.overrides,
            "calibration_data": self.calibration_data or self.recipe.calibration.dataset,
            "compute": self.compute.to_json(),
            "device": {"device": str(self.device.device), "reason": self.device.reason},
            "quantize_seconds": round(self.result.seconds, 2),
            "timings": {k: round(v, 3) for k, v in self.result.timings.items()},
            "group_size_fallbacks": self.group_size_fallbacks,
            "layers": self.result.layers,
        }


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
    weights exactly, `quantkit.compute`). device: where each decoder layer is calibrated ("auto" takes
    CUDA when present); the model itself stays where it is.
    """
    recipe = _recipe(recipe, overrides, dataset, num_samples, seq_len)
    where = devices.resolve(device)
    if isinstance(model, nn.Module):
        net, source, storage = model, _source_of(model), _storage_of(model)
        if getattr(getattr(net, "config", None), "quantization_config", None):
            raise QuantizationError("the model is already quantized; quantize the original float model")
        choice = _choose(storage, where, dtype, recipe)
        if any(p.is_floating_point() and p.dtype != choice.dtype for p in net.parameters()):
            net.to(choice.dtype)
    else:
        source, _, storage = float_source(str(model))
        choice = _choose(storage, where, dtype, recipe)
        net = load(source, dtype=choice.dtype, finite=False)  # check_source below says it, for a source
    notify(choice.describe())
    check_source(net, False, notify)
    adapter = adapter_for(getattr(net.config, "model_type", "?"))
    stages = build_stages(net, adapter, recipe)
    fallbacks = report_fallbacks(stages, notify)
    given = _given_data(dataset, batches)  # what the recipe's calibration.dataset no longer describes
    if batches is None and any(s.algorithm.needs_data() for s in stages):
        batches = _batches(recipe, dataset, tokenizer, source, adapter.needs_bos, net.config.to_dict())
    elif batches:
        model_config.check_length(max(b.shape[-1] for b in batches), net.config.to_dict(), str(source or "the model"),
                                  "batches= of", "give batches of {limit} tokens or fewer")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with widened(choice):
        result = quantize_model(net, adapter, stages, batches, storage, progress, device=where.device)
    rounded = not isinstance(model, nn.Module) and not compute.holds_exactly(choice.dtype, storage)
    record = QuantizeRecord(recipe, source, storage, choice, where, result, fallbacks, created,
                            rounded_from=source if rounded else None, calibration_data=given)
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
    result = record.result
    metadata = {**record.metadata(), **(extra_metadata or {})}
    return export_checkpoint(
        model, Path(path), storage_dtype=record.storage_dtype, source=record.source,
        quantization_config=build_quantization_config(model, result.quantized, result.kv_cache_scheme),
        extra_files={"recipe.yaml": record.recipe.to_yaml(dataset=record.calibration_data),
                     "quantkit.json": json.dumps(metadata, indent=2) + "\n"},
        overwrite=overwrite, protect=[record.source] if record.source is not None else [],
        max_shard_bytes=max_shard_bytes,
        stored=None if record.rounded_from is None else LazyCheckpoint(
            record.rounded_from, adapter_for(model.config.model_type).to_module_name))


def float_source(model_spec: Optional[str]) -> tuple[Path, dict, torch.dtype]:
    """The float checkpoint to quantize: (its directory, its config.json, its storage dtype); a
    checkpoint that is already quantized is refused (quantizing it again would lose its scales)."""
    source = resolve_model(model_spec)
    raw = read_config(source)
    if raw.get("quantization_config"):
        raise QuantizationError(f"{source} is already quantized ({raw['quantization_config'].get('quant_method')}); "
                                "quantize the original float checkpoint")
    return source, raw, checkpoint_dtype(raw)


def report_fallbacks(stages: list[Stage], notify: Callable[[str], None]) -> list[dict]:
    """One line per stage whose group size some layers get smaller, and the record for quantkit.json."""
    records = []
    for st in stages:
        if not st.fallbacks:
            continue
        asked = st.algorithm.scheme.group_size
        by_size: dict[int, list[str]] = {}
        for name, sc in st.fallbacks.items():
            by_size.setdefault(sc.group_size, []).append(name)
            records.append({"name": name, "stage": st.index, "group_size": sc.group_size, "recipe_group_size": asked})
        for size, names in by_size.items():
            kinds = sorted({n.rpartition(".")[2] for n in names})
            notify(f"group_size {asked} does not divide the inputs of {len(names)} linear(s) ({', '.join(kinds)}): "
                   f"those use group_size {size} (recorded in quantkit.json; --set stages.{st.address or st.index}.scheme.group_size=N "
                   "to choose one for all)")
    return records


def calibration_batches(source: Path, recipe: Recipe, needs_bos: bool, tokenizer=None,
                        texts: Optional[Sequence[str]] = None, config: Optional[dict] = None) -> list[torch.Tensor]:
    """The recipe's calibration windows, tokenized by `tokenizer` (default: the source's), in batches. A
    calibration.seq_len longer than the model's context (`config`, default the source's config.json) is refused."""
    cal = recipe.calibration
    raw = config if config is not None else read_config(source)
    model_config.check_length(cal.seq_len, raw, str(source or "the model"), "calibration.seq_len",
                              "use --set calibration.seq_len={limit} or less")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    text = "\n\n".join(texts) if texts is not None else load_text(cal.dataset, cal.text_column, cal.encoding)
    ids = tokenize(tokenizer, text)
    bos = tokenizer.bos_token_id if needs_bos else None
    label = cal.dataset if texts is None else f"{len(texts)} text(s) given to quantize()"
    chunks = make_chunks(ids, cal.num_samples, cal.seq_len, cal.seed, bos, label=label)
    return list(chunks.split(cal.batch_size))  # [batch, seq_len] each


def _given_data(dataset, batches) -> Optional[str]:
    """Calibration data handed to `quantize` itself, in words with a digest (None: the recipe's dataset)."""
    import hashlib

    if batches is not None:
        digest = hashlib.sha256()
        for b in batches:
            digest.update(b.detach().cpu().to(torch.int64).numpy().tobytes())
        tokens = sum(b.numel() for b in batches)
        return (f"{len(batches)} batch(es) of token ids given to quantkit.quantize() ({tokens} tokens, "
                f"sha256 {digest.hexdigest()[:16]})")
    if dataset is not None and not isinstance(dataset, str):
        texts = list(dataset)
        digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
        return (f"{len(texts)} text(s) given to quantkit.quantize() ({sum(len(t) for t in texts)} characters, "
                f"sha256 {digest})")
    return None


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


def _choose(storage: torch.dtype, where: devices.DeviceChoice, dtype, recipe: Recipe) -> compute.ComputeChoice:
    if dtype in (None, "auto"):
        return compute.choose(storage, where.device, recipe.calibration.dtype, "calibration.dtype")
    return compute_choice(dtype, storage, where.device)[0]  # as quantkit.load takes dtype=


def _source_of(model: nn.Module) -> Optional[Path]:
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    return Path(name) if name and Path(name).is_dir() else None


def _storage_of(model: nn.Module) -> torch.dtype:
    named = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named.removeprefix("torch."), None)
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _batches(recipe: Recipe, dataset, tokenizer, source: Optional[Path], needs_bos: bool,
             config: Optional[dict] = None) -> list[torch.Tensor]:
    texts = None if dataset is None or isinstance(dataset, str) else list(dataset)
    if tokenizer is None and source is None:
        raise QuantizationError("calibration needs a tokenizer: pass tokenizer= (or batches= of token ids); the model "
                                "was not loaded from a checkpoint directory whose tokenizer quantkit could use")
    return calibration_batches(source, recipe, needs_bos, tokenizer, texts, config)
