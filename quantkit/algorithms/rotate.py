"""Rotations of the residual stream and of the attention heads, fused into the weights (QuaRot / SpinQuant's
R1 and R2 with fixed random-Hadamard matrices): a transform stage for the schemes that quantize activations
to 4 bits, where a few outlier channels otherwise take the whole grid. With `block_size` the rotations stay
inside blocks of that many channels (32: one MX group), which is what helped on SmolLM2 (recipe rotated-mxfp4);
whole-size rotations, and any rotation before NVFP4, made it worse there (bench/RESULTS.md).

Before the first layer (`transform_model`): the final norm's weight is folded into lm_head, which then reads
the rotated stream (lm_head W diag(w) Q; a tied lm_head is untied, as it no longer equals the embedding), and
the embedding rows are rotated (E Q). Per decoder layer (`transform_layer`): each RMSNorm's weight is folded
into the linears that read it (norms become plain x / rms(x), which commutes with an orthogonal Q); q/k/v and
gate/up read h Q (W Q); o_proj and down_proj write into the rotated stream (Q^T W); with `heads`, each value
head is rotated by R (v_proj R^T W per head) and o_proj's columns undo it per head (W R). The model's function is
unchanged up to float rounding (tested); no online rotation is added, so the checkpoint is an ordinary one
that every loader runs. The maths is in `quantkit.quant.rotation`.

With `down_proj_online: B` each down_proj also gets SpinQuant's R4: its weight becomes W H (H block-diagonal,
normalized Hadamard blocks of B) and its input is rotated by H at run time (`qmodules.online_rotation`), before
the activations are quantized: no offline fusion can rotate the MLP's intermediate activations. The checkpoint
records it as compressed-tensors' transform_config (as llm-compressor's SpinQuant R4 does), which vLLM and
`quantkit.load` apply. `residual: false` leaves out the rotations of the residual stream (and the norm folding), so
R4 (and the per-head rotations) run on any architecture, Gemma included.

Architectures: the Llama family with plain RMSNorms (llama, mistral, qwen2, qwen3). Gemma's norms on the
attention and MLP outputs do not commute with a rotation of the stream; MoE routers are not handled: both
are refused.
"""

from __future__ import annotations

import logging
from typing import Literal, Optional, Union

import torch
from pydantic import Field, field_validator
from torch import nn

from quantkit.algorithms.base import Algorithm, AlgorithmConfig, LayerContext
from quantkit.core.registry import ALGORITHMS
from quantkit.errors import QuantizationError
from quantkit.qmodules import online_rotation
from quantkit.quant import rotation

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ROW_CHUNK = 8192  # embedding / lm_head rows rotated at a time (float64 temporaries of ROW_CHUNK x hidden)


class RotateConfig(AlgorithmConfig):
    seed: int = Field(0, ge=0)  # the rotations' random signs (and orthogonal factor where hidden is not 2^k)
    heads: bool = True  # also rotate each value head (v_proj / o_proj)
    # null: one rotation of the whole hidden size; a power of two: Hadamard blocks of that many channels (rotations
    # kept inside quantization groups, e.g. 32 for MX formats)
    block_size: Optional[int] = Field(None, ge=2)
    # rotate the residual stream (R1; folds the norms): the Llama family only; "auto": where the architecture allows
    # it, and said where it does not (the per-head and down_proj_online rotations still run there)
    residual: Union[bool, Literal["auto"]] = True
    # a power of two: an online Hadamard of blocks of this many channels before each down_proj (R4)
    down_proj_online: Optional[int] = Field(None, ge=2)

    @field_validator("block_size", "down_proj_online")
    @classmethod
    def _power_of_two(cls, v):
        if v is not None and v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v


@ALGORITHMS.register("rotate")
class Rotate(Algorithm):
    name = "rotate"
    Config = RotateConfig
    kind = "transform"
    needs_calibration = False
    any_grid = True  # a rotation prepares weights for every grid (it models none)
    rewrites_outside = True  # the embeddings and lm_head read / write the rotated stream
    config: RotateConfig

    def _rotations(self, config) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q over the hidden size, R over a head), built once per stage (every layer uses the same pair)."""
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        cache = self.__dict__.setdefault("_built", {})
        if (hidden, head_dim) not in cache:
            cache[(hidden, head_dim)] = self._build(hidden, head_dim)
        return cache[(hidden, head_dim)]

    def _build(self, hidden: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        block, seed = self.config.block_size, self.config.seed
        if block is not None and (hidden % block or head_dim % min(block, head_dim)):
            raise QuantizationError(f"rotate: block_size {block} does not divide the hidden size {hidden} (and the "
                                    f"head size {head_dim}); use a power of two that does, or null")
        if block is None:
            return rotation.random_hadamard(hidden, seed), rotation.random_hadamard(head_dim, seed + 1)
        return (rotation.block_hadamard(hidden, block, seed),
                rotation.block_hadamard(head_dim, min(block, head_dim), seed + 1))

    def _residual_applies(self, model_type: str, adapter) -> bool:
        """Whether R1 runs on this architecture (residual true on one it cannot take: an error; "auto": said once)."""
        supported = model_type in SUPPORTED and adapter.norm_weight_offset == 0.0
        if self.config.residual is True and not supported:
            raise QuantizationError(f"the rotate stage supports {', '.join(SUPPORTED)} (plain RMSNorms, no MoE "
                                    f"router); {model_type!r} is not supported: drop the rotate stage, or set "
                                    "residual: false or auto (the per-head and down_proj_online rotations alone)")
        if self.config.residual == "auto" and not supported and not self.__dict__.get("_said"):
            self._said = True
            log.warning("rotate: %s cannot take the residual-stream rotation (R1: it needs plain RMSNorms before "
                        "the sublayers); rotating %s only", model_type,
                        " and ".join(k for k, on in (("the value heads (R2)", self.config.heads),
                                                     ("down_proj's input online (R4)", self.config.down_proj_online))
                                     if on) or "nothing")
        return bool(self.config.residual) and supported

    @torch.no_grad()
    def transform_model(self, model: nn.Module, adapter) -> None:
        if not self._residual_applies(model.config.model_type, adapter):
            return
        q, _ = self._rotations(model.config)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        norm = model.model.norm
        new_head = _rows(head.weight.data, lambda w: rotation.rotate_input(
            rotation.fold_scale_into_inputs(w, norm.weight.data), q))
        new_embed = _rows(embed.weight.data, lambda w: rotation.rotate_input(w, q))
        head.weight = nn.Parameter(new_head, requires_grad=False)  # its own tensor: untied from the embedding
        embed.weight = nn.Parameter(new_embed, requires_grad=False)
        norm.weight.data.fill_(1.0)
        model.config.tie_word_embeddings = False

    @torch.no_grad()
    def transform_layer(self, ctx: LayerContext) -> None:
        layer = ctx.layer
        config = _config_of(ctx)
        q, r = self._rotations(config)
        attn, mlp = layer.self_attn, layer.mlp
        residual = self._residual_applies(config.model_type, ctx.adapter)
        if residual:
            self._residual(layer, q)
        if self.config.heads:
            self._heads(attn, r)
        if self.config.down_proj_online:
            self._online_down(ctx, mlp)
        kinds = [k for k, on in (("hadamard", residual), ("heads", self.config.heads)) if on]
        for name in ctx.linears:
            self.report.setdefault(name, {})["rotated"] = " + ".join(kinds) or "none"

    @staticmethod
    def _residual(layer: nn.Module, q: torch.Tensor) -> None:
        """R1: the norms folded into their readers, which read h Q; o_proj and down_proj write Q^T."""
        attn, mlp = layer.self_attn, layer.mlp
        for norm, readers in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                              (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            for lin in readers:
                lin.weight.data = rotation.rotate_input(rotation.fold_scale_into_inputs(lin.weight.data,
                                                                                        norm.weight.data), q)
            norm.weight.data.fill_(1.0)
        for lin in (attn.o_proj, mlp.down_proj):
            lin.weight.data = rotation.rotate_output(lin.weight.data, q)
            if lin.bias is not None:
                lin.bias.data = rotation.rotate_vector(lin.bias.data, q)

    @staticmethod
    def _heads(attn: nn.Module, r: torch.Tensor) -> None:
        """R2: each value head rotated by R (v_proj), o_proj's columns undoing it per head."""
        head_dim = r.shape[0]
        kv = rotation.per_head(r, attn.v_proj.out_features // head_dim)
        attn.v_proj.weight.data = rotation.rotate_output(attn.v_proj.weight.data, kv)
        if attn.v_proj.bias is not None:
            attn.v_proj.bias.data = rotation.rotate_vector(attn.v_proj.bias.data, kv)
        attn.o_proj.weight.data = rotation.rotate_input(attn.o_proj.weight.data,
                                                        rotation.per_head(r, attn.o_proj.in_features // head_dim))

    def _online_down(self, ctx: LayerContext, mlp: nn.Module) -> None:
        """R4: down_proj's weight W H and its input rotated by H at run time."""
        block = self.config.down_proj_online
        down = getattr(mlp, "down_proj", None)
        if not isinstance(down, nn.Linear):
            raise QuantizationError(f"{ctx.prefix}: down_proj_online needs an MLP with one down_proj linear (MoE "
                                    "experts are not handled): drop down_proj_online")
        if down.in_features % block:
            raise QuantizationError(f"{ctx.prefix}mlp.down_proj: down_proj_online {block} does not divide its "
                                    f"{down.in_features} inputs; use a power of two that does")
        down.weight.data = rotation.rotate_input_blocks(down.weight.data, block)
        online_rotation.attach(down, block)
        name = f"{ctx.prefix}mlp.down_proj"
        self.report.setdefault(name, {})["online_rotation"] = block


def _config_of(ctx: LayerContext):
    config = getattr(ctx.layer.self_attn, "config", None)
    if config is None:
        raise QuantizationError(f"{ctx.prefix}: the attention module has no config; the rotate stage cannot tell "
                                "its head size")
    return config


def _rows(w: torch.Tensor, fn) -> torch.Tensor:
    """fn applied to w a block of rows at a time (bounded float64 temporaries for a large vocabulary)."""
    return torch.cat([fn(w[i : i + ROW_CHUNK]) for i in range(0, w.shape[0], ROW_CHUNK)])
