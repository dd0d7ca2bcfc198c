"""One SmolLM2 distillation job end to end through `swiftkv trainer serve`, and the same recipe run as
`swiftkv distill`, one after the other on the same cores (docs/benchmarks.md, "Training service").

    .venv/bin/python scripts/trainer_smollm2.py [--steps 60] [--layers 22] [--out runs/trainer-e2e]

The job is driven with the official openai SDK: upload the training and validation files, create the job,
follow its events to `succeeded`. Prints one JSON object: the job's wall time, its training tokens/s (from
its metrics events), its evaluation figures and published model, and the CLI run's tokens/s and wall time.
Needs `swiftkv models prepare smollm2-135m-instruct` and `swiftkv data prepare --out data/mix`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean_tok_s(metrics: Path) -> float:
    """Mean training tokens/s over the steps after the first (the first includes warm-up)."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rates = [r["tok_s"] for r in rows if r.get("step", 0) > 1 and r.get("tok_s")]
    return round(statistics.mean(rates), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="models/smollm2-135m-instruct")
    ap.add_argument("--train", default="data/mix/train.jsonl")
    ap.add_argument("--validation", default="data/mix/heldout.jsonl")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("runs/trainer-e2e"))
    args = ap.parse_args()
    os.chdir(ROOT)
    import openai

    swiftkv = str(Path(sys.executable).parent / "swiftkv")
    hp = {"num_key_value_layers": args.layers, "init": "lstsq", "loss": "kl", "temperature": 2.0, "learning_rate": 1e-3,
          "n_steps": args.steps, "batch_size": 8, "seq_len": 256}
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(args.out / "trainer.log", "wb")
    trainer = subprocess.Popen([swiftkv, "trainer", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(args.out / "data"),
                                "--models-dir", str(args.out / "models")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    report: dict = {"recipe": hp, "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip(),
                    "load_average_at_start": os.getloadavg()[0]}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=5)
        deadline = time.time() + 60
        while True:
            try:
                client.fine_tuning.jobs.list(limit=1)
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "the trainer did not start"
                time.sleep(0.5)
        with open(args.train, "rb") as f:
            train = client.files.create(file=("train.jsonl", f), purpose="fine-tune")
        with open(args.validation, "rb") as f:
            valid = client.files.create(file=("heldout.jsonl", f), purpose="fine-tune")
        t0 = time.time()
        job = client.fine_tuning.jobs.create(model=str(Path(args.base).resolve()), training_file=train.id, validation_file=valid.id, seed=0,
                                             suffix=f"l{args.layers}", method={"type": "distillation", "distillation": {"hyperparameters": hp}})
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
            time.sleep(2)
        report["job_wall_s"] = round(time.time() - t0, 1)
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=1000))
        report.update({"job_id": job.id, "status": job.status, "trained_tokens": job.trained_tokens, "fine_tuned_model": job.fine_tuned_model,
                       "error": job.error.model_dump() if job.error and job.error.message else None, "events": len(events),
                       "checkpoints": len(client.fine_tuning.jobs.checkpoints.list(job.id).data)})
        run_dir = args.out / "data" / "runs" / job.id
        report["job_tokens_per_s"] = mean_tok_s(run_dir / "out" / "metrics.jsonl")
        if (run_dir / "eval.json").exists():
            ev = json.loads((run_dir / "eval.json").read_text())
            report["job_eval"] = {k: ev[k] for k in ("top1_agreement", "kl", "ppl_ratio") if k in ev}
    finally:
        os.killpg(trainer.pid, signal.SIGTERM)
        trainer.wait(60)

    # The same recipe as a command (its own teacher cache, as the job builds one in its run folder).
    cli_out = args.out / "cli"
    t0 = time.time()
    subprocess.run([swiftkv, "distill", "--base", args.base, "--data", args.train, "--out", str(cli_out), "--cache", str(args.out / "cli-cache"),
                    "--num-key-value-layers", str(args.layers), "--init", "lstsq", "--loss", "kl", "--temperature", "2", "--lr", "1e-3",
                    "--max-steps", str(args.steps), "--batch-size", "8", "--seq-len", "256", "--seed", "0"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report["cli_wall_s"] = round(time.time() - t0, 1)
    report["cli_tokens_per_s"] = mean_tok_s(cli_out / "metrics.jsonl")
    report["job_over_cli_tokens_per_s"] = round(report["job_tokens_per_s"] / report["cli_tokens_per_s"], 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
