"""AWQ: exact scale folding per architecture, a search that beats no scaling, clipping, determinism, recipes."""

import pytest
import torch

import quantkit
from quantkit.algorithms.awq import AWQ, AWQConfig
from quantkit.algorithms.base import LayerContext
from quantkit.plugins.catalog import adapter_for
from quantkit.calibration.capture import capture_layer_inputs
from quantkit.errors import QuantizationError
from quantkit.quant.awq import apply_clip, candidate_scales, clip_candidates, clip_refine, clip_search, diagonal_blocks, fake_quantize
from quantkit.quant.intq import rtn
from quantkit.quant.schemes import QuantScheme
from quantkit.quant.smoothing import fold_scales, repeated_heads_index

from helpers import quantize_in_memory, sample_ids

W4G16 = QuantScheme(num_bits=4, group_size=16)


def _random_model(arch: str, vocab: int, kv_heads: int = 4, bias: bool = False):
    """A float32 model with non-trivial norm weights (random init leaves them at 1, or 0 for Gemma)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256)
    extra = {"gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "full_attention"])}.get(arch, {})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **common, **extra), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 0.8 + 0.6 - (1.0 if arch == "gemma3_text" else 0.0))
            elif bias and name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("arch,kv_heads", [("llama", 4), ("llama", 2), ("mistral", 4), ("qwen2", 4), ("qwen3", 4),
                                           ("gemma3_text", 4), ("gemma3_text", 1)])
def test_folding_scales_leaves_the_float_model_unchanged(arch, kv_heads, tokenizer):
    model = _random_model(arch, len(tokenizer), kv_heads, bias=arch == "qwen2")
    adapter = adapter_for(arch)
    ids = sample_ids(tokenizer, 2, 20)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    g = torch.Generator().manual_seed(1)
    folded = 0
    for layer in adapter.layers(model):
        for group in adapter.scale_groups:
            smooth = layer.get_submodule(group.smooth)
            balance = [layer.get_submodule(b) for b in group.balance]
            index = None
            if isinstance(smooth, torch.nn.Linear) and smooth.out_features != balance[0].in_features:
                index = repeated_heads_index(smooth.out_features, balance[0].in_features, head_dim=16)  # GQA v -> o
            width = balance[0].in_features if index is None else smooth.out_features
            scales = torch.exp(torch.randn(width, generator=g) * 0.7)
            fold_scales(smooth, balance, scales, adapter.norm_weight_offset, index)
            folded += 1
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert folded == 2 * 4
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_gemma_fold_needs_the_offset(tokenizer):
    """Folding into Gemma's (1 + w) norm as if it were w changes the model: the offset matters."""
    model = _random_model("gemma3_text", len(tokenizer))
    ids = sample_ids(tokenizer, 1, 12)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        layer = model.model.layers[0]
        fold_scales(layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                    torch.full((64,), 2.0), norm_weight_offset=0.0)
        assert not torch.allclose(model(input_ids=ids).logits, before, atol=1e-3)


def test_repeated_heads_index_layout():
    # 2 kv heads x head_dim 2 feeding 4 query heads: heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
    assert repeated_heads_index(4, 8, head_dim=2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert repeated_heads_index(6, 6, head_dim=3).tolist() == list(range(6))
    with pytest.raises(QuantizationError):
        repeated_heads_index(6, 8, head_dim=2)


def test_fold_rejects_mismatched_shapes():
    with pytest.raises(QuantizationError, match="do not fit"):
        fold_scales(torch.nn.Linear(8, 8), [torch.nn.Linear(4, 4)], torch.ones(8))


def test_candidate_scales_are_centred_and_follow_activations():
    x_mean = torch.tensor([0.1, 1.0, 10.0, 100.0])
    w_mean = torch.full((4,), 0.5)
    s = candidate_scales(x_mean, w_mean, 0.5)
    assert torch.isclose(s.max() * s.min(), torch.tensor(1.0))
    assert torch.all(s[1:] > s[:-1])  # more activation, larger scale
    flat = candidate_scales(x_mean, w_mean, 0.0)
    torch.testing.assert_close(flat, torch.ones(4))  # ratio 0 with equal weight magnitudes: no scaling


def test_clip_search_never_worse_and_clips_heavy_tails():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    w[:, ::16] *= 6  # one outlier per group
    x = torch.randn(512, 64, generator=g)
    C = diagonal_blocks(x.t() @ x, W4G16)
    factors = clip_search(w, C, W4G16, torch.float32)

    def err(weight):
        d = (w - fake_quantize(weight, W4G16, torch.float32))
        return ((x @ d.t()) ** 2).sum()

    assert err(apply_clip(w, factors, W4G16)) < err(w)
    assert (factors < 1).any() and (factors > 0.5).all()
    # the moments route: d^T C d summed over groups equals the output error of the whole row
    d = w - fake_quantize(w, W4G16, torch.float32)
    dg = d.reshape(32, 4, 16)
    per_group = torch.einsum("ogi,gij,ogj->og", dg, C, dg)
    xs = x.reshape(512, 4, 16)
    direct = torch.einsum("tgi,ogi->otg", xs, dg).pow(2).sum(1)
    torch.testing.assert_close(per_group, direct, rtol=1e-4, atol=1e-3)


def test_diagonal_blocks_are_the_groups_second_moments():
    x = torch.randn(100, 48, generator=torch.Generator().manual_seed(1))
    blocks = diagonal_blocks(x.t() @ x, W4G16)
    assert blocks.shape == (3, 16, 16)
    for g in range(3):
        xg = x[:, 16 * g : 16 * (g + 1)]
        torch.testing.assert_close(blocks[g], xg.t() @ xg)


def test_clip_refine_lowers_the_whole_row_error_with_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    w[:, ::16] *= 5
    # inputs whose channels are correlated across groups: the cross-group blocks of H are far from zero
    mix = torch.randn(64, 64, generator=g) * 0.3 + torch.eye(64)
    x = torch.randn(2048, 8, generator=g) @ torch.randn(8, 64, generator=g) + 0.3 * torch.randn(2048, 64, generator=g) @ mix
    H = x.t() @ x
    per_group = clip_search(w, diagonal_blocks(H, W4G16), W4G16, torch.float32)
    joint = clip_refine(w, per_group, H, W4G16, torch.float32, sweeps=3)

    def row_errors(factors):
        d = w - fake_quantize(apply_clip(w, factors, W4G16), W4G16, torch.float32)
        return ((d @ H) * d).sum(dim=1)

    before, after = row_errors(per_group), row_errors(joint)
    assert torch.all(after <= before * (1 + 1e-5))  # coordinate descent never makes a row worse
    assert after.sum() < 0.9 * before.sum()  # and the cross-group terms are worth using here
    allowed = torch.tensor(clip_candidates(20, 0.5))
    assert torch.isin(joint, allowed).all()
    # no sweeps, or one group per row: the per-group choice is returned as it is
    assert torch.equal(clip_refine(w, per_group, H, W4G16, torch.float32, sweeps=0), per_group)


def _layer_context(tokenizer, outlier_channels=(3, 17, 40)):
    """Layer 0 of a tiny llama whose inputs carry a few large-magnitude channels (as real LLMs do)."""
    model = _random_model("llama", len(tokenizer), kv_heads=4)
    with torch.no_grad():
        w = model.model.layers[0].input_layernorm.weight
        for c in outlier_channels:
            w[c] = 20.0
    adapter = adapter_for("llama")
    layers = adapter.layers(model)
    batches = [sample_ids(tokenizer, 2, 24), sample_ids(tokenizer, 2, 24).flip(1)]
    inputs = capture_layer_inputs(model, layers, batches)
    prefix = "model.layers.0."
    linears = {prefix + n: m for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    ctx = LayerContext(layers[0], prefix, linears, {n: W4G16 for n in linears}, inputs.hidden, inputs.kwargs[0],
                       adapter, torch.float32)
    return model, ctx


def _attention_error(ctx) -> float:
    """Output error of layer 0's attention block with q/k/v round-to-nearest quantized (independent of AWQ)."""
    attn = ctx.layer.self_attn
    saved = {n: getattr(attn, n).weight.data.clone() for n in ("q_proj", "k_proj", "v_proj")}
    outs, total = [], 0.0
    with torch.no_grad():
        for h, kw in zip(ctx.hidden, ctx.kwargs):
            x = ctx.layer.input_layernorm(h)
            outs.append(attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "use_cache"})[0])
        for n, w in saved.items():
            getattr(attn, n).weight.data = rtn(w, W4G16, torch.float32).dequantize()
        for (h, kw), ref in zip(zip(ctx.hidden, ctx.kwargs), outs):
            x = ctx.layer.input_layernorm(h)
            total += float((attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "use_cache"})[0] - ref).pow(2).sum())
        for n, w in saved.items():
            getattr(attn, n).weight.data = w
    return total


def test_search_lowers_the_block_error_versus_no_scaling(tokenizer):
    _, ctx = _layer_context(tokenizer)
    unscaled = _attention_error(ctx)
    awq = AWQ(AWQConfig(clip=False), None)
    awq.transform_layer(ctx)
    assert _attention_error(ctx) < 0.9 * unscaled
    q = awq.report["model.layers.0.self_attn.q_proj"]
    assert q["awq_ratio"] is not None and q["awq_error_vs_unscaled"] < 1


def test_transform_is_deterministic_and_keeps_the_float_function(tokenizer):
    results = []
    for _ in range(2):
        model, ctx = _layer_context(tokenizer)
        ids = sample_ids(tokenizer, 1, 16)
        with torch.no_grad():
            before = model(input_ids=ids).logits
            AWQ(AWQConfig(clip=False), None).transform_layer(ctx)
            after = model(input_ids=ids).logits
        torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)  # scaling alone is function-preserving
        results.append({n: p.clone() for n, p in model.state_dict().items()})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_clipping_changes_only_the_unskipped_linears(tokenizer):
    _, ctx = _layer_context(tokenizer)
    awq = AWQ(AWQConfig(n_grid=1, clip_in_search=True), None)  # ratio 0 only; clipping on
    awq.transform_layer(ctx)
    clipped = {n for n in ctx.linears if "awq_clip_mean" in awq.report.get(n, {})}
    assert clipped == {n for n in ctx.linears if not n.endswith(("q_proj", "k_proj"))}
    assert all(awq.report[n]["awq_clip_mean"] <= 1 for n in clipped)
    # some groups were clipped: their range shrank below what scaling alone gives
    gate = "model.layers.0.mlp.gate_proj"
    assert awq.report[gate]["awq_clip_mean"] < 1


@pytest.mark.parametrize("recipe", ["awq-w4a16", "awq-w4a16-asym", "awq-gptq-w4a16"])
def test_awq_recipes_run_and_round_trip(recipe, tiny_models, tokenizer, tmp_path):
    from quantkit.checkpoints.export import export_checkpoint
    from quantkit.checkpoints.quantization_config import build_quantization_config

    overrides = ["stages.1.scheme.group_size=32"]
    batches = [sample_ids(tokenizer, 2, 24)]
    # qwen3: stored in float32, so the folded norm weights survive export exactly
    model, adapter, result, storage, _ = quantize_in_memory(tiny_models["qwen3"], recipe, overrides, batches)
    rows = {r["name"]: r for r in result.layers}
    assert len(rows) == 3 * 7
    assert all("awq_ratio" in r for r in rows.values())  # o_proj too: v -> o with scales tied across GQA heads
    ids = sample_ids(tokenizer, 1, 16)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_checkpoint(model, tmp_path / "q", storage_dtype=storage, source=tiny_models["qwen3"],
                      quantization_config=build_quantization_config(model, result.quantized))
    with torch.no_grad():
        got = quantkit.load(tmp_path / "q", dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_float32_compute_of_a_bf16_checkpoint_exports_the_in_memory_model(arch, tiny_models, tokenizer, tmp_path):
    """An AVX2 machine computes a bf16 checkpoint in float32: AWQ's folded norms and weights are
    rounded to bf16 as they are folded, so the export reloads bit for bit to the in-memory model."""
    from quantkit.checkpoints.export import export_checkpoint
    from quantkit.checkpoints.quantization_config import build_quantization_config

    src = tiny_models[arch]
    batches = [sample_ids(tokenizer, 2, 24)]
    model, _, result, storage, _ = quantize_in_memory(src, "awq-w4a16", ["stages.1.scheme.group_size=32"], batches)
    assert storage == torch.bfloat16 and model.dtype == torch.float32
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, norm.to(torch.bfloat16).float())  # the folded norm holds bf16 values
    ids = sample_ids(tokenizer, 1, 16)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_checkpoint(model, tmp_path / "q", storage_dtype=storage, source=src,
                      quantization_config=build_quantization_config(model, result.quantized))
    with torch.no_grad():
        got = quantkit.load(tmp_path / "q", dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_awq_stage_errors(tiny_llama):
    from quantkit.flow.pipeline import build_stages
    from quantkit.flow.recipe import load_recipe

    model = quantkit.load(tiny_llama, dtype=torch.float32)
    adapter = adapter_for("llama")
    with pytest.raises(QuantizationError, match="takes no scheme"):
        build_stages(model, adapter, load_recipe("awq-w4a16", ["stages.0.scheme=W4A16"]))
    with pytest.raises(QuantizationError, match="no later stage quantizes"):
        build_stages(model, adapter, load_recipe("awq-w4a16", ["stages.1.scheme.group_size=32", "stages.1.ignore=[lm_head, re:.*down_proj]"]))


def test_searching_both_grids_is_never_worse_than_one(tokenizer):
    """duo_scaling "both" searches a superset of the candidates of True (and of False)."""
    errors = {}
    for duo in (True, False, "both"):
        _, ctx = _layer_context(tokenizer)
        awq = AWQ(AWQConfig(clip=False, duo_scaling=duo), None)
        awq.transform_layer(ctx)
        errors[duo] = [awq.report[f"model.layers.0.{n}"]["awq_error_vs_unscaled"]
                       for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    assert all(b <= min(t, f) + 1e-12 for b, t, f in zip(errors["both"], errors[True], errors[False]))


def test_input_fake_quantizer_does_what_the_kernels_do():
    from quantkit.kernels.reference import fp8_quantize_per_token, int8_quantize_per_token
    from quantkit.quant import microscale
    from quantkit.kernels.reference import input_fake_quantizer
    from quantkit.quant.schemes import resolve_scheme

    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.linspace(0.1, 30.0, 64)
    assert input_fake_quantizer(resolve_scheme("W4A16", {})) is None
    assert input_fake_quantizer(resolve_scheme("W8A8", {"input_activations": {"strategy": "tensor", "dynamic": False,
                                                                             "type": "int"}})) is None  # static: later
    q, s = fp8_quantize_per_token(x)
    assert torch.equal(input_fake_quantizer(resolve_scheme("W4AFP8", {}))(x), q.float() * s)
    q, s = int8_quantize_per_token(x)
    assert torch.equal(input_fake_quantizer(resolve_scheme("W8A8", {}))(x), q.float() * s)
    gs = microscale.nvfp4_global_scale(x.abs().amax())
    assert torch.equal(input_fake_quantizer(resolve_scheme("NVFP4", {}))(x), microscale.fake_quantize_input(x, 4, 16, gs))
    assert torch.equal(input_fake_quantizer(resolve_scheme("MXFP4", {}))(x), microscale.fake_quantize_input(x, 4, 32, None))
    w = torch.randn(8, 64)
    assert torch.equal(fake_quantize(w, resolve_scheme("NVFP4", {}), torch.float32),
                       microscale.quantize_weight(w, resolve_scheme("NVFP4", {})).dequantize(torch.float32))


def _w4a4_attention_error(ctx, scheme) -> float:
    """Output error of layer 0's attention block with q/k/v weights and inputs quantized as `scheme`'s kernels do."""
    from quantkit.kernels.reference import input_fake_quantizer

    attn, quantize_input = ctx.layer.self_attn, input_fake_quantizer(scheme)
    names = ("q_proj", "k_proj", "v_proj")
    saved = {n: getattr(attn, n).weight.data.clone() for n in names}
    outs, total = [], 0.0
    with torch.no_grad():
        for h, kw in zip(ctx.hidden, ctx.kwargs):
            x = ctx.layer.input_layernorm(h)
            outs.append(attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "use_cache"})[0])
        hooks = [getattr(attn, n).register_forward_pre_hook(lambda m, a: (quantize_input(a[0]),)) for n in names]
        for n, w in saved.items():
            getattr(attn, n).weight.data = fake_quantize(w, scheme, torch.float32)
        for (h, kw), ref in zip(zip(ctx.hidden, ctx.kwargs), outs):
            x = ctx.layer.input_layernorm(h)
            total += float((attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "use_cache"})[0] - ref).pow(2).sum())
        for hook in hooks:
            hook.remove()
        for n, w in saved.items():
            getattr(attn, n).weight.data = w
    return total


def test_search_scores_quantized_inputs_where_the_scheme_quantizes_them(tokenizer):
    """NVFP4 (W4A4): scales searched with the inputs quantized as the kernels will are never worse, on that
    error, than scales searched for the weights alone (NVFP4A16: the same candidates); no hook is left behind."""
    from quantkit.quant.schemes import resolve_scheme

    nvfp4, weight_only = resolve_scheme("NVFP4", {}), resolve_scheme("NVFP4A16", {})
    errors = {}
    for name, search_scheme in (("w4a4", nvfp4), ("w4a16", weight_only)):
        _, ctx = _layer_context(tokenizer)
        ctx.schemes = {n: search_scheme for n in ctx.linears}
        unscaled = _w4a4_attention_error(ctx, nvfp4)
        AWQ(AWQConfig(clip=False), None).transform_layer(ctx)
        assert all(not lin._forward_pre_hooks for lin in ctx.linears.values())
        errors[name] = _w4a4_attention_error(ctx, nvfp4)
        assert errors[name] < unscaled
    assert errors["w4a4"] <= errors["w4a16"] * (1 + 1e-6)


def test_micro_schemes_refuse_the_clipping_search(tokenizer):
    from quantkit.errors import RecipeError
    from quantkit.quant.schemes import resolve_scheme

    _, ctx = _layer_context(tokenizer)
    ctx.schemes = {n: resolve_scheme("NVFP4", {}) for n in ctx.linears}
    with pytest.raises(RecipeError, match="clip: false"):
        AWQ(AWQConfig(clip=True), None).transform_layer(ctx)
