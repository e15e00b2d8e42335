"""Checkpoint formats: how quantized modules are laid out on disk and described in config.json."""
