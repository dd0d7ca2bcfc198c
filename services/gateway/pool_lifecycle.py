"""The pools' lifecycle: start-up one pool at a time, a health watch per pool that takes a failing pool out of
routing and asks its backend to recover (with exponential backoff), and readiness."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
from typing import Callable

from services.config import PlatformConfig
from services.serving.backend import Backend, BackendDown

from . import metrics
from .prompts import max_model_len
from .routing import PoolState

log = logging.getLogger("swiftkv.gateway")


def count_replicas(pool: PoolState) -> None:
    """The engines serving the pool now, as its backend counts them (`replica_count`; one where it cannot say)."""
    count = getattr(pool.backend, "replica_count", None)
    pool.replicas = 1 if count is None else count()


class PoolLifecycle:
    """The pools' states (`pools`, shared with routing and dispatch) and what keeps them current."""

    def __init__(self, cfg: PlatformConfig, backends: dict[str, Backend], on_ready: Callable[[], None] | None = None,
                 on_down: Callable[[str], None] | None = None, on_cache: Callable[[str, int, int], None] | None = None):
        self.cfg = cfg
        self.on_ready = on_ready
        self.on_down = on_down  # told the name of a pool found down (its engine comes back with an empty prefix cache)
        self.on_cache = on_cache  # told a started pool's KV-cache block size and capacity in tokens, where it reports them
        self.pools = {
            name: PoolState(name, backend, cfg.served_name(name), max_model_len(cfg.pools[name].model, cfg.pools[name].engine_args),
                            dual_mode=cfg.pools[name].dual_mode,
                            # a remote server's speculation is its own, unknown here: its refusal reaches the client
                            speculative=cfg.pools[name].backend == "engine" and cfg.pools[name].speculation is not None)
            for name, backend in backends.items()
        }
        # A pool that is down is checked again within a health period: when to try again after a 503.
        self.retry_after = {"Retry-After": str(max(1, math.ceil(cfg.health.period_seconds)))}
        self._tasks: list[asyncio.Task] = []
        self.started = False  # the first start of every pool has been tried
        self._announced = False
        for name, pool in self.pools.items():
            metrics.pool_ready.labels(name).set(0)
            metrics.in_flight.labels(name).set(0)
            slo = pool.slo = cfg.pools[name].slo
            pool.slo_ttft_seconds, pool.slo_max_queue_seconds = slo.ttft_seconds, slo.max_queue_seconds
            pool.decode_token_cost = cfg.routing.decode_token_cost  # the prior, until the pool's decode is measured
            if slo.ttft_seconds is not None:  # every outcome's series from the start: the burn rate's ratio has data at 0
                for outcome in ("within", "over", "shed"):
                    metrics.slo_ttft.labels(name, outcome)
                metrics.pool_slo_ttft.labels(name).set(slo.ttft_seconds)
                metrics.pool_slo_objective.labels(name).set(slo.objective)

    async def start(self) -> None:
        """Start the pools, then watch each one's health: together where no start competes with another's (engines
        on CPU cores of their own), else one by one (engines sharing cores or a GPU, whose memory profiling would
        count the other's)."""
        if all(pool.backend.starts_alongside for pool in self.pools.values()):
            await asyncio.gather(*(self._start(pool) for pool in self.pools.values()))
        else:
            for pool in self.pools.values():
                await self._start(pool)
        # Everything loaded so far (torch, transformers, engines: ~10^6 objects) lives as long as the process.
        # Freezing it keeps the cyclic GC from re-scanning it: a full collection otherwise costs ~0.5 s on
        # two cores and, amortized, about as much CPU per request as the rest of the gateway.
        gc.collect()
        gc.freeze()
        self.started = True
        self._announce()
        self._tasks += [asyncio.create_task(self._watch(pool)) for pool in self.pools.values()]

    async def _start(self, pool: PoolState) -> None:
        try:
            await pool.backend.start()
            cache = pool.backend.prefix_cache()
            if cache is not None and self.on_cache is not None:
                self.on_cache(pool.name, *cache)
            count_replicas(pool)
            self.set_ready(pool, True)
        except BackendDown as e:  # not up yet (e.g. a Ray Serve application still deploying): the watcher retries
            log.warning("%s; the pool joins routing once its health check passes", e)
        except Exception:
            log.exception("pool %s failed to start; the other pool serves its traffic until it recovers", pool.name)

    def set_ready(self, pool: PoolState, ready: bool) -> None:
        if ready != pool.ready:
            log.log(logging.INFO if ready else logging.WARNING, "pool %s %s (%s)", pool.name,
                    "ready" if ready else "is down", pool.served_model_name)
        pool.ready = ready
        metrics.pool_ready.labels(pool.name).set(int(ready))
        if not ready and self.on_down is not None:
            self.on_down(pool.name)

    def _announce(self) -> None:
        if self.on_ready is not None and self.ready and not self._announced:
            self._announced = True
            self.on_ready()

    async def _watch(self, pool: PoolState) -> None:
        """Check one pool every period: a failed check takes it out of routing and asks the backend to
        recover (a dead in-process engine is restarted); failed recoveries are retried with exponential
        backoff, and the pool rejoins routing once its check passes."""
        h = self.cfg.health
        delay = h.period_seconds
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(h.timeout_seconds):  # not wait_for: it can lose a cancel (services.common.waiting)
                    healthy = await pool.backend.health()
            except Exception:  # a hung or failing health check means the pool is down, not the gateway
                healthy = False
            count_replicas(pool)
            self.set_ready(pool, healthy)
            if healthy:
                delay = h.period_seconds
                self._announce()
                continue
            try:
                await pool.backend.recover()
                delay = h.period_seconds
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = min(max(delay, h.period_seconds) * 2, h.max_backoff_seconds)
                log.warning("pool %s: recovery failed (%s: %s); next attempt in %.0f s", pool.name, type(e).__name__, e, delay)

    async def stop(self) -> None:
        """Stop every pool's backend at once: each engine's shutdown waits on its own processes (seconds each)."""
        for t in self._tasks:
            t.cancel()

        async def stop(pool: PoolState) -> None:
            try:
                await pool.backend.stop()
            except Exception:
                log.exception("stopping pool %s", pool.name)

        await asyncio.gather(*(stop(pool) for pool in self.pools.values()))

    @property
    def ready(self) -> bool:
        """Every pool is ready."""
        return all(p.ready for p in self.pools.values())

    @property
    def serving(self) -> bool:
        """Every pool's first start was tried and at least one pool can serve (readiness)."""
        return self.started and any(p.ready for p in self.pools.values())
