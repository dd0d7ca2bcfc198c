"""Speculative decoding as the engines count it: vLLM's `vllm:spec_decode_*` counters read from a server's /metrics
before and after a measured run, per engine model name (`model_name`: one per pool, `<public>-<pool>` by default).

vLLM's conventions (vllm/v1/spec_decode/metrics.py): acceptance rate = accepted / drafted tokens; mean accepted
length = 1 + accepted tokens / drafts (the token the target model adds to every draft counts); acceptance at a
draft position = drafts whose token there was accepted / drafts. An engine without speculative decoding has no
`spec_decode` series at all: its pool is listed with `speculative: false` and no rates.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def scrape(base: str, api_key: str = "none", timeout: float = 10.0) -> str | None:
    """The Prometheus text of `base`/metrics; None when the server gives none (no such route, not reachable)."""
    import httpx

    try:
        r = httpx.get(f"{base.rstrip('/')}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def _engine_series(text: str) -> tuple[set[str], dict[tuple, float]]:
    """-> (every model_name of a vLLM series, {(counter, labels): value} of the speculation counters). Counters are
    read by their `_total` sample (the parser names it so whether or not the page did, as under Ray)."""
    models: set[str] = set()
    counters: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:") or "model_name" not in s.labels:
                continue
            models.add(s.labels["model_name"])
            name = s.name.removesuffix("_total")
            if s.name.endswith("_total") and (name in COUNTERS or name == PER_POSITION):
                counters[(name, tuple(sorted(s.labels.items())))] = s.value
    return models, counters


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def speculation(before: str | None, after: str | None) -> dict[str, dict]:
    """Per engine model name, what its engines drafted and accepted between two scrapes of /metrics (Prometheus
    text): drafts, draft_tokens, accepted_tokens, acceptance_rate, mean_accepted_length, acceptance_by_position
    (rates None when nothing was drafted). Series are summed over engines and replicas; a counter lower after than
    before (its engine restarted) counts from zero, as Prometheus's rate() does. {} when `after` is None."""
    if after is None:
        return {}
    models, end = _engine_series(after)
    start = _engine_series(before)[1] if before is not None else {}
    totals: dict[str, dict] = {}
    for (name, labels), value in end.items():
        delta = value - start.get((name, labels), 0.0)
        delta = value if delta < 0 else delta
        label = dict(labels)
        pool = totals.setdefault(label["model_name"], {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "by_position": {}})
        if name == PER_POSITION:
            pos = int(label.get("position", 0))
            pool["by_position"][pos] = pool["by_position"].get(pos, 0.0) + delta
        else:
            pool[COUNTERS[name]] += delta
    out = {}
    for model in sorted(models):
        t = totals.get(model)
        if t is None:
            out[model] = {"speculative": False, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None,
                          "mean_accepted_length": None, "acceptance_by_position": []}
            continue
        drafts, accepted = t["drafts"], t["accepted_tokens"]
        out[model] = {
            "speculative": True, "drafts": round(drafts), "draft_tokens": round(t["draft_tokens"]), "accepted_tokens": round(accepted),
            "acceptance_rate": _ratio(accepted, t["draft_tokens"]),
            "mean_accepted_length": None if drafts <= 0 else round(1 + accepted / drafts, 4),
            "acceptance_by_position": [_ratio(t["by_position"][p], drafts) for p in sorted(t["by_position"])],
        }
    return out


def cells(spec: dict[str, dict]) -> tuple[str, str]:
    """(acceptance rate, mean accepted length) per pool for a table, e.g. ('swiftkv=0.62 base=-', 'swiftkv=2.41
    base=-'): '-' for a pool that does not speculate or drafted nothing; '-' alone when no pool was read."""
    def cell(key: str) -> str:
        return " ".join(f"{pool}={'-' if s[key] is None else f'{s[key]:.2f}'}" for pool, s in spec.items()) or "-"

    return cell("acceptance_rate"), cell("mean_accepted_length")
