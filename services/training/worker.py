"""The job loop: one job at a time. Everything it knows comes from the store and the run folder on each
tick, so a service restarted after kill -9 picks up where the last one stopped: a running job whose
process is gone is started again and its distillation resumes from the run folder's last checkpoint."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from swiftkv_core.catalog import register_fine_tuned
from swiftkv_core.distill import METRICS_FILE, STATE_FILE

from .job import STOPPED
from .metrics import jobs_finished, step_seconds, tokens_per_second, trained_tokens
from .store import TrainingStore

log = logging.getLogger("swiftkv.training")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "out" / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except (ValueError, RecursionError):  # a line being written (or not the job's own)
            break
    return rows


def read_result(path: Path) -> dict:
    """A JSON object the job process wrote ({} when absent); ValueError when it is anything else."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except RecursionError:  # nested too deep to parse
        raise ValueError(f"{path.name} nests too deep") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


SERVER_PATH = re.compile(r"(?<![\w.])'?(/[^\s'\":]*[^\s'\":.,;)])'?(?::(\d+))?")  # '/a/b.jsonl':3


def public_message(message: str, run_dir: Path) -> str:
    """A job process's error as the job's key may read it: the run folder's data files named by what they hold,
    any other server path hidden (the whole message stays in the server's log)."""
    names = {str(run_dir / "train.jsonl"): "the training data", str(run_dir / "eval.jsonl"): "the evaluation data"}

    def say(m: re.Match) -> str:
        what = names.get(m[1], "a file on the server")
        return f"{what}, line {m[2]}" if m[2] else what

    return SERVER_PATH.sub(say, message)


class Worker:
    def __init__(self, store: TrainingStore, files, settings, backend):
        self.store, self.files, self.settings, self.backend = store, files, settings, backend
        self.current: tuple[str, str, Path] | None = None  # (job id, runner ref, run dir) started or followed here

    def run_dir(self, job_id: str) -> Path:
        return Path(self.settings.data_dir) / "runs" / job_id

    # ---- the API's requests ----------------------------------------------------------------------
    def shutdown(self, timeout: float) -> None:
        """The service is stopping: the running job saves its state and stops; the next start resumes it."""
        job = self.store.next_job()
        if job is not None and job["status"] == "running" and job["runner_ref"]:
            self.backend.stop(job["runner_ref"], self.run_dir(job["id"]), timeout)
            self.store.add_event(job["id"], "Training process stopped with the service; it resumes on the next start")
            log.info("job %s stopped with its state saved; it resumes on the next start", job["id"])

    def stop(self, job: dict) -> None:
        """Kill a job's process now (cancel)."""
        if job.get("runner_ref"):
            self.backend.kill(job["runner_ref"], self.run_dir(job["id"]))
        if self.current and self.current[0] == job["id"]:
            self.current = None

    # ---- one tick --------------------------------------------------------------------------------
    def tick(self) -> None:
        if self.current:  # the job followed here was cancelled or paused by a request
            job = self.store.get_job(None, self.current[0])
            if job is None or job["status"] != "running":
                self.backend.kill(self.current[1], self.current[2])
                self.current = None
        job = self.store.next_job()
        if job is None:
            tokens_per_second.set(0)
            step_seconds.set(0)
            return
        run_dir = self.run_dir(job["id"])
        if job["status"] != "running" or not job["runner_ref"]:
            self._start(job, run_dir)
            return
        if self._progress(job, run_dir):
            return  # paused at a checkpoint
        rc = self.backend.poll(job["runner_ref"], run_dir)
        self.current = (job["id"], job["runner_ref"], run_dir)
        if rc is None:
            return
        if self._progress(job, run_dir):  # the lines written just before it ended
            return
        self.current = None
        if rc == 0 and (run_dir / "done").exists():
            self._finish(job, run_dir)
        elif rc == -1:  # the process of an earlier service is gone without finishing: start it again
            self.store.add_event(job["id"], "Training process lost; resuming from the last checkpoint")
            self._start(job, run_dir)
        elif rc == STOPPED:  # stopped by SIGTERM with its state saved (not by this service, which would not tick again)
            self.store.add_event(job["id"], "Training process stopped; resuming from its saved state")
            self._start(job, run_dir)
        else:
            tail = self.backend.log_tail(job["runner_ref"], run_dir, job["attempts"])
            log.error("job %s: the training process exited with code %s; its log ends:\n%s", job["id"], rc, tail)
            # the job's own "error: " line says what was wrong; a traceback (paths, code) stays in the server's log
            lines = [ln for ln in tail.splitlines() if ln.startswith("error: ")]
            message = (public_message(lines[-1][7:], run_dir) if lines else
                       f"the training process exited with code {rc}; the operator's log has its output")
            self._fail(job, "training_failed", message)

    def _start(self, job: dict, run_dir: Path) -> None:
        attempt = job["attempts"] + 1
        first = job["status"] != "running"
        ref = self.backend.start(job["id"], run_dir, attempt)
        if not self.store.update_job(job["id"], (job["status"],), status="running", runner_ref=ref, attempts=attempt):
            self.backend.kill(ref, run_dir)  # cancelled or paused meanwhile
            return
        self.current = (job["id"], ref, run_dir)
        if first:
            self.store.add_event(job["id"], "Fine-tuning job started" if attempt == 1 else "Fine-tuning job resumed",
                                 {"attempt": attempt})

    def _progress(self, job: dict, run_dir: Path) -> bool:
        """Events and checkpoint records for what the run folder shows; True when the job was paused here."""
        rows = read_metrics(run_dir)
        if not rows:
            return False
        hp = job["method"]["distillation"]["hyperparameters"]
        last_step, every = hp["n_steps"], self.settings.events_every
        reported = self.store.last_step_event(job["id"])
        for r in rows:
            s = r.get("step", 0)
            if s > reported and (s % every == 0 or s == last_step):
                data = {"step": s, "train_loss": r.get("loss"), "tokens": r.get("tokens"), "tokens_per_second": r.get("tok_s"),
                        "learning_rate": r.get("lr")}
                self.store.add_event(job["id"], f"Step {s}/{last_step}: training loss={r.get('loss')}, {r.get('tok_s')} tokens/s",
                                     data, type="metrics")
        r = rows[-1]
        if r.get("tok_s"):
            tokens_per_second.set(r["tok_s"])
            step_seconds.set(r["tokens"] / r["tok_s"] / max(r["step"], 1) if r.get("step") else 0)
        tokens = r.get("tokens", 0)
        if tokens > (job["trained_tokens"] or 0):  # beyond what was counted before (a resume redoes steps)
            trained_tokens.inc(tokens - (job["trained_tokens"] or 0))
            job["trained_tokens"] = tokens  # this tick may read the same rows again after polling
        self.store.update_job(job["id"], trained_tokens=tokens)
        # The state file is rewritten every checkpoint_every steps (and at the last one): every such step logged
        # so far was saved, the newest is the one on disk.
        state = run_dir / "out" / STATE_FILE
        if state.exists():
            every = self.settings.checkpoint_every
            saved = [x for x in rows if x.get("step", 0) > 0 and (x["step"] % every == 0 or x["step"] == last_step)]
            s = r["step"]
            if saved and s != last_step and saved[-1]["step"] == s and s % every == 0 and not self._state_step_reached(state, s):
                saved = saved[:-1]  # this step's state may not be written yet
            for at in saved:
                step = at["step"]
                metrics = {"step": step, "train_loss": at.get("loss"), "tokens": at.get("tokens")}
                if self.store.add_checkpoint(job["id"], step, metrics, str(state)):
                    self.store.add_event(job["id"], f"Checkpoint saved at step {step}",
                                         {"step": step, "fine_tuned_model_checkpoint": f"{job['id']}:step-{step}"})
                    if job["control"] == "pause" and step < last_step and step == saved[-1]["step"]:
                        self.backend.kill(job["runner_ref"], run_dir)
                        self.current = None
                        self.store.update_job(job["id"], ("running",), status="paused", control=None, runner_ref=None)
                        self.store.add_event(job["id"], f"Fine-tuning job paused at step {step}")
                        return True
        return False

    @staticmethod
    def _state_step_reached(state: Path, step: int) -> bool:
        """The state file was replaced after the metrics line of `step` was written (it is saved right after)."""
        metrics = state.parent / METRICS_FILE
        try:
            return state.stat().st_mtime_ns >= metrics.stat().st_mtime_ns
        except OSError:
            return False

    def _fail(self, job: dict, code: str, message: str) -> None:
        if self.store.update_job(job["id"], ("running",), status="failed", finished_at=int(time.time()), runner_ref=None,
                                 error={"code": code, "message": message, "param": None}):
            jobs_finished.labels("failed").inc()
        self.store.add_event(job["id"], f"Fine-tuning job failed: {message}", level="error")

    def _finish(self, job: dict, run_dir: Path) -> None:
        hp = job["method"]["distillation"]["hyperparameters"]
        out = run_dir / "out"
        try:
            result, summary = read_result(run_dir / "eval.json"), read_result(out / "summary.json")
        except ValueError as e:
            return self._fail(job, "training_failed", f"the job's results are unreadable: {e}")
        if result:
            figures = {k: result[k] for k in ("top1_agreement", "kl", "ppl_ratio", "ppl_teacher", "ppl_student", "tokens") if k in result}
            self.store.add_event(job["id"], "Evaluation against the teacher: " + ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()), figures, type="metrics")
        # The result file: the evaluation and the run summary, like OpenAI's step-metrics CSV but as JSON.
        summary.pop("teacher_cache", None)  # a path on the server
        result_id = f"file-result-{job['id']}"
        body = json.dumps({"evaluation": result, "summary": summary, "metrics": read_metrics(run_dir)}).encode()
        size = self.files.write_lines(result_id, [body])
        self.store.finish_files([{"id": result_id, "owner": job["owner"], "purpose": "fine-tune-results",
                                  "filename": f"{job['id']}-results.json", "bytes": size, "created_at": int(time.time())}])
        gate = hp.get("min_top1_agreement")
        if gate is not None and result.get("top1_agreement", 0.0) < gate:
            self.store.update_job(job["id"], ("running",), result_files=[result_id], runner_ref=None)
            self._fail(job, "quality_gate", f"top-1 agreement {result.get('top1_agreement', 0.0):.4f} is below "
                                            f"min_top1_agreement {gate}; the model was not published")
            return
        name = self.model_name(job)
        target = Path(self.settings.models_dir) / name
        tmp = target.parent / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for item in out.iterdir():  # the checkpoint, without the resumable state and logs
            if item.is_file() and item.name not in (STATE_FILE, METRICS_FILE, "run.json", "summary.json"):
                shutil.copy2(item, tmp / item.name)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        card = {"base": job["model"], "job": job["id"], "num_key_value_layers": hp["num_key_value_layers"],
                "key_value_group_size": hp["key_value_group_size"], "quality": {k: result[k] for k in ("top1_agreement", "kl", "ppl_ratio") if k in result}}
        register_fine_tuned(self.settings.models_dir, name, target.resolve(), card)
        if self.store.update_job(job["id"], ("running",), status="succeeded", finished_at=int(time.time()), fine_tuned_model=name,
                                 result_files=[result_id], runner_ref=None, trained_tokens=summary.get("tokens")):
            jobs_finished.labels("succeeded").inc()
        self.store.add_event(job["id"], f"New fine-tuned model created: {name}")  # its folder is the server's business
        self.store.add_event(job["id"], "The job has successfully completed")

    @staticmethod
    def model_name(job: dict) -> str:
        base = Path(job["model"].rstrip("/")).name.lower()
        parts = [base, "swiftkv"] + ([job["suffix"]] if job["suffix"] else []) + [job["id"].removeprefix("ftjob-")[-8:]]
        return "-".join(parts)
