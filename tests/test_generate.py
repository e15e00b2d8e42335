"""The basic generate loop: greedy equals transformers' greedy; sampling is seeded; streaming is whole."""

import torch

import quantkit
from quantkit.runtime.generate import SamplingConfig, generate, sample_next

from helpers import sample_ids


def test_greedy_matches_transformers(tiny_models, tokenizer):
    for arch in ("llama", "gemma3_text"):
        model = quantkit.load(tiny_models[arch], dtype=torch.float32)
        prompt = sample_ids(tokenizer, 1, 12)
        ours = generate(model, tokenizer, prompt[0].tolist(), SamplingConfig(max_new_tokens=10))
        ref = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=3)
        expected = ref[0, prompt.shape[1]:].tolist()
        n = len(ours.token_ids)
        assert ours.token_ids == expected[:n], arch
        assert (ours.finish_reason == "length" and n == 10) or (ours.finish_reason == "stop" and expected[n] == 2)


def test_streamed_text_equals_final_text(tiny_llama, tokenizer):
    model = quantkit.load(tiny_llama, dtype=torch.float32)
    pieces = []
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=3)
    res = generate(model, tokenizer, sample_ids(tokenizer, 1, 8)[0].tolist(), cfg, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == res.text


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    draws = [sample_next(logits, cfg, gen(s)) for s in range(40)]
    assert set(draws) == {1, 2}  # top-k keeps the two largest
    assert draws == [sample_next(logits, cfg, gen(s)) for s in range(40)]
    top_p = SamplingConfig(temperature=1.0, top_p=0.4)
    assert {sample_next(logits, top_p, gen(s)) for s in range(40)} == {1}  # token 1 alone reaches p=0.4
    assert sample_next(logits, SamplingConfig(temperature=0.0), gen(0)) == 1
