"""GPTQ as a pipeline stage: Hessians from calibration inputs (shared by linears that read the same
input), the solver in `quantkit.quant.gptq`, dampening escalation and a loud RTN last resort.

Int schemes get their min/max scales from the solver (ggml's block grids, Q4_1 / Q5_0 / Q4_K / Q6_K: their
parameters as each block is reached, `gptq_quantize_ggml`); FP8 schemes keep the scales of the nearest
rounding (`fp8` stage, same observer) and GPTQ chooses the e4m3 codes on them, so the checkpoint
layout is the `fp8` stage's; a static activation scale comes from the same calibration inputs.
"""

from __future__ import annotations

import dataclasses

import logging
import tempfile
from typing import Literal, Optional

import torch
from pydantic import Field
from torch import nn

from quantkit.calibration import distributed
from quantkit.kernels import wide_matmul
from quantkit.errors import QuantizationError, RecipeError
from quantkit.algorithms.base import Algorithm, AlgorithmConfig
from quantkit.algorithms.fp8 import StaticInputScales, nearest_fp8
from quantkit.quant import microscale
from quantkit.quant.fp8 import Fp8Weight, column_scales
from quantkit.quant.microscale import MicroWeight
from quantkit.quant import ggml
from quantkit.quant.gptq import (HessianError, SolveError, activation_target, gptq_quantize, gptq_quantize_fp8,
                                 gptq_quantize_ggml, hessian_error)
from quantkit.platform.memory import release_free_memory
from quantkit.platform.parking import Parked
from quantkit.quant.hessian import CrossAccumulator, HessianAccumulator
from quantkit.quant.intq import QuantizedWeight, rtn
from quantkit.core.registry import ALGORITHMS

log = logging.getLogger(__name__)

# A group's solve hands free heap pages back to the OS first only when its working set (weights + Hessian)
# is this large. glibc maps chunks above 32 MB on their own and unmaps them when freed; below, what a
# trim returns the next forward faults straight back in, and the trims themselves cost ~1 s per SmolLM2
# GPTQ run (120 groups of 2-7 MB; cProfile at 16 x 512 tokens: 1.1 s of 36). The pipeline still trims once
# per layer. On an 8B layer (170-800 MB groups) the solve dwarfs the trim, and the memory matters.
TRIM_BEFORE_SOLVE_BYTES = 64 << 20


def _trim_before_solve(linears: dict[str, nn.Linear], group: list[str]) -> None:
    weights = sum(linears[n].weight.numel() for n in group)
    columns = linears[group[0]].weight.shape[1]
    if (weights + columns * columns) * 4 >= TRIM_BEFORE_SOLVE_BYTES:  # float32 in the solver
        release_free_memory()


class GPTQConfig(AlgorithmConfig):
    block_size: int = Field(128, gt=0)  # columns per lazy batch update
    dampening_frac: float = Field(0.01, gt=0)  # fraction of mean(diag H) added to the diagonal
    dampening_retries: int = Field(4, ge=0)  # x10 the dampening this many times before giving up
    rtn_fallback: bool = True  # after the retries, quantize the layer with RTN (logged, recorded)
    # GGUF grids (Q4_0, Q5_0, Q4_K, Q6_K; Q4_K_M): each block's parameters searched (diag(H)-weighted
    # error) among ggml-shaped candidates instead of ggml's plain rule
    scale_search: bool = False
    mse_samples: int = Field(1 << 16, ge=1024)  # FP8 static activations, observer mse: input values kept
    # a Hessian of at least this many bytes waits on disk (an unlinked temporary file) while its group is solved,
    # so that the solver's copy is the only n x n matrix in memory (an 8B down_proj's is 822 MB); null: never
    park_hessian_bytes: Optional[int] = Field(256 << 20, ge=0)
    seed: int = 0
    # each linear group calibrated on the inputs the layer makes with the groups before it already quantized
    # (q/k/v, then o_proj on quantized attention, gate/up, then down_proj on their quantized output), in one
    # forward per layer that also makes the next layer's inputs; off: every group on the float layer's inputs,
    # then a second forward with the quantized weights (llm-compressor's way)
    true_sequential: bool = False
    # schemes that quantize activations at run time (NVFP4, MX): solve for W x from the quantized input q(x) the
    # kernel multiplies (asymmetric calibration, GPTAQ-style: GPTQ on W' = W C H_q^-1 with H_q = sum q(x) q(x)^T,
    # C = sum x q(x)^T) instead of for W on sum x x^T. NVFP4's q(x) uses each batch's own global scale. Weight-only
    # schemes: no effect (q(x) = x); int8 / FP8 activations: refused (not emulated during calibration yet).
    activation_target: bool = False
    # the activation target's cross sums D = sum (x - q(x)) q(x)^T per batch: auto multiplies a bf16 calibration
    # forward's pairs as bf16 GEMMs (exact products, each batch's sum rounded to bf16 once before the float32
    # running sum; 3.9x faster where bf16 GEMMs are fast), float32 GEMMs where the run widens its bf16 matmuls (a
    # CPU slow in bf16) or the inputs are not bf16; float32: always (`quant.hessian`; the Hessian is float32 always)
    target_products: Literal["auto", "float32"] = "auto"


@ALGORITHMS.register("gptq")
class GPTQ(Algorithm):
    name = "gptq"
    Config = GPTQConfig
    needs_calibration = True
    supports_actorder = True  # scheme.actorder "static": columns by decreasing diag(H), groups kept
    supports_fp8 = True
    supports_micro = True  # NVFP4 / MX: scales fixed by the nearest rounding, GPTQ chooses the elements
    config: GPTQConfig

    def __init__(self, config: GPTQConfig, scheme):
        super().__init__(config, scheme)
        if config.scale_search and getattr(scheme, "grid", None) not in ("q4_0", "q8_0", "q4_k_m") and \
                not ggml.is_block_grid(scheme) and not scheme.is_micro:
            raise RecipeError("gptq: scale_search is for GGUF's Q4_0, Q8_0, Q5_0, Q4_K, Q6_K grids (scheme: Q4_0, Q8_0, "
                              "Q4_K_M, ...) and the NVFP4 / MX formats")
        self._inputs = StaticInputScales(scheme, config.mse_samples, config.seed) \
            if scheme.is_fp8 or scheme.needs_input_global or scheme.has_static_input else None
        if config.activation_target and scheme.input_activations is not None and not scheme.is_micro:
            raise RecipeError("gptq: activation_target runs for NVFP4 / MX activations only (their quantization is "
                              "emulated here during calibration); drop it for this scheme")
        # weight-only schemes: q(x) = x, so the target is W itself and the solve is plain GPTQ
        self._target = config.activation_target and scheme.input_activations is not None

    def true_sequential(self) -> bool:
        return self.config.true_sequential

    def begin_layer(self, linears: dict[str, nn.Linear], groups: list[list[str]]) -> None:
        self._leader = {name: group[0] for group in groups for name in group}
        self._H: dict[str, HessianAccumulator] = {}
        self._C: dict[str, CrossAccumulator] = {}
        if self._inputs is not None:
            self._inputs.clear()

    def observe(self, name: str, x: torch.Tensor) -> None:
        if self._leader[name] != name:
            return  # the group's first linear accumulates the shared Hessian (and input scale)
        if name not in self._H:
            self._H[name] = HessianAccumulator(x.shape[-1])
        if self._target:
            products = self._products(x)
            xq = self._quantized_input(x).to(products)  # (float32; bf16 products: rounded once more, 2^-9 relative)
            self._H[name].add(xq)
            self._C.setdefault(name, CrossAccumulator(x.shape[-1], products)).add(x.detach().to(products) - xq, xq)
        else:
            self._H[name].add(x)
        if self._inputs is not None:
            self._inputs.add(name, x)

    def _products(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of the activation target's per-batch cross products (`GPTQConfig.target_products`)."""
        if (self.config.target_products == "auto" and x.dtype == torch.bfloat16
                and not wide_matmul.widening_active(torch.bfloat16)):
            return torch.bfloat16
        return torch.float32

    def _quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the scheme's kernel multiplies for input x: its activations quantized and dequantized (NVFP4: under
        the global scale of x itself)."""
        acts = self.scheme.input_activations
        gs = microscale.nvfp4_global_scale(x.detach().abs().amax().float()) if self.scheme.needs_input_global else None
        return microscale.fake_quantize_input(x.detach(), acts.num_bits, acts.group_size, gs)

    def quantize_layer(
        self, linears: dict[str, nn.Linear], groups: list[list[str]], scale_dtype: torch.dtype
    ) -> dict[str, "QuantizedWeight | Fp8Weight"]:
        world = distributed.current()
        if world.active:
            return self._quantize_shared(linears, groups, scale_dtype, world)
        out = {}
        for group in groups:
            _trim_before_solve(linears, group)  # the last group's temporaries back to the OS before this solve
            acc = self._H.pop(group[0], None)  # each Hessian is freed once its group is solved
            assert acc is not None, f"no calibration input reached {group[0]}"
            # one static input scale per group: its linears read the same input
            input_scale = self._input_scale(group[0], scale_dtype)
            result, report = self._solve_group(linears, group, acc, scale_dtype, input_scale)
            out.update(result)
            self.report.update(report)
        return out

    def _input_scale(self, leader: str, scale_dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The group's static FP8 input scale, or NVFP4 activations' global scale; None when neither."""
        if self.scheme.has_static_input:
            return self._inputs.scale(leader, scale_dtype)
        return self._inputs.global_scale(leader) if self.scheme.needs_input_global else None

    def _solve_group(self, linears: dict[str, nn.Linear], group: list[str], acc: HessianAccumulator,
                     scale_dtype: torch.dtype, input_scale: Optional[torch.Tensor]) -> tuple[dict, dict]:
        """One group's weights and report rows. Rows are independent given H: linears sharing an input are
        solved as one stacked matrix. A large H waits on disk during the solve (`park_hessian_bytes`)."""
        H = acc.take_hessian()  # the accumulator gives it up: this frame holds the only reference
        if self._target:
            self._retarget(linears, group, H)
        if self.scheme.is_micro:  # NVFP4: one global scale for the group (`microscale.shared_global_scale`)
            nearest = dict(zip(group, microscale.quantize_group([linears[n].weight.data for n in group], self.scheme)))
        else:
            nearest = {n: self._nearest(linears[n].weight.data, scale_dtype) for n in group}
        begin = self._start(group, linears, nearest, H)
        limit = self.config.park_hessian_bytes
        if limit is not None and H.numel() * H.element_size() >= limit:
            try:
                parked = Parked(H)
            except OSError as exc:
                raise QuantizationError(
                    f"GPTQ {group[0]}: cannot park its {H.numel() * H.element_size() / 1e9:.2f} GB Hessian on disk "
                    f"({exc}); free space in {tempfile.gettempdir()}, point TMPDIR elsewhere, or keep Hessians in "
                    "memory with --set stages.N.args.park_hessian_bytes=null") from exc
            del H  # its memory is free while the solver's copy is made and factorized
            qw, solve, error = self._solve(", ".join(group), [linears[n].weight.data for n in group], parked,
                                           scale_dtype, begin)
            H = parked.load()  # back for the report, once the solver's copy and working weights are gone
            parked.close()
            log.debug("GPTQ %s: its %.2f GB Hessian waited on disk during the solve", group[0], parked.nbytes / 1e9)
        else:
            qw, solve, error = self._solve(", ".join(group), [linears[n].weight.data for n in group], H, scale_dtype,
                                           begin)
        result, report, start = {}, {}, 0
        for name in group:
            rows = slice(start, start + linears[name].out_features)
            result[name] = qw[name] if isinstance(qw, dict) else _rows(qw, rows)
            if input_scale is not None:
                setattr(result[name], "input_global_scale" if self.scheme.is_micro else "input_scale", input_scale)
            report[name], rtn_err = self._metrics(linears[name].weight.data, result[name], nearest[name], H, solve,
                                                  error, rows)
            if self.scheme.grid is not None and (report[name].get("hessian_error_vs_rtn") or 0.0) > 1.0:
                # a GGUF grid, weights already on it (a model converted from this very GGUF type): ggml's own
                # rounding is near exact and GPTQ's compensation only adds error; keep the better of the two
                result[name] = nearest[name]
                report[name] = {**report[name], "hessian_error": rtn_err, "hessian_error_vs_rtn": 1.0,
                                "kept": "nearest (GPTQ's Hessian-weighted error was higher)"}
            start = rows.stop
        return result, report

    def _retarget(self, linears: dict[str, nn.Linear], group: list[str], H_q: torch.Tensor) -> None:
        """Each linear's float weight replaced by its activation target W' (`quant.gptq.activation_target`), which
        the rest of the solve (scales, GPTQ, report) then takes as the weight."""
        D = self._C.pop(group[0]).take()  # 2/n sum (x - q(x)) q(x)^T
        for name in group:
            w = linears[name].weight
            w.data = activation_target(w.data, H_q, D, self.config.dampening_frac).to(w.dtype)

    def _quantize_shared(self, linears: dict[str, nn.Linear], groups: list[list[str]], scale_dtype: torch.dtype,
                         world: "distributed.World") -> dict:
        """A distributed run: every group's Hessian summed over the ranks, the solves dealt out by size
        (largest first, `distributed.owner_of`), each result and its report broadcast from its solver."""
        for group in groups:  # collective calls: the same groups in the same order on every rank
            acc = self._H.get(group[0])
            assert acc is not None, f"no calibration input reached {group[0]}"
            acc.reduce(lambda t, g=group[0]: world.sum_(t, f"GPTQ {g}: Hessian"))
            if group[0] in self._C:
                self._C[group[0]].reduce(lambda t, g=group[0]: world.sum_(t, f"GPTQ {g}: input cross-moments"))
        scales = {g[0]: self._input_scale(g[0], scale_dtype) for g in groups}
        owners = distributed.owner_of([sum(linears[n].weight.numel() for n in g) for g in groups], world.size)
        mine: dict[int, tuple[dict, dict]] = {}
        for gi, group in enumerate(groups):
            acc = self._H.pop(group[0])
            if owners[gi] != world.rank:
                continue  # another rank solves it
            _trim_before_solve(linears, group)
            result, report = self._solve_group(linears, group, acc, scale_dtype, scales[group[0]])
            mine[gi] = ({n: _to_cpu(q) for n, q in result.items()}, report)
        out = {}
        device = next(iter(linears.values())).weight.device
        for gi, group in enumerate(groups):
            result, report = world.broadcast_object(mine.get(gi), owners[gi], f"GPTQ {group[0]}: solved weights")
            out.update({n: _to_device(q, device) for n, q in result.items()})
            self.report.update(report)
        return out

    def _start(self, group: list[str], linears: dict[str, nn.Linear], nearest: dict, H: torch.Tensor) -> dict:
        """The weights whose scales the FP8 / NVFP4 / MX solve keeps: the nearest rounding's, or for NVFP4 / MX with
        scale_search each group's scale searched against diag(H) (`microscale.searched_scales`)."""
        if not (self.scheme.is_micro and self.config.scale_search):
            return nearest
        diag = torch.diagonal(H).float()
        return {n: microscale.searched_scales(linears[n].weight.data, self.scheme, diag, qw.global_scale)
                for n, qw in nearest.items()}

    def _nearest(self, W: torch.Tensor, scale_dtype: torch.dtype) -> "QuantizedWeight | Fp8Weight | ggml.GGMLWeight":
        """Round-to-nearest on the scheme's grid: the fallback, and the baseline of the error report."""
        if ggml.is_block_grid(self.scheme):
            return ggml.nearest(W, self.scheme)  # ggml's plain rule: what llama-quantize does without an imatrix
        return nearest_fp8(W, self.scheme, scale_dtype) if self.scheme.is_fp8 else rtn(W, self.scheme, scale_dtype)

    def _solve(self, name: str, weights: list[torch.Tensor], H: torch.Tensor, scale_dtype: torch.dtype,
               nearest: Optional[dict[str, Fp8Weight]] = None
               ) -> tuple["QuantizedWeight | dict[str, Fp8Weight]", dict, Optional[SolveError]]:
        """GPTQ with dampening escalation; returns the weight (FP8: per linear), how it was obtained, and the
        solve's own error tally (None for the RTN fallback).

        FP8 schemes need `nearest`, the nearest rounding of each stacked linear (its scales are kept).
        weights: the group's weights, stacked afresh for each attempt into the solver's working copy."""
        cfg = self.config
        damp = cfg.dampening_frac
        actorder = self.scheme.actorder == "static"
        for attempt in range(cfg.dampening_retries + 1):
            try:
                if self.scheme.is_micro:
                    scale = torch.cat([qw.group_scales() for qw in nearest.values()])
                    res = gptq_quantize_fp8(torch.cat(weights), H, scale, cfg.block_size, damp, actorder,
                                            overwrite=True, columns_per_scale=self.scheme.group_size,
                                            element_bits=self.scheme.num_bits)
                    weight = _split_rows(res.weight, nearest)
                elif self.scheme.is_fp8:
                    scales = [column_scales(qw) for qw in nearest.values()]  # one scheme: one width for all
                    scale, width = torch.cat([s for s, _ in scales]), scales[0][1]
                    # [sum(out), in], the solver's working copy (overwrite): held by the solver only, which frees it
                    res = gptq_quantize_fp8(torch.cat(weights), H, scale, cfg.block_size, damp, actorder,
                                            overwrite=True, columns_per_scale=width)
                    weight = _split_rows(res.weight, nearest)
                elif ggml.is_block_grid(self.scheme):
                    res = gptq_quantize_ggml(weights, H, self.scheme, cfg.block_size, damp,
                                             scale_search=cfg.scale_search)
                    weight = res.weight
                    if not weight.all_finite():
                        raise HessianError("non-finite scales")
                else:
                    # the weights themselves: the solver stacks them into its working copy in visiting order
                    res = gptq_quantize(weights, H, self.scheme, scale_dtype, cfg.block_size, damp, actorder,
                                        scale_search=cfg.scale_search and self.scheme.grid in ("q4_0", "q8_0"))
                    if not torch.isfinite(res.weight.scale.float()).all():
                        raise HessianError("non-finite scales")
                    weight = res.weight
                info = {"dampening_frac": damp}
                if res.dead_columns:
                    info["dead_columns"] = res.dead_columns
                return weight, info, res.error
            except HessianError as exc:
                if attempt == cfg.dampening_retries:
                    break
                log.warning("GPTQ %s: %s; raising dampening_frac %.3g -> %.3g", name, exc, damp, damp * 10)
                damp *= 10
        if not cfg.rtn_fallback:
            raise HessianError(f"GPTQ failed on {name} even with dampening_frac {damp:.3g}; "
                               "set stages.N.args.dampening_frac higher or allow rtn_fallback")
        log.error("GPTQ %s: numerically unsolvable even with dampening_frac %.3g: FALLING BACK TO RTN", name, damp)
        if self.scheme.is_fp8 or self.scheme.is_micro:
            fallback = nearest
        elif ggml.is_block_grid(self.scheme):
            fallback = ggml.nearest(torch.cat(weights), self.scheme)
        else:
            fallback = rtn(torch.cat(weights), self.scheme, scale_dtype)
        return fallback, {"fallback": "rtn", "dampening_frac": damp}, None

    def _metrics(self, W: torch.Tensor, qw, nearest, H: torch.Tensor, solve: dict, error: Optional[SolveError],
                 rows: slice) -> tuple[dict, Optional[float]]:
        """Hessian-weighted error of the result (from the solve's own tally; `rows`: this linear's rows in the
        solved stack), and relative to round-to-nearest's on the same weight; and that RTN error."""
        if solve.get("fallback"):
            return solve, None
        gptq_err = error.hessian_error(W, qw, rows)  # (the weights dequantized a slice of rows at a time)
        rtn_err = hessian_error(W, nearest, H)
        ratio = round(gptq_err / rtn_err, 4) if rtn_err > 0 else None
        return {"hessian_error": gptq_err, "hessian_error_vs_rtn": ratio, **solve}, rtn_err


def _split_rows(codes: torch.Tensor, nearest: dict[str, "Fp8Weight | MicroWeight"]) -> dict:
    """Split stacked solved codes (e4m3 bytes: FP8 codes, or NVFP4 / MX elements) back into each linear's weight,
    with that linear's own scales (everything but the codes taken from its nearest rounding)."""
    out, start = {}, 0
    for name, qw in nearest.items():
        rows = qw.q.shape[0]
        out[name] = dataclasses.replace(qw, q=codes[start : start + rows].contiguous())
        start += rows
    return out


def _rows(qw: "QuantizedWeight | ggml.GGMLWeight", rows: slice) -> "QuantizedWeight | ggml.GGMLWeight":
    if isinstance(qw, ggml.GGMLWeight):
        return qw.rows(rows)
    zp = None if qw.zero_point is None else qw.zero_point[rows]
    return QuantizedWeight(qw.q[rows].contiguous(), qw.scale[rows].contiguous(), zp, qw.scheme)


def _to_cpu(qw):
    """A quantized weight with its tensors on the CPU (to be broadcast), and back (`_to_device`)."""
    return _to_device(qw, torch.device("cpu"))


def _to_device(qw, device: torch.device):
    import copy

    qw = copy.copy(qw)
    for key, value in vars(qw).items():
        if isinstance(value, torch.Tensor):
            setattr(qw, key, value.to(device))
    return qw
