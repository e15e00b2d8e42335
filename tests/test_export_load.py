"""Export -> load round trips, the on-disk layout, atomic output and damaged checkpoints."""

import json
import os

import pytest
import torch
import yaml
from safetensors import safe_open

import quantkit
from quantkit.errors import CheckpointError, ModelNotFoundError, OutputExistsError
from quantkit.checkpoints.quantization_config import build_quantization_config
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.checkpoints.export import export_checkpoint

from helpers import quantize_in_memory, sample_ids

W4_32 = ["stages.0.scheme.group_size=32"]


def _export(model, result, storage, recipe, src, out, **kw):
    return export_checkpoint(
        model, out, storage_dtype=storage, source=src,
        quantization_config=build_quantization_config(model, result.quantized),
        extra_files={"recipe.yaml": recipe.to_yaml()}, **kw,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("recipe", ["rtn-w4a16", "rtn-w4a16-asym", "rtn-w8a16"])
def test_round_trip_equals_in_memory_model(arch, recipe, tiny_models, tokenizer, tmp_path):
    src = tiny_models[arch]
    overrides = [] if recipe == "rtn-w8a16" else W4_32
    model, _, result, storage, rec = quantize_in_memory(src, recipe, overrides)
    out = _export(model, result, storage, rec, src, tmp_path / "q")
    loaded = quantkit.load(out, dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    for name in result.quantized:
        a, b = model.get_submodule(name), loaded.get_submodule(name)
        assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale, b.weight_scale)


def test_on_disk_layout_matches_compressed_tensors(tiny_llama, tmp_path):
    model, _, result, storage, rec = quantize_in_memory(tiny_llama, "rtn-w4a16-asym", W4_32)
    out = _export(model, result, storage, rec, tiny_llama, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == "pack-quantized"
    assert group["weights"] == {  # compressed-tensors' QuantizationArgs, every field (../shared/FORMATS.md)
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
        "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
        "scale_dtype": None, "zp_dtype": "torch.int8"}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.mlp.down_proj."  # in 128, out 64
        assert f.get_tensor(p + "weight_packed").dtype == torch.int32 and f.get_slice(p + "weight_packed").get_shape() == [64, 16]
        assert f.get_tensor(p + "weight_scale").dtype == torch.bfloat16 and f.get_slice(p + "weight_scale").get_shape() == [64, 4]
        assert f.get_tensor(p + "weight_shape").tolist() == [64, 128]
        assert f.get_slice(p + "weight_zero_point").get_shape() == [8, 4]  # packed along out
        assert p + "weight" not in keys and "lm_head.weight" not in keys  # tied to the embeddings
    for name in ("tokenizer.json", "tokenizer_config.json", "recipe.yaml"):
        assert (out / name).is_file()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["stages"][0]["scheme"]["group_size"] == 32


def test_quantize_job_saves_recipe_and_metadata(tiny_llama, tmp_path):
    recipe = load_recipe("rtn-w4a16", W4_32)
    report = quantize(str(tiny_llama), recipe, tmp_path / "q", progress=False)
    meta = json.loads((report.output / "quantkit.json").read_text())
    assert meta["recipe"] == "rtn-w4a16" and len(meta["layers"]) == 21
    saved = load_recipe(str(report.output / "recipe.yaml"))
    assert saved.stages[0].scheme.resolve() == recipe.stages[0].scheme.resolve()
    assert oct(os.stat(report.output).st_mode & 0o777) != oct(0o700)  # not left private by mkdtemp


def test_existing_output_is_not_overwritten(tiny_llama, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), out, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    # --overwrite replaces only what quantkit wrote: a directory with a file of the user's is refused, naming it
    with pytest.raises(OutputExistsError, match="not a quantkit output .* holds keep.txt"):
        quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), out, overwrite=True, progress=False)  # empty: fine
    first = (out / "model.safetensors").read_bytes()
    quantize(str(tiny_llama), load_recipe("rtn-w8a16"), out, overwrite=True, progress=False)  # a quantkit output: fine
    assert (out / "model.safetensors").read_bytes() != first
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, OSError])
def test_interrupted_export_leaves_nothing(tiny_llama, tmp_path, monkeypatch, exc_type):
    import quantkit.checkpoints.export as export_mod

    def boom(*a, **k):
        raise exc_type("interrupted while writing")

    monkeypatch.setattr(export_mod, "write_json", boom)
    with pytest.raises(exc_type):
        quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), tmp_path / "q", progress=False)
    # no output, no half-written files: only the stopped run's resumable state (every layer finished)
    assert [p.name for p in tmp_path.iterdir()] == [".q.run"]
    monkeypatch.undo()
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), tmp_path / "q", progress=False, resume=True)
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_interrupted_overwrite_keeps_previous_output(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "q"
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), out, progress=False)
    before = (out / "model.safetensors").read_bytes()
    import quantkit.checkpoints.export as export_mod

    monkeypatch.setattr(export_mod, "write_json", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_llama), load_recipe("rtn-w8a16"), out, overwrite=True, progress=False)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".q.run", "q"]  # and the stopped run's state


@pytest.fixture
def exported(tiny_llama, tmp_path):
    return quantize(str(tiny_llama), load_recipe("rtn-w4a16", W4_32), tmp_path / "q", progress=False).output


def test_truncated_safetensors(exported):
    f = exported / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*truncated or corrupted; re-create or re-download"):
        quantkit.load(exported)


def test_corrupted_header(exported):
    f = exported / "model.safetensors"
    f.write_bytes(b"\xff" * 64 + f.read_bytes()[64:])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        quantkit.load(exported)


def test_missing_tensor(exported):
    from safetensors.torch import load_file, save_file

    f = exported / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model.layers.1.mlp.up_proj.weight_scale"):
        quantkit.load(exported)


def test_pickle_weights_are_refused(tmp_path, tiny_llama):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        quantkit.load(d)


def test_unsupported_quant_method(exported):
    cfg = json.loads((exported / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (exported / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization method 'bitsandbytes' is not supported"):
        quantkit.load(exported)
    # GPTQ is read (tests/test_foreign_checkpoints.py), but not this config's layout, nor tensors without qweight
    cfg["quantization_config"]["quant_method"] = "gptq"
    (exported / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="checkpoint_format 'pack-quantized'"):
        quantkit.load(exported)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (exported / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"no tensor named \*\.qweight"):
        quantkit.load(exported)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        quantkit.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        quantkit.load(tmp_path / "empty")


def test_hub_id_fails_with_offline_message():
    with pytest.raises(ModelNotFoundError, match="Hugging Face Hub failed.*offline"):
        quantkit.load("Qwen/Qwen3-4B")


def test_plain_checkpoint_matches_transformers(tiny_models, tokenizer):
    from transformers import AutoModelForCausalLM

    for arch, path in tiny_models.items():
        ours = quantkit.load(path, dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = sample_ids(tokenizer, 1)
        with torch.no_grad():
            assert torch.equal(ours(ids).logits, ref(ids).logits), arch
