"""Converting between GPTQ / AWQ checkpoints and compressed-tensors, without requantizing.

`convert_foreign`: a GPTQ or AWQ checkpoint written as compressed-tensors `pack-quantized` (the translation of
`checkpoints.foreign`), the same dequantized weights; act-order GPTQ (a non-contiguous g_idx) is refused, as
compressed-tensors dropped its `actorder: group` layout. `export_foreign`: a compressed-tensors int checkpoint
written as GPTQ (v1 or v2) or AWQ GEMM, refused, naming the module and the reason, where the target layout
cannot hold its grid. Both stream one tensor (one module) at a time and write atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from quantkit.checkpoints import foreign as foreign_ckpt
from quantkit.checkpoints.atomic import atomic_output_dir, check_output_free
from quantkit.checkpoints.quantization_config import parse_quantization_config, refuse_transforms
from quantkit.errors import CheckpointError
from quantkit.formats.checkpoint import ShardWriter, copy_passthrough, read_config, write_json
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.quant import foreign_layouts as layouts
from quantkit.formats.pack_quantized import read_int_weight
from quantkit.version import __version__

PACKED = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def convert_foreign(src: Path, out: Path, method: str, overwrite: bool = False,
                    notify: Callable[[str], None] = lambda _: None) -> Path:
    """The GPTQ / AWQ checkpoint `src` as a compressed-tensors checkpoint at `out`."""
    src, out = Path(src), Path(out)
    raw = read_config(src)
    qc = raw.get("quantization_config")
    found = foreign_ckpt.method_of(qc)
    if found != method:
        what = f"quant_method {qc.get('quant_method')!r}" if qc else "no quantization_config"
        raise CheckpointError(f"{src}: config.json has {what}, not {method!r}: "
                              + (f"use quantkit convert {found}" if found else "nothing to convert"))
    check_output_free(out, overwrite, protect=[src])
    foreign = foreign_ckpt.scan(src, qc)
    act_order = sorted(m for m, s in foreign.schemes.items() if s.actorder == "group")
    if act_order:
        raise CheckpointError(f"{src}: {len(act_order)} linears with groups in a g_idx (act-order, or a last group "
                              f"shorter than group_size; e.g. {act_order[0]}): compressed-tensors has no such layout "
                              "since it removed actorder "
                              "'group' (2026-08). quantkit loads, evaluates and serves this checkpoint as it is, and "
                              "vLLM reads it as GPTQ; to convert, quantize the original again with actorder: static")
    config = {**raw, "quantization_config": foreign.compressed_tensors_config()}
    _write(src, out, foreign.tensors(), config, overwrite, {"converted_from": str(src.resolve()), "from": method})
    kinds = sorted({s.short() for s in foreign.schemes.values()})
    notify(f"{len(foreign.schemes)} linears ({', '.join(kinds)}) as compressed-tensors pack-quantized")
    return out


def export_foreign(src: Path, out: Path, method: str, gptq_version: int = 1, overwrite: bool = False,
                   notify: Callable[[str], None] = lambda _: None) -> Path:
    """The compressed-tensors int checkpoint `src` as a GPTQ (checkpoint_format gptq or gptq_v2) or AWQ GEMM one."""
    src, out = Path(src), Path(out)
    raw = read_config(src)
    qc = raw.get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{src}: not a compressed-tensors quantized checkpoint (its config.json has "
                              f"{'no quantization_config' if not qc else repr(qc.get('quant_method'))}); quantize it "
                              f"first, e.g. quantkit quantize {src} --recipe gptq-w4a16")
    refuse_transforms(qc, str(src), f"the {method.upper()} format")
    check_output_free(out, overwrite, protect=[src])
    plan = parse_quantization_config(qc, f"{src}/config.json")
    ckpt = LazyCheckpoint(src)
    modules = [k.removesuffix(".weight_packed") for k in ckpt.keys() if k.endswith(".weight_packed")]
    schemes = {m: _int_scheme(plan, m, src) for m in modules}
    shared = _shared_grid(schemes, method, src)
    config = {**raw, "quantization_config": _foreign_config(method, shared, gptq_version)}
    tensors = _exported(ckpt, schemes, method, gptq_version, src)
    _write(src, out, tensors, config, overwrite, {"exported_from": str(src.resolve()), "to": method})
    notify(f"{len(modules)} linears as {method.upper()}"
           + (f" (checkpoint_format {'gptq' if gptq_version == 1 else 'gptq_v2'})" if method == "gptq" else ""))
    return out


def _int_scheme(plan, module: str, src: Path):
    probe = nn.Linear(1, 1, device="meta")  # config targets name modules or the class "Linear"
    group = plan.lookup(module, probe)
    if group is None:
        raise CheckpointError(f"{src}: {module} has packed weights but no quantization_config group")
    scheme = group.scheme
    if group.format.name != "pack-quantized":
        raise CheckpointError(f"{src}: {module} is {group.format.name}; GPTQ and AWQ hold int weights "
                              "(pack-quantized) only")
    return scheme


def _shared_grid(schemes: dict, method: str, src: Path) -> dict:
    """The one (bits, group size, symmetric, act-order) the foreign config states, refusing a mixture."""
    kinds = {(s.num_bits, s.group_size if s.strategy == "group" else -1) for s in schemes.values()}
    if len(kinds) != 1:
        raise CheckpointError(f"{src}: linears with different bits / group sizes ({sorted(kinds)}); a {method.upper()} "
                              "config states one")
    (bits, group), = kinds
    if method == "awq" and bits != 4:
        raise CheckpointError(f"{src}: {bits}-bit weights; AWQ GEMM holds 4 bits only (export gptq instead)")
    if method == "awq" and any(s.actorder == "group" for s in schemes.values()):
        raise CheckpointError(f"{src}: act-order groups (weight_g_idx); AWQ has no g_idx (export gptq instead)")
    return {"bits": bits, "group_size": group, "sym": all(s.symmetric for s in schemes.values()),
            "desc_act": any(s.actorder == "group" for s in schemes.values())}


def _foreign_config(method: str, grid: dict, gptq_version: int) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": grid["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": grid["bits"], "group_size": grid["group_size"],
            "desc_act": grid["desc_act"], "sym": grid["sym"], "static_groups": False, "true_sequential": True,
            "damp_percent": 0.01, "checkpoint_format": "gptq" if gptq_version == 1 else "gptq_v2"}


def _exported(ckpt: LazyCheckpoint, schemes: dict, method: str, gptq_version: int,
              src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    owned = {f"{m}.{s}" for m in schemes for s in PACKED}
    for name in ckpt.keys():
        if name not in owned:
            yield name, ckpt.get(name)
        elif name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            codes = _codes(ckpt, module, schemes[module])
            try:
                parts = layouts.codes_to_awq(codes) if method == "awq" else layouts.codes_to_gptq(codes, gptq_version)
            except layouts.LayoutError as exc:
                raise CheckpointError(f"{src}: {module}: {exc}") from None
            for suffix, tensor in parts.items():
                yield f"{module}.{suffix}", tensor


def _codes(ckpt: LazyCheckpoint, module: str, scheme) -> layouts.IntCodes:
    codes, scale, zp, g_idx = read_int_weight(ckpt, module, scheme)
    return layouts.IntCodes(codes, scale, zp, g_idx, scheme.num_bits)


def _write(src: Path, out: Path, tensors, config: dict, overwrite: bool, provenance: dict) -> None:
    marker = {"quantkit_version": __version__, **provenance}
    with atomic_output_dir(out, overwrite, protect=[src]) as tmp:
        writer = ShardWriter(tmp)
        for key, tensor in tensors:
            writer.add(key, tensor.contiguous())
        writer.close()
        write_json(tmp / "config.json", config)
        copy_passthrough(src, tmp)
        (tmp / "quantkit.json").write_text(json.dumps(marker, indent=2) + "\n")
