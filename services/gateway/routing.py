"""Route policy: which pool serves a request, and why.

Prompt-heavy requests (prompt tokens / expected output tokens >= threshold) go to the `swiftkv` pool (the SwiftKV
model, whose prefill is cheaper), the others to `base` (the base model): that is the intent. Two predictions may
override it:

- Load (`routing.balance`): each pool's predicted work is what its requests in flight still need (prompt tokens not
  yet prefilled and not found cached, plus per expected output token not yet ended its decode cost: measured at the
  pool's batch size, `PoolState.decode_cost`, and `decode_token_cost` until measured), spread over its replicas, and this
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
(a conversation's history answered by the base model keeps its next turn there). The two models' prefix-cache blocks are
never shared: a dual-mode engine salts its base-mode requests' blocks (swiftkv_core.dual_mode `cache_salt`), and the index
hashes them as the engine does (`PromptBlocks.for_mode`), so one pool's blocks of both models live in one LRU bounded by
the engine's one KV cache (the least recently used block of either model goes first), and the engine's KV-cache events
(`routing.kv_events`) name them as the index does.

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
  cache_key  the prefix index predicts nothing cached for the prompt, and the request's prompt_cache_key was last served
             (for the same API key) by another pool (or model) than the ratio's, whose work is within
             `balance_margin_tokens` of it: requests sharing a prompt_cache_key are likely to share a prefix
             (OpenAI's meaning), so they go together (`RoutePolicy.served_cache_key`)
  no_speculation  the request samples with logit_bias or min_p, which vLLM refuses under speculative decoding: it goes
             to the pool whose engines do not speculate (as the intended model where that pool is dual-mode), with no
             load or prefix override (docs/concepts/speculation.md)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from services.common.kv_events import KVEventFeed
from services.common.prefix_index import PrefixIndex, ServerBlocks
from services.config import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX_CACHE_TOKENS, POOL_NAMES, RoutingConfig
from services.serving.backend import Backend
from swiftkv_core.dual_mode import cache_salt

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


DECODE_BUCKETS = 8  # batch sizes per replica 1, 2-3, 4-7, ..., 128 and more: one decode rate each


def batch_bucket(batch: float) -> int:
    """The decode-rate bucket of a batch of `batch` sequences per replica: log2, 0 for one (or fewer)."""
    return min(max(int(batch), 1).bit_length() - 1, DECODE_BUCKETS - 1)


_BUCKET = [batch_bucket(b) for b in range(2 ** DECODE_BUCKETS)]  # looked up on the request path: no call


@dataclass
class PoolState:
    """What the gateway knows about a pool, measured on its own traffic.

    The prediction (docs/operations/slo.md): a request's time to first token is the prefills in line before it, spread
    over the pool's replicas, and its own prefill, at the measured prefill rate, plus one decode step of the batch
    running on a replica (the step in progress when it arrives, which its prefill joins after): the step's time is
    measured per batch-size bucket (`decode_rate`, from each request's time per output token at the pool's concurrency),
    else `decode_token_cost` prompt tokens' prefill per sequence of the batch (the prior). The same measured decode rate
    prices an output token in prompt tokens' prefill work for routing (`decode_cost`)."""

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
    replicas: int = 1  # engines serving the pool now (backend.replica_count(), refreshed by the health watcher)
    running: int = 0  # requests dispatched here that have not ended (live and batch)
    # per batch-size bucket (sequences per replica, `batch_bucket`): decode tokens per second of one sequence (1 / its
    # time per output token), measured on requests that ended; None until one was
    decode_rate: list = field(default_factory=lambda: [None] * DECODE_BUCKETS)
    decode_token_cost: float = 4.0  # the prior: routing.decode_token_cost, until the batch's bucket is measured
    slo: object = None  # the pool config's SLOConfig (None: none), and its two figures read per request:
    slo_ttft_seconds: float | None = None  # live requests counted within or over it (swiftkv_slo_ttft_requests)
    slo_max_queue_seconds: float | None = None  # a live request predicted to wait longer is shed (a 429 `overloaded`)
    # the arrivals since the capacity gauges were last read (services/gateway/capacity.py): requests, uncached prompt
    # tokens, expected output tokens
    arrivals: int = 0
    arrived_prefill: int = 0
    arrived_output: int = 0
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

    def batch(self) -> float:
        """Sequences decoding on one replica now: the requests in flight spread over the replicas."""
        return self.running / max(self.replicas, 1)

    def decode_step_seconds(self, batch: float | None = None) -> float:
        """Time of one decode step of `batch` sequences per replica (default: now): measured in the batch's bucket, else
        the prior (`decode_token_cost` prompt tokens' prefill per sequence at the measured prefill rate). 0: none run."""
        if batch is None:
            batch = self.running / (self.replicas if self.replicas > 1 else 1)
        if batch <= 0:
            return 0.0
        rate = self.decode_rate[_BUCKET[int(batch)] if batch < 2 ** DECODE_BUCKETS else DECODE_BUCKETS - 1]
        return 1.0 / rate if rate else self.decode_token_cost * batch / self.prefill_rate.value

    def decode_cost(self, prior: float) -> float:
        """The work of one output token in prompt tokens' prefill work at the pool's batch now: a step of the batch
        produces one token per sequence in `decode_step_seconds`, time in which the pool prefills that many prompt
        tokens; `prior` (routing.decode_token_cost) until that bucket is measured."""
        batch = self.running / (self.replicas if self.replicas > 1 else 1)
        if batch < 1:
            batch = 1.0
        rate = self.decode_rate[_BUCKET[int(batch)] if batch < 2 ** DECODE_BUCKETS else DECODE_BUCKETS - 1]
        return self.prefill_rate.value / (rate * batch) if rate else prior

    def ttft_seconds(self, prefill_tokens: int) -> float:
        """Predicted time to first token of a request with `prefill_tokens` not cached here: the prefills in line
        before it spread over the pool's replicas and its own, at the pool's measured prefill rate, and the decode step
        of a replica's batch in progress."""
        backlog = self.backlog_tokens / self.replicas if self.replicas > 1 else self.backlog_tokens
        return (backlog + prefill_tokens) / self.prefill_rate.value + (self.decode_step_seconds() if self.running else 0.0)

    def dispatched(self, prefill_tokens: int, output_tokens: int = 0) -> None:
        """A request went out with `prefill_tokens` of its prompt not cached here and `output_tokens` expected."""
        self.backlog_tokens += prefill_tokens
        self.decode_tokens += output_tokens
        self.running += 1
        self.arrivals += 1
        self.arrived_prefill += prefill_tokens
        self.arrived_output += output_tokens
        metrics.labelled(metrics.pool_backlog, self.name).set(self.backlog_tokens)

    def ended(self, output_tokens: int) -> None:
        """A request dispatched with `output_tokens` expected has ended (answered, failed or aborted)."""
        self.decode_tokens -= output_tokens
        self.running -= 1

    def decoded(self, tpot: float, batch: float) -> None:
        """A request's mean time per output token after its first was `tpot`, with `batch` sequences per replica running
        (its own included) as it ended: the decode rate of that batch's bucket."""
        if tpot > 0:
            bucket = batch_bucket(batch)
            rate = self.decode_rate[bucket]
            if rate is None:
                self.decode_rate[bucket] = 1.0 / tpot
            else:
                self.decode_rate[bucket] = rate + 0.2 * (1.0 / tpot - rate)

    def work(self, decode_token_cost: float) -> float:
        """What the requests in flight here still need, in prompt tokens' prefill work (an output token's: measured,
        `decode_cost`, else `decode_token_cost`), spread over the pool's replicas."""
        work = self.backlog_tokens + self.decode_cost(decode_token_cost) * self.decode_tokens if self.decode_tokens else self.backlog_tokens
        return work / self.replicas if self.replicas > 1 else work

    def first_token(self, prefill_tokens: int, ttft: float, queue_seconds: float | None = None) -> None:
        """The first token of a request dispatched with `prefill_tokens` came back `ttft` seconds after it was sent
        (0: it ended without one), of which `queue_seconds` in the engine's queue where the backend knows."""
        self.backlog_tokens -= prefill_tokens
        metrics.labelled(metrics.pool_backlog, self.name).set(self.backlog_tokens)
        prefill_seconds = ttft - (queue_seconds or 0.0)
        if prefill_tokens >= 16 and ttft > 0 and prefill_seconds > 0:  # tiny prefills measure overheads, not prefill
            self.prefill_rate.update(prefill_tokens / prefill_seconds)
            metrics.pool_prefill_rate.labels(self.name).set(self.prefill_rate.value)


class PromptBlocks(tuple):
    """A prompt's block hashes (`RoutePolicy.blocks`), salted with its key's salt as the engines' prefix caches key a
    request's blocks (single-mode engines, and a dual-mode engine's SwiftKV mode). A dual-mode engine salts its base-mode
    requests' blocks with the mode too (swiftkv_core.dual_mode `cache_salt`), so their chain differs from the first block
    on: `for_mode` hashes it, once per prompt and only where asked (a dual-mode pool's base model)."""

    def __new__(cls, index: PrefixIndex, token_ids: Sequence[int], key_salt: str | None = None):
        self = super().__new__(cls, index.hashes(token_ids, salt=key_salt))
        self._index, self._token_ids, self.key_salt, self._base = index, token_ids, key_salt, None
        return self

    def for_mode(self, mode: str | None) -> tuple[bytes, ...]:
        """The chain as an engine keys it for a request it runs in `mode` (a dual-mode engine's; None: a single-mode
        engine's request, these blocks)."""
        if mode != BASE:  # cache_salt(mode, key_salt) is the key's own salt
            return self
        if self._base is None:
            self._base = tuple(self._index.hashes(self._token_ids, salt=cache_salt(BASE, self.key_salt)))
        return self._base


def engine_blocks(blocks: Sequence[bytes], mode: str | None) -> Sequence[bytes]:
    """`blocks` as the engine keys them for a request it runs in `mode` (the mode sent to a dual-mode engine; None: a
    single-mode engine's). Plain hashes (not `PromptBlocks`) of a salted mode cannot be re-hashed: none."""
    if mode != BASE:
        return blocks
    return blocks.for_mode(mode) if isinstance(blocks, PromptBlocks) else ()


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
        # (API key, prompt_cache_key) -> the (pool, model) that last served it, least recently served forgotten first
        self._cache_keys: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()

    CACHE_KEY_ENTRIES = 65_536  # (API key, prompt_cache_key) pairs remembered: a few MiB at most

    def cache_key_hint(self, identity: str, prompt_cache_key: str | None) -> tuple[str, str] | None:
        """The (pool, model) that last served a request of this API key with this prompt_cache_key (cache-aware routing;
        another key's never counts: the pairs are the key's own)."""
        if prompt_cache_key is None or self.index is None:
            return None
        return self._cache_keys.get((identity, prompt_cache_key))

    def served_cache_key(self, identity: str, prompt_cache_key: str | None, pool: str, mode: str | None) -> None:
        """A request of this key with this prompt_cache_key went to `pool`, run as the model `mode` (None: its own)."""
        if prompt_cache_key is None or self.index is None:
            return
        entry = (identity, prompt_cache_key)
        self._cache_keys[entry] = (pool, mode or pool)
        self._cache_keys.move_to_end(entry)
        if len(self._cache_keys) > self.CACHE_KEY_ENTRIES:
            self._cache_keys.popitem(last=False)

    def adopt_engine_cache(self, pool: str, block_size: int, capacity_tokens: int) -> None:
        """A pool's engine reported its prefix cache's block size and capacity: the index follows them unless the
        config fixes them. Called as pools start, before traffic: a change of block size starts an empty index."""
        if self.index is None:
            return
        if self.cfg.prefix_block_size is None and block_size != self.index.block_size:
            self.index = PrefixIndex(self.index.capacity_blocks * self.index.block_size // block_size, block_size)
        if self.cfg.prefix_cache_tokens is None:
            self._capacities[pool] = capacity_tokens
        for name, tokens in self._capacities.items():  # a dual-mode engine's blocks of both models share its one cache
            self.index.set_capacity(name, tokens // self.index.block_size)

    def key_salt(self, identity: str) -> str | None:
        """The prefix-cache salt of a key's requests (per_key, else None): a digest of its identity, never the key, nor
        the digest that names the key elsewhere."""
        own = self.per_key(identity) if callable(self.per_key) else self.per_key
        return hashlib.sha256(f"swiftkv-cache-salt:{identity}".encode()).hexdigest()[:16] if own else None

    def blocks(self, prompt_token_ids: Sequence[int], salt: str | None = None) -> tuple[bytes, ...]:
        """The prompt's block hashes (`PromptBlocks`), salted with its key's `salt`, when routing is cache-aware (else
        none: nothing to hash)."""
        return () if self.index is None else PromptBlocks(self.index, prompt_token_ids, salt)

    def record(self, pool: str, blocks: Sequence[bytes], mode: str | None = None) -> None:
        """`pool` was sent a prompt of these blocks to run in `mode` (a dual-mode engine's; None: a single-mode
        engine's): they become the most recently used of the pool's one cache, as the engine keys them."""
        if self.index is not None:
            self.index.record(pool, engine_blocks(blocks, mode))

    def forget(self, pool: str) -> None:
        """The pool went down: whatever it held in its prefix cache is gone."""
        if self.index is not None:
            self.index.forget(pool)
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
        """Prompt tokens `pool` should find in its prefix cache for a request it runs in `mode` (a dual-mode engine's;
        None: a single-mode engine's); never the last one (vLLM computes at least one)."""
        if self.index is None or not blocks:
            return 0
        bs = self.index.block_size
        return min(self.index.cached_tokens(pool, engine_blocks(blocks, mode)), (prompt_tokens - 1) // bs * bs)

    def decide(self, prompt_tokens: int, expected_output: int, pools: dict[str, PoolState], pinned: str | None = None,
               blocks: Sequence[bytes] = (), unspeculated: bool = False, hint: tuple[str, str] | None = None) -> Decision:
        """The pool for a request of `prompt_tokens` expecting `expected_output` tokens; `blocks` (cache-aware
        routing: `blocks(prompt_token_ids)`) lets the pools' prefix caches count. `unspeculated`: the request needs an
        engine without speculative decoding (`speculation_excluded`); admission refused it where no pool it may go to
        has one. `hint` (`cache_key_hint`): the (pool, model) that last served the request's prompt_cache_key, preferred
        where nothing of the prompt is predicted cached and its work is within the balance margin of the ratio's pool."""
        ratio = prompt_tokens / max(expected_output, 1)
        blocks = blocks if isinstance(blocks, tuple) else tuple(blocks)  # PromptBlocks kept: a dual-mode pool's base chain
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
                    sent_as = mode if pools[pool].dual_mode else None  # the mode its engine is told (Dispatcher.as_routed)
                    counted[pool, mode] = max(0, self.cached_tokens(pool, prompt_tokens, blocks, sent_as) - floor)
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
            # Nothing predicted cached anywhere (an index that forgot, a prefix under the distinctive minimum): the
            # client's prompt_cache_key says where the same prefix likely went, unless that pool is busier by the margin.
            if (hint is not None and hint != (chosen, chosen) and hint in elsewhere and not mine_cached and not cached(*best)
                    and work(*hint) - mine <= self.cfg.balance_margin_tokens):
                return Decision(hint[0], "cache_key", ratio, blocks, hint[1])
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
