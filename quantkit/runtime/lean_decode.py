"""A lean single-token decode step for llama-family decoders (llama, mistral, qwen2, qwen3).

transformers' forward spends much of a decode step on Python around the matmuls (decorators,
keyword plumbing, mask construction over the whole cache, module dispatch). This step runs the
same maths on the same modules' weights with little of that: the linears are the model's own
modules (plain, packed int4 or FP8: each uses its kernel), norms and the MLP are called directly,
keys/values are written into the preallocated StaticCache the prefill filled, and attention reads
only the filled part with a boolean padding mask. Plain 16-bit q/k/v and gate/up projections are
fused (one GEMV each instead of three and two): their weights are re-stored as views into one
concatenated tensor, so nothing is duplicated and the modules keep working as before. Greedy outputs are tested equal to transformers'.
Other architectures (e.g. Gemma 3: sliding windows, logit softcapping) keep transformers' forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.quant.fp8 import fake_quantize
from quantkit.runtime.kv_cache import head_view

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def supports(model: nn.Module) -> bool:
    cfg = model.config
    return (cfg.model_type in SUPPORTED and getattr(cfg, "sliding_window", None) in (None, 0)
            and not getattr(cfg, "use_sliding_window", False))


def _fuse(linears: list[nn.Module]):
    """(weight, bias, sizes) of one linear equal to `linears` stacked on the output dim, with each
    module's weight (and bias) re-stored as a view into it; None unless all are plain nn.Linear of
    one dtype and device."""
    if any(type(m) is not nn.Linear for m in linears):
        return None
    ws = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or any(w.requires_grad for w in ws):
        return None
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        return None
    weight = torch.cat([w.data for w in ws])
    bias = torch.cat([m.bias.data for m in linears]) if all(has_bias) else None
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if bias is not None:
            m.bias.data = bias[start : start + n]
        sizes.append(n)
        start += n
    return weight, bias, sizes


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear, except for one 16-bit token on CPU: torch.mv there (this CPU's bf16 GEMV through
    F.linear is 1.7-2.3x slower than through mv: 120 vs 69 us at 1728 x 576, 2950 vs 1308 us for
    SmolLM2's 49152 x 576 head)."""
    if x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        y = torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _linear(x, module.weight, module.bias) if type(module) is nn.Linear else module(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """Decode steps over a StaticCache filled by a transformers prefill of `total` slots."""

    def __init__(self, model: nn.Module, cache, fp8_scales: Optional[dict] = None):
        self.model, self.cache = model, cache
        self.inner = model.model
        self.layers = list(self.inner.layers)
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.fp8_scales = fp8_scales
        self.head = model.get_output_embeddings()
        fused = getattr(model, "_quantkit_fused", None)  # fused once per model, reused by every generate
        if fused is None:
            fused = ([_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers],
                     [_fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers])
            model._quantkit_fused = fused
        self.qkv, self.gate_up = fused

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slot: int, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at cache slot `slot`; positions [B, 1]; mask [B, slot + 1] (1 = attend).
        Returns the logits [B, vocab]."""
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, positions)  # [B, 1, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attend = mask[:, None, None, :].bool()  # [B, 1, 1, slot + 1]
        b = ids.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if self.qkv[i] is not None:
                weight, bias, sizes = self.qkv[i]
                q, k, v = _linear(x, weight, bias).split(sizes, dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.view(b, 1, -1, self.head_dim)
            k = k.view(b, 1, -1, self.head_dim)
            v = v.view(b, 1, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # qwen3: per-head norms before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if self.fp8_scales is not None:
                ks, vs = self.fp8_scales[i]
                k, v = fake_quantize(k, head_view(ks)), fake_quantize(v, head_view(vs))
            store = self.cache.layers[i]
            store.keys[:, :, slot] = k[:, :, 0]
            store.values[:, :, slot] = v[:, :, 0]
            keys, values = store.keys[:, :, : slot + 1], store.values[:, :, : slot + 1]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=self.scaling,
                                               enable_gqa=self.heads != self.kv_heads)
            h = h + _apply(attn.o_proj, o.transpose(1, 2).reshape(b, 1, -1))
            x = layer.post_attention_layernorm(h)
            if self.gate_up[i] is not None:
                weight, bias, sizes = self.gate_up[i]
                gate, up = _linear(x, weight, bias).split(sizes, dim=-1)
                h = h + _apply(layer.mlp.down_proj, layer.mlp.act_fn(gate) * up)
            else:
                h = h + layer.mlp(x)
        h = self.inner.norm(h)
        return _apply(self.head, h[:, -1])
