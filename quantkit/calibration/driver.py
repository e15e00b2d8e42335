"""The layer driver: one decoder layer run over its calibration batches, with hooks, an early stop or a cache.

This is the one place that knows how transformers calls a decoder layer: the hidden states first,
then the keyword arguments captured for it (masks, rotary embeddings, positions; `capture`), with
the cache arguments handled here (`without_cache`; a `cache` object goes in under the name the
layer's forward takes). Everything that runs a layer over its batches (observing linear inputs,
AWQ's statistics, KV-cache scale observation, making the next layer's inputs) calls `drive_layer`, and the
true-sequential pass (`lockstep`), which runs each batch on a stack of its own, calls `call_layer`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from quantkit.platform.transformers_compat import cache_keyword

CACHE_KEYS = ("cache", "past_key_values", "past_key_value")  # what transformers' layers have called the cache

PreHook = Callable[[nn.Module, tuple], None]
Hook = Callable[[nn.Module, tuple, dict, Any], None]


class _Stop(Exception):
    """Raised by the early stop once every module waited for has seen the batch."""


def without_cache(kwargs: dict) -> dict:
    """A layer call's keyword arguments with no cache: each batch runs on its own, nothing kept."""
    out = {k: v for k, v in kwargs.items() if k not in CACHE_KEYS}
    out["use_cache"] = False
    return out


def call_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One batch through a decoder layer: the hidden states first, then the captured keyword arguments; the
    layer's output hidden states (a decoder layer returns a tuple in some transformers releases, the tensor in others)."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def drive_layer(
    layer: nn.Module,
    hidden: Iterable[torch.Tensor],
    kwargs: Sequence[dict],
    *,
    pre_hooks: Sequence[tuple[nn.Module, PreHook]] = (),
    hooks: Sequence[tuple[nn.Module, Hook]] = (),
    stop_when_seen: Sequence[nn.Module] = (),
    cache: Any = None,
    before_batch: Optional[Callable[[int, torch.Tensor], None]] = None,
    outputs: Optional[list] = None,
) -> Optional[list]:
    """Run `layer` on every (hidden, kwargs) batch.

    pre_hooks: (module, fn(module, args)) called before those modules run; hooks: (module,
    fn(module, args, kwargs, output)) after. stop_when_seen: a batch's forward stops as soon as every
    one of these modules has been reached (their pre-hooks have run): what follows never runs.
    cache: an object the layer's attention calls as its cache (`update(k, v, layer_idx, ...)`), given
    under the layer's cache keyword in place of the captured cache arguments. before_batch(i, h): told
    each batch before it runs. outputs: a list (or an `Activations`) the layer's outputs are appended
    to, and returned; without it nothing is kept.
    """
    handles = [module.register_forward_pre_hook(fn) for module, fn in pre_hooks]
    handles += [module.register_forward_hook(fn, with_kwargs=True) for module, fn in hooks]
    waiting = list(stop_when_seen)
    seen: set[int] = set()

    def reached(module, _args):
        seen.add(id(module))
        if len(seen) == len(waiting):
            raise _Stop

    handles += [module.register_forward_pre_hook(reached) for module in waiting]
    key = cache_keyword(layer) if cache is not None else None
    try:
        for i, (h, kw) in enumerate(zip(hidden, kwargs)):
            if before_batch is not None:
                before_batch(i, h)
            if key is not None:
                kw = {**{k: v for k, v in kw.items() if k not in (*CACHE_KEYS, "use_cache")}, key: cache}
            seen.clear()
            try:
                out = call_layer(layer, h, kw)
            except _Stop:
                continue
            if outputs is not None:
                outputs.append(out)
    finally:
        for handle in handles:
            handle.remove()
    return outputs
