"""Prompts from chat messages: the model's own chat template, with the assistant's turn opened."""

from __future__ import annotations


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template."""


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` ({role, content}) through the tokenizer's chat template, ending where
    the assistant's reply begins."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
