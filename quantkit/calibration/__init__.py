"""Calibration: text sources, deterministic token chunks, and capturing decoder-layer inputs."""
