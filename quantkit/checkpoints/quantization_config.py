"""The `quantization_config` block of compressed-tensors checkpoints: writing it and reading it back.

The config is the contract: the loader decides which module is quantized how from
`config_groups` and `ignore` alone, never from tensor names. It names formats and architectures,
so it looks them up in `quantkit.plugins.catalog` (it sits above the format plugins, not among them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from quantkit.errors import CheckpointError, UnknownNameError
from quantkit.formats.base import QuantFormat
from quantkit.plugins.catalog import checkpoint_namer, quant_format
from quantkit.qmodules import online_rotation
from quantkit.quant.schemes import QuantScheme
from quantkit.core.targets import matches

log = logging.getLogger(__name__)
QUANT_METHOD = "compressed-tensors"
FORMAT_VERSION = "0.19.0"  # the compressed-tensors release whose layout we write


def build_quantization_config(model: nn.Module, quantized: dict[str, tuple[QuantFormat, QuantScheme]],
                              kv_cache_scheme: dict | None = None, rows: list[dict] | None = None) -> dict:
    """config.json's quantization_config for a model whose modules in `quantized` are quantized
    (and whose attention modules hold k_scale / v_scale when kv_cache_scheme is given), with the transform_config
    of its online rotations (the model's, and those the run's report `rows` name: a resumed run's earlier layers)."""
    ckpt = checkpoint_namer(model)  # config names are checkpoint names (Mixtral: block_sparse_moe.*)
    ignore = [ckpt(n) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized] if quantized else []
    config = quantization_config({ckpt(n): q for n, q in quantized.items()}, ignore, kv_cache_scheme)
    online = {**{r["name"]: r["online_rotation"] for r in rows or [] if r.get("online_rotation")},
              **online_rotation.rotated(model)}
    config["transform_config"] = online_rotation.transform_config({ckpt(n): b for n, b in online.items()}) or {}
    return config


def refuse_transforms(qc: dict | None, where: str, target: str) -> None:
    """A checkpoint with online rotations (transform_config) cannot become a format that cannot record them."""
    groups = ((qc or {}).get("transform_config") or {}).get("config_groups") or {}
    if groups:
        raise CheckpointError(f"{where}: its linears need online rotations at run time (transform_config: "
                              f"{', '.join(groups)}), which {target} cannot record; quantize the original without "
                              "the rotate stage's down_proj_online for this format")


def quantization_config(quantized: dict[str, tuple[QuantFormat, QuantScheme]], ignore: list[str],
                        kv_cache_scheme: dict | None = None, name_targets: bool = False) -> dict:
    """The quantization_config of modules `quantized` (checkpoint names -> (format, scheme)), one config group per
    (format, scheme): targets `Linear` when there is one group (unless `name_targets`), else the modules' names."""
    by_group: dict[tuple[str, QuantScheme], list[str]] = {}
    formats_by_name = {}
    for name, (fmt, scheme) in quantized.items():
        by_group.setdefault((fmt.name, scheme), []).append(name)
        formats_by_name[fmt.name] = fmt
    single = len(by_group) == 1 and not name_targets
    groups = {}
    for i, ((fmt_name, scheme), names) in enumerate(sorted(by_group.items(), key=lambda kv: kv[1][0])):
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if single else sorted(names),
            "weights": formats_by_name[fmt_name].weights_config(scheme),
            "input_activations": formats_by_name[fmt_name].activations_config(scheme),
            "output_activations": None,
            "format": fmt_name,
        }
    formats = {fmt for fmt, _ in by_group}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else ("dense" if not formats else "mixed-precision"),
        "quantization_status": "compressed",
        "version": FORMAT_VERSION,
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


@dataclass(frozen=True)
class GroupPlan:
    name: str
    targets: tuple[str, ...]
    format: QuantFormat
    scheme: QuantScheme


@dataclass(frozen=True)
class QuantizedLayout:
    """Which modules of a checkpoint are quantized, with which format and scheme."""

    groups: tuple[GroupPlan, ...]
    ignore: tuple[str, ...]
    kv_cache_strategy: str | None = None  # "tensor" | "attn_head" when the checkpoint has k_scale / v_scale
    transforms: dict | None = None  # the transform_config as written (online rotations: `qmodules.online_rotation`)

    def lookup(self, name: str, module: nn.Module) -> GroupPlan | None:
        if matches(name, module, self.ignore):
            return None
        for group in self.groups:
            if matches(name, module, group.targets):
                return group
        return None


def parse_quantization_config(qc: dict, where: str) -> QuantizedLayout:
    """Validate a compressed-tensors quantization_config and turn it into a QuantizedLayout."""
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{where}: quantization method {method!r} is not supported; quantkit loads "
            f"'{QUANT_METHOD}' checkpoints (convert others first)"
        )
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"{where}: quantization_status {status!r} is not supported; expected 'compressed'")
    kv = qc.get("kv_cache_scheme")
    if kv:
        if kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy") not in ("tensor", "attn_head"):
            raise CheckpointError(f"{where}: kv_cache_scheme {kv} is not supported; supported: FP8 (type float, "
                                  "8 bits) per tensor or per attention head")
    if qc.get("sparsity_config"):
        raise CheckpointError(f"{where}: sparse checkpoints (sparsity_config) are not supported")
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        fmt_name = group.get("format") or qc.get("format")
        try:
            fmt = quant_format(fmt_name)
        except UnknownNameError as exc:
            raise CheckpointError(f"{where}: config_groups.{gname}: {exc}") from None
        if group.get("output_activations"):
            raise CheckpointError(f"{where}: config_groups.{gname}: output activation quantization is not supported")
        if not group.get("weights"):
            raise CheckpointError(f"{where}: config_groups.{gname} has no weights scheme")
        try:
            scheme = fmt.scheme_from_config(gname, group["weights"], group.get("input_activations"))
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        groups.append(GroupPlan(gname, tuple(group.get("targets") or ()), fmt, scheme))
    return QuantizedLayout(tuple(groups), tuple(qc.get("ignore") or ()), kv.get("strategy") if kv else None,
                           qc.get("transform_config"))
