"""`swiftkv trainer serve`: the distillation job service, a FastAPI app of its own (not part of the gateway) with its
own store and file store (the Files API's tables and layout, as the Batch API keeps them), and one worker loop
running one job at a time."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from starlette.responses import JSONResponse, Response

from services.common.bodies import BodyLimits
from services.common.errors import APIError, error_response
from services.common.files_api import FilesService
from services.common.keys import KeyStore
from services.common.threads import Threads
from services.common.uploads import BODY_TIMEOUT, jsonl_lines
from services.common.waiting import wait_event

from .api import build_router
from .backends import LocalJobBackend, RayJobBackend
from .hyperparameters import DistillationHyperparameters
from .metrics import STATUSES, jobs_by_status
from .store import TrainingStore
from .worker import Worker

log = logging.getLogger("swiftkv.training")


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWIFTKV_TRAINER_")

    host: str = Field("127.0.0.1", description="address to listen on; a cluster sets 0.0.0.0 (the chart does), with the "
                      "gateway's API keys")
    port: int = Field(8001, description="port to listen on")
    api_keys_file: str | None = Field(None, description="the gateway's API keys file (a key sees only its own files and jobs); "
                                      "default: SWIFTKV_API_KEYS_FILE, plus SWIFTKV_API_KEYS either way; no keys: one "
                                      "anonymous tenant")
    allowed_models: Annotated[list[str], NoDecode] = Field(
        [], description="hub ids or glob patterns (\"meta-llama/*\") a job may download as its base model, comma-separated "
        "in the environment; empty: only models in models_dir and the names `swiftkv models prepare` builds")
    max_body_bytes: int = Field(1_000_000, description="a JSON request body; more is a 413 (an upload's bound is max_file_bytes)")
    body_timeout_seconds: float = Field(BODY_TIMEOUT, gt=0, description="to receive a whole JSON request body (an upload: this "
                                        "plus a second per 64 KiB received), like the gateway's limits.body_timeout_seconds; "
                                        "a slower one is a 408")
    data_dir: str = Field("data/trainer", description="run folders (data, checkpoints, logs) and the SQLite store")
    files_dir: str | None = Field(None, description="the Files API's bytes, one directory the gateway shares: its data_dir's "
                                  "files/ (the chart mounts the gateway's files volume); with the gateway's database_url too, a "
                                  "file uploaded to either service trains here and a job's results download from either; "
                                  "default: data_dir/files")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the jobs and files store (postgresql://...); "
                                     "default: SQLite file in data_dir")
    models_dir: str = Field("models", description="where jobs find local base models and publish their finished SwiftKV "
                            "checkpoints (`swiftkv models list --dir`)")
    ray_address: str | None = Field(None, description="Ray job submission address (http://head:8265): each job attempt runs "
                                    "as a Ray job, with data_dir on storage the workers share; default: a child process here")
    ray_num_gpus: float = Field(0, description="GPUs each Ray job asks for (0: none; ray_address only)")
    max_file_bytes: int = Field(512 << 20, description="largest uploaded file, in bytes; more is a 413")
    max_storage_bytes_per_key: int | None = Field(2 << 30, ge=1024, description="bytes of files (uploads, batch output, job "
                                                  "results) one key may hold, counted over the file table the gateway shares: "
                                                  "keep it equal to the gateway's batch.max_storage_bytes_per_key (the chart "
                                                  "does); an upload past it is a 413 storage_quota_exceeded; null: no quota")
    file_expiry_seconds: int | None = Field(30 * 86400, ge=3600, description="batch input files uploaded without "
                                            "expires_after, and batch output files, expire this long after their creation: "
                                            "keep it equal to the gateway's batch.file_expiry_seconds (the chart does); "
                                            "fine-tune files and job results expire only by expires_after; null: never")
    file_sweep_seconds: float = Field(60.0, gt=0, description="how often expired files (rows and bytes) are deleted")
    max_line_bytes: int = Field(1_000_000, ge=1024, description="one line (record) of a training or validation file, like the "
                                "Batch API's batch.max_line_bytes; a job naming a file with a longer line is a 400 naming the line")
    max_model_bytes: int = Field(16 << 30, ge=0, description="largest hub model a job may download (its safetensors weights, "
                                 "config and tokenizer files, as the hub lists them); a bigger one is a 400. 16 GiB: an 8B "
                                 "model in bf16, within the chart's 20Gi models volume")
    checkpoint_every: int = Field(50, description="steps between resumable checkpoints")
    events_every: int = Field(10, description="steps between metrics events of a job")
    eval_max_tokens: int = Field(16384, description="packed tokens of the final evaluation (0: no evaluation)")
    eval_prompts: int = Field(4, description="short prompts for the evaluation's greedy agreement")
    eval_gen_tokens: int = Field(16, description="tokens generated greedily per evaluation prompt by teacher and student")
    threads: int | None = Field(None, description="torch threads of the job process; default: torch's own choice")
    poll_seconds: float = Field(0.5, description="how often the worker loop looks at the running job and the queue when "
                                "no request wakes it")
    stop_timeout_seconds: float = Field(30.0, description="on a stop, the running local job saves its state at the end of its "
                                        "step; past this it is killed and resumes from its last periodic checkpoint (keep "
                                        "the pod's terminationGracePeriodSeconds above it)")

    @field_validator("max_storage_bytes_per_key", "file_expiry_seconds", mode="before")
    @classmethod
    def _null(cls, value):  # SWIFTKV_TRAINER_MAX_STORAGE_BYTES_PER_KEY=null, as the chart passes the gateway's null
        return None if isinstance(value, str) and value.strip().lower() in ("null", "none") else value

    @field_validator("allowed_models", mode="before")
    @classmethod
    def _comma_separated(cls, value):  # SWIFTKV_TRAINER_ALLOWED_MODELS="org/a,org/b-*"
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


def records_of(f, cap: int):
    """The non-blank lines of a JSONL file opened in binary, one at a time, each at most `cap` bytes (check_records
    refused longer ones; one longer here is skipped unread, never held)."""
    return (raw for _, _, raw in jsonl_lines(f, cap) if raw is not None and raw.strip())


def copy_records(source: Path, target: Path, cap: int, start: int = 0, stop: int | None = None) -> None:
    """The non-blank lines start..stop of a JSONL file, a line at a time."""
    with open(source, "rb") as f, open(target, "wb") as out:
        out.writelines(itertools.islice((line.rstrip(b"\r\n") + b"\n" for line in records_of(f, cap)), start, stop))


class TrainerService:
    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        # the keys first: a bad keys file stops the service before it creates anything
        self.keys = KeyStore.from_env(settings.api_keys_file or os.environ.get("SWIFTKV_API_KEYS_FILE"))
        data_dir = Path(settings.data_dir).expanduser()
        data_dir.mkdir(parents=True, exist_ok=True)
        settings.data_dir = str(data_dir.resolve())
        self.store = TrainingStore(settings.database_url or f"sqlite:///{data_dir / 'swiftkv.db'}")
        self.io = Threads(2, "swiftkv-training")
        # the platform's Files API, on the bytes and rows the gateway shares (files_dir, database_url)
        self.file_api = FilesService(self.store, Path(settings.files_dir).expanduser() if settings.files_dir else data_dir / "files",
                                     self.io, max_file_bytes=settings.max_file_bytes, quota=settings.max_storage_bytes_per_key,
                                     expiry_seconds=settings.file_expiry_seconds, quota_setting="max_storage_bytes_per_key",
                                     body_timeout=settings.body_timeout_seconds, what="the job store")
        self.files = self.file_api.contents
        self.body_limits = BodyLimits(settings.max_body_bytes, settings.body_timeout_seconds, "max_body_bytes", "body_timeout_seconds")
        self.file_io = Threads(2, "swiftkv-training-files")  # reading and copying big files, beside the store's calls
        backend = RayJobBackend(settings.ray_address, num_gpus=settings.ray_num_gpus) if settings.ray_address else LocalJobBackend()
        self.worker = Worker(self.store, self.files, settings, backend)
        self.wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._sweep: asyncio.Task | None = None

    def prepare_run(self, run_dir: Path, base: Path, method: dict, seed: int, train: Path, valid: Path | None) -> None:
        """The run folder holds everything the job process needs: the settings, its data and (later) its state."""
        hp = method["distillation"]["hyperparameters"]
        run_dir.mkdir(parents=True)
        cap = self.settings.max_line_bytes
        if valid is not None:
            shutil.copyfile(valid, run_dir / "eval.jsonl")
            copy_records(train, run_dir / "train.jsonl", cap)
        else:  # a held-out tenth when there is enough data, else the training records themselves
            with open(train, "rb") as f:
                n = sum(1 for _ in records_of(f, cap))  # counted streaming, a bounded line at a time
            held = n // 10 if n >= 10 else 0
            copy_records(train, run_dir / "train.jsonl", cap, 0, n - held)
            copy_records(train, run_dir / "eval.jsonl", cap, n - held if held else 0)
        s = self.settings
        spec = {
            "distill": {"base": str(base), "out": str(run_dir / "out"), "data": str(run_dir / "train.jsonl"),
                        **DistillationHyperparameters.model_validate(hp).distill_settings(), "seed": seed,
                        "log_every": 1, "checkpoint_every": s.checkpoint_every, "threads": s.threads, "progress": False,
                        # the teacher's side of each row computed once (a resumed attempt reuses it): a step is the
                        # student's later layers and the head only
                        "cache": str(run_dir / "teacher-cache")},
            "eval": {"text": str(run_dir / "eval.jsonl"), "seq_len": hp["seq_len"], "max_tokens": s.eval_max_tokens,
                     "num_prompts": s.eval_prompts, "gen_tokens": s.eval_gen_tokens} if s.eval_max_tokens > 0 else None,
        }
        (run_dir / "job.json").write_text(json.dumps(spec, indent=2))

    async def run(self) -> None:
        while True:
            try:
                await self.io(self.worker.tick)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store is briefly unreachable, a file is mid-write: try again next tick
                log.exception("training worker tick failed")
            await wait_event(self.wake, self.settings.poll_seconds)
            self.wake.clear()

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run())
        self._sweep = asyncio.create_task(self.file_api.sweep_forever(self.settings.file_sweep_seconds))
        self.keys.start_watching()  # the keys follow the gateway's keys file (its changes, SIGHUP)

    async def stop(self) -> None:
        await self.keys.stop_watching()
        if self._sweep is not None:
            self._sweep.cancel()
            with suppress(asyncio.CancelledError):
                await self._sweep
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            await self.io(self.worker.shutdown, self.settings.stop_timeout_seconds)
        self.io.close()
        self.file_io.close()
        self.store.close()


def create_app(settings: TrainerSettings) -> FastAPI:
    service = TrainerService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        yield
        await service.stop()

    app = FastAPI(title="SwiftKV trainer", lifespan=lifespan)
    app.state.service = service
    app.include_router(build_router(service))
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from services.common.openapi import document

    from .openapi import OPERATIONS

    # the routes parse their own requests: described here
    app.openapi = lambda: document(app, OPERATIONS, bearer=service.keys.enabled, public=("/health", "/metrics"))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # e.g. a multipart body Starlette cannot parse
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        return error_response(400, f"invalid request: {first.get('msg', 'bad input')}", param=".".join(str(x) for x in first.get("loc", ())[1:]) or None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")  # no key: Prometheus scrapes it, and it holds counts only, no tenant's objects
    async def metrics():
        counts = await service.io(service.store.count_by_status)
        for status in STATUSES:
            jobs_by_status.labels(status).set(counts.get(status, 0))
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(settings: TrainerSettings, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except (OSError, ValueError) as e:  # an unreadable keys file or a bad key line: say so, no traceback
        raise SystemExit(f"error: trainer: {e}")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level)
