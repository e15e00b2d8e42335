"""NaN/Inf checks: source weights before quantizing (refused, or zeroed when asked, loudly) and
every float tensor before a checkpoint is written."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from quantkit.errors import QuantizationError

ZERO_FLAG = "--zero-nonfinite"


SLICE = 1 << 24  # elements checked at once: the check's own memory stays small whatever the tensor


def find_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, int, int]]:
    """(name, non-finite count, numel) of every float tensor holding NaN or Inf (FP8 codes included).
    A name may come several times in a row (a tensor read in pieces): its counts add up."""
    counts: dict[str, list[int]] = {}
    for name, t in tensors:
        if t.is_floating_point() and t.device.type != "meta":
            flat, bad = t.reshape(-1), 0
            for start in range(0, flat.numel(), SLICE):
                part = flat[start : start + SLICE]
                bad += int((~torch.isfinite(part if part.element_size() >= 2 else part.float())).sum())
            entry = counts.setdefault(name, [0, 0])
            entry[0] += bad
            entry[1] += t.numel()
    return [(name, bad, numel) for name, (bad, numel) in counts.items() if bad]


def _listing(bad: list[tuple[str, int, int]], n: int = 6) -> str:
    return ", ".join(f"{name} ({count} of {numel})" for name, count, numel in bad[:n]) + (" ..." if len(bad) > n else "")


def refuse_or_zero(bad: list[tuple[str, int, int]], zero: bool, notify: Callable[[str], None]) -> list[str]:
    """For source tensors found by `find_nonfinite`: refuse them, naming them, or (`zero`) say loudly
    that they will be zeroed. Returns the names to zero (the caller zeroes them)."""
    if not bad:
        return []
    if not zero:
        raise QuantizationError(
            f"the source weights hold NaN/Inf values in {len(bad)} tensor(s): {_listing(bad)}; quantizing them "
            f"would hide the damage in a healthy-looking checkpoint. Fix the source, or pass {ZERO_FLAG} to "
            "replace those values with 0")
    notify(f"WARNING: {ZERO_FLAG}: replaced NaN/Inf with 0 in {len(bad)} tensor(s): {_listing(bad)}")
    return [name for name, _, _ in bad]


def zero_nonfinite(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def check_source(model: nn.Module, zero: bool, notify: Callable[[str], None]) -> list[str]:
    """Refuse a model whose parameters hold NaN/Inf, naming them; with `zero`, set those values to 0
    and say so. Returns the names of the tensors zeroed."""
    state = model.state_dict()
    names = refuse_or_zero(find_nonfinite(state.items()), zero, notify)
    for name in names:
        state[name].data.copy_(zero_nonfinite(state[name].data))
    return names


def check_output(tensors: dict[str, torch.Tensor], what: str = "the checkpoint to write") -> None:
    """Raise naming every tensor of `tensors` that holds NaN or Inf (scales, codes, weights)."""
    bad = find_nonfinite(tensors.items())
    if bad:
        raise QuantizationError(f"{what} holds NaN/Inf values in {len(bad)} tensor(s): {_listing(bad)}; "
                                "nothing was written")
