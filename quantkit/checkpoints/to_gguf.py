"""`quantkit export gguf`: a checkpoint (quantkit's compressed-tensors output, or float) as one GGUF file.

Quantized linears on a ggml grid (Q4_0: int4 group 32 with fp16 scales and zero points 0 / -1;
Q8_0: symmetric int8 group 32, fp16 scales; `quantkit.gguf.grids`) are written code for code, and those
kept as ggml blocks (Q4_1, Q5_0, Q4_K, Q6_K: format ggml-blocks, recipes gptq-q4_1, gptq-q4_k_m) byte for byte: the file
holds exactly what quantkit's solver chose. Any other int4 group-32 weight goes in as Q4_1 where its
zero points are not Q4_0's (exact: x = d q + m with d = s, m = -s (z + 8), both fp16-exact or refused).
Tensors no algorithm quantized (embeddings, the output matrix, a float checkpoint's linears) are rounded to
nearest on the type llama.cpp would give them (`quantkit.gguf.mixture`), and the closing summary says how
many went which way. A quantized weight on no GGUF grid (another group size, act-order groups) is refused,
naming it, unless `requantize`: then it is rounded to nearest on its tensor's type from its dequantized
values and listed as requantized. The file is written to a hidden
sibling and renamed at the end: an interrupted export leaves nothing at the output path.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from quantkit.errors import CheckpointError, OutputExistsError
from quantkit.formats.checkpoint import read_config
from quantkit.checkpoints.quantization_config import parse_quantization_config, refuse_transforms
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.formats.pack_quantized import read_int_weight
from quantkit.gguf import grids, metadata, mixture
from quantkit.quant import ggml_blocks as blocks
from quantkit.quant import ggml
from quantkit.quant.ggml import KIND
from quantkit.quant.intq import dequantize, dequantize_columns, rtn
from quantkit.quant.schemes import PRESETS, QuantScheme

log = logging.getLogger(__name__)

PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")


@dataclass
class ExportSummary:
    path: Path
    file_type: str
    bytes: int = 0
    types: Counter = field(default_factory=Counter)  # ggml type -> tensors
    exact: int = 0  # quantized tensors written code for code
    nearest: list[str] = field(default_factory=list)  # tensors rounded to nearest here
    requantized: list[str] = field(default_factory=list)  # quantized tensors on no GGUF grid, rounded again

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.types.items()))
        again = (f"; REQUANTIZED (rounded again from their dequantized values): {len(self.requantized)}: "
                 + ", ".join(self.requantized[:8]) + (" ..." if len(self.requantized) > 8 else "")) if self.requantized else ""
        return (f"wrote {self.path} ({self.bytes / 1e6:.1f} MB, file type {self.file_type}): {kinds}; "
                f"{self.exact} calibrated tensors as quantized, {len(self.nearest)} rounded to nearest here{again}")


def infer_file_type(config: dict, schemes: dict[str, QuantScheme], requantize: bool = False) -> str:
    """The file type a quantized checkpoint's linears are stored in exactly (with `requantize`, the nearest one
    by bit width for weights on no GGUF grid)."""
    if schemes and all(s.grid == "q4_1" for s in schemes.values()):
        return "Q4_1"
    if any(ggml.is_block_grid(s) for s in schemes.values()):
        return "Q4_K_M"  # the only mixture that puts K-quants on linears here (recipe gptq-q4_k_m)
    kinds = {grids.ggml_type_of(s) for s in schemes.values()}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()
    if not schemes:
        raise CheckpointError("a float checkpoint: give the GGUF type to round it to (--type q8_0, q4_0, q4_1, q4_k_m or f16)")
    if requantize:
        return "Q4_0" if max(s.num_bits for s in schemes.values()) <= 4 else "Q8_0"
    shown = sorted({s.short() for s in schemes.values()})
    raise CheckpointError(f"the checkpoint's weights ({', '.join(shown)}) are not on one GGUF grid: GGUF holds Q4_0 / "
                          "Q4_1 (int4 group 32) and Q8_0 (int8 symmetric group 32) with fp16 scales; quantize with "
                          "recipe gptq-q4_0, awq-q4_0 or gptq-q8_0, or pass --requantize to round these weights again "
                          "to nearest (each listed)")


def export_gguf(checkpoint: Path, out: Path, file_type: Optional[str] = None, overwrite: bool = False,
                tokenizer_pre: Optional[str] = None, notify: Callable[[str], None] = log.info,
                requantize: bool = False) -> ExportSummary:
    import gguf

    ckpt = Path(checkpoint)
    out = Path(out)
    config = read_config(ckpt)
    model_type = config.get("model_type", "?")
    metadata.gguf_arch(model_type)  # refuses other architectures before any work
    _check_output(out, overwrite, ckpt)
    tensors = LazyCheckpoint(ckpt)  # one tensor read at a time
    schemes = _linear_schemes(config, tensors)
    body = {m: s for m, s in schemes.items() if not m.endswith("lm_head")}  # the output matrix has its own type
    ftype = (file_type or "").upper() or infer_file_type(config, body, requantize)
    if ftype not in mixture.FILE_TYPES:
        raise CheckpointError(f"GGUF type {file_type!r}: use one of {', '.join(t.lower() for t in mixture.FILE_TYPES)}")
    tied = bool(config.get("tie_word_embeddings", model_type in ("gemma3_text",)))
    name_of = metadata.tensor_namer(model_type, config["num_hidden_layers"])
    summary = ExportSummary(out, ftype)
    tmp = out.with_name(f".{out.name}.quantkit-tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, metadata.arch_key(model_type))
    try:
        metadata.write_hparams(writer, config, int(getattr(gguf.LlamaFileType, mixture.FILE_TYPES[ftype])), ckpt.name)
        metadata.write_tokenizer(writer, ckpt, config, tokenizer_pre, notify)
        for hf_name in _tensor_names(tensors, schemes):
            gname = name_of(hf_name)
            if gname is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue
                raise CheckpointError(f"{ckpt}: tensor {hf_name} has no GGUF name for {model_type}")
            data, kind = _tensor(tensors, hf_name, gname, schemes, ftype, tied, config, ckpt, requantize, summary)
            writer.add_tensor(gname, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    summary.bytes = out.stat().st_size
    notify(summary.line())
    return summary


def _tensor(tensors, hf_name, gname, schemes, ftype, tied, config, ckpt, requantize, summary):
    """(data, ggml type) of one tensor of the file, counted in `summary`."""
    module = hf_name.removesuffix(".weight")
    if module in schemes:
        data, kind, exact = _quantized(tensors, module, schemes[module], gname, ftype, tied, config,
                                       ckpt if requantize else None)
        summary.exact += exact
        if not exact:
            summary.requantized.append(gname)
    else:
        data, kind = _float(tensors.get(hf_name), hf_name, gname, ftype, tied, config, ckpt)
        if kind not in ("F32", "F16"):
            summary.nearest.append(gname)
    summary.types[kind] += 1
    return data, kind


def _check_output(out: Path, overwrite: bool, source: Path) -> None:
    if out.suffix != ".gguf":
        raise CheckpointError(f"output {str(out)!r}: a GGUF file name ends in .gguf")
    if out.resolve() == source.resolve():
        raise CheckpointError(f"output {str(out)!r} would replace the source checkpoint")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"output {str(out)!r} already exists; pass --overwrite to replace it, or choose "
                                    "another -o")
        if not out.is_file():
            raise OutputExistsError(f"output {str(out)!r} is not a file; --overwrite replaces an earlier GGUF file only")
    if not out.parent.is_dir():
        raise CheckpointError(f"output directory {str(out.parent)!r} does not exist")


def _linear_schemes(config: dict, where: LazyCheckpoint) -> dict[str, QuantScheme]:
    """module name -> scheme of every quantized linear in the checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return {}
    refuse_transforms(qc, "the checkpoint", "GGUF")
    plan = parse_quantization_config(qc, "quantization_config")
    if plan.kv_cache_strategy:
        log.info("KV-cache scales are not carried into GGUF (llama.cpp calibrates no KV cache)")
    probe = nn.Linear(1, 1, device="meta")
    out = {}
    for key in where.keys():
        if key.endswith((".weight_packed", ".weight_ggml")) or (key.endswith(".weight") and key[: -len(".weight")] + ".weight_scale" in where):
            module = key.rsplit(".", 1)[0]
            group = plan.lookup(module, probe)
            if group is None:
                raise CheckpointError(f"{module}: quantized tensors but no config group of quantization_config")
            if group.scheme.type != "int":
                raise CheckpointError(f"{module}: FP8 weights ({group.scheme.short()}) have no GGUF type; quantize "
                                      "the float original with a GGUF recipe (gptq-q4_0, gptq-q8_0)")
            out[module] = group.scheme
    return out


def _tensor_names(where: LazyCheckpoint, schemes: dict) -> list[str]:
    """The weights to write, in the checkpoint's sorted order (as llama.cpp's converter reads them)."""
    names = []
    for key in sorted(where.keys()):
        module = key.rsplit(".", 1)[0]
        if module in schemes:
            if key.endswith((".weight_packed", ".weight_ggml")) or (key.endswith(".weight") and schemes[module].num_bits == 8
                                                                     and module + ".weight_scale" in where):
                names.append(module + ".weight")
            elif key.endswith(".bias"):  # a quantized linear's bias (qwen2's q/k/v) is written as it is
                names.append(key)
            continue
        names.append(key)
    return names


def _quantized(tensors, module, scheme, gname, ftype, tied, config, requantize_from: Optional[Path] = None):
    """(rows of blocks, ggml type, written exactly) of a quantized linear: its own codes on the GGUF grid that holds
    them, or (`requantize_from`: the checkpoint) rounded again to nearest on the type its tensor gets."""
    if ggml.is_block_grid(scheme):
        return (*_blocks_as_stored(tensors, module, scheme, gname, ftype, tied, config), True)
    codes, scale, zp, g_idx = read_int_weight(tensors, module, scheme)
    want = mixture.tensor_type(gname, tuple(codes.shape), ftype, tied, config["num_hidden_layers"])
    try:
        raw, have = _exact_blocks(module, scheme, codes, scale, zp, g_idx)
        if have != want and not {have, want} <= {"Q4_0", "Q4_1"}:
            raise CheckpointError(f"{module} ({gname}) is stored as {scheme.short()}, but GGUF file type {ftype} puts "
                                  f"{want} there; quantize it with a {want.lower()} scheme or export as "
                                  f"{have.lower()}")
    except CheckpointError as exc:
        if requantize_from is None:
            raise CheckpointError(f"{exc}; or pass --requantize to round it again to nearest (listed)") from None
        w = dequantize_columns(codes, scale, zp, g_idx.long()) if g_idx is not None else dequantize(codes, scale, zp, scheme)
        return (*_float(w, module + ".weight", gname, ftype, tied, config, requantize_from), False)
    return _rows(raw, module + ".weight", config), have, True


def _exact_blocks(module, scheme, codes, scale, zp, g_idx) -> tuple[np.ndarray, str]:
    """The blocks holding an int weight exactly (Q8_0; Q4_0 for zero points 0 / -1, else Q4_1), or CheckpointError."""
    if grids.ggml_type_of(scheme) is None or g_idx is not None:
        raise CheckpointError(f"{module}: {scheme.short()} is on no GGUF grid (GGUF holds int4 and int8 in contiguous "
                              "groups of 32 with fp16 scales)")
    if scheme.num_bits == 8:
        return blocks.pack_q8_0(*grids.q8_0_blocks(codes, scale, module)), "Q8_0"
    if zp is None or bool(torch.isin(zp, torch.tensor([0, -1], dtype=zp.dtype)).all()):
        return blocks.pack_q4_0(*grids.q4_0_blocks(codes, scale, zp, module)), "Q4_0"
    return grids.q4_1_weight(codes, scale, zp, module).to_blocks(), "Q4_1"


def _blocks_as_stored(tensors, module, scheme, gname, ftype, tied, config):
    """A linear kept as ggml blocks: its bytes as they are (rows reordered as the converter does)."""
    rows, cols = (int(v) for v in tensors.get(module + ".weight_shape"))
    have = KIND[scheme.grid]
    want = mixture.tensor_type(gname, (rows, cols), ftype, tied, config["num_hidden_layers"])
    if have != want:
        raise CheckpointError(f"{module} ({gname}) is stored as ggml {have}, but GGUF file type {ftype} puts {want} "
                              "there; export with the file type it was quantized for (q4_k_m)")
    raw = tensors.get(module + ".weight_ggml").numpy()
    expected = blocks.row_bytes(have, cols)
    if raw.dtype != np.uint8 or raw.shape != (rows, expected):
        raise CheckpointError(f"{module}.weight_ggml: {raw.dtype} {list(raw.shape)}, expected uint8 [{rows}, {expected}] "
                              f"for {have} with {cols} inputs: the checkpoint is damaged")
    return _rows(raw, module + ".weight", config), have


def _rows(data: np.ndarray, hf_name: str, config: dict) -> np.ndarray:
    order = metadata.row_order(hf_name, config, data.shape[0])
    return data if order is None else np.ascontiguousarray(data[order])


def _float(tensor: torch.Tensor, hf_name, gname, ftype, tied, config, ckpt):
    tensor = metadata.float_transform(hf_name, config, tensor, ckpt)
    kind = mixture.tensor_type(gname, tuple(tensor.shape), ftype, tied, config["num_hidden_layers"])
    if kind == "F32":
        data = tensor.float().numpy()
    elif kind == "F16":
        data = tensor.to(torch.float16).numpy()
    elif kind == "Q6_K":
        data = blocks.pack_q6_k(*grids.nearest_q6_k(tensor))
    elif kind == "Q4_K":
        data = blocks.pack_q4_k(*grids.nearest_q4_k(tensor))
    elif kind == "Q5_0":
        data = blocks.pack_q5_0(*grids.nearest_q5_0(tensor))
    elif kind == "Q4_1":
        data = ggml.nearest(tensor, QuantScheme(**PRESETS["Q4_1"])).to_blocks()
    else:
        qw = rtn(tensor, QuantScheme(**PRESETS[kind]), torch.float16)
        if kind == "Q8_0":
            data = blocks.pack_q8_0(*grids.q8_0_blocks(qw.q, qw.scale, gname))
        else:
            data = blocks.pack_q4_0(*grids.q4_0_blocks(qw.q, qw.scale, qw.zero_point, gname))
    return _rows(np.ascontiguousarray(data), hf_name, config), kind
