"""Architecture adapters: where a model keeps its decoder layers and which linears share inputs
(looked up by `model_type` in `quantkit.plugins.catalog`)."""

from quantkit.arch.adapter import ArchitectureAdapter

__all__ = ["ArchitectureAdapter"]
