"""The compute-dtype policy (`quantkit.platform.compute`) for each CPU torch can report, CUDA, and the overrides."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.platform import compute
from quantkit.platform.compute import ComputeDtypeError, CpuFeatures, choose

AVX2 = CpuFeatures("AVX2", x86=True)
AVX512 = CpuFeatures("AVX512", x86=True)
AVX512_BF16 = CpuFeatures("AVX512", x86=True, avx512_bf16=True)
AMX = CpuFeatures("AVX512", x86=True, avx512_bf16=True, amx_tile=True)
AMX_FP16 = CpuFeatures("AVX512", x86=True, avx512_bf16=True, amx_tile=True, amx_fp16=True)
ARM = CpuFeatures("DEFAULT", x86=False)


def _never_probe():
    raise AssertionError("the probe must not run where torch reports the CPU's features")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(compute.ENV, raising=False)


@pytest.mark.parametrize("features, storage, expected, words", [
    (AVX2, torch.bfloat16, torch.float32, "AVX2, no fast bf16"),
    (AVX512, torch.bfloat16, torch.float32, "AVX512, no fast bf16"),
    (AMX, torch.bfloat16, torch.bfloat16, "AMX"),
    (AVX2, torch.float16, torch.float32, "no fast bf16"),
    (AMX, torch.float16, torch.float32, "does not hold exactly"),  # fp16 -> bf16 would round weights
    (AMX_FP16, torch.float16, torch.float16, "AMX"),
    (AMX, torch.float32, torch.float32, "would round its weights"),
    (AVX2, torch.float32, torch.float32, "no fast bf16"),
])
def test_cpu_policy(features, storage, expected, words):
    choice = choose(storage, "cpu", features=features, probe=_never_probe)
    assert choice.dtype == expected
    assert words in choice.reason
    assert choice.source == "auto"


def test_the_message_names_dtype_device_and_reason():
    choice = choose(torch.bfloat16, "cpu", features=AVX2, probe=_never_probe)
    assert choice.describe() == "compute float32 on cpu: AVX2, no fast bf16"
    assert choice.to_json()["dtype"] == "float32" and choice.to_json()["device"] == "cpu"


@pytest.mark.parametrize("fast, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_avx512_bf16_without_amx_is_measured(fast, expected):
    # an Intel Xeon with avx512_bf16 and avx512_fp16 but no AMX ran torch's bf16 GEMMs 1.8x slower than
    # float32: the flag alone is no promise, the cached probe decides
    calls = []
    choice = choose(torch.bfloat16, "cpu", features=AVX512_BF16, probe=lambda: calls.append(1) or fast)
    assert choice.dtype == expected and calls == [1]
    assert f"AVX512 with avx512_bf16 but no AMX, bf16 matmul probe: {'fast' if fast else 'slow'}" in choice.reason


@pytest.mark.parametrize("fast, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_unknown_cpus_use_the_probe(fast, expected):
    calls = []
    choice = choose(torch.bfloat16, "cpu", features=ARM, probe=lambda: calls.append(1) or fast)
    assert choice.dtype == expected and calls == [1]
    assert "probe" in choice.reason


@pytest.mark.parametrize("bf16, storage, expected", [
    (True, torch.bfloat16, torch.bfloat16),
    (False, torch.bfloat16, torch.float16),  # no bf16 on the device: fp16
    (True, torch.float16, torch.float16),
    (False, torch.float16, torch.float16),
    (True, torch.float32, torch.float32),
])
def test_cuda_policy(monkeypatch, bf16, storage, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    assert choose(storage, "cuda:0").dtype == expected


def test_overrides_environment_then_setting(monkeypatch):
    monkeypatch.setenv(compute.ENV, "float32")
    env = choose(torch.bfloat16, "cpu", features=AMX, probe=_never_probe)
    assert env.dtype == torch.float32 and env.source == "env" and compute.ENV in env.reason
    # an explicit setting (a recipe's calibration.dtype, --dtype) is more specific than the environment
    setting = choose(torch.bfloat16, "cpu", "bf16", "calibration.dtype", features=AVX2, probe=_never_probe)
    assert setting.dtype == torch.bfloat16 and setting.source == "setting"
    assert "calibration.dtype=bfloat16" in setting.reason
    monkeypatch.setenv(compute.ENV, "auto")
    assert choose(torch.bfloat16, "cpu", features=AVX2, probe=_never_probe).source == "auto"


@pytest.mark.parametrize("storage, asked, rounds", [
    (torch.float32, "bfloat16", True), (torch.float32, "float16", True), (torch.bfloat16, "float16", True),
    (torch.float16, "bfloat16", True), (torch.bfloat16, "float32", False), (torch.bfloat16, "bfloat16", False),
    (torch.float32, "float32", False),
])
@pytest.mark.parametrize("how", ["env", "setting"])
def test_a_dtype_asked_for_that_rounds_the_weights_says_so(monkeypatch, storage, asked, rounds, how):
    if how == "env":
        monkeypatch.setenv(compute.ENV, asked)
    got = choose(storage, "cpu", asked if how == "setting" else "auto", "calibration.dtype", features=AMX,
                 probe=_never_probe)
    assert got.name == asked and compute.holds_exactly(got.dtype, storage) is not rounds
    said = f"narrower than the checkpoint's {str(storage).removeprefix('torch.')}: calibration sees its weights rounded"
    assert (said in got.describe()) is rounds


@pytest.mark.parametrize("where, value", [("env", "int8"), ("setting", "double")])
def test_unknown_names_are_errors(monkeypatch, where, value):
    if where == "env":
        monkeypatch.setenv(compute.ENV, value)
    with pytest.raises(ComputeDtypeError, match=f"{value!r} is not a compute dtype; use auto, float32"):
        choose(torch.bfloat16, "cpu", value if where == "setting" else "auto", features=AVX2, probe=_never_probe)


def test_probe_is_cached_per_machine(tmp_path):
    cache = tmp_path / "probe.json"
    seconds = {torch.float32: 4.0, torch.bfloat16: 1.0}
    timed = []

    def timer(dtype):
        timed.append(dtype)
        return seconds[dtype]

    assert compute.probe_bf16_cached(cache, timer) is True
    assert len(timed) == 2
    assert compute.probe_bf16_cached(cache, timer) is True and len(timed) == 2  # read back, not re-measured
    assert list(json.loads(cache.read_text()).values()) == [True]
    assert compute.probe_bf16(lambda d: {torch.float32: 1.0, torch.bfloat16: 1.2}[d]) is False  # slower bf16
    assert compute.probe_bf16(lambda d: {torch.float32: 1.0, torch.bfloat16: 0.9}[d]) is False  # 1.1x: not enough


def test_this_machine_gets_a_consistent_answer(monkeypatch):
    """What the policy says here follows from what torch reports (no hard-wired dtype)."""
    f = compute.cpu_features()
    choice = choose(torch.bfloat16, "cpu")
    if f.amx_tile and not f.limited_by:
        assert choice.dtype == torch.bfloat16
    elif f.avx512_bf16 or f.limited_by:  # avx512_bf16 without AMX, or features held back: the probe decides
        assert "probe" in choice.reason
    elif f.x86:
        assert choice.dtype == torch.float32
    assert f.capability in compute.machine_summary()


def test_load_uses_the_policy_and_records_it(tiny_llama, monkeypatch):
    from quantkit.checkpoints.loader import load

    monkeypatch.setenv(compute.ENV, "float32")
    model = load(tiny_llama)  # a bf16 checkpoint
    assert model.quantkit_compute.dtype == torch.float32 and model.dtype == torch.float32
    monkeypatch.setenv(compute.ENV, "bfloat16")
    assert load(tiny_llama).dtype == torch.bfloat16
    assert load(tiny_llama, dtype=torch.float32).dtype == torch.float32  # an explicit dtype wins


def test_quantize_records_the_choice(tiny_llama, tmp_path, monkeypatch):
    import json

    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    monkeypatch.setenv(compute.ENV, "float32")
    lines = []
    report = quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
                      progress=False, notify=lines.append)
    assert "compute float32 on cpu: QUANTKIT_COMPUTE_DTYPE=float32" in lines
    meta = json.loads((report.output / "quantkit.json").read_text())
    assert meta["compute"]["dtype"] == "float32" and meta["compute"]["source"] == "env"
    assert meta["compute"]["cpu_capability"] == compute.cpu_features().capability


LIMITED = CpuFeatures("AVX2", x86=True, avx512_bf16=True, amx_tile=True,
                      limited_by="ONEDNN_MAX_CPU_ISA=AVX2, torch dispatches AVX2")


@pytest.mark.parametrize("fast, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_features_the_environment_holds_back_are_measured(fast, expected):
    # the CPU has avx512_bf16 and AMX but oneDNN / torch's dispatch are capped below them (how an AVX2
    # machine is imitated on an AVX-512 one): the flags alone would choose a bf16 that runs ~100x slower
    calls = []
    choice = choose(torch.bfloat16, "cpu", features=LIMITED, probe=lambda: calls.append(1) or fast)
    assert choice.dtype == expected and calls == [1]
    assert "limited by ONEDNN_MAX_CPU_ISA=AVX2" in choice.reason and "probe" in choice.reason


@pytest.mark.parametrize("env, capability, expected", [
    ({}, "AVX512", ""),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX512", "ONEDNN_MAX_CPU_ISA=AVX2"),
    ({"DNNL_MAX_CPU_ISA": "avx512_core"}, "AVX512", "DNNL_MAX_CPU_ISA=avx512_core"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "AVX512", ""),  # still has bf16 GEMMs
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2", "torch dispatches AVX2 (ATEN_CPU_CAPABILITY=avx2)"),
    ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX2",
     "ONEDNN_MAX_CPU_ISA=AVX2, torch dispatches AVX2 (ATEN_CPU_CAPABILITY=avx2)"),
])
def test_environment_limits_are_read_from_the_variables(monkeypatch, env, capability, expected):
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert compute._environment_limits(capability) == expected


def test_the_probe_cache_keeps_limited_environments_apart(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = compute._machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert compute._machine_key() == plain + "|ONEDNN_MAX_CPU_ISA=AVX2"


# -- the decode workload: one token at a time ----------------------------------------------------


def test_an_unknown_workload_is_an_error(tiny_llama):
    from quantkit.checkpoints.loader import load

    with pytest.raises(ValueError, match="workload 'train': use one of batch, decode"):
        load(tiny_llama, workload="train")


def test_the_one_token_probe_is_cached_per_machine_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(compute, "GEMV_EXTRA", {})  # F.linear and mv only
    cache = tmp_path / "probe.json"
    seconds = {(torch.float32, "linear"): 1.0, (torch.bfloat16, "linear"): 2.0, (torch.bfloat16, "mv"): 4.0,
               (torch.float16, "linear"): 3.0, (torch.float16, "mv"): 3.0}
    timed = []

    def timer(dtype, impl, shape):
        timed.append((dtype, impl, shape))
        return seconds[dtype, impl] * shape[0] * shape[1] / 1e6

    first = compute.gemv_timings_cached(torch.bfloat16, cache, timer)
    n = len(timed)
    assert n == 3 * len(compute.GEMV_SHAPES)  # float32, and bf16 by both implementations, at every shape
    assert compute.gemv_timings_cached(torch.bfloat16, cache, timer) == first and len(timed) == n  # read back
    total = sum(a * b for a, b in compute.GEMV_SHAPES) / 1e6
    assert first == pytest.approx({"float32": total, "linear": 2 * total, "mv": 4 * total})
    (key,) = json.loads(cache.read_text())
    assert key == f"gemv bfloat16|{compute._machine_key()}"
    compute.gemv_timings_cached(torch.float16, cache, timer)  # another dtype: measured apart
    assert len(timed) == 2 * n and len(json.loads(cache.read_text())) == 2


def test_a_damaged_probe_entry_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(compute, "GEMV_EXTRA", {})
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({f"gemv bfloat16|{compute._machine_key()}": {"float32": "fast"}}))
    got = compute.gemv_timings_cached(torch.bfloat16, cache, lambda d, impl, shape: 1e-3)
    assert got == pytest.approx({"float32": 4e-3, "linear": 4e-3, "mv": 4e-3})


def test_the_native_gemv_is_timed_where_it_runs_and_chosen_when_fastest(tmp_path, monkeypatch):
    from quantkit.kernels import native

    available = {"on": True}
    build = {"id": "a"}
    monkeypatch.setattr(compute, "GEMV_EXTRA", {"native": (lambda d: available["on"] and d == torch.bfloat16,
                                                            native.gemv_bf16, lambda: build["id"])})
    assert compute.NATIVE_GEMV == "native"
    seconds = {"linear": 2.0, "mv": 3.0, "native": 1.0}
    got = compute.gemv_timings_cached(torch.bfloat16, tmp_path / "probe.json",
                                      lambda d, impl, shape: 5.0 if d == torch.float32 else seconds[impl])
    assert set(got) == {"float32", "linear", "mv", "native"} and min(got, key=got.get) == "native"
    fp16 = compute.gemv_timings_cached(torch.float16, tmp_path / "probe.json", lambda d, impl, shape: 1.0)
    assert set(fp16) == {"float32", "linear", "mv"}  # the native GEMV is bf16 only
    # a cache entry made before the native GEMV existed (no figure for it) is measured again
    available["on"] = False
    cache = tmp_path / "old.json"
    compute.gemv_timings_cached(torch.bfloat16, cache, lambda d, impl, shape: 1.0)
    available["on"] = True
    timed = []
    again = compute.gemv_timings_cached(torch.bfloat16, cache, lambda d, impl, shape: timed.append(impl) or 1.0)
    assert "native" in again and "native" in timed
    timed.clear()
    compute.gemv_timings_cached(torch.bfloat16, cache, lambda d, impl, shape: timed.append(impl) or 1.0)
    assert not timed  # known
    build["id"] = "b"  # the native kernel changed: timed again
    compute.gemv_timings_cached(torch.bfloat16, cache, lambda d, impl, shape: timed.append(impl) or 1.0)
    assert "native" in timed


@pytest.mark.parametrize("impl", ["mv", "linear", "native"])
def test_the_lean_step_runs_16_bit_gemvs_by_the_probed_implementation(monkeypatch, impl):
    from quantkit.runtime import lean_decode

    monkeypatch.setattr(compute, "gemv_impl", lambda dtype: impl)
    calls = []
    real_mv = torch.mv
    monkeypatch.setattr(torch, "mv", lambda *a: calls.append(1) or real_mv(*a))
    g = torch.Generator().manual_seed(0)
    w, x, b = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((48, 32), (1, 1, 32), (48,)))
    native_calls = []
    monkeypatch.setattr(lean_decode.native, "gemv_bf16", lambda w, v: native_calls.append(1) or torch.mv(w, v))
    y = lean_decode._linear(x, w, b)
    assert y.shape == (1, 1, 48) and bool(calls) is (impl != "linear") and bool(native_calls) is (impl == "native")
    reference = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert (y.float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_float32_fit_is_judged_from_the_headers(tiny_llama, monkeypatch):
    from quantkit.checkpoints import loader
    from quantkit.platform import memory
    from quantkit.formats.lazy import LazyCheckpoint

    floats = sum(n for n in (_numel(LazyCheckpoint(tiny_llama).info(k)[1]) for k in LazyCheckpoint(tiny_llama).keys()))
    monkeypatch.setattr(memory, "available_memory", lambda: int(floats * 4 / 0.8) + 16)
    assert loader._fits_in_float32(tiny_llama) is True
    monkeypatch.setattr(memory, "available_memory", lambda: int(floats * 4 / 0.8) - 16)
    assert loader._fits_in_float32(tiny_llama) is False


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- a 16-bit model that fits in memory only as stored ---------------------------------------------


def test_a_16_bit_model_too_large_for_float32_stays_16_bit_where_the_cpu_is_slow_in_it():
    def avx2(**kw):
        return choose(kw.pop("storage", torch.bfloat16), "cpu", features=AVX2, probe=_never_probe, **kw)

    kept = avx2(float32_fits=lambda: False)
    assert kept.dtype == torch.bfloat16 and kept.wide_matmuls and kept.source == "auto"
    assert "AVX2, no fast bf16, but the model would not fit in memory in float32: computing in bfloat16" in kept.reason
    assert "its matmuls run as float32 GEMMs rounded to bfloat16" in kept.describe()
    fp16 = avx2(storage=torch.float16, float32_fits=lambda: False)
    assert fp16.dtype == torch.float16 and fp16.wide_matmuls
    for fits in (lambda: True, None):  # it fits, or nobody asked: float32 as before
        assert avx2(float32_fits=fits).dtype == torch.float32
    # a float32 checkpoint is never narrowed; an AMX CPU keeps fp16 weights in fp16 (not exact in its fast bf16),
    # widened since its fp16 GEMMs are not the fast ones
    assert avx2(storage=torch.float32, float32_fits=lambda: False).dtype == torch.float32
    amx = choose(torch.float16, "cpu", features=AMX, probe=_never_probe, float32_fits=lambda: False)
    assert amx.dtype == torch.float16 and amx.wide_matmuls


def test_the_loader_keeps_a_model_16_bit_that_fits_only_as_stored(tiny_llama, monkeypatch):
    from quantkit.checkpoints import loader
    from quantkit.platform import memory
    from quantkit.formats.lazy import LazyCheckpoint

    ckpt = LazyCheckpoint(tiny_llama)
    floats = sum(_numel(ckpt.info(k)[1]) for k in ckpt.keys())
    monkeypatch.setattr(compute, "cpu_features", lambda: AVX2)
    monkeypatch.setattr(memory, "available_memory", lambda: int(floats * 3 / 0.8))  # bf16 fits, float32 does not
    for workload in ("batch", "decode"):
        model = loader.load(tiny_llama, workload=workload)
        assert model.dtype == torch.bfloat16 and model.quantkit_compute.wide_matmuls
        assert "forward" in vars(model)  # its GEMMs widened
        assert not model.quantkit_offload.offloaded
    # offloaded to disk, one layer at a time: float32 fits, and is the fast choice here
    assert loader.load(tiny_llama, offload="disk").dtype == torch.float32
    monkeypatch.setattr(memory, "available_memory", lambda: int(floats * 4 / 0.8) + 16)
    assert loader.load(tiny_llama).dtype == torch.float32


def test_cached_timings_measure_once_per_name_and_again_when_a_way_is_missing(tmp_path):
    cache, calls = tmp_path / "probe.json", []

    def timer(value):
        return lambda: calls.append(value) or value

    first = compute.cached_timings("thing bf16|build 1", {"a": timer(2.0), "b": timer(1.0)}, cache)
    assert first == {"a": 2.0, "b": 1.0} and len(calls) == 2
    assert compute.cached_timings("thing bf16|build 1", {"a": timer(9.0), "b": timer(9.0)}, cache) == first
    assert len(calls) == 2  # read back
    compute.cached_timings("thing bf16|build 2", {"a": timer(3.0), "b": timer(3.0)}, cache)  # another build
    compute.cached_timings("thing bf16|build 1", {"a": timer(4.0), "b": timer(4.0), "c": timer(4.0)}, cache)
    assert len(calls) == 7  # a way the entry lacks: every way measured again
