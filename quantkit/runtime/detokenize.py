"""Incremental detokenization for streaming.

Each step decodes only a short window of recent tokens twice (from `prefix` to `read`, and from
`prefix` to the end) and emits the difference: constant work per token. The window's leading
context keeps SentencePiece / byte-level leading spaces right, and nothing is emitted while the
decoded text ends in U+FFFD (a character whose bytes are split across tokens is not complete yet).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded as context in front of the first generated ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # start of the decoded window
        self.read = len(self.tokens)  # tokens before this were emitted
        self.text = ""  # everything emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Add one generated token; returns the text it completes ('' while a character is split)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        full = self._decode(self.tokens[self.prefix :])
        if len(full) <= len(before) or full.endswith(REPLACEMENT):
            return ""
        new = full[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += new
        return new
