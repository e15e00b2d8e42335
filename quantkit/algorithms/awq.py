"""AWQ as a pipeline transform: activation-aware scales searched per scale group and folded into
the preceding operator, then (optionally) a per-group clipping search; a later stage (RTN or
GPTQ) quantizes the rewritten weights. The maths is in `quantkit.quant.awq`.

Per decoder layer: one float forward over every calibration batch records each scale group's
input magnitudes, every clipped linear's input Hessian (sum x x^T), and the calls (inputs
and outputs) of each group's parent module for the first `search_samples` sequences. Each
candidate scale is scored by the parent's output error with its balance linears quantized.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import torch
from pydantic import Field
from torch import nn

from quantkit.calibration import distributed
from quantkit.algorithms.base import Algorithm, AlgorithmConfig, LayerContext
from quantkit.arch.adapter import ScaleGroup
from quantkit.calibration.driver import drive_layer
from quantkit.kernels.reference import input_fake_quantizer
from quantkit.quant.awq import apply_clip, candidate_scales, clip_refine, clip_search, diagonal_blocks, fake_quantize, weight_magnitude
from quantkit.quant.hessian import HessianAccumulator
from quantkit.core.registry import ALGORITHMS
from quantkit.errors import RecipeError
from quantkit.quant.smoothing import fold_scales, repeated_heads_index

log = logging.getLogger(__name__)


class AWQConfig(AlgorithmConfig):
    n_grid: int = Field(20, ge=1)  # scale exponents searched: 0, 1/n, ..., (n-1)/n
    # scales from activations and weights (x^r / w^(1-r)), or activations only (x^r), or both grids searched
    duo_scaling: Union[bool, Literal["both"]] = True
    search_samples: int = Field(16, ge=1)  # calibration sequences whose block outputs score a candidate
    clip: bool = True  # search a clipping range per weight group after scaling
    clip_n_grid: int = Field(20, ge=1)
    clip_max_shrink: float = Field(0.5, gt=0, lt=1)  # ranges are shrunk by at most this fraction
    clip_skip: list[str] = Field(default_factory=lambda: ["*q_proj", "*k_proj"])  # attention logits are sensitive
    clip_in_search: bool = False  # score each candidate scale with its clipping applied (slower; SmolLM2: 34.01 -> 33.89)
    # coordinate-descent sweeps re-choosing the clip factors against each row's whole error with the full input
    # Hessian (groups' errors interact); 0 keeps the per-group choice
    clip_joint_sweeps: int = Field(2, ge=0)


@dataclass
class _Recorded:
    """What one float forward of the layer leaves for the search."""

    abs_sum: dict[str, torch.Tensor] = field(default_factory=dict)  # per input: sum |x| over tokens
    hessians: dict[str, HessianAccumulator] = field(default_factory=dict)  # per clipped input: sum x x^T
    tokens: dict[str, int] = field(default_factory=dict)
    calls: dict[str, list[tuple[tuple, dict, torch.Tensor]]] = field(default_factory=dict)  # parent: (args, kwargs, out)

    def hessian(self, name: str) -> torch.Tensor:
        """Sum over tokens of x x^T for input `name` (scaled by 2/tokens: irrelevant to argmins)."""
        return self.hessians[name].hessian()


@ALGORITHMS.register("awq")
class AWQ(Algorithm):
    name = "awq"
    Config = AWQConfig
    kind = "transform"
    needs_calibration = True
    config: AWQConfig

    @torch.no_grad()
    def transform_layer(self, ctx: LayerContext) -> None:
        groups = self._active_groups(ctx)
        leader = _input_leaders(ctx)
        clipped = [n for n in ctx.linears if self.config.clip and not _matches(n, self.config.clip_skip)]
        if any(ctx.schemes[n].is_micro for n in clipped):
            raise RecipeError("awq: the clipping search is for int grids; with an NVFP4 / MX scheme set "
                              "`clip: false` (GPTQ after AWQ chooses the ranges)")
        rec = self._record(ctx, groups, {leader[n] for n in clipped}, leader)
        input_scale: dict[str, torch.Tensor] = {}  # linear -> scales its input was divided by
        for group, index in groups:
            scales = self._search(ctx, group, index, rec, leader, clipped if self.config.clip_in_search else [])
            if scales is None:
                continue
            smooth = ctx.layer.get_submodule(group.smooth)
            balance = [ctx.layer.get_submodule(b) for b in group.balance + group.passthrough]
            fold_scales(smooth, balance, scales, ctx.adapter.norm_weight_offset, index, ctx.scale_dtype)
            for b in group.balance:
                input_scale[ctx.prefix + b] = scales if index is None else scales[index]
        for name in clipped:
            self._clip(ctx, name, rec.hessian(leader[name]), input_scale.get(name))

    # -- recording ---------------------------------------------------------------------------

    def _record(self, ctx: LayerContext, groups: list, moment_inputs: set[str], leader: dict) -> _Recorded:
        rec = _Recorded()
        stat_inputs = {leader[ctx.prefix + g.balance[0]] for g, _ in groups}
        keep = [True]

        def input_hook(name: str):
            def hook(_module, args):
                x = args[0]
                if name in stat_inputs:
                    s = x.detach().abs().float().reshape(-1, x.shape[-1]).sum(dim=0)
                    rec.abs_sum[name] = rec.abs_sum[name] + s if name in rec.abs_sum else s
                    rec.tokens[name] = rec.tokens.get(name, 0) + x.numel() // x.shape[-1]
                if name in moment_inputs:
                    if name not in rec.hessians:
                        rec.hessians[name] = HessianAccumulator(x.shape[-1])
                    rec.hessians[name].add(x)
            return hook

        def parent_hook(rel: str):
            def hook(_module, args, kwargs, output):
                if keep[0]:
                    out = output[0] if isinstance(output, tuple) else output
                    rec.calls.setdefault(rel, []).append((args, kwargs, out.detach()))
            return hook

        world = distributed.current()
        # a distributed run: each rank keeps its share of the search samples (batches are dealt round-robin,
        # so the ranks' first samples together are the single process's first samples)
        budget = [-(-self.config.search_samples // world.size)]

        def before_batch(_i: int, h: torch.Tensor) -> None:
            keep[0] = budget[0] > 0
            budget[0] -= h.shape[0]

        drive_layer(ctx.layer, ctx.hidden, ctx.kwargs,
                    pre_hooks=[(ctx.linears[name], input_hook(name)) for name in stat_inputs | moment_inputs],
                    hooks=[(ctx.layer.get_submodule(rel), parent_hook(rel)) for rel in {g.parent for g, _ in groups}],
                    before_batch=before_batch)
        if world.active:  # the statistics of every rank's batches
            for name in sorted(rec.abs_sum):
                world.sum_(rec.abs_sum[name], f"AWQ {name}: input magnitudes")
                rec.tokens[name] = int(world.sum_numbers([rec.tokens[name]], f"AWQ {name}: tokens")[0])
            for name in sorted(rec.hessians):
                rec.hessians[name].reduce(lambda t, n=name: world.sum_(t, f"AWQ {n}: clip Hessian"))
        return rec

    # -- scale search ------------------------------------------------------------------------

    def _active_groups(self, ctx: LayerContext) -> list[tuple[ScaleGroup, Optional[torch.Tensor]]]:
        """The adapter's scale groups that apply here (every balance linear is a target of this
        stage and the modules exist), each with its balance index: None when the smooth operator's
        outputs are the balance inputs one to one; for v -> o under grouped-query attention, which
        v output feeds each o input (the scales are then tied across the repeated heads)."""
        active = []
        for g in ctx.adapter.scale_groups_in(ctx.layer):
            names = [ctx.prefix + b for b in g.balance]
            if not all(n in ctx.linears for n in names):
                continue
            smooth = ctx.layer.get_submodule(g.smooth)
            index = None
            width = ctx.linears[names[0]].in_features
            if isinstance(smooth, nn.Linear) and smooth.out_features != width:
                owner = ctx.layer.get_submodule(g.smooth.rpartition(".")[0]) if "." in g.smooth else ctx.layer
                head_dim = getattr(owner, "head_dim", None)
                if not isinstance(head_dim, int) or smooth.out_features % head_dim or width % smooth.out_features:
                    log.debug("AWQ: %s -> %s shapes do not fit; group skipped", g.smooth, g.balance)
                    continue
                index = repeated_heads_index(smooth.out_features, width, head_dim, smooth.weight.device)
            active.append((g, index))
        return active

    def _search(self, ctx: LayerContext, group: ScaleGroup, index: Optional[torch.Tensor], rec: _Recorded,
                leader: dict, clipped: list[str]):
        names = [ctx.prefix + b for b in group.balance]
        schemes = [ctx.schemes[n] for n in names]
        lead = leader[names[0]]
        x_mean = rec.abs_sum[lead] / rec.tokens[lead]
        weights = {n: ctx.linears[n].weight.data for n in names}
        w_mean = weight_magnitude(list(weights.values()), schemes[0])
        if index is not None:  # one scale per smooth output: average over the balance inputs it feeds
            x_mean, w_mean = _tied_mean(x_mean, index), _tied_mean(w_mean, index)
        parent, calls = ctx.layer.get_submodule(group.parent), rec.calls.get(group.parent, [])
        smooth = ctx.layer.get_submodule(group.smooth)

        # a scheme that quantizes the balance inputs too (NVFP4, MX, W4AFP8): the candidates are scored with the
        # inputs scaled (x * factor) and quantized as the kernels will, so the scales serve both quantizers
        inputs = _InputQuantization(input_fake_quantizer(schemes[0]), [ctx.linears[n] for n in names])

        def loss(smooth_scales) -> float:
            scales = smooth_scales if index is None or smooth_scales is None else smooth_scales[index]
            # what folding will really do to the balance inputs: x -> x * factor (1/s up to rounding)
            factor = None if smooth_scales is None else \
                _fold_factor(smooth, smooth_scales, ctx.adapter.norm_weight_offset, ctx.scale_dtype)
            if factor is not None and index is not None:
                factor = factor[index]
            inputs.factor = factor
            for (n, w), scheme in zip(weights.items(), schemes):
                # the balance weight as it will be stored (scaled, in the checkpoint dtype), clipped, quantized
                wf = w.float() if scales is None else (w.float() * scales).to(ctx.scale_dtype).float()
                if n in clipped:
                    wf = apply_clip(wf, self._clip_factors(ctx, n, wf, rec.hessian(leader[n]), scales, 0), scheme)
                q = fake_quantize(wf, scheme, ctx.scale_dtype)
                ctx.linears[n].weight.data = (q if factor is None or inputs.active else q * factor).to(w.dtype)
            return _block_error(parent, calls, names)

        try:
            base = loss(None)  # quantized without scaling
            best_err, best_ratio, best = self._best_candidate(loss, base, x_mean, w_mean)
        finally:
            inputs.remove()
            for n, w in weights.items():
                ctx.linears[n].weight.data = w
        for n in names:
            self.report[n] = {"awq_ratio": best_ratio, "awq_error_vs_unscaled": round(best_err / base, 4) if base > 0 else None}
        if best is None:
            log.info("AWQ %s: no scale beats plain quantization; left unscaled", ", ".join(names))
        return best

    def _best_candidate(self, loss: Callable[[torch.Tensor], float], base: float, x_mean: torch.Tensor,
                        w_mean: torch.Tensor) -> tuple[float, Optional[float], Optional[torch.Tensor]]:
        """(error, exponent, scales) of the grid's best candidate; (base, None, None) when none beats no scaling."""
        best_err, best_ratio, best = base, None, None
        duo = self.config.duo_scaling
        for i, use_duo in itertools.product(range(self.config.n_grid), (True, False) if duo == "both" else (duo,)):
            ratio = i / self.config.n_grid
            scales = candidate_scales(x_mean, w_mean, ratio, use_duo)
            err = loss(scales)
            if math.isfinite(err) and err < best_err:
                best_err, best_ratio, best = err, ratio, scales
        return best_err, best_ratio, best

    # -- clipping ----------------------------------------------------------------------------

    def _clip_factors(self, ctx: LayerContext, name: str, w: torch.Tensor, hessian: torch.Tensor, scales,
                      sweeps: int) -> torch.Tensor:
        """Clip factors of weight w (already multiplied by `scales`, if any) of linear `name`."""
        if scales is not None:  # the input is then x / s: its second moments are H_ij / (s_i s_j)
            inv = 1.0 / scales.float()
            hessian = hessian * inv[:, None] * inv[None, :]
        scheme, grid, shrink = ctx.schemes[name], self.config.clip_n_grid, self.config.clip_max_shrink
        factors = clip_search(w, diagonal_blocks(hessian, scheme), scheme, ctx.scale_dtype, grid, shrink)
        return clip_refine(w, factors, hessian, scheme, ctx.scale_dtype, grid, shrink, sweeps)

    def _clip(self, ctx: LayerContext, name: str, hessian: torch.Tensor, scales) -> None:
        lin, scheme = ctx.linears[name], ctx.schemes[name]
        factors = self._clip_factors(ctx, name, lin.weight.data, hessian, scales, self.config.clip_joint_sweeps)
        lin.weight.data = apply_clip(lin.weight.data, factors, scheme).to(lin.weight.dtype)
        self.report.setdefault(name, {})["awq_clip_mean"] = round(float(factors.mean()), 4)


def _block_error(parent: nn.Module, calls: list, names: list[str]) -> float:
    """Mean squared error of the parent block's outputs against the recorded float ones, over every rank's samples
    (the same loss, so the same choice, on every rank)."""
    total, count = 0.0, 0
    for args, kwargs, ref in calls:
        out = parent(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        total += float((out.float() - ref.float()).pow(2).sum())
        count += ref.numel()
    world = distributed.current()
    if world.active:
        total, count = world.sum_numbers([total, count], f"AWQ {', '.join(names)}: search loss")
    return total / max(count, 1)


class _InputQuantization:
    """Forward pre-hooks on the balance linears during the scale search: each input becomes
    quantize(x * factor), the scaled input quantized as the scheme's kernel will (inactive for weight-only schemes,
    where the factor is folded into the weights instead)."""

    def __init__(self, quantize: Optional[Callable[[torch.Tensor], torch.Tensor]], linears: list[nn.Module]):
        self.quantize, self.factor = quantize, None
        self.handles = [] if quantize is None else [lin.register_forward_pre_hook(self._hook) for lin in linears]
        self._last: Optional[tuple] = None  # (x, factor, result): q/k/v (gate/up) read the same input tensor

    @property
    def active(self) -> bool:
        return self.quantize is not None

    def _hook(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if self._last is not None and self._last[0] is x and self._last[1] is self.factor:
            return (self._last[2], *args[1:])
        scaled = x.float() if self.factor is None else x.float() * self.factor.to(x.device)
        result = self.quantize(scaled).to(x.dtype)
        self._last = (x, self.factor, result)
        return (result, *args[1:])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self._last = [], None


def _fold_factor(smooth: nn.Module, scales: torch.Tensor, offset: float, storage_dtype: torch.dtype) -> torch.Tensor:
    """The factor folding `scales` really applies to the smooth operator's outputs: 1/s, except
    where the stored parameter's rounding changes it. That matters for norms applying
    (offset + weight) (Gemma: 1 + w): the folded (1 + w)/s - 1 is stored in the checkpoint dtype,
    and for large s the small 1 + w' left after rounding it can be far from (1 + w)/s."""
    s = scales.float()
    if isinstance(smooth, nn.Linear) or offset == 0 or storage_dtype == torch.float32:
        return 1.0 / s  # relative rounding only: negligible
    base = offset + smooth.weight.float()
    stored = ((base / s) - offset).to(storage_dtype).float()
    factor = (offset + stored) / base
    return torch.where(base.abs() > 1e-6, factor, 1.0 / s)


def _tied_mean(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions that share each index value."""
    n = int(index.max()) + 1
    sums = torch.zeros(n, dtype=torch.float32, device=values.device).index_add_(0, index, values.float())
    return sums / torch.bincount(index, minlength=n).float()


def _input_leaders(ctx: LayerContext) -> dict[str, str]:
    """Each target linear -> the first target reading the same input (inputs are recorded once)."""
    leader = {}
    for group in ctx.adapter.linear_groups:
        names = [ctx.prefix + r for r in group if ctx.prefix + r in ctx.linears]
        for n in names:
            leader[n] = names[0]
    for n in ctx.linears:
        leader.setdefault(n, n)
    return leader


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
