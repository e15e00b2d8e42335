"""Token-level comparison of two next-token distributions: NLL, KL divergence, top-1 agreement.

Pure maths on logits; the evaluation loop (`eval.compare`) feeds it one chunk of positions at a
time. KL(P || Q) is taken from the reference P (the original model) to the candidate Q, in nats,
per scored position: sum_v p_v (log p_v - log q_v), as llama.cpp's `--kl-divergence` reports it.
`Tally` keeps the per-token values of one model on one dataset (4 bytes per token for the KLD,
so a 99th percentile is exact) and sums for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


def log_probs(logits: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """float32 log-softmax over the last dimension (after Gemma's final logit soft-capping, if any)."""
    logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits, dim=-1)


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: logp [n, vocab], targets [n] -> [n] float32."""
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_divergence(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || candidate) per row in nats: [n, vocab] x 2 -> [n] float32, clamped at 0 (rounding)."""
    return F.kl_div(logp, ref_logp, reduction="none", log_target=True).sum(-1).clamp_min_(0.0)


def top1_same(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """[n] bool: the candidate's most likely token is the reference's."""
    return ref_logp.argmax(-1) == logp.argmax(-1)


@dataclass
class Tally:
    """Running totals of one model on one dataset."""

    nll_sum: float = 0.0
    tokens: int = 0
    top1_same: int = 0
    klds: list = field(default_factory=list)  # [n] float32 tensors, one per chunk (candidates only)

    def add(self, nll: torch.Tensor, kld: Optional[torch.Tensor] = None, same: Optional[torch.Tensor] = None) -> None:
        self.nll_sum += nll.double().sum().item()
        self.tokens += nll.numel()
        if kld is not None:
            self.klds.append(kld.detach().float().cpu())
            self.top1_same += int(same.sum().item())

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.nll) if self.tokens and math.isfinite(self.nll) else float("nan")

    def kld_values(self) -> torch.Tensor:
        return torch.cat(self.klds) if self.klds else torch.empty(0)

    def summary(self) -> dict:
        """ppl and mean NLL; for a candidate also KLD mean / 99th percentile / max and top-1 agreement (%)."""
        out = {"ppl": self.ppl, "nll": self.nll, "tokens": self.tokens}
        if self.klds:
            k = self.kld_values().double()
            out.update(kld_mean=k.mean().item(), kld_p99=percentile(k, 99.0), kld_max=k.max().item(),
                       top1_pct=100.0 * self.top1_same / self.tokens)
        return out


def percentile(values: torch.Tensor, q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), for any number of values."""
    v = values.flatten().double().sort().values
    if v.numel() == 0:
        return float("nan")
    pos = (v.numel() - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, v.numel() - 1)
    return (v[lo] + (v[hi] - v[lo]) * (pos - lo)).item()
