"""GGUF in without loss: the linears a GGUF file holds as Q8_0 or Q4_0 become compressed-tensors int
weights whose dequantized values are exactly ggml's (Q8_0 -> symmetric int8 group 32; Q4_0 -> int4
group 32, asymmetric with zero points 0 / -1 when any block has d < 0, symmetric otherwise; fp16
scales as in the file). Q4_1, Q5_0, Q4_K and Q6_K linears keep the file's blocks as they are (quantkit's
`ggml-blocks` format: exact, loaded and run by quantkit, exported back byte for byte; vLLM and transformers
do not read it). Other types (Q5_K, Q2_K, IQ*) stay in the float model transformers dequantized
(`keep_quantized` says which went which way)."""

from __future__ import annotations

from collections import Counter
import numpy as np
import torch
from torch import nn

from quantkit.gguf import grids, metadata
from quantkit.quant import ggml_blocks as blocks
from quantkit.quant.intq import QuantizedWeight
from quantkit.quant.ggml import KIND, GGMLWeight
from quantkit.quant.schemes import PRESETS, QuantScheme

BLOCK_KINDS = tuple(KIND.values())  # ggml types kept as their blocks (Q4_1, Q5_0, Q4_K, Q6_K)

Q8_0 = QuantScheme(num_bits=8, symmetric=True, strategy="group", group_size=32, scale_dtype="float16")
Q4_0_SYM = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, scale_dtype="float16")
Q4_0_ASYM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32, scale_dtype="float16")


def quantized_weight(kind: str, raw: np.ndarray, cols: int) -> QuantizedWeight:
    """The int weight holding exactly the values of Q8_0 / Q4_0 blocks raw [rows, bytes]."""
    if kind == "Q8_0":
        codes, d = blocks.unpack_q8_0(raw, cols)
        return QuantizedWeight(torch.from_numpy(codes.copy()), torch.from_numpy(d.copy()), None, Q8_0)
    q, d = blocks.unpack_q4_0(raw, cols)
    if not np.signbit(d).any():
        codes = (q.astype(np.int16) - 8).astype(np.int8)
        return QuantizedWeight(torch.from_numpy(codes), torch.from_numpy(d.copy()), None, Q4_0_SYM)
    codes, scale, zp = grids.int_from_q4_0(q, d)
    return QuantizedWeight(codes, scale, zp, Q4_0_ASYM)


def keep_quantized(model: nn.Module, reader) -> tuple[dict, Counter]:
    """Swap the model's linears stored as Q8_0 / Q4_0 in the GGUF file (`reader`, a gguf.GGUFReader) for
    packed int modules. Returns the quantized modules (name -> (format, scheme)) for the checkpoint's config,
    and tensors by how they went."""
    from quantkit.plugins.catalog import quant_format
    from quantkit.qmodules.ggml_linear import GGMLLinear
    from quantkit.qmodules.int_linear import PackedIntLinear

    tensors = {t.name: t for t in reader.tensors}
    config = model.config.to_dict()
    namer = metadata.tensor_namer(config["model_type"], config["num_hidden_layers"])
    fmt = quant_format("pack-quantized")
    quantized, how = {}, Counter()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        t = tensors.get(namer(name + ".weight") or "")
        kind = t.tensor_type.name if t is not None else None
        if kind not in ("Q8_0", "Q4_0") and kind not in BLOCK_KINDS:
            how[f"{kind or 'tied'} -> dequantized"] += 1
            continue
        raw = np.asarray(t.data).reshape(module.out_features, -1)
        order = metadata.row_order(name + ".weight", config, module.out_features)
        if order is not None:  # undo the converter's RoPE row order (each row's blocks are its own bytes)
            raw = raw[np.argsort(order)]
        if kind in BLOCK_KINDS:
            scheme = QuantScheme(**PRESETS[kind])
            new = GGMLLinear.from_quantized(GGMLWeight.from_blocks(np.ascontiguousarray(raw), module.in_features,
                                                                   scheme), module.bias)
            quantized[name] = (quant_format("ggml-blocks"), scheme)
            how[f"{kind} -> ggml blocks (kept)"] += 1
        else:
            qw = quantized_weight(kind, raw, module.in_features)
            new = PackedIntLinear.from_quantized(qw, module.bias)
            quantized[name] = (fmt, qw.scheme)
            how[f"{kind} -> {qw.scheme.short()} (kept)"] += 1
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return quantized, how
