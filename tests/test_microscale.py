"""NVFP4, MXFP4 and MXFP8 (`quant.fp4`, `quant.microscale`, `MicroLinear`, the three compressed-tensors formats):
e2m1 codes and their packing with fixed values, e4m3 and e8m0 scales with fixed values and against
compressed-tensors' own rules, the checkpoints decompressed by compressed-tensors and run by transformers,
GPTQ on the fixed scales, the emulated forward against a brute-force reference, and reloading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.errors import CheckpointError
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.qmodules.micro_linear import MicroLinear
from quantkit.quant import fp4, microscale
from quantkit.quant.gptq import gptq_quantize_fp8, hessian_error
from quantkit.quant.schemes import QuantScheme, resolve_scheme

from helpers import sample_ids

PRESETS = ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8")
FORMATS = {"tensor_group": "nvfp4-pack-quantized", "group4": "mxfp4-pack-quantized", "group8": "mxfp8-quantized"}


def _bf16_weight(rows=32, cols=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero group
    w[1, :32] *= 1e-3  # tiny groups
    w[2, 5] = 0.9  # an outlier
    return w.to(torch.bfloat16).float()


# -- bits -------------------------------------------------------------------------------------------------


def test_e2m1_rounding_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 7.0, 1e9, -0.25, -0.3, -4.5, -6.5])
    want = [0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -0.5, -4.0, -6.0]
    assert fp4.round_e2m1(x).tolist() == want
    assert fp4.codes(fp4.round_e2m1(x)).tolist() == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 8, 9, 14, 15]


def test_e2m1_rounding_by_spacing_equals_the_bounds_bit_for_bit():
    """The fast rounding (divide by the grid spacing, round half to even) against the bound-by-bound reference
    over a sweep of float32 bit patterns from 0 to past 8 (every tie among them), both signs, and the specials."""
    import numpy as np

    sweep = torch.from_numpy(np.arange(0, 0x41100000, 61, dtype=np.int64).astype(np.int32)).view(torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e-45, 3e38, float("inf"), float("nan")])
    for x in (sweep, -sweep, ties, -ties):
        fast, ref = fp4.round_e2m1(x), fp4.round_e2m1_reference(x)
        assert torch.equal(fast.view(torch.int32), ref.view(torch.int32))  # signs of zero too


def test_e2m1_codes_pack_low_nibble_first():
    values = torch.tensor([[0.5, 1.0, -6.0, 0.0, 3.0, -0.5]])
    c = fp4.codes(values)
    assert c.tolist() == [[1, 2, 15, 0, 5, 9]]
    packed = fp4.pack(c)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F, 0x95]]
    assert torch.equal(fp4.unpack(packed), c) and fp4.values(c).tolist() == values.tolist()
    with pytest.raises(ValueError, match="even number"):
        fp4.pack(c[:, :5])


def test_pack_equals_compressed_tensors_packing():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    g = torch.Generator().manual_seed(3)
    values = fp4.round_e2m1(torch.randn(16, 64, generator=g) * 3)
    assert torch.equal(fp4.pack(fp4.codes(values)), pack_fp4_to_uint8(values))
    assert torch.equal(fp4.values(fp4.unpack(fp4.pack(fp4.codes(values)))),
                       unpack_fp4_from_uint8(fp4.pack(fp4.codes(values)), 16, 64, dtype=torch.float32))


def test_nvfp4_scales_are_fixed_values():
    g = microscale.nvfp4_global_scale(torch.tensor(2.0))
    assert g.dtype == torch.float32 and g.tolist() == [1344.0]  # 448 * 6 / 2
    s = microscale.nvfp4_group_scales(torch.tensor([2.0, 1.0, 0.0, 0.013]), g)
    assert s.dtype == torch.float8_e4m3fn
    # 1344 * amax / 6: 448, 224, 0 -> 0.125 (e4m3's epsilon), 2.912 -> 3.0 (nearest e4m3)
    assert s.float().tolist() == [448.0, 224.0, 0.125, 3.0]
    assert microscale.nvfp4_global_scale(torch.tensor(0.0)).tolist() == [1.0]


def test_e8m0_scales_are_fixed_values():
    amax = torch.tensor([1.0, 1.7, 1.75, 6.0, 0.0, 448.0, 2.0 ** -140])
    e4 = microscale.mx_exponents(amax, 4)
    # 1 -> 2^0 - 2; 1.7 -> 2^0 (its mantissa is under 1.75) - 2; 1.75 -> 2^1 - 2; 6 = 1.5 x 4 -> 2^2 - 2; 0 -> 0
    assert e4.dtype == torch.uint8 and e4.tolist()[:5] == [125, 125, 126, 127, 0]
    assert microscale.mx_exponents(amax[5:6], 8).tolist() == [128]  # 448 = 1.75 x 2^8 -> 2^9, minus 8
    assert e4.tolist()[6] == 0  # below e8m0's range: the smallest scale
    assert microscale.e8m0_values(torch.tensor([127, 125, 0, 254], dtype=torch.uint8)).tolist() == \
        [1.0, 0.25, 2.0 ** -127, 2.0 ** 127]
    q = microscale.quantize_weight(torch.tensor([[1.7] + [0.0] * 31]), resolve_scheme("MXFP4A16", {}))
    assert q.q.float()[0, 0] == 6.0  # 1.7 / 0.25 = 6.8 saturates at 6


def test_mx_exponents_equal_compressed_tensors():
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    g = torch.Generator().manual_seed(4)
    amax = (torch.rand(4096, generator=g) * 2.0 ** torch.randint(-30, 30, (4096,), generator=g)).to(torch.bfloat16)
    for bits in (4, 8):
        theirs = generate_mx_scales(amax, bits).clamp(0, 254).to(torch.uint8)
        assert torch.equal(microscale.mx_exponents(amax.float(), bits), theirs)


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16", "MXFP8A16"])
def test_elements_equal_compressed_tensors_compression(preset):
    """On compressed-tensors' own scales, our elements (and their packing) are its compressor's bytes; for MX
    the scales themselves are its rule's too (NVFP4's: ours divides amax by 6 in float32 rather than in the
    weight's dtype, so a scale can differ by one e4m3 step where that rounding tips a tie)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    comp = {"NVFP4A16": NVFP4PackedCompressor, "MXFP4A16": MXFP4PackedCompressor,
            "MXFP8A16": MXFP8QuantizationCompressor}[preset]
    sc, cts = resolve_scheme(preset, {}), QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    w = _bf16_weight()
    wb = w.to(torch.bfloat16)
    amax_g = wb.reshape(32, -1, sc.group_size).abs().amax(-1)
    gs = generate_gparam(-w.abs().amax().reshape(1), w.abs().amax().reshape(1)) if preset == "NVFP4A16" else None
    s, _ = calculate_qparams(-amax_g, amax_g, cts.weights, global_scale=gs)
    theirs = comp.compress({"weight": wb, "weight_scale": s, **({"weight_global_scale": gs} if gs is not None else {})},
                           cts)
    if gs is not None:
        ours_scale = s.to(torch.float8_e4m3fn)
        assert torch.equal(gs, microscale.quantize_weight(w, sc).global_scale)
    else:
        ours_scale = microscale.quantize_weight(w, sc).scale
        assert torch.equal(theirs["weight_scale"], ours_scale)
    elements = microscale.quantize_on(w, ours_scale, gs, sc)
    if sc.num_bits == 4:
        assert torch.equal(theirs["weight_packed"], fp4.pack(fp4.codes(elements)))
    else:
        assert torch.equal(theirs["weight"].view(torch.uint8), elements.view(torch.uint8))


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_match_compressed_tensors(preset):
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    ours, theirs = resolve_scheme(preset, {}), PRESET_SCHEMES[preset]
    w = theirs["weights"]
    assert (ours.num_bits, ours.type, ours.strategy, ours.group_size) == (w.num_bits, w.type, w.strategy, w.group_size)
    acts = theirs.get("input_activations")
    if acts is None:
        assert ours.input_activations is None
    else:
        a = ours.input_activations
        assert (a.num_bits, a.strategy, a.group_size, a.dynamic) == (acts.num_bits, acts.strategy, acts.group_size,
                                                                     acts.dynamic)


@pytest.mark.parametrize("fields, message", [
    (dict(num_bits=4, type="float", strategy="tensor_group", group_size=32), "NVFP4: num_bits 4, group_size 16"),
    (dict(num_bits=4, type="float", strategy="group", group_size=16), "MX: num_bits 4 or 8, group_size 32"),
    (dict(num_bits=4, type="float", strategy="group", group_size=32, symmetric=False), "symmetric"),
    (dict(num_bits=4, type="float", strategy="group", group_size=32,
          input_activations={"num_bits": 8, "strategy": "group", "group_size": 32}), "MXFP4 activations"),
    (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16,
          input_activations={"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "dynamic": True}), "local"),
    (dict(num_bits=4, type="float", strategy="channel"), "FP8 e4m3"),
])
def test_bad_microscaled_schemes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        QuantScheme(**fields)


# -- maths -----------------------------------------------------------------------------------------------


def _nearest_e2m1_brute_force(x: float) -> float:
    """The e2m1 value nearest to x; a tie to the one whose grid index is even (even mantissa bit), saturating."""
    grid = [(abs(abs(x) - v), i % 2, v) for i, v in enumerate(fp4.E2M1_VALUES)]
    v = min(grid)[2]
    return -v if x < 0 else v


def _reference_quantize(x: torch.Tensor, bits: int, group: int, global_scale) -> torch.Tensor:
    """Quantize-dequantize with Python floats, a group at a time: the format's definition written plainly (the
    step and each dequantized value rounded to float32 as the format computes them)."""
    out = x.double().clone().reshape(-1, group)
    for row in out:
        amax = float(row.abs().max())
        if global_scale is not None:
            gs = float(global_scale)
            s = float(torch.tensor(min(gs * (amax / 6), 448.0), dtype=torch.float32).to(torch.float8_e4m3fn).float())
            step = float(torch.tensor(s if s else 0.125) / torch.tensor(gs))
        else:
            p = 0 if amax == 0 else int(torch.floor(torch.log2(torch.tensor(amax, dtype=torch.float64))))
            mant = amax / 2.0 ** p if amax else 0.0
            p += mant >= 1.75
            step = 2.0 ** max(p - (2 if bits == 4 else 8), -127)
        for k in range(len(row)):
            y = float(torch.tensor(float(row[k]), dtype=torch.float32) / torch.tensor(step, dtype=torch.float32))
            if bits == 4:
                v = _nearest_e2m1_brute_force(y)
            else:
                v = float(torch.tensor(max(min(y, 448.0), -448.0)).to(torch.float8_e4m3fn).float())
            row[k] = float(torch.tensor(v * step, dtype=torch.float32))  # a float32 product, as the format's
    return out.reshape(x.shape)


@pytest.mark.parametrize("preset", PRESETS)
def test_module_forward_equals_a_brute_force_reference(preset):
    """Weights and (where the scheme says) activations quantized group by group with Python floats, then one
    float64 matmul: the module's float32 forward within float32 rounding of it."""
    sc = resolve_scheme(preset, {})
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=g) * 0.05
    bias = torch.randn(24, generator=g) * 0.1
    x = torch.randn(3, 64, generator=g) * torch.linspace(0.1, 4, 64)
    qw = microscale.quantize_weight(w, sc)
    acts = sc.input_activations
    if acts is not None and acts.dynamic == "local":
        qw.input_global_scale = microscale.nvfp4_global_scale(x.abs().amax() * 1.5)  # as calibrated on larger inputs
    mod = MicroLinear.from_quantized(qw, bias)
    w_ref = _reference_quantize(w, sc.num_bits, sc.group_size, qw.global_scale)
    x_ref = x.double() if acts is None else _reference_quantize(x, acts.num_bits, acts.group_size,
                                                                 qw.input_global_scale)
    want = x_ref @ w_ref.t() + bias.double()
    assert torch.equal(mod.dequantize(torch.float64), w_ref)
    torch.testing.assert_close(mod(x).double(), want, rtol=1e-5, atol=1e-5)
    if acts is not None:  # the activation quantization is in the output
        assert (x.double() @ w_ref.t() + bias.double() - want).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16", "MXFP8A16"])
def test_gptq_on_fixed_scales_beats_nearest(preset):
    """GPTQ keeps the nearest rounding's scales, puts every element on the grid, and lowers the Hessian-weighted
    error below the nearest rounding's on correlated inputs."""
    sc = resolve_scheme(preset, {})
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 128, generator=g) * 0.05
    mix = torch.randn(128, 128, generator=g) * 0.3 + torch.eye(128)
    X = torch.randn(1024, 128, generator=g) @ mix
    H = X.t() @ X / 1024
    near = microscale.quantize_weight(w, sc)
    res = gptq_quantize_fp8(w.clone(), H, near.group_scales(), 128, 0.01, False, columns_per_scale=sc.group_size,
                            element_bits=sc.num_bits)
    solved = microscale.MicroWeight(res.weight, near.scale, near.global_scale, sc)
    if sc.num_bits == 4:
        assert torch.equal(fp4.round_e2m1(res.weight.float()), res.weight.float())
    ratio = hessian_error(w, solved.dequantize(), H) / hessian_error(w, near.dequantize(), H)
    assert ratio < 0.8, ratio


def test_nvfp4_group_shares_one_global_scale():
    sc = resolve_scheme("NVFP4A16", {})
    a, b = torch.randn(16, 64), torch.randn(8, 64) * 4
    qa, qb = microscale.quantize_group([a, b], sc)
    assert torch.equal(qa.global_scale, qb.global_scale)
    assert torch.equal(qa.global_scale, microscale.nvfp4_global_scale(b.abs().amax().clamp(min=a.abs().amax())))


# -- checkpoints ---------------------------------------------------------------------------------------------


CASES = {"nvfp4a16": ("nvfp4a16", []), "nvfp4": ("nvfp4", ["calibration.num_samples=4", "calibration.seq_len=32"]),
         "mxfp4": ("mxfp4", ["calibration.num_samples=4", "calibration.seq_len=32"]), "mxfp8": ("mxfp8", []),
         "rtn-nvfp4": ("nvfp4a16", ["stages.0.scheme=NVFP4"])}


@pytest.fixture(scope="module")
def micro_checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    return {name: quantize(str(tiny_models["llama"]), load_recipe(recipe, overrides), root / name,
                           progress=False).output for name, (recipe, overrides) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_decompressed_by_compressed_tensors_equals_ours(micro_checkpoints, case):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    path = micro_checkpoints[case]
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(raw).config_groups["group_0"]
    comp = {"nvfp4-pack-quantized": NVFP4PackedCompressor, "mxfp4-pack-quantized": MXFP4PackedCompressor,
            "mxfp8-quantized": MXFP8QuantizationCompressor}[raw["format"]]
    tensors = load_file(str(path / "model.safetensors"))
    ours = quantkit.load(path)
    checked = 0
    for name, module in ours.named_modules():
        if not isinstance(module, MicroLinear):
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        assert set(local) == set(module.state_dict())
        theirs = comp.decompress(local, scheme)["weight"]
        assert torch.equal(theirs.to(torch.bfloat16), module.dequantize(torch.bfloat16)), name
        checked += 1
    assert checked == 21
    if raw["format"] == "nvfp4-pack-quantized":  # q/k/v and gate/up share their global scale (vLLM fuses them)
        layer = "model.layers.1."
        for names in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            scales = {float(tensors[layer + n + ".weight_global_scale"]) for n in names}
            assert len(scales) == 1, names
        if case != "nvfp4a16":
            assert float(tensors[layer + "self_attn.q_proj.input_global_scale"]) > 0


def _compressed_tensors_nvfp4_input_rule(m: MicroLinear):
    """compressed-tensors' emulation of NVFP4 activations: amax / 6 rounded in the activation's dtype before the
    global scale multiplies it (ours, the exact rule: in float32), the rest as ours."""
    def forward(x):
        g = m.input_global_scale
        xg = microscale.grouped(x, 16)
        s = (g * (xg.abs().amax(-1) / 6)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        step = (torch.where(s == 0, torch.full_like(s, 0.125), s) / g).unsqueeze(-1)
        xq = (fp4.round_e2m1(xg / step) * step).reshape(x.shape).to(x.dtype)
        return torch.nn.functional.linear(xq, m.dequantize(x.dtype), None if m.bias is None else m.bias.to(x.dtype))
    return forward


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_runs_the_checkpoint_as_we_do(micro_checkpoints, tokenizer, case):
    """transformers (compressed-tensors' decompression and activation emulation) gives our bf16 logits exactly;
    for NVFP4 activations once our model takes compressed-tensors' rounding of amax / 6 (with ours the logits
    differ by that rounding at e4m3 ties only)."""
    from transformers import AutoModelForCausalLM

    path = micro_checkpoints[case]
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = quantkit.load(path, dtype=torch.bfloat16)
    ids = sample_ids(tokenizer, 2)
    nvfp4_acts = case in ("nvfp4", "rtn-nvfp4")
    with torch.no_grad():
        b = theirs(ids).logits.float()
        own = ours(ids).logits.float()
        if nvfp4_acts:
            for m in ours.modules():
                if isinstance(m, MicroLinear):
                    m.forward = _compressed_tensors_nvfp4_input_rule(m)
        a = ours(ids).logits.float()
    assert torch.equal(a, b)
    if nvfp4_acts:
        assert 0 < (own - b).abs().max() < 0.2 * float(b.abs().max())


@pytest.mark.parametrize("recipe", ["nvfp4a16", "mxfp8", "mxfp4"])
def test_reloaded_model_equals_the_in_memory_one(tiny_models, tokenizer, tmp_path, recipe):
    overrides = CASES[recipe][1]
    in_memory, _ = quantkit.quantize(tiny_models["llama"], recipe, overrides=overrides, dtype=torch.float32)
    quantkit.save(in_memory, tmp_path / "q")
    reloaded = quantkit.load(tmp_path / "q", dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        assert torch.equal(in_memory(ids).logits, reloaded(ids).logits)


def test_bad_microscaled_config_is_refused():
    from quantkit.checkpoints.quantization_config import parse_quantization_config

    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "format": "nvfp4-pack-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16, "symmetric": True}}}}
    with pytest.raises(CheckpointError, match="config_groups.g.weights: nvfp4-pack-quantized needs"):
        parse_quantization_config(qc, "x")
    qc["config_groups"]["g"]["weights"]["strategy"] = "tensor_group"
    qc["config_groups"]["g"]["input_activations"] = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                     "group_size": 16, "dynamic": False}
    with pytest.raises(CheckpointError, match="config_groups.g.input_activations"):
        parse_quantization_config(qc, "x")


def test_forced_kernel_is_refused():
    mod = MicroLinear.from_quantized(microscale.quantize_weight(torch.randn(8, 32), resolve_scheme("MXFP4A16", {})),
                                     None)
    mod.kernel_request = "cpu"
    with pytest.raises(Exception, match="run by emulation"):
        mod(torch.randn(2, 32))


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16"])
def test_searched_scales_never_lose_to_the_nearest_rule(preset):
    """Each group's searched scale is a neighbour of the rule's on the scale grid, and its importance-weighted
    error is at most the rule's (the rule's scale is a candidate); somewhere it is strictly lower."""
    sc = resolve_scheme(preset, {})
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 128, generator=g) * 0.05
    imp = torch.rand(128, generator=g) * 4
    near, found = microscale.quantize_weight(w, sc), microscale.searched_scales(w, sc, imp)

    def err(qw):
        d = (qw.dequantize() - w).square() * imp
        return microscale.grouped(d, sc.group_size).sum(-1)

    assert (err(found) <= err(near) + 1e-12).all() and (err(found) < err(near)).any()
    steps = (found.scale.view(torch.uint8).int() - near.scale.view(torch.uint8).int())
    assert steps.min() >= -2 and steps.max() <= 1
    if preset == "NVFP4A16":
        assert torch.equal(found.global_scale, near.global_scale)


def test_gptq_scale_search_is_accepted_for_microscaled_schemes():
    from quantkit.algorithms.gptq import GPTQ, GPTQConfig

    GPTQ(GPTQConfig(scale_search=True), resolve_scheme("NVFP4", {}))
    with pytest.raises(Exception, match="NVFP4 / MX formats"):
        GPTQ(GPTQConfig(scale_search=True), resolve_scheme("W4A16", {}))
