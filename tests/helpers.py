"""Shared test helpers: run the pipeline on a tiny model in memory."""

from __future__ import annotations

from pathlib import Path

import torch

import quantkit
from quantkit.catalog import adapter_for
from quantkit.pipeline import build_stages, quantize_model
from quantkit.recipe import load_recipe
from quantkit.runtime.loader import checkpoint_dtype
from quantkit.formats.checkpoint import read_config


def quantize_in_memory(path: Path, recipe_name: str, overrides: list[str], batches=None):
    """(model, adapter, result, storage_dtype) after running the pipeline without exporting."""
    model = quantkit.load(path, dtype=torch.float32)
    adapter = adapter_for(model.config.model_type)
    recipe = load_recipe(recipe_name, overrides)
    stages = build_stages(model, adapter, recipe)
    storage = checkpoint_dtype(read_config(path))
    result = quantize_model(model, adapter, stages, batches, storage, progress=False)
    return model, adapter, result, storage, recipe


def sample_ids(tokenizer, n: int = 1, seq: int = 24) -> torch.Tensor:
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq]
    return torch.tensor([ids] * n)
