"""One picture of `swiftkv bench platform` sweeps: TTFT p50 and throughput against offered load for every configuration
of the given reports (runs of the same workload on the same machine, e.g. one per configuration or per rate range).

    .venv/bin/python scripts/sweep_plot.py runs/platform/a.json runs/platform/b.json --out docs/sweep.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(paths: list[Path]) -> tuple[str, str, dict[str, list[tuple[float, dict]]]]:
    """-> the workload, the first report's CPU, and per configuration its (rate, figures) points from every report, by
    rate."""
    workloads, machine, points = set(), None, {}
    for path in paths:
        report = json.loads(path.read_text())
        workloads.add(report["workload"])
        machine = machine or report["machine"]["cpu_summary"].split(";")[0]
        for name, config in report["configs"].items():
            points.setdefault(name, []).extend((float(rate), f) for rate, f in config["rates"].items())
    if len(workloads) != 1:
        raise SystemExit(f"the reports are of different workloads: {sorted(workloads)}")
    return workloads.pop(), machine, {name: sorted(p, key=lambda x: x[0]) for name, p in points.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    workload, machine, points = series(a.reports)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, pts) in enumerate(points.items()):
        rates, color = [r for r, _ in pts], f"C{k}"  # one colour per configuration in both panels
        ttft.plot(rates, [f["ttft_p50_s"] for _, f in pts], marker="o", color=color, label=f"{name} p50")
        ttft.plot(rates, [f["ttft_p99_s"] for _, f in pts], marker="s", linestyle="--", alpha=0.5, color=color, label=f"{name} p99")
        tput.plot(rates, [f["throughput_tok_s"] for _, f in pts], marker="o", color=color, label=name)
    ttft.set(xlabel="offered load (requests/s)", ylabel="TTFT (s)", yscale="log", title="time to first token")
    tput.set(xlabel="offered load (requests/s)", ylabel="prompt + output tokens/s", title="throughput")
    for ax in (ttft, tput):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{workload}: platform load test, {machine}")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
