"""Perplexity over non-overlapping windows: ppl = exp(mean next-token NLL), in float32.

Protocol (also in evals/PROTOCOL.md): the text is tokenized once without special tokens and cut
into consecutive windows of `seq_len` tokens (the last partial window is dropped). For model
families that need it (Gemma) each window is BOS + seq_len - 1 text tokens. Every position
after the first in a window is scored; the mean is over all scored tokens of all windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from quantkit.errors import CalibrationDataError
from quantkit.runtime.kv_cache import cache_factory
from quantkit.platform.transformers_compat import cache_kwargs

LOGIT_CHUNK = 512  # positions per LM-head chunk: Gemma's 262k vocab makes full logits 2 GB per window


@dataclass
class PplResult:
    ppl: float
    nll: float  # mean token negative log-likelihood (nats)
    tokens: int  # scored tokens
    windows: int
    seq_len: int
    seconds: float


def windows(ids: torch.Tensor, seq_len: int, max_windows: Optional[int], bos_id: Optional[int]) -> torch.Tensor:
    """[n_windows, seq_len] windows of `ids` (BOS-prefixed when bos_id is given)."""
    body = seq_len - (1 if bos_id is not None else 0)
    n = ids.numel() // body
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise CalibrationDataError(
            f"evaluation text has {ids.numel()} tokens, fewer than one window of {seq_len}; "
            "use a longer text or a smaller --seq-len"
        )
    w = ids[: n * body].reshape(n, body)
    if bos_id is not None:
        w = torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), w], dim=1)
    return w


@torch.no_grad()
def window_nll(model: nn.Module, ids: torch.Tensor, cache=None) -> tuple[float, int]:
    """Sum of next-token NLL over one window [1, seq_len] and the number of scored tokens.
    cache: e.g. an FP8 KV cache (`runtime.kv_cache`) that attention then reads keys/values through."""
    if cache is None:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [1, S, H]
    else:
        hidden = model.model(input_ids=ids, **cache_kwargs(model.model, cache), use_cache=True).last_hidden_state
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    total = 0.0
    for start in range(0, ids.shape[1] - 1, LOGIT_CHUNK):
        h = hidden[:, start : min(start + LOGIT_CHUNK, ids.shape[1] - 1)]
        logits = head(h).float()  # [1, chunk, vocab]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        target = ids[:, start + 1 : start + 1 + h.shape[1]]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
    return total, ids.shape[1] - 1


def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int = 2048, max_windows: Optional[int] = 16,
               bos_id: Optional[int] = None, progress: bool = False, kv_cache_dtype: Optional[str] = None) -> PplResult:
    """Perplexity of `model` (already in float32) over windows of token ids [n]."""
    start = time.perf_counter()
    wins = windows(ids, seq_len, max_windows, bos_id)
    new_cache = cache_factory(model, kv_cache_dtype)
    total, count = 0.0, 0
    device = model.get_input_embeddings().weight.device
    for w in tqdm(wins, desc="perplexity", unit="window", disable=not progress):
        nll, n = window_nll(model, w.unsqueeze(0).to(device), new_cache())
        total, count = total + nll, count + n
    mean = total / count
    return PplResult(math.exp(mean), mean, count, len(wins), seq_len, time.perf_counter() - start)
