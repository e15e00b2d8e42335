"""What a quantize run did: the one report type (`quantkit.quantize` returns it, the CLI prints it) and
the one builder of the quantkit.json written beside every checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from quantkit.flow.pipeline import QuantizationResult
from quantkit.flow.recipe import Recipe
from quantkit.platform import compute, devices
from quantkit.version import __version__


@dataclass
class QuantizeRecord:
    """A run's facts: what was quantized how, from what, where, in how long and with how much memory."""

    recipe: Recipe
    source: Optional[Path]  # the checkpoint directory it came from (tokenizer files are copied from it)
    storage_dtype: torch.dtype  # the dtype the checkpoint is written in (the source's)
    compute: compute.ComputeChoice
    device: devices.DeviceChoice
    result: QuantizationResult = field(default_factory=QuantizationResult)
    group_size_fallbacks: list[dict] = field(default_factory=list)
    created: str = ""
    # the checkpoint the run loaded in a compute dtype narrower than it: the tensors that are still only that
    # rounding are written as stored (an in-memory model handed to `quantize` is written as it is)
    rounded_from: Optional[Path] = None
    # calibration data not named by the recipe (texts or token ids handed to `quantize`), in words; None: the
    # recipe's calibration.dataset (or no stage calibrated)
    calibration_data: Optional[str] = None
    output: Optional[Path] = None  # where the checkpoint was written (None: kept in memory)
    load: str = "whole"  # "whole": the model in memory; "layers": one decoder layer at a time from disk
    world_size: int = 1
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # resident memory, sampled every 20 ms while the run went
    peak_device_bytes: int = 0  # allocated on the accelerator at most (0 on the CPU)
    zeroed_nonfinite: list = field(default_factory=list)
    plan: Optional[dict] = None  # the estimate made before the work, next to the measured peaks
    activations: Optional[dict] = None  # the calibration activations' budget, peak and bytes spilled to disk
    domain_check: Optional[list] = None  # per calibration part: KLD on held-back windows, this recipe and RTN
    domain_warning: Optional[str] = None  # the parts where this recipe is worse than RTN, in words

    @property
    def quantized(self) -> dict:
        """module name -> (format, scheme) of every quantized linear."""
        return self.result.quantized

    def summary(self) -> str:
        """One paragraph: what was quantized how, where the time went, the worst errors."""
        schemes: dict[str, int] = {}
        for _fmt, scheme in self.result.quantized.values():
            schemes[scheme.short()] = schemes.get(scheme.short(), 0) + 1
        lines = [f"recipe {self.recipe.name}: {len(self.result.quantized)} linears quantized "
                 f"({', '.join(f'{n} x {s}' for s, n in schemes.items()) or 'none'}) in {self.result.seconds:.1f} s, "
                 f"{self.compute.describe()}"]
        if self.result.kv_cache_scheme:
            lines.append(f"KV cache scales for {len(self.result.kv_scales)} layers "
                         f"({self.result.kv_cache_scheme.get('strategy')})")
        measured = [row for row in self.result.layers if row.get("sqnr_db") is not None]
        worst = sorted(measured, key=lambda row: row["sqnr_db"])[:3]
        if worst:
            lines.append("lowest SQNR: " + ", ".join(f"{row['name']} {row['sqnr_db']:.1f} dB" for row in worst))
        return "\n".join(lines)

    def closing_line(self) -> str:
        """Peak memory and where the time went (the largest phases)."""
        total = sum(self.result.timings.values()) or 1.0
        top = sorted(self.result.timings.items(), key=lambda kv: -kv[1])[:4]
        shares = ", ".join(f"{name} {100 * s / total:.0f}%" for name, s in top)
        gpu = f", {self.peak_device_bytes / 1e9:.2f} GB on {self.device.device}" if self.device.is_accelerator else ""
        return f"Peak memory {self.peak_rss_bytes / 1e9:.2f} GB resident{gpu}; time: {shares}"

    def metadata(self) -> dict:
        """quantkit.json: provenance, the run's settings and figures, then every layer's report (last: the long part)."""
        return {
            "quantkit_version": __version__,
            "created": self.created,
            "source": str(self.source) if self.source is not None else None,
            "recipe": self.recipe.name,
            "overrides": self.recipe.overrides,
            "calibration_data": self.calibration_data or self.recipe.calibration.dataset,
            "compute": self.compute.to_json(),
            "device": {"device": str(self.device.device), "reason": self.device.reason,
                       "peak_bytes": self.peak_device_bytes},
            "quantize_seconds": round(self.result.seconds, 2),
            "timings": {k: round(v, 3) for k, v in self.result.timings.items()},
            "group_size_fallbacks": self.group_size_fallbacks,
            "load": self.load,
            "world_size": self.world_size,
            "peak_rss_bytes": self.peak_rss_bytes,
            "zeroed_nonfinite": self.zeroed_nonfinite,
            "plan": self.plan,
            "activations": self.activations,
            **({"domain_check": self.domain_check} if self.domain_check is not None else {}),
            "layers": self.result.layers,
        }

    def files(self, extra_metadata: Optional[dict] = None) -> dict[str, str]:
        """What is written beside the weights: recipe.yaml (the recipe as run) and quantkit.json (`extra_metadata`:
        keys a caller of `quantkit.save` adds)."""
        return {"recipe.yaml": self.recipe.to_yaml(dataset=self.calibration_data),
                "quantkit.json": json.dumps({**self.metadata(), **(extra_metadata or {})}, indent=2) + "\n"}
