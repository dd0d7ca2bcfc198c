"""Make a frontier run the platform's default SwiftKV model: its trained tensors (bf16) into
swiftkv_core/weights/ with a recipe beside them (how it was trained, its measured quality and speed-up), read
from the run folder, its evaluations and the layout's engine measurement (scripts/frontier.sh).

    .venv/bin/python scripts/ship_default.py runs/l22 [--row l22] [--runs runs]

Then `rm -rf models/smollm2-135m-instruct-swiftkv && swiftkv models prepare smollm2-135m-instruct-swiftkv`
rebuilds the served model from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def figures(ev: dict) -> dict:
    return {"top1_agreement": round(ev["top1_agreement"], 3), "ppl_ratio": round(ev["ppl_ratio"], 3), "kl": round(ev["kl"], 4),
            "greedy_exact_match": ev.get("greedy_exact_match"), "long_teacher_forced_agreement": round(ev.get("long_teacher_forced_agreement", 0), 3),
            "long_rouge_l": round(ev.get("long_rouge_l", 0), 3)}


def engine_speedup(runs: Path, l: int, g: int) -> tuple[float, str]:
    """The layout's measured prefill speed-up: this machine's `scripts/frontier.sh speed L:G`, else the one recorded
    for the layout in docs/frontier-rows.json (a speed-up depends on the layout only, not on the weights)."""
    path = runs / f"speed-l{l}-g{g}.json"
    if path.exists():
        speed = json.loads(path.read_text())
        return speed["prefill_speedup"], (f"swiftkv bench engine (scripts/frontier.sh speed {l}:{g}), "
                                          f"{speed.get('machine', {}).get('cpu_model', 'this machine')}")
    for row in json.loads((ROOT / "docs" / "frontier-rows.json").read_text()):
        if (row["l"], row["g"], row["speedup_how"]) == (l, g, "measured"):
            return row["speedup"], f"swiftkv bench engine (scripts/frontier.sh speed {l}:{g}), as recorded for row {row['name']} in docs/frontier-rows.json"
    sys.exit(f"no engine measurement of layout l={l} g={g}: run scripts/frontier.sh speed {l}:{g} first")


def main() -> None:
    from swiftkv_core.shipped import DEFAULT_SWIFTKV_NAME, WEIGHTS_DIR, export_trained

    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--row", help="frontier.sh row name (default: the run folder's name)")
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    args = ap.parse_args()
    run = json.loads((args.run / "run.json").read_text())
    summary = json.loads((args.run / "summary.json").read_text())
    held = json.loads((args.run / "eval-heldout.json").read_text())
    man = json.loads((args.run / "eval-heldout_manpages.json").read_text())
    l, g = run["num_key_value_layers"], run["key_value_group_size"]
    speedup, speedup_source = engine_speedup(args.runs, l, g)
    row = args.row or args.run.name
    recipe = {
        "model": DEFAULT_SWIFTKV_NAME,
        "base": "smollm2-135m-instruct (swiftkv models prepare smollm2-135m-instruct)",
        "num_key_value_layers": l,
        "key_value_group_size": g,
        "data": "swiftkv data prepare --out data/mix (defaults: Shakespeare, Python 3.11 docs, Linux 6.1 docs; 30% as ChatML chats; 1 file in 10 held out; seed 0)",
        "command": (f"swiftkv distill --base {run['base']} --data {run['data']} --out {run['out']} --num-key-value-layers {l} "
                    f"--key-value-group-size {g} --init {run['init']} --loss {run['loss']} --temperature {run['temperature']} --lr {run['lr']} "
                    f"--max-steps {run['max_steps']} --batch-size {run['batch_size']} --seq-len {run['seq_len']} --rows {run['rows']} "
                    f"--cache {run['cache']}  (scripts/frontier.sh train {row})"),
        "recipe": {k: run[k] for k in ("init", "loss", "temperature", "lr", "warmup", "max_steps", "batch_size", "seq_len", "rows", "precision")},
        "tokens": summary["tokens"],
        "export": f".venv/bin/python scripts/ship_default.py {args.run} --row {row}",
        "quality": {**figures(held), "manpages": figures(man),
                    "eval": "swiftkv eval --seq-len 512 --max-tokens 8192 --num-prompts 8 --gen-tokens 32 --long-docs 6 on data/mix/heldout.jsonl and data/mix/heldout_manpages.jsonl (docs/benchmarks.md, Frontier)"},
        "prefill_speedup": round(speedup, 2),
        "prefill_speedup_source": speedup_source,
    }
    dest = WEIGHTS_DIR / f"{DEFAULT_SWIFTKV_NAME}.safetensors"
    export_trained(args.run, dest, recipe)
    print(f"{dest} ({dest.stat().st_size / 2**20:.1f} MiB) and its recipe")


if __name__ == "__main__":
    main()
