"""One generation request's state machine, shared by plain and speculative generation.

A request starts from its prompt and sampling parameters and takes committed tokens one at a
time (`commit`). Each token either finishes it (an end token, a stop token id, a stop string
completed by the token's text, or its token budget) or is appended: the token history (for the
penalties), the incremental detokenizer and the stop-string matcher advance, and the text that
is safe to show is streamed to `emit`. `complete` ends it (reason `length` when nothing else
finished it), flushes text held back for a possible stop string and gives the `Completion`.

How the tokens are chosen (one sampled per step, or k drafts verified at once) is the caller's
business; what a committed token does is decided here only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import nn

from quantkit.runtime.detokenize import IncrementalDetokenizer
from quantkit.runtime.sampling import SamplingParams, TokenHistory, sample
from quantkit.runtime.stopping import StopStringMatcher

END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end token or stop string) or "length"
    prompt_tokens: int
    ttft_seconds: float  # prefill + first token
    decode_seconds: float  # first token -> last token
    stop_reason: Optional[Union[int, str]] = None  # the end token id or stop string that finished it

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")


def end_token_ids(model: nn.Module, tokenizer) -> set[int]:
    """EOS ids of the tokenizer and generation config, plus chat end-of-turn tokens in the vocab."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        ids |= set(source if isinstance(source, (list, tuple)) else [source]) - {None}
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    return ids


def context_limit(model: nn.Module) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 1 << 30))


def request_generator(params: SamplingParams) -> Optional[torch.Generator]:
    """A request's own seeded generator (None when greedy: nothing is random)."""
    if params.greedy:
        return None
    return torch.Generator().manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 62)))


@dataclass
class Request:
    """A request in flight: its prompt, parameters and what it has produced so far."""

    prompt: list[int]
    params: SamplingParams
    ends: set[int]  # token ids that end it (unless params.ignore_eos)
    budget: int  # most tokens it may produce
    history: TokenHistory
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    generator: Optional[torch.Generator] = None
    emit: Optional[Callable[[str], None]] = None  # streamed text
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    first_token_at: Optional[float] = None  # when the first token was ready (None before any commit)
    last_token_at: Optional[float] = None

    @classmethod
    def start(cls, tokenizer, prompt: list[int], params: SamplingParams, vocab: int, ends: set[int],
              budget: Optional[int] = None, emit: Optional[Callable[[str], None]] = None,
              generator: Optional[torch.Generator] = None) -> "Request":
        prompt = list(prompt)
        return cls(prompt, params, ends, params.max_new_tokens if budget is None else budget,
                   TokenHistory(vocab, prompt), IncrementalDetokenizer(tokenizer, prompt), StopStringMatcher(params.stop),
                   generator, emit)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from this request's logits [vocab], by its sampler and generator."""
        return sample(logits, self.params, self.history.seen, self.history.counts, self.generator)

    def commit(self, token: int, ready_at: Optional[float] = None) -> bool:
        """Take one chosen token (ready_at: when its logits were ready, the first token's time;
        default now). Returns whether the request is finished."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now if ready_at is None else ready_at
        self.last_token_at = now
        if (token in self.ends and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            self.finish, self.stop_reason = "stop", token
            return True
        self.tokens.append(token)
        self.history.add(token)
        self._show(self.stopper.feed(self.detok.add(token)))
        if self.stopper.stopped:
            self.finish = "stop"
            self.stop_reason = next(s for s in self.params.stop if s in self.detok.text)
        elif len(self.tokens) >= self.budget:
            self.finish = "length"
        return self.finish is not None

    def complete(self, started_at: float) -> Completion:
        """End the request (`length` if nothing finished it) and give its completion; timings
        are measured from `started_at` (the start of the prefill)."""
        if self.finish is None:
            self.finish = "length"
        self._show(self.stopper.flush())
        first = started_at if self.first_token_at is None else self.first_token_at
        last = first if self.last_token_at is None else self.last_token_at
        return Completion(self.text, self.tokens, self.finish, len(self.prompt), first - started_at, last - first,
                          self.stop_reason)

    def _show(self, text: str) -> None:
        if text:
            self.text += text
            if self.emit is not None:
                self.emit(text)
