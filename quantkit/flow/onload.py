"""Layer-by-layer onloading for the quantize job: neither the float nor the quantized model is ever
whole in memory.

The model is an empty (meta) skeleton. A decoder layer's tensors are read from the checkpoint
(plain file reads, `formats.lazy`) just before its turn (`load_layer`); once quantized, its tensors go to the output
shards and the layer is emptied again (`finish_layer`). Tensors outside the decoder layers
(embeddings, final norm, LM head) are copied one by one, before and after the layers in state-dict
order, so the shards hold exactly what a whole-model export of the same model would write.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from quantkit.arch.adapter import ArchitectureAdapter
from quantkit.arch.moe import unfuse_experts
from quantkit.errors import CheckpointError
from quantkit.platform.compute import holds_exactly
from quantkit.checkpoints.export import as_stored_exactly, fixed_dtype_keys
from quantkit.checkpoints.finite import check_output, find_nonfinite, refuse_or_zero, zero_nonfinite
from quantkit.formats.checkpoint import IGNORED_EXTRA_KEYS, ShardWriter
from quantkit.formats.lazy import LazyCheckpoint

log = logging.getLogger(__name__)


def skeleton(config, dtype: torch.dtype) -> PreTrainedModel:
    """The model with every parameter on meta (no memory), MoE experts as one linear each."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unfuse_experts(model)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # from_config leaves a meta model untied
    model.eval()
    model.requires_grad_(False)
    return model


class OnloadedModel:
    """The pipeline's layer store (see `pipeline.quantize_model`) for a skeleton over a checkpoint."""

    def __init__(self, model: PreTrainedModel, source: Path, adapter: ArchitectureAdapter, dtype: torch.dtype,
                 storage_dtype: torch.dtype):
        self.model, self.adapter, self.dtype, self.storage = model, adapter, dtype, storage_dtype
        self.rounded = not holds_exactly(dtype, storage_dtype)  # the compute dtype rounds the stored weights
        self.ckpt = LazyCheckpoint(source, adapter.to_module_name)
        self.zeroed: set[str] = set()
        self.writer: ShardWriter | None = None
        self._hooks: list = []  # the embedding's row readers while calibrating
        self.namer = adapter.to_checkpoint_name
        layers = adapter.layers_path + "."
        self.head, self.tail, self._tied = [], [], {}
        self.outside_in_memory = False  # `materialize_outside`: the outside tensors live in the model
        seen: dict[int, str] = {}
        in_layers = False
        for key, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                self._tied[key] = seen[id(t)]
            seen.setdefault(id(t), key)
            if key.startswith(layers):
                in_layers = True
            else:
                (self.tail if in_layers else self.head).append(key)
        expected = set(model.state_dict())
        unexpected = [self.ckpt.stored_name(k) for k in self.ckpt.keys()
                      if k not in expected and not k.endswith(IGNORED_EXTRA_KEYS)]
        if unexpected:
            raise CheckpointError(f"{source}: tensors that this model does not have: {', '.join(unexpected[:8])}"
                                  + (" ..." if len(unexpected) > 8 else ""))

    # -- checks before the work ------------------------------------------------------------------

    def check_finite(self, zero: bool, notify: Callable[[str], None]) -> list[str]:
        """Read every source tensor once: NaN/Inf are refused naming the tensors, or zeroed (`zero`) as
        each tensor is loaded later, and said so."""
        self.zeroed = set(refuse_or_zero(find_nonfinite(self.ckpt.pieces()), zero, notify))
        return sorted(self.zeroed)

    # -- tensors in and out ----------------------------------------------------------------------

    def _get(self, key: str, cast: bool = True) -> torch.Tensor:
        """Tensor `key` from the checkpoint (NaN/Inf zeroed if asked), floats in the compute dtype (`cast`)
        or as stored."""
        t = self.ckpt.get(key)
        if key in self.zeroed:
            t = zero_nonfinite(t)
        return t.to(self.dtype) if cast and t.is_floating_point() else t

    def _materialize(self, module: nn.Module, prefix: str) -> None:
        state = {}
        for rel, slot in module.state_dict(keep_vars=True).items():
            t = self._get(prefix + rel)
            if t.shape != slot.shape:
                raise CheckpointError(f"tensor {self.namer(prefix + rel)}: shape {tuple(t.shape)} in the checkpoint, "
                                      f"{tuple(slot.shape)} expected by the config")
            state[rel] = t
        module.load_state_dict(state, assign=True, strict=True)
        module.requires_grad_(False)

    def _write(self, key: str, t: torch.Tensor, own_dtype: bool = False) -> None:
        """Tensor `key` to the shards: in its own dtype, or as the checkpoint keeps it; one still in the compute
        dtype that is only its rounding of the stored tensor goes back as stored (`as_stored_exactly`)."""
        if not own_dtype:
            rounded = self.rounded and t.dtype == self.dtype and key in self.ckpt
            t = as_stored_exactly(t, self._get(key, cast=False) if rounded else None, self.storage)
        name = self.namer(key)
        check_output({name: t})
        assert self.writer is not None, "begin(writer) first"
        self.writer.add(name, t)

    def materialize_outside(self) -> None:
        """Load the tensors outside the decoder layers into the model (compute dtype), ties kept, for a stage
        that rewrites them (`Algorithm.rewrites_outside`); from then on they are written from the model and
        the embeddings are whole (no rows on demand)."""
        for key in self.head + self.tail:
            if key not in self._tied:
                self._assign(key, nn.Parameter(self._get(key), requires_grad=False))
        for key, first in self._tied.items():
            self._assign(key, self.model.get_parameter(first))
        self.outside_in_memory = True

    def _assign(self, key: str, value: nn.Parameter) -> None:
        owner, _, attr = key.rpartition(".")
        setattr(self.model.get_submodule(owner), attr, value)

    def _write_outside(self, keys: list[str]) -> None:
        tie = getattr(self.model.config, "tie_word_embeddings", False)
        if self.outside_in_memory:
            state = self.model.state_dict()
            for key in keys:
                if not (key in self._tied and tie):
                    self._write(key, state[key])
            return
        for key in keys:
            if key in self.ckpt:
                # as stored, straight to the storage dtype: the same bytes as through the compute dtype
                # (which holds the stored values exactly), without a float32 copy of a 128k-row embedding
                self._write(key, self._get(key, cast=False))
            elif key in self._tied and tie:
                continue  # e.g. lm_head.weight tied to the embeddings: stored once
            else:
                raise CheckpointError(f"{self.ckpt.path}: tensors missing from the checkpoint: {self.namer(key)}")

    def _embedding_owner(self) -> tuple[nn.Module, str]:
        emb = self.model.get_input_embeddings()
        name = next(n for n, m in self.model.named_modules() if m is emb)
        return emb, name + "."

    # -- the pipeline's hooks --------------------------------------------------------------------

    def begin(self, writer: Optional[ShardWriter], needs_embeddings: bool) -> None:
        """Write the tensors before the decoder layers (writer None: they were written already, by a run
        now resumed); when calibration runs, let the embeddings read the rows each batch looks up (and
        only those) from the checkpoint."""
        if writer is not None:
            self.writer = writer
            self._write_outside(self.head)
        if needs_embeddings and not self.outside_in_memory:
            self._hooks = self._rows_on_demand(*self._embedding_owner())

    def _rows_on_demand(self, emb: nn.Module, prefix: str) -> list:
        """Hooks that give the embedding, for each forward, a weight of just the rows its ids use (in the
        compute dtype) and ids renumbered into it: the same output as the whole matrix (a lookup is exact;
        padding_idx only matters for gradients), without holding 128k rows of it."""
        key, slot, padding = prefix + "weight", emb.weight, getattr(emb, "padding_idx", None)

        def before(module, args):
            ids = args[0]
            used, inverse = torch.unique(ids, return_inverse=True)
            rows = self.ckpt.rows(key, used.cpu())
            if key in self.zeroed:
                rows = zero_nonfinite(rows)
            module.weight = nn.Parameter(rows.to(self.dtype).to(ids.device), requires_grad=False)
            module.padding_idx = None
            return (inverse.reshape(ids.shape),) + tuple(args[1:])

        def after(module, _args, _output):
            module.weight, module.padding_idx = slot, padding

        return [emb.register_forward_pre_hook(before), emb.register_forward_hook(after)]

    def load_layer(self, index: int, layer: nn.Module) -> None:
        self._materialize(layer, f"{self.adapter.layers_path}.{index}.")

    def finish_layer(self, index: int, layer: nn.Module) -> None:
        """Write the (now quantized) layer's tensors and empty it."""
        prefix = f"{self.adapter.layers_path}.{index}."
        keep = fixed_dtype_keys(layer)
        for rel, t in layer.state_dict().items():
            self._write(prefix + rel, t, own_dtype=rel in keep)
        layer.to("meta")

    def end(self, write: bool = True) -> None:
        """Write the tensors after the decoder layers (unless not `write`: a rank that writes nothing) and
        drop the embeddings."""
        if write:
            self._write_outside(self.tail)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
