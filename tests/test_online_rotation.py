"""The online rotation before down_proj (SpinQuant's R4, `qmodules.online_rotation`, the rotate stage's
`down_proj_online`): its matrix against compressed-tensors' own, the model's function kept (llama with the residual
rotations, Gemma without), the checkpoint's transform_config and tensor as llm-compressor writes them, the reload
(and the decode step) computing what compressed-tensors' own hooks compute, and refusals."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.algorithms.base import LayerContext
from quantkit.algorithms.rotate import Rotate, RotateConfig
from quantkit.errors import CheckpointError, QuantizationError
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.plugins.catalog import adapter_for
from quantkit.qmodules import online_rotation
from quantkit.quant import rotation

from helpers import sample_ids


def test_the_matrix_is_compressed_tensors_hadamard():
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    h = online_rotation.hadamard_pm1(8)
    assert torch.equal(h[1], torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]))
    assert torch.equal(h[3], torch.tensor([1.0, -1, -1, 1, 1, -1, -1, 1]))
    for n in (8, 32, 128):
        assert torch.equal(online_rotation.hadamard_pm1(n), deterministic_hadamard_matrix(n, torch.float32))
    x = torch.randn(3, 5, 64)
    y = online_rotation.rotate(x, online_rotation.hadamard_pm1(16))
    torch.testing.assert_close(y[..., 16:32], x[..., 16:32] @ rotation.sylvester_hadamard(16).float())
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # orthogonal
    w = torch.randn(7, 64, dtype=torch.float64)  # W H then x H: the product unchanged
    torch.testing.assert_close(y[0] @ rotation.rotate_input_blocks(w, 16).float().t(), x[0] @ w.float().t(),
                               rtol=1e-5, atol=1e-5)


def _rotated(path, **config):
    model = quantkit.load(path, dtype=torch.float32)
    adapter = adapter_for(model.config.model_type)
    alg = Rotate(RotateConfig(**config), None)
    alg.transform_model(model, adapter)
    for i, layer in enumerate(adapter.layers(model)):
        alg.transform_layer(LayerContext(layer, f"model.layers.{i}.", {}, {}, [], [], adapter, torch.float32))
    return model


@pytest.mark.parametrize("arch, config", [("llama", {"down_proj_online": 32}),
                                          ("llama", {"down_proj_online": 128, "block_size": 16}),
                                          ("gemma3_text", {"residual": False, "heads": False, "down_proj_online": 16}),
                                          ("gemma3_text", {"residual": False, "down_proj_online": 64}),
                                          ("gemma3_text", {"residual": "auto", "down_proj_online": 32}),
                                          ("llama", {"residual": "auto", "down_proj_online": 32})])
def test_online_rotation_keeps_the_models_function(arch, config, tiny_models, tokenizer):
    original = quantkit.load(tiny_models[arch], dtype=torch.float32)
    rotated = _rotated(tiny_models[arch], **config)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        torch.testing.assert_close(rotated(ids).logits, original(ids).logits, rtol=0, atol=1e-4)
    down = rotated.model.layers[0].mlp.down_proj
    assert online_rotation.block_of(down) == config["down_proj_online"]
    norm = rotated.model.layers[0].input_layernorm.weight  # R1 folds the norms (llama, with residual true or auto)
    assert torch.equal(norm, torch.ones_like(norm)) == (arch == "llama")
    assert (down.weight - original.model.layers[0].mlp.down_proj.weight).abs().max() > 1e-3


def test_bad_settings_are_refused(tiny_models):
    with pytest.raises(QuantizationError, match="does not divide its 128 inputs"):
        _rotated(tiny_models["llama"], residual=False, down_proj_online=256)
    with pytest.raises(QuantizationError, match="residual: false"):
        _rotated(tiny_models["gemma3_text"], down_proj_online=16)
    with pytest.raises(ValueError, match="power of two"):
        RotateConfig(down_proj_online=48)


@pytest.fixture(scope="module")
def r4_checkpoint(tiny_models, tmp_path_factory):
    """Rotations with R4 (blocks of 32), then GPTQ W8A16 per channel, on the tiny llama."""
    sets = ["stages.0.args.down_proj_online=32", "stages.1.scheme=W8A16", "calibration.num_samples=4",
            "calibration.seq_len=32", "calibration.check_samples=0"]
    out = tmp_path_factory.mktemp("r4") / "ckpt"
    return quantize(str(tiny_models["llama"]), load_recipe("rotated-mxfp4", sets), out, progress=False).output


def test_the_checkpoint_records_r4_as_llm_compressor_does(r4_checkpoint):
    from compressed_tensors.transform import TransformConfig

    qc = json.loads((r4_checkpoint / "config.json").read_text())["quantization_config"]
    config = TransformConfig.model_validate(qc["transform_config"])  # compressed-tensors' own parser
    scheme = config.config_groups["R4"]
    assert scheme.type == "hadamard" and scheme.head_dim == 32 and not scheme.randomize
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False), ("weight_input", True)]
    assert scheme.apply[0].targets == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    tensors = load_file(str(r4_checkpoint / "model.safetensors"))
    stored = tensors["model.layers.1.mlp.down_proj.R4_input.weight"]
    assert torch.equal(stored.float(), online_rotation.hadamard_pm1(32))
    assert not any("R4" in k for k in tensors if "down_proj" not in k)


def test_reload_computes_what_compressed_tensors_hooks_compute(r4_checkpoint, tiny_models, tokenizer):
    """transformers reads the weights (compressed-tensors' own module code), compressed-tensors' own factory
    adds the online rotation from the config's "input" entry (its "weight_input" entry is fused in the file):
    quantkit's reload gives the same logits, and stays close to the original model."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from transformers import AutoModelForCausalLM

    qc = json.loads((r4_checkpoint / "config.json").read_text())["quantization_config"]
    online = TransformConfig.model_validate(qc["transform_config"])
    for scheme in online.config_groups.values():
        scheme.apply = [a for a in scheme.apply if a.location == "input"]
    theirs = AutoModelForCausalLM.from_pretrained(r4_checkpoint, dtype=torch.float32)
    apply_transform_config(theirs, online)
    ours = quantkit.load(r4_checkpoint, dtype=torch.float32)
    original = quantkit.load(tiny_models["llama"], dtype=torch.float32)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        got, want, base = ours(ids).logits, theirs(ids).logits, original(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - base).abs().max() < 0.05 * base.abs().max()
    del theirs.model.layers[0].mlp.down_proj._forward_pre_hooks[next(iter(
        theirs.model.layers[0].mlp.down_proj._forward_pre_hooks))]  # without the rotation: far off
    with torch.no_grad():
        assert (theirs(ids).logits - got).abs().max() > 1e-2


def test_decode_step_rotates_too(r4_checkpoint, tokenizer):
    from test_generate import _lean_logits

    ids = sample_ids(tokenizer, 1)
    exact = quantkit.load(r4_checkpoint, dtype=torch.float32)
    decoder = quantkit.load(r4_checkpoint, dtype=torch.float32, workload="decode")
    with torch.no_grad():
        want = exact(ids).logits[:, -6:]
        got = _lean_logits(decoder, ids, 6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _edit_config(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"]["transform_config"]["config_groups"]["R4"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(type="random-hadamard"), "deterministic 'hadamard' type only"),
    (lambda s: s.update(randomize=True), "with randomize"),
    (lambda s: s["apply"][0].update(location="output"), "online rotation at 'output'"),
])
def test_transforms_quantkit_cannot_run_are_refused(r4_checkpoint, tmp_path, edit, message):
    bad = _edit_config(r4_checkpoint, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        quantkit.load(bad)


def test_a_wrong_matrix_is_refused(r4_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(r4_checkpoint, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.2.mlp.down_proj.R4_input.weight"][0, 1] = -1.0
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layers.2.mlp.down_proj.R4_input.weight is not the Sylvester"):
        quantkit.load(bad)


@pytest.mark.parametrize("command", [["export", "gguf"], ["export", "gptq"]])
def test_formats_that_cannot_record_it_refuse(r4_checkpoint, tmp_path, command):
    from click.testing import CliRunner

    from quantkit.cli import main as cli

    out = tmp_path / ("out.gguf" if command[1] == "gguf" else "out")
    res = CliRunner().invoke(cli, [*command, str(r4_checkpoint), "-o", str(out)])
    assert res.exit_code != 0 and "online rotations at run time (transform_config: R4)" in res.output
    assert not out.exists()


def test_llm_compressor_style_targets_load_the_same(r4_checkpoint, tmp_path, tokenizer):
    """llm-compressor names the targets by regex ("re:.*down_proj$") and stores the matrix in float64."""
    from safetensors.torch import save_file

    def edit(scheme):
        for args in scheme["apply"]:
            args["targets"] = ["re:.*down_proj$"]

    theirs = _edit_config(r4_checkpoint, tmp_path / "regex", edit)
    tensors = load_file(str(theirs / "model.safetensors"))
    for key in [k for k in tensors if k.endswith("R4_input.weight")]:
        tensors[key] = tensors[key].double()
    save_file(tensors, str(theirs / "model.safetensors"), metadata={"format": "pt"})
    ids = sample_ids(tokenizer, 1)
    a, b = quantkit.load(r4_checkpoint, dtype=torch.float32), quantkit.load(theirs, dtype=torch.float32)
    assert online_rotation.rotated(b) == {f"model.layers.{i}.mlp.down_proj": 32 for i in range(3)}
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_a_reload_offloaded_to_disk_rotates_too(r4_checkpoint, tokenizer):
    ids = sample_ids(tokenizer, 1)
    whole = quantkit.load(r4_checkpoint, dtype=torch.float32)
    offloaded = quantkit.load(r4_checkpoint, dtype=torch.float32, offload="disk")
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, whole(ids).logits)


def test_r1_skipped_is_said_once_per_run(tiny_models, tmp_path, caplog):
    """residual: auto on Gemma: the skipped R1 is said once, not again by the domain check's counterpart run."""
    sets = ["stages.1.scheme=W8A16", "calibration.num_samples=4", "calibration.seq_len=32",
            "calibration.check_samples=1"]
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        record = quantize(str(tiny_models["gemma3_text"]), load_recipe("rotated-mxfp4", sets), tmp_path / "q",
                          progress=False)
    assert record.domain_check  # the check ran (its counterpart rotates too)
    said = [r for r in caplog.records if "cannot take the residual-stream rotation" in r.getMessage()]
    assert len(said) == 1
