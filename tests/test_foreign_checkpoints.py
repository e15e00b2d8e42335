"""GPTQ (AutoGPTQ v1, GPTQModel v2) and AWQ GEMM checkpoints: bit layouts, reading, converting, exporting.

The layouts are checked against packers written here from the formats' own definitions, one element at a time
in Python integers, and against fixed words worked out by hand; the dequantized weights of a converted
act-order checkpoint against compressed-tensors' own decompressor. (GPTQModel, the reader transformers uses
for both formats, needs a newer torch than the one pinned here; `bench/foreign_peer.py` runs it in a venv of
its own: its dequantized weights equal ours rounded to its fp16.) compressed-tensors' decompressor reads the
converted checkpoints in `test_converted_checkpoints_decompress_in_compressed_tensors`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.checkpoints.foreign_io import convert_foreign, export_foreign
from quantkit.cli import main as cli
from quantkit.errors import CheckpointError
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.quant import foreign_layouts as fl
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.schemes import QuantScheme
from helpers import sample_ids

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# --- the formats' definitions, element by element --------------------------------------------------------------

def _stream_words(values: list[int], bits: int) -> list[int]:
    """Values packed as one little-endian bit stream into int32 words (value i at stream bits b*i ..)."""
    n_words = (len(values) * bits + 31) // 32
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (bits * i)
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def gptq_pack_reference(u: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight of unsigned codes u [out, in]: per output column, the input codes as a bit stream."""
    cols = [_stream_words(u[o].tolist(), bits) for o in range(u.shape[0])]
    return torch.tensor(cols, dtype=torch.int32).t().contiguous()  # [in * b / 32, out]


def awq_pack_reference(u: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM qweight of unsigned codes u [in, out]: word c of row i holds column 8c + ORDER[k] at nibble k."""
    rows, cols = u.shape
    out = []
    for i in range(rows):
        row = []
        for c in range(cols // 8):
            word = 0
            for k in range(8):
                word |= int(u[i, 8 * c + AWQ_ORDER[k]]) << (4 * k)
            row.append(word - (1 << 32) if word >= 1 << 31 else word)
        out.append(row)
    return torch.tensor(out, dtype=torch.int32)


def test_gptq_and_awq_words_fixed_values():
    # GPTQ 4-bit: input codes 0..7 of one output column fill one word, code i at bits 4i
    u = torch.arange(8).reshape(1, 8) % 16
    assert fl.codes_to_gptq(fl.IntCodes((u - 8).to(torch.int8), torch.ones(1, 1), None, None, 4), 2)[
        "qweight"].tolist() == [[0x76543210]]
    assert gptq_pack_reference(u, 4).tolist() == [[0x76543210]]
    # GPTQ 3-bit: codes 0..7 repeating over 32 inputs fill 3 words; code 10 (= 2) straddles words 0 and 1
    u3 = (torch.arange(32) % 8).reshape(1, 32)
    words = fl.codes_to_gptq(fl.IntCodes((u3 - 4).to(torch.int8), torch.ones(1, 1), None, None, 3), 2)["qweight"]
    assert [w & 0xFFFFFFFF for w in words[:, 0].tolist()] == [0x88FAC688, 0xC688FAC6, 0xFAC688FA] \
        == [w & 0xFFFFFFFF for w in gptq_pack_reference(u3, 3)[:, 0].tolist()]
    # AWQ: row 0 of columns u = 3 o mod 16: nibbles in the order 0 2 4 6 1 3 5 7 -> 0 6 12 2 3 9 15 5
    ua = (3 * torch.arange(8) % 16).reshape(1, 8)
    qweight = fl.codes_to_awq(fl.IntCodes((ua.t() - 8).to(torch.int8), torch.ones(8, 1), None, None, 4))["qweight"]
    assert [w & 0xFFFFFFFF for w in qweight.flatten().tolist()] == [0x5F932C60]
    assert torch.equal(qweight, awq_pack_reference(ua))


def _random_gptq(bits: int, version: int, act_order: bool, seed: int = 0, out: int = 8, inp: int = 64, group: int = 16):
    """A hand-built 8 x 64 GPTQ linear, packed by the definition, with the weights it defines."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // group
    u = torch.randint(0, 1 << bits, (out, inp), generator=g)
    z = torch.randint(1, 1 << bits, (groups, out), generator=g)  # true zeros; v1 stores z - 1
    scales = (torch.rand(groups, out, generator=g) * 0.02 + 0.001).half()
    g_idx = torch.arange(inp) // group
    if act_order:
        g_idx = g_idx[torch.randperm(inp, generator=g)]
    stored = z - (1 if version == 1 else 0)
    qzeros = torch.tensor([_stream_words(stored[k].tolist(), bits) for k in range(groups)], dtype=torch.int32)
    tensors = {"qweight": gptq_pack_reference(u, bits), "qzeros": qzeros, "scales": scales,
               "g_idx": g_idx.to(torch.int32)}
    weight = (u - z.t()[:, g_idx]).float() * scales.float().t()[:, g_idx]  # s (u - z) per column's group
    return tensors, weight


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reads_as_defined_and_round_trips(bits, version, act_order):
    tensors, weight = _random_gptq(bits, version, act_order)
    codes = fl.gptq_to_codes(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits, 16,
                             version)
    assert (codes.g_idx is not None) == act_order
    scheme = QuantScheme(num_bits=bits, symmetric=False, group_size=16, actorder="group" if act_order else None)
    module = PackedIntLinear(64, 8, False, scheme, torch.float16)
    module.weight_packed.copy_(fl.pack_int32(codes.q, bits, dim=1))
    module.weight_scale.copy_(codes.scale)
    module.weight_zero_point.copy_(fl.pack_int32(codes.zero_point, bits, dim=0))
    if act_order:
        module.weight_g_idx.copy_(codes.g_idx)
    assert torch.equal(module.dequantize(torch.float32), weight)
    back = fl.codes_to_gptq(codes, version)
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(back[key], tensors[key]), key


def test_gptq_symmetric_grid_drops_zero_points_and_v1_limits():
    tensors, _ = _random_gptq(4, 1, False)
    tensors["qzeros"] = torch.full_like(tensors["qzeros"], 0x77777777)  # v1: every zero stored as 7, i.e. 8
    codes = fl.gptq_to_codes(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 4, 16, 1)
    assert codes.zero_point is None  # a symmetric grid: compressed-tensors' symmetric int4
    # v1 wraps a zero of 0 to 15, read back as 16: no 4-bit zero point holds it
    tensors["qzeros"] = torch.full_like(tensors["qzeros"], -1)
    with pytest.raises(fl.LayoutError, match="v1"):
        fl.gptq_to_codes(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 4, 16, 1)
    zero = fl.IntCodes(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 4), torch.full((8, 4), -8, dtype=torch.int8),
                       None, 4)
    with pytest.raises(fl.LayoutError, match="gptq_v2"):
        fl.codes_to_gptq(zero, 1)
    assert fl.gptq_to_codes(**{k: v for k, v in zip(("qweight", "qzeros", "scales"),
                                                    fl.codes_to_gptq(zero, 2).values())},
                            g_idx=None, bits=4, group_size=16, version=2).zero_point.eq(-8).all()


def test_awq_reads_as_defined_and_round_trips():
    g = torch.Generator().manual_seed(1)
    inp, out, group = 64, 16, 32
    u = torch.randint(0, 16, (inp, out), generator=g)
    z = torch.randint(0, 16, (inp // group, out), generator=g)
    scales = (torch.rand(inp // group, out, generator=g) * 0.02).half()
    codes = fl.awq_to_codes(awq_pack_reference(u), awq_pack_reference(z), scales)
    weight = ((u - z.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)).t()
    qw = QuantizedWeight(codes.q, codes.scale, codes.zero_point, QuantScheme(symmetric=False, group_size=group))
    assert torch.equal(qw.dequantize(torch.float32), weight)
    back = fl.codes_to_awq(codes)
    assert torch.equal(back["qweight"], awq_pack_reference(u)) and torch.equal(back["qzeros"], awq_pack_reference(z))
    with pytest.raises(fl.LayoutError, match="4 bits"):
        fl.codes_to_awq(fl.IntCodes(codes.q, codes.scale, None, None, 8))


def test_act_order_kernels_equal_the_reference_path():
    """An act-order layer runs the CPU int4 kernel on permuted columns and permuted inputs: the same result as
    the reference (gather each column's scale, dequantize, matmul), to float rounding."""
    tensors, weight = _random_gptq(4, 2, True, out=32, inp=128, group=32)
    codes = fl.gptq_to_codes(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 4, 32, 2)
    scheme = QuantScheme(symmetric=False, group_size=32, actorder="group")
    qw = QuantizedWeight(codes.q, codes.scale.float(), codes.zero_point, scheme)
    module = PackedIntLinear.from_quantized(qw, None, g_idx=codes.g_idx)
    assert module.column_order() is not None
    # a fresh act-order module (what the decode plan times) holds contiguous groups: the kernels' path, not the reference
    assert torch.equal(PackedIntLinear(128, 32, False, scheme, torch.float32).column_order(), torch.arange(128))
    x = torch.randn(3, 128)
    reference = x @ weight.t()
    module.kernel_request = "torch"
    torch.testing.assert_close(module(x), reference, rtol=1e-5, atol=1e-5)
    module.kernel_request = None
    name = module.prepare(x.device, torch.float32)
    torch.testing.assert_close(module(x), reference, rtol=1e-5, atol=1e-5)
    assert name in ("cpu", "torch")


# --- whole checkpoints ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rtn_checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    out = {}
    for sym in (True, False):
        recipe = load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32", f"stages.0.scheme.symmetric={str(sym).lower()}"])
        out[sym] = quantize(str(tiny_models["llama"]), recipe, root / f"rtn-{sym}", progress=False).output
    return out


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("method,version", [("gptq", 1), ("gptq", 2), ("awq", 1)])
def test_export_load_and_convert_back_exactly(rtn_checkpoints, tokenizer, tmp_path, sym, method, version):
    """quantkit checkpoint -> GPTQ / AWQ -> quantkit.load gives the same logits; convert back gives the same tensors."""
    ct = rtn_checkpoints[sym]
    foreign = export_foreign(ct, tmp_path / "f", method, version)
    qc = json.loads((foreign / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == method and qc["bits"] == 4 and qc["group_size"] == 32
    if method == "gptq":
        assert qc["sym"] is sym and qc["checkpoint_format"] == ("gptq" if version == 1 else "gptq_v2")
    stored = load_file(str(foreign / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.qweight"].shape == ((128 // 8, 64) if method == "gptq" else (128, 8))
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        want = quantkit.load(ct, dtype=torch.float32)(ids).logits
        assert torch.equal(quantkit.load(foreign, dtype=torch.float32)(ids).logits, want)
    back = convert_foreign(foreign, tmp_path / "back", method)
    a, b = load_file(str(ct / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _act_order_gptq(src, out, seed: int = 0):
    """A GPTQ checkpoint with act-order groups made from quantkit's g32 one: each linear's columns get groups in
    a random order (a different model, the one its g_idx defines). Returns the weights it defines."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    defined = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        module = key.removesuffix(".qweight")
        inp = tensors[key].shape[0] * 8
        g_idx = (torch.arange(inp) // 32)[torch.randperm(inp, generator=g)].to(torch.int32)
        tensors[f"{module}.g_idx"] = g_idx
        codes = fl.gptq_to_codes(tensors[key], tensors[f"{module}.qzeros"], tensors[f"{module}.scales"], g_idx, 4, 32, 1)
        zp = codes.zero_point if codes.zero_point is not None else torch.zeros_like(codes.scale, dtype=torch.int8)
        defined[module] = (codes.q.float() - zp.float()[:, g_idx.long()]) * codes.scale.float()[:, g_idx.long()]
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return defined


def test_act_order_gptq_loads_runs_and_refuses_conversion(rtn_checkpoints, tokenizer, tmp_path, monkeypatch):
    """An act-order GPTQ checkpoint loads with each column on its group's grid (the definition's weights), runs the
    kernels on permuted columns with the reference's result, and is refused by convert, which has no layout for it
    (compressed-tensors removed actorder 'group'), with the reason."""
    gptq = export_foreign(rtn_checkpoints[False], tmp_path / "g", "gptq", 1)
    defined = _act_order_gptq(gptq, tmp_path / "act")
    model = quantkit.load(tmp_path / "act", dtype=torch.float32)
    for module, weight in defined.items():
        layer = model.get_submodule(module)
        assert layer.weight_g_idx is not None and torch.equal(layer.dequantize(torch.float32), weight), module
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        fast = model(ids).logits
        monkeypatch.setenv("QUANTKIT_KERNEL", "torch")
        exact = quantkit.load(tmp_path / "act", dtype=torch.float32)(ids).logits
    torch.testing.assert_close(fast, exact, rtol=1e-4, atol=1e-4)
    # the decode step (its own int4 op calls and fused projections) permutes too: its logits are the forward's
    from test_generate import _lean_logits

    # the CPU int4 op named, not measured: the decode plan's own choice differs between machines (float32 decode
    # picked the reference path on an AMX Xeon, the int4 op on an AVX-512 EPYC)
    monkeypatch.setenv("QUANTKIT_KERNEL", "cpu")
    decoder = quantkit.load(tmp_path / "act", dtype=torch.float32, workload="decode")
    assert decoder.get_submodule(next(iter(defined))).prepare(torch.device("cpu"), torch.float32) == "cpu"
    with torch.no_grad():
        lean = _lean_logits(decoder, ids[:1], 6)
    torch.testing.assert_close(lean, exact[:1, -6:], rtol=1e-4, atol=1e-4)
    res = CliRunner().invoke(cli, ["convert", "gptq", str(tmp_path / "act"), "-o", str(tmp_path / "ct")])
    assert res.exit_code != 0 and "actorder 'group'" in res.output and "quantkit loads" in res.output
    assert not (tmp_path / "ct").exists()


def test_converted_checkpoints_decompress_in_compressed_tensors(rtn_checkpoints, tmp_path):
    """GPTQ v1 (asym) and AWQ (sym) converted to compressed-tensors: its own decompressor gives our weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for sym, method in ((False, "gptq"), (True, "awq")):
        foreign = export_foreign(rtn_checkpoints[sym], tmp_path / f"{method}", method, 1)
        ct = convert_foreign(foreign, tmp_path / f"{method}-ct", method)
        qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
        tensors = load_file(str(ct / "model.safetensors"))
        ours = quantkit.load(foreign)
        checked = 0
        for name, module in ours.named_modules():
            if isinstance(module, PackedIntLinear):
                scheme = next(g for g in qc.config_groups.values() if name in g.targets)
                local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
                theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
                assert torch.equal(theirs, module.dequantize(theirs.dtype)), name
                checked += 1
        assert checked == 21


def test_refusals_name_the_input_and_the_fix(rtn_checkpoints, tiny_models, tmp_path):
    ct = rtn_checkpoints[False]
    with pytest.raises(CheckpointError, match="not a compressed-tensors quantized checkpoint"):
        export_foreign(tiny_models["llama"], tmp_path / "x", "gptq")
    with pytest.raises(CheckpointError, match="not 'awq': use quantkit convert gptq"):
        convert_foreign(export_foreign(ct, tmp_path / "g", "gptq", 2), tmp_path / "y", "awq")
    w8 = quantize(str(tiny_models["llama"]), load_recipe("rtn-w8a16"), tmp_path / "w8", progress=False).output
    with pytest.raises(CheckpointError, match="AWQ GEMM holds 4 bits only"):
        export_foreign(w8, tmp_path / "z", "awq")
    assert not (tmp_path / "z").exists()
    res = CliRunner().invoke(cli, ["export", "gptq", str(ct), "-o", str(tmp_path / "g")])
    assert res.exit_code != 0 and "--overwrite" in res.output  # an existing output is never replaced silently
    foreign = tmp_path / "g"
    config = json.loads((foreign / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "marlin"
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="checkpoint_format 'marlin'"):
        quantkit.load(foreign)


@pytest.mark.slow
def test_smollm2_as_gptq_and_awq_scores_and_generates_as_the_original(smollm2_rtn64, emma_ppl, tmp_path):
    """The real model's rtn-w4a16 g64 checkpoint exported as GPTQ (v1) and AWQ: quantkit reads the GPTQ one with the
    same perplexity as the compressed-tensors original (the same weights) and generates from it; the AWQ one gives
    the original's logits; both convert back to the original's tensors."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    gptq = export_foreign(smollm2_rtn64, tmp_path / "gptq", "gptq", 1)
    assert emma_ppl(gptq, 2) == emma_ppl(smollm2_rtn64, 2)
    model = quantkit.load(gptq, dtype=torch.float32)
    tokenizer = quantkit.load_tokenizer(gptq)
    ids = tokenizer("The capital of France is")["input_ids"]
    out = generate(model, tokenizer, ids, SamplingParams(max_new_tokens=8))
    assert len(out.token_ids) > 0 and out.text.strip()
    awq = export_foreign(smollm2_rtn64, tmp_path / "awq", "awq")
    with torch.no_grad():
        want = quantkit.load(smollm2_rtn64, dtype=torch.float32)(torch.tensor([ids])).logits
        assert torch.equal(quantkit.load(awq, dtype=torch.float32)(torch.tensor([ids])).logits, want)
    for method, foreign in (("gptq", gptq), ("awq", awq)):
        back = convert_foreign(foreign, tmp_path / f"{method}-ct", method)
        a, b = load_file(str(smollm2_rtn64 / "model.safetensors")), load_file(str(back / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
