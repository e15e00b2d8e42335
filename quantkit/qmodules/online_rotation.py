"""An online rotation of a linear's input (SpinQuant's R4, before each down_proj): at run time the input x becomes
x H, H block-diagonal with normalized Sylvester-Hadamard blocks, before the linear and before any activation
quantization; the weight absorbed H when it was made (W H: H is symmetric and orthogonal, so x H (W H)^T = x W^T).
Rotating the MLP's intermediate activations spreads their outlier channels, which a 4-bit activation grid
cannot otherwise hold; no offline fusion can do it, as the SwiGLU product sits between up/gate and down.

As compressed-tensors records it, and vLLM reads it (`transform_config` in the quantization_config): a transform
scheme of type "hadamard" with `head_dim` = the block size, applied at location "input" of its targets (online)
and "weight_input", inverse, of the same targets (fused offline, so nothing is done for it at load). The
checkpoint holds the unnormalized +-1 matrix as `<linear>.<scheme>_input.weight` (vLLM loads it and divides by
sqrt(block)). Here: a submodule of that name on the linear (its buffer is that tensor) plus a forward pre-hook
that runs before every other pre-hook, so calibration's observers see the rotated input, as the weight does.
The product is computed in float32 (compressed-tensors' default precision for online transforms).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from quantkit.core.targets import matches

SCHEME = "R4"  # the transform scheme's name quantkit writes: the key in transform_config, the submodule's prefix


def hadamard_pm1(block: int) -> torch.Tensor:
    """The Sylvester-Hadamard matrix of order `block` (a power of two) with entries +-1, float32."""
    if block < 2 or block & (block - 1):
        raise ValueError(f"an online Hadamard rotation needs a power-of-two block, got {block}")
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotate(x: torch.Tensor, pm1: torch.Tensor) -> torch.Tensor:
    """x [..., n] times the block-diagonal normalized Hadamard of blocks pm1 / sqrt(block), in float32,
    returned in x's dtype."""
    block = pm1.shape[0]
    h = pm1.to(device=x.device, dtype=torch.float32) / math.sqrt(block)
    return (x.float().unflatten(-1, (-1, block)) @ h).flatten(-2).to(x.dtype)


class OnlineHadamard(nn.Module):
    """The rotation as a submodule of the linear it precedes; `weight` is what the checkpoint stores."""

    def __init__(self, block: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.block = block
        self.register_buffer("weight", hadamard_pm1(block).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.weight)


def attach(linear: nn.Module, block: int, dtype: Optional[torch.dtype] = None, scheme: str = SCHEME) -> None:
    """Give `linear` the online rotation (its weight must already be W H) as submodule `<scheme>_input`. Its input
    width must divide into blocks."""
    width = _in_features(linear)
    if width % block:
        raise ValueError(f"an online Hadamard of block {block} needs an input width divisible by it, got {width}")
    if _rotation(linear) is not None:
        raise ValueError("this linear already has an online rotation")
    device = next((p.device for p in linear.parameters()), torch.device("cpu"))
    rotation = OnlineHadamard(block, dtype or torch.float32).to(device)
    linear.add_module(f"{scheme}_input", rotation)
    linear.register_forward_pre_hook(lambda _m, args: (rotation(args[0]), *args[1:]), prepend=True)


def _rotation(module: nn.Module) -> Optional[tuple[str, OnlineHadamard]]:
    return next(((n, c) for n, c in module.named_children() if isinstance(c, OnlineHadamard)), None)


def block_of(module: nn.Module) -> Optional[int]:
    """The block size of the module's online rotation, or None."""
    found = _rotation(module)
    return found[1].block if found else None


def carry(old: nn.Module, new: nn.Module) -> None:
    """Give a module that replaces `old` (its quantized form) the same online rotation."""
    found = _rotation(old)
    if found is not None and _rotation(new) is None:
        name, rotation = found
        attach(new, rotation.block, rotation.weight.dtype, name.removesuffix("_input"))


def rotated(model: nn.Module) -> dict[str, int]:
    """{module name: block} of every module with an online rotation."""
    return {name: b for name, m in model.named_modules() if (b := block_of(m)) is not None}


def _in_features(linear: nn.Module) -> int:
    width = getattr(linear, "in_features", None)
    if width is None:
        raise ValueError(f"{type(linear).__name__} has no in_features: not a linear")
    return int(width)


def transform_config(blocks: dict[str, int]) -> Optional[dict]:
    """compressed-tensors' transform_config for {module name: block} (one block size: one scheme), or None."""
    if not blocks:
        return None
    if len(set(blocks.values())) != 1:
        raise ValueError(f"online rotations of several block sizes ({sorted(set(blocks.values()))}): one per model")
    names = sorted(blocks)
    return {"config_groups": {SCHEME: {
        "type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": next(iter(blocks.values())),
        "precision": "float32",
        "apply": [{"targets": names, "location": "input", "inverse": False, "ignore": []},
                  {"targets": names, "location": "weight_input", "inverse": True, "ignore": []}]}}}


def attach_from_config(model: nn.Module, config: Optional[dict], namer=lambda name: name) -> dict[str, int]:
    """Give the modules a checkpoint's transform_config names their online rotations; {module name: block}.
    Weight transforms were fused when the checkpoint was written (nothing to do); what quantkit cannot run (another
    transform type, random permutations, online rotations of outputs or attention) is refused with ValueError,
    naming it. namer: module name -> the checkpoint's name (which the targets use)."""
    attached: dict[str, int] = {}
    for scheme_name, scheme in ((config or {}).get("config_groups") or {}).items():
        if scheme.get("type") != "hadamard" or scheme.get("randomize"):
            raise ValueError(f"transform {scheme_name!r}: type {scheme.get('type')!r}"
                             f"{' with randomize' if scheme.get('randomize') else ''}; quantkit runs the "
                             "deterministic 'hadamard' type only")
        for args in scheme.get("apply") or []:
            location = args.get("location")
            if location in ("weight_input", "weight_output"):
                continue  # fused into the stored weights when the checkpoint was written
            if location != "input" or args.get("inverse"):
                raise ValueError(f"transform {scheme_name!r}: an online rotation at {location!r}"
                                 f"{' (inverse)' if args.get('inverse') else ''}; quantkit runs online rotations of "
                                 "linear inputs only")
            for name, module in list(model.named_modules()):
                ckpt = namer(name)
                if (isinstance(module, OnlineHadamard) or not _is_target(ckpt, module, args.get("targets") or [])
                        or _is_target(ckpt, module, args.get("ignore") or [])):
                    continue
                block = scheme.get("head_dim") or _in_features(module)
                attach(module, block, scheme=scheme_name)
                attached[name] = block
    return attached


def _is_target(name: str, module: nn.Module, patterns: list[str]) -> bool:
    """compressed-tensors' target matching (`core.targets.matches`), where the class name "Linear" also covers
    quantized linears (the skeleton's modules are already swapped when the transforms are attached)."""
    return matches(name, module, patterns) or ("Linear" in patterns and hasattr(module, "in_features"))


def check_matrices(model: nn.Module) -> None:
    """Each online rotation's loaded matrix is the Sylvester-Hadamard one its type promises (ValueError otherwise)."""
    for name, module in model.named_modules():
        if isinstance(module, OnlineHadamard) and module.weight.device.type != "meta":
            if not torch.equal(module.weight.float().cpu(), hadamard_pm1(module.block)):
                raise ValueError(f"{name}.weight is not the Sylvester-Hadamard matrix of order {module.block} that "
                                 "its transform type 'hadamard' means")
