"""Quantization algorithms, each a plugin registered in `quantkit.registry.ALGORITHMS`."""
