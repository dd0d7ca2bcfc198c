"""The Batch API's own metrics; its requests also appear in the gateway's metrics with source="batch"."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

in_flight = Gauge("swiftkv_batch_requests_in_flight", "Batch requests being served", ("pool",))
in_flight_limit = Gauge("swiftkv_batch_in_flight_limit", "Batch requests allowed in flight now (shrinks while live requests wait)", ("pool",))
preempted = Counter("swiftkv_batch_requests_preempted", "Batch requests aborted before their first token to make way for a "
                    "live request on their pool (batch.preempt_prefills); their lines run again", ("pool",))
finished = Counter("swiftkv_batches_finished", "Batches that reached a final status", ("status",))
oldest_pending_age = Gauge("swiftkv_batch_oldest_pending_age_seconds",
                           "Age of the oldest batch line not yet done, over the batches waiting or in progress in the store (0 when none)")
live_traffic_shared = Gauge("swiftkv_batch_live_traffic_shared", "1 while live traffic is shared with the other gateway processes "
                            "through Redis (redis_url), so batch work here makes way for their live requests too; 0 otherwise")
