"""The sampler: pure functions from one request's logits to its next token.

Fixed order (each stage skipped at its neutral value):
  1. repetition penalty (multiplicative, over prompt and output tokens: a seen token's logit is
     divided by the penalty when positive, multiplied when negative);
  2. presence and frequency penalties (additive, over output tokens:
     logit -= presence * [count > 0] + frequency * count);
  3. temperature (0 = greedy: argmax of the penalized logits, no randomness);
  4. top-k; 5. top-p (the smallest set of most likely tokens whose probability reaches p);
  6. min-p (drop tokens below min_p x the top token's probability);
  7. sample from the softmax with the request's own generator.
Every request has its own seeded `torch.Generator`, so its tokens do not depend on what else is
in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = 0
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS / end-of-turn tokens
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0 (0 = greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 = off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2] (OpenAI's range; 0 = off)"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2] (OpenAI's range; 0 = off)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """seen: bool [vocab], tokens of the prompt and the output."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """counts: [vocab] occurrences of each token in the output so far."""
    if presence == 0 and frequency == 0:
        return logits
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts.to(logits.dtype)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


TOP_P_CANDIDATES = 256  # tokens ranked first; widened x8 while they hold less than p of the probability


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest prefix of the tokens ranked by probability whose probability reaches p (the top token
    always). Only the candidates that can be in that prefix are ranked (`torch.topk`, widened until they hold p):
    sorting Gemma's whole 262144-token vocabulary took 96 ms per token on one core, the first 256 well under 1."""
    if p >= 1.0:
        return logits
    probs = logits.softmax(-1)
    k = min(TOP_P_CANDIDATES, probs.numel())
    while True:
        top, order = torch.topk(probs, k)  # sorted, descending
        if k == probs.numel() or float(top.sum()) >= p:
            break
        k = min(8 * k, probs.numel())
    before = top.cumsum(-1) - top  # probability of the tokens ranked above each one
    keep = order[before < p]
    out = torch.full_like(logits, NEG_INF)
    out[keep] = logits[keep]
    return out


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), NEG_INF)


def processed_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Stages 1-6 on float32 logits [vocab]; with temperature 0 only the penalties apply."""
    x = logits.float()
    x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    x = apply_presence_frequency(x, counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return x
    x = x / params.temperature
    x = apply_top_k(x, params.top_k)
    x = apply_top_p(x, params.top_p)
    return apply_min_p(x, params.min_p)


def distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The probabilities the sampler draws from ([vocab]; one-hot at the argmax when greedy)."""
    x = processed_logits(logits, params, seen, counts)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).float()
    return x.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, counts: torch.Tensor,
           generator: Optional[torch.Generator]) -> int:
    x = processed_logits(logits, params, seen, counts)
    if params.greedy:
        return int(x.argmax())
    return int(torch.multinomial(x.softmax(-1), 1, generator=generator))


class TokenHistory:
    """What the penalties need about one request: seen tokens (prompt + output) and output counts."""

    def __init__(self, vocab: int, prompt_ids: list[int]):
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.counts = torch.zeros(vocab, dtype=torch.int32)
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids)] = True

    def add(self, token: int) -> None:
        self.seen[token] = True
        self.counts[token] += 1

    def copy(self) -> "TokenHistory":
        other = TokenHistory.__new__(TokenHistory)
        other.seen, other.counts = self.seen.clone(), self.counts.clone()
        return other
