"""Shared test helpers: run the pipeline on a tiny model in memory."""

from __future__ import annotations

from pathlib import Path

import torch

import quantkit
from quantkit.plugins.catalog import adapter_for


def quantize_in_memory(path: Path, recipe_name: str, overrides: list[str], batches=None):
    """(model, adapter, result, storage_dtype, recipe) after `quantkit.quantize` in float32, without saving."""
    model, report = quantkit.quantize(path, recipe_name, overrides=overrides, batches=batches, dtype=torch.float32)
    return model, adapter_for(model.config.model_type), report.result, report.storage_dtype, report.recipe


def sample_ids(tokenizer, n: int = 1, seq: int = 24) -> torch.Tensor:
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq]
    return torch.tensor([ids] * n)
