"""The Python API (`quantkit.quantize`, `quantkit.save`): in memory, then the same files as the CLI job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.errors import OutputExistsError, QuantizationError, QuantkitError
from quantkit.flow.job import quantize as quantize_job
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.flow.recipe import load_recipe

SMALL = ["calibration.num_samples=6", "calibration.seq_len=32"]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert ca == cb
    assert (a / "recipe.yaml").read_text() == (b / "recipe.yaml").read_text()


@pytest.mark.parametrize("recipe, overrides", [
    ("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
    ("gptq-w4a16", ["stages.0.scheme.group_size=32", *SMALL]),
    ("awq-w4a16-fp8kv", ["stages.1.scheme.group_size=32", *SMALL]),
])
def test_quantize_then_save_writes_the_cli_jobs_files(tiny_llama, tmp_path, recipe, overrides):
    model, report = quantkit.quantize(tiny_llama, recipe, overrides=overrides)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), PackedIntLinear)
    assert set(report.quantized) == {n for n, m in model.named_modules() if isinstance(m, PackedIntLinear)}
    assert len(report.quantized) == 3 * 7
    assert report.recipe.overrides == overrides
    saved = quantkit.save(model, tmp_path / "api")
    quantize_job(str(tiny_llama), load_recipe(recipe, overrides), tmp_path / "cli", progress=False)
    _same_checkpoint(saved, tmp_path / "cli")
    meta = json.loads((saved / "quantkit.json").read_text())
    assert meta["recipe"] == recipe and meta["source"] == str(tiny_llama) and len(meta["layers"]) == 21
    # the saved checkpoint computes what the in-memory model computes
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    back = quantkit.load(saved, dtype=report.compute.dtype)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_quantize_a_model_in_memory_with_texts(tiny_llama, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    texts = [(Path(__file__).resolve().parents[1] / "calibration_data" / "prideprejudice.txt")
             .read_text(encoding="utf-8")[:20000]]
    model, report = quantkit.quantize(net, "gptq-w4a16", overrides=["stages.0.scheme.group_size=32"], dataset=texts,
                                      num_samples=4, seq_len=32, tokenizer=tokenizer, dtype="float32")
    assert model is net and report.compute.dtype == torch.float32 and report.storage_dtype == torch.bfloat16
    assert report.recipe.calibration.num_samples == 4
    assert all(row["sqnr_db"] > 10 for row in report.result.layers)  # 4-bit group 32: ~20 dB on random weights
    saved = quantkit.save(model, tmp_path / "q")
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    assert "recipe gptq-w4a16: 21 linears quantized" in report.summary()


def test_recipe_objects_take_overrides(tiny_llama):
    recipe = load_recipe("rtn-w4a16")
    model, report = quantkit.quantize(tiny_llama, recipe, overrides=["stages.0.scheme.group_size=16"])
    assert {s.group_size for _f, s in report.quantized.values()} == {16}
    assert report.recipe.overrides == ["stages.0.scheme.group_size=16"] and recipe.overrides == []


def test_save_refuses_what_it_cannot_write(tiny_llama, tmp_path):
    plain = quantkit.load(tiny_llama)
    with pytest.raises(QuantizationError, match="returned by quantkit.quantize"):
        quantkit.save(plain, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    model, _ = quantkit.quantize(tiny_llama, "rtn-w4a16", overrides=["stages.0.scheme.group_size=32"])
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(OutputExistsError):
        quantkit.save(model, out)
    assert (out / "mine.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    with pytest.raises(QuantkitError, match="source"):
        quantkit.save(model, tiny_llama, overwrite=True)  # never the source


def test_quantize_refuses_a_quantized_model_and_texts_without_tokenizer(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = quantkit.quantize(tiny_llama, "rtn-w4a16", overrides=["stages.0.scheme.group_size=32"])
    saved = quantkit.save(model, tmp_path / "q")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantkit.quantize(saved, "rtn-w4a16")
    config = AutoModelForCausalLM.from_pretrained(tiny_llama).config
    config._name_or_path = ""  # a model made from a config alone: no checkpoint directory, no tokenizer beside it
    net = AutoModelForCausalLM.from_config(config)
    with pytest.raises(QuantizationError, match="needs a tokenizer"):
        quantkit.quantize(net, "gptq-w4a16", overrides=["stages.0.scheme.group_size=32"], dataset=["some text"])
