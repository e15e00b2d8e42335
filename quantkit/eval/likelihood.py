"""Log-likelihood of continuations: the scoring under lm-eval's loglikelihood requests.

`score(model, requests)` takes (context ids, continuation ids) pairs and returns, per pair, the sum
of log p(continuation token | everything before it) and whether every continuation token was the
greedy (argmax) choice. Pairs are run in batches of similar length, right-padded: a causal model's
positions never see the padding after them, so no attention mask is needed and a padded row scores
exactly as alone. The LM head runs only on the positions that predict continuation tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from quantkit.eval.divergence import log_probs


def _truncate(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], int]:
    """The last max_length + 1 tokens of context + continuation and the continuation's length in them
    (the first token is input only: it is never predicted)."""
    whole = (context + continuation)[-(max_length + 1):]
    return whole, min(len(continuation), len(whole) - 1)


@torch.no_grad()
def score(model: nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
          batch_size: int = 1) -> list[tuple[float, bool]]:
    """[(sum log-prob of the continuation, all greedy)] in the order of `requests`.

    Each context must hold at least one token (lm-eval gives an empty context its prefix token)."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    device = model.get_input_embeddings().weight.device
    items = []
    for i, (ctx, cont) in enumerate(requests):
        if not ctx:
            raise ValueError(f"request {i}: an empty context (give it a BOS/EOS token)")
        if not cont:
            raise ValueError(f"request {i}: an empty continuation")
        items.append((i, *_truncate(list(ctx), list(cont), max_length)))
    order = sorted(items, key=lambda it: -len(it[1]))
    out: list = [None] * len(items)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = len(batch[0][1]) - 1  # inputs: every token but the last
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, whole, _) in enumerate(batch):
            ids[row, : len(whole) - 1] = torch.tensor(whole[:-1])
        hidden = model.model(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for row, (index, whole, n) in enumerate(batch):
            end = len(whole) - 1  # positions end - n .. end - 1 predict the continuation
            logp = log_probs(head(hidden[row, end - n : end]), softcap)
            target = torch.tensor(whole[-n:], device=logp.device)
            total = logp.gather(-1, target[:, None]).sum().item()
            out[index] = (total, bool((logp.argmax(-1) == target).all()))
    return out
