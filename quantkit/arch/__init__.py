"""Architecture adapters: where a model keeps its decoder layers and which linears share inputs."""

from quantkit.arch.adapter import ArchitectureAdapter, adapter_for

__all__ = ["ArchitectureAdapter", "adapter_for"]
