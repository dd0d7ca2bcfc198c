"""Ray Serve's request router for a pool's replicas: the replica choice of services/serving/replicas.py (rendezvous
hashing of the prompt's distinctive prefix, bounded by load) inside Ray Serve, through its request-router extension
point (`RequestRouterConfig.request_router_class`, as Ray Serve LLM's PrefixCacheAffinityRouter plugs in).

Every gateway process routes through its own handle and router; they agree without sharing state, because the order
comes from the prompt alone. Load is the replicas' queue lengths as Ray Serve's router caches them: the prefix's first
replica is passed over when it holds more than `max_imbalance` requests beyond the least loaded candidate. Ray Serve
then picks the least loaded replica with capacity within the first rank that has one.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .replicas import prefix_key, rendezvous


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, min_distinct_tokens: int = 256, max_imbalance: int = 4, **_):
        self.block_size, self.min_distinct_tokens, self.max_imbalance = block_size, min_distinct_tokens, max_imbalance

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        return rank(candidate_replicas, pending_request, self.block_size, self.min_distinct_tokens, self.max_imbalance,
                    lambda replica: self.replica_queue_len_cache.get(replica.replica_id))


def rank(candidates: list, pending_request, block_size: int, min_distinct_tokens: int, max_imbalance: int,
         queue_len) -> list[list]:
    """Ranks of candidates: the prefix's replicas in rendezvous order, one per rank, with those loaded beyond the bound
    moved last; without a distinctive prefix (or a request the router cannot read), one rank of all of them."""
    request = pending_request.args[0] if pending_request is not None and pending_request.args else None
    tokens = getattr(request, "prompt_token_ids", None)
    key = None if tokens is None else prefix_key(tokens, block_size, min_distinct_tokens, getattr(request, "key_salt", None))
    if key is None or len(candidates) < 2:
        return [list(candidates)]
    by_id = {replica.replica_id.unique_id: replica for replica in candidates}
    ordered = [by_id[i] for i in rendezvous(key, list(by_id))]
    lengths = {id(r): queue_len(r) or 0 for r in ordered}
    least = min(lengths.values())
    within = [r for r in ordered if lengths[id(r)] - least <= max_imbalance]
    beyond = [r for r in ordered if lengths[id(r)] - least > max_imbalance]
    return [[r] for r in within] + ([beyond] if beyond else [])
