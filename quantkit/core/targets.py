"""Module selection by recipe patterns: a class name ("Linear"), an exact module name, or "re:<regex>"."""

from __future__ import annotations

import re
from typing import Iterable

from torch import nn


def matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    """compressed-tensors semantics: regexes are `re.match`ed against the full module name."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or pattern == type(module).__name__:
            return True
    return False


def select_linears(model: nn.Module, targets: list[str], ignore: list[str]) -> list[str]:
    """Names of nn.Linear modules matched by `targets` and not by `ignore`, in model order."""
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and matches(name, mod, targets) and not matches(name, mod, ignore)
    ]
