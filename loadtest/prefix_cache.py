"""Prefix caching as the engines count it and as the gateway predicted it, between two scrapes of a server's /metrics:
vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up / found cached, per engine
model name: one per pool, `<public>-<pool>`), and the gateway's `swiftkv_route_prefix_cached_tokens` (prompt tokens its
prefix index expected cached on the pool it chose, cache-aware routing) over `swiftkv_prompt_tokens` (per pool).
The two hit rates side by side show how well the index predicts the engines' own hits. Beside them, the time to first
token the gateway predicted for each pool it chose (`swiftkv_route_predicted_ttft_seconds`) and the one it measured
(`swiftkv_time_to_first_token_seconds`): how well routing's cost model predicts the engines' speed.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

ENGINE = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
GATEWAY = {"swiftkv_route_prefix_cached_tokens": "predicted_cached", "swiftkv_prompt_tokens": "prompt_tokens"}


def _counters(text: str | None) -> dict[tuple[str, str], float]:
    """{(who, counter): value}: who is an engine's model_name or a gateway pool; counters summed over other labels."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text or ""):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if not s.name.endswith("_total"):
                continue
            if name in ENGINE and "model_name" in s.labels:
                key = (s.labels["model_name"], ENGINE[name])
            elif name in GATEWAY and "pool" in s.labels:
                key = (s.labels["pool"], GATEWAY[name])
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def prefix_cache(before: str | None, after: str | None, public: str | None = None) -> dict[str, dict]:
    """Per pool (engine model names `<public>-<pool>` folded into their pool when `public` is given): queries, hits and
    hit_rate of the engines' prefix caches, and the gateway's predicted_cached tokens and predicted_hit_rate over the
    prompt tokens it dispatched there; rates None where nothing was counted. A counter lower after than before (its
    engine restarted) counts from zero."""
    start, end = _counters(before), _counters(after)
    pools: dict[str, dict[str, float]] = {}
    for (who, counter), value in end.items():
        delta = value - start.get((who, counter), 0.0)
        pool = who.removeprefix(f"{public}-") if public else who
        pools.setdefault(pool, {})[counter] = pools.get(pool, {}).get(counter, 0.0) + (value if delta < 0 else delta)

    def ratio(num: float, den: float) -> float | None:
        return round(num / den, 4) if den > 0 else None

    return {pool: {"queries": round(c.get("queries", 0)), "hits": round(c.get("hits", 0)),
                   "hit_rate": ratio(c.get("hits", 0), c.get("queries", 0)),
                   "predicted_cached": round(c.get("predicted_cached", 0)),
                   "predicted_hit_rate": ratio(c.get("predicted_cached", 0), c.get("prompt_tokens", 0))}
            for pool, c in sorted(pools.items())}


TTFT = {"swiftkv_route_predicted_ttft_seconds": "predicted", "swiftkv_time_to_first_token_seconds": "measured"}


def ttft_predictions(before: str | None, after: str | None) -> dict[str, dict]:
    """Per gateway pool: the mean time to first token the gateway predicted and the mean it measured (seconds, over the
    requests between the two scrapes), and their count; means None where nothing was counted."""
    def sums(text: str | None) -> dict[tuple[str, str, str], float]:
        out: dict[tuple[str, str, str], float] = {}
        for family in text_string_to_metric_families(text or ""):
            for s in family.samples:
                for name, kind in TTFT.items():
                    for part in ("sum", "count"):
                        if s.name == f"{name}_{part}" and "pool" in s.labels:
                            key = (s.labels["pool"], kind, part)
                            out[key] = out.get(key, 0.0) + s.value
        return out

    start, end = sums(before), sums(after)
    delta = {k: v - start.get(k, 0.0) for k, v in end.items()}
    out: dict[str, dict] = {}
    for pool in sorted({k[0] for k in delta}):
        row: dict[str, float | int | None] = {}
        for kind in TTFT.values():
            n = delta.get((pool, kind, "count"), 0.0)
            row[f"{kind}_mean_s"] = round(delta.get((pool, kind, "sum"), 0.0) / n, 4) if n > 0 else None
            row[f"{kind}_count"] = round(n)
        if row["measured_count"] or row["predicted_count"]:
            out[pool] = row
    return out
