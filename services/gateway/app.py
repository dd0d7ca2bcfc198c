"""The FastAPI app around a Gateway: the OpenAI routes, health, readiness, metrics, and extensions' routers."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from .errors import APIError, error_response
from .gateway import Gateway

__all__ = ["Gateway", "create_app"]

log = logging.getLogger("swiftkv.gateway")


def create_app(gateway: Gateway, extensions: Sequence = ()) -> FastAPI:
    """`extensions` (e.g. the Batch API) each bring a `router` and async `start()` / `stop()`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(gateway.start())  # /health answers while engines warm up
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

    app = FastAPI(title="SwiftKV gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

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

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    for ext in extensions:
        app.include_router(ext.router)

    return app
