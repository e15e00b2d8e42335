"""quantkit's own one-token CPU kernels (kernels/native_cpu.cpp) against float references and torch's int4 op."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from quantkit.kernels import cpu_int4, native
from quantkit.quant.schemes import QuantScheme
from quantkit.qmodules.int_linear import PackedIntLinear

needs_native = pytest.mark.skipif(native.module() is None, reason=f"native kernels not built: {native.reason()}")
needs_int4 = pytest.mark.skipif(native.module() is None or cpu_int4.native_reason() is not None,
                                reason=f"no native int4 GEMV here: {cpu_int4.native_reason()}")


def _bf16_bound(reference: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding of the exact sum (half an ulp: 2^-9 relative) plus float32 summation-order slack."""
    return reference.abs() * 2.0 ** -8 + 1e-4 * reference.abs().max()


def test_the_build_key_changes_with_source_cpu_torch_and_flags():
    base = native.build_key(b"src", "avx2 fma", "2.13.0")
    assert len({base, native.build_key(b"src2", "avx2 fma", "2.13.0"), native.build_key(b"src", "avx512f", "2.13.0"),
                native.build_key(b"src", "avx2 fma", "2.14.0"),
                native.build_key(b"src", "avx2 fma", "2.13.0", ("-O3", "-march=haswell"))}) == 5
    assert native.build_key(b"src", "avx2 fma", "2.13.0") == base


def test_the_build_targets_another_cpu_when_asked(monkeypatch):
    monkeypatch.delenv(native.ARCH_ENV, raising=False)
    assert native.flags() == native.FLAGS
    monkeypatch.setenv(native.ARCH_ENV, "haswell")
    assert native.flags() == native.arch_flags("haswell") == ("-O3", "-march=haswell", "-fopenmp")


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert native._load.__wrapped__() == (None, "QUANTKIT_NATIVE=0")


def _check_gemv(gemv):
    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 7), (48, 65), (300, 576), (1024, 100), (64, 4096)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(k, generator=g).to(torch.bfloat16)
        y = gemv(w, x)
        reference = w.double() @ x.double()
        assert y.dtype == torch.bfloat16 and y.shape == (n,)
        assert ((y.double() - reference).abs() <= _bf16_bound(reference)).all(), (n, k)


@needs_native
def test_the_bf16_gemv_is_the_float_product_rounded_once():
    _check_gemv(native.gemv_bf16)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        native.gemv_bf16(torch.zeros(4, 8), torch.zeros(8))


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="builds x86 variants")
@pytest.mark.parametrize("arch, int4", [("haswell", False), ("skylake-avx512", True)])
def test_the_other_builds_compute_the_same(tmp_path, arch, int4):
    """The branches other CPUs compile, built here: AVX2 (an AVX2-only EPYC: the GEMVs by FMAs, the int4 one
    over the op's AVX2 layout only) and AVX-512 without avx512_bf16 / VBMI (float32 FMAs after widening)."""
    if int4 and not _cpu_has("avx512bw"):
        pytest.skip("this CPU cannot run an AVX-512 build")
    mod = native.build(native.arch_flags(arch), tmp_path)
    _check_gemv(mod.gemv_bf16)
    _check_attention_and_norm(mod)
    assert mod.int4_available(64) is int4 and mod.int4_available(32)
    if cpu_int4.native_reason() is None and mod.int4_available(cpu_int4.layout_rows()):
        _check_int4(mod.int4_gemv, 192, 576, 64, False)


def _check_attention_and_norm(mod) -> None:
    from quantkit.runtime import row_norm

    q, keys, values, mask, reference = _attention_case(torch.bfloat16)
    b, h, _, d = q.shape
    out = mod.attend_one(q.reshape(b, h, d).contiguous(), keys, values, mask[:, 0, 0].float().contiguous(),
                         mask.shape[-1], d ** -0.5)
    assert (out.double().view_as(reference) - reference).abs().max() <= 2.0 ** -7 * reference.abs().max()
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x, w = torch.randn(3, 577, generator=g).to(dtype), torch.randn(577, generator=g).to(dtype)
        want = row_norm.reference(x, w, 1e-5).double()
        got = mod.rms_norm(x, w, 1e-5).double()
        # another order of summing the squares: r a float32 ulp apart, then one or two roundings of x * r and w * it
        ulps = 2 if dtype == torch.bfloat16 else 4
        assert ((got - want).abs() <= ulps * torch.finfo(dtype).eps * want.abs()).all()


def _count_calls(monkeypatch, kernel: str) -> list:
    """Make `native.module()` the real kernels with calls of `kernel` counted (one entry per call, returned)."""
    calls, real = [], native.module()

    class Spy:
        def __getattr__(self, name):
            if name != kernel:
                return getattr(real, name)
            return lambda *args: calls.append(1) or getattr(real, name)(*args)

    monkeypatch.setattr(native, "module", Spy)
    return calls


def _dequantized(w: cpu_int4.Int4PackedCPU, codes: torch.Tensor) -> torch.Tensor:
    """The weight the op's tables describe: (u - 8) * scale + zero, with the bf16 scales and zeros it reads."""
    sz = w.scale_zeros.double()
    n = codes.shape[0]
    scale = sz[..., 0].t()[:n].repeat_interleave(w.group_size, 1)
    zero = sz[..., 1].t()[:n].repeat_interleave(w.group_size, 1)
    return codes.double() * scale + zero


@needs_int4
@pytest.mark.parametrize("n, k, group, symmetric", [(64, 128, 32, True), (192, 576, 64, False), (128, 256, 128, True),
                                                     (640, 1536, 64, True)])
def test_the_int4_gemv_reads_the_ops_layout(n, k, group, symmetric):
    _check_int4(native.module().int4_gemv, n, k, group, symmetric)


def _check_int4(int4_gemv, n, k, group, symmetric):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 0.005
    zero = None if symmetric else torch.randint(-8, 8, (n, k // group), generator=g)
    w = cpu_int4.repack(codes, scale, zero, group, torch.bfloat16)
    x = torch.randn(k, generator=g).to(torch.bfloat16)
    reference = _dequantized(w, codes) @ x.double()
    mine = int4_gemv(w.packed, w.scale_zeros, x, w.group_size, n, cpu_int4.layout_rows())
    assert mine.dtype == torch.bfloat16 and mine.shape == (n,)
    assert ((mine.double() - reference).abs() <= _bf16_bound(reference)).all()
    op = w.matmul(x[None])[0].double()  # torch's op rounds each dequantized weight to bf16: a looser bound
    assert (mine.double() - op).abs().max() <= 0.02 * reference.abs().max()


@needs_int4
@pytest.mark.parametrize("rows, runs_native", [(128, True), (80, False)])
def test_a_module_planned_native_runs_one_token_there_and_longer_inputs_on_the_op(monkeypatch, rows, runs_native):
    scheme = QuantScheme(num_bits=4, group_size=64)
    module = PackedIntLinear(128, rows, False, scheme, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    module.weight_packed.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, module.weight_packed.shape, generator=g,
                                             dtype=torch.int64).to(torch.int32))
    module.weight_scale.copy_(torch.rand(module.weight_scale.shape, generator=g) * 0.05)
    module.kernel_request, module.one_token = "cpu", "native"
    calls = _count_calls(monkeypatch, "int4_gemv")
    x = torch.randn(1, 1, 128, generator=g).to(torch.bfloat16)
    y = module(x)
    assert bool(calls) is runs_native  # 80 rows: not whole blocks of 64, the op runs
    reference = torch.nn.functional.linear(x.double(), module.dequantize(torch.float64))
    assert ((y.double() - reference).abs() <= 0.02 * reference.abs().max()).all()
    calls.clear()
    module(torch.randn(1, 3, 128, generator=g).to(torch.bfloat16))
    assert not calls  # three tokens: the op


def _attention_case(dtype, batch=2, heads=6, kv_heads=2, dim=32, slots=50, length=37):
    g = torch.Generator().manual_seed(batch * 100 + length)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    keys, values = (torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, length, dtype=dtype)
    mask[-1, ..., :4] = float("-inf")  # the last row padded on the left
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys[:, :, :length].double(), values[:, :, :length].double(), attn_mask=mask.double(),
        scale=dim ** -0.5, enable_gqa=True)
    return q, keys, values, mask, reference


@needs_native
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2.0 ** -7), (torch.float32, 1e-6)])
def test_one_query_attention_over_a_static_cache(dtype, tolerance):
    """Grouped heads, a padded row, fewer positions than slots; within one rounding of the output (bf16) of float64."""
    q, keys, values, mask, reference = _attention_case(dtype)
    b, h, _, d = q.shape
    out = native.module().attend_one(q.reshape(b, h, d).contiguous(), keys, values, mask[:, 0, 0].float().contiguous(),
                                     mask.shape[-1], d ** -0.5)
    assert out.dtype == dtype and out.shape == (b, h, d)
    assert (out.double().view_as(reference) - reference).abs().max() <= tolerance * reference.abs().max()
    with pytest.raises(RuntimeError, match="shapes of q and the cache"):
        native.module().attend_one(q.reshape(b, h, d).contiguous(), keys, values, None, keys.shape[2] + 1, 1.0)


@needs_native
@pytest.mark.parametrize("choice", ["sdpa", "native"])
def test_the_decode_step_attends_by_the_measured_choice(monkeypatch, choice):
    from quantkit.runtime import one_query

    monkeypatch.setattr(one_query, "impl", lambda dtype: choice)
    calls = _count_calls(monkeypatch, "attend_one")
    q, keys, values, mask, reference = _attention_case(torch.bfloat16)
    out = one_query.attend(q, keys, values, mask.shape[-1], mask, q.shape[-1] ** -0.5)
    assert bool(calls) is (choice == "native") and out.shape == q.shape
    assert (out.double() - reference).abs().max() <= 2.0 ** -7 * reference.abs().max()


def test_the_attention_probe_is_cached_and_picks_the_faster(tmp_path):
    from quantkit.runtime import one_query

    asked = []

    def timer(dtype, name, length):
        asked.append((name, length))
        return {"sdpa": 2.0, "native": 1.0}[name] * length

    first = one_query.timings(torch.bfloat16, timer, tmp_path / "probe.json")
    assert first == {"sdpa": 2.0 * sum(one_query.LENGTHS), "native": 1.0 * sum(one_query.LENGTHS)}
    assert len(asked) == 2 * len(one_query.LENGTHS)
    assert one_query.timings(torch.bfloat16, timer, tmp_path / "probe.json") == first and len(asked) == 6  # cached
    one_query.timings(torch.float32, timer, tmp_path / "probe.json")
    assert len(asked) == 12  # another dtype: measured apart


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="torch's AVX2 int4 layout (x86)")
def test_the_int4_gemv_reads_the_ops_avx2_layout_too():
    """Where torch dispatches AVX2 (an AVX2-only CPU, imitated by ATEN_CPU_CAPABILITY in a fresh process) the
    op packs blocks of 32 rows; the native GEMV reads those too, against the float reference."""
    import os
    import subprocess
    import sys

    code = ("import torch, tests.test_native_kernels as t; from quantkit.kernels import cpu_int4, native; "
            "assert cpu_int4.layout_rows() == 32, cpu_int4.layout_rows(); assert cpu_int4.native_reason() is None, "
            "cpu_int4.native_reason(); [t._check_int4(native.module().int4_gemv, n, k, g, s) for n, k, g, s in "
            "((32, 128, 32, True), (96, 576, 64, False))]; print('ok')")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@needs_native
def test_one_query_attention_reads_a_gathered_paged_context_through_its_strides():
    """The serving engine's decode context: [B, L, H_kv, D] gathered, viewed as [B, H_kv, L, D] (no copy)."""
    q, keys, values, mask, reference = _attention_case(torch.bfloat16)
    gathered_k, gathered_v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()  # [B, S, Hkv, D]
    k_view, v_view = gathered_k.permute(0, 2, 1, 3), gathered_v.permute(0, 2, 1, 3)
    assert not k_view.is_contiguous()
    b, h, _, d = q.shape
    out = native.module().attend_one(q.reshape(b, h, d).contiguous(), k_view, v_view,
                                     mask[:, 0, 0].float().contiguous(), mask.shape[-1], d ** -0.5)
    assert (out.double().view_as(reference) - reference).abs().max() <= 2.0 ** -7 * reference.abs().max()
