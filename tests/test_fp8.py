"""FP8: casting and scale rules on fixed values, weight strategies, activation observers, KV-cache
scales, the float-quantized format (read by compressed-tensors and transformers), the runner's
emulation and FP8 KV cache, and the recipes."""

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.errors import CheckpointError, RecipeError
from quantkit.kernels.reference import fp8_quantize_per_token
from quantkit.quant.fp8 import (FP8_MAX, TINY, dequantize_weight, fake_quantize, mse_scale, quantize_weight,
                                scale_from_absmax, to_fp8)
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.qmodules.fp8_linear import Fp8Linear
from quantkit.qmodules.kv import KVObserver
from quantkit.runtime.kv_cache import Fp8KVCache, kv_scales
from quantkit.quant.schemes import QuantScheme, resolve_scheme
from quantkit.platform.transformers_compat import cache_kwargs

from helpers import quantize_in_memory, sample_ids


def test_cast_saturates_rounds_to_even_and_keeps_subnormals():
    x = torch.tensor([1000.0, -1e6, 448.0, 460.0, 31.6, 17.0, 2**-9, 2**-10, 3 * 2**-10, 0.0, -0.0])
    expected = torch.tensor([448.0, -448.0, 448.0, 448.0, 32.0, 16.0, 2**-9, 0.0, 2**-8, 0.0, -0.0])
    got = to_fp8(x).float()
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))
    assert torch.equal(to_fp8(torch.tensor([3e38, -3e38, float("inf")])).float(), torch.tensor([448.0, -448.0, 448.0]))


def test_scales_of_zero_tensors_are_positive_and_codes_zero():
    for strategy, block in (("tensor", None), ("channel", None), ("block", (2, 4))):
        qw = quantize_weight(torch.zeros(4, 8), strategy, torch.float32, block)
        assert (qw.scale > 0).all() and torch.equal(qw.q.float(), torch.zeros(4, 8))
        assert torch.equal(qw.dequantize(), torch.zeros(4, 8))
    assert float(scale_from_absmax(torch.zeros(1), torch.float32)) == pytest.approx(TINY / FP8_MAX)


def test_weight_scales_fixed_values():
    w = torch.tensor([[448.0, -1.0, 0.5, 2.0], [1.0, 2.0, -4.0, 0.25]])
    t = quantize_weight(w, "tensor", torch.float32)
    assert t.scale.shape == (1,) and float(t.scale) == 1.0
    c = quantize_weight(w, "channel", torch.float32)
    assert c.scale.shape == (2, 1) and torch.equal(c.scale.flatten(), torch.tensor([1.0, 4.0 / 448]))
    # per channel, row 1's max (-4) maps to -448 exactly
    assert float(c.q[1, 2].float()) == -448.0
    b = quantize_weight(w, "block", torch.float32, (1, 2))
    assert b.scale.shape == (2, 2)
    assert torch.equal(b.scale, torch.tensor([[448.0, 2.0], [2.0, 4.0]]) / 448)
    for qw in (t, c, b):
        torch.testing.assert_close(qw.dequantize(), w, rtol=2**-3, atol=0)  # e4m3: 3 mantissa bits
    # ragged blocks: 5 x 7 with 2 x 4 blocks -> 3 x 2 scales
    r = quantize_weight(torch.randn(5, 7), "block", torch.float32, (2, 4))
    assert r.scale.shape == (3, 2) and r.q.shape == (5, 7)


def test_weight_sqnr_bounds():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    for strategy, block in (("tensor", None), ("channel", None), ("block", (128, 128))):
        deq = quantize_weight(w, strategy, torch.bfloat16, block).dequantize()
        sqnr = 10 * torch.log10(w.pow(2).sum() / (w - deq).pow(2).sum())
        assert sqnr > 28, (strategy, float(sqnr))  # e4m3 relative error ~ 2^-4 per element: ~31 dB


def test_weight_mse_observer_per_scale():
    """Each scale is chosen on its own weights: never a larger squared error than min-max for that
    channel / block / tensor, smaller in total on gaussian channels and blocks, and a row that min-max already
    represents exactly keeps its min-max scale."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    w[0] = torch.tensor([448.0, -224.0, 112.0, 56.0] * 64) / 448  # on the e4m3 grid at scale 1/448
    for strategy, block in (("tensor", None), ("channel", None), ("block", (16, 64))):
        mm = quantize_weight(w, strategy, torch.float32, block)
        mse = quantize_weight(w, strategy, torch.float32, block, observer="mse")
        assert mse.scale.shape == mm.scale.shape and torch.all(mse.scale <= mm.scale)
        unit = {"tensor": lambda e: e.sum().reshape(1), "channel": lambda e: e.sum(1),
                "block": lambda e: e.reshape(4, 16, 4, 64).sum((1, 3)).flatten()}[strategy]
        err_mm, err_mse = unit((mm.dequantize() - w) ** 2), unit((mse.dequantize() - w) ** 2)
        assert torch.all(err_mse <= err_mm), strategy
        if strategy != "tensor":  # (one scale for all, set by row 0's exact values: nothing to gain)
            assert float(err_mse.sum()) < 0.97 * float(err_mm.sum()), strategy
    ch = quantize_weight(w, "channel", torch.float32, observer="mse")
    assert float(ch.scale[0]) == float(torch.tensor(1 / 448)) and torch.equal(ch.dequantize()[0], w[0])
    with pytest.raises(ValueError, match="observer"):
        quantize_weight(w, "channel", torch.float32, observer="percentile")


def test_dynamic_per_token_scales():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0 * 3, 1.0, -7.0]])
    q, s = fp8_quantize_per_token(x)
    assert torch.equal(s.flatten(), torch.tensor([2.0 / 448, TINY / 448, 3.0]))
    assert float(q[0, 1].float()) == -448.0 and float(q[2, 0].float()) == 448.0
    assert torch.equal(q[1].float(), torch.zeros(3))


def test_mse_observer_clips_heavy_tails_and_keeps_plain_ranges():
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(20000, generator=g)
    tails = torch.cat([gaussian, torch.tensor([400.0])])
    minmax = scale_from_absmax(tails.abs().amax().reshape(1), torch.float32)
    chosen = mse_scale(tails, float(tails.abs().amax()), torch.float32)
    err = lambda s: float((fake_quantize(tails, s) - tails).pow(2).sum())  # noqa: E731
    assert err(chosen) <= err(minmax)
    assert float(chosen) <= float(minmax)
    uniform = torch.rand(20000, generator=g) * 2 - 1
    picked = mse_scale(uniform, float(uniform.abs().amax()), torch.float32)
    assert float(picked) > 0.5 * float(uniform.abs().amax()) / FP8_MAX


def test_kv_observer_records_known_maxima_per_head():
    obs = KVObserver()
    k = torch.zeros(2, 3, 5, 4)
    v = torch.zeros(2, 3, 5, 4)
    k[1, 0, 2, 3], k[0, 1, 4, 0], k[0, 2, 0, 0] = -7.0, 3.0, 0.5
    v[0, 0, 0, 0], v[1, 2, 1, 1] = 2.0, -9.0
    out = obs.update(k, v, 4)
    assert out[0] is k and out[1] is v  # calibration does not change the states
    obs.update(k * 0.5, v * 2, 4)
    assert torch.equal(obs.k_absmax[4], torch.tensor([7.0, 3.0, 0.5]))
    assert torch.equal(obs.v_absmax[4], torch.tensor([4.0, 0.0, 18.0]))


def test_fp8_kv_cache_stores_values_on_the_fp8_grid():
    cache = Fp8KVCache({0: (torch.tensor([0.01]), torch.tensor([0.5, 0.25]))})
    k = torch.randn(1, 2, 3, 4)
    v = torch.randn(1, 2, 3, 4) * 100
    keys, values = cache.update(k, v, 0)
    assert torch.equal(keys, fake_quantize(k, torch.tensor(0.01)))
    # per head scales; codes saturate at 448 * scale
    assert values[0, 0].abs().max() <= 448 * 0.5 and values[0, 1].abs().max() <= 448 * 0.25
    codes = values[0, 1] / 0.25
    assert torch.equal(codes, to_fp8(codes).float())


# -- through the pipeline, the format and the runner ------------------------------------------------

def test_fp8_dynamic_needs_no_calibration_data(tiny_llama, tmp_path, monkeypatch):
    import quantkit.flow.job as qmod

    def no_data(*args, **kwargs):
        raise AssertionError("fp8-dynamic must not load calibration data")

    monkeypatch.setattr(qmod, "calibration_batches", no_data)
    out = quantize(str(tiny_llama), load_recipe("fp8-dynamic", []), tmp_path / "q", progress=False).output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert "model.layers.0.self_attn.q_proj.input_scale" not in tensors


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    cases = {"fp8-dynamic": [], "fp8-static": ["calibration.num_samples=4", "calibration.seq_len=32"],
             "fp8-static-kv": ["calibration.num_samples=4", "calibration.seq_len=32"],
             "block": ["calibration.num_samples=4", "calibration.seq_len=32", "stages.0.scheme=FP8_BLOCK",
                       "stages.0.scheme.block_structure=[32,32]"],
             "gptq-fp8-dynamic": ["calibration.num_samples=4", "calibration.seq_len=32"],
             "gptq-fp8-static": ["calibration.num_samples=4", "calibration.seq_len=32", "stages.0.scheme=FP8"]}
    recipe_of = {"block": "fp8-dynamic", "gptq-fp8-static": "gptq-fp8-dynamic"}
    out = {}
    for name, overrides in cases.items():
        recipe = load_recipe(recipe_of.get(name, name), overrides)
        out[name] = quantize(str(tiny_models["llama"]), recipe, root / name, progress=False).output
    return out


@pytest.mark.parametrize("case", ["fp8-dynamic", "fp8-static", "block", "gptq-fp8-dynamic", "gptq-fp8-static"])
def test_compressed_tensors_decompresses_to_our_weights(fp8_checkpoints, case):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    path = fp8_checkpoints[case]
    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    tensors = load_file(str(path / "model.safetensors"))
    ours = quantkit.load(path)
    checked = 0
    for name, module in ours.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        theirs = FloatQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(theirs.to(torch.bfloat16), module.dequantize(torch.bfloat16)), name
        if case.endswith("fp8-static"):
            assert module.input_scale is not None and float(module.input_scale) > 0
        checked += 1
    assert checked == 21  # 3 layers x 7 linears


def test_transformers_reloads_fp8_and_agrees_with_our_runner(fp8_checkpoints, tokenizer):
    """transformers runs compressed-tensors' own emulation (weights dequantized, activations
    quantized per token). Both compute the same quantize-dequantize in float32 and the same graph
    (on real SmolLM2 the logits agree exactly); atol 1e-5. Without activation quantization the
    difference is far larger (checked below), so this does test the activations' path."""
    from transformers import AutoModelForCausalLM

    path = fp8_checkpoints["fp8-dynamic"]
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = quantkit.load(path, dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        weights_only = resolve_scheme("FP8_WEIGHT", {})
        for m in ours.modules():
            if isinstance(m, Fp8Linear):
                m.scheme = weights_only
        c = ours(ids).logits
    assert (a - c).abs().max() > 100 * 1e-5


def test_gptq_fp8_keeps_the_nearest_scales_and_layout(fp8_checkpoints):
    """gptq-fp8-dynamic writes fp8-dynamic's checkpoint layout and scales with other codes; its
    static variant takes each linear's input scale from the same calibration inputs as fp8-static
    (equal on layer 0, whose inputs do not depend on earlier quantized layers; q/k/v share one)."""
    def read(case):
        path = fp8_checkpoints[case]
        return load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())

    ours, cfg = read("gptq-fp8-dynamic")
    ref, ref_cfg = read("fp8-dynamic")
    assert cfg["quantization_config"]["config_groups"] == ref_cfg["quantization_config"]["config_groups"]
    assert ours.keys() == ref.keys()
    codes = changed = 0
    for key, t in ours.items():
        if key.endswith("weight_scale"):
            assert torch.equal(t, ref[key]), key
        elif t.dtype == torch.float8_e4m3fn:
            changed += int((t.view(torch.uint8) != ref[key].view(torch.uint8)).sum())
            codes += t.numel()
    assert 0.01 < changed / codes < 0.9
    static, _ = read("gptq-fp8-static")
    ref_static, _ = read("fp8-static")
    layer0 = [k for k in static if k.startswith("model.layers.0.") and k.endswith("input_scale")]
    assert len(layer0) == 7
    for key in layer0:
        assert torch.equal(static[key], ref_static[key]), key
    qkv = [static[f"model.layers.0.self_attn.{p}_proj.input_scale"] for p in "qkv"]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2])


def test_in_memory_equals_reloaded(tiny_llama, fp8_checkpoints, tokenizer):
    """The exported static checkpoint computes what the pipeline's modules computed."""
    model, _, result, _, _ = quantize_in_memory(tiny_llama, "fp8-static", ["calibration.num_samples=4"],
                                                batches=[sample_ids(tokenizer, 2, 32)])
    for name, (fmt, scheme) in result.quantized.items():
        assert fmt.name == "float-quantized" and scheme.input_activations.strategy == "tensor"
    reloaded = quantkit.load(fp8_checkpoints["fp8-static"], dtype=torch.float32)
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, Fp8Linear)
    ids = sample_ids(tokenizer, 1)
    with torch.no_grad():
        logits = reloaded(ids).logits
    assert torch.isfinite(logits).all()


def test_static_activation_quantization_changes_outputs_as_emulated():
    lin = torch.nn.Linear(64, 32)
    scheme = resolve_scheme("FP8", {})
    qw = quantize_weight(lin.weight.data, "tensor", torch.float32)
    qw.scheme, qw.input_scale = scheme, torch.tensor([0.01])
    mod = Fp8Linear.from_quantized(qw, lin.bias.data)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(fake_quantize(x, torch.tensor(0.01)), qw.dequantize(), lin.bias)
    torch.testing.assert_close(mod(x), expected, rtol=0, atol=1e-6)


def test_emulated_fp8_linear_keeps_its_dense_weight_exactly():
    """keep_dense changes no bit of the output, and a changed weight (in place), scale or dtype
    is never served from a stale copy."""
    g = torch.Generator().manual_seed(0)
    scheme = resolve_scheme("FP8_DYNAMIC", {})
    qw = quantize_weight(torch.randn(48, 64, generator=g), "channel", torch.float32)
    qw.scheme = scheme
    mod, ref = Fp8Linear.from_quantized(qw, None), Fp8Linear.from_quantized(qw, None)
    x = torch.randn(3, 64, generator=g)
    expected = ref(x)
    mod.keep_dense = True
    assert torch.equal(mod(x), expected)
    kept = mod._dense[1]
    assert torch.equal(mod(x), expected) and mod._dense[1] is kept  # reused, not rebuilt
    other = quantize_weight(torch.randn(48, 64, generator=g), "channel", torch.float32)
    for m in (mod, ref):
        m.weight.copy_(other.q)
    assert torch.equal(mod(x), ref(x)) and not torch.equal(mod(x), expected)
    for m in (mod, ref):
        m.weight_scale.mul_(2)
    assert torch.equal(mod(x), ref(x))
    xb = x.to(torch.bfloat16)
    assert torch.equal(mod(xb), ref(xb)) and mod._dense[1].dtype == torch.bfloat16


def test_dense_fp8_weights_are_kept_where_memory_allows(fp8_checkpoints, monkeypatch, caplog):
    from quantkit.errors import KernelError
    from quantkit.qmodules import fp8_linear as fp8linear

    def kept(model):
        flags = {m.keep_dense for m in model.modules() if isinstance(m, Fp8Linear)}
        assert len(flags) == 1
        return flags.pop()

    path = fp8_checkpoints["fp8-dynamic"]
    model = quantkit.load(path, dtype=torch.float32)  # a tiny model: fits
    assert kept(model)
    need = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear)) * 4
    monkeypatch.setattr(fp8linear, "available_memory", lambda: 3 * need)  # needs over 30% of it
    with caplog.at_level("WARNING"):
        assert fp8linear.plan_dense_cache(model, torch.float32) == 0
    assert not kept(model) and "QUANTKIT_FP8_DENSE=1" in caplog.text
    monkeypatch.setattr(fp8linear, "available_memory", lambda: 4 * need)
    assert fp8linear.plan_dense_cache(model, torch.float32) == need and kept(model)
    monkeypatch.setenv("QUANTKIT_FP8_DENSE", "0")
    assert fp8linear.plan_dense_cache(model, torch.float32) == 0 and not kept(model)
    monkeypatch.setenv("QUANTKIT_FP8_DENSE", "1")
    monkeypatch.setattr(fp8linear, "available_memory", lambda: None)
    assert fp8linear.plan_dense_cache(model, torch.bfloat16) == need // 2 and kept(model)
    monkeypatch.setenv("QUANTKIT_FP8_DENSE", "yes")
    with pytest.raises(KernelError, match="QUANTKIT_FP8_DENSE='yes': use auto, 1"):
        fp8linear.plan_dense_cache(model, torch.float32)


def test_fp8_linear_triton_matches_emulation(monkeypatch):
    from quantkit.kernels.select import use_kernel

    pytest.importorskip("triton")
    lin = torch.nn.Linear(96, 40)
    for preset in ("FP8_DYNAMIC", "FP8"):
        scheme = resolve_scheme(preset, {})
        qw = quantize_weight(lin.weight.data, scheme.strategy, torch.bfloat16)
        qw.scheme, qw.input_scale = scheme, torch.tensor([0.02], dtype=torch.bfloat16)
        mod = Fp8Linear.from_quantized(qw, lin.bias.data.to(torch.bfloat16))
        x = torch.randn(5, 96).to(torch.bfloat16)
        use_kernel(mod, "torch")
        ref = mod(x)
        use_kernel(mod, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        got = mod(x)
        assert mod.kernel == "triton"
        err = (got.float() - ref.float()).abs().max()
        assert err <= 2 * 2**-7 * ref.float().abs().max(), preset


def test_kv_scales_equal_the_absmax_of_cached_keys(tiny_llama, fp8_checkpoints, tokenizer):
    """An independent check: transformers' own DynamicCache holds the keys (after RoPE) and values
    of a full forward; with 16-bit weights their absmax / 448 must be our scales."""
    from transformers import DynamicCache

    batches = [sample_ids(tokenizer, 2, 32), sample_ids(tokenizer, 2, 32).flip(1)]
    model, adapter, result, storage, _ = quantize_in_memory(tiny_llama, "fp8-kv", [], batches=batches)
    assert result.kv_cache_scheme["strategy"] == "tensor" and not result.quantized
    reference = quantkit.load(tiny_llama, dtype=torch.float32)
    k_max, v_max = {}, {}
    for ids in batches:
        cache = DynamicCache(config=reference.config)
        with torch.no_grad():
            reference(ids, use_cache=True, **cache_kwargs(reference, cache))
        for i, layer in enumerate(cache.layers):
            k_max[i] = max(k_max.get(i, 0.0), float(layer.keys.abs().max()))
            v_max[i] = max(v_max.get(i, 0.0), float(layer.values.abs().max()))
    for i, layer in enumerate(model.model.layers):
        assert float(layer.self_attn.k_scale) == float(scale_from_absmax(torch.tensor([k_max[i]]), storage))
        assert float(layer.self_attn.v_scale) == float(scale_from_absmax(torch.tensor([v_max[i]]), storage))
    # per head
    model_h, _, _, _, _ = quantize_in_memory(tiny_llama, "fp8-kv", ["stages.0.args.strategy=head"], batches=batches)
    heads = model_h.model.layers[0].self_attn.k_scale
    assert heads.shape == (model_h.config.num_key_value_heads,)
    assert float(heads.max()) == float(model.model.layers[0].self_attn.k_scale)


def test_kv_checkpoint_round_trip_and_runner_cache(fp8_checkpoints, tokenizer, caplog):
    path = fp8_checkpoints["fp8-static-kv"]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.num_bits == 8
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.k_scale"].shape == (1,)
    model = quantkit.load(path, dtype=torch.float32)
    scales, calibrated = kv_scales(model)
    assert calibrated and float(scales[1][0]) == float(tensors["model.layers.1.self_attn.k_scale"].float())
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    ids = sample_ids(tokenizer, 1)[0].tolist()
    g = generate(model, tokenizer, ids, SamplingParams(max_new_tokens=5), kv_cache_dtype="fp8")
    assert len(g.token_ids) >= 1
    # a model without scales: 1.0 with a warning
    plain = quantkit.load(fp8_checkpoints["fp8-dynamic"], dtype=torch.float32)
    with caplog.at_level("WARNING"):
        _, calibrated = kv_scales(plain)
    assert not calibrated and "using 1.0" in caplog.text


def test_bad_fp8_input_is_rejected(tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match="'rtn' does not quantize FP8 schemes; algorithms that do: .*fp8.*gptq"):
        load_recipe("rtn-w4a16", ["stages.0.scheme=FP8_DYNAMIC"])
    with pytest.raises(RecipeError, match="'fp8' does not quantize int schemes; algorithms that do: .*gptq.*rtn"):
        load_recipe("fp8-dynamic", ["stages.0.scheme=W4A16"])
    with pytest.raises(RecipeError, match="'fp8' has no column order"):
        load_recipe("fp8-dynamic", ["stages.0.scheme.actorder=static"])
    with pytest.raises(ValueError, match="strategy tensor, channel or block"):
        QuantScheme(num_bits=8, type="float", strategy="group", group_size=None)
    with pytest.raises(ValueError, match="activation quantization takes symmetric int weights"):
        QuantScheme(num_bits=4, symmetric=False, input_activations={"strategy": "token"})
    from quantkit.checkpoints.quantization_config import parse_quantization_config

    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "format": "float-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "dynamic": True}}}}
    with pytest.raises(CheckpointError, match="strategy 'group' with dynamic=True is not supported"):
        parse_quantization_config(qc, "x/config.json")
    assert dequantize_weight(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(1), "tensor", None,
                             torch.float32).sum() == 0


def test_w4a16_with_fp8_kv_cache_recipe(tiny_llama, tmp_path, tokenizer):
    """awq-w4a16-fp8kv: int4 weights (pack-quantized) plus KV scales computed on the quantized layers."""
    over = ["stages.1.scheme.group_size=32", "calibration.num_samples=4", "calibration.seq_len=32"]
    out = quantize(str(tiny_llama), load_recipe("awq-w4a16-fp8kv", over), tmp_path / "q", progress=False).output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    model = quantkit.load(out, dtype=torch.float32)
    scales, calibrated = kv_scales(model)
    assert calibrated and len(scales) == model.config.num_hidden_layers
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    res = generate(model, tokenizer, sample_ids(tokenizer, 1, 8)[0].tolist(),
                   SamplingParams(max_new_tokens=4, ignore_eos=True), kv_cache_dtype="fp8")
    assert len(res.token_ids) == 4
