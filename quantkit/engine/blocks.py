"""KV-cache blocks: an allocator with reference counts and a prefix cache (bookkeeping only, no tensors).

The pool (`engine.kv_pool`) holds `num_blocks` blocks of `block_size` token slots per layer; this
module decides which block holds what. A block is *free* (nothing in it worth keeping), *in use*
(reference count > 0: the block tables of that many requests point at it) or *cached free*
(count 0, but it holds a full block of tokens whose key is registered, so a later request with
the same prefix can take it back without computing it).

Prefix keys: block k of a token sequence is keyed by a digest of block k-1's key and block k's
token ids (`chain_key`), so equal keys mean equal tokens from position 0 on, and with them equal
keys and values in every layer. Only full blocks are keyed. When a block is needed and none is
free, the least recently released cached block is evicted (its key forgotten).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Optional, Sequence


def chain_key(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """The prefix key of a full block: blake2b of the previous block's key and this block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_keys(tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of every full block of `tokens` (the first len(known) taken from `known`)."""
    keys = list(known[: len(tokens) // block_size])
    for k in range(len(keys), len(tokens) // block_size):
        keys.append(chain_key(keys[-1] if keys else None, tokens[k * block_size : (k + 1) * block_size]))
    return keys


class BlockAllocator:
    """Which KV blocks are free, in use (with their reference counts) or cached for a prefix."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached_free)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        """Blocks holding a registered prefix (in use or not)."""
        return len(self._key_of)

    def allocate(self) -> int:
        """A block for new tokens (reference count 1); evicts the least recently used cached block
        when no block is free. Raises RuntimeError when every block is in use (callers check `available`)."""
        if self._free:
            block = self._free.popleft()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise RuntimeError("no KV block available (the scheduler must preempt before allocating)")
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; at zero a keyed block stays cached (most recently used), another is free."""
        if self.refs[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key_of:
                self._cached_free[block] = None
            else:
                self._free.append(block)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` found, each taken (reference + 1)."""
        found = []
        if not self.prefix_caching:
            return found
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._cached_free[block]
            self.refs[block] += 1
            found.append(block)
        return found

    def register(self, block: int, key: bytes) -> None:
        """Record that `block` (in use, now full) holds the tokens keyed `key`; a key already held by
        another block keeps that one (this block stays unkeyed and is freed as usual)."""
        if self.prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def check_idle(self) -> None:
        """Raise unless every block is unreferenced and free or cached (after all requests ended)."""
        held = [b for b, r in enumerate(self.refs) if r != 0]
        if held or self.available != self.num_blocks:
            raise AssertionError(f"KV blocks still held: {len(held)} referenced ({held[:8]}...), "
                                 f"{self.available} of {self.num_blocks} available")
