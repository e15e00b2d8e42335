"""Mixture-of-Experts blocks with one `nn.Linear` per expert projection.

transformers 5 stores a block's experts as two fused 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]); checkpoints on disk keep one tensor per expert
(`mlp.experts.{e}.gate_proj.weight`, ...), which is also how compressed-tensors names quantized
experts. `unfuse_experts` replaces the fused module with `LinearExperts`: the same computation
with per-expert linears, so each expert is targeted, calibrated, quantized and saved under its
checkpoint name like any other linear.

During calibration, `all_experts_see_tokens` makes every expert run on every token (its output
for tokens not routed to it is discarded), so rarely chosen experts still get statistics; the
block's output is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, dtype=None, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LinearExperts(nn.ModuleList):
    """Drop-in for transformers' fused experts: forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.calibrate_all = False  # see all_experts_see_tokens

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == e)
            if self.calibrate_all:
                y = expert(hidden_states)[token_idx]  # every token through the expert; keep the routed ones
            elif token_idx.numel() == 0:
                continue
            else:
                y = expert(hidden_states[token_idx])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
        return out


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(down, torch.Tensor) and down.dim() == 3


@torch.no_grad()
def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module by a LinearExperts (weights copied unless on meta).

    Returns how many blocks were replaced.
    """
    count = 0
    for name, module in list(model.named_modules()):
        if not _is_fused_experts(module):
            continue
        gate_up, down = module.gate_up_proj, module.down_proj  # [E, 2I, H], [E, H, I]
        n_experts, two_i, hidden = gate_up.shape
        inter = two_i // 2
        experts = []
        for e in range(n_experts):
            expert = ExpertMLP(hidden, inter, module.act_fn, dtype=gate_up.dtype, device=gate_up.device)
            if gate_up.device.type != "meta":
                expert.gate_proj.weight.copy_(gate_up[e, :inter])
                expert.up_proj.weight.copy_(gate_up[e, inter:])
                expert.down_proj.weight.copy_(down[e])
            experts.append(expert)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, LinearExperts(experts))
        count += 1
    return count


@contextlib.contextmanager
def all_experts_see_tokens(module: nn.Module) -> Iterator[None]:
    """Within the block, every LinearExperts under `module` runs each expert on every token."""
    blocks = [m for m in module.modules() if isinstance(m, LinearExperts)]
    for b in blocks:
        b.calibrate_all = True
    try:
        yield
    finally:
        for b in blocks:
            b.calibrate_all = False
