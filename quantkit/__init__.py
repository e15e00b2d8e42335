"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8) into compressed-tensors checkpoints, evaluate and run them.

The Python API (`quantkit.api`): `quantize(model_or_path, recipe, ...)` -> (model, report) in memory,
`save(model, path)`; `load(path)` and `load_tokenizer(path)` for running checkpoints.
"""

from quantkit.platform import allocator
from quantkit.version import __version__

allocator.request_huge_pages()  # before torch's first allocation (quantkit.platform.allocator)

__all__ = ["quantize", "save", "load", "load_tokenizer", "__version__"]


def __getattr__(name: str):
    # lazy, so that `quantkit --help` does not import torch and transformers
    if name in ("load", "load_tokenizer"):
        from quantkit.checkpoints import loader

        return getattr(loader, name)
    if name in ("quantize", "save"):
        from quantkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
