"""Gateway-side Prometheus metrics: prefix `swiftkv_`, base units, labels of low cardinality (pool, model,
reason, status, source, route: each from a small fixed set; source is `live` or `batch`, route the API route a request
came by: `chat`, `completions` or `responses`). Engine metrics keep
vLLM's own `vllm:` names and are exposed beside these by the in-process engines
(services.serving.engine.EngineMetrics)."""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no `_created` series: they double the output and no dashboard reads them

# Fine below one second, where TTFT of short prompts lives, then coarser up to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)

PM = ("pool", "model", "source")

# route: the API route the request came in by (chat, completions, responses), for the two latencies a client feels
ttft = Histogram("swiftkv_time_to_first_token_seconds", "Gateway-side time to first token (request received to first token sent)", PM + ("route",), buckets=TTFT_BUCKETS)
tpot = Histogram("swiftkv_time_per_output_token_seconds", "Mean time per output token after the first, per request", PM + ("route",), buckets=TPOT_BUCKETS)
e2e = Histogram("swiftkv_e2e_request_latency_seconds", "Request received to last token sent", PM, buckets=E2E_BUCKETS)
queue = Histogram("swiftkv_request_queue_time_seconds", "Time the request waited in the engine queue before being scheduled", PM, buckets=TTFT_BUCKETS)
overhead = Histogram("swiftkv_gateway_overhead_seconds", "Gateway time before dispatch: parsing, auth, tokenization, limits, routing", ("pool",), buckets=OVERHEAD_BUCKETS)
prompt_tokens = Counter("swiftkv_prompt_tokens", "Prompt tokens of requests dispatched", PM)
generation_tokens = Counter("swiftkv_generation_tokens", "Tokens generated", PM)
requests = Counter("swiftkv_requests", "Requests that reached a pool, by outcome (ok, error, client_disconnect; aborted: a batch request the batch runner stopped)", PM + ("status",))
route_decisions = Counter("swiftkv_route_decisions", "Route decisions by pool and reason", ("pool", "reason", "source"))
in_flight = Gauge("swiftkv_requests_in_flight", "Requests being served", ("pool",))
rejections = Counter("swiftkv_requests_rejected", "Requests refused before reaching a pool, by reason", ("reason", "source"))
retries = Counter("swiftkv_request_retries", "Requests retried on another pool after theirs failed before the first token", ("from_pool", "to_pool"))
requests_active = Gauge("swiftkv_gateway_requests_active", "Shared request slots this gateway process holds now: generation, /tokenize and /detokenize requests whose body is in (streams until their last byte); limits.max_concurrent_requests caps them")
requests_waiting = Gauge("swiftkv_gateway_requests_waiting", "Requests with their body in waiting for a shared slot (all limits.max_concurrent_requests held), at most limits.slot_wait_seconds, in a queue fair across keys")
slot_wait = Histogram("swiftkv_gateway_slot_wait_seconds", "Time a request waited for a shared slot, by outcome: served, timeout (a 503) or client_gone (the client left while waiting); requests that found a slot free are not counted", ("outcome",), buckets=TTFT_BUCKETS)
slow_client_disconnects = Counter("swiftkv_slow_client_disconnects", "Connections closed because the client read nothing of its response for limits.send_timeout_seconds")
rate_limits_shared = Gauge("swiftkv_rate_limits_shared", "1 when per-key rate limits are shared through Redis (redis_url), 0 while Redis is unreachable and this gateway uses its own in-process limits")
pool_ready = Gauge("swiftkv_pool_ready", "1 when the pool is warmed up and healthy", ("pool",))
pool_backlog = Gauge("swiftkv_pool_backlog_tokens", "Prompt tokens dispatched to the pool and not yet prefilled", ("pool",))
pool_prefill_rate = Gauge("swiftkv_pool_prefill_rate_tokens_per_second", "Measured prefill rate: prompt tokens over the time to first token less the engine queue wait (moving average)", ("pool",))
# the gateway's predictions, to set beside vLLM's prefix-cache hits (cache-aware routing) and the measured
# swiftkv_time_to_first_token_seconds
prefix_cached_tokens = Counter("swiftkv_route_prefix_cached_tokens", "Prompt tokens the gateway predicted cached in the prefix cache of the pool it sent them to", ("pool",))
kv_cache_events = Counter("swiftkv_kv_cache_events_blocks", "Blocks named in the KV-cache events a pool's engines published "
                          "(routing.kv_events): stored, removed; cleared counts whole-cache clears", ("pool", "event"))
# capacity and the SLO (docs/operations/slo.md): the gauges are computed as /metrics is read (services/gateway/capacity.py),
# never on the request path
slo_ttft = Counter("swiftkv_slo_ttft_requests", "Live requests of a pool with an SLO (pools.<name>.slo.ttft_seconds) by outcome: "
                   "within (first token within the SLO), over (after it), shed (refused with a 429 `overloaded` as their "
                   "predicted time to first token exceeded slo.max_queue_seconds); the error budget is 1 - slo.objective of them",
                   ("pool", "outcome"))
pool_slo_ttft = Gauge("swiftkv_pool_slo_ttft_seconds", "The pool's TTFT SLO, pools.<name>.slo.ttft_seconds (pools with one)", ("pool",))
pool_slo_objective = Gauge("swiftkv_pool_slo_objective", "Share of the pool's live requests that should get their first token "
                           "within its TTFT SLO, pools.<name>.slo.objective (pools with a TTFT SLO): 1 - it is the error budget",
                           ("pool",))
pool_predicted_ttft = Gauge("swiftkv_pool_predicted_ttft_seconds", "Time to first token the gateway predicts for a request arriving "
                            "now with the pool's mean uncached prompt: the prefills in line spread over its replicas and its own at "
                            "the measured prefill rate, and a replica's decode step in progress", ("pool",))
pool_replicas = Gauge("swiftkv_pool_replicas", "Engines serving the pool now: in-process pools their engine, remote pools their "
                      "reachable servers, Ray pools their running replicas", ("pool",))
pool_desired_replicas = Gauge("swiftkv_pool_desired_replicas", "Replicas the pool's SLO needs at the current arrival rate and mix "
                              "of prompt and output tokens, at the measured prefill and decode rates, before clamping to the "
                              "pool's replicas.min and replicas.max (docs/operations/slo.md)", ("pool",))
pool_decode_rate = Gauge("swiftkv_pool_decode_rate_tokens_per_second", "Measured decode rate of one replica at the pool's batch size "
                         "now: sequences per replica over the time per output token measured in that batch-size bucket (the "
                         "prior, routing.decode_token_cost, until measured)", ("pool",))
predicted_ttft = Histogram("swiftkv_route_predicted_ttft_seconds", "Time to first token the gateway predicted for the pool it sent the request to (the prefills in line there and the request's uncached prompt, over the pool's measured prefill rate)", ("pool",), buckets=TTFT_BUCKETS)


class PoolMetrics:
    """The labelled children for one (pool, model), resolved once: `labels()` costs more than observing."""

    def __init__(self, pool: str, model: str, source: str = "live", route: str = "chat"):
        self.ttft = ttft.labels(pool, model, source, route)
        self.tpot = tpot.labels(pool, model, source, route)
        self.e2e = e2e.labels(pool, model, source)
        self.queue = queue.labels(pool, model, source)
        self.prompt_tokens = prompt_tokens.labels(pool, model, source)
        self.generation_tokens = generation_tokens.labels(pool, model, source)
        self.in_flight = in_flight.labels(pool)
        self.overhead = overhead.labels(pool)
        self.requests = {s: requests.labels(pool, model, source, s) for s in ("ok", "error", "client_disconnect", "aborted")}
        self.slo_within = slo_ttft.labels(pool, "within")
        self.slo_over = slo_ttft.labels(pool, "over")


_pool_metrics: dict[tuple[str, str, str, str], PoolMetrics] = {}


def for_pool(pool: str, model: str, source: str = "live", route: str = "chat") -> PoolMetrics:
    """Model names are checked against the served ones before they get here: the set stays small."""
    m = _pool_metrics.get((pool, model, source, route))
    if m is None:
        m = _pool_metrics[(pool, model, source, route)] = PoolMetrics(pool, model, source, route)
    return m


@functools.cache
def labelled(metric, *values: str):
    """`metric.labels(*values)`, resolved once per label set: labels() costs more than counting, and the sets are few."""
    return metric.labels(*values)
