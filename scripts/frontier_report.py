"""Tables and plots of the frontier runs made by scripts/frontier.sh (docs/benchmarks.md, "Frontier").

    .venv/bin/python scripts/frontier_report.py [--runs runs] [--out docs]

Reads, per row, RUNS/ROW/{summary.json, metrics.jsonl, eval-heldout.json, eval-heldout_manpages.json} and
RUNS/speed-lL-gG.json (`swiftkv bench engine`); where a layout has no engine measurement the FLOPs bound of
`swiftkv analyze flops` (2,000-token prompts) is shown instead, marked "bound", unless a recorded row of the
same layout carries a measured one. A measurement in RUNS replaces the recorded speed-up of every row of its
layout (the newer one). Rows are trained on several
machines and runs/ is not kept, so each finished row's figures and learning curve are recorded in
OUT/frontier-rows.json (a row in RUNS replaces its record) and the table and plots are drawn from all recorded
rows. Prints the Markdown table and writes OUT/frontier.png (quality against prefill speed-up),
OUT/learning-curves.png and OUT/budget.png (quality against training tokens, per layout, plain recipe at T = 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def speedup(runs: Path, l: int, g: int, config: dict) -> tuple[float, str]:
    measured = _load(runs / f"speed-l{l}-g{g}.json")
    if measured:
        return measured["prefill_speedup"], "measured"
    from types import SimpleNamespace

    from swiftkv_core.analysis import ModelShape, flops_report

    shape = ModelShape.from_config(SimpleNamespace(**({"head_dim": None} | config)))
    return flops_report(shape, 2000, l, g)["max_prefill_speedup"], "bound"


EVAL_KEYS = ("top1_agreement", "kl", "ppl_ratio", "greedy_exact_match", "greedy_token_agreement",
             "long_teacher_forced_agreement", "long_rouge_l")


def _figures(d: dict | None) -> dict | None:
    return {k: d[k] for k in EVAL_KEYS if k in d} if d else None


def _machine(summary: dict) -> str:
    if summary.get("device", "cpu") != "cpu":  # trained on a GPU: the card, not the host's CPU
        return f"{summary['device']}, {'bf16' if summary.get('precision') == 'bf16' else 'float32'}"
    m = summary.get("machine")
    if not m:
        return "-"
    kind = "AMX" if m.get("amx") else "AVX-512" if m.get("avx512") else "AVX2"
    cpu = m["cpu_model"].replace("(R)", "").replace("(TM)", "").replace(" Processor", "")  # "Intel(R) Xeon(R) Processor" -> "Intel Xeon"
    return f"{cpu}, {kind}, {'bf16' if summary.get('precision') == 'bf16' else 'float32'}"


def recipe(cfg: dict) -> str:
    """What a row adds to the common recipe (lstsq init + KL on data/mix/train.jsonl): the table's recipe column."""
    notes = [f"hidden MSE x{cfg['hidden_weight']:g}"] if cfg.get("hidden_weight") else []
    data = Path(cfg["data"])
    if data.name != "train.jsonl":
        notes.append(f"data {data.name}")
    elif data.parent.name not in ("mix", ""):
        notes.append(f"data {data.parent.name}")
    if cfg.get("batch_size", 8) != 8:
        notes.append(f"batch {cfg['batch_size']}")
    if cfg.get("train_scope", "swiftkv") == "lora":
        modules = cfg["lora_modules"].split(",") if isinstance(cfg["lora_modules"], str) else cfg["lora_modules"]
        notes.append(f"adapters r{cfg['lora_rank']} on {'/'.join(m.removesuffix('_proj') for m in modules)}")
    elif cfg.get("train_scope", "swiftkv") != "swiftkv":
        notes.append(f"trains {cfg['train_scope']}")
    if cfg.get("lr", 1e-3) != 1e-3:
        notes.append(f"lr {cfg['lr']:g}")
    return ", ".join(notes) or "-"


def rows(runs: Path) -> list[dict]:
    """One compact record per finished row in RUNS: everything the table and plots need."""
    out = []
    if not runs.is_dir():
        return out
    for run in sorted(p for p in runs.iterdir() if (p / "summary.json").exists() and (p / "run.json").exists()):
        cfg, summary = _load(run / "run.json"), _load(run / "summary.json")
        model_cfg = _load(run / "config.json") or {}
        l, g = cfg["num_key_value_layers"], cfg["key_value_group_size"]
        s, how = speedup(runs, l, g, model_cfg)
        curve = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        out.append({"name": run.name, "l": l, "g": g, "init": cfg["init"], "temperature": cfg["temperature"], "recipe": recipe(cfg),
                    "tokens": summary["tokens"], "train_tok_s": summary["tokens_per_second"], "machine": _machine(summary),
                    "speedup": s, "speedup_how": how,
                    "heldout": _figures(_load(run / "eval-heldout.json")), "manpages": _figures(_load(run / "eval-heldout_manpages.json")),
                    "curve": [[p["tokens"], round(p["kl"], 5)] for p in curve if "kl" in p]})
    return out


def measurements(runs: Path) -> dict[tuple[int, int], float]:
    """The layouts' prefill speed-ups measured in RUNS (`scripts/frontier.sh speed L:G`)."""
    out = {}
    for path in runs.glob("speed-l*-g*.json") if runs.is_dir() else []:
        l, g = path.stem.removeprefix("speed-l").split("-g")
        out[(int(l), int(g))] = json.loads(path.read_text())["prefill_speedup"]
    return out


def merged(recorded: list[dict], fresh: list[dict], measured_now: dict[tuple[int, int], float] | None = None) -> list[dict]:
    """The recorded rows with those found in RUNS put in their place (by name), ordered by layout."""
    by_name = {r["name"]: r for r in recorded} | {r["name"]: r for r in fresh}
    # A speed-up depends on the layout only: a measurement in RUNS is the newest for every row of its layout, and
    # a row showing the FLOPs bound takes a measured one of its layout.
    now = measured_now or {}
    earlier = {(r["l"], r["g"]): r["speedup"] for r in recorded + fresh if r["speedup_how"] == "measured"}
    for r in by_name.values():
        layout = (r["l"], r["g"])
        if layout in now:
            r["speedup"], r["speedup_how"] = now[layout], "measured"
        elif r["speedup_how"] == "bound" and layout in earlier:
            r["speedup"], r["speedup_how"] = earlier[layout], "measured"
    return sorted(by_name.values(), key=lambda r: (r["l"], r["g"], r["name"]))


def _f(d: dict | None, key: str, fmt: str = "{:.3f}") -> str:
    return fmt.format(d[key]) if d and key in d else "-"


def table(rs: list[dict]) -> str:
    head = ("| row | l | g | init | T | recipe | tokens | prefill speed-up | top-1 held-out / man | KL held-out / man | ppl ratio held-out / man "
            "| greedy exact / prefix | long: forced agreement / ROUGE-L | train tok/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rs:
        h, m = r["heldout"], r["manpages"]
        lines.append(
            f"| {r['name']} ({r['machine']}) | {r['l']} | {r['g']} | {r['init']} | {r['temperature']:g} | {r.get('recipe', '-')} | {r['tokens']:,} "
            f"| {r['speedup']:.2f} ({r['speedup_how']}) | {_f(h, 'top1_agreement')} / {_f(m, 'top1_agreement')} "
            f"| {_f(h, 'kl')} / {_f(m, 'kl')} | {_f(h, 'ppl_ratio')} / {_f(m, 'ppl_ratio')} "
            f"| {_f(h, 'greedy_exact_match', '{:.2f}')} / {_f(h, 'greedy_token_agreement', '{:.2f}')} "
            f"| {_f(h, 'long_teacher_forced_agreement')} / {_f(h, 'long_rouge_l')} | {r['train_tok_s']:.0f} |"
        )
    return "\n".join(lines)


def plots(rs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.6))
    # One colour per row, one marker per text. Rows of one layout share a speed-up: they are drawn side by side
    # (dodged by 0.012) so that none hides another.
    layouts: dict[tuple[int, int], list[str]] = {}
    for r in rs:
        layouts.setdefault((r["l"], r["g"]), []).append(r["name"])
    for i, r in enumerate(rs):
        group = layouts[(r["l"], r["g"])]
        x = r["speedup"] + 0.012 * (group.index(r["name"]) - (len(group) - 1) / 2)
        color = plt.cm.tab20(i % 20)  # more rows than tab10 has colours
        for d, marker in ((r["heldout"], "o"), (r["manpages"], "s")):
            if d:
                a.scatter(x, d["top1_agreement"], marker=marker, color=color)
                b.scatter(x, d["ppl_ratio"], marker=marker, color=color)
        a.scatter([], [], marker="o", color=color, label=r["name"])
    a.axhline(0.90, color="gray", ls="--", lw=0.8)
    b.axhline(1.05, color="gray", ls="--", lw=0.8)
    a.set(xlabel="prefill speed-up over the base model", ylabel="top-1 agreement with the teacher", title="agreement (target >= 0.90)")
    b.set(xlabel="prefill speed-up over the base model", ylabel="perplexity ratio student / teacher", title="perplexity (target <= 1.05)")
    b.scatter([], [], marker="o", color="gray", label="held-out docs")
    b.scatter([], [], marker="s", color="gray", label="man pages")
    a.legend(fontsize=7, title="row", title_fontsize=7)
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rs:
        pts = r["curve"]
        if pts:
            xs, ys = zip(*pts)
            k = 10  # one batch is noisy: the line is a 10-step running mean, the raw points are faint
            smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
            line, = ax.plot(xs, smooth, label=r["name"], lw=1.5)
            ax.plot(xs, ys, color=line.get_color(), lw=0.5, alpha=0.3)
    ax.set(xlabel="training tokens", ylabel="training KL (T^2-scaled, per target token)\n10-step running mean", title="learning curves", xscale="log", yscale="log")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "learning-curves.png", dpi=110)
    plt.close(fig)
    budget_plot(rs, out)


def budget_series(rs: list[dict]) -> dict[int, list[dict]]:
    """Per layout (g = 1), the rows of the plain recipe at T = 1 (no other lever; any data, batch or machine),
    by training tokens: how quality grows with the budget alone."""
    plain = ("-", "data mix-large, batch 32")
    series: dict[int, list[dict]] = {}
    for r in rs:
        if r["g"] == 1 and r["temperature"] == 1 and r["recipe"] in plain and r["heldout"] and r["manpages"]:
            series.setdefault(r["l"], []).append(r)
    return {l: sorted(v, key=lambda r: r["tokens"]) for l, v in sorted(series.items())}


def budget_plot(rs: list[dict], out: Path) -> None:
    """docs/budget.png: top-1 agreement and perplexity ratio against training tokens, per layout, with the bar."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (l, rows_l) in enumerate(budget_series(rs).items()):
        color = plt.cm.tab10(i)
        xs = [r["tokens"] for r in rows_l]
        for text, ls, marker in (("heldout", "-", "o"), ("manpages", "--", "s")):
            a.plot(xs, [r[text]["top1_agreement"] for r in rows_l], ls=ls, marker=marker, color=color, label=f"l = {l}, {text}")
            b.plot(xs, [r[text]["ppl_ratio"] for r in rows_l], ls=ls, marker=marker, color=color, label=f"l = {l}, {text}")
    a.axhline(0.90, color="gray", ls=":", lw=1)
    b.axhline(1.05, color="gray", ls=":", lw=1)
    a.set(xscale="log", xlabel="training tokens", ylabel="top-1 agreement with the teacher", title="agreement against budget (bar >= 0.90)")
    b.set(xscale="log", xlabel="training tokens", ylabel="perplexity ratio student / teacher", title="perplexity against budget (bar <= 1.05)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "budget.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    record = Path(args.out) / "frontier-rows.json"
    rs = merged(json.loads(record.read_text()) if record.exists() else [], rows(Path(args.runs)), measurements(Path(args.runs)))
    if not rs:
        raise SystemExit(f"no finished runs in {args.runs} and no rows recorded in {record}")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(rs, indent=1) + "\n")
    print(table(rs))
    plots(rs, Path(args.out))


if __name__ == "__main__":
    main()
