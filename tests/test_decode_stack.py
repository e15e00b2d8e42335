"""The native decode stack (runtime/decode_stack.py, kernels/native_stack.cpp): every decoder layer of a one-token
step in one native call, bit-identical to the Python lean step it replaces, for plain bf16 / float32 weights
(each one-token GEMV implementation), packed int4 weights (torch's op or the native GEMV, bf16 and narrowed
float32), biases; and left to the Python step where it cannot run a layer."""

import pytest
import torch

import quantkit
from quantkit.flow.job import quantize
from quantkit.flow.recipe import load_recipe
from quantkit.kernels import native
from quantkit.platform import compute
from quantkit.qmodules.int_linear import PackedIntLinear
from quantkit.runtime import decode_stack, lean_decode, one_query
from quantkit.runtime.kv_cache import make_cache
from quantkit.platform.transformers_compat import cache_kwargs

from helpers import sample_ids
from test_native_kernels import _count_calls

pytestmark = pytest.mark.skipif(native.module() is None, reason=f"native kernels not built: {native.reason()}")


def _steps(model, ids: torch.Tensor, steps: int, stack: bool, monkeypatch, prepare=None,
           decoder=lean_decode.LeanDecoder):
    """(logits [1, steps, vocab] of the lean step at the last `steps` positions, the decoder), with the native
    stack allowed or not; the attention by the native call (the stack's condition)."""
    monkeypatch.setattr(one_query, "impl", lambda d: "native")
    monkeypatch.setenv(decode_stack.ENV, "1" if stack else "0")
    width, total = ids.shape[1] - steps, ids.shape[1]
    cache = make_cache(model, None, max_cache_len=total)
    lean = decoder(model, cache)
    if prepare is not None:
        prepare(lean)
    pos, mask = torch.arange(total)[None], torch.ones(1, total, dtype=torch.long)
    model.model(input_ids=ids[:, :width], attention_mask=mask[:, :width], position_ids=pos[:, :width],
                use_cache=True, **cache_kwargs(model.model, cache))
    logits = torch.stack([lean.step(ids[:, s : s + 1], s, pos[:, s : s + 1], mask[:, : s + 1])
                          for s in range(width, total)], 1)
    return logits, lean


def _same_as_python(model, tokenizer, monkeypatch, prepare=None, decoder=lean_decode.LeanDecoder):
    ids = sample_ids(tokenizer, 1, 12)
    want, _ = _steps(model, ids, 5, False, monkeypatch, prepare, decoder)
    made = _count_calls(monkeypatch, "DecodeStack")
    got, lean = _steps(model, ids, 5, True, monkeypatch, prepare, decoder)
    assert len(made) == 1 and lean._stack is not None  # made once, used for every step
    assert got.dtype == want.dtype and torch.equal(got, want)
    return lean


def _model(tokenizer, tmp_path, arch: str, int4: bool, dtype: torch.dtype):
    """A tiny llama, qwen2 (biases on q/k/v) or Gemma 3 (random norm weights; a sliding and a full layer) with 64
    outputs per projection, so int4 q/k/v fuse too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(sliding_window=16, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]) \
        if arch == "gemma3_text" else {}
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                  tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if arch == "qwen2":  # random biases (they start at zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data = torch.randn_like(proj.bias) * 0.1
    for name, param in model.named_parameters():
        if arch == "gemma3_text" and "norm" in name:  # Gemma's norms scale by 1 + weight, zero at first
            param.data = torch.randn_like(param) * 0.3
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    path = tmp_path / "m"
    if int4:
        path = quantize(str(path), load_recipe("rtn-w4a16", ["stages.0.scheme.group_size=32"]), tmp_path / "q",
                        progress=False).output
    return quantkit.load(path, dtype=dtype)


@pytest.mark.parametrize("gemv", ["linear", "mv", "native"])
def test_stack_equals_the_python_step_for_bf16_weights(tiny_llama, tokenizer, gemv, monkeypatch):
    if gemv == "native" and compute.NATIVE_GEMV not in compute.gemv_impls(torch.bfloat16):
        pytest.skip("this build has no native bf16 GEMV")
    monkeypatch.setattr(compute, "gemv_impl", lambda dtype: gemv)
    _same_as_python(quantkit.load(tiny_llama, dtype=torch.bfloat16), tokenizer, monkeypatch)


@pytest.mark.parametrize("norm", ["torch", "native"])
def test_stack_equals_the_python_step_for_float32_weights(tiny_llama, tokenizer, norm, monkeypatch):
    """float32 weights stored column-major (F.linear over a transposed view); either RMSNorm."""
    from quantkit.runtime import row_norm

    monkeypatch.setattr(row_norm, "impl", lambda d: norm)
    _same_as_python(quantkit.load(tiny_llama, dtype=torch.float32), tokenizer, monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("way", ["op", "native", "float32 narrowed"])
def test_stack_equals_the_python_step_for_int4_weights(tokenizer, tmp_path, arch, way, monkeypatch):
    """Packed int4 q/k/v, o, gate/up and down (qwen2: q/k/v with biases) by torch's op, by the native GEMV, or
    in bf16 under float32 activations (a decode plan's narrowed choice): each layer's fused weights in the stack."""
    from quantkit.kernels import cpu_int4

    if way == "native" and cpu_int4.native_reason() is not None:
        pytest.skip(cpu_int4.native_reason())
    model = _model(tokenizer, tmp_path, arch, True, torch.float32 if way == "float32 narrowed" else torch.bfloat16)
    for m in model.modules():
        if isinstance(m, PackedIntLinear):
            m.one_token = "native" if way == "native" else "op"
            m.op_dtype = torch.bfloat16 if way == "float32 narrowed" else None
    lean = _same_as_python(model, tokenizer, monkeypatch)
    fused = model.quantkit_runtime.fused
    assert all(isinstance(f[0], cpu_int4.Int4PackedCPU) for f in fused.qkv + fused.gate_up)
    assert all(f[0].native_one_token is (way == "native") for f in fused.qkv + fused.gate_up)
    assert (lean.plans[0].qkv[0].bias is not None) is (arch == "qwen2")


def test_stack_leaves_what_it_cannot_run_to_the_python_step(tiny_models, tokenizer, monkeypatch):
    """qwen3's per-head q/k norms, a batch of two, the SDPA attention choice and QUANTKIT_NATIVE_STACK=0: no stack."""
    made = _count_calls(monkeypatch, "DecodeStack")
    ids = sample_ids(tokenizer, 2, 8)
    qwen3 = quantkit.load(tiny_models["qwen3"], dtype=torch.float32)
    _, lean = _steps(qwen3, ids[:1], 2, True, monkeypatch)
    assert lean._stack is None and not made
    llama = quantkit.load(tiny_models["llama"], dtype=torch.float32)
    _, lean = _steps(llama, ids[:1], 2, True, monkeypatch)
    assert lean._stack is not None and len(made) == 1
    for batch, attention, env in ((ids, "native", "1"), (ids[:1], "sdpa", "1"), (ids[:1], "native", "0")):
        made.clear()
        cache = make_cache(llama, None, max_cache_len=8)
        lean = lean_decode.LeanDecoder(llama, cache)
        monkeypatch.setattr(one_query, "impl", lambda d, a=attention: a)
        monkeypatch.setenv(decode_stack.ENV, env)
        pos, mask = torch.arange(8)[None].expand(batch.shape[0], -1), torch.ones(batch.shape[0], 8, dtype=torch.long)
        llama.model(input_ids=batch[:, :7], attention_mask=mask[:, :7], position_ids=pos[:, :7], use_cache=True,
                    **cache_kwargs(llama.model, cache))
        lean.step(batch[:, 7:], 7, pos[:, 7:], mask)
        assert not made, (batch.shape, attention, env)


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["torch", "native"])
def test_stack_equals_the_python_step_for_gemma(tokenizer, tmp_path, int4, dtype, norm, monkeypatch):
    """Gemma 3 (runtime/lean_gemma.py): per-head q/k norms, norms after attention and around the MLP (Gemma's
    formula, by torch's ops or the native kernel), GELU, a RoPE table per layer type; plain or int4 weights."""
    from quantkit.runtime import lean_gemma, row_norm

    monkeypatch.setattr(row_norm, "impl", lambda d: norm)
    model = _model(tokenizer, tmp_path, "gemma3_text", int4, dtype)
    lean = _same_as_python(model, tokenizer, monkeypatch, decoder=lean_gemma.GemmaLeanDecoder)
    assert lean.kinds == ["full_attention", "sliding_attention"] and len(lean.plans) == 2
