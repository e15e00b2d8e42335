"""SmoothQuant: the scale rule with fixed values, folding that leaves the float model unchanged and
balances activation and weight ranges, lower W8A8 error where activations carry outliers, bad input."""

import pytest
import torch

import quantkit
from quantkit.algorithms.base import LayerContext
from quantkit.algorithms.smoothquant import SmoothQuant, SmoothQuantConfig
from quantkit.calibration.capture import capture_layer_inputs
from quantkit.errors import QuantizationError
from quantkit.flow.recipe import load_recipe
from quantkit.kernels.reference import int8_quantize_per_token
from quantkit.plugins.catalog import adapter_for
from quantkit.quant.intq import rtn
from quantkit.quant.schemes import resolve_scheme
from quantkit.quant.smoothquant import smoothing_scales, weight_absmax

from helpers import sample_ids
from test_awq import _random_model

W8A8 = resolve_scheme("W8A8", {})


def test_scales_follow_the_rule_with_fixed_values():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0, 16.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0, 0.25])
    # alpha 0.5: sqrt(a / w); a channel with no activation or no weight is left alone (scale 1)
    assert torch.equal(smoothing_scales(act, w, 0.5), torch.tensor([2.0, 0.5, 1.0, 1.0, 8.0]))
    assert torch.equal(smoothing_scales(act, w, 1.0), torch.tensor([4.0, 1.0, 1.0, 1.0, 16.0]))
    assert torch.equal(smoothing_scales(act, w, 0.0), torch.tensor([1.0, 0.25, 1.0, 1.0, 4.0]))
    ws = [torch.tensor([[1.0, -3.0], [-2.0, 0.5]]), torch.tensor([[0.5, 4.0]])]
    assert torch.equal(weight_absmax(ws), torch.tensor([2.0, 4.0]))


def test_bad_scale_inputs_are_refused():
    with pytest.raises(QuantizationError, match="alpha 1.5 is outside"):
        smoothing_scales(torch.ones(3), torch.ones(3), 1.5)
    with pytest.raises(QuantizationError, match="differ in shape"):
        smoothing_scales(torch.ones(3), torch.ones(4), 0.5)
    with pytest.raises(Exception, match="alpha"):
        load_recipe("w8a8-smoothquant", ["stages.0.args.alpha=1.5"])
    with pytest.raises(Exception, match="strength"):
        load_recipe("w8a8-smoothquant", ["stages.0.args.strength=0.5"])


def _context(arch: str, tokenizer, outliers=(3, 17, 40)):
    """Layer 0 of a tiny model whose norms give a few input channels large magnitudes (as real LLMs have)."""
    model = _random_model(arch, len(tokenizer), kv_heads=4)
    offset = 1.0 if arch == "gemma3_text" else 0.0
    with torch.no_grad():
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            if hasattr(model.model.layers[0], norm):
                for c in outliers:
                    getattr(model.model.layers[0], norm).weight[c] = 30.0 - offset
    adapter = adapter_for(arch)
    layers = adapter.layers(model)
    inputs = capture_layer_inputs(model, layers, [sample_ids(tokenizer, 2, 24), sample_ids(tokenizer, 2, 24).flip(1)])
    prefix = "model.layers.0."
    linears = {prefix + n: m for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    return model, LayerContext(layers[0], prefix, linears, {n: W8A8 for n in linears}, inputs.hidden,
                               inputs.kwargs[0], adapter, torch.float32)


def _layer_outputs(ctx) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for h, kw in zip(ctx.hidden, ctx.kwargs):
            out = ctx.layer(h, **kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _input_absmax(ctx, name: str) -> torch.Tensor:
    seen = []
    handle = ctx.linears[name].register_forward_pre_hook(lambda _m, a: seen.append(a[0].abs().amax(dim=(0, 1))))
    try:
        _layer_outputs(ctx)
    finally:
        handle.remove()
    return torch.stack(seen).amax(dim=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_smoothing_leaves_the_float_layer_unchanged_and_balances_ranges(arch, tokenizer):
    _, ctx = _context(arch, tokenizer)
    before = _layer_outputs(ctx)
    sq = SmoothQuant(SmoothQuantConfig(alpha=0.5), None)
    sq.transform_layer(ctx)
    after = _layer_outputs(ctx)
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    smoothed = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    assert set(sq.report) == {ctx.prefix + n for n in smoothed}  # norms only by default: not o_proj, down_proj
    # alpha 0.5: each channel's activation maximum now equals its weight maximum (both sqrt(a w))
    for lead, group in (("self_attn.q_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_proj", ("gate_proj", "up_proj"))):
        part = "self_attn" if lead.startswith("self_attn") else "mlp"
        w = weight_absmax([ctx.layer.get_submodule(f"{part}.{g}").weight for g in group])
        torch.testing.assert_close(_input_absmax(ctx, ctx.prefix + lead), w, rtol=1e-4, atol=1e-6)


def test_smooth_linears_adds_the_linear_groups(tokenizer):
    _, ctx = _context("llama", tokenizer)
    before = _layer_outputs(ctx)
    sq = SmoothQuant(SmoothQuantConfig(alpha=0.5, smooth_linears=True), None)
    sq.transform_layer(ctx)
    assert {ctx.prefix + "self_attn.o_proj", ctx.prefix + "mlp.down_proj"} <= set(sq.report)
    for a, b in zip(_layer_outputs(ctx), before):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _w8a8_error(ctx) -> float:
    """Squared error of the layer's output with every linear's weights int8 per channel and its inputs
    int8 per token (dequantized: W8A8's arithmetic up to float rounding)."""
    reference = _layer_outputs(ctx)
    saved = {n: m.weight.data.clone() for n, m in ctx.linears.items()}

    def quantize_input(_m, args):
        q, s = int8_quantize_per_token(args[0])
        return (q.float() * s,) + args[1:]

    handles = [m.register_forward_pre_hook(quantize_input) for m in ctx.linears.values()]
    try:
        for n, m in ctx.linears.items():
            m.weight.data = rtn(saved[n], W8A8, torch.float32).dequantize(torch.float32)
        return sum(float((o - r).pow(2).sum()) for o, r in zip(_layer_outputs(ctx), reference))
    finally:
        for h in handles:
            h.remove()
        for n, m in ctx.linears.items():
            m.weight.data = saved[n]


def test_smoothing_lowers_the_w8a8_error_where_activations_have_outliers(tokenizer):
    _, ctx = _context("llama", tokenizer)
    plain = _w8a8_error(ctx)
    SmoothQuant(SmoothQuantConfig(alpha=0.5), None).transform_layer(ctx)
    smoothed = _w8a8_error(ctx)
    print(f"W8A8 layer error: {plain:.4g} unsmoothed, {smoothed:.4g} smoothed")
    assert smoothed < 0.5 * plain


def test_recipe_runs_and_reports_scales(tiny_models):
    model, report = quantkit.quantize(tiny_models["llama"], "w8a8-smoothquant",
                                      overrides=["calibration.num_samples=4", "calibration.seq_len=32"],
                                      dtype=torch.float32)
    rows = {r["name"]: r for r in report.result.layers}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert q["smoothquant_scale_min"] > 0 and q["smoothquant_scale_max"] >= q["smoothquant_scale_min"]
    assert "smoothquant_scale_max" not in rows["model.layers.0.self_attn.o_proj"]
