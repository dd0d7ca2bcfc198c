"""OpenAI's Files and Batch routes, same shapes, so the official `openai` SDK works unchanged. The Files routes are the
platform's one Files API (services.common.files_api), which the trainer mounts too.

Every route authenticates like the rest of the gateway; a key sees only its own files and batches
(another key's ids answer 404). Bodies and query parameters are parsed here, so every refusal is a 4xx
in OpenAI's error envelope naming the field (`param`) and what it takes.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from services.common import files_api
from services.common.errors import APIError, bad_request, not_found
from services.common.ids import ID, new_id
from services.common.pagination import cursor, int_param, only_query, page
from services.common.validation import check_metadata, choice, describe

from .batch_input import ENDPOINTS
from .store import TooManyActive

BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}


def openapi_operations(windows: list[str]) -> dict:
    """What the routes below accept, for the gateway's /openapi.json (they parse their own requests)."""
    from services.common.openapi import json_body, page_params

    def pages(high: int) -> list[dict]:
        params = page_params(high)
        params[0]["schema"]["pattern"] = f"^{ID.pattern}$"  # `after`
        return params
    return files_api.openapi_operations() | {
        ("post", "/v1/batches"): {"summary": "Create a batch", "requestBody": json_body({
            "type": "object", "additionalProperties": False, "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {"input_file_id": {"type": "string", "minLength": 1}, "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
                           "completion_window": {"type": "string", "enum": windows},
                           "metadata": {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                        "additionalProperties": {"type": "string", "maxLength": 512}}}})},
        ("get", "/v1/batches"): {"summary": "List batches", "parameters": pages(100)},
    }


def batch_object(b: dict) -> dict:
    times = {f"{t}_at": b[f"{t}_at"] for t in ("created", "in_progress", "expires", "finalizing", "completed", "failed",
                                               "expired", "cancelling", "cancelled")}
    return {
        "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "errors": b["errors"], "input_file_id": b["input_file_id"],
        "completion_window": b["completion_window"], "status": b["status"], "output_file_id": b["output_file_id"],
        "error_file_id": b["error_file_id"], **times,
        "request_counts": {"total": b["total"], "completed": b["completed"], "failed": b["failed"]},
        "metadata": b["metadata"],
        "usage": {"input_tokens": b["prompt_tokens"], "input_tokens_details": {"cached_tokens": b.get("cached_tokens") or 0},
                  "output_tokens": b["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": b["prompt_tokens"] + b["completion_tokens"]},
    }


def build_router(service) -> APIRouter:
    store, cfg, gateway, file_api = service.store, service.cfg, service.gateway, service.file_api
    router = APIRouter()

    def owner(request: Request) -> str:
        return gateway.keys.identify(request.headers.get("authorization"))

    db = file_api.db
    router.include_router(file_api.router(owner))  # the Files API: /v1/files...

    async def own_file(request: Request, file_id: str, param: str | None = None) -> dict:
        return await file_api.own(owner(request), file_id, param)

    # ---- batches ---------------------------------------------------------------------------------
    @router.post("/v1/batches")
    async def create_batch(request: Request):
        who = owner(request)
        body = await gateway.read_json(request)
        if not isinstance(body, dict):
            raise bad_request(f"the body must be a JSON object; got {describe(body)}")
        for name in body:
            if name not in BATCH_FIELDS:
                raise bad_request(f"unsupported field '{name}'", param=name)
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise bad_request(f"input_file_id must be the id of a file uploaded with purpose 'batch'; got {describe(input_file_id)}",
                              param="input_file_id")
        endpoint = choice(body.get("endpoint"), "endpoint", ENDPOINTS)
        window = choice(body.get("completion_window"), "completion_window", cfg.completion_windows)
        metadata = check_metadata(body.get("metadata"))
        f = await own_file(request, input_file_id, "input_file_id")
        if f["purpose"] != "batch":
            raise bad_request(f"{input_file_id} was uploaded with purpose '{f['purpose']}'; a batch needs purpose 'batch'",
                              param="input_file_id")
        if f["bytes"] > cfg.max_file_bytes:
            raise bad_request(f"{input_file_id} has {f['bytes']} bytes; batch input files are limited to {cfg.max_file_bytes}",
                              param="input_file_id")
        now = time.time()
        record = {"id": new_id("batch_"), "owner": who, "endpoint": endpoint, "input_file_id": input_file_id,
                  "completion_window": window, "metadata": metadata, "status": "validating", "created_at": int(now),
                  "expires_at": int(now + cfg.completion_windows[window]), "total": 0, "completed": 0, "failed": 0,
                  "prompt_tokens": 0, "completion_tokens": 0}
        try:
            await db(store.add_batch, record, cfg.max_active_per_key)
        except TooManyActive as e:
            # One input file may back any number of batches: without a cap one key could queue work without end.
            raise APIError(429, f"this key has {e.active} active batches (validating, in_progress or finalizing); the limit "
                           f"is {e.limit} (batch.max_active_per_key): wait for one to finish or cancel one",
                           "invalid_request_error", code="too_many_active_batches")
        service.runner.wake.set()  # the line checks and the work happen in the runner, under the batch's lease
        return batch_object(await db(store.get_batch, who, record["id"]))

    @router.get("/v1/batches")
    async def list_batches(request: Request):
        who = owner(request)
        only_query(request, "after", "limit")
        rows, more = await db(store.list_batches, who, cursor(request), int_param(request, "limit", 20, 1, 100))
        return page([batch_object(b) for b in rows], more)

    async def own_batch(request: Request, batch_id: str, fn, *args) -> dict:
        who = owner(request)
        b = await db(fn, who, batch_id, *args) if ID.fullmatch(batch_id) else None
        if b is None:
            raise not_found("batch", batch_id)
        return b

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str):
        return batch_object(await own_batch(request, batch_id, store.get_batch))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        b = await own_batch(request, batch_id, store.request_cancel, int(time.time()))
        if b["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"a batch that is {b['status']} cannot be cancelled", code="batch_not_cancellable")
        service.runner.cancel_requested(batch_id)
        service.runner.wake.set()  # a batch nobody holds is finished as cancelled by the next claim
        return batch_object(b)

    return router
