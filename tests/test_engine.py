"""The serving engine: greedy outputs equal `generate`'s, prefix caching, preemption, block accounting,
attention over the pool against a dense reference, and the block allocator's bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from quantkit.engine.attention import Chunk, DecodeGroup, StepLayout, attend, paged_attention
from quantkit.engine.blocks import BlockAllocator, block_keys, chain_key
from quantkit.engine.engine import Engine, EngineConfig
from quantkit.engine.kv_pool import KVPool, KVShape
from quantkit.errors import ContextLengthError, KVCapacityError
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams

ARCHS = ("llama", "qwen3", "gemma3_text")


@pytest.fixture(scope="module")
def float_models(tiny_models):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for a, p in tiny_models.items()}


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(4, 500) for _ in range(shared)]
    return [head + [rng.randrange(4, 500) for _ in range(rng.randrange(3, 50))] for _ in range(n)]


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_equals_generate(float_models, tokenizer, arch, concurrency):
    """Each request's tokens through the engine equal `generate` on that request alone (float32), at
    concurrency 1 and 8, then again with every prompt's blocks cached (prefix hits)."""
    model = float_models[arch]
    prompts = _prompts(concurrency, seed=concurrency, shared=20)
    expected = [generate(model, tokenizer, p, GREEDY).token_ids for p in prompts]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=256, block_size=4))
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    assert engine.allocator.evictions == 0 and engine.scheduler.preemptions == 0
    before = engine.scheduler.prompt_tokens_hit
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    # every full block of every prompt is cached now (the last token is always computed)
    assert engine.scheduler.prompt_tokens_hit - before == sum((len(p) - 1) // 4 * 4 for p in prompts)
    engine.allocator.check_idle()


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_by_a_tiny_pool_keeps_outputs(float_models, tokenizer, arch):
    """A pool of 24 blocks x 4 tokens for 8 requests of up to 73 tokens: requests are preempted and recomputed,
    none fails, and every output equals generate's; chunked prefill with 16 tokens per step."""
    model = float_models[arch]
    prompts = _prompts(8, seed=3)
    expected = [generate(model, tokenizer, p, GREEDY).token_ids for p in prompts]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=24, block_size=4, max_batched_tokens=16, max_num_seqs=8))
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    assert engine.scheduler.preemptions > 0
    engine.allocator.check_idle()


def test_sampled_outputs_follow_the_seed_not_the_batch(float_models, tokenizer):
    """Sampling uses each request's own seeded generator: a request's tokens are the same alone or among others."""
    model = float_models["llama"]
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    prompts = _prompts(4, seed=11)
    alone = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=4)).generate(prompts[:1], params)[0]
    together = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=4)).generate(prompts, params)[0]
    assert alone.token_ids == together.token_ids == generate(model, tokenizer, prompts[0], params).token_ids


def test_soak_with_aborts_returns_every_block(float_models, tokenizer):
    """200 requests of random lengths, a fifth aborted at random moments (a client going away) while others
    arrive: afterwards every block is free or cached and no block is referenced."""
    model = float_models["qwen3"]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=40, block_size=4, max_batched_tokens=32, max_num_seqs=8))
    rng = random.Random(5)
    pending = [(p, SamplingParams(max_new_tokens=rng.randrange(1, 12), ignore_eos=rng.random() < 0.5))
               for p in _prompts(200, seed=5, shared=8)]
    ended, live = [], []
    while pending or engine.has_work:
        for _ in range(rng.randrange(0, 4)):
            if pending:
                prompt, params = pending.pop()
                live.append(engine.add(prompt, params, on_finish=ended.append).id)
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
    assert len(ended) == 200
    assert sum(f.reason == "abort" for f in ended) > 10
    assert engine.scheduler.prompt_tokens_hit > 0 and engine.scheduler.preemptions >= 0
    engine.allocator.check_idle()
    assert not engine.sequences and engine.scheduler.idle


def test_requests_that_cannot_fit_are_refused(float_models, tokenizer):
    engine = Engine(float_models["llama"], tokenizer, EngineConfig(num_blocks=8, block_size=4))
    with pytest.raises(KVCapacityError, match="raise --kv-cache-gb"):
        engine.add(list(range(4, 30)), SamplingParams(max_new_tokens=10))
    with pytest.raises(ContextLengthError, match="context of 512"):
        Engine(float_models["llama"], tokenizer, EngineConfig(num_blocks=200, block_size=4)).add(
            list(range(4, 500)), SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.add([], SamplingParams())


def test_fp8_pool_equals_the_runner_fp8_cache(float_models, tokenizer):
    """kv_cache_dtype=fp8: the pool keeps e4m3 codes and the runner's FP8 cache keeps the same values
    dequantized; greedy outputs agree, and the pool takes a quarter of float32's bytes."""
    model = float_models["llama"]
    prompts = _prompts(3, seed=2)
    expected = [generate(model, tokenizer, p, GREEDY, kv_cache_dtype="fp8").token_ids for p in prompts]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=4, kv_cache_dtype="fp8"))
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    plain = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=4))
    assert engine.pool.nbytes * 4 == plain.pool.nbytes


# --- attention over the pool against dense attention -------------------------------------------------------------


class _Module:
    layer_idx = 0


def _dense(q, k, v, positions, window, softcap, scale):
    """Reference: every query of one sequence against its keys 0..pos (and pos - key < window)."""
    out = []
    for i, pos in enumerate(positions):
        keep = torch.arange(k.shape[1]) <= pos
        if window is not None:
            keep &= (pos - torch.arange(k.shape[1])) < window
        rep = q.shape[0] // k.shape[0]
        s = torch.einsum("hd,hkd->hk", q[:, i], k.repeat_interleave(rep, 0)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~keep, float("-inf"))
        out.append(torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v.repeat_interleave(rep, 0)))
    return torch.stack(out, 1)  # [H, n, d]


@pytest.mark.parametrize("way", ["sdpa", "native"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0), (6, 30.0)])
def test_paged_attention_matches_dense(window, softcap, way, monkeypatch):
    """Two decoding sequences and two prefill chunks (one with a cached context, one fresh), scattered over
    the pool's blocks in random order, against dense attention per sequence; the decoding ones by SDPA or the
    native one-query kernel (`runtime.one_query`: soft-capped scores always take the reference path)."""
    from quantkit.kernels import native
    from quantkit.runtime import one_query

    if way == "native" and native.module() is None:
        pytest.skip(f"native kernels not built: {native.reason()}")
    monkeypatch.setattr(one_query, "impl", lambda dtype: way)
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 8, 4
    pool = KVPool(KVShape(1, kv_heads, d), 16, bs, torch.float32, torch.device("cpu"))
    free = list(torch.randperm(16).tolist())
    lengths, counts = [9, 13, 11, 6], [1, 1, 4, 6]  # context lengths after the step, new tokens
    seqs, tables = [], []
    for length in lengths:
        k, v = torch.randn(kv_heads, length, d), torch.randn(kv_heads, length, d)
        blocks = [free.pop() for _ in range(-(-length // bs))]
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(length)])
        seqs.append((k, v, slots))
        tables.append(torch.tensor(blocks))
    for (k, v, slots), n in zip(seqs, counts):  # the earlier context is already in the pool
        pool.write(0, k.transpose(0, 1)[:-n], v.transpose(0, 1)[:-n], slots[:-n])
    q = torch.randn(1, heads, sum(counts), d)
    new_k = torch.cat([k[:, -n:] for (k, _, _), n in zip(seqs, counts)], 1)[None]
    new_v = torch.cat([v[:, -n:] for (_, v, _), n in zip(seqs, counts)], 1)[None]
    step_slots = torch.cat([s[-n:] for (_, _, s), n in zip(seqs, counts)])
    decode = DecodeGroup(torch.tensor([0, 1]), torch.nn.utils.rnn.pad_sequence(tables[:2], True),
                         torch.tensor(lengths[:2]), bs)
    chunks = [Chunk(2, 4, lengths[2], tables[2]), Chunk(6, 6, lengths[3], tables[3])]
    layout = StepLayout(pool, step_slots, decode, chunks)
    out, _ = paged_attention(_Module(), q, new_k, new_v, None, scaling=0.3, sliding_window=window, softcap=softcap,
                             quantkit_step=layout)
    row = 0
    for (k, v, _), n, length in zip(seqs, counts, lengths):
        ref = _dense(q[0, :, row : row + n], k, v, range(length - n, length), window, softcap, 0.3)
        torch.testing.assert_close(out[0, row : row + n].transpose(0, 1), ref, rtol=1e-5, atol=1e-5)
        row += n


def test_attend_softcap_path_equals_sdpa_without_cap_in_the_limit():
    """A huge cap leaves scores unchanged: the eager soft-capping path equals SDPA (causal and masked)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(attend(q, k, v, None, True, 0.35, 1e9), attend(q, k, v, None, True, 0.35, None))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(attend(q, k, v, mask, False, 0.35, 1e9), attend(q, k, v, mask, False, 0.35, None))


# --- the block allocator ------------------------------------------------------------------------------------------


def test_prefix_keys_chain_and_fixed_values():
    assert chain_key(None, [1, 2, 3, 4]).hex() == chain_key(None, (1, 2, 3, 4)).hex()
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same tokens in block 1, other prefix: other key
    assert a[1] == chain_key(a[0], [5, 6, 7, 8])
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, known=a) == a


def test_allocator_reuses_cached_blocks_and_evicts_least_recent():
    alloc = BlockAllocator(4, 2)
    b0, b1 = alloc.allocate(), alloc.allocate()
    keys = block_keys([1, 2, 3, 4], 2)
    alloc.register(b0, keys[0])
    alloc.register(b1, keys[1])
    alloc.release(b1)
    alloc.release(b0)  # released last: most recently used
    assert alloc.available == 4 and alloc.cached == 2
    assert alloc.match(keys) == [b0, b1] and alloc.refs[b0] == 1 == alloc.refs[b1]
    for b in (b1, b0):
        alloc.release(b)
    taken = [alloc.allocate() for _ in range(3)]  # two free, then the least recently released cached one (b1)
    assert b1 in taken and b0 not in taken and alloc.evictions == 1
    assert alloc.match(keys) == [b0]  # the chain stops where its block was evicted
    alloc.release(b1)
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.release(b1)


def test_plan_reports_the_tokens_the_serving_pool_holds(tiny_llama, tokenizer):
    """`quantkit plan --kv-cache-gb` says how many tokens `quantkit serve --kv-cache-gb` gets, to the token."""
    import dataclasses

    from quantkit.checkpoints.loader import load
    from quantkit.flow.job import plan
    from quantkit.flow.recipe import load_recipe

    result = dataclasses.replace(plan(str(tiny_llama), load_recipe("rtn-w4a16"), device="cpu", measure=False),
                                 kv_pool_bytes=3 << 20)
    model = load(tiny_llama, dtype=result.compute_dtype)
    engine = Engine(model, tokenizer, EngineConfig(kv_cache_gb=3 / 1024))
    assert engine.capacity_tokens == result.kv_pool_tokens > 0
    assert f"--kv-cache-gb {3 / 1024:g}: {result.kv_pool_tokens} tokens" in result.format()


def test_fp8_pool_with_calibrated_scales_equals_the_runner(tiny_llama, tokenizer, tmp_path):
    """A checkpoint with calibrated k/v scales (recipe fp8-kv): the pool's e4m3 blocks use them, and greedy
    outputs equal the runner's FP8 cache on the same loaded model."""
    from quantkit.checkpoints.loader import load
    from quantkit.flow.job import quantize
    from quantkit.flow.recipe import load_recipe
    from quantkit.runtime.kv_cache import kv_scales

    out = tmp_path / "fp8kv"
    quantize(str(tiny_llama), load_recipe("fp8-kv", ["calibration.num_samples=4", "calibration.seq_len=32"]), out,
             progress=False)
    model = load(out, dtype="float32")
    scales, calibrated = kv_scales(model)
    assert calibrated and all(float(k.max()) != 1.0 for k, _ in scales.values())
    prompts = _prompts(3, seed=4)
    expected = [generate(model, tokenizer, p, GREEDY, kv_cache_dtype="fp8").token_ids for p in prompts]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64, block_size=4, kv_cache_dtype="fp8"))
    assert torch.equal(engine.pool.scales[0][0].flatten(), scales[0][0].float().flatten())
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
