"""A pool of several servers of one model (a remote pool with several URLs): which replica serves a request.

A prompt's replica is found by rendezvous hashing of its distinctive prefix: the hash of the prefix-cache block
(vLLM's own chained block hash) that ends past the first `min_distinct_tokens` tokens. Every prompt that shares that
prefix (a conversation's turns, the questions about one document) ranks the replicas in the same order, in every
gateway process and pod, with nothing shared between them, so it lands where its prefix is cached. Prompts that
share only a shorter prefix (a common system prompt) get keys of their own and spread over the replicas. The load
bounds the affinity: a replica whose work in flight (prompt tokens plus `decode_token_cost` per output token asked)
exceeds the least loaded replica's by more than `load_margin_tokens` is passed over for the next in the order, so a
popular document does not make a hotspot. A prompt too short to have a distinctive prefix goes to the least loaded.

A replica that is down (unreachable, or failing before a token) is left out until its health check passes again; the
pool is down only when every replica is.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from prometheus_client import Counter

from services.common.prefix_index import block_hashes

from .backend import BackendDown, GenerateRequest, Output

log = logging.getLogger("swiftkv.replicas")

# Reasons a replica was chosen: its prefix's first choice, the next one past a loaded first choice, or no prefix
AFFINITY, SPILL, LEAST_LOADED = "affinity", "spill", "least_loaded"
replica_choices = Counter("swiftkv_replica_choices", "Replicas chosen inside a pool of several servers, by reason",
                          ("pool", "replica", "reason"))


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, min_distinct_tokens: int, salt: str | None = None) -> bytes | None:
    """The hash of the prefix-cache block that ends past the first min_distinct_tokens tokens (the prompt's distinctive
    prefix), salted as the engine caches it (an API key's own cache: its copy of a prefix has a replica of its own);
    None for a prompt too short to have one."""
    blocks = min_distinct_tokens // block_size + 1
    if len(prompt_token_ids) < blocks * block_size:
        return None
    return block_hashes(prompt_token_ids[: blocks * block_size], block_size, salt=salt)[-1]


def rendezvous(key: bytes, replicas: Sequence[str]) -> list[str]:
    """`replicas` ranked for `key` (highest random weight first): the same order for the same key everywhere, and
    removing one replica moves only the keys it ranked first."""
    return sorted(replicas, key=lambda r: hashlib.sha256(key + r.encode()).digest(), reverse=True)


@dataclass
class ReplicaChooser:
    replicas: list[str]
    block_size: int = 16
    min_distinct_tokens: int = 256
    load_margin_tokens: float = 2048.0
    decode_token_cost: float = 4.0

    def __post_init__(self) -> None:
        self.work = dict.fromkeys(self.replicas, 0.0)
        self.up = dict.fromkeys(self.replicas, True)
        self._turn = itertools.count()

    def key(self, prompt_token_ids: Sequence[int], salt: str | None = None) -> bytes | None:
        return prefix_key(prompt_token_ids, self.block_size, self.min_distinct_tokens, salt)

    def cost(self, request: GenerateRequest) -> float:
        return len(request.prompt_token_ids) + self.decode_token_cost * request.sampling.max_tokens * max(request.sampling.n, 1)

    def choose(self, request: GenerateRequest) -> tuple[str, str]:
        """(replica, reason) for the request; BackendDown when no replica is up."""
        live = [r for r in self.replicas if self.up[r]]
        if not live:
            raise BackendDown("no replica is up")
        least = min(self.work[r] for r in live)
        key = self.key(request.prompt_token_ids, request.key_salt)
        if key is None:
            # least loaded; among equals, in turn (a quiet pool still spreads its short requests)
            tied = [r for r in live if self.work[r] == least]
            return tied[next(self._turn) % len(tied)], LEAST_LOADED
        for rank, replica in enumerate(rendezvous(key, live)):
            if self.work[replica] - least <= self.load_margin_tokens:
                return replica, AFFINITY if rank == 0 else SPILL
        raise AssertionError("the least loaded replica is always within the margin")


class ReplicaSet:
    """A Backend over several backends serving one model (`replicas`: name -> backend), each request sent to the
    replica `ReplicaChooser` picks; a replica that fails before its first token is marked down and the request tried
    once on another."""
    starts_alongside = False

    def __init__(self, name: str, replicas: dict, chooser: ReplicaChooser):
        self.name = name
        self.replicas = replicas
        self.chooser = chooser

    async def start(self) -> None:
        errors = []
        for replica, backend in self.replicas.items():
            try:
                await backend.start()
                self.chooser.up[replica] = True
            except BackendDown as e:
                self.chooser.up[replica] = False
                errors.append(str(e))
        if not any(self.chooser.up.values()):
            raise BackendDown(f"pool {self.name}: no replica is reachable ({'; '.join(errors)})")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        tried: set[str] = set()
        while True:
            replica, reason = self.chooser.choose(request)
            if replica in tried:
                raise BackendDown(f"pool {self.name}: every replica failed")
            tried.add(replica)
            replica_choices.labels(self.name, replica, reason).inc()
            cost = self.chooser.cost(request)
            self.chooser.work[replica] += cost
            sent = False
            try:
                async for out in self.replicas[replica].generate(request):
                    sent = True
                    yield out
                return
            except BackendDown:
                if sent:
                    raise
                log.warning("pool %s: replica %s is down; trying another", self.name, replica)
                self.chooser.up[replica] = False
            finally:
                self.chooser.work[replica] -= cost

    def prefix_cache(self) -> None:
        return None

    def replica_count(self) -> int:
        """The servers not marked down (by their last health check or a request that found them down)."""
        return sum(self.chooser.up.values())

    def kv_event_endpoints(self) -> list[str]:
        return [e for backend in self.replicas.values() for e in backend.kv_event_endpoints()]

    async def health(self) -> bool:
        for replica, backend in self.replicas.items():
            self.chooser.up[replica] = await backend.health()
        return any(self.chooser.up.values())

    async def recover(self) -> None:
        await self.start()

    async def stop(self) -> None:
        for backend in self.replicas.values():
            await backend.stop()
