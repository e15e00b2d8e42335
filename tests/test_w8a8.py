"""W8A8 (int8 weights, int8 activations per token) and W4AFP8 (int4 weights, FP8 activations): the schemes,
the int8 activation quantizer's bits, the int8 GEMM against its exact reference, the module against a float
reference, the int-quantized checkpoint read by compressed-tensors and transformers, and reloading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.errors import CheckpointError
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.kernels.reference import (fp8_quantize_per_token, int8_matmul, int8_matmul_reference,
                                        int8_quantize_per_token)
from quantkit.qmodules.int_act_linear import IntActLinear
from quantkit.quant.intq import rtn
from quantkit.quant.schemes import QuantScheme, resolve_scheme

from helpers import sample_ids


def test_presets_match_compressed_tensors():
    w8a8, w4afp8 = resolve_scheme("W8A8", {}), resolve_scheme("W4AFP8", {})
    assert (w8a8.num_bits, w8a8.strategy, w8a8.group_size, w8a8.symmetric) == (8, "channel", None, True)
    assert (w8a8.input_activations.type, w8a8.input_activations.strategy, w8a8.input_activations.dynamic) == \
        ("int", "token", True)
    assert (w4afp8.num_bits, w4afp8.strategy, w4afp8.group_size) == (4, "group", 128)
    assert w4afp8.input_activations.type == "float" and w4afp8.activation_quantized
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for ours, name in ((w8a8, "W8A8"), (w4afp8, "W4AFP8")):
        theirs = PRESET_SCHEMES[name]
        assert theirs["weights"].num_bits == ours.num_bits and theirs["weights"].strategy == ours.strategy
        assert theirs["weights"].group_size == ours.group_size
        acts = theirs["input_activations"]
        assert (acts.type, acts.strategy, acts.dynamic) == (ours.input_activations.type, "token", True)


@pytest.mark.parametrize("fields, message", [
    (dict(num_bits=4, symmetric=False, input_activations={"type": "int"}), "symmetric int weights"),
    (dict(num_bits=4, input_activations={"type": "int"}), "int8 activations take int8 weights"),
    (dict(num_bits=8, strategy="channel", input_activations={"type": "float"}), "W4AFP8"),
    (dict(num_bits=8, strategy="channel", input_activations={"type": "int", "strategy": "tensor", "observer": "mse"}),
     "observer minmax"),
    (dict(num_bits=8, type="float", strategy="channel", input_activations={"type": "int"}), "FP8 activations"),
    (dict(num_bits=8, group_size=32, grid="q8_0", input_activations={"type": "int"}), "GGUF grids"),
])
def test_bad_activation_schemes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        QuantScheme(**fields)


def test_int8_activation_codes_are_fixed_values():
    """amax / 127 per row, codes x * 127 / amax rounded half to even, saturated; a zero row: codes 0, scale 0."""
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0, 63.49],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [-2.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = int8_quantize_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert q[0].tolist() == [127, 0, 2, -2, -127, 63]
    assert q[1].tolist() == [0] * 6 and float(s[1]) == 0.0
    assert q[2].tolist() == [-127, 64, 0, 0, 0, 0]  # 63.5 rounds to the even 64
    assert float(s[0]) == 1.0 and float(s[2]) == float(torch.tensor(2.0) / 127)  # float32 division


@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_int8_gemm_equals_the_exact_reference_bit_for_bit(m):
    g = torch.Generator().manual_seed(m)
    k, n = 576, 96
    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xs, ws = torch.rand(m, 1, generator=g) / 100, torch.rand(n, 1, generator=g).to(torch.bfloat16) / 100
    bias = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        fast = int8_matmul(xq, xs, wq.t(), ws, dtype, bias)
        ref = int8_matmul_reference(xq, xs, wq, ws, dtype, bias)
        assert fast.dtype == dtype and torch.equal(fast, ref)


def _linear(scheme_name: str, bias: bool = True, seed: int = 0) -> tuple[torch.nn.Linear, IntActLinear]:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(256, 48, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 256, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(48, generator=g) * 0.1)
    qw = rtn(lin.weight.data, resolve_scheme(scheme_name, {}), torch.float32)
    return lin, IntActLinear.from_quantized(qw, lin.bias)


@pytest.mark.parametrize("kernel", [None, "torch"])
def test_w8a8_module_equals_a_float_reference(kernel, monkeypatch):
    """Quantize the activations per token, dequantize them and the weight, one float64 matmul: the module
    (int8 GEMM or its reference) within float32 rounding of it; and far from the unquantized input's output."""
    lin, mod = _linear("W8A8")
    mod.kernel_request = kernel
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    xq, xs = int8_quantize_per_token(x.reshape(-1, 256))
    want = (xq.double() * xs.double()) @ mod.dequantize(torch.float64).t() + lin.bias.double()
    got = mod(x)
    assert got.shape == (2, 5, 48) and mod.kernel == ("int8-gemm" if kernel is None else "torch")
    torch.testing.assert_close(got.reshape(-1, 48).double(), want, rtol=1e-6, atol=1e-6)
    unquantized_input = x.reshape(-1, 256).double() @ mod.dequantize(torch.float64).t() + lin.bias.double()
    assert (unquantized_input - want).abs().max() > 100 * (got.reshape(-1, 48).double() - want).abs().max()


def test_w4afp8_module_equals_a_float_reference():
    lin, mod = _linear("W4AFP8", bias=False)
    assert mod.weight.dtype == torch.int8 and int(mod.weight.abs().max()) <= 8 and mod.weight_scale.shape == (48, 2)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    xq, xs = fp8_quantize_per_token(x)
    want = (xq.double() * xs.double()) @ mod.dequantize(torch.float64).t()
    torch.testing.assert_close(mod(x).double(), want, rtol=1e-5, atol=1e-5)
    mod.kernel_request = "cpu"
    with pytest.raises(Exception, match="W4AFP8 layers run by emulation"):
        mod(x)


@pytest.fixture(scope="module")
def w8a8_checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    calib = ["calibration.num_samples=4", "calibration.seq_len=32"]
    cases = {"w8a8-dynamic": ("w8a8-dynamic", []), "w4afp8": ("w4afp8", calib + ["stages.1.scheme.group_size=32"]),
             "gptq-w8a8": ("gptq-w8a16", calib + ["stages.0.scheme=W8A8"]),
             "w8a8-smoothquant": ("w8a8-smoothquant", calib)}
    return {name: quantize(str(tiny_models["llama"]), load_recipe(recipe, overrides), root / name,
                           progress=False).output for name, (recipe, overrides) in cases.items()}


@pytest.mark.parametrize("case", ["w8a8-dynamic", "w4afp8", "gptq-w8a8", "w8a8-smoothquant"])
def test_int_quantized_layout_and_compressed_tensors_decompression(w8a8_checkpoints, case):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    path = w8a8_checkpoints[case]
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    assert raw["format"] == "int-quantized"
    scheme = QuantizationConfig.model_validate(raw).config_groups["group_0"]
    tensors = load_file(str(path / "model.safetensors"))
    ours = quantkit.load(path)
    checked = 0
    for name, module in ours.named_modules():
        if not isinstance(module, IntActLinear):
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        assert set(local) == {"weight", "weight_scale"} and local["weight"].dtype == torch.int8
        theirs = IntQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(theirs.to(torch.bfloat16), module.dequantize(torch.bfloat16)), name
        checked += 1
    assert checked == 21  # 3 layers x 7 linears


@pytest.mark.parametrize("recipe", ["w8a8-dynamic", "w4afp8", "w8a8-smoothquant"])
def test_reloaded_model_equals_the_in_memory_one(tiny_models, tokenizer, tmp_path, recipe):
    overrides = {"w8a8-dynamic": [], "w8a8-smoothquant": ["calibration.num_samples=4", "calibration.seq_len=32"],
                 "w4afp8": ["calibration.num_samples=4", "calibration.seq_len=32", "stages.1.scheme.group_size=32"]}[recipe]
    in_memory, _ = quantkit.quantize(tiny_models["llama"], recipe, overrides=overrides, dtype=torch.float32)
    quantkit.save(in_memory, tmp_path / "q")
    reloaded = quantkit.load(tmp_path / "q", dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        assert torch.equal(in_memory(ids).logits, reloaded(ids).logits)


def _compressed_tensors_int8_rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own dynamic int8 activation rule: s = amax / 127.5, q = round(x / s) in [-128, 127]."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    return torch.round(xf / s).clamp(-128, 127).to(torch.int8), s


def test_transformers_runs_the_w8a8_checkpoint_as_we_do(w8a8_checkpoints, tokenizer):
    """transformers runs compressed-tensors' emulation of our checkpoint: activations quantized and dequantized
    with its dynamic rule (amax / 127.5; ours, as vLLM's int8 kernels: amax / 127), then a float matmul with the
    dequantized weight. Our loaded model with that rule in that emulation gives its logits exactly (the tensors,
    scales and graph agree; our int8 GEMM equals the same emulation with our rule, tested above); with our own
    rule the logits differ by rounding of the size of the activation quantization itself."""
    from transformers import AutoModelForCausalLM

    path = w8a8_checkpoints["w8a8-dynamic"]
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = quantkit.load(path, dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)

    def emulated(m):
        def forward(x):
            q, s = _compressed_tensors_int8_rule(x)
            return torch.nn.functional.linear(q.float() * s, m.dequantize(torch.float32))
        return forward

    with torch.no_grad():
        a, own_rule = theirs(ids).logits, ours(ids).logits
        for m in ours.modules():
            if isinstance(m, IntActLinear):
                m.forward = emulated(m)
        theirs_rule = ours(ids).logits
    torch.testing.assert_close(theirs_rule, a, rtol=0, atol=1e-6)
    assert (own_rule - a).abs().max() > 1e-3


def test_bad_int_quantized_config_is_refused():
    from quantkit.checkpoints.quantization_config import parse_quantization_config

    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "format": "int-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": False}}}}
    with pytest.raises(CheckpointError, match="config_groups.g.input_activations: strategy 'token'"):
        parse_quantization_config(qc, "x")
    del qc["config_groups"]["g"]["input_activations"]
    with pytest.raises(CheckpointError, match="without input_activations"):
        parse_quantization_config(qc, "x")


def test_w4afp8_dense_copy_follows_the_memory_plan(w8a8_checkpoints, monkeypatch):
    """W4AFP8 layers multiply by their dequantized weight, as emulated FP8 layers do: the copy is kept only
    where `plan_dense_cache` allows it (W8A8 layers multiply int8 codes: none is planned for them), and
    keeping it changes no bit of the output."""
    from quantkit.qmodules import fp8_linear as fp8linear

    w4 = quantkit.load(w8a8_checkpoints["w4afp8"], dtype=torch.float32)  # a tiny model: the copies fit
    layers = [m for m in w4.modules() if isinstance(m, IntActLinear)]
    assert layers and all(m.keep_dense for m in layers)
    need = sum(m.weight.numel() for m in layers) * 4
    assert fp8linear.plan_dense_cache(w4, torch.float32) == need
    x = torch.randn(3, layers[0].in_features)
    kept = layers[0](x)
    assert layers[0]._dense is not None
    monkeypatch.setattr(fp8linear, "available_memory", lambda: 3 * need)  # needs over 30% of it
    assert fp8linear.plan_dense_cache(w4, torch.float32) == 0 and not any(m.keep_dense for m in layers)
    assert torch.equal(layers[0](x), kept) and layers[0]._dense is None
    w8 = quantkit.load(w8a8_checkpoints["w8a8-dynamic"], dtype=torch.float32)
    assert fp8linear.plan_dense_cache(w8, torch.float32) == 0
    assert not any(m.keep_dense for m in w8.modules() if isinstance(m, IntActLinear))


# -- static per-tensor int8 activations ------------------------------------------------------------------------

STATIC = ["stages.0.scheme={preset: W8A8, input_activations: {strategy: tensor}}", "calibration.num_samples=4",
          "calibration.seq_len=32", "calibration.check_samples=0"]


def test_static_int8_scheme_and_fixed_codes():
    sc = resolve_scheme("W8A8", {"input_activations": {"strategy": "tensor"}})
    assert sc.has_static_input and sc.input_activations.dynamic is False and "static per-tensor" in sc.short()
    from quantkit.kernels.reference import int8_quantize_static, int8_static_scale

    s = int8_static_scale(torch.tensor(254.0), torch.float32)
    assert s.tolist() == [2.0]
    q, xs = int8_quantize_static(torch.tensor([[3.0, 5.0, -1.0, 300.0, -400.0, 0.4]]), s)
    assert q.tolist() == [[2, 2, 0, 127, -128, 0]]  # 1.5 -> 2, 2.5 -> 2, -0.5 -> 0 (half to even), saturated
    assert xs.shape == (1, 1) and float(xs) == 2.0


@pytest.fixture(scope="module")
def w8a8_static(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8-static")
    return {algo: quantize(str(tiny_models["llama"]), load_recipe(recipe, STATIC), root / algo, progress=False).output
            for algo, recipe in (("rtn", "w8a8-dynamic"), ("gptq", "gptq-w8a16"))}


@pytest.mark.parametrize("algo", ["rtn", "gptq"])
def test_static_int8_checkpoint_layout_and_transformers(w8a8_static, tokenizer, algo):
    """An `input_scale` per linear (one per input-sharing group: q/k/v and gate/up share theirs), the config
    compressed-tensors parses as static per-tensor int8, and transformers runs each layer as we do (its static
    rule is ours: x / s rounded half to even, saturated)."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    path = w8a8_static[algo]
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    acts = QuantizationConfig.model_validate(raw).config_groups["group_0"].input_activations
    assert (acts.strategy, acts.dynamic, acts.type) == ("tensor", False, "int")
    tensors = load_file(str(path / "model.safetensors"))
    layer = "model.layers.1."
    scales = {n: float(tensors[f"{layer}{n}.input_scale"]) for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj", "mlp.down_proj")}
    assert scales["self_attn.q_proj"] == scales["self_attn.k_proj"] == scales["self_attn.v_proj"] > 0
    assert scales["mlp.down_proj"] != scales["self_attn.q_proj"]
    ours = quantkit.load(path, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = {}
    for name, module in theirs.named_modules():
        if name.endswith("_proj"):
            module.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, (a[0], o)))
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
        assert len(seen) == 21
        for name, (x, y) in seen.items():  # each layer on the same input: the same output up to float32 rounding
            torch.testing.assert_close(ours.get_submodule(name)(x), y, rtol=0, atol=1e-5)
    # end to end, an input rounding difference of 1e-7 can flip one activation code: a step of the int8 grid
    assert (a - b).abs().max() < 0.02 * b.abs().max()


def test_static_int8_module_equals_a_float_reference():
    lin = torch.nn.Linear(256, 48)
    scheme = resolve_scheme("W8A8", {"input_activations": {"strategy": "tensor"}})
    qw = rtn(lin.weight.data, scheme, torch.float32)
    qw.input_scale = torch.tensor([0.02])
    mod = IntActLinear.from_quantized(qw, lin.bias.data)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    xq = torch.round(x / 0.02).clamp(-128, 127)
    want = (xq.double() * 0.02) @ mod.dequantize(torch.float64).t() + lin.bias.double()
    for kernel in (None, "torch"):
        mod.kernel_request = kernel
        torch.testing.assert_close(mod(x).double(), want, rtol=1e-5, atol=1e-5)
