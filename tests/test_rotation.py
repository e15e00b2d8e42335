"""The rotate stage (`quant.rotation`, `algorithms.rotate`): the matrices (orthogonal, fixed values, seeded),
the model's function kept by the fused rotations (llama, qwen3 with q/k norms, qwen2 with biases), an untied
lm_head written and read back by quantkit and transformers, onloaded and whole-model runs writing the same
checkpoint, and refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.algorithms.base import LayerContext
from quantkit.algorithms.rotate import Rotate, RotateConfig
from quantkit.errors import QuantizationError, RecipeError
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.plugins.catalog import adapter_for
from quantkit.quant import rotation

from conftest import make_tiny_model
from helpers import sample_ids


def test_sylvester_hadamard_fixed_values_and_orthogonal():
    h2 = rotation.sylvester_hadamard(2)
    assert torch.equal(h2 * 2 ** 0.5, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    h = rotation.sylvester_hadamard(64)
    torch.testing.assert_close(h @ h.t(), torch.eye(64, dtype=torch.float64))
    x = torch.zeros(64, dtype=torch.float64)
    x[5] = 100.0  # one outlier channel becomes 64 equal magnitudes
    assert torch.allclose((x @ h).abs(), torch.full((64,), 12.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.sylvester_hadamard(48)


@pytest.mark.parametrize("n", [64, 576, 96])
def test_random_hadamard_is_orthogonal_and_seeded(n):
    q = rotation.random_hadamard(n, 3)
    torch.testing.assert_close(q @ q.t(), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, rotation.random_hadamard(n, 3)) and not torch.equal(q, rotation.random_hadamard(n, 4))


def test_block_hadamard_stays_inside_blocks():
    q = rotation.block_hadamard(96, 32, 0)
    torch.testing.assert_close(q @ q.t(), torch.eye(96, dtype=torch.float64), rtol=0, atol=1e-12)
    assert q[:32, 32:].abs().sum() == 0 and q[32:64, :32].abs().sum() == 0
    assert torch.allclose(q[:32, :32].abs(), torch.full((32, 32), 32 ** -0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="divisible"):
        rotation.block_hadamard(96, 64, 0)


def _rotated(path, **config) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = quantkit.load(path, dtype=torch.float32)
    original = copy.deepcopy(model)
    adapter = adapter_for(model.config.model_type)
    alg = Rotate(RotateConfig(**config), None)
    alg.transform_model(model, adapter)
    for i, layer in enumerate(adapter.layers(model)):
        alg.transform_layer(LayerContext(layer, f"model.layers.{i}.", {}, {}, [], [], adapter, torch.float32))
    return original, model


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, tokenizer):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2") / "qwen2", tokenizer)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("config", [{}, {"heads": False}, {"block_size": 16}])
def test_rotations_keep_the_models_function(arch, config, tiny_models, tiny_qwen2, tokenizer):
    path = tiny_qwen2 if arch == "qwen2" else tiny_models[arch]
    original, rotated = _rotated(path, **config)
    ids = sample_ids(tokenizer, 2)
    with torch.no_grad():
        a, b = original(ids).logits, rotated(ids).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    q = original.model.layers[0].self_attn.q_proj.weight
    assert (rotated.model.layers[0].self_attn.q_proj.weight - q).abs().max() > 1e-2  # the weights did change
    assert torch.equal(rotated.model.layers[0].input_layernorm.weight, torch.ones_like(q[0]))


def test_gemma_is_refused(tiny_models):
    with pytest.raises(QuantizationError, match="'gemma3_text' is not supported: drop the rotate stage"):
        _rotated(tiny_models["gemma3_text"])
    with pytest.raises(RecipeError, match="power of two"):
        load_recipe("rotated-mxfp4", ["stages.0.args.block_size=48"])


@pytest.fixture(scope="module")
def rotated_checkpoints(tiny_models, tmp_path_factory):
    """rotate + GPTQ W8A16 on the tiny llama (tied embeddings), onloaded (the default) and whole-model; the fused
    rotations only (no online R4: an ordinary checkpoint, which transformers runs as it is)."""
    root = tmp_path_factory.mktemp("rotated")
    sets = ["stages.1.scheme=W8A16", "calibration.num_samples=4", "calibration.seq_len=32",
            "calibration.check_samples=0", "stages.0.args.down_proj_online=null", "stages.0.args.residual=true"]
    return {mode: quantize(str(tiny_models["llama"]), load_recipe("rotated-mxfp4", sets), root / mode, progress=False,
                           load_mode=mode).output for mode in ("layers", "whole")}


def test_onloaded_and_whole_runs_write_the_same_untied_checkpoint(rotated_checkpoints, tiny_models):
    a = load_file(str(rotated_checkpoints["layers"] / "model.safetensors"))
    b = load_file(str(rotated_checkpoints["whole"] / "model.safetensors"))
    source = load_file(str(tiny_models["llama"] / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" in a and "lm_head.weight" not in source
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (a["model.embed_tokens.weight"].float() - source["model.embed_tokens.weight"].float()).abs().max() > 1e-2
    assert json.loads((rotated_checkpoints["layers"] / "config.json").read_text())["tie_word_embeddings"] is False


def test_rotated_checkpoint_runs_like_the_original(rotated_checkpoints, tiny_models, tokenizer):
    """GPTQ int8 weights after the rotation: the rotated model (read by quantkit and by transformers) stays close to
    the original; an unrotated lm_head or embedding would not."""
    from transformers import AutoModelForCausalLM

    path = rotated_checkpoints["layers"]
    ids = sample_ids(tokenizer, 2)
    original = quantkit.load(tiny_models["llama"], dtype=torch.float32)
    ours = quantkit.load(path, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want, got, hf = original(ids).logits, ours(ids).logits, theirs(ids).logits
    torch.testing.assert_close(hf, got, rtol=0, atol=1e-4)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
