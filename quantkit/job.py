"""The quantize job: resolve the model, calibrate, run the pipeline, export the checkpoint."""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from quantkit import compute, devices, distributed
from quantkit.catalog import adapter_for
from quantkit.api import QuantizeRecord, calibration_batches, float_source, report_fallbacks
from quantkit.atomic import (atomic_output_dir, check_free_space, check_output_free, check_writable, clean_stale_for,
                             scratch_dir)
from quantkit.calibration.activations import Activations, Budget
from quantkit.kernels.wide_matmul import widened
from quantkit.errors import QuantizationError
from quantkit.export import export_checkpoint, write_model_files
from quantkit.formats import model_config as model_fields
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES, ShardWriter, read_config
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.quantization_config import build_quantization_config
from quantkit.models.resolve import resolve_model
from quantkit.finite import check_source
from quantkit.memory import PeakSampler, available_memory
from quantkit.plan import Plan, Throughput, make_plan
from quantkit.runtime.offload import DoesNotFitError
from quantkit.pipeline import QuantizationResult, Stage, build_stages, quantize_model
from quantkit.recipe import Recipe
from quantkit.onload import OnloadedModel, skeleton
from quantkit import resume as resume_mod
from quantkit.loader import checkpoint_dtype, load, model_config

log = logging.getLogger(__name__)
LOAD_MODES = ("layers", "whole")


@dataclass
class QuantizeReport:
    output: Path
    source: Path
    result: QuantizationResult
    seconds: float
    compute: compute.ComputeChoice
    device: devices.DeviceChoice
    peak_rss_bytes: int = 0  # resident memory, sampled every 20 ms while the job ran
    peak_device_bytes: int = 0  # allocated on the accelerator at most (0 on the CPU)

    def closing_line(self) -> str:
        """Peak memory and where the time went (the largest phases)."""
        total = sum(self.result.timings.values()) or 1.0
        top = sorted(self.result.timings.items(), key=lambda kv: -kv[1])[:4]
        shares = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in top)
        gpu = f", {self.peak_device_bytes / 1e9:.2f} GB on {self.device.device}" if self.device.is_accelerator else ""
        return f"Peak memory {self.peak_rss_bytes / 1e9:.2f} GB resident{gpu}; time: {shares}"


def default_output(source: Path, recipe: Recipe) -> Path:
    return Path.cwd() / f"{source.name}-{recipe.name}"


def estimate_checkpoint_bytes(model: nn.Module, stages: list[Stage], storage_dtype: torch.dtype) -> int:
    """Bytes of the checkpoint's tensors the stages will write: each quantized linear as its format's
    module holds it (an empty one is built on meta: packed words, scales, zero points, shape), every
    other tensor of the state dict in the storage dtype (non-persistent buffers, e.g. rotary tables,
    are not written; tied weights once)."""
    from quantkit.catalog import format_for

    schemes = {n: st.scheme_of(n) for st in stages if st.algorithm.produces_weights for n in st.modules}
    total, seen = 0, set()
    for name, module in model.named_modules():
        sc = schemes.get(name)
        if sc is not None:
            with torch.device("meta"):
                packed = format_for(sc).empty_module(module, sc, storage_dtype)
            total += sum(t.numel() * t.element_size() for t in packed.state_dict().values())
            seen.update(id(t) for t in module.parameters(recurse=False))
            continue
        buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        for _, t in list(module.named_parameters(recurse=False)) + buffers:
            if id(t) in seen:  # tied parameters are one object (also on meta, where data pointers are all 0)
                continue
            seen.add(id(t))
            total += t.numel() * (storage_dtype.itemsize if t.is_floating_point() else t.element_size())
    return total


def _budget(device: torch.device, asked: Optional[int]) -> Optional[int]:
    """The activation budget: as asked, else half the memory available now where the activations live."""
    if asked is not None:
        return asked
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    return None if free is None else free // 2


def plan(model_spec: Optional[str], recipe: Recipe, device: "str | torch.device | None" = devices.DEFAULT,
         activation_budget_bytes: Optional[int] = None, measure: bool = True, nproc: int = 1) -> Plan:
    """What quantizing `model_spec` with `recipe` will need (`quantkit.plan`), from its config.json alone."""
    where = devices.resolve(device)
    source = resolve_model(model_spec)
    raw = read_config(source)
    adapter = adapter_for(raw.get("model_type", "?"))
    storage_dtype = checkpoint_dtype(raw)
    choice = compute.choose(storage_dtype, where.device, recipe.calibration.dtype, "calibration.dtype")
    model = skeleton(model_config(source, raw), choice.dtype)
    stages = build_stages(model, adapter, recipe)
    if any(s.algorithm.needs_data() for s in stages):
        model_fields.check_length(recipe.calibration.seq_len, raw, str(source), "calibration.seq_len",
                                  "use --set calibration.seq_len={limit} or less")
    with widened(choice):  # the GEMM speed the run will see
        throughput = Throughput.measure(choice.dtype) if measure else None
    return make_plan(model, stages, adapter, recipe, model_name=str(source), device=where.device,
                     compute_dtype=choice.dtype, storage_dtype=storage_dtype,
                     checkpoint_bytes=estimate_checkpoint_bytes(model, stages, storage_dtype),
                     activation_budget=_budget(where.device, activation_budget_bytes),
                     throughput=throughput, nproc=nproc,
                     tokenizer_bytes=tokenizer_file_bytes(source))


def rank_device(asked, rank: int, local_rank: int) -> devices.DeviceChoice:
    """The GPU of one rank of a distributed CUDA run: its local rank's. An index asked for (`--device cuda:3`)
    cannot hold for every rank, so it is refused on every rank alike, not replaced unsaid."""
    index = torch.device(str(asked)).index if str(asked or "").startswith("cuda") else None
    if index is not None:
        raise distributed.DistributedError(
            f"--device {asked} in a distributed run: each rank takes the GPU of its local rank (this is rank "
            f"{rank}, LOCAL_RANK {local_rank}); pass --device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES")
    return devices.DeviceChoice(torch.device("cuda", local_rank), f"rank {rank}: local rank's GPU")


def tokenizer_file_bytes(source: Path) -> int:
    """Size of the checkpoint's tokenizer files (what the tokenizer takes in memory scales with it)."""
    return sum((source / f).stat().st_size for f in ("tokenizer.json", "tokenizer.model") if (source / f).is_file())


def check_plan_fits(p: Plan, available: Optional[int]) -> None:
    """Refuse a run whose planned peak host memory is above what is available, with the numbers."""
    if available is not None and p.peak_host_bytes > available:
        raise QuantizationError(
            f"this run needs about {p.peak_host_bytes / 1e9:.2f} GB of memory (plan: "
            + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in p.breakdown.items() if v)
            + f") and {available / 1e9:.2f} GB is available; lower --activation-budget or calibration.num_samples, "
            "use --device cuda, or pass --no-memory-check to try anyway (`quantkit plan` shows the whole plan)")


def quantize(
    model_spec: Optional[str],
    recipe: Recipe,
    output: Optional[Path] = None,
    overwrite: bool = False,
    progress: bool = True,
    notify: Callable[[str], None] = log.info,
    zero_nonfinite: bool = False,
    trust_remote_code: bool = False,
    load_mode: str = "layers",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: "str | torch.device | None" = devices.DEFAULT,
    activation_budget_bytes: Optional[int] = None,
    memory_check: bool = True,
    resume: bool = False,
    restart: bool = False,
    dist_timeout_s: float = distributed.DEFAULT_TIMEOUT_S,
) -> QuantizeReport:
    """Quantize a checkpoint with `recipe` and write the result to `output` (docs/pipeline.md has the whole story).

    Everything that can be checked before the work is: the output may be written (`overwrite` replaces what
    quantkit wrote), the filesystem has room, the plan fits memory (`memory_check`), the source weights are
    finite (`zero_nonfinite` zeroes NaN/Inf instead of refusing, loudly). `notify` gets the lines a user sees;
    `trust_remote_code` keeps the source's auto_map and .py files (never executed here).
    load_mode "layers" (default) reads each decoder layer just before its turn and writes it right after
    (`quantkit.onload`), keeping a resumable state (`resume` continues a stopped run, `restart` discards it);
    "whole" loads the model first. device: where each layer is calibrated; activation_budget_bytes: calibration
    activations kept in memory (the rest wait on disk). Under torchrun each rank calibrates on its share of the
    batches and rank 0 writes (`dist_timeout_s` bounds a collective's wait)."""
    _check_modes(load_mode, resume, restart)
    where = devices.resolve(device)
    world = distributed.init(where.device, dist_timeout_s) if distributed.env_world_size() > 1 else \
        distributed.current()
    try:
        if world.active and where.device.type == "cuda":
            where = rank_device(device, world.rank, int(os.environ.get("LOCAL_RANK", "0")))
        if not world.is_writer:
            notify = _quiet  # rank 0 speaks for the run
            progress = False
        elif world.active:
            notify(f"distributed: {world.size} ranks ({world.backend}); calibration batches dealt round-robin, "
                   "statistics reduced, solves shared; rank 0 writes")
        if where.is_accelerator:
            notify(where.describe())
        devices.reset_peak(where.device)
        with PeakSampler(0.02, live=False) as peak:  # resident memory only: cheap to read
            report = _quantize(model_spec, recipe, output, overwrite, progress, notify, zero_nonfinite,
                               trust_remote_code, load_mode, max_shard_bytes, peak, where, activation_budget_bytes,
                               memory_check, resume, restart, world)
    finally:
        if world.active:
            distributed.shutdown()
    report.peak_rss_bytes = peak.peak_rss
    report.peak_device_bytes = devices.peak_memory_bytes(where.device)
    return report


def _check_modes(load_mode: str, resume: bool, restart: bool) -> None:
    """Refuse load / resume combinations that cannot work, before anything is read."""
    if load_mode not in LOAD_MODES:
        raise QuantizationError(f"load mode {load_mode!r}: use one of {', '.join(LOAD_MODES)}")
    if (resume or restart) and load_mode != "layers":
        raise QuantizationError("--resume/--restart need --load layers (the default): a whole-model run keeps no "
                                "state between layers")
    if resume and restart:
        raise QuantizationError("--resume continues a stopped run and --restart discards it: give one of them")
    if distributed.env_world_size() > 1 and (resume or restart):
        raise distributed.DistributedError("--resume/--restart are not supported in distributed runs yet: "
                                           "resume with a single process (its state differs per world size)")


def _quantize(model_spec, recipe, output, overwrite, progress, notify, zero_nonfinite, trust_remote_code, load_mode,
              max_shard_bytes, peak: PeakSampler, where: devices.DeviceChoice,
              activation_budget: Optional[int], memory_check: bool, resume: bool = False,
              restart: bool = False, world: distributed.World = distributed.World()) -> QuantizeReport:
    start = time.perf_counter()
    job = _Job.open(model_spec, recipe, output, overwrite, where, world, notify)
    model, onloaded, zeroed = job.load_source(load_mode, zero_nonfinite)
    stages = build_stages(model, job.adapter, recipe)
    fallbacks = report_fallbacks(stages, notify)
    the_plan = job.plan_run(model, stages, activation_budget, memory_check and load_mode == "layers")
    scratch = ExitStack()
    batches, activations = job.calibration(stages, model, activation_budget, scratch)
    extra_files = job.files_writer(peak, load_mode, fallbacks, zeroed, the_plan, activations)
    if not world.is_writer:
        with scratch, widened(job.choice):
            result = _run_silent(model, job.adapter, stages, batches, job.storage, where, activations, onloaded)
        return QuantizeReport(job.out, job.source, result, time.perf_counter() - start, job.choice, where)
    state = None if onloaded is None else job.run_state(batches, load_mode, max_shard_bytes, zero_nonfinite, resume,
                                                          restart)
    try:
        with scratch, widened(job.choice):
            result = _run(model, job.adapter, stages, batches, job.storage, progress, where, activations, onloaded,
                          job.out, overwrite, job.source, extra_files, trust_remote_code, notify, max_shard_bytes, state)
    except BaseException:
        if state is not None:
            state.release()
            if state.finished:
                notify(state.stopped_message(job.out, len(job.adapter.layers(model))))
            else:
                state.remove()  # nothing finished: nothing worth keeping
        raise
    if state is not None:
        state.remove()  # a finished run leaves nothing but its output
    return QuantizeReport(job.out, job.source, result, time.perf_counter() - start, job.choice, where)


@dataclass
class _Job:
    """One quantize run's fixed facts, and its steps in order: the output checked, the source loaded (whole
    or as a skeleton), the plan, the calibration data, the files beside the weights, the resumable state."""

    source: Path
    raw: dict
    storage: torch.dtype
    out: Path
    recipe: Recipe
    adapter: object
    choice: compute.ComputeChoice
    where: devices.DeviceChoice
    world: distributed.World
    notify: Callable[[str], None]

    @classmethod
    def open(cls, model_spec, recipe: Recipe, output, overwrite: bool, where: devices.DeviceChoice,
             world: distributed.World, notify: Callable[[str], None]) -> "_Job":
        source, raw, storage = float_source(model_spec)
        out = Path(output) if output else default_output(source, recipe)
        if world.is_writer:
            for line in clean_stale_for(out):
                notify(line)
            check_output_free(out, overwrite, protect=[source])  # before minutes of work, not after
            check_writable(out)
        choice = compute.choose(storage, where.device, recipe.calibration.dtype, "calibration.dtype")
        notify(choice.describe())
        return cls(source, raw, storage, out, recipe, adapter_for(raw.get("model_type", "?")), choice, where, world,
                   notify)

    def load_source(self, load_mode: str, zero_nonfinite: bool):
        """(model, its onloader or None, the tensors whose NaN/Inf were zeroed): loaded whole, or an empty
        skeleton whose layers are read as their turn comes; non-finite weights refused or zeroed (said)."""
        if load_mode == "whole":
            try:
                model = load(self.source, dtype=self.choice.dtype, finite=False)  # checked just below
            except DoesNotFitError as exc:  # (its fixes name eval's and generate's options, which quantize has not)
                raise QuantizationError(f"--load whole: {exc.what}; --load layers (the default) holds one decoder "
                                        "layer at a time") from None
            return model, None, check_source(model, zero_nonfinite, self.notify)
        model = skeleton(model_config(self.source, self.raw), self.choice.dtype)
        onloaded = OnloadedModel(model, self.source, self.adapter, self.choice.dtype, self.storage)
        return model, onloaded, onloaded.check_finite(zero_nonfinite, self.notify)

    def plan_run(self, model, stages, activation_budget: Optional[int], memory_check: bool) -> Plan:
        """The run's plan, said in one line; a run that would not fit memory or disk is refused now."""
        checkpoint_bytes = estimate_checkpoint_bytes(model, stages, self.storage)
        where = self.where
        the_plan = make_plan(model, stages, self.adapter, self.recipe, model_name=str(self.source),
                             device=where.device, compute_dtype=self.choice.dtype, storage_dtype=self.storage,
                             checkpoint_bytes=checkpoint_bytes,
                             activation_budget=_budget(where.device, activation_budget), throughput=None,
                             nproc=self.world.size, tokenizer_bytes=tokenizer_file_bytes(self.source))
        self.notify(f"plan: peak memory ~{the_plan.peak_host_bytes / 1e9:.2f} GB"
                    + (f" host, ~{the_plan.peak_device_bytes / 1e9:.2f} GB {where.device}" if where.is_accelerator
                       else "")
                    + f"; checkpoint ~{checkpoint_bytes / 1e9:.2f} GB; disk ~{the_plan.disk_bytes / 1e9:.2f} GB")
        if memory_check:
            check_plan_fits(the_plan, available_memory())
        if self.world.is_writer:
            check_free_space(self.out, the_plan.disk_bytes)
        return the_plan

    def calibration(self, stages, model, activation_budget: Optional[int], scratch: ExitStack):
        """(this rank's calibration batches or None, where their activations live)."""
        if not any(s.algorithm.needs_data() for s in stages):
            return None, Activations()
        world = self.world
        batches = calibration_batches(self.source, self.recipe, self.adapter.needs_bos, config=self.raw)
        if world.active:
            if len(batches) < world.size:
                raise distributed.DistributedError(
                    f"the calibration data makes {len(batches)} batch(es) for {world.size} ranks: every rank needs "
                    "one; raise calibration.num_samples, lower calibration.batch_size, or use fewer ranks")
            batches = world.shard(batches)  # batch i to rank i mod N
        return batches, _activations(batches, model.config.hidden_size, self.choice.dtype, self.where.device,
                                     activation_budget, self.out, scratch, self.notify)

    def files_writer(self, peak: PeakSampler, load_mode: str, fallbacks: list, zeroed: list, the_plan: Plan,
                     activations: Activations) -> Callable[[QuantizationResult], dict[str, str]]:
        """recipe.yaml and quantkit.json for a result: the Python API's metadata (one builder,
        `api.QuantizeRecord.metadata`) and what only this job knows (memory, load mode, plan, activations)."""
        def extra_files(result: QuantizationResult) -> dict[str, str]:
            created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            record = QuantizeRecord(self.recipe, self.source, self.storage, self.choice, self.where, result,
                                    fallbacks, created)
            metadata = {**record.metadata(), **{
                "device": {"device": str(self.where.device), "reason": self.where.reason,
                           "peak_bytes": devices.peak_memory_bytes(self.where.device)},
                "load": load_mode,
                "world_size": self.world.size,
                "peak_rss_bytes": peak.peak_rss,  # so far: the files are written at the end of the job
                "zeroed_nonfinite": zeroed,
                "plan": the_plan.to_json(),  # the estimate, next to the measured peak_rss_bytes
                "activations": {"budget_bytes": activations.budget.limit, "peak_bytes": activations.budget.peak,
                                "spilled_bytes": activations.budget.spilled_bytes},
            }}
            metadata["layers"] = metadata.pop("layers")  # last, as it always was: the long part
            return {"recipe.yaml": self.recipe.to_yaml(), "quantkit.json": json.dumps(metadata, indent=2) + "\n"}
        return extra_files

    def run_state(self, batches, load_mode: str, max_shard_bytes: int, zero_nonfinite: bool, resume: bool,
                  restart: bool) -> "resume_mod.RunState":
        """The resumable state of a layer-by-layer run (a stopped one continued with `resume`)."""
        settings = {"load": load_mode, "compute_dtype": self.choice.name, "device_type": self.where.device.type,
                    "world_size": self.world.size, "max_shard_bytes": max_shard_bytes,
                    "zero_nonfinite": bool(zero_nonfinite)}
        if self.choice.wide_matmuls:  # (only when set: a manifest of a run without widening reads the same as before)
            settings["wide_matmuls"] = True  # float32 GEMMs rounded to 16 bits: other last bits than native kernels
        manifest = resume_mod.fingerprint(self.source, self.recipe.to_yaml(), batches, settings)
        return resume_mod.RunState.open(self.out, manifest, resume, restart, self.notify)


def _activations(batches: list[torch.Tensor], hidden_size: int, dtype: torch.dtype, device: torch.device,
                 budget: Optional[int], out: Path, scratch: ExitStack, notify: Callable[[str], None]) -> Activations:
    """Where the calibration activations live: in memory up to the budget, the rest in a scratch directory
    (made only when they do not fit; said so, with the numbers)."""
    need = sum(b.numel() for b in batches) * hidden_size * dtype.itemsize
    budget = _budget(device, budget)
    if budget is None or need <= budget:
        return Activations(Budget(budget))
    spill = scratch.enter_context(scratch_dir(out))
    notify(f"calibration activations take {need / 1e9:.2f} GB per layer, above the {budget / 1e9:.2f} GB budget "
           f"(--activation-budget): the batches beyond it wait on disk in {spill}")
    return Activations(Budget(budget), spill)


def _run(model, adapter, stages, batches, storage_dtype, progress, where, activations, onloaded, out, overwrite, source,
         extra_files, trust_remote_code, notify, max_shard_bytes, state=None) -> QuantizationResult:
    """The pipeline and the export: whole-model, or onloaded with each layer's tensors kept as it finishes
    (in the run's state, `quantkit.resume`) and the shards assembled from them at the end."""
    if onloaded is None:
        result = quantize_model(model, adapter, stages, batches, storage_dtype, progress, device=where.device,
                                activations=activations)
        # a compute dtype narrower than the checkpoint rounded every weight: what stayed float goes back as stored
        rounded = not compute.holds_exactly(model.quantkit_compute.dtype, storage_dtype)
        export_checkpoint(
            model, out, storage_dtype=storage_dtype, source=source,
            quantization_config=build_quantization_config(model, result.quantized, result.kv_cache_scheme),
            extra_files=extra_files(result), overwrite=overwrite, protect=[source], keep_remote_code=trust_remote_code,
            notify=notify, max_shard_bytes=max_shard_bytes,
            stored=LazyCheckpoint(source, adapter.to_module_name) if rounded else None)
    else:
        with atomic_output_dir(out, overwrite, protect=[source]) as tmp:  # an interrupted run leaves nothing at out
            part = None if state.has("head") else state.part("head")
            onloaded.begin(part, needs_embeddings=batches is not None)  # None: written by the stopped run
            if part is not None:
                state.keep("head", part)
            result = _restored(state.report)
            start = state.finished
            result = quantize_model(
                model, adapter, stages, batches, storage_dtype, progress, store=_PartStore(onloaded, state),
                device=where.device, activations=activations, start_layer=start,
                resume_hidden=state.hidden() if start and batches is not None else None, result=result,
                on_layer_done=lambda li, inputs, res: state.layer_done(li, inputs.hidden if inputs else None,
                                                                       _report_of(res)))
            part = state.part("tail")
            onloaded.writer = part
            onloaded.end()
            state.keep("tail", part)
            writer = ShardWriter(tmp, max_shard_bytes)
            n = len(adapter.layers(model))
            state.assemble(writer, ["head", *(resume_mod.layer_part(i) for i in range(n)), "tail"])
            writer.close()
            write_model_files(tmp, model, storage_dtype, source,
                              build_quantization_config(model, result.quantized, result.kv_cache_scheme),
                              extra_files(result), trust_remote_code, notify)
    return result


def _run_silent(model, adapter, stages, batches, storage_dtype, where, activations, onloaded) -> QuantizationResult:
    """A rank other than 0 of a distributed run: the same work on its share of the batches (its part of
    every collective), nothing written."""
    if onloaded is None:
        return quantize_model(model, adapter, stages, batches, storage_dtype, False, device=where.device,
                              activations=activations)
    onloaded.begin(None, needs_embeddings=batches is not None)
    result = quantize_model(model, adapter, stages, batches, storage_dtype, False, store=_DiscardStore(onloaded),
                            device=where.device, activations=activations)
    onloaded.end(write=False)
    return result


class _DiscardStore:
    """Layers loaded as usual and emptied when done, their tensors written by rank 0 only."""

    def __init__(self, onloaded: OnloadedModel):
        self.onloaded = onloaded

    def load_layer(self, index: int, layer: nn.Module) -> None:
        self.onloaded.load_layer(index, layer)

    def finish_layer(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")


def _quiet(_line: str) -> None:
    pass


class _PartStore:
    """The pipeline's layer store for a resumable run: each finished layer's tensors go to a part file of the
    run's state (`quantkit.resume`) instead of straight to the output shards."""

    def __init__(self, onloaded: OnloadedModel, state: "resume_mod.RunState"):
        self.onloaded, self.state = onloaded, state

    def load_layer(self, index: int, layer: nn.Module) -> None:
        self.onloaded.load_layer(index, layer)

    def finish_layer(self, index: int, layer: nn.Module) -> None:
        part = self.state.part(resume_mod.layer_part(index))
        self.onloaded.writer = part
        self.onloaded.finish_layer(index, layer)
        self.state.keep(resume_mod.layer_part(index), part)


def _report_of(result: QuantizationResult) -> dict:
    """What a resumed run needs of the finished layers' report (JSON)."""
    return {"layers": result.layers, "kv_scales": result.kv_scales, "kv_cache_scheme": result.kv_cache_scheme,
            "quantized": {name: scheme.model_dump(mode="json") for name, (_, scheme) in result.quantized.items()},
            "timings": result.timings}


def _restored(report: dict) -> QuantizationResult:
    from quantkit.catalog import format_for
    from quantkit.schemes import QuantScheme

    result = QuantizationResult()
    result.layers = list(report.get("layers", []))
    result.kv_scales = list(report.get("kv_scales", []))
    result.kv_cache_scheme = report.get("kv_cache_scheme")
    result.timings = dict(report.get("timings", {}))
    for name, data in report.get("quantized", {}).items():
        scheme = QuantScheme.model_validate(data)
        result.quantized[name] = (format_for(scheme), scheme)
    return result
