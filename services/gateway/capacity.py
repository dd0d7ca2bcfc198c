"""Capacity: what each pool's SLO needs, computed when /metrics is read (never on the request path).

For each pool, from the arrivals since the last reading and the rates the gateway measures on the pool's own traffic
(services/gateway/routing.py `PoolState`), it sets:

- `swiftkv_pool_predicted_ttft_seconds`: the time to first token a request arriving now would be predicted, with the
  pool's mean uncached prompt (`PoolState.ttft_seconds`);
- `swiftkv_pool_replicas`: the engines serving it now;
- `swiftkv_pool_decode_rate_tokens_per_second`: one replica's decode rate at its batch now;
- `swiftkv_pool_desired_replicas`: the replicas its SLO (pools.<name>.slo) needs at the current arrival rate and mix,
  before clamping to replicas.min/max. The method (docs/operations/slo.md): the largest of
    throughput  the engine time the arrivals need per second (prefill of their uncached prompts at the measured prefill
                rate, decode of their expected output at the measured decode rate of the batch), over the utilization
                at which a replica's queue keeps the predicted TTFT within slo.ttft_seconds (an M/M/1 queue's time in
                system, S / (1 - rho) <= ttft less a decode step: rho <= 1 - S / (ttft - step); 0.8 without a TTFT SLO,
                never under 0.1);
    backlog     the prefills in line drained within slo.ttft_seconds at the measured prefill rate;
    decode      the sequences in flight over the largest batch per replica whose measured time per output token is within
                slo.tpot_seconds.
  0 while the pool is idle (nothing arrived, nothing in flight).
"""

from __future__ import annotations

import math
import time

from . import metrics
from .routing import DECODE_BUCKETS, PoolState

DEFAULT_UTILIZATION = 0.8  # without a TTFT objective: a replica this busy at most
MIN_UTILIZATION = 0.1  # an objective no queue meets (a prefill alone takes about as long): size as if this busy
MIN_WINDOW_SECONDS = 1.0  # a reading sooner than this after the last keeps the last arrival rate


class Capacity:
    """The pools' capacity gauges, refreshed by `refresh()` (the gateway's /metrics handler calls it)."""

    def __init__(self, pools: dict[str, PoolState]):
        self.pools = pools
        self.last = time.monotonic()
        self.arrival_rate = dict.fromkeys(pools, 0.0)  # requests per second, over the last window
        self.mean_prefill = dict.fromkeys(pools, 0.0)  # uncached prompt tokens per request (moving average)
        self.mean_output = dict.fromkeys(pools, 0.0)  # expected output tokens per request (moving average)

    def refresh(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        window = now - self.last
        if window >= MIN_WINDOW_SECONDS:
            self.last = now
            for name, pool in self.pools.items():
                self.arrival_rate[name] = pool.arrivals / window
                if pool.arrivals:
                    first = self.mean_prefill[name] == 0.0 and self.mean_output[name] == 0.0
                    alpha = 1.0 if first else 0.5
                    self.mean_prefill[name] += alpha * (pool.arrived_prefill / pool.arrivals - self.mean_prefill[name])
                    self.mean_output[name] += alpha * (pool.arrived_output / pool.arrivals - self.mean_output[name])
                pool.arrivals = pool.arrived_prefill = pool.arrived_output = 0
        for name, pool in self.pools.items():
            metrics.labelled(metrics.pool_replicas, name).set(pool.replicas)
            metrics.labelled(metrics.pool_predicted_ttft, name).set(pool.ttft_seconds(round(self.mean_prefill[name])))
            batch = max(pool.batch(), 1.0)
            metrics.labelled(metrics.pool_decode_rate, name).set(batch / pool.decode_step_seconds(batch))
            metrics.labelled(metrics.pool_desired_replicas, name).set(self.desired(pool))

    def desired(self, pool: PoolState) -> int:
        """The replicas the pool's SLO needs now (module docstring), before clamping to replicas.min/max."""
        rate, prefill, output = self.arrival_rate[pool.name], self.mean_prefill[pool.name], self.mean_output[pool.name]
        if rate <= 0 and pool.running <= 0 and pool.backlog_tokens <= 0:
            return 0
        slo = pool.slo
        ttft = getattr(slo, "ttft_seconds", None)
        tpot = getattr(slo, "tpot_seconds", None)
        prefill_rate = pool.prefill_rate.value
        batch = max(pool.batch(), 1.0)
        step = pool.decode_step_seconds(batch)
        service = prefill / prefill_rate  # one request's prefill on one replica
        busy = rate * (service + output * step / batch)  # replica-seconds of engine time per second
        if ttft is None:
            utilization = DEFAULT_UTILIZATION
        else:
            room = ttft - step
            utilization = 1.0 - service / room if room > 0 else 0.0
            utilization = min(max(utilization, MIN_UTILIZATION), 1.0)
        needed = whole(busy / utilization)
        if ttft is not None:
            needed = max(needed, whole(pool.backlog_tokens / (prefill_rate * ttft)))
        if tpot is not None and pool.running > 0:
            fits = [b for b in (2 ** i for i in range(DECODE_BUCKETS)) if pool.decode_step_seconds(b) <= tpot]
            largest = max(fits, default=1)
            needed = max(needed, whole(pool.running / largest))
        return max(needed, 1)


def whole(replicas: float) -> int:
    """Replicas rounded up, a rounding error's excess (10.000000001) not counted as one more."""
    return math.ceil(round(replicas, 6))
