"""The trainer's own metrics, on its /metrics (a separate process from the gateway)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

STATUSES = ("validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled")
FINAL = ("succeeded", "failed", "cancelled")

jobs_by_status = Gauge("swiftkv_training_jobs", "Fine-tuning jobs in the store by status (set at each scrape)", ("status",))
jobs_finished = Counter("swiftkv_training_jobs_finished", "Fine-tuning jobs this process saw reach a final status", ("status",))
trained_tokens = Counter("swiftkv_training_tokens", "Tokens trained by the jobs this process followed (steps redone after a resume count once)")
tokens_per_second = Gauge("swiftkv_training_tokens_per_second", "Training tokens per second of the running job (last logged step)")
step_seconds = Gauge("swiftkv_training_step_seconds", "Seconds per optimizer step of the running job (last logged step)")

# Every final status exists from the start at 0, so an alert on `increase(...{status="failed"})` has a series to
# compare against before the first failure.
for _status in FINAL:
    jobs_finished.labels(_status)
