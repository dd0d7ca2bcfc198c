"""One Files API for the gateway and the trainer (services.common.files_api): both apps in process (the gateway over
the fake backend, the trainer without its worker loop, so no training runs), on one database (SQLite file and real
PostgreSQL) and one directory of bytes, as the chart deploys them. A file uploaded to either trains on the trainer and
downloads from either; the trainer's result files download through the gateway; uploads to the trainer count in the
key's one quota, expire, list and delete; the sweep of either removes rows and bytes together, but never a running
batch's input; another key's file is a 404 on both; the trainer's JSON bodies go through the gateway's reader."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import httpx
import pytest
from harness.gateway import InProcessGateway, platform_config
from harness.training import MODEL, QUICK, records
from sqlalchemy import update

from services.common.files import FILE_READERS, expiry

pytestmark = pytest.mark.parametrize("database", ["sqlite", "postgresql"])


class Platform:
    """The gateway (Batch API and Files API) and the trainer on `database_url`, the trainer's files_dir the gateway's
    data_dir/files (what the chart mounts), keys A and B (fresh for each test: quotas are per key) in both."""

    def __init__(self, root: Path, database_url: str, tiny_base: Path, monkeypatch, quota: int | None = None):
        from services.training.service import TrainerSettings, create_app

        self.key_a, self.key_b = f"sk-shared-a-{secrets.token_hex(4)}", f"sk-shared-b-{secrets.token_hex(4)}"
        monkeypatch.setenv("SWIFTKV_API_KEYS", f"{self.key_a},{self.key_b}")  # the gateway's variable: the trainer reads it
        gw_dir, models = root / "gateway", root / "models"
        models.mkdir(parents=True)
        (models / MODEL).symlink_to(tiny_base, target_is_directory=True)
        quota_fields = {"max_storage_bytes_per_key": quota} if quota else {}
        cfg = platform_config(tiny_base, pools=("swiftkv",), max_model_len=64, data_dir=str(gw_dir), database_url=database_url,
                              batch={"poll_seconds": 0.05, **quota_fields})
        self.gw = InProcessGateway(cfg, keys=(self.key_a, self.key_b))
        self.files_dir = gw_dir / "files"
        self.trainer = create_app(TrainerSettings(data_dir=str(root / "trainer"), files_dir=str(self.files_dir),
                                                  database_url=database_url, models_dir=str(models),
                                                  **quota_fields))
        self.service = self.trainer.state.service

    def gateway(self, key: str) -> httpx.AsyncClient:
        return self.gw.client(key)

    def training(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.trainer), base_url="http://trainer",
                                 headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def close(self) -> None:
        for service in (self.service,):
            service.io.close()
            service.file_io.close()
            service.store.close()
        self.gw.service.io.close()
        self.gw.service.store.close()


@pytest.fixture
def make_platform(database, tmp_path, tiny_base, request, monkeypatch):
    for name in ("SWIFTKV_API_KEYS", "SWIFTKV_API_KEYS_FILE", "SWIFTKV_TRAINER_FILES_DIR", "SWIFTKV_TRAINER_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    url = request.getfixturevalue("pg_url") if database == "postgresql" else f"sqlite:///{tmp_path / 'gateway.db'}"
    made = []

    def make(**kw) -> Platform:
        made.append(Platform(tmp_path / f"p{len(made)}", url, tiny_base, monkeypatch, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


async def upload(c: httpx.AsyncClient, content: bytes, purpose: str = "fine-tune", **fields) -> dict:
    r = await c.post("/v1/files", files={"file": ("train.jsonl", content)}, data={"purpose": purpose, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def job(training_file: str, **hp) -> dict:
    return {"model": MODEL, "training_file": training_file,
            "method": {"type": "distillation", "distillation": {"hyperparameters": {**QUICK, **hp}}}}


def refused(r: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param != "unset":
        assert error["param"] == param, error
    return error


def expire(p: Platform, file_id: str) -> None:
    """The file's expiry moved into the past, as time would."""
    with p.service.store.engine.begin() as conn:
        if conn.execute(update(expiry).where(expiry.c.file_id == file_id).values(expires_at=int(time.time()) - 1)).rowcount == 0:
            conn.execute(expiry.insert().values(file_id=file_id, expires_at=int(time.time()) - 1))


# ---- 1. an upload to the gateway trains on the trainer; another key's file is a 404 on both -----------------------
async def test_a_gateway_upload_trains_on_the_trainer_and_is_the_keys_own(make_platform):
    p = make_platform()
    async with p.gateway(p.key_a) as gw_a, p.gateway(p.key_b) as gw_b, p.training(p.key_a) as tr_a, p.training(p.key_b) as tr_b:
        f = await upload(gw_a, records())
        # listed, retrieved and downloaded through the trainer as through the gateway
        assert f["id"] in [x["id"] for x in (await tr_a.get("/v1/files", params={"purpose": "fine-tune"})).json()["data"]]
        assert (await tr_a.get(f"/v1/files/{f['id']}")).json() == f
        assert (await tr_a.get(f"/v1/files/{f['id']}/content")).content == records()
        r = await tr_a.post("/v1/fine_tuning/jobs", json=job(f["id"]))
        assert r.status_code == 200, r.text
        created = r.json()
        assert created["training_file"] == f["id"] and created["status"] == "validating_files"
        run = p.service.worker.run_dir(created["id"])
        assert len((run / "train.jsonl").read_bytes().splitlines()) + len((run / "eval.jsonl").read_bytes().splitlines()) == 24
        # key B: A's file does not exist on either service, and B cannot train on it
        for c in (gw_b, tr_b):
            for path in (f"/v1/files/{f['id']}", f"/v1/files/{f['id']}/content"):
                assert refused(await c.get(path), 404)["code"] == "file_not_found", path
            refused(await c.delete(f"/v1/files/{f['id']}"), 404)
            assert f["id"] not in [x["id"] for x in (await c.get("/v1/files")).json()["data"]]
        assert refused(await tr_b.post("/v1/fine_tuning/jobs", json=job(f["id"])), 400, "training_file")["code"] == "file_not_found"
        # an upload to the trainer is the gateway's file too; a batch file is no training file
        g = await upload(tr_a, b'{"custom_id": "a"}\n', purpose="batch")
        assert (await gw_a.get(f"/v1/files/{g['id']}")).json() == g
        assert "purpose 'fine-tune'" in refused(await tr_a.post("/v1/fine_tuning/jobs", json=job(g["id"])), 400, "training_file")["message"]


async def test_a_file_whose_bytes_went_is_a_400_naming_the_field_not_a_500(make_platform):
    """The sweep of the other service (or an operator) may take the bytes between the row's read and the copy."""
    p = make_platform()
    async with p.training(p.key_a) as tr, p.gateway(p.key_a) as gw:
        f = await upload(gw, records())
        (p.files_dir / f["id"]).unlink()
        error = refused(await tr.post("/v1/fine_tuning/jobs", json=job(f["id"])), 400, "training_file")
        assert error["code"] == "file_not_found"
        assert refused(await tr.get(f"/v1/files/{f['id']}/content"), 404)["code"] == "file_not_found"
        assert not list((Path(p.service.settings.data_dir) / "runs").glob("*")), "a refused job leaves no run folder"


# ---- 2. the trainer's result files download through the gateway; the gateway's sweep takes their bytes too -------
async def test_trainer_result_files_download_through_the_gateway_and_expire_whole(make_platform):
    p = make_platform()
    async with p.gateway(p.key_a) as gw_a, p.gateway(p.key_b) as gw_b, p.training(p.key_a) as tr_a:
        f = await upload(tr_a, records())
        r = await tr_a.post("/v1/fine_tuning/jobs", json=job(f["id"], min_top1_agreement=0.99))
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        # the job's run ended with an evaluation below its gate: the worker writes its result file and fails it
        store, worker = p.service.store, p.service.worker
        run = worker.run_dir(job_id)
        (run / "eval.json").write_text(json.dumps({"top1_agreement": 0.5, "kl": 0.1}))
        (run / "out").mkdir()
        (run / "out" / "summary.json").write_text(json.dumps({"tokens": 128}))
        assert store.update_job(job_id, None, status="running")
        worker._finish(store.get_job(None, job_id), run)
        done = (await tr_a.get(f"/v1/fine_tuning/jobs/{job_id}")).json()
        assert done["status"] == "failed" and done["error"]["code"] == "quality_gate" and len(done["result_files"]) == 1
        result_id = done["result_files"][0]

        listed = (await gw_a.get("/v1/files", params={"purpose": "fine-tune-results"})).json()["data"]
        assert [x["id"] for x in listed] == [result_id] and listed[0]["filename"] == f"{job_id}-results.json"
        r = await gw_a.get(f"/v1/files/{result_id}/content")
        assert r.status_code == 200 and json.loads(r.content)["evaluation"]["top1_agreement"] == 0.5
        assert (await tr_a.get(f"/v1/files/{result_id}/content")).content == r.content
        for path in (f"/v1/files/{result_id}", f"/v1/files/{result_id}/content"):
            refused(await gw_b.get(path), 404)

        # expired: the gateway's sweep removes the trainer's file, row and bytes together
        expire(p, result_id)
        refused(await gw_a.get(f"/v1/files/{result_id}/content"), 404)  # expired at once, swept or not
        assert (p.files_dir / result_id).exists()
        assert await p.gw.service.file_api.sweep() == 1
        assert not (p.files_dir / result_id).exists() and store.files.get(store.get_job(None, job_id)["owner"], result_id) is None


# ---- 3. the trainer's uploads: one quota with the gateway's, expiry, list, delete, sweep -------------------------
async def test_trainer_uploads_count_in_the_keys_quota_expire_list_and_delete(make_platform):
    p = make_platform(quota=4096)
    line = b'{"text": "' + b"x" * 987 + b'"}\n'  # 1000 bytes
    async with p.gateway(p.key_a) as gw, p.training(p.key_a) as tr, p.training(p.key_b) as tr_b:
        first = await upload(tr, line * 3)  # 3000 of the key's 4096 bytes, uploaded to the trainer
        error = refused(await gw.post("/v1/files", files={"file": ("b.jsonl", line * 2)}, data={"purpose": "batch"}), 413, "file")
        assert error["code"] == "storage_quota_exceeded" and "batch.max_storage_bytes_per_key" in error["message"]
        error = refused(await tr.post("/v1/files", files={"file": ("b.jsonl", line * 2)}, data={"purpose": "fine-tune"}), 413, "file")
        assert error["code"] == "storage_quota_exceeded" and "max_storage_bytes_per_key" in error["message"]
        await upload(tr_b, line * 2)  # another key's room is its own
        assert not [x for x in p.files_dir.iterdir() if x.name.startswith(".")], "a refused upload keeps no part file"

        # expires_after, as OpenAI takes it, on the trainer's uploads
        soon = await upload(tr, line, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
        assert soon["expires_at"] == soon["created_at"] + 3600
        refused(await tr.post("/v1/files", files={"file": ("c.jsonl", b"{}")},
                              data={"purpose": "fine-tune", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}),
                400, "expires_after[seconds]")
        listed = (await tr.get("/v1/files", params={"order": "asc"})).json()
        assert [x["id"] for x in listed["data"]] == [first["id"], soon["id"]] and listed["object"] == "list"
        refused(await tr.get("/v1/files", params={"purpose": "nope"}), 400, "purpose")

        # expired: the trainer's sweep removes row and bytes; the room is back
        expire(p, soon["id"])
        assert soon["id"] not in [x["id"] for x in (await gw.get("/v1/files")).json()["data"]]  # expired: listed nowhere
        assert await p.service.file_api.sweep() == 1
        assert not (p.files_dir / soon["id"]).exists()
        for c in (tr, gw):
            refused(await c.get(f"/v1/files/{soon['id']}"), 404)

        # deleted through the trainer: gone from the gateway too, bytes and all
        r = await tr.delete(f"/v1/files/{first['id']}")
        assert r.json() == {"id": first["id"], "object": "file", "deleted": True}
        refused(await gw.get(f"/v1/files/{first['id']}"), 404)
        assert not (p.files_dir / first["id"]).exists()
        await upload(gw, line * 2, purpose="batch")  # the room is back


# ---- 4. a running batch's input: neither service deletes it, nor sweeps it ----------------------------------------
async def test_neither_service_deletes_or_sweeps_a_running_batchs_input(make_platform):
    from services.batch.store import ACTIVE

    assert FILE_READERS[0][0] == "swiftkv_batches" and set(FILE_READERS[0][3]) == set(ACTIVE), "the Batch API's statuses"
    p = make_platform()
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "swiftkv", "prompt": "hi", "max_tokens": 2}}).encode() + b"\n"
    async with p.gateway(p.key_a) as gw, p.training(p.key_a) as tr:
        f = await upload(tr, line, purpose="batch")
        r = await gw.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
        assert r.status_code == 200 and r.json()["status"] == "validating", r.text  # the runner is not started: it stays so
        for c in (tr, gw):
            assert refused(await c.delete(f"/v1/files/{f['id']}"), 409, "file_id")["code"] == "file_in_use"
        expire(p, f["id"])
        assert await p.service.file_api.sweep() == 0 and await p.gw.service.file_api.sweep() == 0
        assert (p.files_dir / f["id"]).exists()
        assert (await gw.post(f"/v1/batches/{r.json()['id']}/cancel")).status_code == 200
        with p.gw.service.store.engine.begin() as conn:  # the runner would finish the cancel
            from services.batch.store import batches
            conn.execute(update(batches).where(batches.c.id == r.json()["id"]).values(status="cancelled"))
        assert await p.service.file_api.sweep() == 1 and not (p.files_dir / f["id"]).exists()


# ---- 5. the trainer's JSON bodies go through the gateway's reader --------------------------------------------------
async def test_the_trainers_bodies_are_read_as_the_gateways(make_platform):
    p = make_platform()
    async with p.training(p.key_a) as tr, p.gateway(p.key_a) as gw:
        f = await upload(tr, records())
        # a lone surrogate, which the trainer stored before: a 400 naming the field, as the gateway answers
        body = json.dumps(job(f["id"]) | {"metadata": {"k": "\ud800"}})
        error = refused(await tr.post("/v1/fine_tuning/jobs", content=body, headers={"content-type": "application/json"}), 400, "metadata.k")
        assert error["code"] == "invalid_value"
        gw_error = refused(await gw.post("/v1/batches", content=json.dumps({"metadata": {"k": "\ud800"}}),
                                         headers={"content-type": "application/json"}), 400, "metadata.k")
        assert gw_error["message"] == error["message"]
        for content in (b"", b"[1]", b"{nope"):
            refused(await tr.post("/v1/fine_tuning/jobs", content=content, headers={"content-type": "application/json"}), 400)
        # both services document one Files API
        gw_doc, tr_doc = (await gw.get("/openapi.json")).json(), (await tr.get("/openapi.json")).json()
        for path, method in (("/v1/files", "post"), ("/v1/files", "get")):
            assert tr_doc["paths"][path][method]["requestBody" if method == "post" else "parameters"] == \
                gw_doc["paths"][path][method]["requestBody" if method == "post" else "parameters"]
        assert set(tr_doc["paths"]) >= {"/v1/files/{file_id}", "/v1/files/{file_id}/content"}


# ---- 6. a training file from the gateway is checked and copied on the trainer's file threads, in bounded memory ------
async def test_a_large_training_file_is_read_on_the_file_threads_a_line_at_a_time(make_platform, monkeypatch):
    """20 MB of 500 kB lines, uploaded to the gateway: the trainer counts, checks and copies it on threads of its own
    (its two store threads stay free for every other request), holding about one line at a time."""
    import tracemalloc
    from threading import current_thread

    from services.training import api

    p = make_platform()
    seen = []
    check = api.check_records
    monkeypatch.setattr(api, "check_records", lambda *a: seen.append(current_thread().name) or check(*a))
    prepare = p.service.prepare_run
    monkeypatch.setattr(p.service, "prepare_run", lambda *a: seen.append(current_thread().name) or prepare(*a))
    content = b"".join(b'{"text": "%d %s"}\n' % (i, b"x" * 500_000) for i in range(40))
    async with p.gateway(p.key_a) as gw, p.training(p.key_a) as tr:
        f = await upload(gw, content)
        tracemalloc.start()
        try:
            r = await tr.post("/v1/fine_tuning/jobs", json=job(f["id"]))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert r.status_code == 200, r.text
    assert len(seen) == 2 and all(name.startswith("swiftkv-training-files") for name in seen), seen
    assert peak < 8 << 20, f"{peak} bytes held for a {len(content)}-byte training file"
    run = p.service.worker.run_dir(r.json()["id"])
    assert [len((run / n).read_bytes().splitlines()) for n in ("train.jsonl", "eval.jsonl")] == [36, 4]
