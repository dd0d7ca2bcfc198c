"""Prometheus text as a dict, for exact lookups and sums over label sets."""

from __future__ import annotations

import re

import httpx


def scrape(base: str, key: str | None = None) -> dict[str, float]:
    """GET base/metrics -> {'name{labels}': value}, labels sorted (no labels: 'name{}')."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return parse(httpx.get(f"{base}/metrics", headers=headers, timeout=30).text)


def parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        m = re.match(r"([^{]+)(?:\{(.*)\})?$", series)
        labels = ",".join(sorted(re.findall(r'\w+="[^"]*"', m.group(2) or "")))
        out[f"{m.group(1)}{{{labels}}}"] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """The sum over the series of `name` that carry these labels (any others, e.g. source, are summed over)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for key, value in samples.items():
        series, _, rest = key.partition("{")
        if series == name and want <= set(re.findall(r'\w+="[^"]*"', rest)):
            total += value
    return total
