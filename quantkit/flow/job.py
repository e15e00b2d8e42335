"""The quantize flow, the only one: resolve the model and the compute dtype, calibrate, run the pipeline,
keep the model in memory or write the checkpoint. `quantkit.quantize` / `quantkit.save` and `quantkit
quantize` all run it (`run`); onloading (`load="layers"`), resume and distributed calibration are options
of the same run (docs/pipeline.md has the whole story)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from quantkit.calibration import distributed
from quantkit.calibration.activations import Activations, Budget
from quantkit.checkpoints.atomic import check_free_space, check_output_free, check_writable, clean_stale_for, scratch_dir
from quantkit.checkpoints.finite import check_source
from quantkit.checkpoints.loader import checkpoint_dtype, compute_choice, load, load_tokenizer, model_config
from quantkit.checkpoints.resolve import resolve_model
from quantkit.errors import QuantizationError
from quantkit.flow import domain_check
from quantkit.flow import resume as resume_mod
from quantkit.flow import self_calibration
from quantkit.flow.onload import OnloadedModel, skeleton
from quantkit.flow.pipeline import Stage, build_stages, quantize_model
from quantkit.flow.plan import Plan, Throughput, make_plan
from quantkit.flow.recipe import Recipe
from quantkit.flow.record import QuantizeRecord
from quantkit.flow.sources import (SELF, calibration_batches, check_given_batches, float_source, given_data,
                                   held_back_windows, model_source, tokenizer_file_bytes)
from quantkit.flow.write import run_layers, run_silent, write_whole
from quantkit.formats import model_config as model_fields
from quantkit.formats.checkpoint import DEFAULT_SHARD_BYTES, read_config
from quantkit.kernels.wide_matmul import widened
from quantkit.platform import compute, devices
from quantkit.platform.memory import PeakSampler, available_memory
from quantkit.plugins.catalog import adapter_for, format_for
from quantkit.runtime.offload import DoesNotFitError

log = logging.getLogger(__name__)
LOAD_MODES = ("layers", "whole")


@dataclass
class Options:
    """How a run goes. The defaults are the Python API's (in memory, quiet); the CLI passes its own."""

    output: Optional[Path] = None  # None: keep the model in memory (load "whole" only)
    default_output: bool = False  # output None: write to ./<model>-<recipe> instead of keeping it in memory
    overwrite: bool = False  # replace what quantkit wrote at output (never the source)
    load: str = "whole"  # "layers": each decoder layer read just before its turn and written right after
    device: Union[str, torch.device, None] = "cpu"  # where each layer is calibrated ("auto": CUDA when present)
    dtype: Union[str, torch.dtype, None] = "auto"  # compute dtype; "auto": the recipe's calibration.dtype rule
    progress: bool = False
    notify: Callable[[str], None] = log.info  # the lines a user sees
    zero_nonfinite: bool = False  # zero NaN/Inf in the source weights (loudly) instead of refusing
    trust_remote_code: bool = False  # keep the source's auto_map and .py files (never executed here)
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    activation_budget_bytes: Optional[int] = None  # None: half the memory available (in memory only when no output)
    memory_check: bool = True  # refuse a layer-by-layer run whose plan does not fit memory
    resume: bool = False  # continue a stopped layer-by-layer run of this output
    restart: bool = False  # discard a stopped run of this output
    dist_timeout_s: float = distributed.DEFAULT_TIMEOUT_S
    texts: Optional[Sequence[str]] = None  # calibration texts instead of the recipe's dataset
    batches: Optional[list[torch.Tensor]] = None  # calibration token ids instead of any text
    tokenizer: object = None  # for text calibration of an in-memory model
    # static activation scales per linear given to the round-to-nearest stages instead of calibrated (`rtn`, `fp8`:
    # `Algorithm.take_input_scales`); the domain check's counterpart takes those of the run it is compared with
    input_scales: Optional[dict] = None


@contextlib.contextmanager
def _warnings_already_said():
    """quantkit's log below errors for the duration (a reference run whose warnings the user already saw)."""
    logger = logging.getLogger("quantkit")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run(model: Union[str, Path, nn.Module, None], recipe: Recipe,
        opts: Options = Options()) -> tuple[Optional[nn.Module], QuantizeRecord]:
    """Quantize `model` (a checkpoint spec, or a transformers model in memory, quantized in place) with `recipe`;
    (the model when it stays in memory else None, the run's record). Everything that can be checked before the
    work is: the output may be written, the filesystem has room, the plan fits memory, the weights are finite.
    Under torchrun each rank calibrates on its share of the batches and rank 0 writes."""
    _check_modes(opts, model)
    where = devices.resolve(opts.device)
    world = distributed.init(where.device, opts.dist_timeout_s) if distributed.env_world_size() > 1 else \
        distributed.current()
    try:
        if world.active and where.device.type == "cuda":
            where = rank_device(opts.device, world.rank, int(os.environ.get("LOCAL_RANK", "0")))
        if not world.is_writer:
            opts = dataclasses.replace(opts, notify=_quiet, progress=False)  # rank 0 speaks for the run
        elif world.active:
            opts.notify(f"distributed: {world.size} ranks ({world.backend}); calibration batches dealt round-robin, "
                        "statistics reduced, solves shared; rank 0 writes")
        if where.is_accelerator:
            opts.notify(where.describe())
        devices.reset_peak(where.device)
        with PeakSampler(0.02, live=False) as peak:  # resident memory only: cheap to read
            job = _Job.open(model, recipe, opts, where, world)
            net, record = job.execute(peak)
    finally:
        if world.active:
            distributed.shutdown()
    record.peak_rss_bytes = peak.peak_rss
    record.peak_device_bytes = devices.peak_memory_bytes(where.device)
    return net, record


def quantize(model_spec: Optional[str], recipe: Recipe, output: Optional[Path] = None, *, progress: bool = True,
             device: Union[str, torch.device, None] = devices.DEFAULT, load_mode: str = "layers",
             **options) -> QuantizeRecord:
    """`quantkit quantize`: `run` a checkpoint to `output` (default ./<model>-<recipe>), layer by layer unless
    `load_mode="whole"`; `options` are `Options` fields."""
    opts = Options(output=Path(output) if output else None, default_output=True, progress=progress, device=device,
                   load=load_mode, **options)
    return run(model_spec, recipe, opts)[1]


def _check_modes(opts: Options, model) -> None:
    """Refuse load / output / resume combinations that cannot work, before anything is read."""
    if opts.load not in LOAD_MODES:
        raise QuantizationError(f"load mode {opts.load!r}: use one of {', '.join(LOAD_MODES)}")
    if opts.load == "layers" and isinstance(model, nn.Module):
        raise QuantizationError("load 'layers' reads a checkpoint from disk layer by layer; a model in memory is "
                                "quantized whole (load='whole')")
    if opts.load == "layers" and opts.output is None and not opts.default_output:
        raise QuantizationError("load 'layers' writes each layer as it finishes: give an output directory")
    if (opts.resume or opts.restart) and opts.load != "layers":
        raise QuantizationError("--resume/--restart need --load layers (the default): a whole-model run keeps no "
                                "state between layers")
    if opts.resume and opts.restart:
        raise QuantizationError("--resume continues a stopped run and --restart discards it: give one of them")
    if distributed.env_world_size() > 1 and (opts.resume or opts.restart):
        raise distributed.DistributedError("--resume/--restart are not supported in distributed runs yet: "
                                           "resume with a single process (its state differs per world size)")


def rank_device(asked, rank: int, local_rank: int) -> devices.DeviceChoice:
    """The GPU of one rank of a distributed CUDA run: its local rank's. An index asked for (`--device cuda:3`)
    cannot hold for every rank, so it is refused on every rank alike, not replaced unsaid."""
    index = torch.device(str(asked)).index if str(asked or "").startswith("cuda") else None
    if index is not None:
        raise distributed.DistributedError(
            f"--device {asked} in a distributed run: each rank takes the GPU of its local rank (this is rank "
            f"{rank}, LOCAL_RANK {local_rank}); pass --device cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES")
    return devices.DeviceChoice(torch.device("cuda", local_rank), f"rank {rank}: local rank's GPU")


def choose_compute(storage: torch.dtype, where: devices.DeviceChoice, dtype, recipe: Recipe) -> compute.ComputeChoice:
    """The run's compute dtype, resolved once: asked for (as `quantkit.load` takes dtype=), else by the recipe's
    calibration.dtype rule (`quantkit.platform.compute`)."""
    if dtype in (None, "auto"):
        return compute.choose(storage, where.device, recipe.calibration.dtype, "calibration.dtype")
    return compute_choice(dtype, storage, where.device)[0]


@dataclass
class _Job:
    """One run's fixed facts, and its steps in order: the output checked, the source loaded (whole or as a
    skeleton), the plan, the calibration data, the pipeline, the files."""

    opts: Options
    recipe: Recipe
    given: Optional[nn.Module]  # the model handed over in memory, if one was
    source: Optional[Path]
    raw: dict
    storage: torch.dtype
    out: Optional[Path]
    adapter: object
    choice: compute.ComputeChoice
    where: devices.DeviceChoice
    world: distributed.World

    @classmethod
    def open(cls, model, recipe: Recipe, opts: Options, where: devices.DeviceChoice,
             world: distributed.World) -> "_Job":
        given = model if isinstance(model, nn.Module) else None
        source, raw, storage = model_source(given) if given is not None else float_source(
            None if model is None else str(model))
        out = Path(opts.output) if opts.output else (default_output(source, recipe) if opts.default_output else None)
        if out is not None and world.is_writer:
            for line in clean_stale_for(out):
                opts.notify(line)
            check_output_free(out, opts.overwrite, protect=[source] if source else [])  # before the work, not after
            check_writable(out)
        choice = choose_compute(storage, where, opts.dtype, recipe)
        opts.notify(choice.describe())
        return cls(opts, recipe, given, source, raw, storage, out, adapter_for(raw.get("model_type", "?")), choice,
                   where, world)

    def execute(self, peak: PeakSampler) -> tuple[Optional[nn.Module], QuantizeRecord]:
        """The run: (the model if it stays in memory, the record); the checkpoint written when there is an output."""
        start, opts = time.perf_counter(), self.opts
        model, onloaded, zeroed = self.load_source()
        stages = build_stages(model, self.adapter, self.recipe)
        if opts.input_scales is not None:
            for stage in stages:
                stage.algorithm.take_input_scales(opts.input_scales)
        record = self.record(report_fallbacks(stages, opts.notify), zeroed)
        budget = activation_budget(self.where.device, opts.activation_budget_bytes)  # one figure: planned and kept
        record.plan = self.plan_run(model, stages, budget).to_json()
        scratch = ExitStack()
        batches, activations = self.calibration(stages, model, budget, scratch)
        writes = self.world.is_writer and self.out is not None
        state = self.run_state(batches) if onloaded is not None and writes else None

        def before_files() -> None:  # the figures so far: the files are written at the end of the run
            record.created = _now()
            record.seconds = time.perf_counter() - start
            record.peak_rss_bytes = peak.peak_rss
            record.peak_device_bytes = devices.peak_memory_bytes(self.where.device)
            record.activations = _activation_figures(activations)

        try:
            with scratch, widened(self.choice):
                record.result = self._pipeline(model, stages, batches, activations, onloaded, record, state,
                                               before_files)
        except BaseException:
            if state is not None:
                _stopped(state, self.out, len(self.adapter.layers(model)), opts.notify)
            raise
        if state is not None:
            state.remove()  # a finished run leaves nothing but its output
        before_files()
        if onloaded is None and writes:
            write_whole(model, record, self.out, overwrite=opts.overwrite, max_shard_bytes=opts.max_shard_bytes,
                        keep_remote_code=opts.trust_remote_code, notify=opts.notify)
        kept = model if onloaded is None else None
        self.check_domains(kept, record)
        return kept, record

    def check_domains(self, kept: Optional[nn.Module], record: QuantizeRecord) -> None:
        """After a calibrated run of a checkpoint on the recipe's own data: its KLD per calibration part on held-back
        windows against round-to-nearest's (`flow.domain_check`), a warning for any part where it is worse."""
        opts, cal = self.opts, self.recipe.calibration
        if (self.given is not None or opts.texts is not None or opts.batches is not None or self.world.active
                or not domain_check.is_calibrated(self.recipe) or cal.check_samples == 0):
            return
        held = held_back_windows(self.source, self.recipe, self.adapter.needs_bos, config=self.raw)
        def quantize(model, recipe: Recipe, out: Optional[Path], scales: Optional[dict] = None) -> Optional[nn.Module]:
            quiet = Options(output=out, load="whole" if out is None else "layers", notify=lambda _: None,
                            dtype=self.choice.dtype, input_scales=scales)
            with _warnings_already_said():  # (the counterpart's stages repeat what this run's said)
                return run(model if out is None else str(model), recipe, quiet)[0]

        rows, record.domain_warning = domain_check.run_check(
            self.source, kept, self.out, self.recipe, held, self.choice.dtype, opts.notify, quantize,
            layers=kept is None)
        if rows is not None:
            record.domain_check = rows  # (in metadata(): quantkit.json written again from the record)
            if self.out is not None and self.world.is_writer and (self.out / "quantkit.json").is_file():
                domain_check.rewrite_file(self.out / "quantkit.json", record.files()["quantkit.json"])

    def _pipeline(self, model, stages, batches, activations, onloaded, record, state, before_files):
        opts = self.opts
        if not self.world.is_writer:
            return run_silent(model, self.adapter, stages, batches, self.storage, self.where.device, activations,
                              onloaded)
        if onloaded is None:
            return quantize_model(model, self.adapter, stages, batches, self.storage, opts.progress,
                                  device=self.where.device, activations=activations)
        return run_layers(model, self.adapter, stages, batches, record, state, onloaded, progress=opts.progress,
                          activations=activations, overwrite=opts.overwrite, max_shard_bytes=opts.max_shard_bytes,
                          keep_remote_code=opts.trust_remote_code, notify=opts.notify, before_files=before_files)

    def record(self, fallbacks: list[dict], zeroed: list) -> QuantizeRecord:
        rounded = self.given is None and not compute.holds_exactly(self.choice.dtype, self.storage)
        return QuantizeRecord(self.recipe, self.source, self.storage, self.choice, self.where,
                              group_size_fallbacks=fallbacks, rounded_from=self.source if rounded else None,
                              calibration_data=given_data(self.opts.texts, self.opts.batches), output=self.out,
                              load=self.opts.load, world_size=self.world.size, zeroed_nonfinite=zeroed)

    def load_source(self):
        """(model, its onloader or None, the tensors whose NaN/Inf were zeroed): handed over, loaded whole, or an
        empty skeleton whose layers are read as their turn comes; non-finite weights refused or zeroed (said)."""
        opts = self.opts
        if self.given is not None:
            model = self.given
            if any(p.is_floating_point() and p.dtype != self.choice.dtype for p in model.parameters()):
                model.to(self.choice.dtype)
            return model, None, check_source(model, opts.zero_nonfinite, opts.notify)
        if opts.load == "whole":
            try:
                model = load(self.source, dtype=self.choice.dtype, finite=False)  # checked just below
            except DoesNotFitError as exc:  # (its fixes name eval's and generate's options, which quantize has not)
                raise QuantizationError(f"--load whole: {exc.what}; --load layers (the default) holds one decoder "
                                        "layer at a time") from None
            return model, None, check_source(model, opts.zero_nonfinite, opts.notify)
        model = skeleton(model_config(self.source, self.raw), self.choice.dtype)
        onloaded = OnloadedModel(model, self.source, self.adapter, self.choice.dtype, self.storage)
        return model, onloaded, onloaded.check_finite(opts.zero_nonfinite, opts.notify)

    def plan_run(self, model, stages, budget: Optional[int]) -> Plan:
        """The run's plan, said in one line; a layer-by-layer run that would not fit memory, or any run that would
        not fit the disk, is refused now."""
        opts, where = self.opts, self.where
        checkpoint_bytes = estimate_checkpoint_bytes(model, stages, self.storage)
        the_plan = make_plan(model, stages, self.adapter, self.recipe, model_name=str(self.source or "the model"),
                             device=where.device, compute_dtype=self.choice.dtype, storage_dtype=self.storage,
                             checkpoint_bytes=checkpoint_bytes,
                             activation_budget=budget, throughput=None, nproc=self.world.size, tokenizer_bytes=tokenizer_file_bytes(self.source))
        opts.notify(f"plan: peak memory ~{the_plan.peak_host_bytes / 1e9:.2f} GB"
                    + (f" host, ~{the_plan.peak_device_bytes / 1e9:.2f} GB {where.device}" if where.is_accelerator
                       else "")
                    + f"; checkpoint ~{checkpoint_bytes / 1e9:.2f} GB; disk ~{the_plan.disk_bytes / 1e9:.2f} GB")
        if opts.memory_check and opts.load == "layers":
            check_plan_fits(the_plan, available_memory())
        if self.world.is_writer and self.out is not None:
            check_free_space(self.out, the_plan.disk_bytes)
        return the_plan

    def calibration(self, stages, model, budget: Optional[int], scratch: ExitStack):
        """(this rank's calibration batches or None, where their activations live: in memory up to `budget`)."""
        opts, world = self.opts, self.world
        if opts.batches is not None:
            check_given_batches(opts.batches, self.raw, str(self.source or "the model"))
            batches = list(opts.batches)
        elif any(s.algorithm.needs_data() for s in stages) and opts.texts is None and \
                self.recipe.calibration.dataset == SELF:
            batches = self.self_generated(model)
        elif any(s.algorithm.needs_data() for s in stages):
            texts = None if opts.texts is None else list(opts.texts)
            batches = calibration_batches(self.source, self.recipe, self.adapter.needs_bos, opts.tokenizer, texts,
                                          config=self.raw, notify=opts.notify)
        else:
            return None, Activations()
        if world.active:
            if len(batches) < world.size:
                raise distributed.DistributedError(
                    f"the calibration data makes {len(batches)} batch(es) for {world.size} ranks: every rank needs "
                    "one; raise calibration.num_samples, lower calibration.batch_size, or use fewer ranks")
            batches = world.shard(batches)  # batch i to rank i mod N
        if self.out is None:
            return batches, Activations()  # in memory: there is no output beside which they could wait on disk
        return batches, _activations(batches, model.config.hidden_size, self.choice.dtype, budget, self.out, scratch,
                                     opts.notify)

    def self_generated(self, model: nn.Module) -> list[torch.Tensor]:
        """calibration.dataset: self: windows the float model writes itself (`flow.self_calibration`), by the model in
        memory when it is whole, else by the source loaded whole for the purpose (and dropped after)."""
        cal, opts = self.recipe.calibration, self.opts
        tokenizer = opts.tokenizer if opts.tokenizer is not None else load_tokenizer(self.source)
        bos = tokenizer.bos_token_id if self.adapter.needs_bos else None
        whole = model if self.opts.load == "whole" else None
        if whole is None:
            try:
                whole = load(self.source, dtype=self.choice.dtype)
            except DoesNotFitError as exc:
                raise QuantizationError(f"calibration.dataset: self generates with the whole model in memory: "
                                        f"{exc.what}; calibrate on the shipped mix (dataset: mix-v1)") from None
        ids = self_calibration.self_windows(whole, tokenizer, self.source, cal.num_samples, cal.seq_len, cal.seed, bos,
                                            opts.notify)
        return list(ids.split(cal.batch_size))

    def run_state(self, batches) -> "resume_mod.RunState":
        """The resumable state of a layer-by-layer run (a stopped one continued with `resume`)."""
        opts = self.opts
        settings = {"load": opts.load, "compute_dtype": self.choice.name, "device_type": self.where.device.type,
                    "world_size": self.world.size, "max_shard_bytes": opts.max_shard_bytes,
                    "zero_nonfinite": bool(opts.zero_nonfinite)}
        if self.choice.wide_matmuls:  # (only when set: a manifest of a run without widening reads the same as before)
            settings["wide_matmuls"] = True  # float32 GEMMs rounded to 16 bits: other last bits than native kernels
        manifest = resume_mod.fingerprint(self.source, self.recipe.to_yaml(), batches, settings)
        return resume_mod.RunState.open(self.out, manifest, opts.resume, opts.restart, opts.notify)


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
                   f"those use group_size {size} (recorded in quantkit.json; --set stages.{st.address or st.index}"
                   ".scheme.group_size=N to choose one for all)")
    return records


def _activations(batches: list[torch.Tensor], hidden_size: int, dtype: torch.dtype, budget: Optional[int], out: Path,
                 scratch: ExitStack, notify: Callable[[str], None]) -> Activations:
    """Where the calibration activations live: in memory up to the budget, the rest in a scratch directory
    (made only when they do not fit; said so, with the numbers)."""
    need = sum(b.numel() for b in batches) * hidden_size * dtype.itemsize
    if budget is None or need <= budget:
        return Activations(Budget(budget))
    spill = scratch.enter_context(scratch_dir(out))
    notify(f"calibration activations take {need / 1e9:.2f} GB per layer, above the {budget / 1e9:.2f} GB budget "
           f"(--activation-budget): the batches beyond it wait on disk in {spill}")
    return Activations(Budget(budget), spill)


def _activation_figures(activations: Activations) -> dict:
    budget = activations.budget
    return {"budget_bytes": budget.limit, "peak_bytes": budget.peak, "spilled_bytes": budget.spilled_bytes}


def _stopped(state: "resume_mod.RunState", out: Path, layers: int, notify: Callable[[str], None]) -> None:
    """A layer-by-layer run that stopped: its finished layers kept for --resume (said how), or nothing kept."""
    state.release()
    if state.finished:
        notify(state.stopped_message(out, layers))
    else:
        state.remove()  # nothing finished: nothing worth keeping


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _quiet(_line: str) -> None:
    pass


def default_output(source: Path, recipe: Recipe) -> Path:
    return Path.cwd() / f"{source.name}-{recipe.name}"


def estimate_checkpoint_bytes(model: nn.Module, stages: list[Stage], storage_dtype: torch.dtype) -> int:
    """Bytes of the checkpoint's tensors the stages will write: each quantized linear as its format's
    module holds it (an empty one is built on meta: packed words, scales, zero points, shape), every
    other tensor of the state dict in the storage dtype (non-persistent buffers, e.g. rotary tables,
    are not written; tied weights once)."""
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


def activation_budget(device: torch.device, asked: Optional[int]) -> Optional[int]:
    """The activation budget: as asked, else half the memory available now where the activations live."""
    if asked is not None:
        return asked
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    return None if free is None else free // 2


def plan(model_spec: Optional[str], recipe: Recipe, device: Union[str, torch.device, None] = devices.DEFAULT,
         activation_budget_bytes: Optional[int] = None, measure: bool = True, nproc: int = 1) -> Plan:
    """What quantizing `model_spec` with `recipe` will need (`quantkit plan`), from its config.json alone."""
    where = devices.resolve(device)
    source = resolve_model(model_spec)
    raw = read_config(source)
    adapter = adapter_for(raw.get("model_type", "?"))
    storage_dtype = checkpoint_dtype(raw)
    choice = choose_compute(storage_dtype, where, "auto", recipe)
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
                     activation_budget=activation_budget(where.device, activation_budget_bytes),
                     throughput=throughput, nproc=nproc, tokenizer_bytes=tokenizer_file_bytes(source))


def check_plan_fits(p: Plan, available: Optional[int]) -> None:
    """Refuse a run whose planned peak host memory is above what is available, with the numbers."""
    if available is not None and p.peak_host_bytes > available:
        raise QuantizationError(
            f"this run needs about {p.peak_host_bytes / 1e9:.2f} GB of memory (plan: "
            + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in p.breakdown.items() if v)
            + f") and {available / 1e9:.2f} GB is available; lower --activation-budget or calibration.num_samples, "
            "use --device cuda, or pass --no-memory-check to try anyway (`quantkit plan` shows the whole plan)")
