"""Live traffic shared between gateway processes through Redis (`redis_url`), so batch work in every process
makes way for a live request that arrived at any of them (`swiftkv serve --workers N`, or several gateway
replicas behind one Service).

Each process publishes "live traffic on pool P" on one channel when a live request starts there, every
heartbeat while its live requests on P are in flight, and once after the last of them ended. Every other
process takes such a message as a live request that ended on P just now (`PoolState.live_elsewhere`): the pool
is live-busy for `live_quiet_seconds` more, and its batch prefills beyond `min_in_flight` are preempted as
for a local live request. Nothing is counted across processes, so a process that dies leaves no pool busy
for longer than the quiet time. While Redis is unreachable each process sees only its own live traffic
(`swiftkv_batch_live_traffic_shared` 0) and tries again every `RETRY_SECONDS`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time

from services.common.waiting import wait_event

from . import metrics
from .gateway_protocols import Pool

log = logging.getLogger("swiftkv.batch")

CHANNEL = "live"  # under the platform's redis_prefix: releases sharing one Redis do not hear each other
RETRY_SECONDS = 5.0


class SharedLiveTraffic:
    def __init__(self, redis_url: str, pools: dict[str, Pool], quiet_seconds: float, redis_prefix: str = "swiftkv"):
        self.redis_url, self.pools = redis_url, pools
        self.channel = f"{redis_prefix}:{CHANNEL}"
        self.origin = secrets.token_hex(6)  # this process: its own messages are not news to it
        # Heartbeats closer than the quiet time, so a long live request elsewhere keeps the pool busy throughout.
        self.heartbeat = min(1.0, max(quiet_seconds / 2, 0.1))
        self.started: set[str] = set()
        self.wake = asyncio.Event()
        for name, pool in pools.items():
            pool.on_live_start.append(functools.partial(self._local_start, name))
        metrics.live_traffic_shared.set(0)

    def _local_start(self, pool: str, local: bool) -> None:
        if not local:
            return  # news from another process: not ours to repeat
        self.started.add(pool)
        self.wake.set()

    async def run(self) -> None:
        """Until cancelled (BatchService runs it beside the runner)."""
        import redis
        import redis.asyncio as aioredis

        while True:
            # keepalive: a subscriber blocks in listen() for as long as nothing is published; a dead peer must still show
            client = aioredis.Redis.from_url(self.redis_url, socket_connect_timeout=1.0, socket_keepalive=True)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    metrics.live_traffic_shared.set(1)
                    log.info("batch: live traffic shared through Redis (channel %s)", self.channel)
                    async with asyncio.TaskGroup() as tasks:
                        tasks.create_task(self._publish(client))
                        tasks.create_task(self._listen(pubsub))
            except* (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("batch: Redis unreachable (%s); batch work makes way only for this process's live "
                            "traffic until it answers", e.exceptions[0])
            except* Exception:
                log.exception("batch: sharing live traffic through Redis failed; trying again")
            finally:
                metrics.live_traffic_shared.set(0)
                await client.aclose()
            await asyncio.sleep(RETRY_SECONDS)

    async def _publish(self, client) -> None:
        last_round = time.monotonic()
        while True:
            await wait_event(self.wake, self.heartbeat)
            self.wake.clear()
            now = time.monotonic()
            busy = self.started | {name for name, p in self.pools.items()
                                   if p.live_in_flight > 0 or p.live_ended_at >= last_round}
            self.started = set()
            last_round = now
            for name in busy:
                await client.publish(self.channel, f"{self.origin} {name}")

    async def _listen(self, pubsub) -> None:
        async for message in pubsub.listen():
            if message["type"] != "message":
                continue
            origin, _, name = message["data"].decode(errors="replace").partition(" ")  # a stray message must not end the loop
            if origin != self.origin and name in self.pools:
                self.pools[name].live_elsewhere()
