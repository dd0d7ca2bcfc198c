"""The gateway's request pipeline: admission -> dispatch -> rendering over the pools, for live HTTP requests
(`handle`) and the Batch API's lines (`run_request`). `Gateway` composes the parts and holds what the routes,
extensions and the server share: the config, keys, prompter, pools and the CPU pool.

One public model name maps to the pools (routed by prompt/output ratio); each pool's own model name
bypasses routing. Every response carries `x-swiftkv-route: pool=...` (then `; mode=...` where a dual-mode pool runs the
other pool's model); why it went there (`reason=...; ratio=...`) goes to the logs and metrics, and into the header only
with routing.expose_reason: a `prefix` reason would tell a client what another recently sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import JSONResponse, Response

from services.common.errors import APIError, bad_request
from services.common.keys import KeyStore
from services.config import PlatformConfig
from services.serving.backend import Backend, BackendError, BadRequest, Output

from . import metrics
from .admission import Admission, AdmittedRequest, count_rejection
from .capacity import Capacity
from .dispatch import Dispatcher, calling_on_first_token
from .pool_lifecycle import PoolLifecycle
from .prompts import Prompter
from .render import collect, failure, json_bytes, small_answer, sse_body
from .routing import Decision, RoutePolicy
from .schemas import ChatCompletionRequest, CompletionRequest, check_tree
from .slots import Slots

log = logging.getLogger("swiftkv.gateway")


class Gateway:
    """The pools (`lifecycle`), `admission`, `dispatch` and rendering, composed; the FastAPI app is a thin shell
    around it."""

    def __init__(self, cfg: PlatformConfig, backends: dict[str, Backend], prompter: Prompter, keys: KeyStore,
                 on_ready: Callable[[], None] | None = None, extra_metrics: Callable[[], Awaitable[str]] | None = None):
        self.cfg = cfg
        self.keys = keys
        self.prompter = prompter
        self.extra_metrics = extra_metrics  # engine metrics living elsewhere (Ray's metrics agent)
        self.created = int(time.time())
        # Work that grows with a request's body (templates, tokenization, tools, grammar checks, large answers)
        # runs here, never on the event loop, where it would stall every stream of the process (the tokenizer
        # and xgrammar release the GIL). Four threads: a small request finds one free beside a few huge ones;
        # more work waits its turn (requests are bounded by limits.max_concurrent_requests).
        self.cpu = ThreadPoolExecutor(max_workers=4, thread_name_prefix="swiftkv-cpu")
        # with API keys, each key's prefix cache is its own (the Tenancy rule) unless the operator shares them: for every
        # key (routing.share_prefix_cache) or for a key (its share_prefix_cache in the keys file), read per request
        self.policy = RoutePolicy(cfg.routing, per_key=functools.partial(keys.own_cache, shared_by_default=cfg.routing.share_prefix_cache))
        self.lifecycle = PoolLifecycle(cfg, backends, on_ready, on_down=self.policy.forget,
                                       on_cache=self.policy.adopt_engine_cache)
        self.pools = self.lifecycle.pools
        self.capacity = Capacity(self.pools)  # the pools' SLO and capacity gauges, computed as /metrics is read
        self.admission = Admission(cfg, self.pools, prompter, keys, self.off_loop)
        self.limiter = self.admission.limiter
        # per key from arrival, and the process's shared slots once a body is in (the app's KeySlots middleware counts)
        self.slots = Slots(cfg.limits, keys)
        self.kv_feeds: list = []  # the engines' KV-cache events, followed once started (routing.kv_events)
        self.responses = None  # the Responses API (responses_api.ResponsesAPI), set by create_app: serves kind "responses"
        self.dispatch = Dispatcher(self.pools, self.policy, self.limiter, self.admission.output_estimate,
                                   self.lifecycle.set_ready, self.lifecycle.retry_after)

    async def start(self) -> None:
        if self.policy.index is not None and self.cfg.routing.kv_events:  # subscribed before the engines publish
            self.kv_feeds = [self.policy.follow_kv_events(name, endpoint)
                             for name, pool in self.pools.items() for endpoint in pool.backend.kv_event_endpoints()]
        await self.lifecycle.start()

    async def stop(self) -> None:
        await self.lifecycle.stop()
        await asyncio.gather(*(asyncio.to_thread(feed.stop) for feed in self.kv_feeds))

    @property
    def started(self) -> bool:
        return self.lifecycle.started

    async def read_json(self, request: Request) -> object:
        return await self.admission.read_json(request)

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the CPU pool: the event loop keeps serving every other request meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, functools.partial(fn, *args))

    async def admit_and_route(self, data: object, kind: str, identity: str, size: int = 0,
                              charge: bool = True, charged: bool = False, live: bool = False) -> tuple[AdmittedRequest, Decision]:
        """Everything before the backend is called; raises APIError for any refusal (`live`: a pool's SLO may shed it)."""
        admitted = await self.admission.admit(data, kind, identity, size, charge, charged)
        try:
            return admitted, self.dispatch.choose(admitted, shed=live)
        except APIError:
            await self.admission.release(admitted)
            raise

    # ---- live requests ---------------------------------------------------------------------------
    async def handle(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        try:
            identity = self.admission.identify(request)
            data, size = await self.admission.read_body(request, identity)  # charged before it is decoded
            if (refusal := await self.slots.take(request)) is not None:  # a shared slot, once the body is in and charged
                return refusal
            admitted, decision = await self.admit_and_route(data, kind, identity, size, charged=True, live=True)
        except APIError as e:
            count_rejection(e, "live")
            return e.response()
        req, gen = admitted.request, admitted.generate
        metrics.labelled(metrics.route_decisions, decision.pool, decision.reason, "live").inc()
        metrics.for_pool(decision.pool, req.model).overhead.observe(time.perf_counter() - t0)
        stream = self.dispatch.stream(admitted, decision, t0)
        log.debug("request %s routed: %s", gen.request_id, decision.header(expose_reason=True))
        headers = {"x-swiftkv-route": decision.header(self.cfg.routing.expose_reason), "x-request-id": gen.request_id}
        if req.stream:
            first = await self.first_or_refusal(request, stream, admitted, headers)
            if isinstance(first, Response):
                return first
            return EventStream(sse_body(stream, first, admitted.render, admitted.prompt_tokens, req.include_usage, req.continuous_usage),
                               headers)
        try:
            status, body = await until_disconnect(request, collect(stream, admitted.render, admitted.prompt_tokens, self.off_loop,
                                                                   admitted.structured_param))
        except ClientGone:
            return Response(status_code=499)
        content = json_bytes(body) if small_answer(body) else await self.off_loop(json_bytes, body)  # up to limits.max_unstreamed_tokens
        return Response(content, status_code=status, headers=headers | (self.lifecycle.retry_after if status == 503 else {}),
                        media_type="application/json")

    async def first_or_refusal(self, request: Request, stream: AsyncIterator[Output], admitted: AdmittedRequest,
                               headers: dict[str, str], rename: Callable[[dict], dict] = lambda body: body) -> list[Output] | Response:
        """A streamed answer's outputs up to its first content, or the response that ends it there. The status line goes
        out with the first byte, so a request the engine refuses gets its real 4xx/5xx (its body through `rename`; a 503
        with Retry-After) instead of a 200 with an error event; a client gone meanwhile is a 499."""
        try:
            return await first_outputs(request, stream)
        except ClientGone:
            return Response(status_code=499)
        except (BackendError, BadRequest) as e:
            await stream.aclose()
            status, body = failure(e, admitted.structured_param)
            return JSONResponse(rename(body), status_code=status, headers=headers | (self.lifecycle.retry_after if status == 503 else {}))

    # ---- requests without HTTP (the Batch API) ---------------------------------------------------
    async def prepare(self, data: object, kind: str, source: str = "batch") -> ChatCompletionRequest | CompletionRequest:
        """An already-parsed body without HTTP (a Batch API line) -> the validated request; a refusal (a streamed
        request among them, before any charge) is an APIError, counted under `source`. Its tree is walked and validated
        on the CPU pool (a line's size is not known here, and may be that of a large body). A line retried after a
        429 passes what this returned to run_request, so its retries cost only the limiter call."""
        if kind == "responses":
            return await self.responses.prepare(data, source)
        try:
            return await self.off_loop(self._prepare, data, kind)
        except APIError as e:
            count_rejection(e, source)
            raise

    def _prepare(self, data: object, kind: str) -> ChatCompletionRequest | CompletionRequest:
        check_tree(data)
        req = self.admission.validate(data, kind)
        if req.stream:  # refused before the key is charged for a request it would not get
            raise bad_request("stream is not supported here", param="stream")
        return req

    async def run_request(self, data: object, kind: str, identity: str, *, source: str = "batch", priority: int = 0,
                          slot: Callable[[Decision], AbstractAsyncContextManager[Decision]] | None = None,
                          first_token: Callable[[], None] | None = None, route: str | None = None) -> tuple[int, dict]:
        """Serve one already-parsed, non-streamed request body (or what `prepare` made of it) without HTTP (the Batch
        API's lines): the same validation, token counting, routing, backends and metrics (labelled `source`) as live
        traffic, at the engine priority given (or the body's own, if later), charged to the key's per-minute limits
        (a 429 when over them, which the caller waits out). `slot(decision)` is entered once the route is decided and
        held while the engine works (the caller's bound on its own requests per pool); it may move the request to
        another pool: the decision it yields is the one served and counted. `first_token()` is called, in the
        calling task, when the first output token arrives. `route`: the API route the request came by, where it is not
        its kind's (the Responses API's chat requests)."""
        if kind == "responses":  # its chat request comes back through here
            return await self.responses.run_request(data, identity, source=source, priority=priority, slot=slot, first_token=first_token)
        try:
            req = data if isinstance(data, (ChatCompletionRequest, CompletionRequest)) else await self.prepare(data, kind, source)
        except APIError as e:  # counted by prepare
            return e.status, e.body()
        try:
            admitted, decision = await self.admit_and_route(req, kind, identity)
        except APIError as e:
            count_rejection(e, source)
            return e.status, e.body()
        admitted.generate.priority = max(priority, admitted.generate.priority)  # never ahead of the caller's (batch's)
        admitted.route = route or admitted.route
        async with slot(decision) if slot is not None else nullcontext(decision) as decision:
            metrics.labelled(metrics.route_decisions, decision.pool, decision.reason, source).inc()
            stream = self.dispatch.stream(admitted, decision, time.perf_counter(), source)
            if first_token is not None:
                stream = calling_on_first_token(stream, first_token)
            return await collect(stream, admitted.render, admitted.prompt_tokens, self.off_loop, admitted.structured_param)


class ClientGone(Exception):
    """The client disconnected while the gateway waited for the engine."""


async def first_outputs(request: Request, stream: AsyncIterator[Output]) -> list[Output]:
    """The stream's outputs up to the first with content (all of them if it ends first); the engine's
    refusal is raised from here. A client that leaves meanwhile aborts the request (ClientGone)."""
    outputs: list[Output] = []

    async def pull() -> None:
        while (out := await anext(stream, None)) is not None:
            outputs.append(out)
            if out.choices:
                return

    await until_disconnect(request, pull())
    return outputs


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work` while a watcher waits for the client to leave; if it does, `work` is cancelled (which
    closes the stream and aborts the engine request) and ClientGone is raised."""
    return await watching(request.receive, work)


async def watching(receive: Callable[[], Awaitable[dict]], work: Awaitable):
    """until_disconnect, on an ASGI `receive`."""
    current = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()


class EventStream(Response):
    """Server-sent events, sent as Starlette's StreamingResponse sends them; a client that leaves cancels the sending
    (closing `events`, which aborts the engine request). One watcher task per stream instead of StreamingResponse's anyio
    task group, whose cancel scopes cost more than the rest of a short answer's sending."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        async def send_all() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await watching(receive, send_all())
        except ClientGone:
            pass
        finally:
            await self.events.aclose()
