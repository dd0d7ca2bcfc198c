"""The distillation job service as a process (`swiftkv trainer serve`), the records jobs train on, and the client
calls the training tests share."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .processes import BIN, Server, free_port

TRAINER_FLAGS = ["--checkpoint-every", "2", "--events-every", "1", "--eval-max-tokens", "128", "--eval-prompts", "1", "--threads", "1"]
QUICK = {"n_steps": 4, "batch_size": 2, "seq_len": 32}
MODEL = "tiny"  # the tiny fixture model's name in the trainer's models directory


class Trainer(Server):
    """One `swiftkv trainer serve` process, in its own process group (a kill -9 takes its job process too). `base`
    is offered to jobs as the model MODEL (a link in its models directory); with `key`, the service wants that key.
    start() returns once /health answers."""

    def __init__(self, work: Path, data_dir: Path, models_dir: Path, base: Path | None = None, key: str | None = None):
        port = free_port()
        args = [BIN / "swiftkv", "trainer", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
                "--models-dir", str(models_dir), *TRAINER_FLAGS]
        if base is not None:
            models_dir.mkdir(parents=True, exist_ok=True)
            (models_dir / MODEL).symlink_to(base, target_is_directory=True)
        if key is not None:
            (work / "trainer-keys").write_text(f"{key}\n")
            args += ["--api-keys-file", str(work / "trainer-keys")]
        super().__init__(args, work, f"http://127.0.0.1:{port}", "trainer", ready_path="/health")
        self.key = key

    def start(self) -> "Trainer":
        super().start()
        self.wait(timeout=120, what="healthy")
        return self

    def stop(self, grace: float = 20) -> None:
        super().stop(grace)

    def client(self, key: str | None = None, timeout: float = 60, **kw):
        return super().client(key or self.key or "unused", timeout, **kw)


def records(n: int = 24) -> bytes:
    topics = ["the sea", "a mountain", "bread", "rivers", "the moon", "trains", "music", "gardens"]
    lines = []
    for i in range(n):
        t = topics[i % len(topics)]
        if i % 3 == 0:
            lines.append({"text": f"A short note about {t}. It is number {i} and it says a few plain words about {t}."})
        else:
            lines.append({"messages": [{"role": "user", "content": f"Tell me about {t}."},
                                       {"role": "assistant", "content": f"Here is something about {t}: it is item {i}, simple and calm."}]})
    return b"".join(json.dumps(r).encode() + b"\n" for r in lines)


def create(client, model, training_file, **hp):
    return client.fine_tuning.jobs.create(model=str(model), training_file=training_file,
                                          method={"type": "distillation", "distillation": {"hyperparameters": {**QUICK, **hp}}})


def wait_status(client, job_id: str, statuses, timeout: float = 240):
    deadline = time.time() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status not in ("failed", "cancelled", "succeeded"), f"{job_id} ended {job.status}: {job.error}"
        assert time.time() < deadline, f"{job_id} still {job.status}"
        time.sleep(0.3)


def distill_config(base, out, data, **kw):
    """A short distillation run on the tiny checkpoint (6 steps, checkpoints every 3), fields overridden by `kw`."""
    from swiftkv_core.distill import DistillConfig

    defaults = dict(num_key_value_layers=4, max_steps=6, batch_size=2, seq_len=32, lr=1e-2, progress=False, checkpoint_every=3, precision="fp32")
    defaults.update(kw)
    return DistillConfig(base=str(base), out=str(out), data=str(data), **defaults)
