"""Adapters for the decoder-only families quantkit supports out of the box."""

from quantkit.arch.adapter import ArchitectureAdapter
from quantkit.registry import ARCHITECTURES

for _model_type in ("llama", "mistral", "qwen2", "qwen3"):
    ARCHITECTURES.add(_model_type, ArchitectureAdapter(model_type=_model_type))

ARCHITECTURES.add("gemma3_text", ArchitectureAdapter(model_type="gemma3_text", needs_bos=True))
