"""Per-key token-aware rate limits (the keys and their per-key limits: services.common.keys)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from services.common.errors import APIError
from services.common.keys import KeyStore

log = logging.getLogger("swiftkv.gateway")

@dataclass
class Bucket:
    """Token bucket refilled continuously at capacity per minute."""

    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.capacity


class RateLimiter:
    """Per key: requests, prompt tokens and output tokens per minute, taken before the request costs any
    work. Prompt tokens are taken as an upper-bound estimate (the body's bytes) and settled to the exact count
    once tokenized; output tokens are reserved (max_tokens or the expected output) and settled against what
    was generated when the request ends."""

    KINDS = ("requests", "prompt_tokens", "output_tokens")

    def __init__(self, requests_per_minute: int | None, prompt_tokens_per_minute: int | None,
                 output_tokens_per_minute: int | None, per_key: KeyStore | dict[str, dict[str, int]] | None = None):
        self.defaults = dict(zip(self.KINDS, (requests_per_minute, prompt_tokens_per_minute, output_tokens_per_minute)))
        # the running KeyStore, read per request: a key's limit changed by a reload of the keys file applies to its next one
        self.keys = per_key if isinstance(per_key, KeyStore) else KeyStore(per_key)
        self.buckets: dict[str, dict[str, Bucket]] = {}
        self._settling: set[asyncio.Task] = set()  # settle_soon's tasks until they end (only where buckets are remote)
        self.checked: dict[str, int] = {}  # per key, the KeyStore.generation its buckets were last sized for

    def limits(self, identity: str) -> dict[str, int | None]:
        return self.defaults | {k.removesuffix("_per_minute"): v for k, v in self.keys.limits(identity).items()}

    # Async like the Redis limiter's, so callers await either.
    async def acquire(self, identity: str, prompt_tokens: int, output_tokens: int, requests: int = 1) -> None:
        """Take the amounts, or refuse (a 429 with the longest wait) and take nothing. `requests=0`: a request
        already counted (its body charged before it was parsed) takes its output reservation."""
        self._take(identity, prompt_tokens, output_tokens, requests)

    def _buckets(self, identity: str) -> dict[str, Bucket]:
        """The key's buckets, made full on first use. Never dropped: a debt stays until it is repaid. A limit changed
        since (a reload of the keys file) resizes its bucket: a raise adds the difference, a cut caps what is left."""
        buckets = self.buckets.get(identity)
        generation = self.keys.generation
        if buckets is not None and self.checked.get(identity) == generation:  # no reload since: as they were
            return buckets
        limits = {k: v for k, v in self.limits(identity).items() if v}
        if buckets is None or len(buckets) != len(limits) or any(k not in buckets or buckets[k].capacity != v for k, v in limits.items()):
            now = time.monotonic()
            old = buckets or {}
            buckets = self.buckets[identity] = {k: self._resized(old.get(k), v, now) for k, v in limits.items()}
        self.checked[identity] = generation
        return buckets

    @staticmethod
    def _resized(bucket: Bucket | None, capacity: int, now: float) -> Bucket:
        if bucket is None:
            return Bucket(capacity, capacity, now)
        bucket.refill(now)
        return Bucket(capacity, min(capacity, bucket.level + max(0, capacity - bucket.capacity)), now)

    def _take(self, identity: str, prompt_tokens: int, output_tokens: int, requests: int = 1) -> None:
        buckets = self._buckets(identity)
        if not buckets:
            return
        now = time.monotonic()  # not before the buckets' own stamp
        need = {"requests": requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
        waits = {}
        for kind, bucket in buckets.items():
            bucket.refill(now)
            waits[kind] = bucket.wait_for(need[kind])
        kind, wait = max(waits.items(), key=lambda kv: kv[1])
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise APIError(429, f"rate limit reached for {kind.replace('_', ' ')} per minute "
                                f"(limit {buckets[kind].capacity:g}); retry after {retry}s",
                           "requests" if kind == "requests" else "tokens", code="rate_limit_exceeded",
                           headers={"Retry-After": str(retry)})
        for kind, bucket in buckets.items():
            bucket.level -= min(need[kind], bucket.capacity)

    async def charge(self, identity: str, output_tokens: int) -> None:
        """Take an output reservation again without a limit check (a request admitted once and retried)."""
        self._charge(identity, output_tokens)

    def _charge(self, identity: str, output_tokens: int) -> None:
        bucket = self._buckets(identity).get("output_tokens")
        if bucket is not None:
            bucket.level -= min(output_tokens, bucket.capacity)

    async def settle(self, identity: str, reserved: int, actual: int, kind: str = "output_tokens") -> None:
        """Charge what was used instead of what acquire() took for `kind`: output tokens generated against
        their reservation, or a prompt's exact token count against its estimate. What was not used comes
        back; an overage (a request without max_tokens that ran past its estimate) is taken too, and may
        leave the bucket below zero so the key's next requests wait until it has refilled."""
        self._settle(identity, reserved, actual, kind)

    def settle_soon(self, identity: str, reserved: int, actual: int) -> None:
        """`settle` of output tokens from code that cannot wait (an answer's end, maybe in a task being cancelled): at
        once here; through a task of its own where the buckets are remote (RedisRateLimiter)."""
        self._settle(identity, reserved, actual, "output_tokens")

    def _settle(self, identity: str, reserved: int, actual: int, kind: str) -> None:
        # made here if need be: a request admitted through Redis may end after Redis went away
        bucket = self._buckets(identity).get(kind)
        if bucket is not None:
            taken = min(reserved, bucket.capacity)  # what acquire() took
            bucket.level = min(bucket.capacity, bucket.level + taken - actual)


# Refill every bucket of a key from Redis' own clock, then (take) refuse with the longest wait or take all
# amounts at once, or (adjust) add signed amounts; one script, so concurrent gateways never interleave. A bucket
# expires only once it would be full again.
# KEYS: the key's buckets; ARGV: mode, count, then capacity and amount per bucket. -> {index of the bucket
# that refused (1-based, 0 if none), its wait in seconds as a string}.
_BUCKETS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local n = tonumber(ARGV[2])
local levels = {}
local worst, worst_i = 0, 0
for i = 1, n do
  local cap = tonumber(ARGV[1 + 2 * i])
  local amt = tonumber(ARGV[2 + 2 * i])
  local v = redis.call('HMGET', KEYS[i], 'level', 'stamp')
  local level = tonumber(v[1]) or cap
  local stamp = tonumber(v[2]) or now
  level = math.min(cap, level + math.max(0, now - stamp) * cap / 60.0)
  levels[i] = level
  if ARGV[1] == 'take' then
    local missing = math.min(amt, cap) - level
    if missing > 0 and missing * 60.0 / cap > worst then
      worst, worst_i = missing * 60.0 / cap, i
    end
  end
end
if worst > 0 then return {worst_i, tostring(worst)} end
for i = 1, n do
  local cap = tonumber(ARGV[1 + 2 * i])
  local amt = tonumber(ARGV[2 + 2 * i])
  local level
  if ARGV[1] == 'take' then level = levels[i] - math.min(amt, cap) else level = math.min(cap, levels[i] + amt) end
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'stamp', tostring(now))
  -- kept until it has refilled to full (a missing bucket reads as full), debt included, plus a margin
  redis.call('EXPIRE', KEYS[i], math.max(120, math.ceil((cap - level) * 60.0 / cap) + 60))
end
return {0, '0'}
"""


class RedisRateLimiter(RateLimiter):
    """The same per-key buckets kept in Redis, so every gateway process sharing `redis_url` enforces one
    limit. If Redis cannot be reached the gateway keeps serving on its own in-process buckets (the base
    class) and says so in `swiftkv_rate_limits_shared` (0); Redis is tried again every `retry_seconds`.
    Calls go through redis.asyncio: a slow or silent Redis holds only the requests waiting on it, never
    the event loop (and so never the streams of other requests)."""

    PREFIX = "swiftkv:ratelimit:"  # with the default redis_prefix

    def __init__(self, redis_url: str, *args, retry_seconds: float = 5.0, prefix: str = "swiftkv", **kwargs):
        super().__init__(*args, **kwargs)
        self.url = redis_url
        self.PREFIX = f"{prefix}:ratelimit:"  # PlatformConfig.redis_prefix: releases sharing one Redis keep their own buckets
        self.retry_seconds = retry_seconds
        self.down_since: float | None = None
        self._clients: tuple | None = None  # (event loop, client, script): a redis.asyncio client serves one loop
        from . import metrics

        self.metric = metrics.rate_limits_shared
        self.metric.set(1)

    def _script(self):
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        loop = asyncio.get_running_loop()
        if self._clients is None or self._clients[0] is not loop:
            # No retries inside a call: a failed call falls back at once and Redis is tried again after retry_seconds.
            client = redis.asyncio.Redis.from_url(self.url, socket_connect_timeout=0.25, socket_timeout=0.5,
                                                  retry=Retry(NoBackoff(), 0))
            self._clients = (loop, client, client.register_script(_BUCKETS_LUA))
        return self._clients[2]

    def _shared(self) -> bool:
        return self.down_since is None or time.monotonic() - self.down_since >= self.retry_seconds

    async def _run(self, identity: str, mode: str, amounts: dict[str, float]):
        """The script on this key's buckets -> its answer, or None when Redis is unreachable (now local)."""
        import redis

        limits = {k: v for k, v in self.limits(identity).items() if v}
        kinds = [k for k in limits if k in amounts]
        if not kinds:
            return [0, "0"]
        args = [mode, len(kinds)]
        for k in kinds:
            args += [limits[k], amounts[k]]
        try:
            out = await self._script()(keys=[f"{self.PREFIX}{identity}:{k}" for k in kinds], args=args)
        except (redis.ConnectionError, redis.TimeoutError, OSError, TimeoutError) as e:
            if self.down_since is None:
                log.warning("rate limits: Redis unreachable (%s); using this process's own limits", e or type(e).__name__)
            self.down_since = time.monotonic()
            self.metric.set(0)
            return None
        if self.down_since is not None:
            log.info("rate limits: Redis reachable again; limits shared")
        self.down_since = None
        self.metric.set(1)
        return int(out[0]), float(out[1]), kinds

    async def acquire(self, identity: str, prompt_tokens: int, output_tokens: int, requests: int = 1) -> None:
        res = None
        if self._shared():
            res = await self._run(identity, "take", {"requests": requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens})
        if res is None:
            return self._take(identity, prompt_tokens, output_tokens, requests)
        if res[0] == 0:
            return
        refused, wait, kinds = res
        kind = kinds[refused - 1]
        retry = max(1, math.ceil(wait))
        raise APIError(429, f"rate limit reached for {kind.replace('_', ' ')} per minute "
                            f"(limit {self.limits(identity)[kind]:g}); retry after {retry}s",
                       "requests" if kind == "requests" else "tokens", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry)})

    async def settle(self, identity: str, reserved: int, actual: int, kind: str = "output_tokens") -> None:
        cap = self.limits(identity).get(kind)
        if not cap:
            return
        if not self._shared() or await self._run(identity, "adjust", {kind: min(reserved, cap) - actual}) is None:
            self._settle(identity, reserved, actual, kind)

    def settle_soon(self, identity: str, reserved: int, actual: int) -> None:
        """In a task of its own: it completes even while the request's own task is being cancelled (the client left),
        and the end of an answer never waits on Redis."""
        task = asyncio.get_running_loop().create_task(self.settle(identity, reserved, actual))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def charge(self, identity: str, output_tokens: int) -> None:
        cap = self.limits(identity).get("output_tokens")
        if not cap:
            return
        if not self._shared() or await self._run(identity, "adjust", {"output_tokens": -min(output_tokens, cap)}) is None:
            self._charge(identity, output_tokens)
