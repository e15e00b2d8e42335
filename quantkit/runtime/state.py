"""What the runner keeps for one loaded model, next to the model itself.

`quantkit.load` gives every model a `RuntimeState` (as `model.quantkit_runtime`): the kernel its
quantized linears were asked to use when it was loaded (QUANTKIT_KERNEL, read once), and the
lean decode step's fused projections, made at the first generate and reused by every later one
while the model's device and dtype stay the same, and the hook that gives `state_dict()` (saving)
the usual row-major weights back where the step re-stored them column-major. A model that did not
come from the loader (one quantized in memory, a transformers model) gets a state at its first generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn


@dataclass
class FusedProjections:
    """Per decoder layer, the fused q/k/v and gate/up projections ((weight, bias, sizes) or None
    where a layer's linears cannot be fused), for inputs on `device` in `dtype`."""

    device: torch.device
    dtype: torch.dtype
    qkv: list[Optional[tuple]]
    gate_up: list[Optional[tuple]]


@dataclass
class RuntimeState:
    kernel: Optional[str] = None  # the kernel request given to the quantized linears at load (None: automatic)
    fused: Optional[FusedProjections] = None
    layout_hook: Optional[object] = None  # handle of the state_dict pre-hook that restores row-major weights

    def fused_for(self, device: torch.device, dtype: torch.dtype,
                  build: Callable[[], tuple[list, list]]) -> FusedProjections:
        """The fused projections for `device` / `dtype`, built (by `build`: (qkv, gate_up)) when missing
        or made for another device or dtype."""
        if self.fused is None or (self.fused.device, self.fused.dtype) != (device, dtype):
            self.fused = None  # the old views go before the new ones are made
            self.fused = FusedProjections(device, dtype, *build())
        return self.fused


def runtime_state(model: nn.Module) -> RuntimeState:
    """The model's runtime state (made now for a model that has none)."""
    state = getattr(model, "quantkit_runtime", None)
    if state is None:
        state = RuntimeState()
        model.quantkit_runtime = state
    return state
