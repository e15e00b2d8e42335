"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8) into compressed-tensors checkpoints, evaluate and run them."""

from quantkit.version import __version__

__all__ = ["load", "load_tokenizer", "__version__"]


def __getattr__(name: str):
    # lazy, so that `quantkit --help` does not import torch and transformers
    if name in ("load", "load_tokenizer"):
        from quantkit.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
