"""Grafana dashboards of the platform, built with Grafana's own builder library (grafana-foundation-sdk).

`python deploy/grafana/dashboards.py` writes them into the chart (deploy/helm/swiftkv/files/dashboards/),
which ships each as a ConfigMap for Grafana's dashboard sidecar; tests/test_deploy.py checks that the
committed JSON is what this file builds and runs the speculative-decoding panels through promtool on known
counters; tests/test_deploy_live.py runs every other panel query against a real Prometheus scraping a live
platform (whose pools do not speculate).

Engine panels read vLLM's own metric names. Under Ray Serve the replicas export them through Ray as
`ray_vllm_*` (':' becomes '_'), so every engine query selects both spellings by `__name__`; only one of
them exists in a given deployment, so nothing is counted twice.

Engine series carry vLLM's `model_name` label, the pool's served model name (`<public>-<pool>` unless the pool
sets its own): that is the per-pool key of every engine panel.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).resolve().parents[1] / "helm" / "swiftkv" / "files" / "dashboards"
RATE = "$__rate_interval"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


def vllm(name: str) -> str:
    """Selector of a vLLM metric under both names: `vllm:x` (in-process engines, vLLM servers, the gateway's
    /metrics) and `ray_vllm_x` (Ray Serve replicas scraped from Ray's metrics port)."""
    ray = "ray_vllm_" + name
    if name.endswith("_total"):  # Ray's exporter may or may not add the counter suffix
        ray = "ray_vllm_" + name[: -len("_total")] + "(_total)?"
    return '{__name__=~"vllm:%s|%s"}' % (name, ray)


def quantiles(metric: str, by: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}[{RATE}])))", f"{{{{{by}}}}} p{round(q * 100)}") for q in qs]


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    description: str = ""
    needs: str = ""  # what must be on for the panel's series to exist at all ("": any running platform)


SPEC = "a pool with speculative decoding (its `speculative:` setting)"


def per_pool_rate(name: str, by: str = "model_name") -> str:
    return f"sum by ({by}) (rate({vllm(name)}[{RATE}]))"


# vLLM's conventions (vllm/v1/spec_decode/metrics.py): acceptance rate = accepted / drafted tokens; mean accepted
# length = 1 + accepted / drafts (the bonus token the target model adds to every draft counts).
ACCEPTED, DRAFTED, DRAFTS = ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total",
                             "spec_decode_num_drafts_total")


ROWS: dict[str, list[Panel]] = {
    "Latency (gateway, per pool)": [
        Panel("Time to first token", "s", quantiles("swiftkv_time_to_first_token_seconds_bucket", "pool"),
              "Request received to first token sent, live and batch requests"),
        Panel("Time per output token", "s", quantiles("swiftkv_time_per_output_token_seconds_bucket", "pool")),
        Panel("End-to-end latency", "s", quantiles("swiftkv_e2e_request_latency_seconds_bucket", "pool")),
        Panel("Gateway overhead p99", "s", quantiles("swiftkv_gateway_overhead_seconds_bucket", "pool", (0.99,)),
              "Parsing, auth, tokenization, limits and routing before dispatch"),
    ],
    "Traffic": [
        Panel("Requests by route reason", "reqps",
              [(f"sum by (pool, reason) (rate(swiftkv_route_decisions_total[{RATE}]))", "{{pool}} {{reason}}")]),
        Panel("Requests by outcome", "reqps",
              [(f"sum by (pool, status) (rate(swiftkv_requests_total[{RATE}]))", "{{pool}} {{status}}"),
               (f"sum by (reason) (rate(swiftkv_requests_rejected_total[{RATE}]))", "rejected {{reason}}")]),
        Panel("Prompt tokens/s", "short",
              [(f"sum by (pool) (rate(swiftkv_prompt_tokens_total[{RATE}]))", "{{pool}}")]),
        Panel("Output tokens/s", "short",
              [(f"sum by (pool) (rate(swiftkv_generation_tokens_total[{RATE}]))", "{{pool}}")]),
    ],
    "Pools: backlog and queues": [
        Panel("Backlog (prompt tokens not yet prefilled)", "short",
              [("sum by (pool) (swiftkv_pool_backlog_tokens)", "{{pool}}")]),
        Panel("Requests in flight (gateway)", "short",
              [("sum by (pool) (swiftkv_requests_in_flight)", "{{pool}}")]),
        Panel("Engine queue depth", "short",
              [(f"sum by (model_name) ({vllm('num_requests_running')})", "{{model_name}} running"),
               (f"sum by (model_name) ({vllm('num_requests_waiting')})", "{{model_name}} waiting")]),
        Panel("Pool ready", "short", [("min by (pool) (swiftkv_pool_ready)", "{{pool}}")]),
    ],
    # docs/operations/slo.md: each pool's SLO (pools.<name>.slo), what it attains, and the replicas it needs
    "SLO and capacity": [
        Panel("Predicted and measured TTFT", "s",
              [("max by (pool) (swiftkv_pool_predicted_ttft_seconds)", "{{pool}} predicted now"),
               (f'histogram_quantile(0.95, sum by (pool, le) (rate(swiftkv_time_to_first_token_seconds_bucket{{source="live"}}[{RATE}])))',
                "{{pool}} measured p95"),
               ("max by (pool) (swiftkv_pool_slo_ttft_seconds)", "{{pool}} SLO")],
              "The TTFT the gateway predicts for a request arriving now (the prefills in line over the replicas, its own, a "
              "decode step), beside the live p95 and the pool's slo.ttft_seconds"),
        Panel("Replicas: running and desired", "short",
              [("max by (pool) (swiftkv_pool_replicas)", "{{pool}} running"),
               ("max by (pool) (swiftkv_pool_desired_replicas)", "{{pool}} desired")],
              "Desired: what the SLO needs at the current arrival rate and mix, before replicas.min/max (docs/operations/slo.md)"),
        Panel("TTFT SLO attainment", "percentunit",
              [(f'sum by (pool) (rate(swiftkv_slo_ttft_requests_total{{outcome="within"}}[{RATE}])) / '
                f"sum by (pool) (rate(swiftkv_slo_ttft_requests_total[{RATE}]))", "{{pool}}"),
               ("max by (pool) (swiftkv_pool_slo_objective)", "{{pool}} objective")],
              "Share of live requests with their first token within the pool's slo.ttft_seconds (shed ones count as missed)"),
        Panel("Error budget burn rate", "short",
              [(f'sum by (pool) (rate(swiftkv_slo_ttft_requests_total{{outcome!="within"}}[{w}])) / '
                f"sum by (pool) (rate(swiftkv_slo_ttft_requests_total[{w}])) / on (pool) (1 - max by (pool) (swiftkv_pool_slo_objective))",
                f"{{{{pool}}}} {w}") for w in ("5m", "1h", "6h")],
              "How fast each pool spends its error budget (1 - slo.objective): 1 spends it in exactly the SLO's period; the "
              "burn-rate alerts fire above 14.4 (1h and 5m) and 6 (6h and 30m)"),
        Panel("Decode rate per replica", "short",
              [("max by (pool) (swiftkv_pool_decode_rate_tokens_per_second)", "{{pool}}")],
              "Output tokens per second of one replica at the pool's batch size now, measured per batch-size bucket"),
    ],
    "Engines (vLLM)": [
        Panel("Engine time to first token", "s", quantiles(vllm("time_to_first_token_seconds_bucket"), "model_name")),
        Panel("Inter-token latency", "s", quantiles(vllm("inter_token_latency_seconds_bucket"), "model_name")),
        Panel("KV cache usage", "percentunit",
              [(f"max by (model_name) ({vllm('kv_cache_usage_perc')})", "{{model_name}}")]),
        Panel("Engine queue time p90", "s", quantiles(vllm("request_queue_time_seconds_bucket"), "model_name", (0.9,))),
        Panel("Engine tokens/s", "short",
              [(f"sum by (model_name) (rate({vllm('prompt_tokens_total')}[{RATE}]))", "{{model_name}} prompt"),
               (f"sum by (model_name) (rate({vllm('generation_tokens_total')}[{RATE}]))", "{{model_name}} output")]),
    ],
    "Speculative decoding": [
        Panel("Draft acceptance rate", "percentunit",
              [(f"{per_pool_rate(ACCEPTED)} / {per_pool_rate(DRAFTED)}", "{{model_name}}")],
              "Accepted draft tokens / proposed draft tokens, per pool", SPEC),
        Panel("Mean accepted length", "short",
              [(f"1 + {per_pool_rate(ACCEPTED)} / {per_pool_rate(DRAFTS)}", "{{model_name}}")],
              "Tokens each verification step yields: 1 (the target model's own) + accepted draft tokens per draft", SPEC),
        Panel("Acceptance by draft position", "percentunit",
              [(f"{per_pool_rate('spec_decode_num_accepted_tokens_per_pos_total', 'model_name, position')}"
                f" / on (model_name) group_left {per_pool_rate(DRAFTS)}", "{{model_name}} position {{position}}")],
              "Share of drafts whose token at this position was accepted (position 0: the first draft token)", SPEC),
        Panel("Drafted and accepted tokens/s", "short",
              [(per_pool_rate(DRAFTED), "{{model_name}} drafted"), (per_pool_rate(ACCEPTED), "{{model_name}} accepted")],
              needs=SPEC),
    ],
    "Batch API": [
        Panel("Batch requests in flight and allowed", "short",
              [("sum by (pool) (swiftkv_batch_requests_in_flight)", "{{pool}} in flight"),
               ("min by (pool) (swiftkv_batch_in_flight_limit)", "{{pool}} allowed")]),
        Panel("Batch lines served, and aborted to make way for live requests", "reqps",
              [(f'sum by (pool, status) (rate(swiftkv_requests_total{{source="batch"}}[{RATE}]))', "{{pool}} {{status}}"),
               (f"sum by (pool) (rate(swiftkv_batch_requests_preempted_total[{RATE}]))", "{{pool}} aborted for live")]),
        Panel("Batches finished", "short",
              [("sum by (status) (swiftkv_batches_finished_total)", "{{status}}")]),
        Panel("Oldest pending batch line", "s",
              [("max(swiftkv_batch_oldest_pending_age_seconds)", "age")]),
    ],
    "Training jobs": [
        Panel("Fine-tuning jobs by status", "short",
              [("sum by (status) (swiftkv_training_jobs)", "{{status}}")], "Jobs in the trainer's store"),
        Panel("Running jobs", "short",
              [('sum(swiftkv_training_jobs{status="running"})', "running"),
               ('sum(swiftkv_training_jobs{status=~"validating_files|queued"})', "waiting"),
               ('sum(swiftkv_training_jobs{status="paused"})', "paused")], "One job runs at a time; the others wait in order"),
        Panel("Trained tokens/s", "short",
              [(f"sum(rate(swiftkv_training_tokens_total[{RATE}]))", "tokens/s")]),
        Panel("Jobs finished in the last hour", "short",
              [("sum by (status) (increase(swiftkv_training_jobs_finished_total[1h]))", "{{status}}")]),
    ],
}


def build() -> dict:
    board = (
        dashboard.Dashboard("SwiftKV serving")
        .uid("swiftkv-serving")
        .tags(["swiftkv", "vllm"])
        .description("Gateway latency and routing per pool, engine (vLLM) queues and KV cache, speculative decoding, Batch API, training jobs")
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for row, panels in ROWS.items():
        board = board.with_row(dashboard.Row(row))
        for p in panels:
            panel = (timeseries.Panel().title(p.title).unit(p.unit).datasource(DATASOURCE).span(12 if len(panels) < 4 else 6).height(8))
            description = p.description + (f"{'. ' if p.description else ''}No data without {p.needs}." if p.needs else "")
            if description:
                panel = panel.description(description)
            for i, (expr, legend) in enumerate(p.targets):
                panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCDEFGH"[i]).datasource(DATASOURCE))
            board = board.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON."""
    return {"swiftkv-serving.json": build()}


def queries(with_optional: bool = True) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, as the dashboards hold them; with_optional=False leaves out
    the panels whose series exist only when a feature is on (`Panel.needs`, e.g. speculative decoding)."""
    return [(p.title, expr) for panels in ROWS.values() for p in panels if with_optional or not p.needs
            for expr, _ in p.targets]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, board in dashboards().items():
        (OUT / name).write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
        print(OUT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
