"""The compute dtype: the float dtype matmuls run in, chosen by what the device computes fast.

A 16-bit dtype is chosen only where the device computes it fast: CUDA devices with bf16 (fp16
on those without), CPUs whose torch build reports AMX tiles, and, on CPUs with avx512_bf16 but no
AMX or that torch cannot tell about (not x86), where a short matmul probe finds bf16 at least 1.5x
faster than float32 (cached per machine). avx512_bf16 alone is no promise: on an Intel Xeon with it
(and avx512_fp16) but no AMX, torch 2.13's bf16 GEMMs ran 1.8x *slower* than float32 (a 2048 x 512 x
512 product 7.3 vs 4.1 ms; a SmolLM2 layer forward 128 vs 80 ms), and GPTQ and AWQ took 1.2-1.3x
longer in bf16. Otherwise float32: on an AVX2-only CPU a bf16 matmul is emulated and ~100x slower
than float32. Where the CPU
has the features but the environment keeps torch from them (`ATEN_CPU_CAPABILITY=avx2`, or
`ONEDNN_MAX_CPU_ISA` below bf16: oneDNN then runs a bf16 GEMM ~100x slower, as on an AVX2 CPU),
the probe decides too; that is also how an AVX2 machine is imitated on an AVX-512 one.

A model loaded to generate (`workload="decode"`) spends its time on one-token linears, whose speed
in bf16 need not follow the GEMMs' (an AVX-512 Xeon without AMX: 1536 x 576 at one token 90 us in
bf16, 50 in float32): there the loader asks `runtime.decode_plan`, which times the model's own layer
kinds in each candidate dtype, instead of this module's GEMM-based answer.

The choice never loses weight precision: a 16-bit compute dtype is taken only for a checkpoint
stored in a dtype it holds exactly (bf16 -> float32 is exact, float32 -> bf16 is not), so a
float32 checkpoint computes in float32. `QUANTKIT_COMPUTE_DTYPE`, or an explicit setting (a
recipe's `calibration.dtype`, a `--dtype` option), overrides the automatic choice; a 16-bit dtype
so asked for on a CPU that does not compute it fast keeps its numbers but runs its matmuls on float32
GEMMs (`ComputeChoice.wide_matmuls`, `kernels.wide_matmul`). So does a 16-bit checkpoint that would
not fit in memory as float32 on a CPU slow in its dtype (a bf16 7B model, 14 GB, on a 24 GB AVX2
machine): computing in float32 would need 28 GB, or offloading to disk, where bf16 fits.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from quantkit.platform import allocator
from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)

ENV = "QUANTKIT_COMPUTE_DTYPE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PROBE_FILE = "compute-probe.json"
PROBE_MIN_SPEEDUP = 1.5  # bf16 counts as fast when its matmul beats float32 by this factor
WORKLOADS = ("batch", "decode")  # batch: GEMMs (calibration, eval); decode: one token at a time (the loader)
# one-token 16-bit linear on the CPU: F.linear or torch.mv (row-major weight), and those registered by the
# kernels that define them (`register_gemv`: quantkit's own bf16 GEMV, `kernels.native`)
GEMV_IMPLS = ("linear", "mv")
NATIVE_GEMV = "native"
GEMV_EXTRA: dict[str, tuple[Callable[[torch.dtype], bool], Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            Callable[[], str]]] = {}


def register_gemv(name: str, available: Callable[[torch.dtype], bool],
                  run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  version: Callable[[], str] = lambda: "") -> None:
    """Add a one-token implementation the GEMV probe times beside GEMV_IMPLS: available(dtype) says where it
    runs, run(weight [N, K], x [K]) -> [N] in x's dtype, version() names the build (part of the cache key, so a
    changed kernel is timed again). Kernels register themselves: platform imports none."""
    GEMV_EXTRA[name] = (available, run, version)
# dtypes that hold every value of a storage dtype exactly (float16 -> bfloat16 would drop 3 mantissa bits);
# bf16 -> fp16 keeps every bf16 weight of a normal model (8 of fp16's 11 mantissa bits, |w| < 65504)
EXACT_FOR = {
    torch.float32: (torch.float32,),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float16: (torch.float16, torch.float32),
}


class ComputeDtypeError(QuantkitError):
    """A compute dtype asked for by name (setting or environment) is not one quantkit knows."""


@dataclass(frozen=True)
class CpuFeatures:
    """What torch reports about this CPU (a value, so tests can describe any CPU)."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    x86: bool
    avx512_bf16: bool = False
    amx_tile: bool = False
    amx_fp16: bool = False
    limited_by: str = ""  # the environment that keeps torch below the CPU's features, in words ("" if none)


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which it still has bf16 GEMM kernels
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                     "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                     "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


def _environment_limits(capability: str) -> str:
    """What in the environment holds torch below the CPU's bf16 features, in words ("" if nothing)."""
    limits = []
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(var, "").strip()
        if value and value.upper() not in _ONEDNN_BF16_ISAS:
            limits.append(f"{var}={value}")
    if not capability.startswith("AVX512"):
        limits.append(f"torch dispatches {capability}"
                      + (f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})"
                         if os.environ.get("ATEN_CPU_CAPABILITY") else ""))
    return ", ".join(limits)


@functools.cache
def cpu_features() -> CpuFeatures:
    cpu = torch.cpu

    def flag(name: str) -> bool:
        fn = getattr(cpu, name, None)
        try:
            return bool(fn()) if callable(fn) else False
        except Exception:  # an old or unusual build: unknown counts as absent
            return False

    capability = torch.backends.cpu.get_cpu_capability()
    avx512_bf16, amx_tile = flag("_is_avx512_bf16_supported"), flag("_is_amx_tile_supported")
    return CpuFeatures(
        capability=capability,
        x86=platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"),
        avx512_bf16=avx512_bf16,
        amx_tile=amx_tile,
        amx_fp16=flag("_is_amx_fp16_supported"),
        limited_by=_environment_limits(capability) if (avx512_bf16 or amx_tile) else "",
    )


@dataclass(frozen=True)
class ComputeChoice:
    dtype: torch.dtype
    device: str  # "cpu", "cuda:0", ...
    reason: str  # why, in words: "AVX2, no fast bf16"
    source: str  # "auto", "env" (QUANTKIT_COMPUTE_DTYPE) or "setting"
    # a 16-bit dtype on a CPU that does not compute it fast (asked for, or a 16-bit model that would not fit
    # in memory as float32): its matmuls run as float32 GEMMs rounded back to it (`kernels.wide_matmul`)
    wide_matmuls: bool = False

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        wide = (f"; its matmuls run as float32 GEMMs rounded to {self.name} (this CPU's {self.name} GEMMs are slow)"
                if self.wide_matmuls else "")
        return f"compute {self.name} on {self.device}: {self.reason}{wide}"

    def to_json(self) -> dict:
        return {"dtype": self.name, "device": self.device, "reason": self.reason, "source": self.source,
                "wide_matmuls": self.wide_matmuls, "cpu_capability": cpu_features().capability}


def parse_dtype(name: str, where: str) -> Optional[torch.dtype]:
    """A dtype name (float32, bfloat16, float16, or bf16/fp16/fp32), or None for 'auto'."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key in ("", "auto"):
        return None
    if key not in DTYPES:
        raise ComputeDtypeError(f"{where}={name!r} is not a compute dtype; use auto, {', '.join(DTYPES)}")
    return DTYPES[key]


def fast_16bit(device: Union[str, torch.device], features: Optional[CpuFeatures] = None,
               probe: Optional[Callable[[], bool]] = None) -> tuple[tuple[torch.dtype, ...], str]:
    """The 16-bit dtypes `device` computes fast (best first), and why, in words."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return (torch.bfloat16, torch.float16), f"CUDA {torch.cuda.get_device_name(device)}, bf16 supported"
        return (torch.float16,), f"CUDA {torch.cuda.get_device_name(device)}, no bf16 (fp16 instead)"
    if device.type == "mps":
        return (torch.float16, torch.bfloat16), "Apple GPU (mps)"
    if device.type != "cpu":
        return (), f"{device.type}: no known fast 16-bit dtype"
    f = features or cpu_features()
    if f.avx512_bf16 or f.amx_tile:
        which = " and ".join(n for n, ok in (("avx512_bf16", f.avx512_bf16), ("AMX", f.amx_tile)) if ok)
        if f.limited_by:  # the CPU has them, torch may not use them: measure
            return _probed(f"{f.capability}, {which} limited by {f.limited_by}", probe)
        if not f.amx_tile:  # avx512_bf16 alone has been both: measure
            return _probed(f"{f.capability} with avx512_bf16 but no AMX", probe)
        return ((torch.bfloat16, torch.float16) if f.amx_fp16 else (torch.bfloat16,)), f"{f.capability} with {which}, fast bf16"
    if f.x86:
        return (), f"{f.capability}, no fast bf16"
    return _probed(f.capability, probe)


def _probed(why: str, probe: Optional[Callable[[], bool]]) -> tuple[tuple[torch.dtype, ...], str]:
    """bf16 if the (cached) matmul probe finds it fast, and why, in words."""
    fast = (probe or probe_bf16_cached)()
    return ((torch.bfloat16,) if fast else ()), f"{why}, bf16 matmul probe: {'fast' if fast else 'slow'}"


def choose(storage: torch.dtype, device: Union[str, torch.device] = "cpu", setting: Optional[str] = "auto",
           setting_name: str = "dtype", features: Optional[CpuFeatures] = None,
           probe: Optional[Callable[[], bool]] = None,
           float32_fits: Optional[Callable[[], bool]] = None) -> ComputeChoice:
    """The compute dtype for a checkpoint stored in `storage` on `device`.

    Precedence: an explicit `setting` (named `setting_name` in messages), then QUANTKIT_COMPUTE_DTYPE,
    then the hardware's fast dtype among those holding `storage` exactly, else float32.

    This is the answer for GEMMs (calibration, eval); a model loaded to decode on a CPU is planned by
    `runtime.decode_plan` among the dtypes `exact_dtypes` names. Where no fast 16-bit dtype holds the
    checkpoint, `float32_fits()` (CPU) keeps a 16-bit checkpoint in its own dtype when float32 would not
    fit, its GEMMs widened where the CPU is slow in it."""
    dev = str(torch.device(device))
    explicit = parse_dtype(setting or "auto", setting_name)
    if explicit is not None:
        return asked_for(explicit, storage, device, f"{setting_name}={_name(explicit)}", "setting", features, probe)
    env = os.environ.get(ENV, "")
    from_env = parse_dtype(env, ENV)
    if from_env is not None:
        return asked_for(from_env, storage, device, f"{ENV}={env.strip()}", "env", features, probe)
    fast, why = fast_16bit(device, features, probe)
    exact = EXACT_FOR.get(storage, (torch.float32,))
    for dtype in fast:
        if dtype in exact:
            return ComputeChoice(dtype, dev, why, "auto")
    if torch.device(device).type == "cuda" and fast and storage == torch.bfloat16:
        return ComputeChoice(fast[0], dev, why, "auto")  # bf16 weights are exact in fp16 but for subnormals
    if (storage in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"
            and float32_fits is not None and not float32_fits()):
        # float32 would double a model that fits only as stored: keep its dtype, and where the CPU is slow in it,
        # run its GEMMs widened (float32 speed, 16-bit memory); one-token steps stay native (a GEMV widened
        # converts the whole weight per token: measured several times slower than native)
        return ComputeChoice(storage, dev, f"{why}, but the model would not fit in memory in float32: computing in "
                                           f"{_name(storage)}, as stored", "auto",
                             wide_matmuls=storage not in fast)
    if fast and storage == torch.float32:
        why = f"{why}; the checkpoint is float32 and 16 bits would round its weights"
    elif fast:
        why = f"{why}; the checkpoint is {_name(storage)}, which {_name(fast[0])} does not hold exactly"
    return ComputeChoice(torch.float32, dev, why, "auto")


def asked_for(dtype: torch.dtype, storage: torch.dtype, device: Union[str, torch.device], why: str, source: str,
              features: Optional[CpuFeatures] = None, probe: Optional[Callable[[], bool]] = None) -> ComputeChoice:
    """The choice of a dtype named by the user (`why` says where): taken as asked; on a CPU that does not
    compute it fast, a 16-bit dtype keeps its numbers but runs its matmuls on float32 GEMMs."""
    return ComputeChoice(dtype, str(torch.device(device)), why + _rounding(dtype, storage), source,
                         wide_matmuls=needs_wide_matmuls(dtype, device, features, probe))


def needs_wide_matmuls(dtype: torch.dtype, device: Union[str, torch.device], features: Optional[CpuFeatures] = None,
                       probe: Optional[Callable[[], bool]] = None) -> bool:
    """Whether `dtype`'s matmuls should run as float32 GEMMs: a 16-bit dtype on a CPU not fast in it."""
    if dtype == torch.float32 or torch.device(device).type != "cpu":
        return False
    return dtype not in fast_16bit(device, features, probe)[0]


def exact_dtypes(storage: torch.dtype) -> tuple[torch.dtype, ...]:
    """The compute dtypes that hold a checkpoint stored in `storage` exactly, float32 first."""
    return (torch.float32,) + ((storage,) if storage in (torch.bfloat16, torch.float16) else ())


def holds_exactly(compute: torch.dtype, storage: torch.dtype) -> bool:
    """Whether every value of a checkpoint stored in `storage` survives the cast to `compute`."""
    return compute in EXACT_FOR.get(storage, (torch.float32,))


def _rounding(compute: torch.dtype, storage: torch.dtype) -> str:
    """What a compute dtype asked for costs when it is narrower than the checkpoint (said with the choice)."""
    if holds_exactly(compute, storage):
        return ""
    return (f"; narrower than the checkpoint's {_name(storage)}: calibration sees its weights rounded to "
            f"{_name(compute)}, and the tensors left unquantized are written as stored")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the probe (CPUs torch cannot describe) -----------------------------------------------------


def _machine_key() -> str:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu part", "hardware")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    limits = "".join(f"|{var}={os.environ[var]}" for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                              "DNNL_MAX_CPU_ISA") if os.environ.get(var))
    return f"{platform.machine()}|{model}|torch {torch.__version__}{limits}"


def _matmul_seconds(dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    a, b = torch.randn(n // 2, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return best


def probe_bf16(timer: Callable[[torch.dtype], float] = _matmul_seconds) -> bool:
    """Whether a bf16 matmul beats float32 by PROBE_MIN_SPEEDUP here (about 50 ms)."""
    speedup = timer(torch.float32) / max(timer(torch.bfloat16), 1e-12)
    log.info("bf16 matmul probe: %.2fx float32", speedup)
    return speedup >= PROBE_MIN_SPEEDUP


def probe_bf16_cached(cache_file: Optional[Path] = None, timer: Callable[[torch.dtype], float] = _matmul_seconds) -> bool:
    """`probe_bf16`, run once per machine (CPU model and torch version) and kept in the cache."""
    key = _machine_key()
    known = _read_probe_cache(cache_file)
    if isinstance(known.get(key), bool):
        return known[key]
    fast = probe_bf16(timer)
    _write_probe_cache(cache_file, key, fast)
    return fast


# -- the one-token (GEMV) probe, for decode ------------------------------------------------------

GEMV_SHAPES = ((1536, 576), (576, 1536), (2048, 2048), (4096, 4096))  # [out, in]: small and 8B-sized layers


def _gemv_seconds(dtype: torch.dtype, impl: str, shape: tuple[int, int], reps: int = 20) -> float:
    """Best time of one one-token linear of `shape` in `dtype` by `impl`: float32 as the lean decode step
    keeps it (column-major), 16 bits through F.linear, torch.mv or a registered GEMV on a row-major weight."""
    import torch.nn.functional as F

    out, inp = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g).to(dtype)
    x = torch.randn(1, inp, generator=g).to(dtype)
    if dtype == torch.float32:
        w = w.t().contiguous().t()
    if impl in GEMV_EXTRA:
        run = GEMV_EXTRA[impl][1]
        fn = lambda: run(w, x[0])  # noqa: E731
    else:
        fn = (lambda: torch.mv(w, x[0])) if impl == "mv" else (lambda: F.linear(x, w))
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def gemv_impls(dtype: torch.dtype) -> tuple[str, ...]:
    """The one-token implementations the probe times for `dtype`: GEMV_IMPLS and the registered ones that run it."""
    return GEMV_IMPLS + tuple(name for name, (available, _, _) in GEMV_EXTRA.items() if available(dtype))


def gemv_timings(dtype: torch.dtype, shapes=GEMV_SHAPES,
                 timer: Callable[[torch.dtype, str, tuple[int, int]], float] = _gemv_seconds,
                 impls: Optional[tuple[str, ...]] = None) -> dict[str, float]:
    """Seconds summed over `shapes` for a one-token linear: "float32", and `dtype` by each of `impls`
    (default `gemv_impls`; well under a second in all)."""
    result = {"float32": sum(timer(torch.float32, "linear", s) for s in shapes)}
    for impl in impls or gemv_impls(dtype):
        result[impl] = sum(timer(dtype, impl, s) for s in shapes)
    log.info("one-token linear probe (%s): %s", _name(dtype),
             ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in result.items()))
    return result


def gemv_timings_cached(dtype: torch.dtype, cache_file: Optional[Path] = None,
                        timer: Callable[[torch.dtype, str, tuple[int, int]], float] = _gemv_seconds) -> dict[str, float]:
    """`gemv_timings` at GEMV_SHAPES, measured once per machine (CPU model, torch version) and dtype
    and kept in the probe cache, so the decode dtype and kernel choices stay the same from run to run (an
    entry without a figure for every implementation available now is measured again)."""
    impls = gemv_impls(dtype)
    builds = "".join(f"|{name} {GEMV_EXTRA[name][2]()}" for name in impls if name in GEMV_EXTRA)
    key = f"gemv {_name(dtype)}|{_machine_key()}{builds}"
    known = _read_probe_cache(cache_file)
    value = known.get(key)
    if isinstance(value, dict) and all(isinstance(value.get(k), (int, float)) and value[k] > 0
                                       for k in ("float32", *impls)):
        return {k: float(value[k]) for k in ("float32", *impls)}
    timings = gemv_timings(dtype, timer=timer, impls=impls)
    _write_probe_cache(cache_file, key, timings)
    return timings


@functools.lru_cache(maxsize=None)
def gemv_impl(dtype: torch.dtype) -> str:
    """How the lean decode step runs a one-token `dtype` linear on this CPU: "mv", "linear" or "native",
    whichever the cached probe found fastest (an AVX512+AMX Xeon: torch.mv 1.7-2.3x faster than F.linear in
    bf16; an AVX-512 Xeon without AMX: F.linear 2.8x faster than torch.mv; an AVX-512 EPYC with avx512_bf16:
    the native GEMV 3-4x faster than F.linear on SmolLM2's layers, 2x on its head)."""
    t = gemv_timings_cached(dtype)
    return min(t.keys() - {"float32"}, key=lambda impl: t[impl])


def cached_timings(name: str, timers: dict[str, Callable[[], float]], cache_file: Optional[Path] = None) -> dict[str, float]:
    """Seconds of each way of doing one thing (`timers`: way -> a function that times it), measured once per
    machine under `name` (which should name the dtype and any build) and kept in the probe cache; an entry
    without a figure for every way is measured again."""
    key = f"{name}|{_machine_key()}"
    known = _read_probe_cache(cache_file).get(key)
    if isinstance(known, dict) and all(isinstance(known.get(w), (int, float)) and known[w] > 0 for w in timers):
        return {w: float(known[w]) for w in timers}
    figures = {w: timer() for w, timer in timers.items()}
    _write_probe_cache(cache_file, key, figures)
    return figures


def read_probe_cache(cache_file: Optional[Path] = None) -> dict:
    """Every cached probe figure (an empty dict when there is no cache or it cannot be read)."""
    return _read_probe_cache(cache_file)


def write_probe_cache(cache_file: Optional[Path], entries: dict) -> None:
    """Add `entries` to the probe cache (one rename: readers see the old file or the new one)."""
    _write_probe_entries(cache_file, entries)


def _probe_cache_path(cache_file: Optional[Path]) -> Path:
    from quantkit.platform.paths import cache_dir

    return cache_file or cache_dir() / PROBE_FILE


def _read_probe_cache(cache_file: Optional[Path]) -> dict:
    try:
        known = json.loads(_probe_cache_path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_probe_cache(cache_file: Optional[Path], key: str, value) -> None:
    _write_probe_entries(cache_file, {key: value})


def _write_probe_entries(cache_file: Optional[Path], entries: dict) -> None:
    path = _probe_cache_path(cache_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a whole file or none: written beside it and renamed, so a process reading it meanwhile (another job,
        # another test worker) never sees half of it
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read_probe_cache(cache_file), **entries}, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache only costs a re-probe next time
        log.info("could not cache a probe in %s: %s", path, exc)


def machine_summary() -> str:
    """One line for every benchmark figure: the CPU, what torch reports about it, threads."""
    f = cpu_features()
    flags = [n for n, ok in (("avx512_bf16", f.avx512_bf16), ("AMX", f.amx_tile), ("AMX-fp16", f.amx_fp16)) if ok]
    model = _machine_key().split("|")[1] or platform.machine()
    gpu = f"; CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    if f.limited_by:
        flags.append(f"limited by {f.limited_by}")
    return (f"cpu {model}, capability {f.capability}" + (f" ({', '.join(flags)})" if flags else "")
            + f", torch {torch.__version__}, {torch.get_num_threads()} threads, {allocator.state()}{gpu}")
