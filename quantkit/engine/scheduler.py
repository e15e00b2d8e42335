"""The iteration-level scheduler: which tokens of which sequences the next model step computes.

Every step, under a budget of `max_batched_tokens`:
  1. every running sequence in decode gets its one token (oldest first);
  2. running sequences still prefilling get their next chunk (chunked prefill: a long prompt is
     computed over several steps, so it never stalls the decodes of the others);
  3. waiting sequences are admitted first come, first served while the budget, `max_num_seqs` and
     the pool allow: each takes the cached blocks of its prompt's longest cached prefix
     (`blocks.BlockAllocator.match`) and computes only the rest.
A sequence's blocks are taken as its tokens arrive. When a running sequence needs a block and
none is available, the newest running sequence is preempted (its blocks returned, recomputed
later, first in line), never failed or dropped; a new sequence is admitted only when its first
chunk's blocks are available without preempting anyone. A finished or aborted sequence leaves at
once (`finish`) and its blocks go back.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from quantkit.engine.blocks import BlockAllocator, block_keys
from quantkit.engine.sequence import Sequence, State


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running sequences at most
    max_batched_tokens: int = 256  # tokens computed per step at most (decodes + prefill chunks)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) >= 1: every running sequence decodes one token per step")


@dataclass
class Work:
    """One sequence's share of a step: `count` tokens from position `start`; `sample`: the step
    computes its last uncomputed token, so a token is sampled from its logits."""

    seq: Sequence
    start: int
    count: int

    @property
    def sample(self) -> bool:
        return self.start + self.count == self.seq.length


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig):
        self.allocator, self.config = allocator, config
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.preemptions = 0
        self.prompt_tokens_queried = 0  # prompt tokens looked up in the prefix cache (first admissions)
        self.prompt_tokens_hit = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Work]:
        """The work of the next step (empty when there is none)."""
        budget, work = self.config.max_batched_tokens, []
        for phase in ("decode", "prefill"):
            for seq in list(self.running):
                if seq.state is not State.RUNNING or (seq.remaining == 1) != (phase == "decode") or budget == 0:
                    continue
                count = min(seq.remaining, budget)
                if self._grow_or_preempt(seq, count):
                    work.append(Work(seq, seq.computed, count))
                    budget -= count
        work = [w for w in work if w.seq.state is State.RUNNING]  # a later preemption may have taken one back
        budget = self.config.max_batched_tokens - sum(w.count for w in work)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            work.append(admitted)
            budget -= admitted.count
        now = time.perf_counter()
        for w in work:
            if w.seq.first_scheduled_at is None:
                w.seq.first_scheduled_at = now
        return work

    def _blocks_needed(self, seq: Sequence, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(seq.blocks))

    def _grow_or_preempt(self, seq: Sequence, count: int) -> bool:
        """Give `seq` the blocks for `count` more tokens, preempting the newest running sequences while
        none are available. False when `seq` itself had to be preempted."""
        need = self._blocks_needed(seq, seq.computed + count)
        while self.allocator.available < need:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        seq.blocks.extend(self.allocator.allocate() for _ in range(need))
        return True

    def _admit(self, seq: Sequence, budget: int) -> Optional[Work]:
        """Admit `seq` with a first chunk of at most `budget` tokens when its blocks are available."""
        tokens = seq.tokens
        seq.keys = block_keys(tokens, self.block_size, seq.keys)
        # at least the last token is computed (its logits give the next token): never all of it cached
        usable = seq.keys[: (len(tokens) - 1) // self.block_size]
        cached = self.allocator.match(usable)
        count = min(len(tokens) - len(cached) * self.block_size, budget)
        need = -(-(len(cached) * self.block_size + count) // self.block_size) - len(cached)
        if self.allocator.available < need:
            for block in reversed(cached):
                self.allocator.release(block)
            return None
        seq.blocks = cached + [self.allocator.allocate() for _ in range(need)]
        seq.computed = len(cached) * self.block_size
        if not seq.admitted:
            seq.admitted, seq.cached_prompt_tokens = True, min(seq.computed, len(seq.request.prompt))
            self.prompt_tokens_queried += len(seq.request.prompt)
            self.prompt_tokens_hit += seq.cached_prompt_tokens
        seq.state = State.RUNNING
        self.running.append(seq)
        return Work(seq, seq.computed, count)

    def preempt(self, seq: Sequence) -> None:
        """Return `seq`'s blocks and put it first in line, to be recomputed."""
        self._release(seq)
        seq.computed, seq.state = 0, State.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def advance(self, work: Work) -> None:
        """After a step computed `work`: count its tokens and key its newly full blocks."""
        seq = work.seq
        seq.computed = work.start + work.count
        full = seq.computed // self.block_size
        if full > 0 and self.allocator.prefix_caching:
            if len(seq.keys) < full:
                seq.keys = block_keys(seq.tokens[: full * self.block_size], self.block_size, seq.keys)
            for k in range(work.start // self.block_size, full):
                self.allocator.register(seq.blocks[k], seq.keys[k])

    def finish(self, seq: Sequence) -> None:
        """`seq` leaves (finished or aborted), wherever it is; its blocks go back."""
        if seq.state is State.RUNNING:
            self.running.remove(seq)
        elif seq.state is State.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.state = State.FINISHED

    def _release(self, seq: Sequence) -> None:
        # the tail first: the prefix's first blocks are then the most recently used, evicted last
        for block in reversed(seq.blocks):
            self.allocator.release(block)
        seq.blocks = []
