"""operations/metrics.md: the platform's own Prometheus metrics, read off the metric objects the modules define."""

from __future__ import annotations

import importlib
from typing import Iterator

from prometheus_client.metrics import MetricWrapperBase

from .markdown import banner, code, docstring, table

# Every module that defines platform metrics (tests/test_docs.py checks that no other module does).
METRIC_MODULES = ("services.gateway.metrics", "services.batch.metrics", "services.training.metrics", "services.serving.replicas",
                  "services.common.keys")
SUFFIX = {"counter": "_total"}  # what prometheus_client appends to a counter's name in the exposition


def defined_metrics(module_name: str) -> Iterator[MetricWrapperBase]:
    module = importlib.import_module(module_name)
    yield from (obj for obj in vars(module).values() if isinstance(obj, MetricWrapperBase))


def exposed_name(metric: MetricWrapperBase) -> str:
    family = metric.describe()[0]
    return family.name + SUFFIX.get(family.type, "")


def _row(metric: MetricWrapperBase) -> tuple[str, ...]:
    family = metric.describe()[0]
    # prometheus_client keeps labels and buckets only in private fields; the float('inf') bucket is implicit
    buckets = [b for b in getattr(metric, "_upper_bounds", ()) if b != float("inf")]
    return (code(exposed_name(metric)), family.type, ", ".join(code(label) for label in metric._labelnames),
            family.documentation, ", ".join(f"{b:g}" for b in buckets))


def metrics_page() -> str:
    parts = [banner("Metrics", *(m.replace(".", "/") + ".py" for m in METRIC_MODULES)),
             "Served at `/metrics` by the gateway and the trainer. Counters are exposed with the suffix `_total`, "
             "histograms as `_bucket`, `_sum` and `_count` series; the engines' own metrics keep vLLM's `vllm:` names.\n"]
    for module_name in METRIC_MODULES:
        parts += [f"## `{module_name}`\n", docstring(importlib.import_module(module_name)) + "\n",
                  table(("Name", "Type", "Labels", "Help", "Buckets"), map(_row, defined_metrics(module_name)))]
    return "\n".join(parts)
