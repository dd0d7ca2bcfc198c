"""What each target (a pool; later a replica) holds in vLLM's prefix cache, as the gateway sees it.

vLLM v1 caches a prompt's KV by blocks of `block_size` tokens, each keyed by a hash chained on its parent's, so one
hash names the whole prefix that ends with its block. The gateway computes the same hashes from the token ids it
sends (`block_hashes`, as vllm.v1.core.kv_cache_utils' `hash_block_tokens` with the default `sha256` algorithm: only
full blocks, the first one chained on NONE_HASH) and keeps, per target, an LRU of the blocks it dispatched there,
bounded by the target's KV-cache capacity in blocks (vLLM's num_gpu_blocks). `cached_tokens` is then the longest
prefix of a prompt that target should still hold. It is a prediction: the engine also caches output blocks, running
requests pin blocks the index counts as evictable, and a restarted engine starts empty (`forget`). Where the engine
publishes its KV-cache events (services/common/kv_events.py), they correct it: blocks it stored (`stored`), evicted
(`removed`) or dropped all at once (`forget`); in a pool of several servers, `ServerBlocks` keeps a block in the pool's
index while any of them still holds it.

A request's cache salt (vLLM's `cache_salt`: an API key's, where keys' caches are kept apart) is hashed into its first
block as vLLM does, so one key's blocks never match another's, here as in the engine. A dual-mode engine's base-mode
requests carry the mode's salt too (swiftkv_core.dual_mode `cache_salt`), hashed alike: one target (a pool) then holds
both models' blocks apart within one capacity, as the engine's one KV cache does, and its events name them as here.

Blocks are keyed as vLLM's events name them (`block_key`: the hash's last 8 bytes as an integer, vLLM's default
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), so an event's hashes and the gateway's own meet.

No vLLM import: the gateway image has none. The hashes match the engines' own when both use the same seed
(PYTHONHASHSEED, else vLLM's fixed seed for sha256), though routing needs them consistent only within the gateway.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from collections import OrderedDict
from typing import Sequence

from services.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for cryptographic hashes when PYTHONHASHSEED is unset
_PROTOCOL = pickle.HIGHEST_PROTOCOL  # vLLM's `sha256` pickles with it


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block (vLLM's NONE_HASH for sha256)."""
    if seed is None:
        seed = os.getenv("PYTHONHASHSEED", DEFAULT_SEED)
    return _sha256(seed)


def block_key(block_hash: bytes | int) -> int:
    """A block as vLLM's KV-cache events name it: an integer as they are, else the hash's last 8 bytes."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(block_hash[-8:], "big")


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, parent: bytes | None = None,
                 salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none). Token ids must be Python
    ints, as vLLM's are: the hash is over their pickled tuple. `salt` is the request's cache_salt, which vLLM hashes
    into a prompt's first block only: give it for a chain that starts at the prompt's first token."""
    parent = none_hash() if parent is None else parent
    # (parent, block tokens, extra keys): extra keys (LoRA, multimodal, cache salt) are None for a plain prompt
    extra = (("cache_salt", salt),) if salt else None
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start:start + block_size]), extra))
        extra = None
        out.append(parent)
    return out


class PrefixIndex:
    """Per target, an LRU of the block hashes dispatched there, at most `capacity_blocks` of them (or the target's own
    capacity, `set_capacity`). Thread-safe: one lock around dictionary updates; hashing happens outside it, once per
    request, for every target."""

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE, seed: str | None = None):
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be at least 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._none_hash = none_hash(seed)
        self._targets: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}  # targets whose engine reported its KV-cache capacity
        self._lock = threading.Lock()

    def set_capacity(self, target: str, blocks: int) -> None:
        """`target`'s engine holds `blocks` blocks of KV cache (vLLM's num_gpu_blocks)."""
        with self._lock:
            self._capacity[target] = max(1, blocks)
            self._trim(target)

    def _trim(self, target: str) -> None:
        lru = self._targets.get(target)
        limit = self._capacity.get(target, self.capacity_blocks)
        while lru and len(lru) > limit:
            lru.popitem(last=False)

    def hashes(self, token_ids: Sequence[int], parent: bytes | None = None, salt: str | None = None) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids`, continuing the chain after `parent` when given, else
        from the prompt's start with its cache salt `salt` (an API key's blocks then never meet another key's)."""
        if parent is not None:
            return block_hashes(token_ids, self.block_size, parent)
        return block_hashes(token_ids, self.block_size, self._none_hash, salt)

    def record(self, target: str, hashes: Sequence[bytes | int]) -> None:
        """`target` was sent a prompt with these blocks, or its engine says it stored them: they become its most
        recently used. Inserted last block first, so that at capacity a chain loses its tail before its head (as vLLM
        frees a request's blocks), which keeps the shorter prefix findable."""
        if not hashes:
            return
        with self._lock:
            lru = self._targets.setdefault(target, OrderedDict())
            for h in reversed(hashes):
                key = block_key(h)
                lru[key] = None
                lru.move_to_end(key)
            self._trim(target)

    def removed(self, target: str, hashes: Sequence[bytes | int]) -> None:
        """`target`'s engine evicted these blocks from its prefix cache."""
        with self._lock:
            lru = self._targets.get(target)
            if lru:
                for h in hashes:
                    lru.pop(block_key(h), None)

    def cached_tokens(self, target: str, hashes: Sequence[bytes | int]) -> int:
        """Tokens of the longest prefix of these blocks that `target` holds (a lookup; it refreshes nothing)."""
        with self._lock:
            lru = self._targets.get(target)
            if not lru:
                return 0
            n = 0
            for h in hashes:
                if block_key(h) not in lru:
                    break
                n += 1
        return n * self.block_size

    def forget(self, target: str) -> None:
        """The target's cache is gone (its engine went down or restarted)."""
        with self._lock:
            self._targets.pop(target, None)

    def blocks(self, target: str) -> int:
        with self._lock:
            return len(self._targets.get(target, ()))


class ServerBlocks:
    """Which of a pool's servers hold each block, from their KV-cache events: in a pool of several servers one server's
    eviction (or cleared cache) takes a block out of the pool's index only when no other server of the pool still
    holds it. Thread-safe: each server's events arrive on a feed thread of their own."""

    def __init__(self):
        self._held: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def add(self, server: str) -> None:
        with self._lock:
            self._held.setdefault(server, set())

    @property
    def servers(self) -> int:
        with self._lock:
            return len(self._held)

    def stored(self, server: str, hashes: Sequence[bytes | int]) -> None:
        with self._lock:
            self._held.setdefault(server, set()).update(block_key(h) for h in hashes)

    def removed(self, server: str, hashes: Sequence[bytes | int]) -> list[int]:
        """`server` evicted these blocks: those no server of the pool holds any more."""
        with self._lock:
            mine = self._held.setdefault(server, set())
            keys = [block_key(h) for h in hashes]
            mine.difference_update(keys)
            return [k for k in keys if not any(k in held for held in self._held.values())]

    def cleared(self, server: str) -> list[int]:
        """`server` dropped its whole cache: the blocks it held that no other server of the pool holds."""
        with self._lock:
            mine, self._held[server] = self._held.get(server, set()), set()
            return [k for k in mine if not any(k in held for held in self._held.values())]

    def forget(self) -> None:
        """The pool went down: no server holds anything."""
        with self._lock:
            for held in self._held.values():
                held.clear()
