"""The generate loop: batched prefill, then token-by-token decode with a preallocated KV cache.

`generate_batch` builds the batch, prefills it and decodes; each request is a
`runtime.request.Request`, the state machine it shares with speculative decoding.

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
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from quantkit.errors import ContextLengthError
from quantkit.runtime import lean_decode, lean_gemma
from quantkit.runtime.kv_cache import Fp8StaticCache, make_cache
from quantkit.runtime.request import Completion, Request, context_limit, end_token_ids, request_generator
from quantkit.runtime.sampling import SamplingParams
from quantkit.platform.transformers_compat import cache_kwargs

__all__ = ["Completion", "context_limit", "end_token_ids", "generate", "generate_batch"]

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """Left-padded prompts: ids [B, width], and mask / positions [B, width + steps] for every slot."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    width: int
    steps: int


def _build_batch(prompts: list[list[int]], steps: int, pad: int, device: torch.device) -> _Batch:
    b, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.ones((b, width + steps), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, : width - len(p)] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return _Batch(input_ids.to(device), mask.to(device), positions.to(device), width, steps)


class _Forward:
    """The model's prefill and decode steps over one cache: the lean step where the architecture
    has one (`runtime.lean_decode`), else transformers' forward; logits of the last position only,
    through the lean step's head (a GEMV) wherever the model's forward is its decoder then its head."""

    def __init__(self, model: nn.Module, cache):
        self.model, self.cache = model, cache
        if lean_decode.supports(model):
            scales = cache.scales if isinstance(cache, Fp8StaticCache) else None
            self.lean = lean_decode.LeanDecoder(model, cache, scales)
        else:
            self.lean = lean_gemma.GemmaLeanDecoder(model, cache) if lean_gemma.supports(model, cache) else None
        embed = model.get_input_embeddings().weight
        self.head = self.lean.head if self.lean is not None else \
            lean_decode.Head(model, embed.device, embed.dtype) if lean_decode.head_apart(model) else None

    def _logits(self, **inputs) -> torch.Tensor:
        """Logits [B, vocab] of the last position of a forward over `inputs` through the cache."""
        if self.head is not None:
            hidden = self.model.model(**inputs, **cache_kwargs(self.model.model, self.cache)).last_hidden_state
            return self.head(hidden[:, -1])
        return self.model(**inputs, **cache_kwargs(self.model, self.cache), logits_to_keep=1).logits[:, -1]

    def prefill(self, batch: _Batch) -> torch.Tensor:
        w = batch.width
        return self._logits(input_ids=batch.input_ids, attention_mask=batch.mask[:, :w],
                            position_ids=batch.positions[:, :w], use_cache=True)

    def step(self, ids: torch.Tensor, batch: _Batch, t: int) -> torch.Tensor:
        """ids [B, 1] at decode step t (cache slot width + t)."""
        slot = batch.width + t
        positions, mask = batch.positions[:, slot : slot + 1], batch.mask[:, : slot + 1]
        if self.lean is not None:
            return self.lean.step(ids, slot, positions, mask)
        return self._logits(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)


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
        raise ContextLengthError(f"a prompt of {width} tokens leaves no room in the model's context of {limit}; "
                                 "shorten the prompt")
    steps = min(max(p.max_new_tokens for p in plist), limit - width)
    if steps < max(p.max_new_tokens for p in plist):
        log.warning("max_new_tokens capped at %d by the model's context of %d tokens", steps, limit)
    ends = end_token_ids(model, tokenizer)
    vocab = model.get_output_embeddings().weight.shape[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(ends), 0)
    reqs = [Request.start(tokenizer, p, pr, vocab, ends, emit=_stream(on_text, i), generator=request_generator(pr))
            for i, (p, pr) in enumerate(zip(prompts, plist))]
    batch = _build_batch(prompts, steps, pad, next(model.parameters()).device)
    forward = _Forward(model, make_cache(model, kv_cache_dtype, max_cache_len=width + steps))
    start = time.perf_counter()
    _decode(forward, batch, reqs, forward.prefill(batch), pad)
    return [r.complete(start) for r in reqs]


def _decode(forward: _Forward, batch: _Batch, reqs: list[Request], logits: torch.Tensor, pad: int) -> None:
    """Sample and commit a token for every unfinished request, then step the batch, until every
    request is finished or the steps run out (finished rows keep stepping on the pad token)."""
    device = batch.input_ids.device
    for t in range(batch.steps):
        logits = logits.float().cpu()
        ready = time.perf_counter()
        for i, r in enumerate(reqs):
            if not r.done:
                r.commit(r.sample(logits[i]), ready)
        if all(r.done for r in reqs) or t == batch.steps - 1:
            return
        ids = torch.tensor([r.tokens[-1] if r.tokens else pad for r in reqs], device=device).unsqueeze(1)
        logits = forward.step(ids, batch, t)


def _stream(on_text: Optional[Callable[[int, str], None]], index: int) -> Optional[Callable[[str], None]]:
    return None if on_text is None else (lambda text: on_text(index, text))


def generate(model: nn.Module, tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             on_text: Optional[Callable[[str], None]] = None, kv_cache_dtype: Optional[str] = None) -> Completion:
    """One prompt; on_text(text) streams it."""
    stream = None if on_text is None else (lambda _i, text: on_text(text))
    return generate_batch(model, tokenizer, [prompt_ids], params, stream, kv_cache_dtype)[0]
