"""The config.json fields quantkit reads, checked before use, and the one check of a length against a
model's context.

transformers fills a missing field with its own default (a config with only `model_type` and
`num_hidden_layers` became a 6.33B-parameter Llama) and reports a wrongly typed one as a stack; here
each is refused naming the field, the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from quantkit.errors import CheckpointError, ContextLengthError

# read by every command: the model's size and shape
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# required too for the architectures quantkit quantizes (their MLP's width)
REQUIRED_KNOWN = ("intermediate_size",)
# positive whole numbers where present (null allowed)
POSITIVE = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "moe_intermediate_size",
            "num_experts", "num_local_experts", "num_experts_per_tok")


def text_fields(raw: dict) -> dict:
    """The fields of the text model: the top level, or `text_config` where a multimodal config nests it."""
    nested = raw.get("text_config")
    return nested if isinstance(nested, dict) and "hidden_size" not in raw else raw


def check(raw: dict, file: Union[str, Path], known_types: tuple[str, ...] = ()) -> None:
    """Refuse a config whose fields quantkit reads are missing, of the wrong type or not positive.
    known_types: model types quantkit quantizes (their REQUIRED_KNOWN fields are required too)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{file}: model_type is {model_type!r}; it must name the architecture "
                              "(e.g. \"llama\"), as the model's original config.json does")
    fields = text_fields(raw)
    required = REQUIRED + (REQUIRED_KNOWN if model_type in known_types else ())
    missing = [name for name in required if fields.get(name) is None]
    if missing:
        raise CheckpointError(f"{file}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; "
                              "quantkit will not guess the model's shape (transformers would fill in its own "
                              "defaults, describing another model): use the model's original config.json")
    for name in required + POSITIVE:
        value = fields.get(name)
        if value is not None and (type(value) is not int or value <= 0):
            raise CheckpointError(f"{file}: {name} is {value!r}; it must be a positive whole number (as in the "
                                  "model's original config.json)")
    heads, kv = fields["num_attention_heads"], fields.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise CheckpointError(f"{file}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")


def context_length(raw: dict) -> Optional[int]:
    """The model's context in tokens (max_position_embeddings), or None when the config does not say."""
    value = text_fields(raw).get("max_position_embeddings")
    return value if type(value) is int and value > 0 else None


def check_length(tokens: int, raw: dict, model: str, what: str, fix: str) -> None:
    """Refuse `tokens` (calibration, evaluation, request lengths) longer than `model`'s context, naming `what`
    (the option or field) and `fix` (how to ask for less)."""
    limit = context_length(raw)
    if limit is not None and tokens > limit:
        raise ContextLengthError(f"{what} {tokens} is longer than the context of {model} ({limit} tokens); "
                                 f"{fix.format(limit=limit)}")
