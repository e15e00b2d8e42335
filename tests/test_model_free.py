"""Model-free quantization (`quantize --model-free`): tensor by tensor from the shards, no model, no adapter.

For architectures quantkit knows, the weight files are byte for byte the layer-by-layer job's (dense llama, qwen2
with biases, gemma3, a qwen3 MoE and a Mixtral with routers; NVFP4's global scale shared by q/k/v and gate/up); for one it has no adapter for (phi3, fused qkv) the
output loads and each weight is the round-to-nearest of its source; for a config no library knows, the tensors
are still quantized by name and shape."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.cli import main as cli
from quantkit.errors import QuantizationError
from quantkit.flow.job import quantize
from quantkit.flow.model_free import quantize_model_free
from quantkit.flow.recipe import load_recipe
from quantkit.quant.intq import rtn
from quantkit.quant.schemes import resolve_scheme

RECIPES = [("rtn-w4a16", ["stages.0.scheme.group_size=32"]), ("rtn-w4a16-asym", ["stages.0.scheme.group_size=32"]),
           ("fp8-dynamic", []), ("mxfp8", []), ("nvfp4a16", []), ("rtn-w4a16", ["stages.0.scheme=MXFP4"])]
IDS = ["rtn", "rtn-asym", "fp8", "mxfp8", "nvfp4a16", "mxfp4"]


def _same_as_layer_by_layer(source, recipe, overrides, root):
    a = quantize(str(source), load_recipe(recipe, overrides), root / "layers", progress=False).output
    b = quantize_model_free(source, load_recipe(recipe, overrides), root / "free")
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    qb = json.loads((b / "config.json").read_text())["quantization_config"]
    assert filecmp.cmp(a / "model.safetensors", b / "model.safetensors", shallow=False)
    assert qa["config_groups"] == qb["config_groups"] and qa["format"] == qb["format"]
    # the same ignore list, plus MoE routers (Linear modules in some transformers versions, router classes in others)
    extra = set(qb["ignore"]) - set(qa["ignore"])
    assert set(qa["ignore"]) <= set(qb["ignore"]) and all(n.endswith(".gate") for n in extra), extra
    return b


@pytest.mark.parametrize("recipe,overrides", RECIPES, ids=IDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_byte_identical_to_the_layer_by_layer_job(tiny_models, tmp_path, arch, recipe, overrides):
    _same_as_layer_by_layer(tiny_models[arch], recipe, overrides, tmp_path)


@pytest.mark.parametrize("recipe,overrides", RECIPES[:1] + RECIPES[2:] + [("fp8-dynamic", ["stages.0.scheme=FP8_BLOCK"])],
                         ids=IDS[:1] + IDS[2:] + ["fp8-block"])
def test_byte_identical_a_block_of_rows_at_a_time(tiny_models, tmp_path, monkeypatch, recipe, overrides):
    """Weights quantized 32 rows at a time (128 for FP8 blocks): the same bytes as the whole tensor at once."""
    from quantkit.flow import model_free

    monkeypatch.setattr(model_free, "CHUNK_BYTES", 1)
    assert model_free.chunk_rows(resolve_scheme("W4A16", {}), 4096, 4096) == 32
    _same_as_layer_by_layer(tiny_models["qwen3"], recipe, overrides, tmp_path)


def test_byte_identical_on_qwen2_and_moe(tiny_models, tokenizer, tmp_path_factory):
    from conftest import make_tiny_model
    from test_moe import _save_tiny_moe

    root = tmp_path_factory.mktemp("mf")
    sources = {"qwen2": make_tiny_model("qwen2", root / "qwen2", tokenizer),
               "qwen3_moe": _save_tiny_moe(root / "qwen3_moe", tokenizer, "qwen3_moe", intermediate_size=96,
                                           moe_intermediate_size=32, num_experts=4, mlp_only_layers=[1]),
               "mixtral": _save_tiny_moe(root / "mixtral", tokenizer, "mixtral", intermediate_size=32,
                                         num_local_experts=4)}
    for name, source in sources.items():
        # NVFP4 on MoE: both paths share one global scale between each expert's gate and up (vLLM fuses them)
        for recipe, overrides in RECIPES[:1] + RECIPES[2:3] + RECIPES[4:5]:
            out = _same_as_layer_by_layer(source, recipe, overrides, root / f"{name}-{recipe}")
            if name != "qwen2":  # routers stay as they were
                tensors = load_file(str(out / "model.safetensors"))
                assert any(k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")) for k in tensors)
                if recipe == "nvfp4a16":  # one global scale for each expert's gate and up (w1 and w3)
                    expert = next(k for k in tensors if ".experts.0." in k).split(".experts.0.")[0] + ".experts.0."
                    gate, up = (("gate_proj", "up_proj") if name == "qwen3_moe" else ("w1", "w3"))
                    assert torch.equal(tensors[f"{expert}{gate}.weight_global_scale"],
                                       tensors[f"{expert}{up}.weight_global_scale"])


def test_an_architecture_without_adapter(tokenizer, tmp_path):
    """phi3 (fused qkv_proj and gate_up_proj): the layer-by-layer job refuses it and points at --model-free, which
    quantizes every linear to the RTN of its weight; quantkit loads and runs the result close to the original."""
    from conftest import make_tiny_model

    source = make_tiny_model("phi3", tmp_path / "phi3", tokenizer)
    res = CliRunner().invoke(cli, ["quantize", str(source), "--recipe", "rtn-w8a16", "-o", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--model-free" in res.output
    res = CliRunner().invoke(cli, ["quantize", str(source), "--recipe", "rtn-w8a16", "-o", str(tmp_path / "q"),
                                   "--model-free"])
    assert res.exit_code == 0, res.output
    original = load_file(str(source / "model.safetensors"))
    model = quantkit.load(tmp_path / "q", dtype=torch.float32)
    scheme = resolve_scheme("W8A16", {})
    names = [k.removesuffix(".weight") for k in original if k.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert len(names) == 6
    for name in names:
        want = rtn(original[name + ".weight"].float(), scheme, torch.float32).dequantize(torch.float32)
        assert torch.equal(model.get_submodule(name).dequantize(torch.float32), want), name
    ref = quantkit.load(source, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 0.02  # int8 per channel: close to the original


def test_a_config_no_library_knows_and_what_stays_16_bit(tmp_path):
    source = tmp_path / "mystery"
    source.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"encoder.tok.weight": torch.randn(100, 64, generator=g).bfloat16(),
               "blocks.0.mix.weight": torch.randn(128, 64, generator=g).bfloat16(),
               "blocks.0.mix.bias": torch.randn(128, generator=g).bfloat16(),
               "blocks.0.norm.weight": torch.ones(64).bfloat16(),
               "blocks.0.mlp.gate.weight": torch.randn(8, 64, generator=g).bfloat16(),
               "head.weight": torch.randn(100, 64, generator=g).bfloat16()}, str(source / "model.safetensors"))
    (source / "config.json").write_text(json.dumps({"model_type": "mystery-net", "torch_dtype": "bfloat16",
                                                     "vocab_size": 100}))
    notes = []
    out = quantize_model_free(source, load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
                              notify=notes.append)
    tensors = load_file(str(out / "model.safetensors"))
    assert "blocks.0.mix.weight_packed" in tensors and torch.equal(tensors["blocks.0.mix.bias"],
                                                                   load_file(str(source / "model.safetensors"))["blocks.0.mix.bias"])
    # vocab-sized (embedding, head) and router tensors are kept, and said
    for kept in ("encoder.tok.weight", "head.weight", "blocks.0.mlp.gate.weight"):
        assert kept in tensors and kept in notes[0]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and "head" in qc["ignore"]


def test_refusals(tiny_models, tmp_path):
    source = tiny_models["llama"]
    for recipe, what in (("gptq-w4a16", "needs calibration data"), ("gptq-q4_k_m", "needs calibration data"),
                         ("fp8-static", "needs calibration data")):
        with pytest.raises(QuantizationError, match=what):
            quantize_model_free(source, load_recipe(recipe), tmp_path / recipe)
        assert not (tmp_path / recipe).exists()
    done = quantize_model_free(source, load_recipe("rtn-w8a16"), tmp_path / "q")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model_free(done, load_recipe("rtn-w8a16"), tmp_path / "q2")
    with pytest.raises(Exception, match="--overwrite"):
        quantize_model_free(source, load_recipe("rtn-w8a16"), tmp_path / "q")
