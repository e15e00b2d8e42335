"""Strict numbers for typed configs: a YAML `true` is not the number 1.

pydantic's lax mode turns booleans into numbers (`group_size: true` would be group size 1). The
base model here rejects a boolean for any field that takes numbers but not booleans.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a value of one of `kinds` fits `annotation` (through Optional, Union, Annotated, Literal)."""
    if annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _admits(get_args(annotation)[0], kinds)
    if origin in (Union, types.UnionType):
        return any(_admits(a, kinds) for a in get_args(annotation))
    if origin is Literal:
        return any(type(a) in kinds for a in get_args(annotation))
    return isinstance(annotation, type) and any(annotation is k for k in kinds)


class StrictModel(BaseModel):
    """Unknown keys are errors, and booleans are not numbers."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if isinstance(value, bool) and field is not None and not _admits(field.annotation, (bool,)) \
                        and _admits(field.annotation, (int, float)):
                    raise ValueError(f"{key}: expected a number, got {str(value).lower()} (a boolean is not a number)")
        return data
