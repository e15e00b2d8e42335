"""The paged KV pool: one preallocated tensor of token slots per layer for keys and one for values.

Slot s lives in block s // block_size. Layer l's keys are `keys[l]` of shape [slots, kv_heads,
head_dim]; a request's block table maps its token positions to slots. Tokens are written where
the step's slot mapping says (`write`) and read back by slot index (`read`).

The pool is sized from a memory budget (`blocks_for_budget`). With `kv_cache_dtype="fp8"` the
slots hold float8 e4m3 codes (half the bytes of bf16) and each layer's calibrated k/v scale
(`runtime.kv_cache.kv_scales`); a read gives code x scale in the compute dtype, the same values the
runner's FP8 cache attends over (`quant.fp8.fake_quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from quantkit.quant.fp8 import quantize


@dataclass(frozen=True)
class KVShape:
    """What one token's keys and values take in every layer."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: nn.Module) -> "KVShape":
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim)

    def bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def element_bytes(dtype: torch.dtype, kv_cache_dtype: Optional[str]) -> int:
    return 1 if kv_cache_dtype == "fp8" else torch.empty((), dtype=dtype).element_size()


def blocks_for_budget(budget_bytes: int, shape: KVShape, block_size: int, element: int) -> int:
    """How many blocks of `block_size` tokens a budget of `budget_bytes` holds."""
    return int(budget_bytes // (block_size * shape.bytes_per_token(element)))


class KVPool:
    """Keys and values of `num_blocks` x `block_size` token slots in every layer."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 fp8_scales: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]] = None):
        self.shape, self.num_blocks, self.block_size, self.dtype = shape, num_blocks, block_size, dtype
        slots = num_blocks * block_size
        store = torch.uint8 if fp8_scales is not None else dtype  # e4m3 codes kept as bytes (index ops take those)
        self.keys = [torch.zeros(slots, shape.kv_heads, shape.head_dim, dtype=store, device=device)
                     for _ in range(shape.layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.scales = None if fp8_scales is None else \
            {l: (k.float().reshape(1, -1, 1).to(device), v.float().reshape(1, -1, 1).to(device))
             for l, (k, v) in fp8_scales.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Store keys / values [tokens, kv_heads, head_dim] at `slots` [tokens]."""
        if self.scales is not None:
            ks, vs = self.scales[layer]
            keys, values = quantize(keys, ks).view(torch.uint8), quantize(values, vs).view(torch.uint8)
        self.keys[layer].index_copy_(0, slots, keys.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(0, slots, values.to(self.values[layer].dtype))

    def read(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks: tables [B, n] block ids -> [B, n * block_size, kv_heads, head_dim]
        in the compute dtype. Blocks are copied whole (one index_select of block-sized rows: on an AMX Xeon
        16 x 20 blocks of SmolLM2's bf16 keys took 113 us, gathering the same slots one by one 574 us)."""
        b, n = tables.shape
        shape = (self.num_blocks, -1)
        flat = tables.reshape(-1)
        k = self.keys[layer].view(shape).index_select(0, flat).view(b, n * self.block_size, *self.keys[layer].shape[1:])
        v = self.values[layer].view(shape).index_select(0, flat).view(b, n * self.block_size, *self.values[layer].shape[1:])
        if self.scales is None:
            return k, v
        ks, vs = self.scales[layer]
        return ((k.view(torch.float8_e4m3fn).float() * ks).to(self.dtype),
                (v.view(torch.float8_e4m3fn).float() * vs).to(self.dtype))

    def dequantized(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `read` would give for keys / values [tokens, kv_heads, head_dim] just written."""
        if self.scales is None:
            return keys, values
        ks, vs = self.scales[layer]
        return ((quantize(keys, ks).float() * ks).to(self.dtype), (quantize(values, vs).float() * vs).to(self.dtype))
