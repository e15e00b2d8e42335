"""The engine: requests in, tokens out, one model step at a time for every request in flight.

`Engine.add` queues a request (prompt token ids and sampling parameters); each `Engine.step`
asks the scheduler for the step's work, runs it (`runner.ModelRunner`), samples a token for every
sequence whose step reached its end and commits it through the request's state machine
(`runtime.request.Request`: end tokens, stop strings, budget, streamed text). A sequence that
finishes or is aborted leaves at once and its blocks go back; the next step admits a waiting one.
`Engine.generate` runs a list of prompts to the end (tests, `quantkit generate --engine`); the
server drives the engine from its own thread (`engine.loop`).

Not thread-safe: one thread calls add / abort / step.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

import torch
from torch import nn

from quantkit.engine.blocks import BlockAllocator
from quantkit.engine.kv_pool import KVPool, KVShape, blocks_for_budget, element_bytes
from quantkit.engine.metrics import Metrics
from quantkit.engine.runner import ModelRunner
from quantkit.engine.scheduler import Scheduler, SchedulerConfig
from quantkit.engine.sequence import Sequence, State
from quantkit.errors import ContextLengthError, KVCapacityError
from quantkit.runtime.kv_cache import kv_scales
from quantkit.runtime.request import Completion, Request, context_limit, end_token_ids, request_generator
from quantkit.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_gb: float = 1.0  # the pool's memory budget (ignored when num_blocks is given)
    num_blocks: Optional[int] = None
    block_size: int = 16
    max_num_seqs: int = 32
    max_batched_tokens: int = 256
    prefix_caching: bool = True
    kv_cache_dtype: Optional[str] = None  # None / "auto": the compute dtype; "fp8": e4m3 with the model's k/v scales

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {self.block_size})")
        if self.num_blocks is None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0 (got {self.kv_cache_gb})")
        if self.kv_cache_dtype not in (None, "auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use auto or fp8")


@dataclass
class Finished:
    """A sequence's end, as the engine reports it."""

    seq: Sequence
    completion: Completion
    reason: str  # "stop", "length" or "abort"
    error: Optional[str] = None  # why the engine ended it, when a step failed


def pool_blocks(model: nn.Module, config: EngineConfig) -> int:
    """How many blocks the config's budget holds for this model."""
    if config.num_blocks is not None:
        return config.num_blocks
    dtype = model.get_input_embeddings().weight.dtype
    return blocks_for_budget(int(config.kv_cache_gb * GiB), KVShape.of(model), config.block_size,
                             element_bytes(dtype, config.kv_cache_dtype))


class Engine:
    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        embed = model.get_input_embeddings().weight
        num_blocks = pool_blocks(model, config)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {config.kv_cache_gb} GB holds less than one block of "
                             f"{config.block_size} tokens for this model; raise --kv-cache-gb")
        fp8 = kv_scales(model)[0] if config.kv_cache_dtype == "fp8" else None
        self.pool = KVPool(KVShape.of(model), num_blocks, config.block_size, embed.dtype, embed.device, fp8)
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(config.max_num_seqs, config.max_batched_tokens))
        self.runner = ModelRunner(model, self.pool)
        self.metrics = Metrics()
        self.limit = context_limit(model)
        self.ends = end_token_ids(model, tokenizer)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._callbacks: dict[str, Callable[[Finished], None]] = {}
        self.steps = 0

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.config.block_size

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ContextLengthError / KVCapacityError when a request of this size can never run."""
        if prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        if prompt_tokens + max_new_tokens > self.limit:
            raise ContextLengthError(f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
                                     f"model's context of {self.limit} tokens")
        if prompt_tokens + max_new_tokens > self.capacity_tokens:
            raise KVCapacityError(f"{prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the KV pool's "
                                  f"{self.capacity_tokens} tokens; raise --kv-cache-gb or lower max_tokens")

    def add(self, prompt: Seq[int], params: SamplingParams, request_id: Optional[str] = None,
            on_text: Optional[Callable[[str], None]] = None,
            on_finish: Optional[Callable[[Finished], None]] = None) -> Sequence:
        """Queue a request; on_text streams its text, on_finish gets its end (both on the engine's thread)."""
        prompt = list(prompt)
        self.check_fits(len(prompt), params.max_new_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.sequences:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = Request.start(self.tokenizer, prompt, params, self.vocab, self.ends, emit=on_text,
                            generator=request_generator(params))
        seq = Sequence(rid, req)
        self.sequences[rid] = seq
        if on_finish is not None:
            self._callbacks[rid] = on_finish
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, error: Optional[str] = None) -> bool:
        """End a request now (its blocks go back); False when it is not in flight."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        self._end(seq, "abort", error)
        return True

    @property
    def has_work(self) -> bool:
        return not self.scheduler.idle

    def step(self) -> int:
        """One model step; returns how many tokens it computed (0: nothing to do)."""
        work = self.scheduler.schedule()
        if not work:
            if self.scheduler.waiting:  # nothing running and the first waiting does not fit: cannot happen
                raise RuntimeError("the scheduler admitted nothing with an empty batch (KV pool too small)")
            return 0
        logits = self.runner.step(work)
        ready = time.perf_counter()
        i = 0
        for w in work:
            self.scheduler.advance(w)
            if w.sample:
                req = w.seq.request
                if req.commit(req.sample(logits[i]), ready):
                    self._end(w.seq, req.finish or "length")
                i += 1
        self.steps += 1
        return sum(w.count for w in work)

    def _end(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        self.scheduler.finish(seq)
        self.sequences.pop(seq.id, None)
        req = seq.request
        if reason == "abort":
            req.finish = "abort"
        completion = req.complete(seq.arrived_at)
        n = len(completion.token_ids)
        self.metrics.request_done(reason, len(req.prompt), n, completion.ttft_seconds,
                                  completion.decode_seconds / (n - 1) if n > 1 else 0.0,
                                  completion.ttft_seconds + completion.decode_seconds)
        callback = self._callbacks.pop(seq.id, None)
        if callback is not None:
            callback(Finished(seq, completion, reason, error))

    def generate(self, prompts: Seq[Seq[int]], params, on_text=None) -> list[Completion]:
        """Run every prompt (params: one SamplingParams or one per prompt) to its end; completions in order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        ids = []
        for i, (p, pr) in enumerate(zip(prompts, plist)):
            emit = None if on_text is None else (lambda text, i=i: on_text(i, text))
            seq = self.add(p, pr, on_text=emit, on_finish=lambda f: done.__setitem__(f.seq.id, f.completion))
            ids.append(seq.id)
        while self.has_work:
            self.step()
        return [done[i] for i in ids]

    def gauges(self) -> dict[str, tuple[str, float]]:
        s, a = self.scheduler, self.allocator
        hit = s.prompt_tokens_hit / s.prompt_tokens_queried if s.prompt_tokens_queried else 0.0
        return {
            "requests_running": ("Requests in the running batch.", len(s.running)),
            "requests_waiting": ("Requests waiting to be admitted.", len(s.waiting)),
            "kv_blocks_used": ("KV blocks referenced by running requests.", a.used),
            "kv_blocks_free": ("KV blocks available (free or cached and evictable).", a.available),
            "kv_blocks_cached": ("KV blocks holding a cached prefix.", a.cached),
            "kv_blocks_total": ("KV blocks in the pool.", a.num_blocks),
            "kv_block_size_tokens": ("Tokens per KV block.", a.block_size),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / prompt tokens admitted.", hit),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.", s.prompt_tokens_hit),
            "preemptions": ("Requests preempted (recomputed later) since the start.", s.preemptions),
        }
