"""The ArchitectureAdapter contract (the lookup from a `model_type` to its adapter is `quantkit.plugins.catalog`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from quantkit.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ScaleGroup:
    """Linears (`balance`) that read the output of one operator (`smooth`: a norm or a linear).

    Scaling the smooth operator's output channels by 1/s and the balance linears' input columns
    by s leaves the model's function unchanged; AWQ chooses s. `parent` is the module whose
    output scores a candidate s (the attention block, the MLP, or the balance linear itself).
    Names are relative to the decoder layer.
    """

    smooth: str
    balance: tuple[str, ...]
    parent: str
    passthrough: tuple[str, ...] = ()  # unquantized readers of the smooth output (MoE router): scaled at fold

    def expand(self, module_names: set[str]) -> list["ScaleGroup"]:
        """Concrete groups for a layer whose modules are `module_names` (relative).

        A `*` stands for one name component (an expert index). In `smooth`, each match gives one
        group with that index substituted everywhere; elsewhere, `*` takes every match. Groups
        whose modules do not all exist are dropped.
        """
        if "*" in self.smooth:
            out = []
            for star in _stars(self.smooth, module_names):
                sub = lambda p: p.replace("*", star)  # noqa: E731
                out += ScaleGroup(sub(self.smooth), tuple(map(sub, self.balance)), sub(self.parent),
                                  tuple(map(sub, self.passthrough))).expand(module_names)
            return out
        balance = tuple(n for p in self.balance for n in _glob(p, module_names))
        passthrough = tuple(n for p in self.passthrough for n in _glob(p, module_names))
        if not balance or any(n not in module_names for n in (self.smooth, self.parent, *balance, *passthrough)):
            return []
        return [ScaleGroup(self.smooth, balance, self.parent, passthrough)]


def _star_regex(pattern: str) -> str:
    """Regex source for a dotted name pattern whose `*` (captured) stands for one component."""
    return re.escape(pattern).replace(r"\*", r"([^.]+)")


def _rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for src, dst in pairs:
        rx = r"(^|\.)" + _star_regex(src) + r"(?=\.|$)"
        repl = r"\1" + dst.replace("*", r"\2")
        name, n = re.subn(rx, repl, name, count=1)
        if n:
            break
    return name


def _stars(pattern: str, names: set[str]) -> list[str]:
    rx = re.compile("^" + _star_regex(pattern) + "$")
    found = [m.group(1) for m in map(rx.match, names) if m]
    return sorted(found, key=lambda s: (len(s), s))  # 0, 1, ..., 10 in numeric order


def _glob(pattern: str, names: set[str]) -> list[str]:
    if "*" not in pattern:
        return [pattern]
    return [pattern.replace("*", star) for star in _stars(pattern, names)]


# sibling linears (one parent) that read the same input, by leaf name: vLLM fuses them (qkv, gate_up / w13)
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def sibling_groups(names: list[str]) -> list[list[str]]:
    """`names` partitioned into input-sharing groups by name alone (`SHARED_INPUTS` under one parent, e.g. each
    MoE expert's gate and up), the rest alone; in order of first appearance."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        family = next((i for i, fam in enumerate(SHARED_INPUTS) if leaf in fam), None)
        groups.setdefault((parent, family) if family is not None else (name, None), []).append(name)
    return list(groups.values())


LLAMA_SCALE_GROUPS = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),  # only where v's out == o's in
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How quantkit walks one model family.

    `linear_groups` lists, per decoder layer, the linears (relative names) that read the same
    input; algorithms that collect input statistics (GPTQ Hessians) share them within a group.
    `scale_groups` are the AWQ mappings; `norm_weight_offset` says how the family's RMSNorm
    applies its weight: x_normed * (offset + weight) (0 for Llama, 1 for Gemma).
    """

    model_type: str
    layers_path: str = "model.layers"
    linear_groups: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    needs_bos: bool = False  # evaluation windows must start with BOS (Gemma: ppl ~36 vs ~89)
    scale_groups: tuple[ScaleGroup, ...] = LLAMA_SCALE_GROUPS
    norm_weight_offset: float = 0.0
    attention: str = "self_attn"  # the attention module inside a decoder layer (holds k_scale / v_scale)
    # (module name fragment, checkpoint name fragment) pairs where the two differ; `*` is one component
    checkpoint_names: tuple[tuple[str, str], ...] = ()

    def to_checkpoint_name(self, name: str) -> str:
        """A module/tensor name as the family's checkpoints spell it."""
        return _rename(name, self.checkpoint_names)

    def to_module_name(self, name: str) -> str:
        """A checkpoint tensor name as the transformers model (after unfusing experts) spells it."""
        return _rename(name, tuple((b, a) for a, b in self.checkpoint_names))

    def layers(self, model: nn.Module) -> nn.ModuleList:
        obj = model
        for part in self.layers_path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise UnsupportedArchitectureError(
                    f"model of type {self.model_type!r} has no {self.layers_path!r}; "
                    "its adapter does not match this checkpoint"
                )
        return obj

    def scale_groups_in(self, layer: nn.Module) -> list[ScaleGroup]:
        """The adapter's scale groups made concrete for one decoder layer (see ScaleGroup.expand)."""
        names = {n for n, _ in layer.named_modules() if n}
        return [g for group in self.scale_groups for g in group.expand(names)]

    def linear_names(self) -> list[str]:
        return [name for group in self.linear_groups for name in group]
