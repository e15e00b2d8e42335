"""Adapters for the decoder-only families quantkit supports out of the box."""

from quantkit.arch.adapter import LLAMA_SCALE_GROUPS, ArchitectureAdapter, ScaleGroup
from quantkit.registry import ARCHITECTURES

for _model_type in ("llama", "mistral", "qwen2", "qwen3"):
    ARCHITECTURES.add(_model_type, ArchitectureAdapter(model_type=_model_type))

# Gemma 3: the MLP reads pre_feedforward_layernorm (post_attention_layernorm normalises the attention
# output before the residual add), and its RMSNorm scales by (1 + weight).
_GEMMA3_SCALE_GROUPS = tuple(
    ScaleGroup("pre_feedforward_layernorm", g.balance, g.parent) if g.smooth == "post_attention_layernorm" else g
    for g in LLAMA_SCALE_GROUPS
)
ARCHITECTURES.add("gemma3_text", ArchitectureAdapter(
    model_type="gemma3_text", needs_bos=True, scale_groups=_GEMMA3_SCALE_GROUPS, norm_weight_offset=1.0,
))
