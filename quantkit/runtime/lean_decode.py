"""A lean single-token decode step for llama-family decoders (llama, mistral, qwen2, qwen3).

transformers' forward spends much of a decode step on Python around the matmuls (decorators,
keyword plumbing, mask construction over the whole cache, module dispatch). This step runs the
same maths on the same weights with little of that. Each layer's parts are resolved once per
generate (`_LayerPlan`); plain linears run as GEMVs on their weights, packed int4 linears on the
CPU int4 op directly (its bf16 output promoted to float32 by its consumers, exactly), other packed /
FP8 linears as their own modules; RMSNorm is one fused op (bit-identical to the module); RoPE is
applied once over the q and k heads side by side (a roll instead of rotate_half's four ops, the
same values); keys/values are written into the
preallocated StaticCache the prefill filled, and attention reads only the filled part (torch's SDPA or the
native one-query kernel, whichever is faster here: `one_query`), with an additive padding mask only when a
row is padded. Where the native attention was chosen, a layer with fused q/k/v runs RoPE, the cache write
and the attention in one native call (`kernels.native`: rope_store_attend), and where every layer of a
one-sequence step can, all the layers run in one native call of the same kernels and ops (`decode_stack`).
Plain q/k/v and gate/up projections of one
dtype are fused (one GEMV each instead of three and two): their weights are re-stored as views
into one concatenated tensor, so nothing is duplicated and the modules keep working as before.
Logits are tested against transformers' forward, and greedy outputs equal to transformers'.
Gemma 3 has its own step on these parts (`lean_gemma`); other architectures keep transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.platform import compute
from quantkit.kernels import cpu_int4, native
from quantkit.quant.fp8 import fake_quantize
from quantkit.qmodules.kv import head_view
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.qmodules import online_rotation
from quantkit.runtime import decode_stack, one_query, row_norm
from quantkit.runtime.state import runtime_state

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# causal LMs whose forward is `model.model` then the head (and final logit softcapping, if configured): the
# runner may call the two itself, the head on the last position through `_linear` (an AMX Xeon: Gemma 3's
# 262144 x 640 bf16 head through transformers' forward cost 29 ms and a 9 ms weight copy per step)
HEAD_APART = SUPPORTED + ("gemma3_text",)


def supports(model: nn.Module) -> bool:
    cfg = model.config
    offload = getattr(model, "quantkit_offload", None)
    if offload is not None and offload.offloaded:  # fusing would load every layer at once
        return False
    return (cfg.model_type in SUPPORTED and getattr(cfg, "sliding_window", None) in (None, 0)
            and not getattr(cfg, "use_sliding_window", False)
            and hasattr(getattr(getattr(model, "model", None), "norm", None), "variance_epsilon"))


def column_major(weight: torch.Tensor) -> bool:
    """Whether the decode step keeps this plain weight column-major (stored as [in, out], the module's
    weight a transposed view of it): float32 on the CPU. A one-token float32 F.linear then streams
    the weight as x @ W^T with W^T contiguous instead of one short dot product per output row. On an
    AVX2 EPYC (2 threads, cold caches, SmolLM2's shapes) 30 layers' GEMVs took 21.6 ms instead of
    28.0 and the 49152 x 576 head 3.8 instead of 7.6 (bench/decode.py: the whole step). 16-bit
    weights keep their row-major layout (torch.mv or F.linear, whichever is faster here: `_linear`)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def _to_column_major(module: nn.Module) -> None:
    """Re-store a plain linear's weight column-major (same values, same shape; see `column_major`)."""
    w = getattr(module, "weight", None)
    if type(module) is nn.Linear and column_major(w) and not w.requires_grad and not _is_column_major(w):
        w.data = w.data.t().contiguous().t()


def _column_major_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear and _is_column_major(m.weight)]


def _is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[0] > 1 and w.stride(0) == 1


def restore_row_major(model: nn.Module) -> None:
    """Give every linear re-stored column-major by the decode step its own row-major (contiguous)
    weight again and drop the fused projections (the next generate makes them again). Runs before
    `model.state_dict()`, so saving sees the usual layout (transformers' save_pretrained cannot take
    a transposed view that shares storage). Weights are copied one at a time; a fused tensor is freed
    once its last view has its own copy."""
    linears = _column_major_linears(model)
    if not linears:
        return
    runtime_state(model).fused = None  # the fused tensors live on only through the modules' views
    for module in linears:
        module.weight.data = module.weight.data.contiguous()


def _fuse(linears: list[nn.Module], dtype: torch.dtype):
    """(weight, bias, sizes) of one linear equal to `linears` stacked on the output dim, or None.

    Plain nn.Linear modules of one dtype: weight is one concatenated tensor and each module's weight
    (and bias) is re-stored as a view into it. Packed int4 modules on the CPU int4 op: weight is one
    Int4PackedCPU whose packed rows are the modules' packed rows side by side (the op packs rows in
    blocks of 64, so every module must have a multiple of 64 outputs) and each module's own kernel
    weight is re-pointed to its rows of it; only the small scale tables are copied. Nothing large
    is duplicated and the modules keep working as before."""
    if len({m.bias is None for m in linears}) != 1:  # some with a bias, some without
        return None
    if any(online_rotation.block_of(m) is not None for m in linears):
        return None  # an online input rotation (a pre-hook): each module rotates its own input when called
    if all(type(m) is nn.Linear for m in linears):
        return _fuse_plain(linears)
    if all(isinstance(m, PackedIntLinear) for m in linears):
        if any(m.weight_g_idx is not None for m in linears):
            return None  # act-order: each permutes its own input (`PackedIntLinear.column_order`), no shared product
        return _fuse_int4_cpu(linears, dtype)
    return None


def _fuse_plain(linears: list[nn.Linear]):
    ws = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or any(w.requires_grad for w in ws):
        return None
    # one [sum out, in] weight, or its column-major form: one [in, sum out] tensor, transposed
    weight = torch.cat([w.data.t() for w in ws], dim=1).t() if column_major(ws[0]) else torch.cat([w.data for w in ws])
    bias = _cat_bias(linears)
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if bias is not None:
            m.bias.data = bias[start : start + n]
        sizes.append(n)
        start += n
    return weight, bias, sizes


def _fuse_int4_cpu(linears: list[PackedIntLinear], dtype: torch.dtype):
    device = linears[0].weight_packed.device
    if device.type != "cpu" or any(m.prepare(device, dtype) != "cpu" for m in linears):
        return None
    packs = [m._prepared[2] for m in linears]
    if len({(p.group_size, p.packed.shape[1], p.scale_zeros.shape[0]) for p in packs}) != 1 \
            or any(m.out_features % cpu_int4.ROW_BLOCK for m in linears):
        return None
    packed = torch.cat([p.packed for p in packs])
    fused = cpu_int4.Int4PackedCPU(packed, torch.cat([p.scale_zeros for p in packs], dim=1),
                                   packs[0].group_size, packed.shape[0], all(p.native_one_token for p in packs))
    start = 0
    for m, p in zip(linears, packs):
        n = m.out_features
        m._prepared = (m._prepared[0], "cpu", cpu_int4.Int4PackedCPU(packed[start : start + n], p.scale_zeros,
                                                                    p.group_size, n, p.native_one_token))
        start += n
    return fused, _cat_bias(linears), [m.out_features for m in linears]


def _cat_bias(linears: list[nn.Module]) -> Optional[torch.Tensor]:
    return None if linears[0].bias is None else torch.cat([m.bias.data for m in linears])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear, or for one 16-bit token on CPU whichever of torch.mv, F.linear and quantkit's own bf16
    GEMV this CPU runs fastest (`compute.gemv_impl`, probed once per machine: an AVX512+AMX Xeon ran bf16
    GEMVs 1.7-2.3x faster through mv, 69 vs 120 us at 1728 x 576; an AVX-512 Xeon without AMX 2.8x slower,
    253 vs 90 us at 1536 x 576; an AVX-512 EPYC with avx512_bf16 ran the native GEMV in 25 us against
    F.linear's 93 at 1536 x 576)."""
    if x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        impl = compute.gemv_impl(x.dtype)
        if impl == "mv":
            y = torch.mv(weight, x.reshape(-1))
        elif impl == compute.NATIVE_GEMV and weight.is_contiguous():
            y = native.gemv_bf16(weight, x.reshape(-1))
        else:
            return F.linear(x, weight, bias)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The llama-family RMSNorm (weight x normalized input, normalized in float32 and cast back) as one
    call instead of the module's seven: torch's fused op (bit-identical to the module) or the native
    kernel, whichever is faster here (`row_norm`)."""
    return row_norm.rms_norm(x, norm.weight, norm.variance_epsilon)


def additive_mask(mask: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
    """A step's mask [B, S] (1 = attend) as one additive [B, 1, 1, S] mask in h's dtype for every layer, or None
    where nothing is masked (one prompt: no padding)."""
    if bool(mask.all()):
        return None
    return torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(mask == 0, float("-inf"))[:, None, None]


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(half, -1) * _signed_sin(sin)
    exactly (rotate_half(x) = [-x2, x1], roll = [x2, x1]; (-a) * b == a * (-b)), one op per use
    instead of four; made once per step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (transformers' RoPE) in cos's dtype, x in any float dtype."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _prepare(model: nn.Module, layers: list[nn.Module], dtype: torch.dtype) -> tuple[list, list]:
    """Fuse q/k/v and gate/up of every layer; o, down and the head go column-major where that is the
    faster layout (`column_major`). Returns (qkv, gate_up) per layer."""
    fused = ([_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], dtype) for l in layers],
             [_fuse([l.mlp.gate_proj, l.mlp.up_proj], dtype) for l in layers])
    for module in [m for l in layers for m in (l.self_attn.o_proj, l.mlp.down_proj)] + [model.get_output_embeddings()]:
        _to_column_major(module)
    state = runtime_state(model)
    if state.layout_hook is None and _column_major_linears(model):
        state.layout_hook = model.register_state_dict_pre_hook(lambda module, _prefix, _keep: restore_row_major(module))
    return fused


def head_apart(model: nn.Module) -> bool:
    """Whether the runner may compute `model`'s hidden states and its head apart (`Head`)."""
    return model.config.model_type in HEAD_APART and hasattr(getattr(model, "model", None), "layers") \
        and model.get_output_embeddings() is not None


class Head:
    """The LM head over one position's final hidden state [B, H] (normed): its linear as the step runs
    linears (`_resolve`: a one-token GEMV by this CPU's faster implementation), then final logit softcapping
    where the config has it, as the model's forward computes it (logits / cap, tanh, * cap)."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.linear = _resolve(model.get_output_embeddings(), device, dtype)
        self.cap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        y = _run(self.linear, hidden)
        y = y if y.dtype == hidden.dtype else y.to(hidden.dtype)
        if self.cap is not None:
            y = torch.tanh(y / self.cap) * self.cap
        return y


@dataclass
class _LayerPlan:
    """What one decoder layer's step needs, resolved once per decoder (no module lookups per token).
    A linear is what `_resolve` gives: (weight, bias) for a plain nn.Linear, an `_Int4`, or a module."""

    ln1: nn.Module
    ln2: nn.Module
    qkv: Optional[tuple]  # fused (linear, sizes) or None
    q: object
    k: object
    v: object
    q_norm: Optional[nn.Module]
    k_norm: Optional[nn.Module]
    o: object
    gate_up: Optional[tuple]  # fused (linear, sizes) or None
    down: object
    mlp: nn.Module
    act: object


@dataclass
class _Int4:
    """A linear on the CPU int4 op, called directly (no module call, no kernel lookup per token). Its
    output stays in the op's dtype (bf16 where the probe chose it for float32 activations) unless
    it has a bias: the consumers (the residual add, RoPE, the cache write, the activation) promote a
    bf16 output to float32 exactly, so the result equals the module's, which casts it back first."""

    packed: cpu_int4.Int4PackedCPU
    bias: Optional[torch.Tensor]
    module: Optional[nn.Module]  # for more rows than the op is used for (None: a fused weight, always the op)


def _resolve(module: nn.Module, device: torch.device, dtype: torch.dtype):
    """What the step calls for a linear: (weight, bias) for a plain nn.Linear (run through `_linear`),
    an `_Int4` for a packed int4 module on the CPU op, else the module itself."""
    if online_rotation.block_of(module) is not None:
        return module  # its online input rotation runs as a pre-hook of the module call
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if isinstance(module, PackedIntLinear) and module.prepare(device, dtype) == "cpu" and module.weight_g_idx is None:
        return _Int4(module._prepared[2], module.bias, module)
    return module  # (act-order int4: the module permutes its input before the op)


def _fused_linear(fused: Optional[tuple]):
    """A fused projection (weight, bias, sizes) -> (linear as `_resolve` gives it, sizes), or None."""
    if fused is None:
        return None
    weight, bias, sizes = fused
    return ((weight, bias) if isinstance(weight, torch.Tensor) else _Int4(weight, bias, None)), sizes


def _run(lin, x: torch.Tensor) -> torch.Tensor:
    """One linear over x [B, 1, K]. An `_Int4` without a bias answers in the op's dtype (see `_Int4`)."""
    if type(lin) is tuple:
        return _linear(x, lin[0], lin[1])
    if type(lin) is not _Int4:
        return lin(x)
    if lin.module is not None and x.numel() > lin.module.op_tokens * x.shape[-1]:
        return lin.module(x)
    return lin.packed.matmul(x, lin.bias, cast_back=False)


def _op_limit(modules: list[nn.Module]) -> int:
    """Up to how many tokens every packed int4 module of `modules` runs its op (no limit for other linears)."""
    return min((m.op_tokens for m in modules if isinstance(m, PackedIntLinear)), default=1 << 30)


class LeanDecoder:
    """Decode steps over a StaticCache filled by a transformers prefill of `total` slots (`step`), or over
    tokens laid flat whose attention the caller computes (`flat_step`: the serving engine's paged cache)."""

    def __init__(self, model: nn.Module, cache, fp8_scales: Optional[dict] = None):
        self.model, self.cache = model, cache
        self.inner = model.model
        layers = list(self.inner.layers)
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.fp8_scales = fp8_scales
        self._stack, self._stack_for = None, None  # the native DecodeStack and the dtype it was made for
        # fused once per model (and compute dtype / device), kept in its runtime state for every generate
        embed = model.get_input_embeddings().weight
        fused = runtime_state(model).fused_for(embed.device, embed.dtype, lambda: _prepare(model, layers, embed.dtype))
        dev, dt = embed.device, embed.dtype
        self.head = Head(model, dev, dt)
        self.plans = []
        self.limits = [(_op_limit([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]),
                        _op_limit([l.mlp.gate_proj, l.mlp.up_proj])) for l in layers]
        for layer, qkv, gate_up in zip(layers, fused.qkv, fused.gate_up):
            attn, mlp = layer.self_attn, layer.mlp
            self.plans.append(_LayerPlan(
                layer.input_layernorm, layer.post_attention_layernorm, _fused_linear(qkv),
                *(_resolve(m, dev, dt) for m in (attn.q_proj, attn.k_proj, attn.v_proj)),
                getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), _resolve(attn.o_proj, dev, dt),
                _fused_linear(gate_up), _resolve(mlp.down_proj, dev, dt), mlp,
                F.silu if getattr(cfg, "hidden_act", None) == "silu" else mlp.act_fn))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over one position's final hidden state [B, H] (already normed), in its dtype."""
        return self.head(hidden)

    @torch.no_grad()
    def flat_step(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """The decoder over T tokens laid flat (ids, positions [1, T]: tokens of several sequences side by
        side); attention(layer, q, k, v) -> [1, T, heads, head_dim] attends them (q [1, heads, T, d] and
        k / v [1, kv_heads, T, d] after the norms and RoPE: the caller stores k / v and picks each token's
        context). Fused q/k/v and gate/up run while T is within every fused int4 module's op limit; longer
        inputs (prefill chunks) run the modules apart, each choosing its op or dequantizing. Returns the
        final normed hidden states [T, hidden]."""
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, positions)  # [1, T, head_dim]
        cos, sin = cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1))
        t, d = ids.shape[1], self.head_dim
        for i, p in enumerate(self.plans):
            x = _rms_norm(h, p.ln1)
            if p.qkv is not None and t <= self.limits[i][0]:
                lin, sizes = p.qkv
                q, k, v = _run(lin, x).to(h.dtype).split(sizes, dim=-1)
            else:
                q, k, v = (_run(lin, x).to(h.dtype) for lin in (p.q, p.k, p.v))
            q, k, v = q.view(1, t, -1, d), k.view(1, t, -1, d), v.view(1, t, -1, d)
            if p.q_norm is not None:  # qwen3: per-head norms before RoPE
                q, k = _rms_norm(q, p.q_norm), _rms_norm(k, p.k_norm)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            o = attention(i, q, k, v.transpose(1, 2))
            h = h + _run(p.o, o.reshape(1, t, -1))
            x = _rms_norm(h, p.ln2)
            if p.gate_up is not None and t <= self.limits[i][1]:
                lin, sizes = p.gate_up
                gate, up = _run(lin, x).split(sizes, dim=-1)
                h = h + _run(p.down, p.act(gate.to(h.dtype)) * up)
            else:
                h = h + p.mlp(x)
        return _rms_norm(h, self.inner.norm)[0]

    def _fused_inputs(self, dtype: torch.dtype, cos: torch.Tensor, signed_sin: torch.Tensor,
                      attend: Optional[torch.Tensor]) -> Optional[tuple]:
        """(cos, signed_sin [B, D], float32 mask [B, slot + 1] or None) for the native RoPE + cache write +
        attention of fused q/k/v layers, or None where that does not run: the one-query probe chose SDPA
        for `dtype`, an FP8 cache, or a cache in another dtype."""
        store = self.cache.layers[0]
        if self.fp8_scales is not None or one_query.impl(dtype) != "native" or store.keys.dtype != dtype \
                or cos.dtype != dtype or store.keys.stride(-1) != 1 or store.values.stride(-1) != 1:
            return None
        b = cos.shape[0]
        return (cos.reshape(b, -1).contiguous(), signed_sin.reshape(b, -1).contiguous(),
                None if attend is None else attend[:, 0, 0].float().contiguous())

    def _attention(self, i: int, p: _LayerPlan, x: torch.Tensor, slot: int, cos: torch.Tensor, sin: torch.Tensor,
                   attend: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Layer i's q/k/v, norms, RoPE, cache write and attention by torch ops: [B, 1, H, D]."""
        b, d, heads = x.shape[0], self.head_dim, self.heads
        # an int4 output may come in bf16 (see `_Int4`): RoPE and the cache write promote it to
        # the compute dtype exactly; the per-head norms and FP8 fake quantization get it cast first
        if p.qkv is not None:
            lin, sizes = p.qkv
            y = _run(lin, x)
            if p.q_norm is None:  # RoPE once over the q and k heads side by side
                qk = y[..., : sizes[0] + sizes[1]].view(b, 1, -1, d).transpose(1, 2)
                q, k = _rope(qk, cos, sin).split([heads, sizes[1] // d], dim=1)
                v = y[..., sizes[0] + sizes[1]:].view(b, 1, -1, d).transpose(1, 2)
            else:
                q, k, v = y.to(dtype).split(sizes, dim=-1)
        else:
            q, k, v = (_run(lin, x).to(dtype) for lin in (p.q, p.k, p.v))
        if p.qkv is None or p.q_norm is not None:
            q, k = q.view(b, 1, -1, d), k.view(b, 1, -1, d)
            v = v.view(b, 1, -1, d).transpose(1, 2)
            if p.q_norm is not None:  # qwen3: per-head norms before RoPE
                q, k = _rms_norm(q, p.q_norm), _rms_norm(k, p.k_norm)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        if self.fp8_scales is not None:
            ks, vs = self.fp8_scales[i]
            k, v = fake_quantize(k, head_view(ks)), fake_quantize(v.to(dtype), head_view(vs))
        store = self.cache.layers[i]
        store.keys[:, :, slot] = k[:, :, 0]
        store.values[:, :, slot] = v[:, :, 0]
        return one_query.attend(q, store.keys, store.values, slot + 1, attend, self.scaling).transpose(1, 2)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slot: int, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] at cache slot `slot`; positions [B, 1]; mask [B, slot + 1] (1 = attend).
        Returns the logits [B, vocab]."""
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, positions)  # [B, 1, head_dim]
        cos, sin = cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1))
        attend = additive_mask(mask, h)
        fused = self._fused_inputs(h.dtype, cos, sin, attend)
        stack = self._native_stack(h.dtype) if fused is not None and ids.shape[0] == 1 else None
        if stack is not None:  # every layer in one native call, the same kernels and ops as `_layers`
            h = stack.step(h.view(1, -1), [fused[:2]], slot, fused[2]).view_as(h)
        else:
            h = self._layers(h, slot, cos, sin, attend, fused)
        h = _rms_norm(h, self.inner.norm)
        return self.logits(h[:, -1])

    def _native_stack(self, dtype: torch.dtype):
        """The native DecodeStack over this decoder's layers for hidden states of `dtype` (`decode_stack`:
        made once), or None where some layer needs the Python step."""
        if self._stack_for != dtype:
            self._stack = decode_stack.build(self.plans, self.cache, dtype, self.scaling, self.heads)
            self._stack_for = dtype
        return self._stack

    def _layers(self, h: torch.Tensor, slot: int, cos: torch.Tensor, sin: torch.Tensor,
                attend: Optional[torch.Tensor], fused: Optional[tuple]) -> torch.Tensor:
        """Every decoder layer over h [B, 1, H] by Python-level calls; the last layer's output."""
        b, heads = h.shape[0], self.heads
        for i, p in enumerate(self.plans):
            x = _rms_norm(h, p.ln1)
            if fused is not None and p.qkv is not None and p.q_norm is None:
                store = self.cache.layers[i]
                o = native.module().rope_store_attend(_run(p.qkv[0], x).to(h.dtype).reshape(b, -1), *fused[:2],
                                                      store.keys, store.values, slot, fused[2], self.scaling, heads)
            else:
                o = self._attention(i, p, x, slot, cos, sin, attend, h.dtype)
            h = h + _run(p.o, o.reshape(b, 1, -1))
            x = _rms_norm(h, p.ln2)
            if p.gate_up is not None:
                lin, sizes = p.gate_up
                gate, up = _run(lin, x).split(sizes, dim=-1)
                h = h + _run(p.down, p.act(gate.to(h.dtype)) * up)
            else:
                h = h + p.mlp(x)
        return h
