"""Capture what each decoder layer receives, so layers can be run one at a time.

One model forward per batch runs with every decoder layer's `forward` temporarily replaced by
a recorder: layer 0's hidden states and every layer's keyword arguments (attention masks,
rotary embeddings: they differ per layer type, e.g. Gemma's sliding vs full attention) are
kept; the recorders pass hidden states through unchanged, and the last one stops the forward
so the final norm and LM head never run. What is kept goes to the device the layers will run on
(`device`): the embeddings run where the model is (CPU), the layers one at a time on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from quantkit.calibration.activations import Activations
from quantkit.calibration.driver import drive_layer, without_cache
from quantkit.platform.devices import to_device


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    hidden: Activations  # per batch: [batch, seq, hidden] input of the current layer
    kwargs: list[list[dict]]  # [layer][batch] keyword arguments of each layer call


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor],
                         device: torch.device = torch.device("cpu"),
                         hidden: Optional[Activations] = None) -> LayerInputs:
    """Layer 0's input and every layer's keyword arguments for each batch; `hidden`: where layer 0's
    inputs go (an `Activations` with a memory budget), by default a new one without a limit."""
    hidden = hidden if hidden is not None else Activations()
    kwargs: list[list[dict]] = [[] for _ in layers]
    last = len(layers) - 1

    def recorder(index: int):
        def forward(*args, **kw):
            h = args[0] if args else kw.pop("hidden_states")
            kwargs[index].append(to_device(without_cache(kw), device))
            if index == 0:
                hidden.append(h.to(device))
            if index == last:
                raise _StopForward
            return h

        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        embed = model.get_input_embeddings().weight
        where = embed.device if embed.device.type != "meta" else torch.device("cpu")  # onloading: on the CPU
        for ids in batches:
            try:
                model(input_ids=ids.to(where), use_cache=False)
            except _StopForward:
                pass
    finally:
        for layer in layers:
            del layer.forward  # drop the instance attribute: the class forward is back
    return LayerInputs(hidden, kwargs)


def observe_layer(
    layer: nn.Module,
    hidden: list[torch.Tensor],
    kwargs: list[dict],
    linears: dict[str, nn.Module],
    observe: Callable[[str, torch.Tensor], None],
) -> None:
    """Run every batch through `layer`, calling observe(name, input) for each of `linears`.

    Only the linears' inputs are wanted, so a batch's forward stops as soon as every one of them
    has seen it: what follows the last one (e.g. the down projection's matmul) never runs.
    """
    def pre_hook(name: str):
        return lambda _module, args: observe(name, args[0])

    drive_layer(layer, hidden, kwargs, pre_hooks=[(lin, pre_hook(name)) for name, lin in linears.items()],
                stop_when_seen=list(linears.values()))


def run_layer(layer: nn.Module, hidden: Iterable[torch.Tensor], kwargs: list[dict], into=None):
    """The layer's outputs for every batch, appended to `into` (a list by default) and returned."""
    return drive_layer(layer, hidden, kwargs, outputs=[] if into is None else into)
