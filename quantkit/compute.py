"""The compute dtype: the float dtype matmuls run in, chosen by what the device computes fast.

A 16-bit dtype is chosen only where the device has it in hardware: CUDA devices with bf16 (fp16
on those without), CPUs whose torch build reports avx512_bf16 or AMX tiles, and, on CPUs torch
cannot tell about (not x86), a short matmul probe whose result is cached per machine. Otherwise
float32: on an AVX2-only CPU a bf16 matmul is emulated and ~100x slower than float32. Where the CPU
has the features but the environment keeps torch from them (`ATEN_CPU_CAPABILITY=avx2`, or
`ONEDNN_MAX_CPU_ISA` below bf16: oneDNN then runs a bf16 GEMM ~100x slower, as on an AVX2 CPU),
the probe decides too; that is also how an AVX2 machine is imitated on an AVX-512 one.

The choice never loses weight precision: a 16-bit compute dtype is taken only for a checkpoint
stored in a dtype it holds exactly (bf16 -> float32 is exact, float32 -> bf16 is not), so a
float32 checkpoint computes in float32. `QUANTKIT_COMPUTE_DTYPE`, or an explicit setting (a
recipe's `calibration.dtype`, a `--dtype` option), overrides the automatic choice.
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

from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)

ENV = "QUANTKIT_COMPUTE_DTYPE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
PROBE_FILE = "compute-probe.json"
PROBE_MIN_SPEEDUP = 1.5  # bf16 counts as fast when its matmul beats float32 by this factor
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

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"compute {self.name} on {self.device}: {self.reason}"

    def to_json(self) -> dict:
        return {"dtype": self.name, "device": self.device, "reason": self.reason, "source": self.source,
                "cpu_capability": cpu_features().capability}


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
            fast = (probe or probe_bf16_cached)()
            return ((torch.bfloat16,) if fast else ()), \
                f"{f.capability}, {which} limited by {f.limited_by}, bf16 matmul probe: {'fast' if fast else 'slow'}"
        return ((torch.bfloat16, torch.float16) if f.amx_fp16 else (torch.bfloat16,)), f"{f.capability} with {which}, fast bf16"
    if f.x86:
        return (), f"{f.capability}, no fast bf16"
    fast = (probe or probe_bf16_cached)()
    return ((torch.bfloat16,) if fast else ()), f"{f.capability}, bf16 matmul probe: {'fast' if fast else 'slow'}"


def choose(storage: torch.dtype, device: Union[str, torch.device] = "cpu", setting: Optional[str] = "auto",
           setting_name: str = "dtype", features: Optional[CpuFeatures] = None,
           probe: Optional[Callable[[], bool]] = None) -> ComputeChoice:
    """The compute dtype for a checkpoint stored in `storage` on `device`.

    Precedence: an explicit `setting` (named `setting_name` in messages), then QUANTKIT_COMPUTE_DTYPE,
    then the hardware's fast dtype among those holding `storage` exactly, else float32."""
    dev = str(torch.device(device))
    explicit = parse_dtype(setting or "auto", setting_name)
    if explicit is not None:
        return ComputeChoice(explicit, dev, f"{setting_name}={_name(explicit)}" + _rounding(explicit, storage), "setting")
    env = os.environ.get(ENV, "")
    from_env = parse_dtype(env, ENV)
    if from_env is not None:
        return ComputeChoice(from_env, dev, f"{ENV}={env.strip()}" + _rounding(from_env, storage), "env")
    fast, why = fast_16bit(device, features, probe)
    exact = EXACT_FOR.get(storage, (torch.float32,))
    for dtype in fast:
        if dtype in exact:
            return ComputeChoice(dtype, dev, why, "auto")
    if torch.device(device).type == "cuda" and fast and storage == torch.bfloat16:
        return ComputeChoice(fast[0], dev, why, "auto")  # bf16 weights are exact in fp16 but for subnormals
    if fast and storage == torch.float32:
        why = f"{why}; the checkpoint is float32 and 16 bits would round its weights"
    elif fast:
        why = f"{why}; the checkpoint is {_name(storage)}, which {_name(fast[0])} does not hold exactly"
    return ComputeChoice(torch.float32, dev, why, "auto")


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
    from quantkit.paths import cache_dir

    path = cache_file or cache_dir() / PROBE_FILE
    key = _machine_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), bool):
        return known[key]
    fast = probe_bf16(timer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: fast}, indent=2) + "\n")
    except OSError as exc:  # a read-only cache only costs a re-probe next time
        log.info("could not cache the bf16 probe in %s: %s", path, exc)
    return fast


def machine_summary() -> str:
    """One line for every benchmark figure: the CPU, what torch reports about it, threads."""
    f = cpu_features()
    flags = [n for n, ok in (("avx512_bf16", f.avx512_bf16), ("AMX", f.amx_tile), ("AMX-fp16", f.amx_fp16)) if ok]
    model = _machine_key().split("|")[1] or platform.machine()
    gpu = f"; CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    if f.limited_by:
        flags.append(f"limited by {f.limited_by}")
    return (f"cpu {model}, capability {f.capability}" + (f" ({', '.join(flags)})" if flags else "")
            + f", torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}")
