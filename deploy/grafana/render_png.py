"""Render the dashboard's latency panels to a PNG without a Grafana server: the same PromQL the dashboard
holds (deploy/grafana/dashboards.py), run as range queries against Prometheus and drawn with matplotlib.

    python deploy/grafana/render_png.py --prometheus http://127.0.0.1:9090 --out latency.png --minutes 10
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dashboards  # noqa: E402

PANELS = ("Time to first token", "Time per output token", "End-to-end latency", "Inter-token latency")


def range_series(prometheus: str, expr: str, start: float, end: float, step: float, rate_window: str) -> list[tuple[dict, list, list]]:
    body = httpx.get(f"{prometheus}/api/v1/query_range", timeout=30, params={
        "query": expr.replace("$__rate_interval", rate_window), "start": start, "end": end, "step": step}).json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    out = []
    for r in body["data"]["result"]:
        ts = [float(t) - start for t, _ in r["values"]]
        vs = [float(v) for _, v in r["values"]]
        out.append((r["metric"], ts, vs))
    return out


def legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{%s}}" % key, value)
    return template


def render(prometheus: str, out: Path, minutes: float = 10, rate_window: str = "30s") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {p.title: p for ps in dashboards.ROWS.values() for p in ps}
    end = time.time()
    start = end - minutes * 60
    step = max(1.0, minutes * 60 / 300)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), constrained_layout=True)
    for ax, title in zip(axes.flat, PANELS):
        for expr, template in panels[title].targets:
            for labels, ts, vs in range_series(prometheus, expr, start, end, step, rate_window):
                points = [(t, v * 1000) for t, v in zip(ts, vs) if not math.isnan(v)]
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], label=legend(template, labels), linewidth=1.4)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle("SwiftKV serving: latency per pool (gateway) and per engine (vLLM)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate-window", default="1m", help="what Grafana's $__rate_interval stands for")
    args = parser.parse_args()
    print(render(args.prometheus.rstrip("/"), args.out, args.minutes, args.rate_window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
