"""GPTQ and AWQ checkpoints (AutoGPTQ / GPTQModel, AutoAWQ GEMM) seen as compressed-tensors ones.

A foreign checkpoint is read through one translation: its `quantization_config` becomes a compressed-tensors
`pack-quantized` config (one group per scheme, each module named), and its tensors become that format's
tensors, module by module, with the same dequantized values (`quant.foreign_layouts`). `quantkit.load` runs
the translated stream, so eval, generate, report and the server take these checkpoints as they are;
`quantkit convert gptq|awq` writes it out (`checkpoints.convert_foreign`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from quantkit.errors import CheckpointError
from quantkit.checkpoints.quantization_config import quantization_config
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.formats.pack_quantized import PackQuantized
from quantkit.quant import foreign_layouts as layouts
from quantkit.quant.schemes import QuantScheme

METHODS = ("gptq", "awq")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
AWQ_SUFFIXES = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class ForeignConfig:
    """What a GPTQ / AWQ quantization_config says, checked."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group per row
    version: int = 2  # GPTQ: 1 (AutoGPTQ's stored z - 1) or 2; AWQ: unused

    @property
    def suffixes(self) -> tuple[str, ...]:
        return GPTQ_SUFFIXES if self.method == "gptq" else AWQ_SUFFIXES


def method_of(qc: Optional[dict]) -> Optional[str]:
    """"gptq" or "awq" for a foreign quantization_config, None for anything else."""
    method = (qc or {}).get("quant_method")
    return method if method in METHODS else None


def parse_config(qc: dict, where: str) -> ForeignConfig:
    """The foreign config's fields, refusing the layouts quantkit does not read (naming the field)."""
    method = qc["quant_method"]
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: quantization_config.version {version!r}: quantkit reads AWQ's GEMM "
                                  "layout only (the one AutoAWQ writes by default)")
        if not qc.get("zero_point", True):
            raise CheckpointError(f"{where}: quantization_config.zero_point false: AutoAWQ's GEMM layout has zero points")
        if bits != 4:
            raise CheckpointError(f"{where}: quantization_config.bits {bits}: AWQ GEMM is 4-bit")
        return ForeignConfig("awq", 4, int(group))
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}: quantization_config.checkpoint_format {fmt!r}: quantkit reads 'gptq' (v1) "
                              "and 'gptq_v2'; repack other layouts (marlin, bitblas, ...) with GPTQModel first")
    if bits not in layouts.GPTQ_BITS:
        raise CheckpointError(f"{where}: quantization_config.bits {bits}: GPTQ is read for {layouts.GPTQ_BITS} bits")
    return ForeignConfig("gptq", int(bits), int(group), 1 if fmt == "gptq" else 2)


@dataclass
class ForeignCheckpoint:
    """A scanned foreign checkpoint: its config, tensors, and each quantized module's scheme (checkpoint names)."""

    path: Path
    config: ForeignConfig
    ckpt: LazyCheckpoint
    schemes: dict[str, QuantScheme] = field(default_factory=dict)

    def codes(self, module: str) -> layouts.IntCodes:
        """Module `module`'s weight as quantkit codes (the foreign tensors read and translated)."""
        get = self.ckpt.get
        cfg = self.config
        try:
            if cfg.method == "awq":
                return layouts.awq_to_codes(get(f"{module}.qweight"), get(f"{module}.qzeros"), get(f"{module}.scales"))
            g_idx = get(f"{module}.g_idx") if f"{module}.g_idx" in self.ckpt else None
            return layouts.gptq_to_codes(get(f"{module}.qweight"), get(f"{module}.qzeros"), get(f"{module}.scales"),
                                         g_idx, cfg.bits, cfg.group_size, cfg.version)
        except layouts.LayoutError as exc:
            raise CheckpointError(f"{self.path}: {module}: {exc}") from None

    def compressed_tensors_config(self) -> dict:
        """The equivalent compressed-tensors quantization_config (one group per scheme, modules named)."""
        fmt = PackQuantized()
        return quantization_config({m: (fmt, s) for m, s in self.schemes.items()}, [], name_targets=True)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as compressed-tensors names and layout: the quantized modules' translated, the rest as
        stored; one module's tensors at a time."""
        owned = {f"{m}.{s}" for m in self.schemes for s in self.config.suffixes}
        for name in self.ckpt.keys():
            if name not in owned:
                yield name, self.ckpt.get(name)
            elif name.endswith(".qweight"):
                yield from self._translated(name.removesuffix(".qweight"))

    def _translated(self, module: str) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.codes(module)
        out, inp = c.q.shape
        scheme = self.schemes[module]
        yield f"{module}.weight_packed", layouts.pack_int32(c.q, c.num_bits, dim=1)
        yield f"{module}.weight_scale", c.scale
        if c.zero_point is not None:
            yield f"{module}.weight_zero_point", layouts.pack_int32(c.zero_point, c.num_bits, dim=0)
        yield f"{module}.weight_shape", torch.tensor([out, inp], dtype=torch.int64)
        if scheme.actorder == "group":
            yield f"{module}.weight_g_idx", c.g_idx


def scan(path: Path, qc: dict) -> ForeignCheckpoint:
    """Read a foreign checkpoint's headers and each quantized module's zero points and g_idx (small), to give
    every module its scheme: symmetric where every zero point is the midpoint, act-order where g_idx is not
    the contiguous layout."""
    where = f"{path}/config.json"
    cfg = parse_config(qc, where)
    ckpt = LazyCheckpoint(path)
    found = ForeignCheckpoint(path, cfg, ckpt)
    modules = [k.removesuffix(".qweight") for k in ckpt.keys() if k.endswith(".qweight")]
    if not modules:
        raise CheckpointError(f"{path}: quant_method {cfg.method!r} but no tensor named *.qweight: not a "
                              f"{cfg.method.upper()} checkpoint quantkit can read")
    for module in modules:
        missing = [s for s in cfg.suffixes if s != "g_idx" and f"{module}.{s}" not in ckpt]
        if missing:
            raise CheckpointError(f"{path}: {module} has qweight but no {', '.join(missing)}")
        found.schemes[module] = _scheme(found, module)
    return found


def _scheme(found: ForeignCheckpoint, module: str) -> QuantScheme:
    """A module's scheme from its headers, zero points and g_idx (its qweight is not read)."""
    cfg, ckpt = found.config, found.ckpt
    scale_dtype, (groups, out) = ckpt.info(f"{module}.scales")
    qweight_shape = ckpt.info(f"{module}.qweight")[1]
    inp = qweight_shape[0] if cfg.method == "awq" else qweight_shape[0] * 32 // cfg.bits  # AWQ packs the outputs
    try:
        if cfg.method == "awq":
            zp, g_idx = layouts.awq_zero_points(ckpt.get(f"{module}.qzeros"), out), None
        else:
            zp = layouts.gptq_zero_points(ckpt.get(f"{module}.qzeros"), cfg.bits, out, cfg.version)
            g_idx = layouts.gptq_groups(ckpt.get(f"{module}.g_idx") if f"{module}.g_idx" in ckpt else None,
                                        cfg.group_size, inp)
    except layouts.LayoutError as exc:
        raise CheckpointError(f"{found.path}: {module}: {exc}") from None
    size = cfg.group_size if cfg.group_size > 0 else inp
    if groups != -(-inp // size):
        raise CheckpointError(f"{found.path}: {module}: {groups} groups of scales, but {inp} input columns in groups "
                              f"of {size} (quantization_config.group_size) make {-(-inp // size)}")
    channel = groups == 1 and g_idx is None
    return QuantScheme(num_bits=cfg.bits, symmetric=zp is None, strategy="channel" if channel else "group",
                       group_size=None if channel else size, actorder="group" if g_idx is not None else None,
                       scale_dtype=str(scale_dtype).removeprefix("torch."))
