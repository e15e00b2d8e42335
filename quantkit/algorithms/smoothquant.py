"""SmoothQuant as a pipeline transform: per-channel scales that move activation outliers into the
weights, folded into the operator that produces those activations; a later stage (RTN or GPTQ,
usually to W8A8) quantizes the rewritten weights. The maths is in `quantkit.quant.smoothquant`.

Per decoder layer: one float forward over every calibration batch records, for each of the
architecture adapter's scale groups, the maximum |x| of every input channel of its linears; the
scales are folded with `quant.smoothing.fold_scales`, exactly as AWQ's are. By default only the
groups smoothed by a norm (q/k/v after the input norm, gate/up after the MLP's norm) are used, as
in the paper and in llm-compressor; `smooth_linears: true` adds v -> o and up -> down where the
shapes match one to one.
"""

from __future__ import annotations

import logging

import torch
from pydantic import Field
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig, LayerContext
from quantkit.arch.adapter import ScaleGroup
from quantkit.calibration import distributed
from quantkit.calibration.driver import drive_layer
from quantkit.core.registry import ALGORITHMS
from quantkit.quant.smoothing import fold_scales
from quantkit.quant.smoothquant import smoothing_scales, weight_absmax

log = logging.getLogger(__name__)


class SmoothQuantConfig(AlgorithmConfig):
    alpha: float = Field(0.5, ge=0.0, le=1.0)  # migration strength: share of the activation range moved
    smooth_linears: bool = False  # also smooth v -> o and up -> down (a linear's output rows are divided)


@ALGORITHMS.register("smoothquant")
class SmoothQuant(Algorithm):
    name = "smoothquant"
    Config = SmoothQuantConfig
    kind = "transform"
    needs_calibration = True
    config: SmoothQuantConfig

    @torch.no_grad()
    def transform_layer(self, ctx: LayerContext) -> None:
        groups = self._active_groups(ctx)
        if not groups:
            return
        act_max = self._record(ctx, groups)
        for group in groups:
            names = [ctx.prefix + b for b in group.balance]
            linears = [ctx.linears[n] for n in names]
            scales = smoothing_scales(act_max[names[0]], weight_absmax([m.weight for m in linears]), self.config.alpha)
            smooth = ctx.layer.get_submodule(group.smooth)
            balance = linears + [ctx.layer.get_submodule(p) for p in group.passthrough]
            fold_scales(smooth, balance, scales, ctx.adapter.norm_weight_offset, None, ctx.scale_dtype)
            for n in names:
                self.report[n] = {"smoothquant_scale_min": round(float(scales.min()), 4),
                                  "smoothquant_scale_max": round(float(scales.max()), 4)}

    def _active_groups(self, ctx: LayerContext) -> list[ScaleGroup]:
        """The adapter's scale groups whose linears are all targets of the quantizing stage, whose
        smooth operator is a norm (or, with `smooth_linears`, a linear with one output per input)."""
        active = []
        for g in ctx.adapter.scale_groups_in(ctx.layer):
            names = [ctx.prefix + b for b in g.balance]
            if not all(n in ctx.linears for n in names):
                continue
            smooth = ctx.layer.get_submodule(g.smooth)
            if isinstance(smooth, nn.Linear):
                if not self.config.smooth_linears:
                    continue
                if smooth.out_features != ctx.linears[names[0]].in_features:
                    log.debug("SmoothQuant: %s -> %s shapes do not match one to one; group skipped", g.smooth, g.balance)
                    continue
            active.append(g)
        return active

    def _record(self, ctx: LayerContext, groups: list[ScaleGroup]) -> dict[str, torch.Tensor]:
        """Per input channel max |x| of each group's first linear, over every calibration batch."""
        act_max: dict[str, torch.Tensor] = {}
        leads = [ctx.prefix + g.balance[0] for g in groups]

        def hook(name: str):
            def record(_module, args):
                m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
                act_max[name] = torch.maximum(act_max[name], m) if name in act_max else m
            return record

        drive_layer(ctx.layer, ctx.hidden, ctx.kwargs, pre_hooks=[(ctx.linears[n], hook(n)) for n in leads])
        world = distributed.current()
        if world.active:  # the maxima over every rank's batches
            for name in leads:
                world.max_(act_max[name], f"SmoothQuant {name}: activation maxima")
        return act_max
