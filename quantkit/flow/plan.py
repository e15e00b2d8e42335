"""What a quantize run will need, from config.json alone (no weights are read): parameters by part,
checkpoint size before and after, peak host and device memory by the onloaded job's accounting,
disk, KV-cache bytes, and a time estimate from throughput measured on this machine.

The memory accounting follows what the onloaded job holds (`quantkit.flow.onload`, `quantkit.flow.pipeline`):
the process itself (`process_bytes`: measured, and more on a CUDA device, whose libraries and context live
in host memory too) and, when calibrating, its imports, text and tokenizer,
then the larger of
- the largest tensor outside the decoder layers, as stored (copied one at a time), and
- one decoder layer in the compute dtype + the calibration activations (in and out, within the
  activation budget) + the working set of the stage that needs most: round-to-nearest's float32
  copies of the largest linear and the layer's codes; GPTQ's Hessians not yet solved and one group's
  solve (one n^2 copy, `quant.gptq.inverse_hessian_factor`, and its stacked weight); AWQ's recorded
  inputs and clip Hessians; a true-sequential stage adds every batch's forward in flight at once.
The NaN scan of the source, before the work, is a peak of its own. On an accelerator the layer-phase
terms are on the device and the host keeps the layer while it loads. Every constant is measured
(RSS sampled every 5 ms through runs on SmolLM2, Gemma, tiny models and an 8B-shaped model).
Figures are estimates; `bench/big_model.py` measures the real job (the note of issue 14 compares them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from quantkit.flow.pipeline import Stage

# Measured (RSS sampled every 5 ms through a quantize run; SmolLM2, Gemma and tiny models):
BASE_PROCESS_BYTES = 470_000_000  # torch, transformers and quantkit imported
# CUDA's libraries and context, in host memory, once a process has used the GPU. Measured on an H200
# (torch 2.11.0+cu130, 2026-12-04): RSS 2.03 GB against 0.79 GB planned without it for gptq-w4a16 of a
# SmolLM2-shaped model, 3.22 GB against 1.99 GB for the 8B-shaped one: +1.24 and +1.23 GB.
CUDA_HOST_BYTES = 1_230_000_000
SCAN_BYTES_PER_PIECE_BYTE = 3.5  # the NaN scan of the source: a piece (64 MB at most) and its finite masks
SCAN_PIECE_BYTES = 64 << 20
CALIBRATION_PROCESS_BYTES = 170_000_000  # calibration's imports, the text and its token ids
TOKENIZER_MEMORY_PER_FILE_BYTE = 10  # a loaded fast tokenizer takes ~10x its tokenizer.json (Gemma: 33 MB -> 0.31 GB)
OUTSIDE_TEMP_BYTES = 256 << 20  # writing a tensor outside the layers: its finite mask and copy buffers, at most
ASSUMED_READ_BYTES_PER_S = 1.0e9  # disk reads; not measured here (the plan reads no weights)


def process_bytes(device: torch.device) -> int:
    """Host memory of a quantkit process before any work: its imports, and on CUDA the runtime's own."""
    return BASE_PROCESS_BYTES + (CUDA_HOST_BYTES if device.type == "cuda" else 0)


@dataclass
class Plan:
    model: str
    recipe: str
    device: str
    compute_dtype: str
    storage_dtype: str
    parameters: dict[str, int]  # by part: embeddings, attention, mlp, experts, head, other
    source_bytes: int
    checkpoint_bytes: int
    quantized_parameters: int
    peak_host_bytes: int
    peak_device_bytes: int
    disk_bytes: int
    activation_bytes: int  # one layer's calibration activations (0 without calibration)
    kv_bytes_per_token: int
    context: int
    estimated_seconds: float
    nproc: int = 1
    kv_pool_bytes: int = 1 << 30  # `quantkit serve --kv-cache-gb` (1 by default)
    kv_block_size: int = 16
    breakdown: dict[str, int] = field(default_factory=dict)  # the peak's terms
    throughput: dict[str, float] = field(default_factory=dict)  # what the estimate is made from

    @property
    def bits_per_weight(self) -> float:
        total = sum(self.parameters.values())
        return 8 * self.checkpoint_bytes / total if total else 0.0

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the serving engine's paged KV pool holds in `kv_pool_bytes` (whole blocks)."""
        per_block = self.kv_block_size * self.kv_bytes_per_token
        return int(self.kv_pool_bytes // per_block) * self.kv_block_size if per_block else 0

    def to_json(self) -> dict:
        return {
            "model": self.model, "recipe": self.recipe, "device": self.device, "nproc": self.nproc,
            "compute_dtype": self.compute_dtype, "storage_dtype": self.storage_dtype,
            "parameters": self.parameters, "quantized_parameters": self.quantized_parameters,
            "source_bytes": self.source_bytes, "checkpoint_bytes": self.checkpoint_bytes,
            "bits_per_weight": round(self.bits_per_weight, 3),
            "peak_host_bytes": self.peak_host_bytes, "peak_device_bytes": self.peak_device_bytes,
            "disk_bytes": self.disk_bytes, "activation_bytes": self.activation_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "context": self.context,
            "kv_bytes_at_context": self.kv_bytes_per_token * self.context,
            "kv_pool_bytes": self.kv_pool_bytes, "kv_pool_tokens": self.kv_pool_tokens,
            "estimated_seconds": round(self.estimated_seconds, 1),
            "peak_breakdown_bytes": self.breakdown, "throughput": self.throughput,
        }

    def format(self) -> str:
        gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
        total = sum(self.parameters.values())
        parts = ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in self.parameters.items() if v)
        lines = [
            f"plan: {self.model} with {self.recipe} on {self.device} (compute {self.compute_dtype}, "
            f"stored {self.storage_dtype})",
            f"  parameters      {total / 1e9:.2f}B ({parts}); {self.quantized_parameters / 1e9:.2f}B quantized",
            f"  checkpoint      {gb(self.source_bytes)} -> {gb(self.checkpoint_bytes)} "
            f"({self.bits_per_weight:.2f} bits per weight)",
            f"  peak memory     host {gb(self.peak_host_bytes)}"
            + (f", device {gb(self.peak_device_bytes)}" if self.device != "cpu" else "")
            + "  (" + ", ".join(f"{k} {gb(v)}" for k, v in self.breakdown.items() if v) + ")",
            f"  disk            {gb(self.disk_bytes)}",
            f"  KV cache        {self.kv_bytes_per_token / 1e3:.1f} KB per token, "
            f"{gb(self.kv_bytes_per_token * self.context)} at {self.context} tokens; serving with "
            f"--kv-cache-gb {self.kv_pool_bytes / (1 << 30):g}: {self.kv_pool_tokens} tokens "
            f"(blocks of {self.kv_block_size})",
            f"  time            ~{_duration(self.estimated_seconds)} (estimate from this machine's measured "
            f"throughput; disk reads assumed {ASSUMED_READ_BYTES_PER_S / 1e9:.1f} GB/s)",
        ]
        return "\n".join(lines)


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def parameters_by_part(model: nn.Module, layers_path: str, attention: str) -> dict[str, int]:
    """Parameter counts of a (meta) model: embeddings, attention, mlp (dense), experts, head, other
    (norms, routers). Tied weights count once."""
    parts = dict.fromkeys(("embeddings", "attention", "mlp", "experts", "head", "other"), 0)
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    seen = set()
    for mname, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if module is emb:
                part = "embeddings"
            elif module is head:
                part = "head"
            elif mname.startswith(layers_path + ".") and f".{attention}." in mname + ".":
                part = "attention"
            elif ".experts." in mname:
                part = "experts"
            elif ".mlp." in mname + "." and isinstance(module, nn.Linear):
                part = "mlp"
            else:
                part = "other"
            parts[part] += p.numel()
    return parts


def kv_bytes_per_token(config, bytes_per_element: float) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(2 * config.num_hidden_layers * heads * head_dim * bytes_per_element)


@dataclass(frozen=True)
class Throughput:
    """What this machine does per second, measured by short probes (about 0.2 s in all)."""

    matmul_flops: float  # in the compute dtype
    rtn_weights: float  # weights per second through round-to-nearest, packing and the report

    @classmethod
    def measure(cls, dtype: torch.dtype) -> "Throughput":
        from quantkit.quant.intq import rtn, sqnr_db
        from quantkit.quant.packing import pack_int32
        from quantkit.quant.schemes import QuantScheme

        a, b = torch.randn(256, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        a @ b
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.08:
            a @ b
            n += 1
        flops = 2 * 256 * 1024 * 1024 * n / (time.perf_counter() - start)
        w = torch.randn(1024, 2048, dtype=dtype)
        scheme = QuantScheme(num_bits=4, group_size=128)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.08:
            qw = rtn(w, scheme, dtype)
            pack_int32(qw.q, 4)
            sqnr_db(w, qw.dequantize(dtype))
            n += 1
        return cls(flops, w.numel() * n / (time.perf_counter() - start))


def make_plan(model: nn.Module, stages: list[Stage], adapter, recipe, *, model_name: str, device: torch.device,
              compute_dtype: torch.dtype, storage_dtype: torch.dtype, checkpoint_bytes: int,
              activation_budget: Optional[int], throughput: Optional[Throughput], nproc: int = 1,
              tokenizer_bytes: int = 0) -> Plan:
    """The plan of quantizing the (meta) `model` with `stages` (see the module docstring)."""
    config = model.config
    layers = adapter.layers(model)
    prefix = adapter.layers_path + "."
    parts = parameters_by_part(model, adapter.layers_path, adapter.attention)
    itemsize = compute_dtype.itemsize
    source = sum(t.numel() * (storage_dtype.itemsize if t.is_floating_point() else t.element_size())
                 for t in _unique_tensors(model))
    quantized = {n for s in stages if s.algorithm.produces_weights for n in s.modules}
    schemes = {n: s.scheme_of(n) for s in stages if s.algorithm.produces_weights for n in s.modules}
    quantized_params = sum(model.get_submodule(n).weight.numel() for n in quantized)

    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    layer0 = f"{prefix}0."
    linears = {n[len(layer0):]: model.get_submodule(n) for n in quantized if n.startswith(layer0)}
    largest = max((m.weight.numel() for m in linears.values()), default=0)
    outside = max((t.numel() * storage_dtype.itemsize for name, t in model.state_dict(keep_vars=True).items()
                   if not name.startswith(prefix)), default=0)

    cal = recipe.calibration
    calibrates = any(s.algorithm.needs_data() for s in stages)
    tokens, share, act, act_held, spill = _activations(cal, calibrates, adapter.needs_bos, nproc, config.hidden_size,
                                                       itemsize, activation_budget)
    work = _quantize_work(linears, schemes, largest, itemsize)
    extra = max((_stage_extra(s, linears, adapter, cal, tokens, config.hidden_size) for s in stages), default=0)
    in_flight = _lockstep_bytes(stages, linears, adapter, int(tokens * share), config.hidden_size, itemsize)
    layer_phase = layer_params * itemsize + act_held + work + extra + in_flight
    process = process_bytes(device)
    base = process + (CALIBRATION_PROCESS_BYTES + TOKENIZER_MEMORY_PER_FILE_BYTE * tokenizer_bytes
                      if calibrates else 0)
    largest_source = max((t.numel() * (storage_dtype.itemsize if t.is_floating_point() else t.element_size())
                          for t in _unique_tensors(model)), default=0)
    scan = process + SCAN_BYTES_PER_PIECE_BYTE * min(largest_source, SCAN_PIECE_BYTES)  # before the work
    outside_cost = outside + min(outside, OUTSIDE_TEMP_BYTES)
    breakdown = {"process": base, "layer": layer_params * itemsize, "activations": act_held,
                 "quantize": work, "solver": extra}
    if in_flight:
        breakdown["batches in flight"] = in_flight  # a true-sequential pass (`calibration.lockstep`)
    host, dev, breakdown = _peaks(device, nproc, scan, base, process, outside_cost, layer_phase,
                                  layer_params * itemsize, breakdown)

    kv_elem = 1.0 if any(s.spec.algorithm == "kv_cache" for s in stages) else float(itemsize)  # FP8 cache: 1 byte
    seconds, rates = _estimate(stages, adapter, layers, linears, tokens, source, quantized_params, throughput, cal,
                               layer_params)
    if seconds is not None and nproc > 1:
        seconds /= nproc  # ideal sharing of the forwards and solves (each rank also reads every layer)
    return Plan(
        model=model_name, recipe=recipe.name, device=str(device), compute_dtype=str(compute_dtype).removeprefix("torch."),
        storage_dtype=str(storage_dtype).removeprefix("torch."), parameters=parts, source_bytes=source,
        checkpoint_bytes=checkpoint_bytes, quantized_parameters=quantized_params, peak_host_bytes=int(host),
        peak_device_bytes=int(dev), disk_bytes=int(disk_needed(checkpoint_bytes, act, spill)), activation_bytes=int(act),
        kv_bytes_per_token=kv_bytes_per_token(config, kv_elem),
        context=int(getattr(config, "max_position_embeddings", 0) or 0), estimated_seconds=seconds, nproc=nproc, breakdown={k: int(v) for k, v in breakdown.items()}, throughput=rates)


def _activations(cal, calibrates: bool, needs_bos: bool, nproc: int, hidden: int, itemsize: int,
                 budget: Optional[int]) -> tuple[int, float, int, int, int]:
    """(calibration tokens, this rank's share of the batches, activation bytes of one layer's inputs, bytes
    held in memory (inputs and outputs of a layer, within the budget), bytes spilled to disk)."""
    tokens = cal.num_samples * (cal.seq_len + (1 if needs_bos else 0)) if calibrates else 0
    # nproc ranks (`quantkit.calibration.distributed`): each holds its share of the batches' activations
    batches = math.ceil(cal.num_samples / cal.batch_size)
    share = math.ceil(batches / nproc) / batches if calibrates else 0
    act = int(tokens * share) * hidden * itemsize
    held = min(2 * act, budget) if budget is not None else 2 * act
    return tokens, share, act, held, max(0, 2 * act - held)


def _quantize_work(linears: dict, schemes: dict, largest: int, itemsize: int) -> int:
    """Bytes of one linear's quantization: float32 copies of the largest weight, its dequantized form, and the
    codes and packed words of the layer's linears."""
    if not linears:
        return 0
    bits = max(sc.num_bits for sc in schemes.values())
    codes = sum(m.weight.numel() for m in linears.values()) * (1 + bits / 8)  # int8 codes + packed words
    return int(largest * (4 + (4 if itemsize < 4 else 0) + itemsize) + codes)


def _peaks(device: torch.device, nproc: int, scan: int, base: int, process: int, outside_cost: int, layer_phase: int,
           layer_bytes: int, breakdown: dict) -> tuple[int, int, dict]:
    """(peak host bytes, peak device bytes, the breakdown of the larger phase): the NaN/Inf scan before the work,
    the tensors outside the decoder layers, or a layer's quantization, whichever is largest."""
    if device.type == "cpu":  # every rank on this host
        host = nproc * max(scan, base + max(outside_cost, layer_phase))
        dev = 0
    else:  # one device per rank
        host = nproc * max(scan, base + max(outside_cost, layer_bytes))
        dev = layer_phase
    if outside_cost > layer_phase:
        breakdown = {"process": base, "largest outside tensor": outside_cost}
    if scan > base + max(outside_cost, layer_phase):
        breakdown = {"process": process, "scan of the source for NaN/Inf": scan - process}
    return host, dev, breakdown


def disk_needed(checkpoint_bytes: int, activation_bytes: int, spill_bytes: int) -> int:
    """Disk of a layer-by-layer run: the run's resumable state (every finished layer's tensors, and the
    activations at the last layer boundary, written beside the previous copy before it is replaced,
    `quantkit.flow.resume`), the output assembled from it, and calibration activations spilled past the budget."""
    return 2 * checkpoint_bytes + 2 * activation_bytes + spill_bytes


def _unique_tensors(model: nn.Module):
    """The checkpoint's tensors: the state dict (persistent buffers only), tied ones once."""
    seen = set()
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _groups_of(linears: dict[str, nn.Module], adapter) -> list[list[nn.Module]]:
    groups, seen = [], set()
    for group in adapter.linear_groups:
        found = [linears[n] for n in group if n in linears]
        if found:
            groups.append(found)
            seen.update(n for n in group if n in linears)
    return groups + [[m] for n, m in linears.items() if n not in seen]


def _stage_extra(stage: Stage, linears: dict[str, nn.Module], adapter, cal, tokens: int, hidden: int) -> int:
    """Bytes a stage holds beyond the layer and the quantize step, in the worst moment of a layer."""
    name = stage.spec.algorithm
    groups = _groups_of(linears, adapter)
    if not groups:
        return 0
    widths = [g[0].in_features for g in groups]
    if name == "gptq":
        # solving group k: the Hessians of groups k and later (earlier ones are freed; group k's own waits on
        # disk when it is at least park_hessian_bytes), one n_k^2 copy that is factorized and inverted in
        # place, and the float32 working copy of the group's stacked weight
        # (true-sequential: the later groups' Hessians are not summed yet when group k is solved)
        limit = getattr(stage.algorithm.config, "park_hessian_bytes", None)
        parked = [limit is not None and 4 * n * n >= limit for n in widths]
        one_by_one = stage.algorithm.true_sequential()
        return max((0 if one_by_one else sum(4 * n * n for n in widths[k + 1:]))
                   + (0 if parked[k] else 4 * widths[k] ** 2)
                   + 4 * widths[k] ** 2 + 4 * widths[k] * sum(m.out_features for m in groups[k])
                   for k in range(len(groups)))
    if name == "awq":
        samples = min(stage.algorithm.config.search_samples, cal.num_samples)
        recorded = samples * cal.seq_len * sum(widths) * 4  # inputs of each group, float32, for the search
        clip = sum(4 * n * n for n in widths) if stage.algorithm.config.clip else 0
        return recorded + clip
    return 0


def _lockstep_bytes(stages, linears: dict[str, nn.Module], adapter, tokens: int, hidden: int, itemsize: int) -> int:
    """A true-sequential stage's single forward holds every batch's forward in flight at once
    (`calibration.lockstep`): per token about the residual, the block's input and the widest group
    input (an MLP intermediate), beyond the activations; these never spill."""
    if not any(s.algorithm.needs_data() and s.algorithm.true_sequential() for s in stages):
        return 0
    widths = [g[0].in_features for g in _groups_of(linears, adapter)]
    return tokens * (2 * hidden + max(widths, default=hidden)) * itemsize


def _estimate(stages, adapter, layers, linears, tokens, source_bytes, quantized_params, tp: Optional[Throughput], cal,
              layer_params) -> tuple[float, dict]:
    """Seconds: reading the source twice (NaN check, load), quantizing every weight, and for calibrating
    stages the layer forwards and solves as FLOPs at the measured matmul rate."""
    if tp is None:
        return float("nan"), {}
    n_layers = len(layers)
    seconds = 2 * source_bytes / ASSUMED_READ_BYTES_PER_S + quantized_params / tp.rtn_weights
    for stage in stages:
        name = stage.spec.algorithm
        if not stage.algorithm.needs_data():
            continue
        forward = 2 * layer_params * tokens * n_layers  # one layer forward over all calibration tokens
        # calibration forward + next-inputs forward; one lock-step forward for a true-sequential stage
        seconds += (1 if stage.algorithm.true_sequential() else 2) * forward / tp.matmul_flops
        if name == "gptq":
            per_layer = 0.0
            for g in _groups_of(linears, adapter):
                n, out = g[0].in_features, sum(m.out_features for m in g)
                per_layer += tokens * n * n + n ** 3 + 2 * out * n * n  # Hessian, factor + inverse, column loop
            seconds += n_layers * per_layer / tp.matmul_flops
        elif name == "awq":
            grid = stage.algorithm.config.n_grid * (2 if stage.algorithm.config.duo_scaling == "both" else 1)
            samples = min(stage.algorithm.config.search_samples, cal.num_samples) * cal.seq_len
            seconds += n_layers * grid * 2 * layer_params * samples / tp.matmul_flops
    return seconds, {"matmul_gflops": round(tp.matmul_flops / 1e9, 1),
                     "rtn_mweights_per_s": round(tp.rtn_weights / 1e6, 1),
                     "assumed_read_gb_per_s": ASSUMED_READ_BYTES_PER_S / 1e9}
