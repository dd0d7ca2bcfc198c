"""The Batch API's own metrics; its requests also appear in the gateway's metrics with source="batch"."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

in_flight = Gauge("swiftkv_batch_requests_in_flight", "Batch requests being served", ("pool",))
in_flight_limit = Gauge("swiftkv_batch_in_flight_limit", "Batch requests allowed in flight now (shrinks while live requests wait)", ("pool",))
finished = Counter("swiftkv_batches_finished", "Batches that reached a final status", ("status",))
