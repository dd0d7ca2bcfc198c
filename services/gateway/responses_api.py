"""The Responses API routes (`/v1/responses`), an extension of the gateway app: a Responses request becomes the chat
request the chat route would get and goes through the same admission, routing, dispatch and metrics (Gateway's), and
its answer (whole or streamed) comes back as a Response. Stored responses are per key (another key's id is a 404), in
the Batch API's database (ResponseStore). The Batch API's `/v1/responses` lines come here through Gateway.run_request.

A conversation continued by previous_response_id is rebuilt from the store, oldest turn first, rendered with the chat
template and routed by its prefix like any chat request, so a later turn finds its history in the engine's prefix
cache. Reading the chain is charged to the key (its stored bytes, as prompt tokens) before it is read, and its
length is bounded (responses.max_chain_length)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from sqlalchemy.exc import OperationalError
from starlette.responses import JSONResponse, Response

from services.common.errors import APIError, bad_request, not_found
from services.common.files import QuotaExceeded
from services.common.ids import ID, new_id
from services.common.pagination import cursor, int_param, only_query
from services.common.threads import Threads
from services.common.validation import choice

from . import metrics
from .admission import count_rejection
from .pipeline import ClientGone, EventStream, Gateway, until_disconnect
from .render import collect, json_bytes
from .responses import ResponsesRequest, chat_body, from_chat, parse_request, renamed, renamed_body, stored_items
from .responses_store import ResponseStore, record_of
from .responses_stream import ResponseEvents
from .schemas import ChatCompletionRequest, check_tree

log = logging.getLogger("swiftkv.gateway")


def quota_error(used: int, quota: int) -> APIError:
    return APIError(413, f"this key's files and stored responses hold {used} of its {quota} bytes "
                         "(batch.max_storage_bytes_per_key): delete responses or files, let them expire, or send store: false",
                    param="store", code="storage_quota_exceeded")


@dataclass
class Turn:
    """A Responses request ready for admission: the chat request it makes, and what storing it needs."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    items: list[dict]  # the request's input items, as stored
    parent: dict | None  # the previous response's place in its conversation
    history: int  # items of the conversation before this input, in the chat request


class Counted(APIError):
    """A refusal Gateway.run_request made, and counted, already."""


class ResponsesAPI:
    """`router`, `start()`/`stop()` and `openapi_operations`, as create_app takes its extensions."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.cfg = gateway.cfg
        self.io = Threads(2, "swiftkv-responses")
        self._store: ResponseStore | None = None
        self._opening = threading.Lock()
        self._sweeper: asyncio.Task | None = None
        self.router = self._routes()
        self.openapi_operations = openapi_operations()

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self.sweep_expired())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._store is not None:
            self._store.close()
        self.io.close()

    async def sweep_expired(self) -> None:
        """Deletes expired responses while the gateway runs, as the Batch API deletes expired files."""
        while True:
            try:
                if removed := await self.db("sweep"):
                    log.info("deleted %d expired responses", removed)
            except Exception as e:  # the database is away: try again next time
                log.warning("deleting expired responses: %s", e)
            await asyncio.sleep(self.cfg.batch.file_sweep_seconds)

    def store(self) -> ResponseStore:
        with self._opening:
            if self._store is None:
                url = self.cfg.database_url or f"sqlite:///{Path(self.cfg.data_dir).expanduser() / 'swiftkv.db'}"
                Path(self.cfg.data_dir).expanduser().mkdir(parents=True, exist_ok=True)
                expiry = self.cfg.batch.file_expiry_seconds
                self._store = ResponseStore(url, expiry, {"batch": expiry, "batch_output": expiry} if expiry else {})
            return self._store

    async def db(self, method: str, *args):
        def call():
            return getattr(self.store(), method)(*args)
        try:
            return await self.io(call)
        except OperationalError as e:  # the database is down or unreachable: the client may retry
            raise APIError(503, f"the response store is unavailable: {type(e.orig).__name__ if e.orig else e}; try again shortly",
                           "server_error", code="unavailable")

    # ---- a request -> a turn ---------------------------------------------------------------------
    def parse_line(self, data: object) -> ResponsesRequest:
        """A Batch API line's body (not walked by read_body, as a live body is) -> the request."""
        if isinstance(data, (dict, list)):
            check_tree(data)
        return parse_request(data, self.cfg.limits)

    async def prepare(self, data: object, source: str = "batch") -> ResponsesRequest:
        """A Batch API line's body, validated once for all its retries (as Gateway.prepare does a chat line's)."""
        try:
            req = await self.gateway.off_loop(self.parse_line, data)
            if req.stream:
                raise bad_request("stream is not supported here", param="stream")
            return req
        except APIError as e:
            count_rejection(e, source)
            raise

    async def conversation(self, req: ResponsesRequest, identity: str) -> tuple[dict | None, list[dict], int]:
        """The quota check (store: true), then the conversation so far read from the store: (the previous response's
        head, its items oldest first, the prompt tokens charged for them). The chain's item bytes bound its prompt
        tokens: they are taken from the key before it is read, and given back (turn_that_fits) once admission has
        charged the prompt's exact count."""
        quota = self.cfg.batch.max_storage_bytes_per_key
        if req.store and quota is not None and (used := await self.db("used", identity)) >= quota:
            raise quota_error(used, quota)
        if req.previous_response_id is None:
            return None, [], 0
        parent = await self.db("head", identity, req.previous_response_id)
        if parent is None:
            raise not_found("response", req.previous_response_id, "previous_response_id")
        limit = self.cfg.responses.max_chain_length
        if parent["depth"] + 1 > limit:
            raise bad_request(f"previous_response_id continues a conversation of {parent['depth']} responses; a "
                              f"conversation holds at most {limit} (responses.max_chain_length): start a new one with "
                              "the turns it needs as input", param="previous_response_id", code="conversation_too_long")
        charged = parent["chain_bytes"]
        await self.gateway.limiter.acquire(identity, charged, 0, requests=0)
        try:
            chain = await self.db("chain", identity, parent["id"], limit)
            if isinstance(chain, str):
                raise not_found("response", chain, "previous_response_id")
            return parent, [it for row in chain for it in _turn_items(row)], charged
        except BaseException:
            await self.gateway.limiter.settle(identity, charged, 0, kind="prompt_tokens")
            raise

    async def turn(self, req: ResponsesRequest, parent: dict | None, history: list[dict]) -> Turn:
        """The chat request of this input after `history`."""
        while history and history[0]["type"] == "function_call_output":  # truncated away from the call it answers
            history = history[1:]
        items = stored_items(req)
        try:
            chat = await self.gateway.off_loop(self.gateway.admission.validate, chat_body(req, history, items), "chat")
        except APIError as e:
            raise renamed(e) from None
        return Turn(req, chat, items, parent, len(history))

    async def turn_that_fits(self, req: ResponsesRequest, identity: str, admit) -> tuple[Turn, object]:
        """`admit(turn)` for the request; with truncation auto, a conversation too long for the context loses its
        oldest turns (halving what is dropped each try) until it fits, as OpenAI truncates."""
        parent, history, charged = await self.conversation(req, identity)
        try:
            while True:
                turn = await self.turn(req, parent, history)
                try:
                    return turn, await admit(turn)
                except APIError as e:
                    if req.truncation != "auto" or e.code != "context_length_exceeded" or turn.history == 0:
                        raise renamed(e) from None
                    history = history[len(history) - turn.history + max(1, turn.history // 2):]
        finally:
            if charged:
                await self.gateway.limiter.settle(identity, charged, 0, kind="prompt_tokens")

    async def save(self, response: dict, turn: Turn, identity: str) -> None:
        record = record_of(response, identity, turn.items, turn.parent, self.cfg.batch.file_expiry_seconds)
        try:
            await self.db("add", record, self.cfg.batch.max_storage_bytes_per_key)
        except QuotaExceeded as e:
            raise quota_error(e.used, e.quota) from None

    # ---- live requests ---------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        gw, t0 = self.gateway, time.perf_counter()
        try:
            identity = gw.admission.identify(request)
            data, size = await gw.admission.read_body(request, identity)  # charged before it is decoded
            if (refusal := await gw.slots.take(request)) is not None:  # a shared slot, once the body is in (slots.py)
                return refusal
            req = await gw.admission.by_size(size, parse_request, data, self.cfg.limits)  # read_body walked it (check_tree)
            turn, (admitted, decision) = await self.turn_that_fits(
                req, identity, lambda t: gw.admit_and_route(t.chat, "chat", identity, size, charged=True, live=True))
        except APIError as e:
            count_rejection(e, "live")
            return e.response()
        resp_id, created = new_id("resp_"), int(time.time())
        admitted.route = "responses"
        metrics.labelled(metrics.route_decisions, decision.pool, decision.reason, "live").inc()
        metrics.for_pool(decision.pool, req.model).overhead.observe(time.perf_counter() - t0)
        stream = gw.dispatch.stream(admitted, decision, t0)
        headers = {"x-swiftkv-route": decision.header(self.cfg.routing.expose_reason), "x-request-id": admitted.generate.request_id}
        if req.stream:
            first = await gw.first_or_refusal(request, stream, admitted, headers, renamed_body)
            if isinstance(first, Response):
                return first
            save = (lambda response: self.save(response, turn, identity)) if req.store else None
            events = ResponseEvents(resp_id, req, created, admitted.render, admitted.prompt_tokens, save)
            return EventStream(events.body(stream, first), headers)  # one watcher task, no anyio task group
        try:
            status, body = await until_disconnect(request, collect(stream, admitted.render, admitted.prompt_tokens, gw.off_loop,
                                                                   admitted.structured_param))
        except ClientGone:
            return Response(status_code=499)
        if status != 200:
            return JSONResponse(renamed_body(body), status_code=status, headers=headers)
        response = from_chat(resp_id, req, created, body)
        if req.store:
            try:
                await self.save(response, turn, identity)
            except APIError as e:
                return e.response()
        return Response(await gw.off_loop(json_bytes, response), media_type="application/json", headers=headers)

    # ---- the Batch API's lines -------------------------------------------------------------------
    async def run_request(self, data: object, identity: str, *, source: str = "batch", **options) -> tuple[int, dict]:
        """A `/v1/responses` line (or what `prepare` made of it) through Gateway.run_request as its chat request."""
        try:
            req = data if isinstance(data, ResponsesRequest) else await self.prepare(data, source)
        except APIError as e:  # counted by prepare
            return e.status, e.body()

        async def admit(turn: Turn):
            status, body = await self.gateway.run_request(turn.chat, "chat", identity, source=source, route="responses", **options)
            if status != 200:
                error = body.get("error") or {}
                raise Counted(status, error.get("message", ""), error.get("type", "invalid_request_error"),
                              error.get("param"), error.get("code"))
            return body

        try:
            turn, chat = await self.turn_that_fits(req, identity, admit)
            response = from_chat(new_id("resp_"), req, int(time.time()), chat)
            if req.store:
                await self.save(response, turn, identity)
        except APIError as e:
            if not isinstance(e, Counted):
                count_rejection(e, source)
            return e.status, e.body()
        return 200, response

    # ---- stored responses ------------------------------------------------------------------------
    async def own(self, request: Request, response_id: str) -> dict:
        identity = self.gateway.admission.identify(request)
        row = await self.db("get", identity, response_id) if ID.fullmatch(response_id) else None
        if row is None:
            raise not_found("response", response_id)
        return row

    def _routes(self) -> APIRouter:
        router = APIRouter()

        async def create(request: Request):
            return await self.create(request)

        router.add_api_route("/v1/responses", create, methods=["POST"], include_in_schema=False)

        @router.get("/v1/responses/{response_id}")
        async def retrieve(request: Request, response_id: str):
            no_query(request)
            row = await self.own(request, response_id)
            return Response(row["response"], media_type="application/json")

        @router.delete("/v1/responses/{response_id}")
        async def delete(request: Request, response_id: str):
            no_query(request)
            row = await self.own(request, response_id)
            await self.db("delete", row["owner"], row["id"])
            return {"id": row["id"], "object": "response", "deleted": True}

        @router.get("/v1/responses/{response_id}/input_items")
        async def input_items(request: Request, response_id: str):
            only_query(request, "after", "limit", "order")
            order = choice(request.query_params.get("order", "desc"), "order", ("asc", "desc"))
            limit = int_param(request, "limit", 20, 1, 100)
            after = cursor(request)
            row = await self.own(request, response_id)
            items = await self.gateway.off_loop(_json_list, row["input_items"])
            if order == "desc":
                items.reverse()
            if after is not None:
                at = next((i for i, it in enumerate(items) if it["id"] == after), None)
                if at is None:
                    raise bad_request(f"after {after!r} is not an input item of {response_id}", param="after")
                items = items[at + 1:]
            data = items[:limit]
            return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}

        return router


def no_query(request: Request) -> None:
    for name in request.query_params:
        raise bad_request(f"unsupported query parameter '{name}'; this route takes none", param=name)


def _json_list(text: str) -> list:
    return json.loads(text)


def _turn_items(row: dict) -> list[dict]:
    """A stored turn's items as the next turn's history: its input, then its output."""
    return json.loads(row["input_items"]) + json.loads(row["response"])["output"]


def openapi_operations() -> dict:
    """The routes for /openapi.json (they parse their own requests)."""
    from services.common.openapi import json_body, page_params, query, ref

    pages = page_params(100)
    pages[0]["schema"]["pattern"] = f"^{ID.pattern}$"
    answer = {"description": "the Response; with `stream: true`, server-sent events ending with response.completed "
                             "(or response.incomplete, response.failed)",
              "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}}
    return {
        ("post", "/v1/responses"): {"summary": "Create a response", "operationId": "create_response",
                                    "requestBody": json_body(ref(ResponsesRequest), {"model": "swiftkv", "input": "What is the capital of France?",
                                                                                "max_output_tokens": 32}),
                                    "responses": {"200": answer}},
        ("get", "/v1/responses/{response_id}"): {"summary": "Retrieve a stored response", "operationId": "get_response"},
        ("delete", "/v1/responses/{response_id}"): {"summary": "Delete a stored response", "operationId": "delete_response"},
        ("get", "/v1/responses/{response_id}/input_items"): {
            "summary": "List a stored response's input items", "operationId": "list_input_items",
            "parameters": [query("order", {"type": "string", "enum": ["asc", "desc"]}), *pages]},
    }
