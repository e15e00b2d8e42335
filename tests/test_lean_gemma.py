"""The lean Gemma 3 decode step (runtime/lean_gemma.py) against transformers' own forward: logits equal to float32
rounding (bf16 rounding in bf16), for plain and packed int4 weights, either attention; where it runs (a cache
the sliding window holds) and where it leaves the step to transformers; greedy generation unchanged."""

import pytest
import torch

import quantkit
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.runtime import generate as gen
from quantkit.runtime import lean_gemma, one_query
from quantkit.runtime.kv_cache import make_cache
from quantkit.runtime.sampling import SamplingParams
from quantkit.platform.transformers_compat import cache_kwargs

from helpers import sample_ids


def _random_norms(model) -> None:
    """Gemma's norm weights start at zero (a scale of 1 + w): random ones, so a wrong formula shows."""
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = (torch.randn(p.shape, generator=g) * 0.3).to(p.dtype)


def _lean_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    width, total = ids.shape[1] - steps, ids.shape[1]
    cache = make_cache(model, None, max_cache_len=total)
    assert lean_gemma.supports(model, cache)
    pos, mask = torch.arange(total)[None], torch.ones(1, total, dtype=torch.long)
    model.model(input_ids=ids[:, :width], attention_mask=mask[:, :width], position_ids=pos[:, :width],
                use_cache=True, **cache_kwargs(model.model, cache))
    lean = lean_gemma.GemmaLeanDecoder(model, cache)
    return torch.stack([lean.step(ids[:, s : s + 1], s, pos[:, s : s + 1], mask[:, : s + 1])
                        for s in range(width, total)], 1)


@pytest.mark.parametrize("way", ["sdpa", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_step_matches_transformers_forward(tiny_models, tokenizer, dtype, way, monkeypatch):
    """Sliding and full layers (their own RoPE frequencies), per-head q/k norms, the four norms of a layer."""
    from quantkit.kernels import native

    if way == "native" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(one_query, "impl", lambda d: way)
    model = quantkit.load(tiny_models["gemma3_text"], dtype=dtype)
    _random_norms(model)
    ids = sample_ids(tokenizer, 1, 14)
    ours = _lean_logits(model, ids, 6).float()
    ref = model(ids).logits[:, -6:].float()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (ours - ref).abs().max() < tol, float((ours - ref).abs().max())
    if dtype == torch.float32:
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_step_runs_packed_int4_weights(tiny_models, tokenizer, tmp_path, dtype):
    """A W4A16 checkpoint: gate/up fuse into one int4 weight (q/k/v of 64 / 32 / 32 outputs stay apart)."""
    from quantkit.kernels.cpu_int4 import Int4PackedCPU

    out = quantize(str(tiny_models["gemma3_text"]), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]),
                   tmp_path / "q", progress=False).output
    model = quantkit.load(out, dtype=dtype)
    ids = sample_ids(tokenizer, 1, 12)
    ours = _lean_logits(model, ids, 4).float()
    ref = model(ids).logits[:, -4:].float()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (ours - ref).abs().max() < tol, float((ours - ref).abs().max())
    fused = model.quantkit_runtime.fused
    assert all(f is None for f in fused.qkv) and all(isinstance(f[0], Int4PackedCPU) for f in fused.gate_up)


def test_gemma_step_runs_only_where_the_window_holds_the_cache(tiny_models):
    """The tiny model's window is 16 slots: a 16-slot cache runs the step, a 17-slot one (its sliding layers
    would roll) and an FP8 cache keep transformers' forward; so do other architectures."""
    model = quantkit.load(tiny_models["gemma3_text"], dtype=torch.float32)
    assert model.config.sliding_window == 16
    assert lean_gemma.supports(model, make_cache(model, None, max_cache_len=16))
    assert not lean_gemma.supports(model, make_cache(model, None, max_cache_len=17))
    assert not lean_gemma.supports(model, make_cache(model, "fp8", max_cache_len=8))
    llama = quantkit.load(tiny_models["llama"], dtype=torch.float32)
    assert not lean_gemma.supports(llama, make_cache(llama, None, max_cache_len=8))


def test_generate_runs_the_gemma_step_with_transformers_greedy_tokens(tiny_models, tokenizer, monkeypatch):
    """float32 greedy generation through the Gemma step (counted) gives transformers' forward's tokens."""
    model = quantkit.load(tiny_models["gemma3_text"], dtype=torch.float32)
    _random_norms(model)
    prompt = sample_ids(tokenizer, 1, 6)[0].tolist()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    steps = []
    real = lean_gemma.GemmaLeanDecoder.step
    monkeypatch.setattr(lean_gemma.GemmaLeanDecoder, "step", lambda self, *a: steps.append(1) or real(self, *a))
    ours = gen.generate(model, tokenizer, prompt, params).token_ids
    assert len(steps) == 7
    monkeypatch.setattr(lean_gemma, "supports", lambda *a: False)
    assert gen.generate(model, tokenizer, prompt, params).token_ids == ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("way", ["torch", "native"])
def test_gemma_norm_computes_the_modules_norm(dtype, way, monkeypatch):
    """The module itself where torch's way is chosen (bit-identical); the native kernel (another summation order)
    within a few ulps, rows of 640 and per-head rows of 256."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from quantkit.kernels import native
    from quantkit.runtime import row_norm

    if way == "native" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(row_norm, "impl", lambda d: way)
    g = torch.Generator().manual_seed(0)
    ulp = torch.finfo(dtype).eps * (2 if dtype == torch.bfloat16 else 4)
    for width, shape in ((640, (1, 1, 640)), (256, (1, 1, 4, 256))):
        norm = Gemma3RMSNorm(width, eps=1e-6).to(dtype)
        norm.weight.data = (torch.randn(width, generator=g) * 0.5).to(dtype)
        for scale in (1e-3, 1.0, 30.0):
            x = (torch.randn(shape, generator=g) * scale).to(dtype)
            got, want = row_norm.gemma_rms_norm(x, norm), norm(x)
            if way == "torch":
                assert torch.equal(got, want)
            else:
                assert got.dtype == dtype and ((got.double() - want.double()).abs() <= ulp * want.double().abs()).all()
