"""The dashboards and alerts against a real Prometheus scraping a live platform (the run's shared engines: conftest's
`platform`) and a live trainer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import free_port, wait_until
from harness.deploy import ROOT, find, render, tool
from harness.engines import KEY
from harness.training import MODEL, QUICK, Trainer, create, records, wait_status


def _promql_left_side(expr: str) -> str:
    """An alert's expression without its threshold, so it returns data while nothing is wrong."""
    return re.split(r"\s(?:>|<|==|!=|>=|<=)\s[^()]*$", expr.strip())[0]


@pytest.mark.slow
@pytest.mark.engine
def test_every_panel_and_alert_query_returns_data_from_a_live_platform(platform, tiny_base, tmp_path):
    """Prometheus (Debian's binary, loopback) scrapes a live `swiftkv serve --engine inprocess` and a live
    `swiftkv trainer serve` on the tiny fixtures; after a short load (live requests to both pools, a rejected one,
    a batch, a four-step distillation job) every dashboard panel query and every alert expression, run through
    Prometheus's HTTP API, returns a series with a number."""
    import httpx
    import openai

    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import dashboards
        import render_png  # noqa: F401
    finally:
        sys.path.pop(0)
    prometheus = tool("prometheus")
    base = platform.base
    trainer = Trainer(tmp_path, tmp_path / "trainer", tmp_path / "models", tiny_base)
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "swiftkv-gateway", "static_configs": [{"targets": [base.removeprefix("http://")]}]},
                           {"job_name": "swiftkv-trainer", "static_configs": [{"targets": [trainer.base.removeprefix("http://")]}]}]}))
    prom = None
    try:
        trainer.start()
        trainer_client = trainer.client()
        job = create(trainer_client, MODEL, trainer_client.files.create(file=("train.jsonl", records()), purpose="fine-tune").id)
        with open(tmp_path / "prometheus.log", "w") as log:
            prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        # /-/ready answers 503 "Service Unavailable" (not JSON) while the TSDB opens: query only once it is ready
        ready = f"http://127.0.0.1:{prom_port}/-/ready"
        wait_until(lambda: httpx.get(ready, timeout=2).status_code == 200, 60, "ready", prom, lambda: (tmp_path / "prometheus.log").read_text())
        wait_until(lambda: httpx.get(f"{api}/query", params={"query": "up"}, timeout=2).json()["data"]["result"], 60, "scraping", prom,
                   lambda: (tmp_path / "prometheus.log").read_text())

        client = platform.client(KEY)
        started = time.time()
        long_prompt = "Summarize the following notes about the river and the town. " * 12
        for i in range(4):  # prompt-heavy -> swiftkv, output-heavy -> base, streamed and not
            if i == 1:  # each series scraped once before it grows: a series born at its final count has no rate()
                time.sleep(2.5)
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
            for _ in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=24,
                                                    stream=True, stream_options={"include_usage": True}):
                pass
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "tiny", "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4}}) + "\n"
                        for i in range(3))
        batch = client.batches.create(input_file_id=client.files.create(file=("in.jsonl", lines.encode()), purpose="batch").id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + 120
        while client.batches.retrieve(batch.id).status != "completed":
            assert time.time() < deadline, "batch did not complete"
            time.sleep(0.5)
        wait_status(trainer_client, job.id, ("succeeded",))

        rule = find(render(), "PrometheusRule")[0]
        alert_exprs = [(r["alert"], _promql_left_side(r["expr"])) for g in rule["spec"]["groups"] for r in g["rules"]]

        def without_data() -> list[str]:
            empty = []
            for title, expr in dashboards.queries(with_optional=False) + alert_exprs:  # no pool here speculates
                query = expr.replace("$__rate_interval", "1m")
                body = httpx.get(f"{api}/query", params={"query": query}, timeout=10).json()
                assert body["status"] == "success", (title, query, body)
                values = [float(r["value"][1]) for r in body["data"]["result"]]
                if not any(v == v for v in values):  # no series, or only NaN
                    empty.append(f"{title}: {query}")
            return empty

        deadline = time.time() + 30  # the last requests' series need a few scrapes (every second) for their rate()
        while empty := without_data():
            assert time.time() < deadline, "queries without data:\n" + "\n".join(empty)
            time.sleep(1)
        trained = httpx.get(f"{api}/query", params={"query": "sum(swiftkv_training_tokens_total)"}, timeout=10).json()["data"]["result"]
        assert float(trained[0]["value"][1]) == QUICK["n_steps"] * QUICK["batch_size"] * QUICK["seq_len"]

        # the latency panels as a picture, from the same queries (docs/deploy/observability.md: SWIFTKV_DASHBOARD_PNG=docs/dashboard-latency.png)
        import render_png

        for out in [tmp_path / "latency.png"] + ([Path(os.environ["SWIFTKV_DASHBOARD_PNG"])] if os.environ.get("SWIFTKV_DASHBOARD_PNG") else []):
            assert render_png.render(f"http://127.0.0.1:{prom_port}", out, minutes=(time.time() - started) / 60 + 0.2).read_bytes()[:4] == b"\x89PNG"
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        trainer.stop()
