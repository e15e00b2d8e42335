"""The runner: sampler stages (exact values and order), seeded sampling independent of the batch,
stop strings, incremental detokenization, the batched generate loop against transformers'
greedy, speculative decoding, and the chat command."""

import pytest
import torch

import quantkit
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.runtime.detokenize import IncrementalDetokenizer
from quantkit.runtime import lean_decode
from quantkit.runtime.generate import generate, generate_batch
from quantkit.runtime.kv_cache import make_cache
from quantkit.runtime.sampling import (SamplingParams, TokenHistory, apply_min_p, apply_presence_frequency,
                                       apply_repetition_penalty, apply_top_k, apply_top_p, processed_logits, sample)
from quantkit.runtime.speculative import speculative_generate
from quantkit.runtime.stopping import StopStringMatcher
from quantkit.platform.transformers_compat import cache_kwargs

from helpers import sample_ids

INF = float("inf")


# -- sampler stages -----------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    seen = torch.tensor([True, True, False, False])
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([1.0, -4.0, 1.0, -1.0]))


def test_presence_and_frequency_penalties():
    logits = torch.tensor([1.0, 1.0, 1.0])
    counts = torch.tensor([0, 1, 3])
    assert torch.equal(apply_presence_frequency(logits, counts, 0.5, 0.25), torch.tensor([1.0, 0.25, -0.25]))


def test_top_k_top_p_min_p_exact():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert torch.equal(apply_top_k(logits, 2), torch.tensor([3.0, -INF, 2.0, -INF]))
    assert torch.equal(apply_top_k(logits, 0), logits)
    probs = torch.tensor([0.5, 0.1, 0.3, 0.1])
    lp = probs.log()
    # sorted: 0.5, 0.3, 0.1, 0.1 -> the smallest prefix reaching 0.75 is {0, 2}
    kept = apply_top_p(lp, 0.75)
    assert torch.isinf(kept[[1, 3]]).all() and torch.isfinite(kept[[0, 2]]).all()
    assert torch.isfinite(apply_top_p(lp, 0.81)).sum() == 3
    assert torch.isfinite(apply_top_p(lp, 0.1)).sum() == 1  # the top token always stays
    # min-p 0.5: drop below 0.5 * 0.5 = 0.25
    kept = apply_min_p(lp, 0.5)
    assert torch.isfinite(kept).tolist() == [True, False, True, False]


def test_top_p_over_candidates_equals_a_full_sort():
    """top-p ranks only the tokens that can be kept (topk, widened until they hold p): the same set as sorting
    the whole vocabulary, for peaked and flat distributions of Gemma's vocabulary size."""
    def reference(logits, p):
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p
        out = logits.clone()
        out[order[drop]] = -INF
        return out

    gen = torch.Generator().manual_seed(0)
    for scale in (8.0, 2.0, 0.05):  # peaked (a few tokens), wide (hundreds: the candidates widen), nearly flat
        logits = torch.randn(262144, generator=gen) * scale
        for p in (0.5, 0.9, 0.95):
            ours, ref = apply_top_p(logits, p), reference(logits, p)
            kept, kept_ref = torch.isfinite(ours), torch.isfinite(ref)
            assert torch.equal(ours[kept], logits[kept])
            if scale > 1:
                assert torch.equal(kept, kept_ref), (scale, p)
            else:  # ~250000 near-equal probabilities: float32 sums in another order move the edge by a token or two
                assert (kept ^ kept_ref).sum() <= 2 and kept.sum() > 100_000, (scale, p)


def test_stage_order_penalties_then_temperature_then_filters():
    logits = torch.tensor([4.0, 3.0, 0.0])
    seen = torch.tensor([True, False, False])
    counts = torch.zeros(3, dtype=torch.int32)
    # penalty first: 4 / 2 = 2 < 3, so token 1 leads; temperature 0.5 then doubles both
    p = SamplingParams(temperature=0.5, repetition_penalty=2.0, top_k=1)
    assert torch.equal(processed_logits(logits, p, seen, counts), torch.tensor([-INF, 6.0, -INF]))
    # greedy applies the penalties too
    assert sample(logits, SamplingParams(repetition_penalty=2.0), seen, counts, None) == 1
    # top-p after temperature: a low temperature concentrates the mass on one token
    cold = SamplingParams(temperature=0.02, top_p=0.9)  # 50 vs 45: the top token has 99.3%
    assert torch.isfinite(processed_logits(torch.tensor([1.0, 0.9, 0.0]), cold, seen & False, counts)).sum() == 1
    hot = SamplingParams(temperature=10.0, top_p=0.9)
    assert torch.isfinite(processed_logits(torch.tensor([1.0, 0.9, 0.0]), hot, seen & False, counts)).sum() == 3


def test_sampling_is_seeded():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    hist = TokenHistory(4, [])
    p = SamplingParams(temperature=1.0, top_k=2)
    draws = [sample(logits, p, hist.seen, hist.counts, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {1, 2}
    assert draws == [sample(logits, p, hist.seen, hist.counts, torch.Generator().manual_seed(s)) for s in range(40)]


def test_bad_sampling_params_are_rejected():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(max_new_tokens=0), dict(stop=("",)),
                dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- stop strings and detokenization ------------------------------------------------------------

def test_stop_string_split_across_pieces_never_leaks():
    m = StopStringMatcher(("###", "END"))
    out = [m.feed(t) for t in ["Hello #", "#", " world", " E", "N", "D tail"]]
    # "##" then " world": not a stop after all, released; "EN" held, then END completes
    assert "".join(out) == "Hello ## world "
    assert m.stopped and m.flush() == ""
    assert out[0] == "Hello " and out[1] == ""  # "#", "##" were held back
    m2 = StopStringMatcher(("<stop>",))
    assert m2.feed("abc<st") == "abc" and m2.flush() == "<st"  # generation ended: the held text was real
    assert StopStringMatcher(()).feed("x") == "x"


@pytest.mark.parametrize("text", ["Emma 😀 smiled.", "日本語のテキスト", "naïve café — “quoted”", "🇫🇷 flag"])
def test_incremental_detokenization_never_emits_replacement_chars(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # byte-level pieces: characters are split across tokens
    prompt = tokenizer("She said:", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
    assert sum(1 for p in pieces if p) < len(ids) or text.isascii()  # some tokens completed no character


def test_detokenizer_keeps_leading_spaces(tokenizer):
    prompt = tokenizer("It is a truth", add_special_tokens=False)["input_ids"]
    ids = tokenizer(" universally acknowledged", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.add(t) for t in ids) == " universally acknowledged"


# -- the generate loop --------------------------------------------------------------------------

def test_greedy_matches_transformers(tiny_models, tokenizer):
    for arch in ("llama", "gemma3_text"):
        model = quantkit.load(tiny_models[arch], dtype=torch.float32)
        prompt = sample_ids(tokenizer, 1, 12)
        ours = generate(model, tokenizer, prompt[0].tolist(), SamplingParams(max_new_tokens=10, ignore_eos=True))
        ref = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert ours.token_ids == ref[0, prompt.shape[1]:].tolist(), arch
        assert ours.finish_reason == "length"


@pytest.mark.parametrize("cap", [None, 3.0])
def test_the_head_computed_apart_equals_the_models_forward(tiny_models, tokenizer, cap):
    """Gemma 3 over a cache longer than its sliding window (no lean step: runtime/lean_gemma.py) still runs its
    head apart (a GEMV on the last position), final logit softcapping included: the prefill's logits equal
    transformers' forward."""
    from quantkit.runtime.generate import _build_batch, _Forward

    model = quantkit.load(tiny_models["gemma3_text"], dtype=torch.float32)
    model.config.final_logit_softcapping = cap
    ids = sample_ids(tokenizer, 2, 9)
    forward = _Forward(model, make_cache(model, None, max_cache_len=model.config.sliding_window + 4))
    assert forward.lean is None and forward.head is not None
    ours = forward.prefill(_build_batch([row.tolist() for row in ids], 3, 3, ids.device))
    ref = model(ids).logits[:, -1]
    assert (ours - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    if cap is not None:
        assert ref.abs().max() < cap


def _lean_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits of the lean decode step at each of the last `steps` positions of ids [1, S], after a
    transformers prefill of the rest into a StaticCache (as the generate loop runs it)."""
    width, total = ids.shape[1] - steps, ids.shape[1]
    cache = make_cache(model, None, max_cache_len=total)
    lean = lean_decode.LeanDecoder(model, cache)
    pos, mask = torch.arange(total)[None], torch.ones(1, total, dtype=torch.long)
    model.model(input_ids=ids[:, :width], attention_mask=mask[:, :width], position_ids=pos[:, :width],
                use_cache=True, **cache_kwargs(model.model, cache))
    return torch.stack([lean.step(ids[:, s : s + 1], s, pos[:, s : s + 1], mask[:, : s + 1])
                        for s in range(width, total)], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("way", ["torch", "native"])
def test_lean_rms_norm_computes_the_modules_norm(dtype, way, monkeypatch):
    """torch's path bit-identical to the module; the native kernel (another summation order) within a few ulps."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from quantkit.kernels import native
    from quantkit.runtime import row_norm

    if way == "native" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(row_norm, "impl", lambda d: way)
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = (torch.randn(576, generator=g) * 0.5 + 1).to(dtype)
    ulp = torch.finfo(dtype).eps * (2 if dtype == torch.bfloat16 else 4)  # see test_native_kernels
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(3, 1, 576, generator=g) * scale).to(dtype)
        got, want = lean_decode._rms_norm(x, norm), norm(x)
        if way == "torch":
            assert torch.equal(got, want), scale
        else:
            assert got.dtype == dtype and ((got.double() - want.double()).abs() <= ulp * want.double().abs()).all()


@pytest.mark.parametrize("way", ["sdpa", "native", "stack"])
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.float32), ("llama", torch.bfloat16)])
def test_lean_decode_step_matches_transformers_forward(tiny_models, tokenizer, arch, dtype, way, monkeypatch):
    """The lean step (fused q/k/v and gate/up, fused RMSNorm, GEMVs) against transformers' own
    full forward of the same sequence: equal to float32 rounding, and to bf16 rounding in bf16. Attention by
    SDPA, or natively (llama's fused q/k/v: RoPE, the cache write and attention in one native call), or every
    layer in one native call (the decode stack: llama; qwen3's per-head norms keep the Python step)."""
    from quantkit.kernels import native
    from quantkit.runtime import decode_stack, one_query

    if way != "sdpa" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(one_query, "impl", lambda d: "sdpa" if way == "sdpa" else "native")
    monkeypatch.setenv(decode_stack.ENV, "1" if way == "stack" else "0")
    fused_calls = []
    if way != "sdpa":
        from test_native_kernels import _count_calls

        fused_calls = _count_calls(monkeypatch, "rope_store_attend" if way == "native" else "DecodeStack")
    model = quantkit.load(tiny_models[arch], dtype=dtype)
    assert lean_decode.supports(model)
    ids = sample_ids(tokenizer, 1, 14)
    ours = _lean_logits(model, ids, 6).float()
    assert bool(fused_calls) is (way != "sdpa" and arch == "llama")  # qwen3's per-head norms: torch ops
    fused = model.quantkit_runtime.fused
    assert all(f is not None for f in fused.qkv + fused.gate_up)  # the fused path ran
    ref = model(ids).logits[:, -6:].float()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (ours - ref).abs().max() < tol, float((ours - ref).abs().max())
    if dtype == torch.float32:
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_float32_decode_weights_go_column_major_with_the_same_values(tiny_models, tokenizer, tmp_path):
    """float32 on the CPU: the fused q/k/v and gate/up weights, o, down and the head are re-stored
    column-major (a transposed view of one [in, out] tensor) with the same values; the logits before
    and after the re-layout are equal, tied embeddings stay tied, and the model still saves the same
    tensors. bf16 weights keep their row-major layout."""
    from safetensors.torch import load_file

    model = quantkit.load(tiny_models["llama"], dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = sample_ids(tokenizer, 1, 14)
    ref = model(ids).logits[:, -6:]  # before any re-layout
    ours = _lean_logits(model, ids, 6)
    assert (ours - ref).abs().max() < 1e-4 and torch.equal(model(ids).logits[:, -6:], ref)
    layer = model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj, layer.self_attn.o_proj,
                layer.mlp.down_proj, model.get_output_embeddings()):
        assert lin.weight.stride(0) == 1, lin
    qkv = model.quantkit_runtime.fused.qkv[0][0]
    assert qkv.t().is_contiguous() and layer.self_attn.k_proj.weight.data_ptr() == \
        qkv.data_ptr() + layer.self_attn.q_proj.out_features * qkv.element_size()  # a view, not a copy
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "saved")  # state_dict() restores the row-major layout first
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) <= set(before) and all(torch.equal(saved[k], before[k]) for k in saved)
    assert layer.self_attn.o_proj.weight.is_contiguous() and model.quantkit_runtime.fused is None
    assert torch.equal(_lean_logits(model, ids, 6), ours)  # and the next decode re-lays it out
    assert layer.self_attn.o_proj.weight.stride(0) == 1
    model16 = quantkit.load(tiny_models["llama"], dtype=torch.bfloat16)
    _lean_logits(model16, ids, 2)
    assert model16.model.layers[0].self_attn.o_proj.weight.is_contiguous()


def test_lean_decode_step_runs_packed_int4_modules(tiny_llama, tokenizer, draft_model):
    """A W4A16 checkpoint: gate/up (128 outputs each) fuse into one CPU int4 weight; q/k/v cannot
    (k/v have 32 outputs, the op packs rows in blocks of 64) and stay separate modules. Same logits."""
    from quantkit.kernels.cpu_int4 import Int4PackedCPU

    ids = sample_ids(tokenizer, 1, 12)
    ref = draft_model(ids).logits[:, -4:]
    ours = _lean_logits(draft_model, ids, 4)
    fused = draft_model.quantkit_runtime.fused
    qkv, gate_up = fused.qkv, fused.gate_up
    assert all(f is None for f in qkv) and all(isinstance(f[0], Int4PackedCPU) for f in gate_up)
    assert (ours - ref).abs().max() < 1e-4
    assert (draft_model(ids).logits[:, -4:] - ref).abs().max() == 0  # the modules, re-pointed, still agree


def test_lean_decode_fuses_int4_qkv_without_copying_weights(tokenizer, tmp_path):
    """With 64-row multiples everywhere q/k/v fuse too; each module's kernel weight becomes a view of
    the fused one (no second copy), and logits stay those of transformers' forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.kernels.cpu_int4 import Int4PackedCPU

    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = quantize(str(tmp_path / "m"), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
                   progress=False).output
    model = quantkit.load(out, dtype=torch.float32)
    ids = sample_ids(tokenizer, 1, 12)
    ref = model(ids).logits[:, -4:]
    ours = _lean_logits(model, ids, 4)
    assert (ours - ref).abs().max() < 1e-4
    fused, _, sizes = model.quantkit_runtime.fused.qkv[0]
    assert isinstance(fused, Int4PackedCPU) and sizes == [64, 64, 64]
    attn = model.model.layers[0].self_attn
    starts = [m._prepared[2].packed.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    row = fused.packed.stride(0) * fused.packed.element_size()
    assert starts == [fused.packed.data_ptr() + i * 64 * row for i in range(3)]


def test_lean_int4_linears_run_the_op_directly_in_bf16_with_the_modules_results(tiny_llama, tokenizer, tmp_path,
                                                                                  monkeypatch):
    """float32 activations with the CPU int4 op in bf16 (a decode plan's narrowed choice, said): the
    step calls the op directly (o/down as `_Int4`, no module call) and leaves its bf16 output to the
    consumers, which promote it to float32 exactly: each call equals the module's output, with and
    without a bias, and the step's logits equal transformers' forward through the same modules."""
    from quantkit.qmodules.int_linear import PackedIntLinear

    out = quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
                   progress=False).output
    model = quantkit.load(out, dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, PackedIntLinear):
            m.op_dtype = torch.bfloat16  # as a decode plan that chose narrowed int4 activations sets it
    ids = sample_ids(tokenizer, 1, 12)
    ref = model(ids).logits[:, -4:]
    ours = _lean_logits(model, ids, 4)
    assert ours.dtype == torch.float32 and (ours - ref).abs().max() < 1e-4
    lean = lean_decode.LeanDecoder(model, make_cache(model, None, max_cache_len=4))
    down = model.model.layers[0].mlp.down_proj
    lin = lean.plans[0].down
    assert type(lin) is lean_decode._Int4 and lin.packed.dtype == torch.bfloat16
    x = torch.randn(3, 1, down.in_features, generator=torch.Generator().manual_seed(0))
    y = lean_decode._run(lin, x)
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), down(x))
    down.bias = torch.nn.Parameter(torch.randn(down.out_features), requires_grad=False)
    y = lean_decode._run(lean_decode._resolve(down, x.device, torch.float32), x)
    assert y.dtype == torch.float32 and torch.equal(y, down(x))


@pytest.mark.parametrize("way", ["sdpa", "native"])
def test_batch_of_different_lengths_equals_single_requests(tiny_llama, tokenizer, way, monkeypatch):
    """Padded rows (a mask) and single requests agree, with attention by SDPA or the native kernels."""
    from quantkit.kernels import native
    from quantkit.runtime import one_query

    if way == "native" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(one_query, "impl", lambda d: way)
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    prompts = [sample_ids(tokenizer, 1, n)[0].tolist() for n in (5, 12, 9)]
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    seeded = [SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    for params in ([greedy] * 3, seeded):
        batch = generate_batch(model, tokenizer, prompts, params)
        for prompt, p, got in zip(prompts, params, batch):
            alone = generate(model, tokenizer, prompt, p)
            assert got.token_ids == alone.token_ids and got.text == alone.text
    # a request's sampled tokens do not depend on its neighbours
    other = generate_batch(model, tokenizer, [prompts[0], prompts[2]], [seeded[0], seeded[2]])
    assert other[0].token_ids == generate_batch(model, tokenizer, prompts, seeded)[0].token_ids


def test_stop_strings_and_finish_reasons(tiny_llama, tokenizer):
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    prompt = sample_ids(tokenizer, 1, 8)[0].tolist()
    full = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "the greedy text is blank around its middle"
    pieces = []
    res = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)),
                   on_text=pieces.append)
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == full.text[: full.text.index(stop)] and "".join(pieces) == res.text
    assert stop not in "".join(pieces)
    # an end token: stop, and not part of the output
    end = full.token_ids[3]
    res = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(end,)))
    assert res.finish_reason == "stop" and res.stop_reason == end and end not in res.token_ids


def test_streamed_text_equals_final_text(tiny_llama, tokenizer):
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    pieces = []
    res = generate(model, tokenizer, sample_ids(tokenizer, 1, 8)[0].tolist(),
                   SamplingParams(max_new_tokens=12, temperature=1.0, seed=3), on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == res.text
    assert res.ttft_seconds > 0 and res.prompt_tokens == 8


def test_context_limit_caps_generation(tiny_llama, tokenizer, caplog):
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    limit = model.config.max_position_embeddings
    prompt = (sample_ids(tokenizer, 1, 24)[0].tolist() * limit)[: limit - 3]
    with caplog.at_level("WARNING"):
        res = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(res.token_ids) == 3 and res.finish_reason == "length" and "capped" in caplog.text
    with pytest.raises(ValueError, match="leaves no room"):
        generate(model, tokenizer, prompt + [5, 5, 5], SamplingParams(max_new_tokens=2))


# -- speculative decoding ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_model(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "w4"
    quantize(str(tiny_llama), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), out, progress=False)
    return quantkit.load(out, dtype=torch.float32)


def test_speculative_greedy_is_plain_greedy(tiny_llama, tokenizer, draft_model):
    target = quantkit.load(tiny_llama, dtype=torch.float32)
    for n in (6, 13):
        prompt = sample_ids(tokenizer, 1, n)[0].tolist()
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        plain = generate(target, tokenizer, prompt, params)
        for k in (1, 3, 5):
            spec, stats = speculative_generate(target, draft_model, tokenizer, prompt, params, k)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text, (n, k)
            assert 0 <= stats.acceptance_rate <= 1 and stats.proposed == stats.rounds * k
    # the target as its own draft accepts everything
    _, stats = speculative_generate(target, target, tokenizer, prompt, params, 4)
    assert stats.acceptance_rate == 1.0


def test_lean_draft_equals_the_full_forward_draft(tokenizer, draft_model):
    """The speculative draft through the lean step over a StaticCache gives the logits of the
    transformers forward over a cropped DynamicCache, including after a rejected draft is rolled back."""
    from transformers import DynamicCache

    from quantkit.runtime.speculative import _LeanDraft, _Model

    lean, full = _LeanDraft(draft_model, 40), _Model(draft_model, DynamicCache(config=draft_model.config))
    seq = sample_ids(tokenizer, 1, 10)[0].tolist()
    for tokens in (seq, seq + [5], seq + [5, 7, 9], seq + [5, 8, 11, 12], seq + [5, 8], seq + [5, 8, 11, 6, 13]):
        assert (lean.last_logits(tokens) - full.last_logits(tokens)).abs().max() < 1e-4, len(tokens)


def test_speculative_sampling_keeps_the_target_distribution(tiny_llama, tokenizer, draft_model):
    """First-token frequencies over many seeds, speculative vs plain sampling from the target, on a
    4-token support (top_k 4: the draft's top 4 differ from the target's, so rejections and the
    residual distribution are exercised). 400 draws each; the bound is statistical: the TV distance
    of two samples of one 4-way distribution stays below 0.12 with overwhelming probability."""
    target = quantkit.load(tiny_llama, dtype=torch.float32)
    prompt = sample_ids(tokenizer, 1, 6)[0].tolist()
    plain, spec, accepted, proposed = {}, {}, 0, 0
    for s in range(400):
        params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=4, seed=s, ignore_eos=True)
        a = generate(target, tokenizer, prompt, params).token_ids[0]
        (b, stats) = speculative_generate(target, draft_model, tokenizer, prompt, params.__class__(
            **{**params.__dict__, "seed": 10_000 + s}), 2)
        plain[a] = plain.get(a, 0) + 1
        spec[b.token_ids[0]] = spec.get(b.token_ids[0], 0) + 1
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    tv = 0.5 * sum(abs(plain.get(t, 0) - spec.get(t, 0)) / 400 for t in set(plain) | set(spec))
    assert len(plain) >= 3 and set(spec) <= set(plain) | set(spec)
    assert tv < 0.12, (tv, plain, spec)
    assert 0 < accepted < proposed  # some drafts kept, some rejected


# -- chat -------------------------------------------------------------------------------------------

def test_chat_command_keeps_history(tiny_llama, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    # the tiny tokenizer has no chat template: the command must say so
    result = CliRunner().invoke(main, ["chat", str(tiny_llama), "-n", "4"], input="hello\n\n")
    assert result.exit_code != 0 and "no chat template" in result.output


def test_chat_keeps_the_conversation(tiny_llama, tmp_path, monkeypatch):
    """With a chat template, every turn's prompt holds the whole history (system, user, assistant...)."""
    import shutil

    from click.testing import CliRunner

    import quantkit.cli.generate as gen_cli
    from quantkit.cli import main

    model_dir = tmp_path / "chatty"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    seen = []
    real = gen_cli.chat_ids

    def recording(tokenizer, messages):
        seen.append([dict(m) for m in messages])
        return real(tokenizer, messages)

    monkeypatch.setattr(gen_cli, "chat_ids", recording)
    result = CliRunner().invoke(main, ["chat", str(model_dir), "-n", "3", "--system", "Be brief."],
                                input="hello\nand again\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("model> ") == 2 and "tok/s" in result.output
    turns = seen[1:]  # seen[0] is the template check
    assert [m["role"] for m in turns[0]] == ["system", "user"]
    assert [m["role"] for m in turns[1]] == ["system", "user", "assistant", "user"]
    assert turns[1][1]["content"] == "hello" and turns[1][3]["content"] == "and again"


# -- the request state machine (runtime.request), shared by plain and speculative generation ----

def test_request_finishes_on_end_token_stop_string_and_budget(tokenizer):
    from quantkit.runtime.request import Request

    prompt = tokenizer("It is a truth", add_special_tokens=False)["input_ids"]
    words = tokenizer(" universally acknowledged that a single man", add_special_tokens=False)["input_ids"]
    vocab, end = len(tokenizer), 2
    # the budget: the third token finishes it with "length", and every token is kept
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=3), vocab, {end})
    assert [r.commit(t) for t in words[:3]] == [False, False, True] and r.finish == "length"
    assert r.tokens == words[:3] and r.complete(0.0).token_ids == words[:3]
    # an end token finishes it with "stop" and is not kept (unless ignore_eos); a stop token id likewise
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=8), vocab, {end})
    assert not r.commit(words[0]) and r.commit(end) and (r.finish, r.stop_reason, r.tokens) == ("stop", end, words[:1])
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), vocab, {end})
    assert not r.commit(end) and r.tokens == [end]
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=8, stop_token_ids=(words[1],)), vocab, {end})
    assert not r.commit(words[0]) and r.commit(words[1]) and r.stop_reason == words[1]
    # a stop string: the text ends before it, nothing of it is streamed, and it is the stop reason
    streamed = []
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=len(words), stop=("single",)), vocab, {end},
                      emit=streamed.append)
    for t in words:
        if r.commit(t):
            break
    done = r.complete(0.0)
    assert done.finish_reason == "stop" and done.stop_reason == "single"
    assert "single" not in done.text and "".join(streamed) == done.text
    assert done.text == tokenizer.decode(done.token_ids).split("single")[0] and done.text.strip()
    # nothing finished it: complete() says "length" and releases the text held back for a possible stop string
    text = tokenizer.decode(words[:4])
    r = Request.start(tokenizer, prompt, SamplingParams(max_new_tokens=8, stop=(text[-2:] + "\x00",)), vocab, {end})
    for t in words[:4]:
        r.commit(t)
    assert r.text == text[:-2]  # its last two characters could start the stop string
    done = r.complete(0.0)
    assert done.finish_reason == "length" and done.text == text


def test_loaded_model_keeps_its_kernel_request_and_fused_weights(draft_model, tiny_llama, monkeypatch, tmp_path):
    """QUANTKIT_KERNEL is read when the model is loaded, not per forward; use_kernel changes it. The
    lean step's fused projections live in the model's runtime state and are made once."""
    from quantkit.kernels.select import use_kernel
    from quantkit.qmodules.int_linear import PackedIntLinear

    source = draft_model.quantkit_source
    monkeypatch.setenv("QUANTKIT_KERNEL", "torch")
    model = quantkit.load(source, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, PackedIntLinear)]
    assert model.quantkit_runtime.kernel == "torch" and all(m.kernel_request == "torch" for m in linears)
    monkeypatch.setenv("QUANTKIT_KERNEL", "cpu")  # too late for this model
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = model(ids).logits
    assert {m.kernel for m in linears} == {"torch"}
    assert use_kernel(model, "auto") == len(linears)
    assert torch.allclose(model(ids).logits, ref, atol=1e-4) and {m.kernel for m in linears} == {"cpu"}
    monkeypatch.delenv("QUANTKIT_KERNEL")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    tok = quantkit.load_tokenizer(source)
    first = generate(model, tok, [5, 6, 7], params)
    fused = model.quantkit_runtime.fused
    assert fused is not None and generate(model, tok, [5, 6, 7], params).token_ids == first.token_ids
    assert model.quantkit_runtime.fused is fused  # not made again
