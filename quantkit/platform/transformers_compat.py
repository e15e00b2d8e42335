"""What differs between the transformers releases quantkit runs on (pyproject: >=5.0,<6), in one place.

The cache keyword: decoder layers and models take their KV cache as `past_key_values` in transformers 5.17
and as `cache` in 5.25 (`past_key_values` deprecated there); the suite has run on both. A keyword a
forward does not name falls into its `**kwargs` and is ignored without a word: a cache given under the
wrong name is silently not used (generation then sees one token at a time). So every call that passes a
cache names it through `cache_keyword`, read from the forward's signature of the module's class.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


def cache_keyword(module: nn.Module) -> str:
    """The name under which `module`'s forward takes its cache: "cache" or "past_key_values"."""
    return _keyword_of(type(module))


def cache_kwargs(module: nn.Module, cache) -> dict:
    """{keyword: cache} for a call of `module`."""
    return {cache_keyword(module): cache}


@functools.lru_cache(maxsize=None)
def _keyword_of(cls: type) -> str:
    # the class's forward, not the instance's (quantkit may wrap a model's forward; see kernels.wide_matmul);
    # inspect.signature follows functools.wraps, so transformers' own decorators show the real parameters
    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{cls.__name__}.forward takes no cache (neither cache nor past_key_values): "
                    "this transformers release is not one quantkit supports")
