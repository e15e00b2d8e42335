"""Adapters for the decoder-only families quantkit supports out of the box."""

from quantkit.arch.adapter import LLAMA_SCALE_GROUPS, ArchitectureAdapter, ScaleGroup
from quantkit.core.registry import ARCHITECTURES

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

# Qwen3-MoE: sparse blocks (experts unfused into per-expert linears, see quantkit.arch.moe) and, in
# `mlp_only_layers`, dense MLPs; the groups that do not exist in a layer drop out. The router
# (`mlp.gate`) reads the normed input too: it is scaled with the experts but never quantized.
_MOE_SCALE_GROUPS = LLAMA_SCALE_GROUPS + (
    ScaleGroup("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), "mlp",
               passthrough=("mlp.gate",)),
    ScaleGroup("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",), "mlp.experts.*.down_proj"),
)
ARCHITECTURES.add("qwen3_moe", ArchitectureAdapter(model_type="qwen3_moe", scale_groups=_MOE_SCALE_GROUPS))

# Mixtral: the same block, but its checkpoints keep the original names (block_sparse_moe, w1/w3/w2),
# which is also what compressed-tensors checkpoints of it use.
ARCHITECTURES.add("mixtral", ArchitectureAdapter(model_type="mixtral", scale_groups=_MOE_SCALE_GROUPS, checkpoint_names=(
    ("mlp.experts.*.gate_proj", "block_sparse_moe.experts.*.w1"),
    ("mlp.experts.*.up_proj", "block_sparse_moe.experts.*.w3"),
    ("mlp.experts.*.down_proj", "block_sparse_moe.experts.*.w2"),
    ("mlp.experts", "block_sparse_moe.experts"),
    ("mlp.gate", "block_sparse_moe.gate"),
)))
