"""`quantkit.load`: build a model from a checkpoint directory, quantized modules included.

The inverse of `quantkit.checkpoints.export`, used alike by the quantize job (its source model), eval and
the runner. The model skeleton is built with empty (meta) parameters, quantized linears are
swapped in as the checkpoint's `quantization_config` says, then every tensor is assigned from
safetensors. The kernel request (QUANTKIT_KERNEL) is read while loading, by each quantized linear as it is
made, and recorded in the `runtime.state.RuntimeState` the model carries for the runner.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Optional, Union

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from quantkit.platform import compute, devices
from quantkit.plugins.catalog import architecture_names, checkpoint_namer, find_adapter
from quantkit.arch.moe import unfuse_experts
from quantkit.errors import CheckpointError
from quantkit.checkpoints.finite import find_nonfinite
from quantkit.formats.checkpoint import IGNORED_EXTRA_KEYS, checkpoint_dtype, iter_tensors, read_config
from quantkit.checkpoints import foreign as foreign_ckpt
from quantkit.checkpoints.quantization_config import QuantizedLayout, parse_quantization_config
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.checkpoints.resolve import resolve_model
from quantkit.kernels.select import forced_kernel
from quantkit.kernels.wide_matmul import wrap_forward
from quantkit.qmodules.fp8_linear import plan_dense_cache
from quantkit.qmodules.kv import attention_modules
from quantkit.qmodules import online_rotation
from quantkit.runtime import offload as offload_mod
from quantkit.runtime import decode_plan
from quantkit.runtime.state import RuntimeState

log = logging.getLogger(__name__)


def load(path: Union[str, Path, None], dtype: Union[torch.dtype, str, None] = None,
         device: Union[str, torch.device, None] = "cpu", offload: Optional[str] = "none",
         workload: str = "batch", remeasure: bool = False, finite: bool = True) -> PreTrainedModel:
    """Load a plain or compressed-tensors checkpoint onto `device` (cpu by default; "auto" takes CUDA when
    present, `quantkit.platform.devices`; a device asked for and missing is an error).

    dtype: compute dtype of the float parameters: a torch dtype, a name, or None / "auto" for the
    machine's fast dtype that holds the checkpoint's weights exactly (`quantkit.platform.compute`; bf16 only
    where the CPU computes it fast). Quantized modules keep their packed integers and stored scales
    whatever the dtype. The choice is kept as `model.quantkit_compute`, the device as `model.quantkit_device`.

    offload: "none" (default) loads every tensor; "disk" keeps the decoder layers in the checkpoint and
    loads each just before it runs (`runtime.offload`: memory for one layer, much slower); "auto" offloads
    only a model that would not fit in memory. The choice is kept as `model.quantkit_offload`.

    workload: what the model is for: "batch" (eval, calibration: GEMMs; exact kernels) or "decode"
    (generate, chat: one token at a time). On a CPU, decode is planned by timing the model's own layer
    kinds in each candidate dtype and kernel (`runtime.decode_plan`, cached per machine; `remeasure`
    times them again); the plan is kept as `model.quantkit_decode_plan` (None for batch).

    finite: refuse a checkpoint whose tensors hold NaN or Inf, naming them (the quantize job checks its source
    itself, to offer --zero-nonfinite).
    """
    if workload not in compute.WORKLOADS:
        raise ValueError(f"workload {workload!r}: use one of {', '.join(compute.WORKLOADS)}")
    where = devices.resolve(device, "device")
    path, plan, stored, config, foreign = _describe(path)
    # (offloaded to disk, only one layer is ever in memory: float32 then always fits)
    fits = (lambda: True) if offload_mod.mode_of(offload) == "disk" else (lambda: _fits_in_float32(path))
    kinds = (lambda: _layer_kinds(config, plan, stored)) if workload == "decode" else None
    choice, decode = compute_choice(dtype, stored, where.device, workload, float32_fits=fits, kinds=kinds,
                                    remeasure=remeasure)
    model, adapter, quantized = _skeleton(path, config, plan, choice.dtype)
    # decode reads every weight once per token: from the process's own memory (`_assign_tensors`), not the file's
    offloading = _fill(model, path, adapter, quantized, choice, stored, offload, where,
                       own=workload == "decode" and where.device.type == "cpu", finite=finite, foreign=foreign)
    model.eval()
    model.requires_grad_(False)  # an inference model: no autograd bookkeeping, and the decode step may fuse weights
    if decode is not None:
        decode_plan.apply(model, decode)
    if not offloading.offloaded:  # offloaded layers prepare their kernels at each load
        prepare_kernels(model, choice.dtype)
    model.quantkit_source = str(path)
    model.quantkit_offload = offloading
    model.quantkit_compute = choice
    model.quantkit_decode_plan = decode
    wrap_forward(model, choice)  # a 16-bit dtype this CPU is slow in: the model's matmuls on float32 GEMMs
    model.quantkit_device = where
    # the kernel request the quantized linears took when they were made (QUANTKIT_KERNEL), for the runner
    model.quantkit_runtime = RuntimeState(kernel=forced_kernel())
    log.info("%s: %s", path, choice.describe())
    return model


def _describe(path: Union[str, Path, None]):
    """A checkpoint's resolved path, quantization plan (None: not quantized), stored dtype, transformers
    config (without its quantization_config: quantkit builds quantized modules itself) and, for a GPTQ or AWQ
    checkpoint, its translation into compressed-tensors (`checkpoints.foreign`; None otherwise)."""
    path = resolve_model(None if path is None else str(path))
    raw = read_config(path)
    qc = raw.get("quantization_config")
    foreign = foreign_ckpt.scan(path, qc) if foreign_ckpt.method_of(qc) else None
    if foreign is not None:
        qc = foreign.compressed_tensors_config()
    plan = parse_quantization_config(qc, f"{path}/config.json") if qc else None
    config = model_config(path, raw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return path, plan, checkpoint_dtype(raw), config, foreign


def decode_plan_for(path: Union[str, Path, None], dtype: Union[torch.dtype, str, None] = None,
                    remeasure: bool = False) -> tuple[compute.ComputeChoice, decode_plan.DecodePlan]:
    """What `load(path, dtype, workload="decode")` would choose on this CPU, from the config alone
    (nothing loaded): the compute choice and the decode plan (`remeasure`: time every figure again)."""
    path, plan, stored, config, _ = _describe(path)
    return compute_choice(dtype, stored, torch.device("cpu"), "decode", lambda: _fits_in_float32(path),
                          lambda: _layer_kinds(config, plan, stored), remeasure)


def _skeleton(path: Path, config, plan: Optional[QuantizedLayout], dtype: torch.dtype):
    """The model with empty (meta) parameters in `dtype`, quantized linears swapped in. Returns (model,
    its architecture adapter or None, the names of the quantized linears)."""
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as exc:
            raise CheckpointError(f"{path}: transformers cannot build this model: {exc}") from None
    unfuse_experts(model)  # MoE: one linear per expert, named as in the checkpoint
    quantized = _swap_quantized_modules(model, plan, dtype) if plan else set()
    try:
        online_rotation.attach_from_config(model, plan.transforms if plan else None, checkpoint_namer(model))
    except ValueError as exc:
        raise CheckpointError(f"{path}/config.json: {exc}") from None
    if plan and plan.kv_cache_strategy:
        _add_kv_scale_slots(model, plan.kv_cache_strategy)
    return model, find_adapter(config.model_type), quantized


def _fill(model: nn.Module, path: Path, adapter, quantized: set[str], choice: compute.ComputeChoice,
          stored: torch.dtype, offload: Optional[str], where: devices.DeviceChoice,
          own: bool = False, finite: bool = True, foreign=None) -> offload_mod.OffloadChoice:
    """Assign the checkpoint's tensors to the skeleton (the decoder layers left on disk when offloading)
    and move it to its device (`own`: in-memory tensors copied out of the mapped file; `foreign`: a GPTQ / AWQ
    checkpoint's translated tensors instead of the files'). Returns the offload choice."""
    dtype = choice.dtype
    to_module = adapter.to_module_name if adapter else (lambda name: name)
    ckpt = LazyCheckpoint(path, to_module)
    owner_quantized = quantized.__contains__
    try:
        offloading = offload_mod.choose(offload, offload_mod.in_memory_bytes(ckpt, dtype, owner_quantized))
    except offload_mod.DoesNotFitError as exc:
        half = ([f"--dtype {str(stored).removeprefix('torch.')} keeps its weights as stored, in half the memory"]
                if dtype == torch.float32 and stored.itemsize == 2 else [])
        raise offload_mod.DoesNotFitError(f"{path} ({choice.describe()}): {exc.what}", exc.fixes + half) from None
    if offloading.offloaded and foreign is not None:
        raise offload_mod.OffloadError(f"{path}: --offload disk reads compressed-tensors checkpoints; convert this "
                                       f"{foreign.config.method.upper()} one first: quantkit convert "
                                       f"{foreign.config.method} {path} -o DIR")
    if offloading.offloaded:
        if adapter is None:
            raise offload_mod.OffloadError(f"{path}: --offload disk needs an architecture quantkit knows "
                                           f"(model_type {model.config.model_type!r} has no adapter)")
        offloader = offload_mod.DiskOffload(model, ckpt, adapter.layers_path, owner_quantized, dtype, where.device)
        skip = offloader.offloaded_keys
        if finite:  # the layers left on disk, a piece at a time (the resident tensors are checked as assigned)
            _refuse_nonfinite(path, ((ckpt.stored_name(k), t) for k, t in ckpt.pieces() if k in skip))
        resident = ((ckpt.stored_name(k), ckpt.get(k)) for k in ckpt.keys() if k not in skip)
        _assign_tensors(model, path, quantized, dtype, to_module, resident, elsewhere=skip, own=own, finite=finite)
        model.quantkit_offloader = offloader
    else:
        _assign_tensors(model, path, quantized, dtype, to_module, foreign.tensors() if foreign else None, own=own,
                        finite=finite)
    try:
        online_rotation.check_matrices(model)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if where.is_accelerator:
        offload_mod.move_resident(model, where.device)  # offloaded slots stay on meta until their layer runs
    return offloading


def _refuse_nonfinite(path: Path, tensors) -> None:
    """Refuse a checkpoint holding NaN or Inf in any of `tensors` ((stored name, tensor or piece) pairs; float
    ones: scales, weights, FP8 codes), naming them: every command that loads it would compute garbage from it
    (eval would show a NaN perplexity, generate would go on producing text)."""
    bad = find_nonfinite(tensors)
    if bad:
        listing = ", ".join(f"{name} ({count} of {numel})" for name, count, numel in bad[:6]) + \
            (" ..." if len(bad) > 6 else "")
        raise CheckpointError(f"{path}: NaN/Inf values in {len(bad)} tensor(s): {listing}; the checkpoint is damaged. "
                              "Re-create it from its source (quantize refuses non-finite source weights, or zeroes "
                              "them with --zero-nonfinite)")


def compute_choice(dtype: Union[torch.dtype, str, None], storage: torch.dtype, device: torch.device,
                   workload: str = "batch", float32_fits=None, kinds=None,
                   remeasure: bool = False) -> tuple[compute.ComputeChoice, Optional[decode_plan.DecodePlan]]:
    """The compute choice, and for the decode workload on a CPU the decode plan (None otherwise).

    kinds: a function giving the model's layer kinds (`decode_plan.layer_kinds`), called only when a plan
    is made. An automatic choice plans among every dtype that holds the checkpoint exactly (its own 16
    bits only when float32 would not fit), narrowed int4 activations allowed; a dtype asked for is kept
    and only its kernels are planned."""
    if isinstance(dtype, torch.dtype):
        base = compute.asked_for(dtype, storage, device, f"dtype={str(dtype).removeprefix('torch.')} asked for",
                                 "setting")
    else:
        base = compute.choose(storage, device, dtype or "auto", "dtype", float32_fits=float32_fits)
    if workload != "decode" or torch.device(device).type != "cpu" or kinds is None:
        return base, None
    auto = base.source == "auto"
    if auto:
        fits = float32_fits is None or float32_fits()
        dtypes = compute.exact_dtypes(storage) if fits else (base.dtype,)
    else:
        dtypes = (base.dtype,)
    plan = decode_plan.choose(kinds(), dtypes, narrowing=auto, remeasure=remeasure)
    if not auto:
        return replace(base, reason=f"{base.reason}; {plan.describe()}"), plan
    dtype = plan.choice.dtype
    reason = f"{base.reason}; {plan.describe()}: {plan.choice.describe()}"
    return compute.ComputeChoice(dtype, base.device, reason, "auto",
                                 wide_matmuls=compute.needs_wide_matmuls(dtype, device)), plan


def _layer_kinds(config, plan: Optional[QuantizedLayout], stored: torch.dtype) -> dict:
    """The layer kinds of the model `config` and `plan` describe (quantized linears as they will load, with
    scales in the checkpoint's dtype), from a skeleton that holds no tensors at all."""
    with init_empty_weights(include_buffers=True):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=stored)
    unfuse_experts(skeleton)
    if plan:
        with torch.device("meta"):
            _swap_quantized_modules(skeleton, plan, stored)
    return decode_plan.layer_kinds(skeleton.modules())


def _fits_in_float32(path: Path) -> bool:
    """Whether the checkpoint's tensors, every float one as float32, fit in memory by the rule of
    `--offload auto` (`runtime.offload.choose`): from the safetensors headers, nothing read."""
    from quantkit.platform.memory import available_memory

    total = offload_mod.in_memory_bytes(LazyCheckpoint(path, lambda name: name), torch.float32, lambda owner: False)
    return not offload_mod.choose("auto", total, available=available_memory()).offloaded


def model_config(path: Path, raw: dict):
    """transformers' config for the checkpoint; never with trust_remote_code, so an architecture
    transformers does not know is a clear error here. The fields quantkit reads are checked first
    (`formats.model_config`), with the MLP's width required for the architectures quantkit quantizes."""
    from quantkit.formats import model_config as fields

    fields.check(raw, path / "config.json", known_types=tuple(architecture_names()))
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        model_type = raw.get("model_type", "?")
        remote = " (its config points at remote code, which quantkit never runs)" if raw.get("auto_map") else ""
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not an architecture this transformers knows{remote}; "
            f"quantkit runs transformers' built-in architectures, and quantizes {', '.join(architecture_names())}"
            f" ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc


def prepare_kernels(model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Choose each quantized linear's kernel for its device and `dtype` inputs and repack its weight
    now rather than at the first forward; let emulated FP8 layers keep dense weights where they fit
    (`plan_dense_cache`). Returns how many int modules use each kernel."""
    counts: dict[str, int] = {}
    for module in model.modules():
        prepare = getattr(module, "prepare", None)
        if callable(prepare) and hasattr(module, "weight_packed"):
            name = prepare(module.weight_packed.device, dtype)
            counts[name] = counts.get(name, 0) + 1
    if counts:
        log.info("quantized linears by kernel: %s", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    dense = plan_dense_cache(model, dtype)  # emulated FP8 layers: keep dequantized weights if they fit
    if dense:
        log.info("emulated FP8 layers keep dequantized weights (%.2f GB)", dense / 1e9)
    return counts


def _swap_quantized_modules(model: nn.Module, plan: QuantizedLayout, dtype: torch.dtype) -> set[str]:
    swapped = set()
    ckpt = checkpoint_namer(model)  # the config's targets/ignore use checkpoint names
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        group = plan.lookup(ckpt(name), module)
        if group is None:
            continue
        new = group.format.empty_module(module, group.scheme, dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.add(name)
    if not swapped and plan.groups:
        raise CheckpointError("quantization_config matches no Linear module of this model")
    return swapped


def _add_kv_scale_slots(model: nn.Module, strategy: str) -> None:
    """Buffers k_scale / v_scale on every attention module, for the checkpoint's KV-cache scales."""
    modules = attention_modules(model)
    if not modules:
        raise CheckpointError("the checkpoint has kv_cache_scheme but this model has no attention modules "
                              "with k_proj / v_proj to hold k_scale / v_scale")
    for attn in modules.values():
        k_proj = attn.k_proj
        heads = k_proj.out_features // attn.head_dim if strategy == "attn_head" else 1
        for name in ("k_scale", "v_scale"):
            attn.register_buffer(name, torch.ones(heads))


def _assign_tensors(model: nn.Module, path: Path, quantized: set[str], dtype: torch.dtype, to_module,
                    tensors=None, elsewhere: frozenset[str] | set[str] = frozenset(), own: bool = False,
                    finite: bool = False) -> None:
    """Assign the checkpoint's tensors ((stored name, tensor) pairs; all of `path` by default); the
    slots in `elsewhere` are filled later (offloaded layers) and were checked by their owner.

    own: copy every tensor the file maps (safetensors' tensors are views of the mapped file) into the process's
    own memory (huge pages, `quantkit.platform.allocator`): one-token GEMVs read those faster (an AMX Xeon, Gemma 3's
    262144 x 640 bf16 head by torch.mv: 30 ms mapped, 22 ms copied, interleaved runs).
    finite: refuse NaN/Inf in any of them, naming them, before anything is assigned."""
    expected = dict(model.state_dict(keep_vars=True))
    loaded: dict[str, torch.Tensor] = {}
    as_stored: list[tuple[str, torch.Tensor]] = []  # (stored name, tensor as read): what the finite check reads
    unexpected = []
    for stored_key, tensor in (iter_tensors(path) if tensors is None else tensors):
        key = to_module(stored_key)
        if key not in expected:
            if not key.endswith(IGNORED_EXTRA_KEYS):
                unexpected.append(stored_key)
            continue
        owner = key.rpartition(".")[0]
        stored = tensor
        as_stored.append((stored_key, stored))
        if tensor.is_floating_point() and owner not in quantized:
            tensor = tensor.to(dtype)  # quantized modules keep their stored scale dtype
        if own and tensor.data_ptr() == stored.data_ptr():
            tensor = tensor.clone()
        _check_shape(key, tensor, expected[key], owner in quantized)
        loaded[key] = tensor
    if unexpected:
        raise CheckpointError(f"{path}: tensors that this model does not have: {', '.join(unexpected[:8])}"
                              + (" ..." if len(unexpected) > 8 else ""))
    if finite:
        _refuse_nonfinite(path, as_stored)
    model.load_state_dict(loaded, strict=False, assign=True)
    _tie_embeddings(model)
    # every slot must come from the file (directly, or by tying to a loaded tensor): quantized
    # modules' buffers exist on CPU already, so "still on meta" alone would miss them
    loaded_ptrs = {t.data_ptr() for t in loaded.values()}
    missing = [k for k, v in model.state_dict(keep_vars=True).items()
               if k not in loaded and k not in elsewhere and (v.device.type == "meta" or v.data_ptr() not in loaded_ptrs)]
    if missing:
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))


def _check_shape(key: str, tensor: torch.Tensor, slot: torch.Tensor, quantized: bool) -> None:
    if tensor.shape != slot.shape:
        raise CheckpointError(f"tensor {key}: shape {tuple(tensor.shape)} in the checkpoint, "
                              f"{tuple(slot.shape)} expected by the config")
    if quantized and not tensor.is_floating_point() and tensor.dtype != slot.dtype:
        raise CheckpointError(f"tensor {key}: dtype {tensor.dtype} in the checkpoint, {slot.dtype} expected")


def _tie_embeddings(model: PreTrainedModel) -> None:
    out = model.get_output_embeddings()
    if out is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    if isinstance(out, nn.Linear) and out.weight.device.type == "meta":
        out.weight = model.get_input_embeddings().weight


def load_tokenizer(path: Union[str, Path, None]):
    """The tokenizer saved beside a checkpoint."""
    path = resolve_model(None if path is None else str(path))
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise CheckpointError(f"{path}: no usable tokenizer ({type(exc).__name__}: {exc})") from exc
