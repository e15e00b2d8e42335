"""Attention over the paged KV pool, as a transformers attention implementation (the torch reference).

A step's tokens come from several sequences, flattened into one row ([1, T]: no padding); each
token has its own position. transformers' decoder layers compute q/k/v, their norms and RoPE as
usual and call the attention implementation registered here (`NAME`), which gets the step's
layout (`StepLayout`) as the keyword `quantkit_step`. It writes the step's keys and values into
the pool at their slots, then attends:
  - decode tokens (one per sequence) at once: their contexts' blocks gathered from the pool into
    one padded [B, blocks x block_size] batch, one masked one-query attention (SDPA or the native
    kernel, whichever `runtime.one_query` measured faster; SDPA where scores are soft-capped);
  - each prefill chunk on its own: its context's blocks (cached prefix + earlier chunks + itself)
    gathered, causal within the chunk; a chunk with no earlier context attends to its own keys.
Sliding-window layers (Gemma 3: the module passes `sliding_window`) see only keys with
query position - key position < window, as transformers' masks do; where the module passes
`softcap` (logit soft-capping), scores go through cap * tanh(s / cap) before the softmax.
Masks are built once per step per window size and reused by every layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.engine.kv_pool import KVPool
from quantkit.runtime import one_query

NAME = "quantkit_paged"


@dataclass
class DecodeGroup:
    """The step's single-token sequences: their rows in the flat batch and their contexts' slots."""

    rows: torch.Tensor  # [B] token indices in the step
    tables: torch.Tensor  # [B, n] their contexts' blocks, padded with block 0
    lengths: torch.Tensor  # [B] context lengths (the new token included)
    block_size: int
    masks: dict = field(default_factory=dict)

    def mask(self, window: Optional[int]) -> Optional[torch.Tensor]:
        """[B, 1, 1, n x block_size] bool (True: attend), or None when nothing is masked."""
        if window not in self.masks:
            j = torch.arange(self.tables.shape[1] * self.block_size, device=self.tables.device)
            keep = j[None] < self.lengths[:, None]
            if window is not None:
                keep &= (self.lengths[:, None] - 1 - j[None]) < window
            self.masks[window] = None if bool(keep.all()) else keep[:, None, None]
        return self.masks[window]

    def additive(self, window: Optional[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """`mask` as 0 / -inf scores [B, 1, 1, n x block_size] in `dtype` (None when nothing is masked)."""
        key = ("additive", window, dtype)
        if key not in self.masks:
            keep = self.mask(window)
            self.masks[key] = None if keep is None else \
                torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        return self.masks[key]


@dataclass
class Chunk:
    """One sequence's run of `count` tokens (rows start..start+count) ending its context of `length`."""

    start: int
    count: int
    length: int
    blocks: torch.Tensor  # [ceil(length / block_size)] the context's blocks
    masks: dict = field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        """No earlier context: the chunk attends to its own keys only."""
        return self.length == self.count

    def mask(self, window: Optional[int]) -> tuple[Optional[torch.Tensor], bool]:
        """(bool mask [count, length] or None, is_causal)."""
        length = self.length
        if self.fresh and (window is None or length <= window):
            return None, True
        if window not in self.masks:
            q = torch.arange(length - self.count, length, device=self.blocks.device)[:, None]
            j = torch.arange(length, device=self.blocks.device)[None]
            keep = j <= q
            if window is not None:
                keep &= (q - j) < window
            self.masks[window] = keep
        return self.masks[window], False


@dataclass
class StepLayout:
    pool: KVPool
    slots: torch.Tensor  # [T] where each token's keys / values go
    decode: Optional[DecodeGroup]
    chunks: list[Chunk]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
           scale: Optional[float], softcap: Optional[float]) -> torch.Tensor:
    """q [B, H, n, d] over k / v [B, KVH, L, d] (H a multiple of KVH); mask bool, True = attend."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                    sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    quantkit_step: Optional[StepLayout] = None, **_kwargs):
    """The attention implementation transformers calls: query [1, H, T, d], key / value [1, KVH, T, d] of
    the step's tokens; returns ([1, T, H, d], None)."""
    if quantkit_step is None:
        raise RuntimeError(f"attention implementation {NAME!r} runs only inside the engine's step")
    return attend_layer(quantkit_step, module.layer_idx, query, key, value, scaling, sliding_window, softcap), None


def attend_layer(step: StepLayout, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: Optional[float], sliding_window: Optional[int] = None,
                 softcap: Optional[float] = None) -> torch.Tensor:
    """Store the step's keys / values of `layer` in the pool, then attend: [1, T, H, d]."""
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, d]
    step.pool.write(layer, k_new, v_new, step.slots)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, d]
    if step.decode is not None:
        g = step.decode
        q = query[0][:, g.rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
        k, v = step.pool.read(layer, g.tables)  # [B, Lmax, KVH, d]
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        if softcap is None:  # one query a sequence: SDPA or the native kernel, whichever is faster here
            o = one_query.attend(q, k, v, k.shape[2], g.additive(sliding_window, q.dtype),
                                 q.shape[-1] ** -0.5 if scaling is None else scaling)
        else:
            o = attend(q, k, v, g.mask(sliding_window), False, scaling, softcap)
        out[g.rows] = o[:, :, 0]
    for c in step.chunks:
        end = c.start + c.count
        if c.fresh:
            k, v = step.pool.dequantized(layer, k_new[c.start:end], v_new[c.start:end])
        else:
            k, v = step.pool.read(layer, c.blocks[None])
            k, v = k[0, : c.length], v[0, : c.length]
        mask, causal = c.mask(sliding_window)
        o = attend(query[:, :, c.start:end], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, causal,
                   scaling, softcap)
        out[c.start:end] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)


_register()


def configs_of(model: nn.Module) -> list:
    """Every distinct config object of the model's modules (the attention modules read theirs)."""
    return list({id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values())


@contextlib.contextmanager
def paged(configs: list):
    """The attention modules of these configs (`configs_of`) use `paged_attention` inside the block."""
    before = [(c, c._attn_implementation_internal) for c in configs]
    for c, _ in before:
        c._attn_implementation_internal = NAME
    try:
        yield
    finally:
        for c, impl in before:
            c._attn_implementation_internal = impl
