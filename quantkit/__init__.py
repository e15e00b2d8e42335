"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8) into compressed-tensors checkpoints, evaluate and run them."""

__version__ = "0.1.0"

__all__ = ["load", "load_tokenizer", "__version__"]


def __getattr__(name: str):
    # lazy, so that `quantkit --help` does not import torch and transformers
    if name in ("load", "load_tokenizer"):
        from quantkit.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
