"""One request inside the engine: its tokens, its block table and how far its KV is computed.

A sequence wraps the runner's `runtime.request.Request` (sampling state, detokenizer, stop
strings, streamed text) and adds what the scheduler needs: the block table, `computed` (how many
of its tokens have keys and values in the pool), the prefix keys of its full blocks, and its
state. Its tokens are the prompt then every committed token; the last committed token is fed at
the next step, so a running sequence in decode has exactly one token not yet computed. A
preempted sequence loses its blocks and `computed` goes back to 0: it is prefilled again from
all its tokens (cached prefix blocks permitting, cheaply) and continues where it was.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from quantkit.runtime.request import Request


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    id: str
    request: Request
    arrived_at: float = field(default_factory=time.perf_counter)
    state: State = State.WAITING
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the pool
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks (computed or not)
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache at its first admission
    admitted: bool = False  # admitted at least once (the first admission counts the prefix hit)
    preemptions: int = 0
    abort_reason: Optional[str] = None
    first_scheduled_at: Optional[float] = None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.request.tokens

    @property
    def length(self) -> int:
        return len(self.request.prompt) + len(self.request.tokens)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.length - self.computed

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def max_length(self) -> int:
        """The most tokens it can hold: prompt + its token budget."""
        return len(self.request.prompt) + self.request.budget
