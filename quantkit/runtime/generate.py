"""The generate loop: batched prefill, then token-by-token decode with a preallocated KV cache.

Prompts of different lengths are left-padded into one batch (attention mask and position ids
make every row see only its own tokens). The cache is a transformers `StaticCache` sized to
prompt + new tokens (or the FP8 variant, `runtime.kv_cache`), so decoding allocates nothing per
step. Only the last position's logits are computed. Each request has its own sampler state
(`runtime.sampling`), seeded generator, incremental detokenizer and stop-string matcher; it
finishes on an end token (EOS / end-of-turn, unless ignore_eos), a stop string (`stop`), its
max_new_tokens or the model's context limit (`length`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from quantkit.runtime.detokenize import IncrementalDetokenizer
from quantkit.runtime import lean_decode
from quantkit.runtime.kv_cache import Fp8StaticCache, make_cache
from quantkit.runtime.sampling import SamplingParams, TokenHistory, sample
from quantkit.runtime.stopping import StopStringMatcher

log = logging.getLogger(__name__)
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


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    history: TokenHistory
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    generator: Optional[torch.Generator]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    first_token_at: float = 0.0
    last_token_at: float = 0.0


@torch.no_grad()
def generate_batch(model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]],
                   params: Union[SamplingParams, Sequence[SamplingParams]],
                   on_text: Optional[Callable[[int, str], None]] = None,
                   kv_cache_dtype: Optional[str] = None) -> list[Completion]:
    """Generate for every prompt (token ids) at once; on_text(i, text) streams request i's text."""
    prompts = [list(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
    limit, width = context_limit(model), max(len(p) for p in prompts)
    if width >= limit:
        raise ValueError(f"a prompt of {width} tokens leaves no room in the model's context of {limit}")
    steps = min(max(p.max_new_tokens for p in plist), limit - width)
    if steps < max(p.max_new_tokens for p in plist):
        log.warning("max_new_tokens capped at %d by the model's context of %d tokens", steps, limit)
    ends = end_token_ids(model, tokenizer)
    vocab = model.get_output_embeddings().weight.shape[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(ends), 0)
    reqs = [_Request(i, p, pr, TokenHistory(vocab, p), IncrementalDetokenizer(tokenizer, p), StopStringMatcher(pr.stop),
                     None if pr.greedy else torch.Generator().manual_seed(pr.seed if pr.seed is not None
                                                                          else int(torch.seed() % (1 << 62))))
            for i, (p, pr) in enumerate(zip(prompts, plist))]

    b, total = len(prompts), width + steps
    device = next(model.parameters()).device
    input_ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.ones((b, total), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, : width - len(p)] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
    cache = make_cache(model, kv_cache_dtype, max_cache_len=total)

    lean = lean_decode.LeanDecoder(model, cache, cache.scales if isinstance(cache, Fp8StaticCache) else None) \
        if lean_decode.supports(model) else None
    start = time.perf_counter()
    prefill = dict(input_ids=input_ids, attention_mask=mask[:, :width], position_ids=positions[:, :width],
                   cache=cache, use_cache=True)
    if lean is not None:  # the head on the last position only, through the lean step's GEMV
        logits = lean.logits(model.model(**prefill).last_hidden_state[:, -1])
    else:
        logits = model(**prefill, logits_to_keep=1).logits[:, -1]
    for t in range(steps):
        logits = logits.float().cpu()
        now = time.perf_counter()
        next_ids = []
        for r in reqs:
            if r.finish is None:
                _step(r, logits[r.index], ends, now, on_text)
            next_ids.append(r.tokens[-1] if r.tokens else pad)
        if all(r.finish is not None for r in reqs) or t == steps - 1:
            break
        step_ids = torch.tensor(next_ids, device=device).unsqueeze(1)
        if lean is not None:
            logits = lean.step(step_ids, width + t, positions[:, width + t : width + t + 1], mask[:, : width + t + 1])
        else:
            logits = model(input_ids=step_ids, attention_mask=mask[:, : width + t + 1],
                           position_ids=positions[:, width + t : width + t + 1], cache=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
    results = []
    for r in reqs:
        if r.finish is None:
            r.finish = "length"
        tail = r.stopper.flush()
        if tail:
            r.text += tail
            if on_text:
                on_text(r.index, tail)
        results.append(Completion(r.text, r.tokens, r.finish, len(r.prompt), r.first_token_at - start,
                                  r.last_token_at - r.first_token_at, r.stop_reason))
    return results


def _step(r: _Request, logits: torch.Tensor, ends: set[int], now: float, on_text) -> None:
    token = sample(logits, r.params, r.history.seen, r.history.counts, r.generator)
    if not r.tokens:
        r.first_token_at = now
    r.last_token_at = time.perf_counter()
    if (token in ends and not r.params.ignore_eos) or token in r.params.stop_token_ids:
        r.finish, r.stop_reason = "stop", token
        return
    r.tokens.append(token)
    r.history.add(token)
    emitted = r.stopper.feed(r.detok.add(token))
    if emitted:
        r.text += emitted
        if on_text:
            on_text(r.index, emitted)
    if r.stopper.stopped:
        r.finish = "stop"
        r.stop_reason = next(s for s in r.params.stop if s in r.detok.text)
    elif len(r.tokens) >= r.params.max_new_tokens:
        r.finish = "length"


def generate(model: nn.Module, tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             on_text: Optional[Callable[[str], None]] = None, kv_cache_dtype: Optional[str] = None) -> Completion:
    """One prompt; on_text(text) streams it."""
    stream = None if on_text is None else (lambda _i, text: on_text(text))
    return generate_batch(model, tokenizer, [prompt_ids], params, stream, kv_cache_dtype)[0]
