"""The FastAPI app around a Gateway: the OpenAI routes, health, readiness, metrics, and extensions' routers."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from .edge import ConcurrencyCap
from .errors import APIError, bad_request, error_response
from .gateway import Gateway
from .openapi import document, json_body, ref
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse

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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(gateway.start())  # /health answers while engines warm up
        if worker_header:  # one of several workers: accept only once the pools were tried, or a replacement
            await starting  # worker would take connections from ready ones and answer them 503
        for ext in extensions:
            await ext.start()
        try:
            yield
        finally:
            for ext in reversed(extensions):
                await ext.stop()
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await gateway.stop()

    app = FastAPI(title="SwiftKV gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.gateway = gateway
    app.add_middleware(ConcurrencyCap, limit=gateway.cfg.limits.max_concurrent_requests,
                       paths=("/v1/chat/completions", "/v1/completions"))
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

    @app.get("/health")
    async def health():
        if gateway.alive:  # alive while the pools start, then while at least one can serve
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "pools": {name: p.ready for name, p in gateway.pools.items()}}, status_code=503)

    @app.get("/ready")
    async def ready():
        body = {"ready": gateway.ready, "pools": {name: p.ready for name, p in gateway.pools.items()}}
        return JSONResponse(body, status_code=200 if gateway.ready else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        gateway.keys.identify(request.headers.get("authorization"))
        body = generate_latest(REGISTRY)
        if gateway.extra_metrics is not None:
            body += (await gateway.extra_metrics()).encode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        gateway.keys.identify(request.headers.get("authorization"))
        data = [{"id": name, "object": "model", "created": gateway.created, "owned_by": "swiftkv",
                 "root": gateway.cfg.model if pool else None, "pool": pool}
                for name, pool in gateway.models.items()]
        return {"object": "list", "data": data}

    # The two hot routes are plain Starlette endpoints: they parse their own bodies (to answer with
    # OpenAI's envelope), so FastAPI's dependency and body machinery would only add latency.
    async def chat(request: Request):
        return await gateway.handle(request, "chat")

    async def completions(request: Request):
        return await gateway.handle(request, "completion")

    # vLLM's tokenizer routes and version, for tools that probe them (same shapes as vLLM's server)
    @app.post("/tokenize")
    async def tokenize(request: Request):
        gateway.keys.identify(request.headers.get("authorization"))
        req = parse(TokenizeRequest, await gateway.read_json(request))
        gateway.check_bounds(req)
        if req.model is not None:
            gateway.resolve_model(req.model)
        p = gateway.prompter
        if req.messages is not None:
            ids = p.chat_messages(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                                  req.chat_template_kwargs, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = p.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": gateway.max_model_len, "tokens": ids,
                "token_strs": p.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        gateway.keys.identify(request.headers.get("authorization"))
        req = parse(DetokenizeRequest, await gateway.read_json(request))
        if req.model is not None:
            gateway.resolve_model(req.model)
        vocab = gateway.prompter.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is not in the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": gateway.prompter.decode(req.tokens)}

    @app.get("/version")
    async def version():
        from vllm import __version__ as vllm_version

        return {"version": vllm_version}

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    operations = dict(OPERATIONS)
    for ext in extensions:
        app.include_router(ext.router)
        operations.update(getattr(ext, "openapi_operations", {}))
    models = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest]
    app.openapi = lambda: document(app, operations, models, bearer=gateway.keys.enabled, public=("/health", "/ready", "/version"))
    return app


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
