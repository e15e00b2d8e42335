"""A lean single-token decode step for Gemma 3 text decoders (`gemma3_text`), as `lean_decode` has for llama.

transformers' Gemma 3 forward spends most of a decode step on Python around its matmuls: on a 2-core AMD EPYC
a W4A16 Gemma-3-270m step ran about 600 dtype copies and 100 norms' worth of small ops around 126 GEMVs. This
step computes the same layer as transformers' `Gemma3DecoderLayer` on the same weights with the lean step's
parts (`lean_decode`): fused q/k/v and gate/up, one-token GEMVs or the CPU int4 op called directly, RoPE by a
roll, the cache write into the StaticCache the prefill filled, and attention over its filled part (SDPA or
the native one-query kernel, `one_query`). Gemma's own parts run as transformers computes them: its RMSNorm
(normalized in float32, times 1 + weight, rounded once: `row_norm.gemma_rms_norm`), per-head q/k norms,
norms after attention and after the MLP, the RoPE of each layer's type (local / global frequencies), its
scaled embedding, its MLP activation and its attention scaling (query_pre_attn_scalar).

Sliding-window layers hold their last `sliding_window` positions: while a generate's cache fits the window
(prompt + new tokens <= 512 for Gemma-3-270m) every position is in it and the window changes nothing, so the
step runs there; longer generations, attention logit softcapping and FP8 caches keep transformers' forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quantkit.kernels import native as native_kernels
from quantkit.runtime import decode_stack, lean_decode, one_query
from quantkit.runtime.row_norm import gemma_rms_norm as _norm
from quantkit.runtime.lean_decode import _rope, _run, _signed_sin

MODEL_TYPES = ("gemma3_text",)
LAYER_TYPES = ("sliding_attention", "full_attention")


def supports(model: nn.Module, cache) -> bool:
    """Whether the Gemma step runs `model` over `cache` (a StaticCache whose sliding layers hold every slot)."""
    cfg = model.config
    offload = getattr(model, "quantkit_offload", None)
    if cfg.model_type not in MODEL_TYPES or (offload is not None and offload.offloaded):
        return False
    if getattr(cfg, "attn_logit_softcapping", None) is not None or getattr(cfg, "use_bidirectional_attention", False):
        return False
    if not set(getattr(cfg, "layer_types", None) or ()) <= set(LAYER_TYPES) or getattr(cache, "scales", None):
        return False
    layers = getattr(cache, "layers", None) or []
    # a sliding layer holds min(window, total) slots: every layer with the same length means the window holds all
    lengths = {getattr(layer, "max_cache_len", None) for layer in layers}
    window = getattr(cfg, "sliding_window", None)
    fits = len(lengths) == 1 and None not in lengths and (window is None or lengths.pop() <= window)
    return fits and len(layers) == cfg.num_hidden_layers


class GemmaLeanDecoder(lean_decode.LeanDecoder):
    """Decode steps of a Gemma 3 decoder over a StaticCache filled by a transformers prefill (`step`)."""

    def __init__(self, model: nn.Module, cache):
        super().__init__(model, cache)
        layers = list(self.inner.layers)
        self.types = list(model.config.layer_types)
        self.kinds = sorted(set(self.types))  # the RoPE tables of a step, one per layer type
        self.scaling = layers[0].self_attn.scaling
        self.extra = [(l.pre_feedforward_layernorm, l.post_feedforward_layernorm) for l in layers]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slot: int, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at cache slot `slot`; positions [B, 1]; mask [B, slot + 1] (1 = attend).
        Returns the logits [B, vocab]."""
        h = self.inner.embed_tokens(ids)  # scaled by sqrt(hidden), as the model's embedding does
        attend = lean_decode.additive_mask(mask, h)
        rope, fused = {}, {}
        for kind in self.kinds:
            cos, sin = self.inner.rotary_emb(h, positions, kind)  # [B, 1, head_dim]
            rope[kind] = (cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1)))
            fused[kind] = self._fused_inputs(h.dtype, *rope[kind], attend)
        native = all(f is not None for f in fused.values())
        stack = self._native_stack(h.dtype) if native and ids.shape[0] == 1 else None
        if stack is not None:  # every layer in one native call, the same kernels and ops as below
            tables = [fused[kind][:2] for kind in self.kinds]
            h = stack.step(h.view(1, -1), tables, slot, fused[self.kinds[0]][2]).view_as(h)
        else:
            for i, p in enumerate(self.plans):
                kind = self.types[i]
                x = _norm(h, p.ln1)
                o = self._native_attention(i, p, x, slot, fused[kind], h.dtype) if native else \
                    self._gemma_attention(i, p, x, slot, *rope[kind], attend, h.dtype)
                h = h + _norm(_run(p.o, o.reshape(h.shape[0], 1, -1)).to(h.dtype), p.ln2)
                pre, post = self.extra[i]
                h = h + _norm(self._mlp(p, _norm(h, pre), h.dtype), post)
        return self.logits(_norm(h, self.inner.norm)[:, -1])

    def _native_stack(self, dtype: torch.dtype):
        """The native DecodeStack over this decoder's Gemma layers (`decode_stack`: made once), or None."""
        if self._stack_for != dtype:
            mod = native_kernels.module()
            parts = [decode_stack.gemma_parts(mod, layer) for layer in self.inner.layers] if mod is not None else None
            ropes = [self.kinds.index(t) for t in self.types]
            self._stack = decode_stack.build(self.plans, self.cache, dtype, self.scaling, self.heads, ropes, parts)
            self._stack_for = dtype
        return self._stack

    def _mlp(self, p, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if p.gate_up is None:
            return p.mlp(x)
        lin, sizes = p.gate_up
        gate, up = _run(lin, x).split(sizes, dim=-1)
        return _run(p.down, p.act(gate.to(dtype)) * up.to(dtype)).to(dtype)

    def _qkv(self, p, x: torch.Tensor, dtype: torch.dtype) -> tuple:
        """q, k [B, 1, H(kv), D] after the per-head norms, and v [B, 1, H_kv * D]."""
        b, d = x.shape[0], self.head_dim
        if p.qkv is not None:
            lin, sizes = p.qkv
            q, k, v = _run(lin, x).to(dtype).split(sizes, dim=-1)
        else:
            q, k, v = (_run(lin, x).to(dtype) for lin in (p.q, p.k, p.v))
        return _norm(q.view(b, 1, -1, d), p.q_norm), _norm(k.view(b, 1, -1, d), p.k_norm), v

    def _native_attention(self, i: int, p, x: torch.Tensor, slot: int, fused: tuple, dtype: torch.dtype):
        """Layer i's attention through the native RoPE + cache write + attention call (as the stack runs it)."""
        b = x.shape[0]
        q, k, v = self._qkv(p, x, dtype)
        row = torch.cat([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], dim=-1)
        store = self.cache.layers[i]
        return native_kernels.module().rope_store_attend(row, *fused[:2], store.keys, store.values, slot, fused[2],
                                                         self.scaling, self.heads)

    def _gemma_attention(self, i: int, p, x: torch.Tensor, slot: int, cos: torch.Tensor, sin: torch.Tensor,
                         attend: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Layer i's q/k/v, per-head norms, RoPE, cache write and attention by torch ops: [B, 1, H, D]."""
        b, d = x.shape[0], self.head_dim
        q, k, v = self._qkv(p, x, dtype)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        store = self.cache.layers[i]
        store.keys[:, :, slot] = k[:, :, 0]
        store.values[:, :, slot] = v.view(b, -1, d)
        return one_query.attend(q, store.keys, store.values, slot + 1, attend, self.scaling).transpose(1, 2)
