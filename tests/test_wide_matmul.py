"""16-bit matmuls on float32 GEMMs (`quantkit.kernels.wide_matmul`): the numbers of a 16-bit GEMM, which
calls it takes, where the compute policy asks for it, and that calibration and loaded models run in it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.platform import compute
from quantkit.platform.compute import CpuFeatures, choose
from quantkit.kernels import wide_matmul
from quantkit.kernels.wide_matmul import MIN_ROWS, WideMatmuls, widening

AVX2 = CpuFeatures("AVX2", x86=True)
AMX = CpuFeatures("AVX512", x86=True, avx512_bf16=True, amx_tile=True)


@pytest.fixture
def spy(monkeypatch):
    """The functions widened, in call order."""
    calls = []
    real = wide_matmul.widened_call

    def counting(func, args, kwargs, scratch=None):
        calls.append(func)
        return real(func, args, kwargs, scratch)

    monkeypatch.setattr(wide_matmul, "widened_call", counting)
    return calls


def _operands(dtype, rows=MIN_ROWS):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    return x, w, bias


# each form: (its call on (x, w, bias), the same maths in float32)
FORMS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), lambda x, w, b: F.linear(x, w, b)),
    "matmul": (lambda x, w, b: torch.matmul(x, w.t()), lambda x, w, b: x @ w.t()),
    "operator": (lambda x, w, b: x @ w.t(), lambda x, w, b: x @ w.t()),
    "method": (lambda x, w, b: x.matmul(w.t()), lambda x, w, b: x @ w.t()),
    "mm": (lambda x, w, b: torch.mm(x, w.t()), lambda x, w, b: x @ w.t()),
    "addmm": (lambda x, w, b: torch.addmm(b, x, w.t()), lambda x, w, b: torch.addmm(b, x, w.t())),
    "bmm": (lambda x, w, b: torch.bmm(x.view(2, -1, 96), w.t().expand(2, 96, 80)),
            lambda x, w, b: torch.bmm(x.view(2, -1, 96), w.t().expand(2, 96, 80))),
    "baddbmm": (lambda x, w, b: torch.baddbmm(b.expand(2, 1, 80), x.view(2, -1, 96), w.t().expand(2, 96, 80)),
                lambda x, w, b: torch.baddbmm(b.expand(2, 1, 80), x.view(2, -1, 96), w.t().expand(2, 96, 80))),
    "einsum": (lambda x, w, b: torch.einsum("ti,oi->to", x, w), lambda x, w, b: torch.einsum("ti,oi->to", x, w)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS)
def test_a_widened_product_is_the_float32_product_rounded_once(spy, form, dtype):
    call, maths = FORMS[form]
    x, w, b = _operands(dtype)
    with WideMatmuls(dtype):
        got = call(x, w, b)
    assert len(spy) == 1
    assert got.dtype == dtype
    expected = maths(x.float(), w.float(), b.float()).to(dtype)  # float32 accumulation, one rounding
    assert torch.equal(got, expected)
    # and a 16-bit GEMM's numbers: the native kernel agrees to its last bit or so (accumulation order)
    native = call(x, w, b).float()
    assert ((got.float() - native).abs() <= native.abs() * 2.0 ** -6 + 1e-3).all()


def test_gemvs_other_dtypes_mixed_operands_and_out_buffers_stay_native(spy):
    x, w, b = _operands(torch.bfloat16, rows=MIN_ROWS - 1)  # decode-sized: converting w costs more than it saves
    out = torch.empty(MIN_ROWS, 80, dtype=torch.bfloat16)
    big = _operands(torch.bfloat16)[0]
    with WideMatmuls(torch.bfloat16):
        assert torch.equal(F.linear(x, w, b), torch.nn.functional.linear(x, w, b))
        torch.mv(w, x[0])
        F.linear(big.float(), w.float())               # float32 already
        F.linear(big.half(), w.half())                 # not the dtype widened
        with pytest.raises(RuntimeError):
            F.linear(big, w.float())                    # mixed: torch's own error, as without the mode
        torch.mm(big, w.t(), out=out)                  # the caller's buffer, filled as asked
        big + big                                      # not a product
    assert spy == []


def test_nested_widening_pushes_one_mode(spy):
    x, w, _ = _operands(torch.bfloat16)
    depth = torch._C._len_torch_function_stack()
    with widening(torch.bfloat16):
        with widening(torch.bfloat16):
            assert torch._C._len_torch_function_stack() == depth + 1
            F.linear(x, w)
        F.linear(x, w)
    assert torch._C._len_torch_function_stack() == depth
    F.linear(x, w)  # outside: native
    assert len(spy) == 2


def test_large_operands_are_widened_into_one_reused_buffer_released_on_exit(monkeypatch):
    monkeypatch.setattr(wide_matmul, "SCRATCH_MIN", 80 * 96)  # the weights below; x (64 x 96) and w2 too
    x, w, b = _operands(torch.bfloat16)
    w2 = torch.randn(80, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    mode = WideMatmuls(torch.bfloat16)
    with mode:
        first = F.linear(x, w, b)
        buffer = mode.scratch.buffer
        assert buffer is not None and buffer.numel() == 80 * 96
        second = x @ w2.t()                          # a strided view of another weight, same size: same buffer
        assert mode.scratch.buffer is buffer
        with torch.inference_mode():
            third = F.linear(x, w)                   # the buffer written in inference mode ...
        fourth = F.linear(x, w, b)                   # ... and out of it again
        assert mode.scratch.buffer is buffer
        wide = torch.cat([x, x])                     # a larger operand grows it
        fifth = F.linear(wide, w)
        assert mode.scratch.buffer.numel() == 2 * 64 * 96
    assert mode.scratch.buffer is None               # nothing held once the mode is left
    assert torch.equal(first, F.linear(x.float(), w.float(), b.float()).bfloat16())
    assert torch.equal(second, (x.float() @ w2.float().t()).bfloat16())
    assert torch.equal(third, F.linear(x.float(), w.float()).bfloat16())
    assert torch.equal(fourth, first)
    assert torch.equal(fifth, F.linear(wide.float(), w.float()).bfloat16())


def test_operands_autograd_keeps_are_not_widened_into_the_reused_buffer(monkeypatch):
    monkeypatch.setattr(wide_matmul, "SCRATCH_MIN", 1)
    x, w, _ = _operands(torch.bfloat16)
    other = torch.randn_like(w)
    x.requires_grad_(True)
    with WideMatmuls(torch.bfloat16):
        y = F.linear(x, w)          # backward needs w: a later product must not overwrite it
        F.linear(x.detach(), other)
        y.float().sum().backward()
    assert torch.equal(x.grad, w.float().sum(0).bfloat16().expand_as(x))


# -- where the policy asks for it ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(compute.ENV, raising=False)


def _never_probe():
    raise AssertionError("no probe where torch reports the CPU's features")


@pytest.mark.parametrize("features, asked, how, wide", [
    (AVX2, "bfloat16", "setting", True),   # asked for on a CPU slow in it
    (AVX2, "float16", "env", True),
    (AVX2, "float32", "setting", False),   # float32 is float32
    (AVX2, "auto", "setting", False),      # the policy picks 16 bits only where fast: nothing to widen
    (AMX, "bfloat16", "setting", False),   # fast in bf16: its own kernels
    (AMX, "bfloat16", "env", False),
    (AMX, "float16", "setting", True),     # AMX without its fp16 part
])
def test_the_policy_widens_a_16_bit_dtype_asked_for_where_the_cpu_is_slow_in_it(monkeypatch, features, asked,
                                                                                 how, wide):
    if how == "env":
        monkeypatch.setenv(compute.ENV, asked)
    choice = choose(torch.bfloat16, "cpu", asked if how == "setting" else "auto", "calibration.dtype",
                    features=features, probe=_never_probe)
    assert choice.wide_matmuls is wide
    assert choice.to_json()["wide_matmuls"] is wide
    assert ("its matmuls run as float32 GEMMs rounded to" in choice.describe()) is wide


def test_the_probe_decides_where_the_flags_do_not():
    no_amx = CpuFeatures("AVX512", x86=True, avx512_bf16=True)
    assert choose(torch.bfloat16, "cpu", "bfloat16", features=no_amx, probe=lambda: False).wide_matmuls
    assert not choose(torch.bfloat16, "cpu", "bfloat16", features=no_amx, probe=lambda: True).wide_matmuls


def test_accelerators_are_never_widened():
    assert not compute.needs_wide_matmuls(torch.bfloat16, "cuda:0")
    assert not compute.needs_wide_matmuls(torch.float16, "mps")


# -- calibration and loaded models run in it ----------------------------------------------------


@pytest.fixture
def slow_bf16(monkeypatch):
    """This CPU described as one without fast 16-bit GEMMs (whatever it really is)."""
    monkeypatch.setattr(compute, "fast_16bit", lambda device, features=None, probe=None: ((), "test CPU, no fast bf16"))


def test_quantize_in_a_forced_bf16_widens_and_says_so(tiny_llama, tmp_path, slow_bf16, spy):
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe

    recipe = load_recipe("gptq-w4a16", ["calibration.dtype=bfloat16", "calibration.num_samples=2",
                                        "calibration.seq_len=64", "stages.0.scheme.group_size=32"])
    said = []
    report = quantize(str(tiny_llama), recipe, tmp_path / "q", progress=False, notify=said.append)
    assert len(spy) > 0 and set(spy) <= wide_matmul.MATMULS
    meta = json.loads((report.output / "quantkit.json").read_text())
    assert meta["compute"]["dtype"] == "bfloat16" and meta["compute"]["wide_matmuls"] is True
    assert any("its matmuls run as float32 GEMMs rounded to bfloat16" in line for line in said)
    assert torch.get_default_dtype() == torch.float32 and torch._C._len_torch_function_stack() == 0


def test_a_model_loaded_in_a_slow_bf16_runs_its_forwards_widened(tiny_llama, slow_bf16, spy):
    model = quantkit.load(tiny_llama, dtype=torch.bfloat16)
    assert model.quantkit_compute.wide_matmuls
    ids = torch.randint(4, 100, (1, MIN_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert len(spy) > 0
        with widening(torch.bfloat16):
            assert torch.equal(logits, model.forward.__wrapped__(ids).logits)
        for part, arg in ((model.model, ids), (model.get_output_embeddings(), torch.ones(MIN_ROWS, 64).bfloat16())):
            spy.clear()  # eval, lm-eval and generate's prefill call the decoder stack and the head directly
            part(arg)
            assert len(spy) > 0, part
        spy.clear()
        model(ids[:, :1])  # one token: every product is a GEMV, and the mode is not even entered
        model.model(ids[:, :1])
        model.get_output_embeddings()(torch.ones(1, 64).bfloat16())
    assert spy == []
    out = model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # transformers still reads forward
    assert out.shape == (1, 10)


def test_a_fast_or_float32_choice_leaves_the_model_alone(tiny_llama, monkeypatch):
    monkeypatch.setattr(compute, "fast_16bit", lambda device, features=None, probe=None: ((torch.bfloat16,), "fast"))
    fast = quantkit.load(tiny_llama, dtype=torch.bfloat16)
    wide = fast.quantkit_compute.wide_matmuls
    assert not wide and "forward" not in vars(fast)
    assert "forward" not in vars(quantkit.load(tiny_llama, dtype=torch.float32))


@pytest.mark.slow
def test_smollm2_too_large_for_float32_here_evaluates_in_bf16_widened(smollm2, emma_ppl, monkeypatch, spy):
    """The real model on a CPU described as AVX2, with memory for its bf16 weights but not for float32 ones:
    it loads in bf16 (no disk offload, no float32), its GEMMs widened, and scores as float32 does to bf16's
    precision."""
    from quantkit.platform import memory
    from quantkit.calibration.data import load_text, tokenize
    from quantkit.eval.ppl import perplexity
    from quantkit.checkpoints.loader import load, load_tokenizer

    weights = sum(f.stat().st_size for f in smollm2.glob("*.safetensors"))  # bf16 on disk
    monkeypatch.setattr(compute, "cpu_features", lambda: AVX2)
    monkeypatch.setattr(memory, "available_memory", lambda: int(weights * 1.5 / 0.8))  # 1.5x bf16 < float32's 2x
    model = load(smollm2, offload="auto")
    assert model.dtype == torch.bfloat16 and model.quantkit_compute.wide_matmuls
    assert not model.quantkit_offload.offloaded
    assert "would not fit in memory in float32" in model.quantkit_compute.describe()
    ids = tokenize(load_tokenizer(smollm2), load_text("emma"))
    ppl = perplexity(model, ids, seq_len=512, max_windows=1).ppl
    assert len(spy) > 0
    reference = emma_ppl(smollm2, 1)
    assert abs(ppl / reference - 1) < 0.02, (ppl, reference)  # bf16 activations: 34.26 against 34.36 measured
