"""Route policy: which pool serves a request, and why.

Prompt-heavy requests (prompt tokens / expected output tokens >= threshold) go to the `swiftkv` pool (the SwiftKV
model, whose prefill is cheaper), the others to `base` (the base model): that is the intent. Two predictions may
override it:

- Load (`routing.balance`): each pool's predicted work is what its requests in flight still need (prompt tokens not
  yet prefilled and not found cached, plus `decode_token_cost` per expected output token not yet ended) and this
  request's own. When the intended pool's exceeds the other's by more than `balance_margin_tokens`, the other serves:
  at capacity both engines stay busy (the intent alone left the base engine idle while the SwiftKV engine's queue
  grew), and at low load the intent stands. A faster pool drains its work sooner and so takes more. The pools are
  compared by work, not by seconds at each pool's measured prefill rate: measured under load, a rate reflects the
  engine's batch at that moment, and comparing by it sent too much to whichever pool was momentarily less loaded
  (docs/benchmarks.md, "pools compared by measured prefill rate"). The measured rate predicts each request's time to
  first token for the metrics, beside the measured one.
- Prefix cache (`routing.cache_aware`): the prompt tokens a pool holds cached (services.common.prefix_index) cost it
  no prefill, so a conversation's next turn stays where its history is cached unless the other pool's predicted work
  is lower even with the cold prefill. Only the cached tokens beyond `prefix_min_distinct_tokens` count (a system
  prompt everyone shares must not pin traffic), and a pool's load counts against its cache (no hotspot).

The intent (the ratio, or a pool's own model name) fixes the model that runs the request (`Decision.mode`). Where the
overrides (or a fallback) move it to the other pool and that pool is dual-mode (its engines run the SwiftKV checkpoint
and serve both models per request, swiftkv_core/dual_mode.py), it runs there as the intended model: only the engine
changed, and prompt-heavy traffic at capacity runs as SwiftKV on both pools. As both engines then run the same model
for it, the less loaded one serves it (no `balance_margin_tokens`). Moved to a pool that is not, it runs as
that pool's model. The prefix override may also switch the model on a dual-mode pool, to where the prompt is cached
(a conversation's history answered by the base model keeps its next turn there). The two models' prefix-cache blocks are never shared, so the index keys a pool's blocks by the
model too (`cache_key`: the pool's name for its own model, `base+swiftkv` for the SwiftKV model on the base pool).

With API keys, each key's prefix cache is its own unless `routing.share_prefix_cache`: its requests carry vLLM's
`cache_salt` (`key_salt`, a digest of the key) and the index hashes their blocks with it, so a prompt another key sent
is neither found cached nor routed to (which would tell that key what the other sent, and where).

Reasons (a small fixed set, used as a metric label and in the logs; in the `x-swiftkv-route` header only with
`routing.expose_reason`, `pool=...; reason=...; ratio=...`, else `pool=...`, then `; mode=...` where the model is not
the pool's own):
  ratio      the prompt/output ratio chose the pool
  backlog    the ratio's pool holds more predicted work than the other by more than the margin
  prefix     the other pool holds more of the prompt in its prefix cache and predicts less work for it
  fallback   the ratio's pool is down
  pinned     the client asked for a pool's own model name
  single     only one pool is configured
  batch_steered  a Batch API line moved off a pool busy with live traffic (`RoutePolicy.steer_batch`)
  no_speculation  the request samples with logit_bias or min_p, which vLLM refuses under speculative decoding: it goes
             to the pool whose engines do not speculate (as the intended model where that pool is dual-mode), with no
             load or prefix override (docs/concepts/speculation.md)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from services.common.kv_events import KVEventFeed
from services.common.prefix_index import PrefixIndex, ServerBlocks
from services.config import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX_CACHE_TOKENS, POOL_NAMES, RoutingConfig
from services.serving.backend import Backend

from . import metrics

SWIFTKV, BASE = POOL_NAMES
SAMPLING_EPS = 1e-5  # vLLM's: a min_p at or below it is no min_p


def speculation_excluded(sampling) -> str | None:
    """The field of a request (or its SamplingOptions) that no speculating engine serves: vLLM refuses logit_bias and
    min_p with speculative decoding (SamplingParams._validate_spec_decode). None: any pool may serve it."""
    if getattr(sampling, "logit_bias", None):
        return "logit_bias"
    if (getattr(sampling, "min_p", 0.0) or 0.0) > SAMPLING_EPS:
        return "min_p"
    return None


# Where a batch line may move without losing quality: the config fixes the pools' roles by name (`swiftkv`
# serves the SwiftKV model, `base` its base model, sharing its tokenizer), and the base model is the quality
# reference. Never the reverse.
STEER_TO = {SWIFTKV: BASE}


@dataclass
class Ewma:
    value: float
    alpha: float = 0.2

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


@dataclass
class PoolState:
    """What the gateway knows about a pool, measured on its own traffic."""

    name: str
    backend: Backend
    served_model_name: str
    max_model_len: int | None = None
    ready: bool = False
    dual_mode: bool = False  # its engines serve both models, per request (the pool config's dual_mode)
    speculative: bool = False  # its engines run speculative decoding (the pool config's): no logit_bias nor min_p there
    backlog_tokens: int = 0  # dispatched prompt tokens not found cached whose first token has not come back
    decode_tokens: int = 0  # expected output tokens of the requests dispatched here that have not ended
    # prompt tokens prefilled per second of an engine's prefill (time to first token less its queue wait, where the
    # backend reports that), measured on this pool's own traffic: the TTFT it predicts goes to the metrics
    prefill_rate: Ewma = field(default_factory=lambda: Ewma(5000.0))
    live_in_flight: int = 0  # live requests from dispatch to the end of their response
    live_ended_at: float = -math.inf  # time.monotonic() when the last of them ended
    live_elsewhere_at: float = -math.inf  # when another gateway process last reported live traffic here
    # called with local=True when a live request starts here, False when another process reports one
    # (services/batch: batch work making way, and telling the other processes)
    on_live_start: list[Callable[[bool], None]] = field(default_factory=list, repr=False)

    def live_started(self) -> None:
        self.live_in_flight += 1
        for hook in self.on_live_start:
            hook(True)

    def live_elsewhere(self) -> None:
        """Another gateway process has live traffic on this pool (services/batch/live.py): counted as a live
        request of this process that ended just now."""
        self.live_elsewhere_at = time.monotonic()
        for hook in self.on_live_start:
            hook(False)

    def live_ended(self) -> None:
        self.live_in_flight -= 1
        self.live_ended_at = time.monotonic()

    def live_busy(self, quiet_seconds: float) -> bool:
        """Live traffic is on this pool: a live request is in flight, or one ended less than `quiet_seconds` ago
        (here or in another gateway process)."""
        return self.live_in_flight > 0 or time.monotonic() - max(self.live_ended_at, self.live_elsewhere_at) < quiet_seconds

    def ttft_seconds(self, prefill_tokens: int) -> float:
        """Predicted time to first token of a request with `prefill_tokens` not cached here: the prefills in line
        before it and its own, at the pool's measured prefill rate."""
        return (self.backlog_tokens + prefill_tokens) / self.prefill_rate.value

    def dispatched(self, prefill_tokens: int, output_tokens: int = 0) -> None:
        """A request went out with `prefill_tokens` of its prompt not cached here and `output_tokens` expected."""
        self.backlog_tokens += prefill_tokens
        self.decode_tokens += output_tokens
        metrics.labelled(metrics.pool_backlog, self.name).set(self.backlog_tokens)

    def ended(self, output_tokens: int) -> None:
        """A request dispatched with `output_tokens` expected has ended (answered, failed or aborted)."""
        self.decode_tokens -= output_tokens

    def work(self, decode_token_cost: float) -> float:
        """What the requests in flight here still need, in prompt tokens' prefill work."""
        return self.backlog_tokens + decode_token_cost * self.decode_tokens

    def first_token(self, prefill_tokens: int, ttft: float, queue_seconds: float | None = None) -> None:
        """The first token of a request dispatched with `prefill_tokens` came back `ttft` seconds after it was sent
        (0: it ended without one), of which `queue_seconds` in the engine's queue where the backend knows."""
        self.backlog_tokens -= prefill_tokens
        metrics.labelled(metrics.pool_backlog, self.name).set(self.backlog_tokens)
        prefill_seconds = ttft - (queue_seconds or 0.0)
        if prefill_tokens >= 16 and ttft > 0 and prefill_seconds > 0:  # tiny prefills measure overheads, not prefill
            self.prefill_rate.update(prefill_tokens / prefill_seconds)
            metrics.pool_prefill_rate.labels(self.name).set(self.prefill_rate.value)


def cache_key(pool: str, mode: str | None = None) -> str:
    """The prefix-cache index's target for `pool`'s blocks of the model `mode`: the pool's name for its own model."""
    return pool if mode in (None, pool) else f"{pool}+{mode}"


@dataclass(frozen=True)
class Decision:
    pool: str
    reason: str
    ratio: float
    # the prompt's prefix-cache block hashes (cache_aware routing), hashed once for the decision, a retry and the index
    blocks: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    mode: str | None = None  # the model that runs it, swiftkv or base: the pool's own (None) unless a dual-mode pool's other

    def __post_init__(self) -> None:
        if self.mode is None:
            object.__setattr__(self, "mode", self.pool)

    def header(self, expose_reason: bool = False) -> str:
        """The `x-swiftkv-route` header: why it was routed (the reason and ratio) only where the operator exposes it, since
        a `prefix` reason tells a client what another recently sent."""
        why = f"; reason={self.reason}; ratio={self.ratio:.2f}" if expose_reason else ""
        return f"pool={self.pool}{why}" + ("" if self.mode == self.pool else f"; mode={self.mode}")


class NoPoolAvailable(Exception):
    pass


class RoutePolicy:
    def __init__(self, cfg: RoutingConfig, index: PrefixIndex | None = None, per_key: bool | Callable[[str], bool] = False):
        self.cfg = cfg
        # each API key's prefix cache apart: a bool for every key, or per key (KeyStore.own_cache: the keys file's
        # share_prefix_cache, else routing.share_prefix_cache), read per request so a reload of the keys file applies
        self.per_key = per_key
        # what each pool holds in its prefix cache: None unless routing is cache-aware
        if index is None and cfg.cache_aware:
            block_size = cfg.prefix_block_size or DEFAULT_BLOCK_SIZE
            index = PrefixIndex((cfg.prefix_cache_tokens or DEFAULT_PREFIX_CACHE_TOKENS) // block_size, block_size)
        self.index = index
        self._capacities: dict[str, int] = {}  # tokens, as the pools' engines reported them
        self._servers: dict[str, ServerBlocks] = {}  # per pool, which of its engines hold each block (KV-cache events)

    def adopt_engine_cache(self, pool: str, block_size: int, capacity_tokens: int) -> None:
        """A pool's engine reported its prefix cache's block size and capacity: the index follows them unless the
        config fixes them. Called as pools start, before traffic: a change of block size starts an empty index."""
        if self.index is None:
            return
        if self.cfg.prefix_block_size is None and block_size != self.index.block_size:
            self.index = PrefixIndex(self.index.capacity_blocks * self.index.block_size // block_size, block_size)
        if self.cfg.prefix_cache_tokens is None:
            self._capacities[pool] = capacity_tokens
        for name, tokens in self._capacities.items():
            for mode in POOL_NAMES:  # a dual-mode engine's blocks of either model share its cache
                self.index.set_capacity(cache_key(name, mode), tokens // self.index.block_size)

    def key_salt(self, identity: str) -> str | None:
        """The prefix-cache salt of a key's requests (per_key, else None): a digest of its identity, never the key, nor
        the digest that names the key elsewhere."""
        own = self.per_key(identity) if callable(self.per_key) else self.per_key
        return hashlib.sha256(f"swiftkv-cache-salt:{identity}".encode()).hexdigest()[:16] if own else None

    def blocks(self, prompt_token_ids: Sequence[int], salt: str | None = None) -> tuple[bytes, ...]:
        """The prompt's block hashes, salted with its key's `salt`, when routing is cache-aware (else none: nothing to
        hash)."""
        return () if self.index is None else tuple(self.index.hashes(prompt_token_ids, salt=salt))

    def forget(self, pool: str) -> None:
        """The pool went down: whatever it held in its prefix cache is gone."""
        if self.index is not None:
            for mode in POOL_NAMES:
                self.index.forget(cache_key(pool, mode))
        if pool in self._servers:
            self._servers[pool].forget()

    def follow_kv_events(self, pool: str, endpoint: str) -> KVEventFeed:
        """A feed of one of `pool`'s engines' KV-cache events (routing.kv_events) that corrects the index: blocks the
        engine stored or evicted, its cache cleared; where the pool has several engines, a block leaves the pool's index
        only once none of them holds it. Started; the caller stops it. The index is looked up at each event
        (adopt_engine_cache may replace it)."""
        servers = self._servers.setdefault(pool, ServerBlocks())
        servers.add(endpoint)

        def stored(hashes) -> None:
            metrics.kv_cache_events.labels(pool, "stored").inc(len(hashes))
            servers.stored(endpoint, hashes)
            if self.index is not None:
                self.index.record(pool, hashes)

        def removed(hashes) -> None:
            metrics.kv_cache_events.labels(pool, "removed").inc(len(hashes))
            gone = servers.removed(endpoint, hashes)
            if self.index is not None:
                self.index.removed(pool, gone)

        def cleared() -> None:
            metrics.kv_cache_events.labels(pool, "cleared").inc()
            if servers.servers == 1:  # the pool's only engine: everything it held is gone, predictions included
                self.forget(pool)
            elif self.index is not None:
                self.index.removed(pool, servers.cleared(endpoint))

        feed = KVEventFeed(endpoint, stored, removed, cleared)
        feed.start()
        return feed

    def cached_tokens(self, pool: str, prompt_tokens: int, blocks: Sequence[bytes], mode: str | None = None) -> int:
        """Prompt tokens `pool` should find in its prefix cache for the model `mode` (None: its own); never the last one
        (vLLM computes at least one)."""
        if self.index is None or not blocks:
            return 0
        bs = self.index.block_size
        return min(self.index.cached_tokens(cache_key(pool, mode), blocks), (prompt_tokens - 1) // bs * bs)

    def decide(self, prompt_tokens: int, expected_output: int, pools: dict[str, PoolState], pinned: str | None = None,
               blocks: Sequence[bytes] = (), unspeculated: bool = False) -> Decision:
        """The pool for a request of `prompt_tokens` expecting `expected_output` tokens; `blocks` (cache-aware
        routing: `blocks(prompt_token_ids)`) lets the pools' prefix caches count. `unspeculated`: the request needs an
        engine without speculative decoding (`speculation_excluded`); admission refused it where no pool it may go to
        has one."""
        ratio = prompt_tokens / max(expected_output, 1)
        blocks = tuple(blocks)
        if pinned is not None:
            if not pools[pinned].ready:
                raise NoPoolAvailable(f"pool {pinned} is not available")
            return Decision(pinned, "pinned", ratio, blocks)
        if len(pools) == 1:
            (only,) = pools.values()
            if not only.ready:
                raise NoPoolAvailable(f"pool {only.name} is not available")
            return Decision(only.name, "single", ratio, blocks)
        chosen = SWIFTKV if ratio >= self.cfg.ratio_threshold else BASE
        other = BASE if chosen == SWIFTKV else SWIFTKV
        plain = [name for name in (chosen, other) if not pools[name].speculative]
        if unspeculated and len(plain) == 1:  # the one pool that does not speculate, as the intended model if it can
            (name,) = plain
            if not pools[name].ready:
                raise NoPoolAvailable(f"pool {name}, the one without speculative decoding (which logit_bias and min_p "
                                      "need), is not available")
            return Decision(name, "no_speculation", ratio, blocks, chosen if pools[name].dual_mode else name)
        moved_as = chosen if pools[other].dual_mode else other  # the model it runs as if moved to the other pool
        if not pools[chosen].ready:
            if not pools[other].ready:
                raise NoPoolAvailable("no pool is available")
            return Decision(other, "fallback", ratio, blocks, moved_as)
        if pools[other].ready:
            # Cached tokens up to the distinctive minimum count for nothing: a prefix every request shares would
            # otherwise pull all traffic to the pool that happens to hold it.
            floor = self.cfg.prefix_min_distinct_tokens

            counted: dict[tuple[str, str], int] = {}

            def cached(pool: str, mode: str) -> int:  # looked up once per pool and model
                if (pool, mode) not in counted:
                    counted[pool, mode] = max(0, self.cached_tokens(pool, prompt_tokens, blocks, mode) - floor)
                return counted[pool, mode]

            def work(pool: str, mode: str) -> float:
                return pools[pool].work(self.cfg.decode_token_cost) + own - cached(pool, mode)

            own = prompt_tokens + self.cfg.decode_token_cost * expected_output
            mine_cached, mine = cached(chosen, chosen), work(chosen, chosen)
            # Where else the prompt may be cached: the other pool as the model it would run there, and on a dual-mode
            # pool either model (a conversation's history cached as the base model keeps its next turn there, as it
            # would between two single-model pools).
            elsewhere = {(other, moved_as)} | {(p, m) for p in pools if pools[p].dual_mode for m in POOL_NAMES}
            best = max(sorted(elsewhere - {(chosen, chosen)}), key=lambda pm: cached(*pm))
            if cached(*best) > mine_cached and work(*best) < mine:
                return Decision(best[0], "prefix", ratio, blocks, best[1])
            theirs = work(other, moved_as)
            # The margin keeps the intended model at low load; where the other pool would run the same model (dual
            # mode) the two engines are alike for this request, and the less loaded one serves it.
            margin = 0 if moved_as == chosen else self.cfg.balance_margin_tokens
            if self.cfg.balance and mine - theirs > margin:
                return Decision(other, "backlog", ratio, blocks, moved_as)
        return Decision(chosen, "ratio", ratio, blocks)

    def steer_batch(self, decision: Decision, pools: dict[str, PoolState], live_busy: Callable[[str], bool]) -> Decision:
        """A batch line's route, away from live traffic: a line whose pool is live-busy moves to a ready pool
        that is not, when that pool serves at least the line's quality (`STEER_TO`: SwiftKV -> base model,
        never the reverse; a dual-mode pool runs it as the same model); a pinned line stays where the client sent it, and a
        `no_speculation` line on the one pool that can serve it."""
        to = STEER_TO.get(decision.pool)
        if decision.reason in ("pinned", "no_speculation") or to not in pools or not pools[to].ready:
            return decision
        if not live_busy(decision.pool) or live_busy(to):
            return decision
        mode = decision.mode if pools[to].dual_mode else to
        return dataclasses.replace(decision, pool=to, reason="batch_steered", mode=mode)
