"""Hostile input and operations against the distillation job service, in process (its FastAPI app over httpx, the
worker loop not started, so no job runs): API keys and per-key objects, which models a job may name and when they
are fetched, bounded and deeply nested bodies, a run folder's state file holding pickled code, OpenAI's event types,
and the chart's listen address and keys."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch
from harness.training import MODEL, QUICK, records

from services.training.api import event_object
from services.training.service import TrainerSettings, create_app
from swiftkv_core.distill import STATE_FILE, DistillConfig, DistillError, distill

KEY_A, KEY_B = "sk-trainer-a", "sk-trainer-b"
DEEP = 100_000  # nesting levels: past any recursion limit of Python's JSON parser


@pytest.fixture
def make_app(tmp_path, tiny_base, monkeypatch):
    """An app factory: the trainer over tmp_path, the tiny model offered as MODEL in its models directory."""
    for name in ("SWIFTKV_API_KEYS", "SWIFTKV_API_KEYS_FILE", "SWIFTKV_TRAINER_HOST", "SWIFTKV_TRAINER_ALLOWED_MODELS"):
        monkeypatch.delenv(name, raising=False)
    models = tmp_path / "models"
    models.mkdir()
    (models / MODEL).symlink_to(tiny_base, target_is_directory=True)
    apps = []

    def make(**settings):
        apps.append(create_app(TrainerSettings(data_dir=str(tmp_path / "data"), models_dir=str(models), **settings)))
        return apps[-1]

    yield make
    for app in apps:
        app.state.service.io.close()
        app.state.service.file_io.close()
        app.state.service.store.close()


def client(app, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://trainer", headers=headers, timeout=60)


async def upload(c: httpx.AsyncClient, content: bytes | None = None) -> str:
    r = await c.post("/v1/files", files={"file": ("train.jsonl", records() if content is None else content)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def job(model: str = MODEL, training_file: str = "file-missing", **hp) -> dict:
    return {"model": model, "training_file": training_file,
            "method": {"type": "distillation", "distillation": {"hyperparameters": {**QUICK, **hp}}}}


def refused(r: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param != "unset":
        assert body["error"]["param"] == param, body
    return body["error"]


# ---- 1. the gateway's keys: 401 without one, every object scoped to its key -------------------------------------
async def test_keys_are_required_and_each_key_sees_only_its_own(make_app, monkeypatch):
    monkeypatch.setenv("SWIFTKV_API_KEYS", f"{KEY_A},{KEY_B}")  # the gateway's variable
    app = make_app()
    async with client(app) as anon, client(app, "sk-wrong") as wrong, client(app, KEY_A) as a, client(app, KEY_B) as b:
        routes = [("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/file-x"), ("get", "/v1/files/file-x/content"),
                  ("delete", "/v1/files/file-x"),
                  ("post", "/v1/fine_tuning/jobs"), ("get", "/v1/fine_tuning/jobs"), ("get", "/v1/fine_tuning/jobs/ftjob-x"),
                  ("get", "/v1/fine_tuning/jobs/ftjob-x/events"), ("get", "/v1/fine_tuning/jobs/ftjob-x/checkpoints"),
                  ("post", "/v1/fine_tuning/jobs/ftjob-x/cancel"), ("post", "/v1/fine_tuning/jobs/ftjob-x/pause"),
                  ("post", "/v1/fine_tuning/jobs/ftjob-x/resume")]
        for c in (anon, wrong):
            for method, path in routes:
                assert refused(await c.request(method, path), 401)["code"] == "invalid_api_key", (method, path)
        assert (await anon.get("/health")).status_code == 200 and (await anon.get("/metrics")).status_code == 200
        doc = (await anon.get("/openapi.json")).json()
        assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []

        file_id = await upload(a)
        r = await a.post("/v1/fine_tuning/jobs", json=job(training_file=file_id))
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        # Key B: A's job, its events and checkpoints, A's file do not exist; nor may B train on A's file.
        for path in (f"/v1/fine_tuning/jobs/{job_id}", f"/v1/fine_tuning/jobs/{job_id}/events",
                     f"/v1/fine_tuning/jobs/{job_id}/checkpoints", f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
            refused(await b.get(path), 404)
            assert (await a.get(path)).status_code == 200, path
        for verb in ("pause", "resume", "cancel"):
            refused(await b.post(f"/v1/fine_tuning/jobs/{job_id}/{verb}"), 404)
        refused(await b.delete(f"/v1/files/{file_id}"), 404)
        assert (await b.get("/v1/files")).json()["data"] == [] and [f["id"] for f in (await a.get("/v1/files")).json()["data"]] == [file_id]
        assert (await b.get("/v1/fine_tuning/jobs")).json()["data"] == []
        assert [j["id"] for j in (await a.get("/v1/fine_tuning/jobs")).json()["data"]] == [job_id]
        assert refused(await b.post("/v1/fine_tuning/jobs", json=job(training_file=file_id)), 400, "training_file")["code"] == "file_not_found"
        assert (await a.get(f"/v1/fine_tuning/jobs/{job_id}")).json()["status"] == "validating_files", "B's cancel did nothing"


def test_default_listen_address_is_loopback(monkeypatch):
    monkeypatch.delenv("SWIFTKV_TRAINER_HOST", raising=False)
    assert TrainerSettings().host == "127.0.0.1"


def test_chart_listens_on_all_addresses_with_the_gateways_keys():
    from harness.deploy import find, render

    c = find(render(None, "--set", "apiKeys.keys[0]=sk-one", "--set", "trainer.allowedModels[0]=meta-llama/*"),
             "Deployment", "trainer")[0]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in c["containers"][0]["env"]}
    assert env["SWIFTKV_TRAINER_HOST"] == "0.0.0.0" and env["SWIFTKV_TRAINER_ALLOWED_MODELS"] == "meta-llama/*"
    mounts = {m["mountPath"]: m["name"] for m in c["containers"][0]["volumeMounts"]}
    keys_dir, keys_file = env["SWIFTKV_API_KEYS_FILE"].rsplit("/", 1)
    secret = {v["name"]: v.get("secret") for v in c["volumes"]}[mounts[keys_dir]]
    assert secret == {"secretName": "swiftkv-api-keys"} and keys_file == "keys.txt"  # the Secret the gateway reads
    assert env["HF_HOME"].startswith("/models/"), "hub downloads go to the models volume, not the pod's /tmp"
    plain = find(render(), "Deployment", "trainer")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "SWIFTKV_API_KEYS_FILE" not in {e["name"] for e in plain["env"]}


# ---- 2. models: only the models directory, prepared names and allowed hub ids; fetched last ---------------------
async def test_model_is_fetched_only_for_a_valid_request_and_only_if_allowed(make_app, tiny_base, tmp_path, monkeypatch):
    import huggingface_hub

    from services.training import api
    from swiftkv_core import catalog

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kw: fetched.append(name) or str(tiny_base))
    monkeypatch.setattr(catalog, "prepare", lambda name, models_dir: fetched.append(name) or tiny_base)
    monkeypatch.setattr(api, "hub_listing", lambda name: ("a" * 40, {"config.json": 1, "model.safetensors": 1}))
    app = make_app(allowed_models=["allowed-org/*"])
    async with client(app) as c:
        file_id = await upload(c)
        P = "method.distillation.hyperparameters"
        for model in ("allowed-org/llama", "smollm2-135m-instruct"):  # each would be downloaded or built
            refused(await c.post("/v1/fine_tuning/jobs", json=job(model, file_id, loss="mse")), 400, f"{P}.loss")
            refused(await c.post("/v1/fine_tuning/jobs", json=job(model, "file-missing")), 400, "training_file")
            refused(await c.post("/v1/fine_tuning/jobs", json={**job(model, file_id), "seed": -1}), 400, "seed")
        assert fetched == [], "nothing fetched for a refused request"
        outside = tmp_path / "elsewhere"
        outside.symlink_to(tiny_base, target_is_directory=True)
        for model in ("other-org/llama", str(tiny_base), str(outside), f"../{outside.name}", "/etc", "a/b/c", ".", "x\u0000"):
            error = refused(await c.post("/v1/fine_tuning/jobs", json=job(model, file_id)), 400, "model")
            assert "allowed-org/*" in error["message"] and "smollm2" in error["message"], error  # what is allowed
        assert fetched == []
        for model in (MODEL, str(tmp_path / "models" / MODEL)):  # by name, or by its path in the models directory
            assert (await c.post("/v1/fine_tuning/jobs", json=job(model, file_id))).status_code == 200
        assert fetched == []
        r = await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/llama", file_id))
        assert r.status_code == 200 and fetched == ["allowed-org/llama"], r.text
    async with client(make_app()) as c:  # by default no hub id is allowed
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/llama", file_id)), 400, "model")
        assert "allowed_models: none" in error["message"] and fetched == ["allowed-org/llama"]


# ---- 3. request bodies are bounded ----------------------------------------------------------------------------
async def test_a_body_past_max_body_bytes_is_a_413(make_app):
    app = make_app(max_body_bytes=4096)
    big = json.dumps({**job(), "metadata": {"k": "x" * 8000}}).encode()
    async with client(app) as c:
        error = refused(await c.post("/v1/fine_tuning/jobs", content=big, headers={"content-type": "application/json"}), 413)
        assert "4096" in error["message"] and "max_body_bytes" in error["message"] and error["code"] == "request_too_large"

        async def chunked():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        r = await c.post("/v1/fine_tuning/jobs", content=chunked(), headers={"content-type": "application/json"})
        assert "4096" in refused(r, 413)["message"]
        assert refused(await c.post("/v1/fine_tuning/jobs", json=job()), 400, "training_file"), "a body within the bound is read"


# ---- 4. JSON nested past the parser's recursion limit is a 400 -------------------------------------------------
async def test_deeply_nested_json_is_a_400(make_app):
    deep = "[" * DEEP + "]" * DEEP
    async with client(make_app()) as c:
        for body in (deep, '{"model": ' + deep + "}"):
            error = refused(await c.post("/v1/fine_tuning/jobs", content=body, headers={"content-type": "application/json"}), 400)
            assert error["code"] == "invalid_json"
        nested_line = ('{"text": "ok", "extra": ' + deep + "}\n").encode()
        file_id = await upload(c, records(3) + nested_line)
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job(training_file=file_id)), 400, "training_file")
        assert "line 4" in error["message"] and error["code"] == "invalid_file_format"


async def test_unreadable_result_files_fail_the_job(make_app, tmp_path):
    """eval.json / summary.json are the job process's; one that is not a JSON object fails its job, naming it."""
    app = make_app()
    service = app.state.service
    async with client(app) as c:
        r = await c.post("/v1/fine_tuning/jobs", json=job(str(tmp_path / "models" / MODEL), await upload(c)))
        job_id = r.json()["id"]
        service.store.update_job(job_id, status="running")
        (service.worker.run_dir(job_id) / "eval.json").write_text("[" * DEEP + "]" * DEEP)
        service.worker._finish(service.store.get_job(None, job_id), service.worker.run_dir(job_id))
        done = (await c.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
    assert done["status"] == "failed" and "eval.json" in done["error"]["message"], done


# ---- 5. a state file holding pickled code is refused, not run -------------------------------------------------
def test_a_state_file_with_pickled_code_is_refused_not_run(tiny_base, tmp_path):
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    out = tmp_path / "run"
    out.mkdir()
    torch.save({"step": 1, "trainable": {}, "payload": Payload()}, out / STATE_FILE)
    (tmp_path / "train.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = DistillConfig(base=str(tiny_base), out=str(out), data=str(tmp_path / "train.txt"), num_key_value_layers=4,
                        max_steps=2, batch_size=1, seq_len=16, precision="fp32", progress=False)
    with pytest.raises(DistillError, match="not loaded"):
        distill(cfg)
    assert not marker.exists()


# ---- 6. events use OpenAI's types only ------------------------------------------------------------------------
async def test_checkpoint_events_are_openai_messages(make_app, tmp_path):
    app = make_app(checkpoint_every=2, events_every=1)
    service = app.state.service
    async with client(app) as c:
        r = await c.post("/v1/fine_tuning/jobs", json=job(str(tmp_path / "models" / MODEL), await upload(c), n_steps=2))
        job_id = r.json()["id"]
        run_dir = service.worker.run_dir(job_id)
        (run_dir / "out").mkdir()
        (run_dir / "out" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "tokens": 64 * s, "tok_s": 10.0}) + "\n"
                                                               for s in (1, 2)))
        (run_dir / "out" / STATE_FILE).write_bytes(b"")
        service.worker._progress(service.store.get_job(None, job_id), run_dir)
        events = (await c.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100})).json()["data"]
    assert {e["type"] for e in events} == {"message", "metrics"}
    saved = [e for e in events if e["message"] == "Checkpoint saved at step 2"]
    assert [e["type"] for e in saved] == ["message"] and saved[0]["data"] == {"step": 2, "fine_tuned_model_checkpoint": f"{job_id}:step-2"}
    legacy = {"id": "ftevent-x", "created_at": 0, "level": "info", "message": "Checkpoint saved at step 2", "type": "checkpoint", "data": {}}
    assert event_object(legacy)["type"] == "message"  # a row an older version stored


async def test_odd_ids_cursors_and_metadata_are_4xx(make_app):
    """Ids no service hands out (a NUL is a 500 on PostgreSQL if it reaches the store) name nothing; a cursor that
    is not an id and metadata outside OpenAI's bounds are 400s naming the field."""
    async with client(make_app()) as c:
        for path in ("/v1/files/file%00x", "/v1/files/file%00x/content", "/v1/fine_tuning/jobs/ftjob%00x",
                     "/v1/fine_tuning/jobs/ftjob%00x/events", "/v1/fine_tuning/jobs/" + "x" * 65):
            refused(await c.get(path), 404)
        refused(await c.get("/v1/fine_tuning/jobs", params={"after": "ftjob\x00"}), 400, "after")
        refused(await c.post("/v1/fine_tuning/jobs", json=job(training_file="file\x00x")), 400, "training_file")
        refused(await c.post("/v1/fine_tuning/jobs", json={**job(), "metadata": {"k": 1}}), 400, "metadata.k")


# ---- 7. nothing a key reads names server paths, tracebacks or another tenant's models --------------------------
async def test_refusals_and_failures_name_no_server_internals(make_app, tiny_base, tmp_path, monkeypatch):
    """The model refusal says what is allowed without listing the models directory (other tenants' fine-tuned
    models); hub errors, failed jobs, events and result files say what went wrong without paths or tracebacks."""
    import huggingface_hub

    from services.training import api
    from swiftkv_core.catalog import register_fine_tuned

    theirs = tmp_path / "models" / "tiny-swiftkv-theirsecret-abcd1234"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 8}')
    register_fine_tuned(tmp_path / "models", theirs.name, theirs, {"base": MODEL, "job": "ftjob-theirs"})
    secret = "/srv/secret-cache/models--allowed-org--llama"

    def hub_down(name, **kw):
        raise OSError(f"[Errno 28] No space left on device: '{secret}/blobs/x.incomplete'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_down)
    monkeypatch.setattr(api, "hub_listing", lambda name: ("0" * 40, {"config.json": 10, "model.safetensors": 10}), raising=False)
    app = make_app(allowed_models=["allowed-org/*"])
    service = app.state.service
    readable = []  # everything the key gets back
    async with client(app) as c:
        file_id = await upload(c)
        for model in ("other-org/llama", "nonesuch", "../x"):
            error = refused(await c.post("/v1/fine_tuning/jobs", json=job(model, file_id)), 400, "model")
            assert "allowed-org/*" in error["message"] and "smollm2" in error["message"], error  # what is allowed
            readable.append(error)
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/llama", file_id)), 503, "model")
        assert "allowed-org/llama" in error["message"] and "download" in error["message"], error
        readable.append(error)

        async def failed_job(log: str) -> dict:
            r = await c.post("/v1/fine_tuning/jobs", json=job(MODEL, file_id))
            job_id = r.json()["id"]
            run_dir = service.worker.run_dir(job_id)
            service.store.update_job(job_id, status="running", runner_ref="1", attempts=1)
            (run_dir / "attempt-1.log").write_text(log.replace("RUN", str(run_dir)))
            monkeypatch.setattr(service.worker.backend, "poll", lambda ref, run_dir: 2)
            service.worker.tick()
            done = (await c.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
            assert done["status"] == "failed", done
            readable.extend([done, (await c.get(f"/v1/fine_tuning/jobs/{job_id}/events")).json()])
            return done["error"]

        traceback = (f'Traceback (most recent call last):\n  File "{secret}/distill.py", line 3, in run\n'
                     "RuntimeError: CUDA error: out of memory\n")
        assert "exited with code 2" in (await failed_job(traceback))["message"]
        error = await failed_job("loading\nerror: RUN/train.jsonl:3: not valid JSON (Expecting value)\n")
        assert "line 3" in error["message"] and "not valid JSON" in error["message"], error

        # a finished job: its events and result file
        r = await c.post("/v1/fine_tuning/jobs", json=job(MODEL, file_id))
        job_id = r.json()["id"]
        run_dir = service.worker.run_dir(job_id)
        (run_dir / "out").mkdir()
        (run_dir / "out" / "config.json").write_text("{}")
        (run_dir / "out" / "summary.json").write_text(json.dumps({"tokens": 64, "teacher_cache": str(run_dir / "teacher-cache")}))
        service.store.update_job(job_id, status="running", runner_ref="1", attempts=1)
        service.worker._finish(service.store.get_job(None, job_id), run_dir)
        done = (await c.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
        assert done["status"] == "succeeded", done
        readable.extend([done, (await c.get(f"/v1/fine_tuning/jobs/{job_id}/events")).json(),
                         (await c.get(f"/v1/files/{done['result_files'][0]}/content")).text])
    text = json.dumps(readable)
    for internal in (str(tmp_path), secret, "Traceback", "theirsecret", "Errno"):
        assert internal not in text, (internal, text)


async def test_a_local_model_refused_after_its_lookup_is_named_as_in_the_models_directory(make_app, tmp_path):
    """A folder of the models directory that is no base Llama (found by its config.json, refused once it is read) is
    named as the client can name it, its path below the models directory, never by the server's path to it."""
    folder = tmp_path / "models" / "team" / "mistral-7b"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "mistral", "num_hidden_layers": 8}')
    async with client(make_app()) as c:
        file_id = await upload(c)
        for model in ("team/mistral-7b", str(folder)):
            error = refused(await c.post("/v1/fine_tuning/jobs", json=job(model, file_id)), 400, "model")
            assert error["code"] == "model_not_supported" and "'team/mistral-7b' has model_type 'mistral'" in error["message"], error
            assert str(tmp_path) not in error["message"], error


# ---- 8. training files: each line bounded, read a line at a time, on threads of their own ----------------------
async def test_a_training_line_past_max_line_bytes_is_a_400(make_app):
    big = b'{"text": "' + b"x" * 1_500_000 + b'"}\n'
    async with client(make_app()) as c:
        file_id = await upload(c, records(3) + big + records(2))
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job(training_file=file_id)), 400, "training_file")
        assert "line 4" in error["message"] and "1000000 bytes" in error["message"] and "max_line_bytes" in error["message"], error
        assert error["code"] == "invalid_file_format"
        ok = await upload(c, records(3) + b'{"text": "' + b"x" * 900_000 + b'"}\n')  # within the bound
        assert (await c.post("/v1/fine_tuning/jobs", json=job(training_file=ok))).status_code == 200


async def test_file_validation_does_not_stall_the_store_calls(make_app, monkeypatch):
    """Two big files being checked at once hold the validation threads, not the ones every other call needs."""
    import asyncio
    import threading

    from services.training import api

    gate, entered = threading.Event(), threading.Semaphore(0)
    real = api.check_records

    def slow(*args):
        entered.release()
        gate.wait(60)
        return real(*args)

    monkeypatch.setattr(api, "check_records", slow)
    app = make_app()
    async with client(app) as c:
        file_id = await upload(c)
        creates = [asyncio.create_task(c.post("/v1/fine_tuning/jobs", json=job(training_file=file_id))) for _ in range(2)]
        try:
            for _ in range(2):
                await asyncio.to_thread(entered.acquire, True, 10)
            r = await asyncio.wait_for(c.get("/v1/fine_tuning/jobs"), 10)
            assert r.status_code == 200
        finally:
            gate.set()
            results = await asyncio.gather(*creates)
        assert [r.status_code for r in results] == [200, 200]


def test_run_folder_is_written_a_line_at_a_time(make_app, tmp_path):
    """The run folder's data is copied a line at a time (a 512 MiB file is not held in memory); the held-out tenth
    (no validation file) is the last lines, blank lines skipped."""
    import tracemalloc

    from services.training.api import check_layout, parse_method

    service = make_app().state.service
    train = tmp_path / "train.jsonl"
    train.write_bytes(b"".join(b'{"text": "%d %s"}\n' % (i, b"x" * 500_000) for i in range(40)) + b"\n\n")
    method = check_layout(parse_method(None), 8)
    tracemalloc.start()
    try:
        service.prepare_run(tmp_path / "run", tmp_path, method, 0, train, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes held for a {train.stat().st_size}-byte file"
    lines = (tmp_path / "run" / "train.jsonl").read_bytes().splitlines()
    held = (tmp_path / "run" / "eval.jsonl").read_bytes().splitlines()
    assert len(lines) == 36 and len(held) == 4 and held[-1].startswith(b'{"text": "39 '), (len(lines), len(held))


# ---- 9. hub downloads: only the files a job needs, and only up to max_model_bytes -------------------------------
async def test_hub_downloads_are_filtered_and_bounded(make_app, tiny_base, monkeypatch):
    """The check is the trainer's, decided from the hub's file listing (here a local function in its place)."""
    import huggingface_hub

    from services.training import api

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kw: fetched.append((name, kw)) or str(tiny_base))
    listings = {
        "allowed-org/huge": {"config.json": 700, "model.safetensors.index.json": 30_000, "tokenizer.json": 9 << 20,
                             **{f"model-{i:05d}-of-00030.safetensors": 5 << 30 for i in range(30)}},
        "allowed-org/bin-only": {"config.json": 700, "pytorch_model.bin": 1 << 20, "tokenizer.json": 1 << 10},
        "allowed-org/llama": {"config.json": 700, "model.safetensors": 1 << 20, "tokenizer.json": 1 << 10,
                              "original/consolidated.00.pth": 900 << 30, "README.md": 100},  # what is not needed is not counted
    }
    monkeypatch.setattr(api, "hub_listing", lambda name: ("a" * 40, listings[name]), raising=False)
    app = make_app(allowed_models=["allowed-org/*"])
    async with client(app) as c:
        file_id = await upload(c)
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/huge", file_id)), 400, "model")
        assert "max_model_bytes" in error["message"] and "allowed-org/huge" in error["message"], error
        error = refused(await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/bin-only", file_id)), 400, "model")
        assert "safetensors" in error["message"], error
        assert fetched == [], "nothing is downloaded past the check"
        r = await c.post("/v1/fine_tuning/jobs", json=job("allowed-org/llama", file_id))
        assert r.status_code == 200, r.text
    [(name, kw)] = fetched
    assert name == "allowed-org/llama" and kw["revision"] == "a" * 40, kw  # the revision whose size was checked
    from huggingface_hub.utils import filter_repo_objects  # how snapshot_download applies allow_patterns

    got = set(filter_repo_objects(listings["allowed-org/llama"], allow_patterns=kw["allow_patterns"]))
    assert got == {"config.json", "model.safetensors", "tokenizer.json"}, got
