"""The one place plugins are looked up: algorithms, checkpoint formats and architecture adapters.

`quantkit.core.registry` is a leaf that holds names; plugins import it to add themselves. This module
imports `quantkit.plugins.builtins` (which registers the built-in plugins), so every lookup here sees them
and, through the registry, the third-party `quantkit.plugins` entry points. Code that uses plugins
(recipes, the pipeline, export, loading, evaluation, the CLI) looks them up here and never in the
registry directly, so no plugin ever has to import what looks it up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import quantkit.plugins.builtins  # noqa: F401  (importing it registers the built-in plugins)
from quantkit.errors import QuantizationError, UnsupportedArchitectureError
from quantkit.core.registry import ALGORITHMS, ARCHITECTURES, FORMATS

if TYPE_CHECKING:
    from torch import nn

    from quantkit.algorithms.base import Algorithm
    from quantkit.arch.adapter import ArchitectureAdapter
    from quantkit.formats.base import QuantFormat
    from quantkit.quant.schemes import QuantScheme


# -- algorithms --------------------------------------------------------------------------------

def algorithm(name: str) -> type["Algorithm"]:
    """The algorithm class registered as `name` (an error lists the known ones)."""
    return ALGORITHMS.get(name)


def algorithm_names() -> list[str]:
    return ALGORITHMS.names()


# -- formats -----------------------------------------------------------------------------------

def quant_format(name: str) -> "QuantFormat":
    """The checkpoint format registered as `name` (a compressed-tensors format name)."""
    return FORMATS.get(name)


def format_for(scheme: "QuantScheme") -> "QuantFormat":
    """The registered format that stores `scheme`."""
    for entry in FORMATS.entries():
        if entry.obj.supports(scheme):
            return entry.obj
    raise QuantizationError(f"no registered checkpoint format stores scheme {scheme.short()}")


# -- architectures -----------------------------------------------------------------------------

def find_adapter(model_type: str) -> Optional["ArchitectureAdapter"]:
    """The adapter registered for a `config.model_type`, or None (loading and evaluating need none)."""
    return ARCHITECTURES.get(model_type) if model_type in ARCHITECTURES else None


def adapter_for(model_type: str) -> "ArchitectureAdapter":
    """The adapter for a `config.model_type` (quantizing needs one), or an error listing the known ones."""
    adapter = find_adapter(model_type)
    if adapter is None:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported architectures: {', '.join(architecture_names())}. "
            "A plugin can add one through the 'quantkit.plugins' entry point group; a data-free recipe (rtn-*, "
            "fp8-dynamic, mxfp8) runs on any architecture with quantize --model-free."
        )
    return adapter


def architecture_names() -> list[str]:
    return ARCHITECTURES.names()


def checkpoint_namer(model: "nn.Module") -> Callable[[str], str]:
    """name -> the name in this model family's checkpoints (identity for most families)."""
    adapter = find_adapter(getattr(getattr(model, "config", None), "model_type", ""))
    return adapter.to_checkpoint_name if adapter else (lambda name: name)


def needs_bos(model_type: str) -> bool:
    """Whether texts for this family are scored with a BOS token first (its adapter says; default no)."""
    adapter = find_adapter(model_type)
    return bool(adapter and adapter.needs_bos)
