"""Disk offload for inference (`--offload disk`): a model whose decoder layers live on disk.

Everything outside the decoder layers (embeddings, final norm, LM head) and the layers' tiny KV-cache
scales are loaded as usual. Each decoder layer's other tensors stay in the checkpoint: a forward
pre-hook reads them (plain file reads, `formats.lazy`) onto the compute device just before the layer
runs, and a forward hook empties the layer again (meta) right after, with any kernel repacking or
dense copy its quantized modules made. Memory holds one layer at a time; every forward reads the
whole model from disk (the page cache helps when it can), so this is for models that do not fit.

`auto` offloads only when the model in memory would take more than `FIT_SHARE` of the available
memory, and says so. `none` loads it whole, but a model larger than the available memory and free
swap together is an error naming `--offload auto` (it could only end in the kernel's OOM kill).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.errors import CheckpointError
from quantkit.formats.checkpoint import IGNORED_EXTRA_KEYS
from quantkit.formats.lazy import LazyCheckpoint
from quantkit.platform.memory import available_memory, free_swap

log = logging.getLogger(__name__)

MODES = ("none", "disk", "auto")
FIT_SHARE = 0.8  # auto: offload when the loaded model would take more than this share of the available memory
RESIDENT_SUFFIXES = ("k_scale", "v_scale")  # per-layer tensors small enough to keep (the FP8 KV cache reads them)


class OffloadError(CheckpointError):
    """--offload names no mode, or the model cannot be offloaded."""


class DoesNotFitError(OffloadError):
    """Loading whole a model larger than the available memory and free swap together: `what` says so, `fixes`
    are the ways out (the caller adds its own)."""

    def __init__(self, what: str, fixes: list[str]):
        self.what, self.fixes = what, fixes
        super().__init__(f"{what}: {'; or '.join(fixes)}")


@dataclass(frozen=True)
class OffloadChoice:
    mode: str  # "none" or "disk"
    reason: str
    model_bytes: int  # the model's tensors in memory as loaded whole (compute dtype)

    @property
    def offloaded(self) -> bool:
        return self.mode == "disk"

    def describe(self) -> str:
        return f"offload {self.mode}: {self.reason}"


def in_memory_bytes(ckpt: LazyCheckpoint, compute_dtype: torch.dtype, quantized_owner: Callable[[str], bool]) -> int:
    """Bytes the checkpoint's tensors take once loaded: floats of unquantized modules in the compute dtype,
    everything else as stored."""
    total = 0
    for key in ckpt.keys():
        dtype, shape = ckpt.info(key)
        n = 1
        for d in shape:
            n *= d
        cast = dtype.is_floating_point and dtype.itemsize >= 2 and not quantized_owner(key.rpartition(".")[0])
        total += n * (compute_dtype.itemsize if cast else dtype.itemsize)
    return total


def mode_of(mode: Optional[str]) -> str:
    """An --offload value as one of MODES (None: "none"; case and spaces ignored), or OffloadError."""
    normal = (mode or "none").strip().lower()
    if normal not in MODES:
        raise OffloadError(f"--offload {normal!r}: use one of {', '.join(MODES)}")
    return normal


def choose(mode: Optional[str], model_bytes: int, available: Optional[int] = None) -> OffloadChoice:
    """none / disk as asked; auto: disk only when the whole model would not fit."""
    mode = mode_of(mode)
    gb = model_bytes / 1e9
    if mode == "none":  # loaded whole as asked, unless it cannot fit even with the swap: an error, not an OOM kill
        room, swap = (available_memory() if available is None else available), free_swap()
        if room is not None and model_bytes > room + swap:
            raise DoesNotFitError(f"the model takes {gb:.2f} GB in memory, more than the {room / 1e9:.2f} GB "
                                  f"available (and {swap / 1e9:.2f} GB of free swap)",
                                  ["--offload auto (or disk) loads its decoder layers from disk one at a time"])
    if mode != "auto":
        return OffloadChoice(mode, "asked for" + (f" (model {gb:.2f} GB in memory)" if mode == "none" else ""),
                             model_bytes)
    available = available_memory() if available is None else available
    if available is None or model_bytes <= FIT_SHARE * available:
        return OffloadChoice("none", f"the model ({gb:.2f} GB) fits in memory", model_bytes)
    return OffloadChoice("disk", f"the model takes {gb:.2f} GB, more than {FIT_SHARE:.0%} of the "
                                 f"{available / 1e9:.2f} GB available: its layers load from disk one at a time "
                                 "(slower; --offload none to load it whole)", model_bytes)


class DiskOffload:
    """Hooks that load each decoder layer from `ckpt` just before it runs and empty it right after."""

    def __init__(self, model: nn.Module, ckpt: LazyCheckpoint, layers_path: str, quantized_owner: Callable[[str], bool],
                 dtype: torch.dtype, device: torch.device):
        self.ckpt, self.dtype, self.device, self.quantized_owner = ckpt, dtype, device, quantized_owner
        self.layers: nn.ModuleList = model.get_submodule(layers_path)
        self.prefixes = [f"{layers_path}.{i}." for i in range(len(self.layers))]
        expected = model.state_dict(keep_vars=True)
        self.keys: dict[int, list[str]] = {}
        for i, prefix in enumerate(self.prefixes):
            self.keys[i] = [k for k in expected if k.startswith(prefix) and not k.endswith(RESIDENT_SUFFIXES)]
        self._check(expected)
        self.loads = 0  # layer loads so far (for tests and progress)
        for i, layer in enumerate(self.layers):
            self._release(i)
            layer.register_forward_pre_hook(self._pre_hook(i))
            layer.register_forward_hook(self._post_hook(i))

    @property
    def offloaded_keys(self) -> set[str]:
        return {k for keys in self.keys.values() for k in keys}

    def _check(self, expected: dict[str, torch.Tensor]) -> None:
        """Every offloaded slot is in the checkpoint with its shape, and the layers hold nothing else:
        checked from the headers now, not at the first forward."""
        missing, wrong = [], []
        for key in self.offloaded_keys:
            if key not in self.ckpt:
                missing.append(self.ckpt_name(key))
                continue
            _, shape = self.ckpt.info(key)
            if tuple(shape) != tuple(expected[key].shape):
                wrong.append(f"{self.ckpt_name(key)} {tuple(shape)} (expected {tuple(expected[key].shape)})")
        unexpected = [self.ckpt.stored_name(k) for k in self.ckpt.keys()
                      if k.startswith(tuple(self.prefixes)) and k not in expected and not k.endswith(IGNORED_EXTRA_KEYS)]
        if missing or wrong or unexpected:
            parts = ([f"tensors missing from the checkpoint: {', '.join(sorted(missing)[:8])}"] if missing else []) + \
                    ([f"shapes that differ from the config: {', '.join(sorted(wrong)[:4])}"] if wrong else []) + \
                    ([f"tensors that this model does not have: {', '.join(unexpected[:8])}"] if unexpected else [])
            raise CheckpointError(f"{self.ckpt.path}: " + "; ".join(parts))

    def ckpt_name(self, key: str) -> str:
        return self.ckpt.stored_name(key) if key in self.ckpt else key

    def _pre_hook(self, index: int):
        def hook(_module, _args):
            self._load(index)
        return hook

    def _post_hook(self, index: int):
        def hook(_module, _args, _output):
            self._release(index)
        return hook

    def _load(self, index: int) -> None:
        layer, prefix = self.layers[index], self.prefixes[index]
        state = {}
        for key in self.keys[index]:
            t = self.ckpt.get(key)
            if t.is_floating_point() and t.element_size() >= 2 and not self.quantized_owner(key.rpartition(".")[0]):
                t = t.to(self.dtype)  # quantized modules keep their stored scale dtype
            state[key[len(prefix):]] = t.to(self.device)
        layer.load_state_dict(state, strict=False, assign=True)
        self.loads += 1

    def _release(self, index: int) -> None:
        """Put the layer's offloaded tensors back on meta and drop what its modules derived from them."""
        layer, prefix = self.layers[index], self.prefixes[index]
        offloaded = set(self.keys[index])
        for mname, module in layer.named_modules():
            base = prefix + (mname + "." if mname else "")
            for name, p in list(module._parameters.items()):
                if p is not None and base + name in offloaded and not p.is_meta:
                    module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None and base + name in offloaded and not b.is_meta:
                    module._buffers[name] = b.to("meta")
            for cache in ("_prepared", "_dense"):  # int kernels' repacked weights, FP8's dense copies
                if getattr(module, cache, None) is not None:
                    setattr(module, cache, None)



def move_resident(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)` for every tensor that is not on meta (offloaded layers' slots stay there)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.is_meta:
                module._parameters[name] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to(device)
