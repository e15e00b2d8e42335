"""GPTQ as a pipeline stage: Hessians from calibration inputs (shared by linears that read the same
input), the solver in `quantkit.quant.gptq`, dampening escalation and a loud RTN last resort."""

from __future__ import annotations

import logging

import torch
from pydantic import Field
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.quant.gptq import HessianError, gptq_quantize, hessian_error
from quantkit.quant.hessian import HessianAccumulator
from quantkit.quant.intq import QuantizedWeight, rtn
from quantkit.registry import ALGORITHMS

log = logging.getLogger(__name__)


class GPTQConfig(AlgorithmConfig):
    block_size: int = Field(128, gt=0)  # columns per lazy batch update
    dampening_frac: float = Field(0.01, gt=0)  # fraction of mean(diag H) added to the diagonal
    dampening_retries: int = Field(4, ge=0)  # x10 the dampening this many times before giving up
    rtn_fallback: bool = True  # after the retries, quantize the layer with RTN (logged, recorded)


@ALGORITHMS.register("gptq")
class GPTQ(Algorithm):
    name = "gptq"
    Config = GPTQConfig
    needs_calibration = True
    supports_actorder = True  # scheme.actorder "static": columns by decreasing diag(H), groups kept
    config: GPTQConfig

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        self._leader = {name: group[0] for group in groups for name in group}
        self._H: dict[str, HessianAccumulator] = {}

    def observe(self, name: str, x: torch.Tensor) -> None:
        if self._leader[name] != name:
            return  # the group's first linear accumulates the shared Hessian
        if name not in self._H:
            self._H[name] = HessianAccumulator(x.shape[-1])
        self._H[name].add(x)

    def quantize_layer(
        self, linears: dict[str, nn.Linear], groups: list[list[str]], scale_dtype: torch.dtype
    ) -> dict[str, QuantizedWeight]:
        out = {}
        for group in groups:
            acc = self._H.get(group[0])
            assert acc is not None, f"no calibration input reached {group[0]}"
            H = acc.hessian()
            # rows are independent given H: linears sharing an input are solved as one stacked matrix
            W = torch.cat([linears[n].weight.data for n in group])  # [sum(out), in]
            qw, solve = self._solve(", ".join(group), W, H, scale_dtype)
            start = 0
            for name in group:
                rows = slice(start, start + linears[name].out_features)
                out[name] = _rows(qw, rows)
                self.report[name] = self._metrics(linears[name].weight.data, out[name], H, scale_dtype, solve)
                start = rows.stop
        self._H = {}
        return out

    def _solve(
        self, name: str, W: torch.Tensor, H: torch.Tensor, scale_dtype: torch.dtype
    ) -> tuple[QuantizedWeight, dict]:
        """GPTQ with dampening escalation; returns the weight and how it was obtained."""
        cfg = self.config
        damp = cfg.dampening_frac
        for attempt in range(cfg.dampening_retries + 1):
            try:
                res = gptq_quantize(W, H, self.scheme, scale_dtype, cfg.block_size, damp,
                                    actorder=self.scheme.actorder == "static")
                if not torch.isfinite(res.weight.scale.float()).all():
                    raise HessianError("non-finite scales")
                info = {"dampening_frac": damp}
                if res.dead_columns:
                    info["dead_columns"] = res.dead_columns
                return res.weight, info
            except HessianError as exc:
                if attempt == cfg.dampening_retries:
                    break
                log.warning("GPTQ %s: %s; raising dampening_frac %.3g -> %.3g", name, exc, damp, damp * 10)
                damp *= 10
        if not cfg.rtn_fallback:
            raise HessianError(f"GPTQ failed on {name} even with dampening_frac {damp:.3g}; "
                               "set stages.N.args.dampening_frac higher or allow rtn_fallback")
        log.error("GPTQ %s: numerically unsolvable even with dampening_frac %.3g: FALLING BACK TO RTN", name, damp)
        return rtn(W, self.scheme, scale_dtype), {"fallback": "rtn", "dampening_frac": damp}

    def _metrics(self, W: torch.Tensor, qw: QuantizedWeight, H: torch.Tensor, scale_dtype, solve: dict) -> dict:
        """Hessian-weighted error of the result, and relative to RTN's on the same weight."""
        if solve.get("fallback"):
            return solve
        gptq_err = hessian_error(W, qw.dequantize(), H)
        rtn_err = hessian_error(W, rtn(W, self.scheme, scale_dtype).dequantize(), H)
        ratio = round(gptq_err / rtn_err, 4) if rtn_err > 0 else None
        return {"hessian_error": gptq_err, "hessian_error_vs_rtn": ratio, **solve}


def _rows(qw: QuantizedWeight, rows: slice) -> QuantizedWeight:
    zp = None if qw.zero_point is None else qw.zero_point[rows]
    return QuantizedWeight(qw.q[rows].contiguous(), qw.scale[rows].contiguous(), zp, qw.scheme)
