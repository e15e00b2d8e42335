"""Bugs found by reading the quantize flow (issue 50), each with a test that failed on the code before
the fix: overrides on a Recipe object, the provenance of calibration data handed to quantize(), a
model on a GPU staying there, and an explicit GPU index under torchrun."""

from __future__ import annotations

import json

import pytest
import torch

import quantkit
from quantkit.calibration.distributed import DistributedError
from quantkit.flow.recipe import load_recipe

from helpers import sample_ids


@pytest.mark.parametrize("item", ["stages.0.scheme.preset=W8A16", "stages.0.scheme.strategy=channel",
                                  "stages.0.scheme.group_size=32", "calibration.num_samples=7"])
def test_overrides_on_a_recipe_object_mean_what_they_mean_on_its_name(item):
    """Overrides went through the fully resolved dump: preset=W8A16 was ignored, strategy=channel raised."""
    by_object = load_recipe("rtn-w4a16").with_overrides([item])
    by_name = load_recipe("rtn-w4a16", [item])
    assert by_object.resolved[0].scheme == by_name.resolved[0].scheme
    assert by_object.calibration == by_name.calibration and by_object.overrides == [item]
    twice = load_recipe("rtn-w4a16", ["calibration.seq_len=128"]).with_overrides([item])
    assert twice.overrides == ["calibration.seq_len=128", item] and twice.calibration.seq_len == 128


def test_quantize_applies_overrides_to_a_recipe_object(tiny_llama):
    model, report = quantkit.quantize(str(tiny_llama), load_recipe("rtn-w4a16"),
                                      overrides=["stages.0.scheme.preset=W8A16"])
    assert {s.short() for _, s in report.quantized.values()} == {"int8 sym channel"}


@pytest.mark.parametrize("given", ["texts", "batches"])
def test_saved_provenance_names_the_data_given_to_quantize(tiny_llama, tokenizer, tmp_path, given):
    """With dataset= a list of texts or batches=, recipe.yaml and quantkit.json named the recipe's dataset."""
    kw = {"dataset": ["It is a truth universally acknowledged. " * 40, "Emma Woodhouse, handsome, clever. " * 40]} \
        if given == "texts" else {"batches": [sample_ids(tokenizer, 2, 32)]}
    model, report = quantkit.quantize(str(tiny_llama), "gptq-w4a16", overrides=["stages.0.scheme.group_size=32"],
                                      num_samples=2, seq_len=32, **kw)
    out = quantkit.save(model, tmp_path / "q")
    meta = json.loads((out / "quantkit.json").read_text())
    words = "2 text(s) given to quantkit.quantize()" if given == "texts" else \
        "1 batch(es) of token ids given to quantkit.quantize() (64 tokens"
    assert words in meta["calibration_data"] and "sha256" in meta["calibration_data"]
    recipe_yaml = (out / "recipe.yaml").read_text()
    assert words in recipe_yaml and "sensesensibility" not in recipe_yaml
    # a recipe's own dataset is named as it is
    model, _ = quantkit.quantize(str(tiny_llama), "rtn-w4a16", overrides=["stages.0.scheme.group_size=32"])
    plain = quantkit.save(model, tmp_path / "plain")
    assert json.loads((plain / "quantkit.json").read_text())["calibration_data"] == "mix-v1"


@pytest.mark.parametrize("asked", ["cuda:1", "cuda:0"])
def test_an_explicit_gpu_index_under_torchrun_is_refused_on_every_rank(asked):
    """It was replaced by LOCAL_RANK's GPU without a word."""
    from quantkit.flow.job import rank_device

    for rank in (0, 1):
        with pytest.raises(DistributedError, match=f"--device {asked} in a distributed run.*CUDA_VISIBLE_DEVICES"):
            rank_device(asked, rank, rank)
    assert rank_device("cuda", 1, 1).device == torch.device("cuda", 1)
    assert rank_device("auto", 0, 0).device == torch.device("cuda", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it where one is lent)")
def test_a_model_on_a_gpu_is_calibrated_and_left_there(tiny_llama, tokenizer):
    """Calibration ids stayed on the CPU and each quantized layer was moved to the CPU."""
    model = quantkit.load(tiny_llama, dtype=torch.float32).to("cuda")
    model, _ = quantkit.quantize(model, "gptq-w4a16", overrides=["stages.0.scheme.group_size=32"], tokenizer=tokenizer,
                                 num_samples=2, seq_len=32, device="cuda")
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}


def test_calibration_runs_on_the_models_device_and_layers_go_back_home(tiny_llama, tokenizer, monkeypatch):
    """Without a GPU: the pipeline returns each layer to where it was (here the CPU, calibrated on the CPU too),
    and capture feeds the ids on the embedding's device."""
    from quantkit.flow import pipeline
    from quantkit.calibration import capture

    assert pipeline._device_of(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert pipeline._device_of(torch.nn.Linear(2, 2, device="meta")) == torch.device("cpu")
    seen = []
    real = capture.capture_layer_inputs

    def spy(model, layers, batches, *a, **k):
        def hook(module, args, kwargs):
            seen.append(kwargs["input_ids"].device)
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return real(model, layers, batches, *a, **k)
        finally:
            handle.remove()

    monkeypatch.setattr(pipeline, "capture_layer_inputs", spy)
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    quantkit.quantize(model, "gptq-w4a16", overrides=["stages.0.scheme.group_size=32"], tokenizer=tokenizer,
                      num_samples=2, seq_len=32)
    assert seen and set(seen) == {model.get_input_embeddings().weight.device}
