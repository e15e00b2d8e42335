"""A small generate loop: prefill, then token-by-token decode with the model's KV cache.

Greedy when temperature is 0, else temperature / top-k / top-p sampling from a seeded generator.
Text is streamed through `on_text` as soon as it is known not to end inside a UTF-8 character.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.runtime.kv_cache import make_cache


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> int:
    """One token id from logits [vocab]."""
    if cfg.temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= cfg.top_p  # keep the smallest prefix reaching top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


@torch.no_grad()
def generate(model: nn.Module, tokenizer, prompt_ids: list[int], cfg: SamplingConfig,
             on_text: Optional[Callable[[str], None]] = None, kv_cache_dtype: Optional[str] = None) -> Generation:
    gen = torch.Generator().manual_seed(cfg.seed)
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    eos_ids |= set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
    t0 = time.perf_counter()
    first_cache = make_cache(model, kv_cache_dtype)  # None: the model's own cache
    extra = {} if first_cache is None else {"cache": first_cache}
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, **extra)
    cache = getattr(out, "cache", None) or out.past_key_values  # renamed to `cache` in transformers 5
    tokens: list[int] = [sample_next(out.logits[0, -1], cfg, gen)]
    t1 = time.perf_counter()
    emitted = ""
    finish = "length"
    while True:
        if tokens[-1] in eos_ids:
            finish = "stop"
            tokens.pop()
            break
        emitted = _stream(tokenizer, tokens, emitted, on_text)
        if len(tokens) >= cfg.max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        tokens.append(sample_next(out.logits[0, -1], cfg, gen))
    t2 = time.perf_counter()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if on_text and text.startswith(emitted) and len(text) > len(emitted):
        on_text(text[len(emitted):])
    return Generation(text, tokens, finish, t1 - t0, t2 - t1)


def _stream(tokenizer, tokens: list[int], emitted: str, on_text) -> str:
    """Emit the new suffix of the decoded text unless it ends inside a multi-byte character."""
    if on_text is None:
        return emitted
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if text.endswith("\ufffd") or not text.startswith(emitted):
        return emitted
    if len(text) > len(emitted):
        on_text(text[len(emitted):])
    return text


def _as_list(x) -> list:
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])
