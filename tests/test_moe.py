"""Mixture-of-Experts (Qwen3-MoE): per-expert linears, every expert calibrated, exact folding, round trips."""

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit.plugins.catalog import adapter_for
from quantkit.arch.moe import LinearExperts, all_experts_see_tokens
from quantkit.quant.smoothing import fold_scales, repeated_heads_index

from helpers import quantize_in_memory, sample_ids

N_EXPERTS = 4


def _save_tiny_moe(path, tokenizer, model_type: str, **config_kw):
    """A float32 two-layer MoE with non-trivial norms and a router that routes, saved by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, **config_kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # zeros at init
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _quantize_export_reload(source, recipe, tokenizer, out, batches):
    """Quantize in memory, export, reload: (result, saved tensor names, logits before, logits after reload)."""
    from quantkit.checkpoints.export import export_checkpoint
    from quantkit.checkpoints.quantization_config import build_quantization_config

    stage = 1 if recipe.startswith("awq") else 0
    model, _, result, storage, _ = quantize_in_memory(source, recipe, [f"stages.{stage}.scheme.group_size=32"], batches)
    ids = sample_ids(tokenizer, 1, 16)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_checkpoint(model, out, storage_dtype=storage, source=source,
                      quantization_config=build_quantization_config(model, result.quantized))
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    with torch.no_grad():
        got = quantkit.load(out, dtype=torch.float32)(input_ids=ids).logits
    return result, keys, expected, got


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, tokenizer):
    return _save_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3-moe", tokenizer, "qwen3_moe", intermediate_size=96,
                          moe_intermediate_size=32, num_experts=N_EXPERTS, mlp_only_layers=[1])


def test_load_unfuses_experts_and_matches_transformers(tiny_moe, tokenizer):
    from transformers import AutoModelForCausalLM

    ours = quantkit.load(tiny_moe, dtype=torch.float32)
    experts = ours.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == N_EXPERTS
    assert isinstance(experts[3].down_proj, torch.nn.Linear)
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    ids = sample_ids(tokenizer, 2, 20)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_every_expert_sees_every_token_during_calibration(tiny_moe, tokenizer):
    model = quantkit.load(tiny_moe, dtype=torch.float32)
    layer = model.model.layers[0]
    ids = sample_ids(tokenizer, 2, 20)
    seen = {}
    for e, expert in enumerate(layer.mlp.experts):
        expert.gate_proj.register_forward_pre_hook(lambda m, a, e=e: seen.__setitem__(e, seen.get(e, 0) + a[0].shape[0]))
    with torch.no_grad():
        routed = model(input_ids=ids).logits
        routed_counts = dict(seen)
        seen.clear()
        with all_experts_see_tokens(layer):
            everything = model(input_ids=ids).logits
    assert sum(routed_counts.values()) == 2 * 40  # top-2 of 40 tokens
    assert seen == {e: 40 for e in range(N_EXPERTS)}
    torch.testing.assert_close(everything, routed, rtol=1e-6, atol=1e-6)  # the output does not change
    assert not layer.mlp.experts.calibrate_all


def test_folding_with_router_passthrough_is_exact(tiny_moe, tokenizer):
    model = quantkit.load(tiny_moe, dtype=torch.float32)
    adapter = adapter_for("qwen3_moe")
    ids = sample_ids(tokenizer, 2, 20)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    g = torch.Generator().manual_seed(0)
    kinds = []
    for layer in adapter.layers(model):
        for group in adapter.scale_groups_in(layer):
            smooth = layer.get_submodule(group.smooth)
            first = layer.get_submodule(group.balance[0])
            index = None
            if isinstance(smooth, torch.nn.Linear) and smooth.out_features != first.in_features:
                index = repeated_heads_index(smooth.out_features, first.in_features, head_dim=16)
            n = first.in_features if index is None else smooth.out_features
            fold_scales(smooth, [layer.get_submodule(b) for b in group.balance + group.passthrough],
                        torch.exp(torch.randn(n, generator=g) * 0.5), adapter.norm_weight_offset, index)
            kinds.append((group.smooth, len(group.balance), group.passthrough))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-4, atol=1e-4)
    assert ("post_attention_layernorm", 2 * N_EXPERTS, ("mlp.gate",)) in kinds  # sparse layer: all experts + router
    assert ("post_attention_layernorm", 2, ()) in kinds  # dense layer (mlp_only_layers)
    assert sum(k[0].startswith("mlp.experts.") for k in kinds) == N_EXPERTS  # up -> down per expert


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "awq-w4a16"])
def test_moe_quantize_export_reload(recipe, tiny_moe, tokenizer, tmp_path):
    batches = [sample_ids(tokenizer, 2, 24), sample_ids(tokenizer, 2, 24).flip(1)]
    result, keys, expected, got = _quantize_export_reload(tiny_moe, recipe, tokenizer, tmp_path / "q", batches)
    names = {r["name"] for r in result.layers}
    assert {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(N_EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert "model.layers.1.mlp.down_proj" in names and not any(n.endswith("mlp.gate") for n in names)
    assert "model.layers.0.mlp.experts.2.up_proj.weight_packed" in keys
    with safe_open(str(next((tmp_path / "q").glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32  # router: float, as it was
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory, tokenizer):
    return _save_tiny_moe(tmp_path_factory.mktemp("mixtral") / "mixtral", tokenizer, "mixtral", intermediate_size=32,
                          num_local_experts=N_EXPERTS)


@pytest.mark.parametrize("recipe", ["gptq-w4a16", "awq-w4a16"])
def test_mixtral_checkpoint_names_both_ways(recipe, tiny_mixtral, tokenizer, tmp_path):
    """Mixtral files say block_sparse_moe.experts.{e}.w1/w3/w2; the modules are mlp.experts.{e}.gate/up/down_proj."""
    from transformers import AutoModelForCausalLM

    with safe_open(str(next(tiny_mixtral.glob("*.safetensors"))), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in f.keys()  # what transformers writes
    ids = sample_ids(tokenizer, 2, 20)
    ours = quantkit.load(tiny_mixtral, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

    _, keys, expected, got = _quantize_export_reload(tiny_mixtral, recipe, tokenizer, tmp_path / "q",
                                                     [sample_ids(tokenizer, 2, 24)])
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in k for k in keys)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
