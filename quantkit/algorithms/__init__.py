"""Quantization algorithms, each a plugin registered in `quantkit.core.registry.ALGORITHMS`."""
