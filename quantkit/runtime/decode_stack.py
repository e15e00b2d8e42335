"""A llama-family decode step's decoder layers in one native call (`kernels/native_stack.cpp`: DecodeStack).

`LeanDecoder.step` runs a layer as about fifteen Python-level calls (norms, linears, the fused attention
call, adds, SiLU); on a 2-core AMD EPYC a SmolLM2 W4A16 step spent about as long on that dispatch as in its
int4 GEMVs. DecodeStack runs the same kernels and torch ops in the same order from C++, each linear as
`lean_decode._run` runs one token (the GEMV implementation `compute.gemv_impl` chose, the int4 op or the native
int4 GEMV the decode plan chose), so its hidden state equals the Python step's bit for bit.

Gemma 3's layers (`lean_gemma`) too: per-head q/k norms, Gemma's norms after attention and around the MLP,
GELU, a RoPE table per layer type. It takes over a step only where it can run all of it: one sequence, the
native RoPE + cache write + attention call (`LeanDecoder._fused_inputs`), every layer with fused q/k/v (per-head
norms only for Gemma: qwen3 keeps the Python step) and fused gate/up with SiLU or GELU, and every linear a plain weight or a packed int4 weight on the CPU op (no module call: FP8, act-order and
online rotations keep the Python step). QUANTKIT_NATIVE_STACK=0 keeps the Python step (back-to-back
comparisons); QUANTKIT_NATIVE=0 turns every native kernel off, this with them.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu_int4, native
from quantkit.platform import compute
from quantkit.runtime import row_norm

ENV = "QUANTKIT_NATIVE_STACK"
# how a StackLinear runs (native_stack.cpp's Kind): quantkit's bf16 GEMV, torch.mv, F.linear, a packed int4 weight
NATIVE_GEMV, MV, LINEAR, INT4 = 0, 1, 2, 3
GELU_TANH = ("GELUTanh", "PytorchGELUTanh")  # transformers' gelu_pytorch_tanh: F.gelu(x, approximate="tanh")


def disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no")


def dense_kind(weight: torch.Tensor, dtype: torch.dtype) -> int:
    """How `lean_decode._linear` runs one token of `dtype` through a plain weight."""
    if dtype not in (torch.bfloat16, torch.float16) or weight.device.type != "cpu":
        return LINEAR
    impl = compute.gemv_impl(dtype)
    if impl == "mv":
        return MV
    return NATIVE_GEMV if impl == compute.NATIVE_GEMV and weight.is_contiguous() else LINEAR


def linear_spec(mod, lin, dtype: torch.dtype):
    """The StackLinear that runs `lin` (a linear as `lean_decode._resolve` gives it) for one token of `dtype`
    as `lean_decode._run` would, or None for a module the step calls (FP8, act-order, online rotation)."""
    if type(lin) is tuple:
        weight, bias = lin
        return mod.StackLinear(dense_kind(weight, dtype), weight, None, bias, 0, weight.shape[0], 0)
    packed = getattr(lin, "packed", None)
    if not isinstance(packed, cpu_int4.Int4PackedCPU) or (lin.module is not None and lin.module.op_tokens < 1):
        return None
    rows = cpu_int4.layout_rows() if packed.native_one_token and packed.dtype == torch.bfloat16 else 0
    return mod.StackLinear(INT4, packed.packed, packed.scale_zeros, lin.bias, packed.group_size,
                           packed.out_features, rows or 0)


def act_kind(act) -> Optional[int]:
    """The stack's code for a layer's MLP activation (0 SiLU, 1 GELU with the tanh approximation), or None."""
    if act is F.silu:
        return 0
    return 1 if type(act).__name__ in GELU_TANH else None


def _eps(norm: torch.nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def gemma_parts(mod, layer: torch.nn.Module):
    """A Gemma 3 layer's q / k norms and the norms around its MLP for the stack, or None (norms of several eps)."""
    norms = (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm)
    if len({_eps(n) for n in norms}) != 1:
        return None
    return mod.StackGemmaParts(*(n.weight for n in norms), _eps(norms[0]))


def _layer(mod, plan, store, dtype: torch.dtype, rope: int = 0, gemma=None):
    act = act_kind(plan.act)
    if plan.qkv is None or plan.gate_up is None or act is None or (plan.q_norm is not None) != (gemma is not None):
        return None
    specs = [linear_spec(mod, lin, dtype) for lin in (plan.qkv[0], plan.o, plan.gate_up[0], plan.down)]
    if any(s is None for s in specs):
        return None
    return mod.StackLayer(plan.ln1.weight, plan.ln2.weight, _eps(plan.ln1), _eps(plan.ln2), *specs,
                          plan.gate_up[1][0], store.keys, store.values, rope, act, gemma)


def build(plans: list, cache, dtype: torch.dtype, scaling: float, heads: int,
          ropes: Optional[list[int]] = None, gemma: Optional[list] = None) -> Optional[object]:
    """A DecodeStack over a LeanDecoder's layer plans and static cache for hidden states of `dtype`, or None
    where some layer needs the Python step (or the native kernels are off). ropes: each layer's RoPE table
    (default 0); gemma: each layer's `gemma_parts` (Gemma 3), made with the module this returns from."""
    mod = native.module()
    if disabled() or mod is None:
        return None
    ropes = ropes or [0] * len(plans)
    gemma = gemma or [None] * len(plans)
    layers = [_layer(mod, *args, dtype, rope, parts)
              for args, rope, parts in zip(zip(plans, cache.layers), ropes, gemma)]
    if not layers or any(layer is None for layer in layers):
        return None
    return mod.DecodeStack(layers, row_norm.impl(dtype) == "native", scaling, heads)
