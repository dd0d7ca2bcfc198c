"""The gateway's predictions beside what was measured, between two scrapes of a server's /metrics:

- Prefix caching: vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up / found
  cached, per engine model name: one per pool, `<public>-<pool>`), and the gateway's
  `swiftkv_route_prefix_cached_tokens` (prompt tokens its prefix index expected cached on the pool it chose,
  cache-aware routing) over `swiftkv_prompt_tokens` (per pool): how well the index predicts the engines' own hits.
- Time to first token: the one the gateway predicted for each pool it chose (`swiftkv_route_predicted_ttft_seconds`)
  and the one it measured (`swiftkv_time_to_first_token_seconds`): how well routing's cost model predicts the
  engines' speed.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

ENGINE = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}  # labelled by model_name
GATEWAY = {"swiftkv_route_prefix_cached_tokens": "predicted_cached", "swiftkv_prompt_tokens": "prompt_tokens"}  # by pool
TTFT = {"swiftkv_route_predicted_ttft_seconds": "predicted", "swiftkv_time_to_first_token_seconds": "measured"}  # by pool


def _summed(text: str | None, families: dict[str, str], suffixes: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """{(who, what): value} for the samples of `families` ending in one of `suffixes`, summed over other labels: who is
    an engine's model_name (ENGINE) or a gateway pool; what is the family's short name, `_sum` / `_count` appended for
    a histogram's parts (a counter's `_total` is not)."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text or ""):
        for s in family.samples:
            base, _, suffix = s.name.rpartition("_")
            what, who = families.get(base), s.labels.get("model_name" if base in ENGINE else "pool")
            if what is None or who is None or f"_{suffix}" not in suffixes:
                continue
            key = (who, what if suffix == "total" else f"{what}_{suffix}")
            out[key] = out.get(key, 0.0) + s.value
    return out


def _delta(before: str | None, after: str | None, families: dict[str, str],
           suffixes: tuple[str, ...] = ("_total",)) -> dict[tuple[str, str], float]:
    """What each of `_summed`'s values grew by between the two scrapes; one lower after than before (its process
    restarted) counts from zero."""
    start, end = _summed(before, families, suffixes), _summed(after, families, suffixes)
    return {key: value if value < start.get(key, 0.0) else value - start.get(key, 0.0) for key, value in end.items()}


def prefix_cache(before: str | None, after: str | None, public: str | None = None) -> dict[str, dict]:
    """Per pool (engine model names `<public>-<pool>` folded into their pool when `public` is given): queries, hits and
    hit_rate of the engines' prefix caches, and the gateway's predicted_cached tokens and predicted_hit_rate over the
    prompt tokens it dispatched there; rates None where nothing was counted. A counter lower after than before (its
    engine restarted) counts from zero."""
    pools: dict[str, dict[str, float]] = {}
    for (who, counter), grew in _delta(before, after, ENGINE | GATEWAY).items():
        pool = who.removeprefix(f"{public}-") if public else who
        pools.setdefault(pool, {})[counter] = pools.get(pool, {}).get(counter, 0.0) + grew

    def ratio(num: float, den: float) -> float | None:
        return round(num / den, 4) if den > 0 else None

    return {pool: {"queries": round(c.get("queries", 0)), "hits": round(c.get("hits", 0)),
                   "hit_rate": ratio(c.get("hits", 0), c.get("queries", 0)),
                   "predicted_cached": round(c.get("predicted_cached", 0)),
                   "predicted_hit_rate": ratio(c.get("predicted_cached", 0), c.get("prompt_tokens", 0))}
            for pool, c in sorted(pools.items())}


def ttft_predictions(before: str | None, after: str | None) -> dict[str, dict]:
    """Per gateway pool: the mean time to first token the gateway predicted and the mean it measured (seconds, over the
    requests between the two scrapes), and their count; means None where nothing was counted."""
    grew = _delta(before, after, TTFT, ("_sum", "_count"))
    out: dict[str, dict] = {}
    for pool in sorted({who for who, _ in grew}):
        row: dict[str, float | int | None] = {}
        for kind in TTFT.values():
            n = grew.get((pool, f"{kind}_count"), 0.0)
            row[f"{kind}_mean_s"] = round(grew.get((pool, f"{kind}_sum"), 0.0) / n, 4) if n > 0 else None
            row[f"{kind}_count"] = round(n)
        if row["measured_count"] or row["predicted_count"]:
            out[pool] = row
    return out
