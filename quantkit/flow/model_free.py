"""Model-free quantization: a data-free recipe run over the safetensors shards, one tensor at a time.

No model is built and no architecture adapter is needed, so any checkpoint whose linears are 2-D `*.weight`
tensors can be quantized, reading each tensor once, in the memory of one tensor. A stage's targets and ignore
patterns are matched against module names (a tensor's name less `.weight`); the class name `Linear` stands
for every 2-D float weight that is not an embedding: not named like one (`EMBEDDING_NAMES`) and not
vocab_size rows long (embeddings and output heads; a recipe quantizes neither), and not an MoE router
(`ROUTER_NAMES`). What stays 16-bit is said. Each weight goes through the same
algorithm and format code as in the layer-by-layer job (`quantize_layer` on a one-linear stand-in, then the
format's module), so for an architecture quantkit also knows, the files are the same bytes.

Only stages that quantize weights without data qualify: RTN (int, ggml grids, NVFP4A16, MXFP4 / MXFP8) and FP8
without static activations; NVFP4's global scale is shared by the siblings that read one input (q/k/v, gate/up,
found by name). Stages whose result depends on calibration or on the model's structure (NVFP4 activations'
global scale, transforms, KV-cache scales, the Q4_K_M mixture) are refused, naming the stage.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from quantkit.arch.adapter import sibling_groups
from quantkit.checkpoints.atomic import atomic_output_dir, check_output_free
from quantkit.checkpoints.export import as_stored, fixed_dtype_keys
from quantkit.errors import QuantizationError
from quantkit.flow.layer_schemes import fit_group_size
from quantkit.flow.recipe import Recipe
from quantkit.formats.checkpoint import PASSTHROUGH_FILES, ShardWriter, checkpoint_dtype, read_config, write_json
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.core.targets import matches
from quantkit.checkpoints.quantization_config import quantization_config
from quantkit.plugins.catalog import format_for
from quantkit.quant import microscale
from quantkit.version import __version__

EMBEDDING_NAMES = re.compile(r"(^|\.)(embed_tokens|embed|embeddings|word_embeddings|wte|wpe|tok_embeddings)$")
# MoE routers stay in 16 bits, as the layer-by-layer job keeps them (their scores pick the experts)
ROUTER_NAMES = re.compile(r"(^|\.)((mlp|block_sparse_moe|moe)\.gate|router|gate\.wg)$")


class _Stand(nn.Linear):
    """A one-linear stand-in holding a checkpoint tensor (no parameters allocated: the weight is assigned)."""

    def __init__(self, weight: torch.Tensor):
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None


def plan(ckpt: LazyCheckpoint, recipe: Recipe, vocab: int | None = None) -> dict[str, tuple]:
    """Each targeted weight's module name: (stage algorithm, its scheme), in checkpoint order; refuses stages that
    need a model or data."""
    out: dict[str, tuple] = {}
    linears = {k.removesuffix(".weight"): ckpt.info(k) for k in ckpt.keys() if _is_linear(k, *ckpt.info(k), vocab)}
    probe = nn.Linear(1, 1, device="meta")  # `Linear` in targets: every linear-shaped weight
    for stage in recipe.resolved:
        what = f"stages.{stage.index} ({stage.spec.algorithm})"
        algo = stage.algorithm(stage.config, stage.scheme)
        if not algo.produces_weights or algo.needs_data():
            raise QuantizationError(f"model-free quantization runs data-free weight stages only; {what} "
                                    + ("needs calibration data" if algo.produces_weights else "transforms the model")
                                    + ": drop --model-free to run the layer-by-layer job")
        scheme = stage.scheme
        if scheme.grid == "q4_k_m":
            raise QuantizationError(f"model-free quantization: {what}'s scheme {scheme.short()} is llama.cpp's "
                                    "per-layer mixture, which needs the model's structure; drop --model-free")
        names = [n for n in linears if matches(n, probe, stage.spec.targets) and not matches(n, probe, stage.spec.ignore)]
        taken = [n for n in names if n in out]
        if taken:
            raise QuantizationError(f"{what} targets {taken[0]}, which an earlier stage quantizes")
        fallback = fit_group_size({n: linears[n][1][1] for n in names}, scheme, stage.index, stage.group_size_explicit)
        out.update({n: (algo, fallback.get(n, scheme)) for n in names})
    if not out:
        raise QuantizationError("the recipe's targets match no 2-D weight of this checkpoint")
    return out


def _is_linear(key: str, dtype: torch.dtype, shape: tuple, vocab: int | None, routers: bool = False) -> bool:
    """Whether tensor `key` is a linear's weight that `Linear` targets (`routers`: MoE routers count too)."""
    module = key.removesuffix(".weight")
    return (key.endswith(".weight") and len(shape) == 2 and dtype.is_floating_point and shape[0] != vocab
            and not EMBEDDING_NAMES.search(module) and (routers or not ROUTER_NAMES.search(module)))


def quantize_model_free(source: Path, recipe: Recipe, out: Path, overwrite: bool = False,
                        notify: Callable[[str], None] = lambda _: None) -> Path:
    """Quantize checkpoint `source` with the data-free `recipe` tensor by tensor into a compressed-tensors
    checkpoint at `out` (written atomically)."""
    source, out = Path(source), Path(out)
    raw = read_config(source, check=False)  # no model is built from it: any architecture's fields will do
    if raw.get("quantization_config"):
        raise QuantizationError(f"{source} is already quantized ({raw['quantization_config'].get('quant_method')}); "
                                "quantize its original")
    check_output_free(out, overwrite, protect=[source])
    storage = checkpoint_dtype(raw)
    ckpt = LazyCheckpoint(source)
    vocab = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    targets = plan(ckpt, recipe, vocab)
    start = time.perf_counter()
    quantized: dict[str, tuple] = {}
    with atomic_output_dir(out, overwrite, protect=[source]) as tmp:
        writer = ShardWriter(tmp, plan=list(_layout(ckpt, targets, storage)))  # each byte written once
        for key, tensor in _tensors(ckpt, targets, storage, quantized):
            if tensor is None:  # a tensor kept as stored: copied piece by piece
                writer.add_pieces(key, *ckpt.info(key), ckpt.pieces_of(key))
            else:
                writer.add(key, tensor)
        writer.close()
        config = {**raw, "quantization_config": _config(quantized, ckpt, recipe)}
        write_json(tmp / "config.json", config)
        for name in PASSTHROUGH_FILES:
            if (source / name).is_file():
                (tmp / name).write_bytes((source / name).read_bytes())
        (tmp / "recipe.yaml").write_text(recipe.to_yaml())
        marker = {"quantkit_version": __version__, "source": str(source.resolve()), "recipe": recipe.name,
                  "model_free": True, "seconds": round(time.perf_counter() - start, 3)}
        (tmp / "quantkit.json").write_text(json.dumps(marker, indent=2) + "\n")
    kept = [k for k in ckpt.keys() if len(ckpt.info(k)[1]) == 2 and k.removesuffix(".weight") not in quantized]
    notify(f"{len(quantized)} linears quantized model-free in {time.perf_counter() - start:.1f} s; 2-D tensors kept "
           f"as stored: {', '.join(kept[:6]) + (' ...' if len(kept) > 6 else '') or 'none'}")
    return out


def _tensors(ckpt: LazyCheckpoint, targets: dict, storage: torch.dtype,
             quantized: dict) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """Every tensor of the output: targeted weights quantized (their modules' state dicts); the rest as stored, given
    as None (the caller copies them piece by piece)."""
    global_scales = _nvfp4_global_scales(ckpt, targets)
    for key in ckpt.keys():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module not in targets:
            yield key, None
            continue
        rows, cols = ckpt.info(key)[1]
        step = chunk_rows(targets[module][1], rows, cols)
        parts: dict[str, list[torch.Tensor]] = {}
        for start in range(0, rows, step):  # rows are quantized independently: a block at a time, same bytes
            fmt, scheme, state = _quantize_rows(ckpt.row_block(key, start, start + step), module, targets[module],
                                                global_scales.get(module), storage)
            for name, tensor in state.items():
                parts.setdefault(name, []).append(tensor)
        quantized[module] = (fmt, scheme)
        for name, pieces in parts.items():
            yield f"{module}.{name}", _joined(name, pieces, rows, cols, step)


def _quantize_rows(w: torch.Tensor, module: str, target: tuple, global_scale: Optional[torch.Tensor],
                   storage: torch.dtype) -> tuple:
    """(format, scheme, state dict as exported) of rows w of a linear: the stage's own `quantize_layer`, or for NVFP4
    the nearest rounding on the global scale of the linears reading the same input (as RTN computes it)."""
    algo, scheme = target
    if global_scale is not None:
        qw = microscale.quantize_weight(w.float(), scheme, global_scale)
        qw.input_global_scale = None
    else:
        algo.scheme = scheme
        qw = algo.quantize_layer({module: _Stand(w.float())}, [[module]], storage)[module]
    fmt = format_for(qw.scheme)
    packed = fmt.build_module(qw, None)
    keep = fixed_dtype_keys(packed)  # as the layer-by-layer export writes them (`checkpoints.export`)
    return fmt, qw.scheme, {name: t if name in keep else as_stored(t, storage) for name, t in packed.state_dict().items()}


def _joined(name: str, pieces: list[torch.Tensor], rows: int, cols: int, step: int) -> torch.Tensor:
    """One tensor of a module quantized in row blocks: per-row tensors concatenated, per-tensor ones (NVFP4's global
    scale) once, weight_shape the whole weight's."""
    if name == "weight_shape":
        return torch.tensor([rows, cols], dtype=pieces[0].dtype)
    if len(pieces) == 1:
        return pieces[0]
    if pieces[0].dim() == 0 or pieces[0].shape[0] != min(step, rows):  # not one row per weight row
        assert all(torch.equal(p, pieces[0]) for p in pieces), f"{name}: differs between row blocks"
        return pieces[0]
    return torch.cat(pieces)


def _nvfp4_global_scales(ckpt: LazyCheckpoint, targets: dict) -> dict[str, torch.Tensor]:
    """For NVFP4 weights: each linear's global scale, that of the joint amax of the siblings reading the same input
    (`arch.adapter.sibling_groups`, as the layer-by-layer job groups them), read a block of rows at a time."""
    micro = [m for m, (_, s) in targets.items() if s.is_micro and s.micro_name == "nvfp4"]
    out = {}
    for members in sibling_groups(micro):
        amax = torch.zeros(())
        for m in members:
            rows, cols = ckpt.info(m + ".weight")[1]
            step = max(1, CHUNK_BYTES // (4 * cols))
            for start in range(0, rows, step):
                amax = torch.maximum(amax, ckpt.row_block(m + ".weight", start, start + step).float().abs().amax())
        g = microscale.nvfp4_global_scale(amax)
        out.update({m: g for m in members})
    return out


def _layout(ckpt: LazyCheckpoint, targets: dict, storage: torch.dtype) -> Iterator[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every output tensor in `_tensors`' order, from the formats' empty modules (on the meta
    device: nothing allocated) and the export's dtype rules."""
    for key in ckpt.keys():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module not in targets:
            yield (key, *ckpt.info(key))
            continue
        scheme = targets[module][1]
        rows, cols = ckpt.info(key)[1]
        with torch.device("meta"):
            empty = format_for(scheme).empty_module(nn.Linear(cols, rows, bias=False), scheme, storage)
        keep = fixed_dtype_keys(empty)
        for name, t in empty.state_dict().items():
            dtype = t.dtype if name in keep or not (t.is_floating_point() and t.element_size() >= 2) else storage
            yield f"{module}.{name}", dtype, tuple(t.shape)


CHUNK_BYTES = 32 << 20  # float32 bytes of weight rows quantized at a time


def chunk_rows(scheme, rows: int, cols: int) -> int:
    """Rows per step for `scheme`: all of them where one scale spans the tensor; else about CHUNK_BYTES of float32,
    a multiple of 32 rows (zero points pack along the rows: 32 rows fill whole words at any width) and of an FP8
    block's rows."""
    if scheme.strategy == "tensor":
        return rows
    align = math.lcm(32, scheme.block_structure[0]) if scheme.strategy == "block" else 32
    return max(align, CHUNK_BYTES // (4 * cols) // align * align)


def _config(quantized: dict, ckpt: LazyCheckpoint, recipe: Recipe) -> dict:
    """compressed-tensors' quantization_config, grouped as the layer-by-layer job groups it."""
    # every linear-shaped weight left as stored (heads, routers: loaders must not treat them as quantized Linears)
    linears = [k.removesuffix(".weight") for k in ckpt.keys() if _is_linear(k, *ckpt.info(k), None, routers=True)]
    ignore = sorted({n for n in linears if n not in quantized}
                    | {p for s in recipe.stages for p in s.ignore if not p.startswith("re:")})
    return quantization_config(quantized, ignore)
