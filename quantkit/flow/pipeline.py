"""The sequential layer-wise pipeline: quantize a model one decoder layer at a time.

For each decoder layer: run the calibration batches through it with the stages' hooks (only
if a stage needs data), let each stage quantize its targeted linears, swap them for quantized
modules, then run the *quantized* layer to produce the next layer's inputs. A true-sequential stage
does both in one lock-step forward (`calibration.lockstep`), each group quantized as the batches reach
it. Beyond the model, memory holds one layer's inputs for all calibration batches.

On an accelerator (`device`), only the layer being quantized, the calibration activations and the
solvers' state live on it: the model stays on the CPU (or on disk, with a layer store) and each
layer goes to the device for its turn and back after it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.algorithms.base import Algorithm, LayerContext
from quantkit.arch.adapter import ArchitectureAdapter, sibling_groups
from quantkit.arch.moe import all_experts_see_tokens
from quantkit.calibration.activations import Activations
from quantkit.calibration.capture import LayerInputs, capture_layer_inputs, observe_layer, run_layer
from quantkit.calibration.lockstep import drive_in_lockstep
from quantkit.errors import QuantizationError
from quantkit.plugins.catalog import format_for
from quantkit.formats.base import QuantFormat
from quantkit.platform.memory import release_free_memory
from quantkit.quant.ggml import is_block_grid
from quantkit.quant.intq import sqnr_db
from quantkit.flow.layer_schemes import layer_schemes
from quantkit.qmodules import online_rotation
from quantkit.flow.recipe import Recipe, StageSpec
from quantkit.quant.schemes import QuantScheme
from quantkit.core.targets import select_linears

log = logging.getLogger(__name__)


class LayerStore(Protocol):
    """Loads a decoder layer's tensors before its turn and takes it back, quantized, after it."""

    def load_layer(self, index: int, layer: nn.Module) -> None: ...

    def finish_layer(self, index: int, layer: nn.Module) -> None: ...


@dataclass
class Stage:
    index: int
    spec: StageSpec
    algorithm: Algorithm
    modules: list[str]  # full names of the linears this stage quantizes (or transforms)
    schemes: dict[str, QuantScheme] = field(default_factory=dict)  # transforms: the scheme each target gets later
    # quantizing stages: linears whose inputs the scheme's group size does not divide, with the smaller group they get
    fallbacks: dict[str, QuantScheme] = field(default_factory=dict)
    address: str = ""  # how --set names the stage (`ResolvedStage.address`)
    # a per-tensor mixture scheme (Q4_K_M): the ggml grid each linear gets, as llama.cpp chooses it
    mixture: dict[str, QuantScheme] = field(default_factory=dict)

    def scheme_of(self, name: str) -> QuantScheme:
        """The scheme this (quantizing) stage gives linear `name`."""
        if name in self.mixture:
            return self.mixture[name]
        return self.fallbacks.get(name, self.algorithm.scheme)


@dataclass
class QuantizationResult:
    quantized: dict[str, tuple[QuantFormat, QuantScheme]] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)  # per quantized linear: name, scheme, sqnr_db
    kv_cache_scheme: Optional[dict] = None  # compressed-tensors kv_cache_scheme when KV scales were calibrated
    kv_scales: list[dict] = field(default_factory=list)  # per layer: k_scale, v_scale
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over layers
    on_phase: Optional[Callable[[str], None]] = None  # told each phase as it starts (the progress bar)

    def add_seconds(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block and charge it to phase `name`."""
        if self.on_phase is not None:
            self.on_phase(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_seconds(name, time.perf_counter() - start)


def build_stages(model: nn.Module, adapter: ArchitectureAdapter, recipe: Recipe) -> list[Stage]:
    """Instantiate each stage's algorithm and resolve its target modules, validating up front."""
    stages, claimed = [], {}
    layers_prefix = adapter.layers_path + "."
    for planned in recipe.resolved:
        i, spec, algo_cls, scheme = planned.index, planned.spec, planned.algorithm, planned.scheme
        if not algo_cls.produces_weights and scheme is not None:
            raise QuantizationError(
                f"stage {i} ({spec.algorithm}) takes no scheme: it prepares weights for the stage that "
                f"quantizes them and uses that stage's scheme; remove stages.{i}.scheme"
            )
        if algo_cls.produces_weights and scheme is None:
            raise QuantizationError(f"stage {i} ({spec.algorithm}) needs a scheme, e.g. `scheme: W4A16`")
        algorithm = algo_cls(planned.config, scheme)
        if algo_cls.kind == "attention":  # layer-level (KV cache): no linear targets
            stages.append(Stage(i, spec, algorithm, [], address=planned.address))
            continue
        names = select_linears(model, spec.targets, spec.ignore)
        outside = [n for n in names if not n.startswith(layers_prefix)]
        if outside:
            raise QuantizationError(
                f"stage {i} ({spec.algorithm}) targets {', '.join(outside)}, outside the decoder layers; "
                f"quantizing those is not supported yet: add them to stages.{i}.ignore"
            )
        fallbacks, mixture = {}, {}
        if algo_cls.produces_weights:
            fallbacks, mixture = layer_schemes(model, names, scheme, i, planned.group_size_explicit)
            twice = [n for n in names if n in claimed]
            if twice:
                raise QuantizationError(
                    f"stage {i} quantizes {twice[0]} which stage {claimed[twice[0]]} already quantizes; "
                    "make the stages' targets/ignore disjoint"
                )
            claimed.update({n: i for n in names})
        stages.append(Stage(i, spec, algorithm, names, fallbacks=fallbacks, address=planned.address, mixture=mixture))
    if not claimed and not any(_observes_attention(s) for s in stages):
        raise QuantizationError("the recipe's targets match no Linear module inside the decoder layers")
    for stage in stages:
        if stage.algorithm.kind == "transform":
            _assign_later_schemes(stage, stages, claimed)
    _check_true_sequential(stages, layers_prefix)
    return stages


def _layer_of(name: str, layers_prefix: str) -> str:
    return name[len(layers_prefix):].split(".", 1)[0]


def _check_true_sequential(stages: list[Stage], layers_prefix: str) -> None:
    """A true-sequential stage's single forward makes the next layer's inputs, so no later stage may change
    weights (quantize or transform) in a layer it quantizes."""
    for i, stage in enumerate(stages):
        if not stage.algorithm.true_sequential():
            continue
        mine = {_layer_of(n, layers_prefix) for n in stage.modules}
        for later in stages[i + 1:]:
            if later.algorithm.kind == "attention":
                continue
            shared = sorted({_layer_of(n, layers_prefix) for n in later.modules} & mine, key=int)
            if shared:
                raise QuantizationError(
                    f"stage {stage.index} ({stage.spec.algorithm}) is true-sequential, but stage {later.index} "
                    f"({later.spec.algorithm}) changes weights after it in decoder layer {shared[0]}: its single "
                    f"forward would hand the next layer stale inputs; move stage {stage.index} last, or set "
                    f"stages.{stage.index}.args.true_sequential=false")


def _observes_attention(stage: Stage) -> bool:
    return stage.algorithm.kind == "attention"


def _assign_later_schemes(stage: Stage, stages: list[Stage], claimed: dict[str, int]) -> None:
    """A transform prepares weights for the stage that quantizes them: it must come before it."""
    missing = [n for n in stage.modules if claimed.get(n, -1) < stage.index]
    if missing:
        raise QuantizationError(
            f"stage {stage.index} ({stage.spec.algorithm}) transforms {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + " but no later stage quantizes it; add a quantizing stage (rtn, gptq) after it "
            f"or add those modules to stages.{stage.index}.ignore"
        )
    stage.schemes = {n: stages[claimed[n]].scheme_of(n) for n in stage.modules}
    if stage.algorithm.any_grid:
        return
    blocks = [n for n, sc in stage.schemes.items() if is_block_grid(sc)]
    if blocks:
        raise QuantizationError(
            f"stage {stage.index} ({stage.spec.algorithm}) prepares weights for int grids, but {blocks[0]} is quantized "
            f"to ggml's {stage.schemes[blocks[0]].short()} by stage {claimed[blocks[0]]}, which it does not model: "
            f"drop stage {stage.index} (recipe gptq-q4_k_m) or use a Q4_0 recipe (awq-q4_0)")
    fp8 = [n for n, sc in stage.schemes.items() if sc.is_fp8]
    if fp8:
        raise QuantizationError(
            f"stage {stage.index} ({stage.spec.algorithm}) prepares int weights, but {fp8[0]} is quantized to FP8 by "
            f"stage {claimed[fp8[0]]}; FP8's per-channel scales need no such transform: drop stage {stage.index}")


def _by_scheme(groups: list[list[str]], scheme_of: dict[str, QuantScheme]) -> list[list[str]]:
    """Input-sharing groups split where their linears get different schemes (a mixture's attn_v in Q6_K
    beside q/k in Q5_0): each part is solved on its own (with its own Hessian of the same inputs)."""
    out = []
    for group in groups:
        parts: dict[QuantScheme, list[str]] = {}
        for name in group:
            parts.setdefault(scheme_of[name], []).append(name)
        out.extend(parts.values())
    return out


def _groups(names: list[str], adapter: ArchitectureAdapter, prefix: str) -> list[list[str]]:
    """Partition a layer's names into input-sharing groups as the adapter declares them; the rest by name
    (`sibling_groups`: each MoE expert's gate and up share one, as vLLM fuses them)."""
    groups, seen = [], set()
    for rel_group in adapter.linear_groups:
        group = [prefix + r for r in rel_group if prefix + r in names]
        if group:
            groups.append(group)
            seen.update(group)
    return groups + sibling_groups([n for n in names if n not in seen])


def quantize_model(
    model: nn.Module,
    adapter: ArchitectureAdapter,
    stages: list[Stage],
    batches: Optional[list[torch.Tensor]],
    scale_dtype: torch.dtype,
    progress: bool = True,
    store: Optional[LayerStore] = None,
    device: torch.device = torch.device("cpu"),
    activations: Optional[Activations] = None,
    start_layer: int = 0,
    resume_hidden: Optional[Iterable[torch.Tensor]] = None,
    on_layer_done: Optional[Callable[[int, Optional[LayerInputs], QuantizationResult], None]] = None,
    result: Optional[QuantizationResult] = None,
) -> QuantizationResult:
    """Quantize `model` in place; returns which modules were quantized and per-module errors.

    store: where decoder layers come from and go to when the model is not in memory (`onload`):
    each layer is loaded just before its turn and handed back, quantized, right after it.
    device: where each layer computes (the rest of the model stays where it is).
    activations: where the calibration activations are kept (with a memory budget and a spill directory);
    by default in memory without a limit.

    Resuming (`quantkit.flow.resume`): layers before `start_layer` are done (`result` holds their report);
    `resume_hidden` are the calibration activations entering `start_layer` (the other layers' arguments
    are captured again, which runs only the embeddings). on_layer_done(index, inputs, result) is called
    after each layer is handed back to the store, with the next layer's inputs in `inputs`."""
    start = time.perf_counter()
    layers = adapter.layers(model)
    result = result if result is not None else QuantizationResult()
    if store is None:  # onloading: the caller transformed them already (`transform_outside`)
        transform_outside(model, adapter, stages)
    inputs = _first_inputs(model, layers, stages, batches, device, activations, start_layer, resume_hidden, result)
    notes: dict[str, dict] = {}  # what transforms report per linear, logged when it is quantized
    bar = tqdm(range(start_layer, len(layers)), desc="quantizing layers", unit="layer", disable=not progress,
               initial=start_layer, total=len(layers))
    result.on_phase = lambda name: bar.set_postfix_str(name, refresh=True)
    for li in bar:
        _layer_turn(model, layers, li, stages, adapter, inputs, scale_dtype, result, notes, store, device)
        if on_layer_done is not None:
            on_layer_done(li, inputs if li < len(layers) - 1 else None, result)
        release_free_memory()
    result.on_phase = None
    bar.close()
    result.seconds = time.perf_counter() - start
    return result


def _layer_turn(model, layers, li: int, stages, adapter, inputs: Optional[LayerInputs], scale_dtype,
                result: QuantizationResult, notes: dict, store: Optional[LayerStore], device: torch.device) -> None:
    """Layer `li`'s turn: loaded (from the store, onto the compute device), every stage run, the next layer's inputs
    made, the packed modules swapped in, and the layer handed back (to the store, or to where it lives)."""
    if store is not None:
        with result.phase("load layer"):
            store.load_layer(li, layers[li])
    home = _device_of(layers[li])  # where the layer lives in the model (a GPU, for a model that sits on one)
    if home != device:
        with result.phase("load layer"):
            layers[li].to(device)
    packed, following = _quantize_layer(model, layers, li, stages, adapter, inputs, scale_dtype, result, notes)
    _advance(layers, li, inputs, following, result)
    for name, module in packed.items():
        model.set_submodule(name, module)
    if store is not None:
        with result.phase("write layer"):
            store.finish_layer(li, layers[li])
    elif home != device:
        layers[li].to(home)  # the quantized layer rejoins the model where the model is


def rewrites_outside(stages: list[Stage]) -> bool:
    """Whether a stage rewrites tensors outside the decoder layers (the rotate stage's embeddings and lm_head)."""
    return any(s.algorithm.rewrites_outside for s in stages)


def transform_outside(model: nn.Module, adapter: ArchitectureAdapter, stages: list[Stage]) -> None:
    """Each transform stage's `transform_model`, once, before any layer is calibrated (an onloaded model's
    outside tensors must be in memory first: `OnloadedModel.materialize_outside`)."""
    for stage in stages:
        if stage.algorithm.kind == "transform":
            stage.algorithm.transform_model(model, adapter)


def _first_inputs(model, layers, stages, batches, device, activations, start_layer: int, resume_hidden,
                  result: QuantizationResult) -> Optional[LayerInputs]:
    """What the first layer to quantize receives (None when no stage calibrates): captured by one forward
    per batch, or, resuming at `start_layer`, the saved activations entering it."""
    if not any(s.algorithm.needs_data() for s in stages):
        return None
    if not batches:
        raise QuantizationError("a stage needs calibration data but no calibration batches were given")
    with result.phase("capture layer inputs"):
        inputs = capture_layer_inputs(model, layers, batches, device, activations)
    if start_layer:
        inputs.hidden.clear()
        inputs.hidden = inputs.hidden.successor()
        for t in resume_hidden:
            inputs.hidden.append(t.to(device))
        for li in range(start_layer):
            inputs.kwargs[li] = []
    return inputs


def _quantize_layer(model, layers, li: int, stages, adapter, inputs: Optional[LayerInputs], scale_dtype,
                    result: QuantizationResult, notes: dict) -> tuple[dict[str, nn.Module], Optional[Activations]]:
    """Every stage on layer `li`: (the packed modules to swap in, the next layer's inputs when a true-sequential
    pass made them, else None); KV-cache observers run last, on K/V as the quantized layer makes them."""
    prefix = f"{adapter.layers_path}.{li}."
    packed: dict[str, nn.Module] = {}
    following = None
    for stage in stages:
        names = [n for n in stage.modules if n.startswith(prefix)]
        if not names:
            continue
        if inputs is not None and stage.algorithm.true_sequential():
            made, following = _run_stage_lockstep(model, layers[li], li, stage, names, adapter, inputs,
                                                  scale_dtype, result, notes, last=li == len(layers) - 1)
            packed.update(made)
        else:
            packed.update(_run_stage(model, layers[li], li, stage, names, adapter, inputs, scale_dtype, result, notes))
    for stage in filter(_observes_attention, stages):
        with result.phase(f"{stage.spec.algorithm}: calibrate"):
            report = stage.algorithm.calibrate_layer(layers[li], adapter.attention, inputs.hidden,
                                                     inputs.kwargs[li], scale_dtype)
        result.kv_scales.append({"layer": li, **report})
        result.kv_cache_scheme = stage.algorithm.scheme_config()
    return packed, following


def _advance(layers, li: int, inputs: Optional[LayerInputs], following, result: QuantizationResult) -> None:
    """Make the next layer's inputs out of this (quantized) layer's: the true-sequential pass's, or one
    forward; this layer's inputs and arguments are released."""
    if following is not None:
        inputs.hidden.clear()  # the pass made the next layer's inputs (the last stage to change weights)
        inputs.hidden = following
        inputs.kwargs[li] = []
    elif inputs is not None and li < len(layers) - 1:
        with result.phase("forward quantized layer (next inputs)"):
            # this layer's inputs are released as the next layer's are made: one budget for both
            inputs.hidden = run_layer(layers[li], inputs.hidden.drain(), inputs.kwargs[li],
                                      into=inputs.hidden.successor())
        inputs.kwargs[li] = []  # this layer's arguments are no longer needed
    elif inputs is not None:
        inputs.hidden.clear()  # the last layer's inputs (and their spill files)


def _device_of(layer: nn.Module) -> torch.device:
    """The device of a layer's tensors (the CPU for a layer without any, or one still on meta: onloading
    fills it on the CPU)."""
    t = next(iter(layer.parameters()), None)
    t = t if t is not None else next(iter(layer.buffers()), None)
    return torch.device("cpu") if t is None or t.device.type == "meta" else t.device


def _run_stage(model, layer, li: int, stage: Stage, names: list[str], adapter, inputs: Optional[LayerInputs],
               scale_dtype: torch.dtype, result: QuantizationResult, notes: dict[str, dict]) -> dict[str, nn.Module]:
    """Run one stage on one layer. Each quantized linear keeps its float module, now holding the
    dequantized weight (what the packed module computes, but without unpacking per forward), so
    the next stage and the next-inputs forward see the quantized layer; the packed modules are
    returned for the caller to swap in afterwards."""
    linears = {n: model.get_submodule(n) for n in names}
    prefix = f"{adapter.layers_path}.{li}."
    groups = _groups(names, adapter, prefix)
    algorithm = stage.algorithm
    if algorithm.kind == "transform":
        ctx = LayerContext(layer, prefix, linears, {n: stage.schemes[n] for n in names},
                           inputs.hidden if inputs else [], inputs.kwargs[li] if inputs else [], adapter, scale_dtype)
        with result.phase(f"{stage.spec.algorithm}: transform"), all_experts_see_tokens(layer):
            algorithm.transform_layer(ctx)
        for name, note in algorithm.report.items():
            notes.setdefault(name, {}).update(note)
        algorithm.report.clear()
        return {}
    scheme_of, groups, algorithms = _begin_weights(stage, linears, groups)
    if algorithm.needs_data():
        observe_time = [0.0]

        def observe(name: str, x: torch.Tensor) -> None:
            t0 = time.perf_counter()
            algorithm.observe(name, x)
            observe_time[0] += time.perf_counter() - t0

        with result.phase(f"{stage.spec.algorithm}: calibration forward"), all_experts_see_tokens(layer):
            observe_layer(layer, inputs.hidden, inputs.kwargs[li], linears, observe)
        # the statistics' share of the forward, charged to a phase of its own
        result.add_seconds(f"{stage.spec.algorithm}: calibration forward", -observe_time[0])
        result.add_seconds(f"{stage.spec.algorithm}: observe (statistics)", observe_time[0])
    quantized = {}
    with result.phase(f"{stage.spec.algorithm}: quantize"):
        for scheme, algo in algorithms.items():
            part = [g for g in groups if scheme_of[g[0]] == scheme]
            quantized.update(algo.quantize_layer({n: linears[n] for g in part for n in g}, part, scale_dtype))
    with result.phase("pack and report"):
        return _pack(stage, linears, quantized, notes, result)


def _begin_weights(stage: Stage, linears: dict[str, nn.Module], groups: list[list[str]]):
    """A quantizing stage's start on one layer: each linear's scheme, the input-sharing groups split by scheme,
    `begin_layer` called, and one algorithm per scheme (layers with a fallback group size, a mixture): views
    sharing the statistics, made before any of them quantizes (an algorithm may drop its statistics when done)."""
    algorithm = stage.algorithm
    scheme_of = {n: stage.scheme_of(n) for n in linears}
    groups = _by_scheme(groups, scheme_of)
    algorithm.begin_layer(linears, groups)
    algorithms = {sc: algorithm if sc == algorithm.scheme else algorithm.for_scheme(sc)
                  for sc in dict.fromkeys(scheme_of.values())}
    return scheme_of, groups, algorithms


def _run_stage_lockstep(model, layer, li: int, stage: Stage, names: list[str], adapter, inputs: LayerInputs,
                        scale_dtype: torch.dtype, result: QuantizationResult, notes: dict[str, dict],
                        last: bool) -> tuple[dict[str, nn.Module], Optional[Activations]]:
    """Run a true-sequential stage on one layer in a single lock-step forward (`calibration.lockstep`):
    each input-sharing group is quantized once every batch has reached it, on the inputs the layer makes
    with the groups before it quantized. Returns the packed modules and the layer's outputs over the
    batches (the next layer's inputs; None for the last layer): no second forward is needed."""
    linears = {n: model.get_submodule(n) for n in names}
    algorithm = stage.algorithm
    scheme_of, groups, algorithms = _begin_weights(stage, linears, _groups(names, adapter, f"{adapter.layers_path}.{li}."))
    packed: dict[str, nn.Module] = {}
    side = {"observe": 0.0, "quantize": 0.0, "pack": 0.0}

    def on_input(g: int, x: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for name in groups[g]:  # the group's linears read this one input
            algorithm.observe(name, x)
        side["observe"] += time.perf_counter() - t0

    def at_group(g: int) -> None:
        group = groups[g]
        t0 = time.perf_counter()
        quantized = algorithms[scheme_of[group[0]]].quantize_layer({n: linears[n] for n in group}, [group], scale_dtype)
        t1 = time.perf_counter()
        packed.update(_pack(stage, {n: linears[n] for n in group}, quantized, notes, result))
        side["quantize"] += t1 - t0
        side["pack"] += time.perf_counter() - t1

    outputs = None if last else inputs.hidden.successor()
    label = f"{stage.spec.algorithm}: true-sequential forward"
    with result.phase(label), all_experts_see_tokens(layer):
        drive_in_lockstep(layer, inputs.hidden, inputs.kwargs[li], [[linears[n] for n in g] for g in groups],
                          on_input, at_group, outputs=outputs, names=[", ".join(g) for g in groups])
    # the forward's phase less what its hooks did, each charged to its own phase
    result.add_seconds(label, -sum(side.values()))
    result.add_seconds(f"{stage.spec.algorithm}: observe (statistics)", side["observe"])
    result.add_seconds(f"{stage.spec.algorithm}: quantize", side["quantize"])
    result.add_seconds("pack and report", side["pack"])
    return packed, outputs


def _pack(stage: Stage, linears: dict[str, nn.Module], quantized: dict, notes: dict[str, dict],
          result: QuantizationResult) -> dict[str, nn.Module]:
    """Packed modules for the quantized weights, each float linear left holding its dequantized weight,
    and a report row per linear."""
    algorithm = stage.algorithm
    packed = {}
    for name, qw in quantized.items():
        fmt = format_for(qw.scheme)
        linear = linears[name]
        packed[name] = fmt.build_module(qw, linear.bias)
        online_rotation.carry(linear, packed[name])  # an online input rotation (the rotate stage's R4) goes along
        dequantized = qw.dequantize(linear.weight.dtype)  # what the packed module computes, without unpacking it
        result.quantized[name] = (fmt, qw.scheme)
        result.layers.append({
            "name": name,
            "algorithm": stage.spec.algorithm,
            "scheme": qw.scheme.short(),
            "sqnr_db": round(sqnr_db(linear.weight.data, dequantized), 3),
            **notes.pop(name, {}),
            **algorithm.report.pop(name, {}),
        })
        linear.weight.data = dequantized
    return packed
