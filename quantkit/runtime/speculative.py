"""Speculative decoding: a small draft model proposes k tokens, the target verifies them in one forward.

Both models keep a growing KV cache of the committed sequence. Each round the draft samples k
tokens one by one (its distributions q_i after the sampler's stages), the target scores the last
committed token and the k drafts in a single forward (distributions p_i, same stages, same
history), and the drafts are accepted left to right with the rejection-sampling rule: d_i is
kept with probability min(1, p_i(d_i) / q_i(d_i)); the first rejected position is resampled from
norm(max(p_i - q_i, 0)); if all k are kept, one more token comes from p_{k+1}. The committed
tokens are then distributed exactly as the target's own samples (Leviathan et al., 2023). With
temperature 0 both distributions are one-hot at their argmax, so a draft is kept exactly when it
is the target's greedy token and the output is the target's plain greedy output. Caches are
cropped back to the committed sequence after every round. A llama-family draft runs through the
lean decode step over a StaticCache (a draft is only worth its per-token cost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from transformers import DynamicCache

from quantkit.errors import ContextLengthError, IncompatibleModelsError
from quantkit.runtime import lean_decode
from quantkit.runtime.kv_cache import make_cache
from quantkit.runtime.request import Completion, Request, context_limit, end_token_ids
from quantkit.runtime.sampling import SamplingParams, distribution
from quantkit.platform.transformers_compat import cache_kwargs


@dataclass
class SpeculativeStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


def _shared_prefix(held: list[int], tokens: list[int]) -> int:
    """How many leading tokens of `tokens` a cache holding `held` can keep."""
    keep = 0
    for a, b in zip(held, tokens):
        if a != b:
            break
        keep += 1
    return keep


class _Model:
    """A model with its cache and the tokens the cache holds."""

    def __init__(self, model: nn.Module, cache):
        self.model, self.cache, self.tokens = model, cache, []

    def logits_from(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [len(tokens) - start, vocab] of positions start.. of `tokens`: the cache is cropped to
        what it shares with `tokens` (at most `start` tokens) and the rest is fed in one forward."""
        keep = _shared_prefix(self.tokens, tokens[:start])
        if len(self.tokens) > keep:
            self.cache.crop(keep - len(self.tokens))  # transformers 5: a negative count removes that many
        ids = torch.tensor([tokens[keep:]], device=next(self.model.parameters()).device)
        logits = self.model(input_ids=ids, **cache_kwargs(self.model, self.cache), use_cache=True).logits[0]
        self.tokens = list(tokens)
        return logits[start - keep:].float().cpu()

    def last_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.logits_from(tokens, len(tokens) - 1)[-1]


class _LeanDraft:
    """A llama-family draft decoded through the lean step (`runtime.lean_decode`) over a StaticCache
    of `capacity` slots: the prompt is prefilled once, then each call feeds only the tokens the cache
    does not hold yet, one step each (slots past the committed sequence are simply overwritten)."""

    def __init__(self, model: nn.Module, capacity: int):
        self.model, self.cache = model, make_cache(model, None, max_cache_len=capacity)
        self.lean = lean_decode.LeanDecoder(model, self.cache)
        self.device = next(model.parameters()).device
        self.mask = torch.ones((1, capacity), dtype=torch.long, device=self.device)
        self.positions = torch.arange(capacity, device=self.device).unsqueeze(0)
        self.tokens: list[int] = []

    def last_logits(self, tokens: list[int]) -> torch.Tensor:
        keep = _shared_prefix(self.tokens, tokens[:-1])  # the last token is always fed: its logits are the answer
        if keep == 0 and len(tokens) > 1:
            n = len(tokens) - 1
            self.model.model(input_ids=torch.tensor([tokens[:n]], device=self.device), attention_mask=self.mask[:, :n],
                             position_ids=self.positions[:, :n], **cache_kwargs(self.model.model, self.cache),
                             use_cache=True)
            keep = n
        for slot in range(keep, len(tokens)):
            logits = self.lean.step(torch.tensor([[tokens[slot]]], device=self.device), slot,
                                    self.positions[:, slot : slot + 1], self.mask[:, : slot + 1])
        self.tokens = list(tokens)
        return logits[0].float().cpu()


class _Rounds:
    """One round of speculative sampling: the draft proposes k tokens, the target keeps a prefix of them and
    adds one of its own (a resample where it rejected, else a bonus token), so the output is distributed as
    the target's alone."""

    def __init__(self, params: SamplingParams, gen: torch.Generator, k: int):
        self.params, self.gen, self.k = params, gen, k

    def dist(self, logits: torch.Tensor, hist) -> torch.Tensor:
        return distribution(logits, self.params, hist.seen, hist.counts)

    def draw(self, probs: torch.Tensor) -> int:
        return int(probs.argmax()) if self.params.greedy else int(torch.multinomial(probs, 1, generator=self.gen))

    def propose(self, drf, seq: list[int], history) -> tuple[list[int], list[torch.Tensor]]:
        """k draft tokens after `seq`, and the draft's distribution each was drawn from."""
        hist = history.copy()
        drafts, qs = [], []
        logits = drf.last_logits(seq)
        for i in range(self.k):
            q = self.dist(logits, hist)
            d = self.draw(q)
            drafts.append(d)
            qs.append(q)
            hist.add(d)
            if i < self.k - 1:
                logits = drf.last_logits(seq + drafts)
        return drafts, qs

    def verify(self, p_logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor], history) -> list[int]:
        """The tokens this round commits: drafts accepted (greedy: equal to the target's choice; sampled: with
        probability min(1, p/q)), then the target's own token."""
        hist = history.copy()
        committed = []
        for i, d in enumerate(drafts):
            p, q = self.dist(p_logits[i], hist), qs[i]
            if self.params.greedy:
                keep = int(p.argmax()) == d
            else:
                keep = float(torch.rand(1, generator=self.gen)) < min(1.0, float(p[d] / q[d])) if q[d] > 0 else False
            if keep:
                committed.append(d)
                hist.add(d)
                continue
            residual = (p - q).clamp(min=0)
            committed.append(self.draw(residual / residual.sum()) if float(residual.sum()) > 0 else self.draw(p))
            return committed
        committed.append(self.draw(self.dist(p_logits[len(drafts)], hist)))
        return committed


@torch.no_grad()
def speculative_generate(target: nn.Module, draft: nn.Module, tokenizer, prompt_ids: list[int], params: SamplingParams,
                         num_draft_tokens: int = 4, on_text: Optional[Callable[[str], None]] = None,
                         kv_cache_dtype: Optional[str] = None) -> tuple[Completion, SpeculativeStats]:
    if num_draft_tokens < 1:
        raise ValueError("num_draft_tokens must be >= 1")
    vocab = target.get_output_embeddings().weight.shape[0]
    if draft.get_output_embeddings().weight.shape[0] != vocab:
        raise IncompatibleModelsError("the draft model's vocabulary differs from the target's; it must share the "
                                      "tokenizer (e.g. a quantized copy of the same model)")
    seq = list(prompt_ids)
    limit = min(context_limit(target), context_limit(draft))
    budget = min(params.max_new_tokens, limit - len(seq) - num_draft_tokens - 1)
    if budget < 1:
        raise ContextLengthError(f"a prompt of {len(seq)} tokens leaves no room in the context of {limit}; "
                                 "shorten the prompt")
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    request = Request.start(tokenizer, seq, params, vocab, end_token_ids(target, tokenizer), budget, on_text)
    history = request.history  # the committed sequence's history; each round's drafts extend a copy
    tgt = _Model(target, make_cache(target, kv_cache_dtype) or DynamicCache(config=target.config))
    drf = _LeanDraft(draft, len(seq) + budget + num_draft_tokens + 1) if lean_decode.supports(draft) \
        else _Model(draft, DynamicCache(config=draft.config))
    stats = SpeculativeStats()
    start = time.perf_counter()
    rounds = _Rounds(params, gen, num_draft_tokens)
    while not request.done:
        drafts, qs = rounds.propose(drf, seq, history)
        # verify in one target forward: the distributions after the last committed token and after each draft
        committed = rounds.verify(tgt.logits_from(seq + drafts, len(seq) - 1), drafts, qs, history)
        stats.rounds += 1
        stats.proposed += num_draft_tokens
        stats.accepted += len(committed) - 1  # drafts kept; the last token is a resample or the bonus
        # commit token by token: the request's state machine decides where it stops
        for token in committed:
            if request.commit(token):
                break
            seq.append(token)
    return request.complete(start), stats
