"""OpenAI's Files and fine-tuning jobs routes, same shapes, so the official `openai` SDK drives the service:
`client.fine_tuning.jobs.create(model=..., training_file=..., method={"type": "distillation", ...})`. The Files routes
are the platform's one Files API (services.common.files_api), the gateway's too: a file uploaded to either service
trains here, and a job's result file downloads from either.

Every route wants one of the gateway's API keys when keys are configured (401 otherwise), and a key sees only its
own files and jobs (another key's ids answer 404), as in the Batch API. Every refusal is a 400 naming the field
(the SDK raises BadRequestError), decided before anything is written, so a refused job leaves no row, no event and
no run folder behind; the whole request is checked before its model is prepared or downloaded."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from fastapi import APIRouter, Request
from sqlalchemy.exc import OperationalError

from services.common.bodies import read_object
from services.common.errors import APIError, bad_request, not_found
from services.common.ids import ID, new_id
from services.common.pagination import cursor, int_param, only_query, page
from services.common.uploads import jsonl_lines
from services.common.validation import check_metadata
from swiftkv_core.config import SwiftKVConfigError

from .hyperparameters import DistillationHyperparameters, HyperparameterError
from .metrics import jobs_finished

log = logging.getLogger("swiftkv.training")

JOB_FIELDS = {"model", "training_file", "validation_file", "method", "suffix", "seed", "metadata", "hyperparameters", "integrations"}


def job_object(j: dict) -> dict:
    hp = j["method"]["distillation"]["hyperparameters"]
    return {
        "id": j["id"], "object": "fine_tuning.job", "created_at": j["created_at"], "error": j["error"],
        "fine_tuned_model": j["fine_tuned_model"], "finished_at": j["finished_at"],
        "hyperparameters": {"batch_size": hp["batch_size"], "learning_rate_multiplier": None, "n_epochs": None},
        "model": j["model"], "organization_id": "org-swiftkv", "result_files": j["result_files"] or [], "seed": j["seed"],
        "status": j["status"], "trained_tokens": j["trained_tokens"], "training_file": j["training_file"],
        "validation_file": j["validation_file"], "estimated_finish": j["estimated_finish"], "integrations": None,
        "metadata": j["metadata"], "method": j["method"],
    }


def event_object(e: dict) -> dict:
    # OpenAI's event types are "message" and "metrics" (a store written by an older version may hold "checkpoint")
    return {"id": e["id"], "object": "fine_tuning.job.event", "created_at": e["created_at"], "level": e["level"],
            "message": e["message"], "type": e["type"] if e["type"] == "metrics" else "message", "data": e["data"] or {}}


# OpenAI's checkpoint metrics; the others a checkpoint records (its tokens) are in the job's metrics events
CHECKPOINT_METRICS = ("full_valid_loss", "full_valid_mean_token_accuracy", "step", "train_loss", "train_mean_token_accuracy",
                      "valid_loss", "valid_mean_token_accuracy")


def checkpoint_object(c: dict) -> dict:
    metrics = {k: v for k, v in (c["metrics"] or {}).items() if k in CHECKPOINT_METRICS}
    return {"id": c["id"], "object": "fine_tuning.job.checkpoint", "created_at": c["created_at"],
            "fine_tuned_model_checkpoint": f"{c['job_id']}:step-{c['step_number']}", "fine_tuning_job_id": c["job_id"],
            "metrics": metrics, "step_number": c["step_number"]}


def gone(file_id: str, param: str) -> APIError:
    return bad_request(f"no such file: {file_id[:64]}", param=param, code="file_not_found")


def check_records(path: Path, param: str, max_line_bytes: int) -> int:
    """Lines of OpenAI's chat format ({"messages": [...]}) or {"text": ...}; returns how many, else a 400. One line
    is held at a time, at most max_line_bytes of it (the rest of a longer line is skipped unread), so a file of any
    size is read in bounded memory."""
    n = 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:  # deleted (or swept) since its row was read
        raise gone(path.name, param) from None
    with f:
        for number, _, raw in jsonl_lines(f, max_line_bytes):  # the Batch API's reader
            if raw is None:
                raise bad_request(f"line {number} of the file has more than {max_line_bytes} bytes; a line is limited to "
                                  f"{max_line_bytes} bytes (max_line_bytes)", param=param, code="invalid_file_format")
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):  # ValueError: not JSON, not UTF-8; RecursionError: nested too deep
                raise bad_request(f"line {number} of the file is not valid JSON (or nests too deep to parse)", param=param,
                                  code="invalid_file_format")
            ok = isinstance(rec, dict) and (
                isinstance(rec.get("text"), str) and rec["text"].strip()
                or isinstance(rec.get("messages"), list) and rec["messages"] and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in rec["messages"]))
            if not ok:
                raise bad_request(f"line {number} of the file is neither {{\"messages\": [{{\"role\", \"content\"}}, ...]}} "
                                  "nor {\"text\": \"...\"}", param=param, code="invalid_file_format")
            n += 1
    if n == 0:
        raise bad_request("the file is empty: it has no training records", param=param, code="invalid_file_format")
    return n


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def model_source(name: str, models_dir: Path, allowed: list[str]) -> tuple[str, str | Path]:
    """Where a job's `model` comes from, decided without building or downloading anything: ("registered", name) for
    a name `swiftkv models prepare` builds, ("local", folder) for a model folder in the models directory (by its name
    there, or a path into it), ("hub", id) for a hub id the operator allowed (allowed_models). Any other folder on
    this machine, and any other hub id, is a 400 saying what is allowed."""
    from swiftkv_core import catalog

    if len(name) > 512:
        raise bad_request(f"model names are at most 512 characters; got {len(name)}", param="model")
    if name in catalog.fine_tuned(models_dir):
        raise bad_request(f"{name} is already a SwiftKV model; distill from its base model", param="model", code="model_not_supported")
    if name in catalog.REGISTRY:
        return "registered", name
    root = Path(os.path.abspath(models_dir))
    for candidate in (Path(os.path.abspath(root / name)), Path(os.path.abspath(name))):  # lexical: `..` cannot leave root
        if candidate.is_relative_to(root) and candidate != root and not any(
                part.startswith(".") for part in candidate.relative_to(root).parts) and (candidate / "config.json").is_file():
            return "local", candidate
    if HUB_ID.fullmatch(name) and any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed):
        return "hub", name
    # The models directory is not listed: it holds other keys' fine-tuned models too.
    raise bad_request(
        f"model {name!r} cannot be distilled here: name a model `swiftkv models prepare` builds ({', '.join(catalog.REGISTRY)}), "
        f"a hub id the operator allowed (allowed_models: {', '.join(allowed) or 'none'}) or a base model the operator placed "
        "in the trainer's models directory (ask the operator for its name)", param="model", code="model_not_found")


# What a job needs of a hub repository: config, tokenizer, safetensors weights (not .bin/.pth copies, not originals).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def hub_listing(name: str) -> tuple[str, dict[str, int]]:
    """The hub's current revision of a model repository and the size of each of its files: the one call made to the
    hub before a download."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(name, files_metadata=True)
    return info.sha, {s.rfilename: s.size or 0 for s in info.siblings or []}


def download(name: str, max_bytes: int) -> Path:
    """An allowed hub model's folder: only HUB_FILES, of the revision whose size was checked, and only when they
    come to at most max_bytes (a pattern in allowed_models may match repositories of any size)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    revision, sizes = hub_listing(name)
    wanted = list(filter_repo_objects(sizes, allow_patterns=HUB_FILES))  # the files snapshot_download will fetch
    if not any(f.endswith(".safetensors") for f in wanted):
        raise bad_request(f"model {name} has no safetensors weights on the hub; only safetensors checkpoints are downloaded",
                          param="model", code="model_not_supported")
    total = sum(sizes[f] for f in wanted)
    if total > max_bytes:
        raise bad_request(f"model {name} is {total} bytes ({total / 2**30:.1f} GiB) of weights, config and tokenizer on the "
                          f"hub; this trainer downloads at most {max_bytes} bytes (max_model_bytes)", param="model",
                          code="model_too_large")
    return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_FILES))


def fetch_model(source: tuple[str, str | Path], models_dir: Path, max_model_bytes: int) -> tuple[Path, dict]:
    """The model folder (prepared or downloaded now if need be) and its config.json; 400 when it is not a base Llama.
    A failure to prepare or download is said in a sentence; its details (paths, URLs) go to the server's log only."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    from swiftkv_core import catalog

    kind, name = source
    folder = Path(name)
    if kind == "local":  # named in messages as in the models directory, never by the server's path to it
        name = os.path.relpath(folder, os.path.abspath(models_dir))
    try:
        if kind == "registered":
            folder = catalog.prepare(name, models_dir)
        elif kind == "hub":
            folder = download(name, max_model_bytes)
    except APIError:
        raise
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError):
        raise bad_request(f"model {name} is not on the hub, or it is gated or private to this trainer's hub token", param="model",
                          code="model_not_found")
    except Exception:
        log.exception("model %s could not be %s", name, "prepared" if kind == "registered" else "downloaded")
        where = "prepared on the server" if kind == "registered" else "downloaded from the hub"
        raise APIError(503, f"model {name} could not be {where} just now; try again later (the operator's log has the "
                       "cause)", "server_error", param="model", code="unavailable")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        raise bad_request(f"model {name!r} has no readable config.json", param="model", code="model_not_found")
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind != "llama":
        raise bad_request(f"model {name!r} has model_type {kind!r}; only base Llama models can be distilled", param="model",
                          code="model_not_supported")
    if not isinstance(config.get("num_hidden_layers"), int) or config["num_hidden_layers"] < 2:
        raise bad_request(f"model {name!r} has no num_hidden_layers of at least 2 in its config.json", param="model",
                          code="model_not_supported")
    return folder.resolve(), config


HP = "method.distillation.hyperparameters"


def parse_method(method) -> DistillationHyperparameters:
    """The method's hyperparameters, each checked, defaults filled in but num_key_value_layers, whose default and
    bounds depend on the model (check_layout, once the model is known)."""
    if method is None:
        method = {"type": "distillation"}
    if not isinstance(method, dict) or method.get("type") != "distillation":
        raise bad_request("method.type must be 'distillation' (SwiftKV distillation)", param="method.type")
    for key in method:
        if key not in ("type", "distillation"):
            raise bad_request(f"unsupported field 'method.{key}'", param=f"method.{key}")
    body = method.get("distillation") or {}
    if not isinstance(body, dict) or any(k != "hyperparameters" for k in body):
        raise bad_request("method.distillation may hold only 'hyperparameters'", param="method.distillation")
    given = body.get("hyperparameters") or {}
    if not isinstance(given, dict):
        raise bad_request(f"{HP} must be an object", param=HP)
    try:
        return DistillationHyperparameters.from_request(given)
    except HyperparameterError as e:
        raise bad_request(str(e), param=f"{HP}.{e.field}")


def check_layout(hp: DistillationHyperparameters, layers: int) -> dict:
    """The job's method: num_key_value_layers (default: half the layers) and the AcrossKV groups checked against the
    model's layers."""
    try:
        hp = hp.for_model(layers)
    except SwiftKVConfigError as e:
        raise bad_request(str(e), param=f"{HP}.{e.field}")
    return {"type": "distillation", "distillation": {"hyperparameters": hp.model_dump()}}


def build_router(service) -> APIRouter:
    store, file_api, settings = service.store, service.file_api, service.settings
    router = APIRouter()

    def owner(request: Request) -> str:
        """The caller's key digest ("anonymous" without keys); 401 when keys are configured and it has none valid."""
        return service.keys.identify(request.headers.get("authorization"))

    async def db(fn, *args, **kwargs):
        try:
            return await service.io(fn, *args, **kwargs)
        except OperationalError:
            log.warning("the job store is unavailable", exc_info=True)  # the details (host, SQL) for the operator only
            raise APIError(503, "the job store is unavailable; try again shortly", "server_error", code="unavailable")

    router.include_router(file_api.router(owner))  # the Files API: /v1/files...

    # ---- jobs ------------------------------------------------------------------------------------
    async def input_file(who: str, file_id, param: str) -> Path:
        """The key's file of purpose fine-tune (uploaded to this service or to the gateway), its records checked."""
        if not isinstance(file_id, str) or not file_id:
            raise bad_request(f"{param} must be a file id", param=param)
        f = await file_api.db(file_api.records.get, who, file_id) if ID.fullmatch(file_id) else None
        if f is None:
            raise gone(file_id, param)
        if f["purpose"] != "fine-tune":
            raise bad_request(f"{file_id} was uploaded with purpose '{f['purpose']}'; a job needs purpose 'fine-tune'", param=param)
        # on threads of their own: two big files being read do not hold the threads every store call needs
        await service.file_io(check_records, file_api.path(file_id), param, settings.max_line_bytes)
        return file_api.path(file_id)

    @router.post("/v1/fine_tuning/jobs")
    async def create_job(request: Request):
        who = owner(request)
        body = await read_object(request, service.body_limits, asyncio.to_thread)  # the gateway's body reader
        for name in body:
            if name not in JOB_FIELDS:
                raise bad_request(f"unsupported field '{name}'", param=name)
        if body.get("hyperparameters"):
            raise bad_request("top-level hyperparameters are not supported; use method.distillation.hyperparameters", param="hyperparameters")
        if body.get("integrations"):
            raise bad_request("integrations are not supported", param="integrations")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("model is required", param="model")
        suffix, seed, metadata = body.get("suffix"), body.get("seed"), body.get("metadata")
        if suffix is not None and not (isinstance(suffix, str) and 1 <= len(suffix) <= 64 and suffix.replace("-", "").replace("_", "").isalnum()):
            raise bad_request("suffix must be 1 to 64 letters, digits, '-' or '_'", param="suffix")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= 2**31 - 1):
            raise bad_request("seed must be an integer from 0 to 2147483647", param="seed")
        check_metadata(metadata)
        hyperparameters = parse_method(body.get("method"))
        source = await service.io(model_source, model, Path(settings.models_dir), settings.allowed_models)
        train = await input_file(who, body.get("training_file"), "training_file")
        valid = await input_file(who, body["validation_file"], "validation_file") if body.get("validation_file") else None
        # Only a request valid in every other respect prepares or downloads its model, on a thread of its own (it may
        # take minutes), so the store's threads keep serving.
        folder, config = await asyncio.to_thread(fetch_model, source, Path(settings.models_dir), settings.max_model_bytes)
        method = check_layout(hyperparameters, config["num_hidden_layers"])
        job_id = new_id("ftjob-")
        record = {"id": job_id, "owner": who, "model": model, "training_file": body["training_file"],
                  "validation_file": body.get("validation_file"), "method": method, "suffix": suffix,
                  "seed": seed if seed is not None else 0, "metadata": metadata, "status": "validating_files",
                  "created_at": int(time.time()), "attempts": 0, "trained_tokens": 0}
        run_dir = service.worker.run_dir(job_id)
        try:
            try:
                await service.file_io(service.prepare_run, run_dir, folder, method, record["seed"], train, valid)
            except FileNotFoundError as e:  # a file deleted (or swept) while it was being copied
                param, name = ("validation_file", valid.name) if valid is not None and str(e.filename) == str(valid) else ("training_file", train.name)
                raise gone(name, param) from None
            await db(store.add_job, record)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        service.wake.set()
        return job_object(await db(store.get_job, who, job_id))

    @router.get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request):
        who = owner(request)
        only_query(request, "after", "limit")
        rows, more = await db(store.list_jobs, who, cursor(request), int_param(request, "limit", 20, 1, 100))
        return page([job_object(j) for j in rows], more)

    async def own_job(who: str, job_id: str) -> dict:
        """The caller's job; another key's is a 404, as if it did not exist."""
        j = await db(store.get_job, who, job_id) if ID.fullmatch(job_id) else None  # an id no service hands out names nothing
        if j is None:
            raise not_found("fine_tuning_job", job_id)
        return j

    @router.get("/v1/fine_tuning/jobs/{job_id}")
    async def get_job(request: Request, job_id: str):
        return job_object(await own_job(owner(request), job_id))

    @router.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def job_events(request: Request, job_id: str):
        who = owner(request)
        only_query(request, "after", "limit")
        await own_job(who, job_id)
        rows, more = await db(store.list_events, job_id, cursor(request), int_param(request, "limit", 20, 1, 1000))
        return page([event_object(e) for e in rows], more)

    @router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def job_checkpoints(request: Request, job_id: str):
        who = owner(request)
        only_query(request, "after", "limit")
        await own_job(who, job_id)
        rows, more = await db(store.list_checkpoints, job_id, cursor(request), int_param(request, "limit", 10, 1, 1000))
        return page([checkpoint_object(c) for c in rows], more)

    @router.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(request: Request, job_id: str):
        who = owner(request)
        j = await own_job(who, job_id)
        if not await db(store.update_job, job_id, ("validating_files", "queued", "running", "paused"), status="cancelled",
                        finished_at=int(time.time()), control=None):
            raise APIError(409, f"a job that is {j['status']} cannot be cancelled", param="job_id", code="job_not_cancellable")
        jobs_finished.labels("cancelled").inc()
        await service.io(service.worker.stop, j)
        await db(store.update_job, job_id, runner_ref=None)
        await db(store.add_event, job_id, "Fine-tuning job cancelled")
        return job_object(await own_job(who, job_id))

    @router.post("/v1/fine_tuning/jobs/{job_id}/pause")
    async def pause_job(request: Request, job_id: str):
        who = owner(request)
        j = await own_job(who, job_id)
        if await db(store.update_job, job_id, ("validating_files", "queued"), status="paused"):
            await db(store.add_event, job_id, "Fine-tuning job paused before it started")
        elif await db(store.update_job, job_id, ("running",), control="pause"):
            await db(store.add_event, job_id, "Pause requested: the job stops at its next checkpoint")
        elif j["status"] != "paused":
            raise APIError(409, f"a job that is {j['status']} cannot be paused", param="job_id", code="job_not_pausable")
        return job_object(await own_job(who, job_id))

    @router.post("/v1/fine_tuning/jobs/{job_id}/resume")
    async def resume_job(request: Request, job_id: str):
        who = owner(request)
        j = await own_job(who, job_id)
        if await db(store.update_job, job_id, ("paused",), status="queued", control=None, runner_ref=None):
            await db(store.add_event, job_id, "Fine-tuning job resumed: queued to continue from its last checkpoint")
            service.wake.set()
        elif await db(store.update_job, job_id, ("running",), control=None):
            pass  # a pause not yet reached is withdrawn
        else:
            raise APIError(409, f"a job that is {j['status']} cannot be resumed", param="job_id", code="job_not_resumable")
        return job_object(await own_job(who, job_id))

    return router
