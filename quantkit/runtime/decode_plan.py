"""The decode plan: the compute dtype, and each layer kind's kernel, that a model generates with on a
CPU, chosen by timing the model's own layer kinds in every candidate on this machine.

A layer kind is a linear's family (dense; packed int4 on the CPU int4 op; other packed int, FP8 or
GGML blocks, run as their modules), shape and scheme. For each candidate compute dtype that holds
the checkpoint's weights exactly (float32; the checkpoint's own 16-bit dtype) each kind's routes
are timed at one token (`Route`: the int4 op in that dtype, quantkit's own one-token GEMV over the op's
layout where it runs (bf16), or dequantize + matmul; dense layers as the lean decode step runs them), the median of REPEATS samples, and the plan with the shortest
one-token step wins. One more candidate narrows: float32 with W4A16 layers' activations rounded to
bf16 for the int4 op (what the scheme's A16 names); it is taken only when it beats the best exact
plan by NARROW_MIN_GAIN, and the choice says so. For the chosen plan, each int4 kind's op is also
timed against dequantization at prefill chunks (`CHUNK_TOKENS`): up to the largest chunk it wins,
prompts run on the op, longer ones dequantize once per forward.

Every figure is cached per machine (CPU model, torch version, limits in the environment; the
compute probe's key), layer kind, route and token count, so later runs choose the same without
measuring; `quantkit doctor MODEL` measures again and prints the table.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.platform import compute
from quantkit.kernels import cpu_int4, native
from quantkit.qmodules.fp8_linear import Fp8Linear
from quantkit.qmodules.int_act_linear import IntActLinear
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.qmodules.micro_linear import MicroLinear
from quantkit.qmodules.dense_copy import DenseCopy

log = logging.getLogger(__name__)

REPEATS = 5  # samples per figure; the median is kept
SAMPLE_SECONDS = 2e-3  # each sample runs the kernel often enough to last about this long
MAX_ROWS = 2048  # a larger layer is timed on this many of its rows, its time scaled by out_features / rows
COLD_BYTES = 256 << 20  # a kind is timed over copies of up to this many bytes of weights, read in turn
# prefill chunks (and the serving engine's decode batches) at which an int4 op is timed against dequantizing; 32:
# on an AMX Xeon the op took 544 us for 32 tokens of SmolLM2's 1536 x 576 int4 linear against 961 us for
# dequantizing, and lost only at 64 (1064 against 1014), so without 32 a batch of 17-63 dequantized
CHUNK_TOKENS = (16, 32, 64, cpu_int4.MAX_TOKENS)
NARROW_MIN_GAIN = 1.1  # a plan that rounds activations narrower must be this much faster than the best exact one
NARROW_DTYPE = torch.bfloat16  # the 16-bit activations a W4A16 layer may take under a float32 plan


@dataclass(frozen=True)
class LayerKind:
    """What decides a linear's speed: family ("dense", "int4", "int", "fp8", "int-act", "micro", "ggml"), shape and scheme."""

    family: str
    out_features: int
    in_features: int
    scheme: str = ""  # the scheme's short form, and the stored scale dtype ("" for dense)

    def key(self) -> str:
        return f"{self.family} {self.out_features}x{self.in_features}" + (f" {self.scheme}" if self.scheme else "")


@dataclass(frozen=True)
class Route:
    """One way to run a layer kind: kernel "gemv" (dense), "int4-op", "native" (one token on the op's layout,
    `kernels.native`), "dequant" or "module", computing in
    `dtype`, its input arriving in `inputs` (the compute dtype; float32 for int4 activations narrowed to bf16)."""

    kernel: str
    dtype: torch.dtype
    inputs: Optional[torch.dtype] = None  # None: `dtype`

    @property
    def input_dtype(self) -> torch.dtype:
        return self.inputs or self.dtype

    def key(self) -> str:
        cast = f" from {_name(self.inputs)}" if self.inputs not in (None, self.dtype) else ""
        return f"{self.kernel} {_name(self.dtype)}{cast}"


@dataclass(frozen=True)
class Candidate:
    """A compute dtype, and the dtype W4A16 layers' activations reach the int4 op in (narrower: said)."""

    dtype: torch.dtype
    int4_dtype: torch.dtype

    @property
    def narrowed(self) -> bool:
        return self.int4_dtype != self.dtype

    def describe(self) -> str:
        return _name(self.dtype) + (f" (int4 layers' activations in {_name(self.int4_dtype)})" if self.narrowed else "")


@dataclass
class KindInfo:
    """How many layers of a kind the model has, and how to make one with `rows` outputs to time it."""

    count: int
    build: Callable[[int], nn.Module] = field(repr=False)


@dataclass
class DecodePlan:
    """The chosen candidate, every candidate's estimated one-token step (seconds in the linears), the
    one-token route of each kind under the choice, and the token counts up to which int4 kinds run the op."""

    choice: Candidate
    step_seconds: dict[Candidate, float]
    routes: dict[LayerKind, Route]
    op_tokens: dict[LayerKind, int]
    figures: dict[tuple[LayerKind, Route, int], float]  # every timing used, seconds per call
    counts: dict[LayerKind, int]

    def describe(self) -> str:
        """One line: what was chosen, and the figures that chose it."""
        figures = ", ".join(f"{c.describe()} {s * 1e3:.2f} ms" for c, s in
                            sorted(self.step_seconds.items(), key=lambda kv: kv[1]))
        return f"decode plan measured here, one token through the linears: {figures}"

    def table(self) -> list[str]:
        """A markdown table of every figure: kind, count, route, tokens, microseconds, chosen."""
        rows = ["| layer kind | count | route | tokens | us per call | used |", "| --- | --- | --- | --- | --- | --- |"]
        for (kind, route, tokens), seconds in sorted(self.figures.items(), key=lambda kv: (kv[0][0].key(), kv[0][2],
                                                                                            kv[0][1].key())):
            used = _used(self, kind, route, tokens)
            rows.append(f"| {kind.key()} | {self.counts[kind]} | {route.key()} | {tokens} | {seconds * 1e6:.0f} | "
                        f"{'yes' if used else ''} |")
        return rows


def _used(plan: DecodePlan, kind: LayerKind, route: Route, tokens: int) -> bool:
    if kind.family != "int4":
        return route == plan.routes.get(kind) and tokens == 1
    limit = plan.op_tokens.get(kind, 0)
    op, dequant = routes(kind, plan.choice)[:2]
    if route.kernel == "native" or (route == op and tokens == 1):  # one token: the op or the native GEMV
        return tokens == 1 and limit > 0 and route == plan.routes[kind]
    return (route == op and tokens <= limit) or (route == dequant and tokens > limit)


# -- the model's layer kinds ----------------------------------------------------------------------


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The layer kind of a linear module (None: not a linear this plan knows)."""
    if type(module) is nn.Linear:
        return LayerKind("dense", module.out_features, module.in_features)
    scheme = getattr(module, "scheme", None)
    scale = getattr(module, "weight_scale", None)
    if scheme is None or scale is None:
        return None
    detail = f"{scheme.short()} {_name(scale.dtype)} scales"
    if isinstance(module, PackedIntLinear):
        family = "int4" if cpu_int4.unsupported_reason(scheme.num_bits, module.in_features,
                                                       module.kernel_group_size) is None else "int"
    else:
        family = ("fp8" if isinstance(module, Fp8Linear) else "int-act" if isinstance(module, IntActLinear)
                  else "micro" if isinstance(module, MicroLinear) else "ggml")
    return LayerKind(family, module.out_features, module.in_features, detail)


def layer_kinds(modules: Iterable[nn.Module]) -> dict[LayerKind, KindInfo]:
    """The kinds among `modules` (a model's linears, quantized ones as they will be loaded), counted; each
    with a factory of a same-kind module of any number of rows (zero weights: speed does not depend on them)."""
    kinds: dict[LayerKind, KindInfo] = {}
    for module in modules:
        kind = kind_of(module)
        if kind is None:
            continue
        if kind in kinds:
            kinds[kind].count += 1
        else:
            kinds[kind] = KindInfo(1, _factory(module))
    return kinds


def _factory(module: nn.Module) -> Callable[[int], nn.Module]:
    if type(module) is nn.Linear:
        return lambda rows: nn.Linear(module.in_features, rows, bias=False)
    cls, scheme, scale_dtype = type(module), module.scheme, module.weight_scale.dtype
    return lambda rows: cls(module.in_features, rows, False, scheme, scale_dtype)


# -- candidates and routes -------------------------------------------------------------------------


def candidates(dtypes: Iterable[torch.dtype], kinds: Iterable[LayerKind], narrowing: bool = True) -> list[Candidate]:
    """Each dtype as is, and float32 with int4 activations narrowed (when allowed and the model has int4 kinds)."""
    out = [Candidate(d, d) for d in dtypes]
    if narrowing and torch.float32 in dtypes and any(k.family == "int4" for k in kinds):
        out.append(Candidate(torch.float32, NARROW_DTYPE))
    return out


def routes(kind: LayerKind, candidate: Candidate) -> list[Route]:
    """The routes a kind may take under `candidate`: each computes in its dtype (the int4 op in int4_dtype)."""
    if kind.family == "dense":
        return [Route("gemv", candidate.dtype)]
    if kind.family == "int4":
        ways = [Route("int4-op", candidate.int4_dtype, candidate.dtype), Route("dequant", candidate.dtype)]
        if candidate.int4_dtype == torch.bfloat16 and cpu_int4.native_reason() is None:
            ways.append(Route("native", torch.bfloat16, candidate.dtype))  # one token, on the op's own layout
        return ways
    return [Route("module", candidate.dtype)]


# -- timing -----------------------------------------------------------------------------------------

Timer = Callable[[LayerKind, KindInfo, Route, int], float]


def measure(kind: LayerKind, info: KindInfo, route: Route, tokens: int) -> float:
    """Seconds per call of `kind` run by `route` on `tokens` tokens: the median of REPEATS samples, each
    a pass over as many same-kind modules as the model has (COLD_BYTES of them at most), so that their
    weights come from memory as in a decode step, not from a cache one layer warmed (MAX_ROWS rows each
    at most, the time scaled to the kind's rows)."""
    rows = min(kind.out_features, MAX_ROWS)
    first = _runner(info.build(rows), route)
    copies = max(1, min(info.count, COLD_BYTES // max(first.nbytes, 1)))
    runners = [first] + [_runner(info.build(rows), route) for _ in range(copies - 1)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, kind.in_features, generator=g).to(route.input_dtype)

    def one_pass():
        for run in runners:
            run(x)

    with torch.no_grad():
        one_pass()  # warm up (repacks for the op)
        start = time.perf_counter()
        one_pass()
        once = max(time.perf_counter() - start, 1e-7)
        passes = max(1, min(50, int(SAMPLE_SECONDS / once)))
        samples = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            for _ in range(passes):
                one_pass()
            samples.append((time.perf_counter() - start) / (passes * copies))
    return statistics.median(samples) * kind.out_features / rows


@dataclass
class _Runner:
    """A callable that runs one synthetic layer by a route, and the bytes of weights it reads."""

    run: Callable[[torch.Tensor], torch.Tensor]
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _runner(module: nn.Module, route: Route) -> _Runner:
    from quantkit.runtime import lean_decode

    if route.kernel == "gemv":
        w = module.weight.detach().to(route.dtype)
        if lean_decode.column_major(w):
            w = w.t().contiguous().t()
        return _Runner(lambda x: lean_decode._linear(x, w, None) if x.shape[1] == 1 else F.linear(x, w),
                       w.numel() * w.element_size())
    if route.kernel in ("int4-op", "dequant", "native"):
        module.kernel_request = "torch" if route.kernel == "dequant" else "cpu"
        module.op_dtype = route.dtype
        module.op_tokens = 1 << 30
        module.one_token = "native" if route.kernel == "native" else "op"
    if isinstance(module, DenseCopy):
        module.keep_dense = True  # as `plan_dense_cache` lets a model that fits keep them
    return _Runner(module, sum(t.numel() * t.element_size() for t in module.state_dict().values()))


def _probe_key(kind: LayerKind, route: Route, tokens: int) -> str:
    """The cache key of one figure: a route through the native kernels carries their build (a changed kernel is
    timed again), a 16-bit dense GEMV the implementation the one-token probe chose for it."""
    uses_native = route.kernel == "native"
    if kind.family == "dense" and route.dtype in (torch.bfloat16, torch.float16) and tokens == 1:
        impl = compute.gemv_impl(route.dtype)
        uses_native = impl == compute.NATIVE_GEMV
        route_key = f"{route.key()} by {impl}"
    else:
        route_key = route.key()
    build = f"|native {native.build_id()}" if uses_native else ""
    return f"decode {kind.key()}|{route_key}|{tokens} tokens|{compute._machine_key()}{build}"


class Figures:
    """Timings of (kind, route, tokens), read from the probe cache or measured (and then cached)."""

    def __init__(self, kinds: dict[LayerKind, KindInfo], timer: Timer = measure, remeasure: bool = False,
                 cache_file=None):
        self.kinds, self.timer, self.remeasure, self.cache_file = kinds, timer, remeasure, cache_file
        self.known: dict[tuple[LayerKind, Route, int], float] = {}
        self._cached = {} if remeasure else compute.read_probe_cache(cache_file)
        self._new: dict[str, float] = {}

    def __call__(self, kind: LayerKind, route: Route, tokens: int) -> float:
        key = (kind, route, tokens)
        if key not in self.known:
            stored = self._cached.get(_probe_key(*key))
            if isinstance(stored, (int, float)) and not isinstance(stored, bool) and stored > 0:
                self.known[key] = float(stored)
            else:
                self.known[key] = self.timer(kind, self.kinds[kind], route, tokens)
                self._new[_probe_key(*key)] = self.known[key]
        return self.known[key]

    def save(self) -> None:
        if self._new:
            compute.write_probe_cache(self.cache_file, self._new)
            self._new = {}


# -- the choice ------------------------------------------------------------------------------------


def choose(kinds: dict[LayerKind, KindInfo], dtypes: Iterable[torch.dtype], narrowing: bool = True,
           timer: Timer = measure, remeasure: bool = False, cache_file=None) -> DecodePlan:
    """The plan for a model with `kinds`, among compute `dtypes` (each exact for the checkpoint; float32
    first), narrowed int4 activations allowed when `narrowing` (the dtype was not asked for)."""
    figures = Figures(kinds, timer, remeasure, cache_file)
    options = candidates(list(dtypes), kinds, narrowing)
    steps = {c: sum(info.count * min(figures(k, r, 1) for r in routes(k, c)) for k, info in kinds.items())
             for c in options}
    exact = min((c for c in options if not c.narrowed), key=steps.__getitem__)
    narrowed = [c for c in options if c.narrowed and steps[c] * NARROW_MIN_GAIN < steps[exact]]
    choice = min(narrowed, key=steps.__getitem__) if narrowed else exact
    chosen = {k: min(routes(k, choice), key=lambda r: figures(k, r, 1)) for k in kinds}
    op_tokens = {k: _op_tokens(k, choice, chosen[k], figures) for k in kinds if k.family == "int4"}
    figures.save()
    return DecodePlan(choice, steps, chosen, op_tokens, dict(figures.known), {k: i.count for k, i in kinds.items()})


def _op_tokens(kind: LayerKind, choice: Candidate, one_token: Route, figures: Figures) -> int:
    """Up to how many tokens an int4 kind runs the op: 0 when dequantizing wins at one token, else the largest
    prefill chunk at which the op still beats dequantizing (timing stops at the first chunk it loses)."""
    if one_token.kernel not in ("int4-op", "native"):
        return 0
    op, dequant = routes(kind, choice)[:2]
    limit = 1
    for tokens in CHUNK_TOKENS:
        if figures(kind, op, tokens) > figures(kind, dequant, tokens):
            break
        limit = tokens
    return limit


def apply(model: nn.Module, plan: DecodePlan) -> int:
    """Set every packed int4 linear of `model` to the plan's op dtype and token limit. Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, PackedIntLinear):
            kind = kind_of(module)
            if kind in plan.op_tokens:
                module.op_dtype = plan.choice.int4_dtype
                module.op_tokens = plan.op_tokens[kind]
                module.one_token = "native" if plan.routes[kind].kernel == "native" else "op"
                count += 1
    return count


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
