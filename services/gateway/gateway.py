"""Request handling: authenticate -> validate -> limit -> count tokens (off the event loop) -> route -> stream,
and the pools' lifecycle (start, health watch, recovery).

One public model name maps to the pools (routed by prompt/output ratio); each pool's own model name
bypasses routing. Every response carries `x-swiftkv-route: pool=...; reason=...; ratio=...`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, aclosing, nullcontext
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.serving.backend import Backend, BackendDown, BackendError, BadRequest, GenerateRequest, Output, SamplingOptions, UpstreamError
from services.serving.config import PlatformConfig

from . import constraints, metrics
from .auth import KeyStore, RateLimiter, RedisRateLimiter
from .errors import APIError, bad_request, error_body, sse_error
from .prompts import Prompter, max_model_len
from .render import ChatRender, Choice, CompletionRender, json_bytes, sse_event, usage_dict
from .routing import Decision, Ewma, NoPoolAvailable, PoolState, RoutePolicy
from .schemas import ChatCompletionRequest, CompletionRequest, check_tree, parse
from .tools import ToolCalls, parser_class

log = logging.getLogger("swiftkv.gateway")

REJECTION_REASONS = {
    "invalid_api_key": "auth",
    "rate_limit_exceeded": "rate_limit",
    "request_too_large": "body_too_large",
    "request_timeout": "body_timeout",
    "array_above_max_length": "bounds",
    "string_above_max_length": "bounds",
    "integer_above_max_value": "bounds",
    "context_length_exceeded": "prompt_too_long",
    "response_too_large": "bounds",
    "model_not_found": "unknown_model",
    "unavailable": "unavailable",
}


class Gateway:
    """Holds the pools and everything a request needs; the FastAPI app is a thin shell around it."""

    def __init__(self, cfg: PlatformConfig, backends: dict[str, Backend], prompter: Prompter, keys: KeyStore,
                 on_ready: Callable[[], None] | None = None, extra_metrics: Callable[[], Awaitable[str]] | None = None):
        self.cfg = cfg
        self.extra_metrics = extra_metrics  # engine metrics living elsewhere (Ray's metrics agent)
        self.prompter = prompter
        self.keys = keys
        self.on_ready = on_ready
        self.pools = {
            name: PoolState(name, backend, cfg.served_name(name), max_model_len(cfg.pools[name].model, cfg.pools[name].engine_args))
            for name, backend in backends.items()
        }
        self.models: dict[str, str | None] = {cfg.model: None} | {p.served_model_name: name for name, p in self.pools.items()}
        lens = [p.max_model_len for p in self.pools.values() if p.max_model_len]
        self.max_model_len = min(lens) if lens else None
        self.max_prompt_tokens = cfg.limits.max_prompt_tokens or (self.max_model_len - 1 if self.max_model_len else None)
        self.policy = RoutePolicy(cfg.routing)
        limits = (cfg.limits.requests_per_minute, cfg.limits.prompt_tokens_per_minute, cfg.limits.output_tokens_per_minute, keys.digests)
        self.limiter = RedisRateLimiter(cfg.redis_url, *limits) if cfg.redis_url else RateLimiter(*limits)
        self.output_estimate = Ewma(float(cfg.routing.default_output_estimate))
        # Work that grows with a request's body (templates, tokenization, tools, grammar checks, large answers)
        # runs here, never on the event loop, where it would stall every stream of the process (the tokenizer
        # and xgrammar release the GIL). Four threads: a small request finds one free beside a few huge ones;
        # more work waits its turn (requests are bounded by limits.max_concurrent_requests).
        self.cpu = ThreadPoolExecutor(max_workers=4, thread_name_prefix="swiftkv-cpu")
        self.check_constraints = constraints.checked_here(cfg)
        self._settling: set[asyncio.Task] = set()
        self.created = int(time.time())
        # A pool that is down is checked again within a health period: when to try again after a 503.
        self.retry_after = {"Retry-After": str(max(1, math.ceil(cfg.health.period_seconds)))}
        self.tool_parsers = {name: cfg.pools[name].tool_call_parser for name in self.pools}
        for parser in self.tool_parsers.values():
            if parser is not None:
                parser_class(parser)  # an unknown name fails at start, not on the first request with tools
        self._tasks: list[asyncio.Task] = []
        self.started = False  # the first start of every pool has been tried
        self._announced = False
        for name in self.pools:
            metrics.pool_ready.labels(name).set(0)
            metrics.in_flight.labels(name).set(0)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start pools one by one (engines compete for the same cores), then watch each one's health."""
        for pool in self.pools.values():
            try:
                await pool.backend.start()
                self._set_ready(pool, True)
            except BackendDown as e:  # not up yet (e.g. a Ray Serve application still deploying): the watcher retries
                log.warning("%s; the pool joins routing once its health check passes", e)
            except Exception:
                log.exception("pool %s failed to start; the other pool serves its traffic until it recovers", pool.name)
        # Everything loaded so far (torch, transformers, engines: ~10^6 objects) lives as long as the process.
        # Freezing it keeps the cyclic GC from re-scanning it: a full collection otherwise costs ~0.5 s on
        # two cores and, amortized, about as much CPU per request as the rest of the gateway.
        gc.collect()
        gc.freeze()
        self.started = True
        self._announce()
        self._tasks += [asyncio.create_task(self._watch(pool)) for pool in self.pools.values()]

    def _set_ready(self, pool: PoolState, ready: bool) -> None:
        if ready != pool.ready:
            log.log(logging.INFO if ready else logging.WARNING, "pool %s %s (%s)", pool.name,
                    "ready" if ready else "is down", pool.served_model_name)
        pool.ready = ready
        metrics.pool_ready.labels(pool.name).set(int(ready))

    def _announce(self) -> None:
        if self.on_ready is not None and self.ready and not self._announced:
            self._announced = True
            self.on_ready()

    async def _watch(self, pool: PoolState) -> None:
        """Check one pool every period: a failed check takes it out of routing and asks the backend to
        recover (a dead in-process engine is restarted); failed recoveries are retried with exponential
        backoff, and the pool rejoins routing once its check passes."""
        h = self.cfg.health
        delay = h.period_seconds
        while True:
            await asyncio.sleep(delay)
            try:
                healthy = await asyncio.wait_for(pool.backend.health(), timeout=h.timeout_seconds)
            except Exception:  # a hung or failing health check means the pool is down, not the gateway
                healthy = False
            self._set_ready(pool, healthy)
            if healthy:
                delay = h.period_seconds
                self._announce()
                continue
            try:
                await pool.backend.recover()
                delay = h.period_seconds
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = min(max(delay, h.period_seconds) * 2, h.max_backoff_seconds)
                log.warning("pool %s: recovery failed (%s: %s); next attempt in %.0f s", pool.name, type(e).__name__, e, delay)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for pool in self.pools.values():
            try:
                await pool.backend.stop()
            except Exception:
                log.exception("stopping pool %s", pool.name)

    @property
    def ready(self) -> bool:
        return all(p.ready for p in self.pools.values())

    @property
    def serving(self) -> bool:
        """Every pool's first start was tried and at least one pool can serve (readiness)."""
        return self.started and any(p.ready for p in self.pools.values())

    # ---- request preparation ---------------------------------------------------------------------
    async def read_json(self, request: Request) -> object:
        return (await self.read_body(request))[0]

    async def read_body(self, request: Request) -> tuple[object, int]:
        """The body as JSON, and its size in bytes: more than limits.max_body_bytes is a 413 (refused from
        Content-Length before reading when declared), a body still arriving after limits.body_timeout_seconds
        a 408; both close the connection (the rest of the body is never read). JSON that nests too deeply or
        holds a lone surrogate is a 400 (`check_tree`)."""
        limits = self.cfg.limits
        limit = limits.max_body_bytes
        close = {"Connection": "close"}
        declared = request.headers.get("content-length")
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes; the limit is {limit} bytes (limits.max_body_bytes)",
                           code="request_too_large", headers=close)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(limits.body_timeout_seconds):
                async for chunk in request.stream():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"request body exceeds the limit of {limit} bytes (limits.max_body_bytes)",
                                       code="request_too_large", headers=close)
        except TimeoutError:
            raise APIError(408, f"request body not received within {limits.body_timeout_seconds:g} s "
                                f"(limits.body_timeout_seconds)", code="request_timeout", headers=close) from None
        body = b"".join(chunks)
        try:
            text = body.decode(json.detect_encoding(body))  # what json.loads(bytes) would decode
            data = json.loads(text)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise bad_request(f"malformed JSON body: {e}", code="invalid_json")
        except RecursionError:
            raise bad_request("the JSON body nests objects and arrays too deeply", code="invalid_json")
        check_tree(data, text)
        return data, size

    def resolve_model(self, name: str) -> str | None:
        if name not in self.models:
            raise APIError(404, f"the model '{name}' does not exist; available: {', '.join(self.models)}",
                           param="model", code="model_not_found")
        return self.models[name]

    def output_tokens(self, prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """max_tokens for the engine: what the client asked for, or what fits in the context."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; the limit is {self.max_prompt_tokens} tokens",
                           param=prompt_param, code="context_length_exceeded")
        if self.max_model_len is None:
            return requested or self.cfg.routing.default_output_estimate
        room = self.max_model_len - prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens and leaves no room to answer in this model's "
                                f"maximum context length of {self.max_model_len} tokens", param=prompt_param,
                           code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens: the prompt has "
                                f"{prompt_tokens} and max_tokens asks for {requested}", param="max_tokens",
                           code="context_length_exceeded")
        return requested or room

    # ---- serving ---------------------------------------------------------------------------------
    async def tracked(self, pool: PoolState, model: str, request: GenerateRequest, t0: float, identity: str,
                      reserved: int | None, estimate_output: bool, source: str = "live") -> AsyncIterator[Output]:
        """The backend's stream with the gateway's bookkeeping: metrics, backlog, estimates, limits."""
        prompt_tokens = len(request.prompt_token_ids)
        m = metrics.for_pool(pool.name, model, source)
        m.in_flight.inc()
        m.prompt_tokens.inc(prompt_tokens)
        pool.dispatched(prompt_tokens)
        live = source == "live"
        if live:  # batch work yields to live traffic on this pool until it has been quiet a while (services/batch)
            pool.live_started()
        first_at = None
        generated = 0
        status = "error"
        try:
            async with aclosing(pool.backend.generate(request)) as stream:
                async for out in stream:
                    n = sum(c.num_tokens for c in out.choices)
                    if first_at is None and n:
                        first_at = time.perf_counter()
                        pool.first_token(prompt_tokens, first_at - t0)
                        m.ttft.observe(first_at - t0)
                    if out.queue_seconds is not None:
                        m.queue.observe(out.queue_seconds)
                    generated += n
                    yield out
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            # No client waits on a batch request: only the batch runner stops one (preempted, cancelled, expired).
            status = "client_disconnect" if live else "aborted"
            raise
        except BackendDown:
            # The pool cannot serve (engine dead, server unreachable): route around it now; the health
            # watcher brings it back once it answers. A failure of one request leaves the pool in routing.
            self._set_ready(pool, False)
            raise
        finally:
            end = time.perf_counter()
            if live:
                pool.live_ended()
            if first_at is None:
                pool.first_token(prompt_tokens, 0.0)
            m.in_flight.dec()
            m.requests[status].inc()
            m.generation_tokens.inc(generated)
            m.e2e.observe(end - t0)
            per_choice = generated / max(request.sampling.n, 1)
            if first_at is not None and per_choice > 1:
                m.tpot.observe((end - first_at) / (per_choice - 1))
            if status == "ok" and estimate_output:
                self.output_estimate.update(per_choice)
            if reserved is not None:  # charge what was generated, beyond the reservation too
                self.settle_later(identity, reserved, generated)

    def settle_later(self, identity: str, reserved: int, generated: int) -> None:
        """Settle an output reservation in a task of its own: it completes even while the request's own task
        is being cancelled (the client left), and the end of an answer never waits on Redis."""
        task = asyncio.get_running_loop().create_task(self.limiter.settle(identity, reserved, generated))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def retried(self, decision, model: str, request: GenerateRequest, t0: float, identity: str,
                      reserved: int | None, estimate_output: bool, source: str = "live") -> AsyncIterator[Output]:
        """`tracked` on the decided pool; if that pool goes down (BackendDown) before any token went out,
        the request is tried once more on another ready pool (not for a pinned pool). The first attempt's
        reservation was settled at 0 by `tracked`, so the retry is charged again (without a 429 check:
        the request was already admitted)."""
        sent = False
        try:
            async with aclosing(self.tracked(self.pools[decision.pool], model, request, t0, identity, reserved,
                                             estimate_output, source)) as stream:
                async for out in stream:
                    if any(c.num_tokens or c.text for c in out.choices):
                        sent = True
                    yield out
            return
        except BackendDown as e:
            if sent or decision.reason == "pinned":
                raise
            first_error = e
        try:
            again = self.policy.decide(len(request.prompt_token_ids), request.sampling.max_tokens, self.pools)
        except NoPoolAvailable:
            raise first_error from None
        if again.pool == decision.pool:
            raise first_error
        log.warning("pool %s failed before the first token of %s; retrying on pool %s", decision.pool,
                    request.request_id, again.pool)
        metrics.retries.labels(decision.pool, again.pool).inc()
        if reserved is not None:
            await self.limiter.charge(identity, reserved)
        retry = dataclasses.replace(request, request_id=f"{request.request_id}-r")
        async with aclosing(self.tracked(self.pools[again.pool], model, retry, t0, identity, reserved,
                                         estimate_output, source)) as stream:
            async for out in stream:
                yield out

    async def prepare(self, request: Request, kind: str):
        """Everything before dispatch; raises APIError for any refusal."""
        identity = self.keys.identify(request.headers.get("authorization"))
        data, size = await self.read_body(request)
        return await self.prepare_body(data, kind, identity, size)

    async def prepare_body(self, data: object, kind: str, identity: str, size: int = 0, charge: bool = True):
        """A parsed body -> what dispatch needs. The checks that cost little run first; then the key is charged
        (the request, `size` (the body's bytes, an upper bound of its prompt tokens) and the expected output)
        before the work that grows with the body (`build_prompt`) runs on the CPU pool; the prompt tokens are
        then settled to their exact count. `charge=False` leaves the per-minute limits alone."""
        if kind == "chat":
            req = parse(ChatCompletionRequest, data)
            self.check_bounds(req)
            logprobs = req.logprobs_k()
        else:
            req = parse(CompletionRequest, data)
            self.check_bounds(req)
            if req.suffix is not None:
                raise bad_request("suffix is not supported (no model served here is trained for fill-in-the-middle)", param="suffix")
            if req.echo and req.logprobs is not None:
                raise bad_request("echo with logprobs needs the prompt's logprobs, which the engines here do not give "
                                  "(SwiftKV skips the later layers for prompt tokens)", param="echo")
            logprobs = req.logprobs_k()
        pinned = self.resolve_model(req.model)
        self.check_token_ids(req)
        requested = req.output_limit()
        reserved = (requested or max(1, round(self.output_estimate.value))) * req.n if charge else None  # None: not charged
        if reserved is not None:
            await self.limiter.acquire(identity, size, reserved)
        try:
            tools, prompt_ids, echo, structured, structured_param = await self.off_loop(self.build_prompt, req, kind, pinned)
            max_tokens = self.output_tokens(len(prompt_ids), requested, "messages" if kind == "chat" else "prompt")
            if req.min_tokens > max_tokens:
                raise bad_request(f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
            self.check_answer_size(req, max_tokens, logprobs)
            expected = requested or max(1, min(max_tokens, round(self.output_estimate.value)))
            if reserved is not None:
                await self.limiter.settle(identity, size, len(prompt_ids), kind="prompt_tokens")
                if expected * req.n < reserved:  # less room in the context than the estimate reserved
                    await self.limiter.settle(identity, reserved, expected * req.n)
                    reserved = expected * req.n
            decision = self.policy.decide(len(prompt_ids), expected, self.pools, pinned)
        except (APIError, NoPoolAvailable) as e:
            if reserved is not None:  # the output reservation comes back; the request and its prompt stay charged
                await self.limiter.settle(identity, reserved, 0)
            if isinstance(e, NoPoolAvailable):
                raise APIError(503, f"{e}; try again shortly", "server_error", code="unavailable", headers=self.retry_after) from None
            raise
        sampling = SamplingOptions(
            max_tokens=max_tokens, n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
            stop=req.stops(), logprobs=logprobs, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, ignore_eos=req.ignore_eos, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, stop_token_ids=list(req.stop_token_ids or []),
            skip_special_tokens=req.skip_special_tokens if tools is None or tools.skip_special_tokens is None else tools.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=req.logit_bias_ids(), structured=structured,
        )
        gen = GenerateRequest(secrets.token_hex(12), prompt_ids, sampling, priority=req.priority)
        render = ChatRender if kind == "chat" else CompletionRender
        r = render(gen.request_id, req.model, int(time.time()), req.n, logprobs is not None, tools, echo)
        r.structured_param = structured_param  # the field an engine's refusal of the constraint is about
        return identity, req, gen, decision, reserved, requested is None, r

    def build_prompt(self, req: ChatCompletionRequest | CompletionRequest, kind: str, pinned: str | None):
        """The work that grows with the body, on the CPU pool: tools, the structured-output constraint's
        check, chat template and tokenization -> (tools, prompt ids, echo, constraint, its request field)."""
        tools = None
        if kind == "chat":
            if req.tool_mode() is not None:
                tools = self.tool_calls(req, pinned)
            prompt_ids = self.prompter.chat(req)
            role = "assistant" if req.add_generation_prompt else req.messages[-1].role
            echo = req.messages[-1].text() if req.echo and req.messages[-1].role == role else ""
        else:
            prompt_ids = self.prompter.completion(req)
            echo = ""
            if req.echo:
                prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)) else req.prompt
                echo = prompt if isinstance(prompt, str) else self.prompter.decode(prompt)
        structured, structured_param = req.structured()
        if tools is not None and tools.structured is not None:
            structured, structured_param = tools.structured, "tools"
        if structured is not None and self.check_constraints:
            constraints.check(structured, structured_param)
        return tools, prompt_ids, echo, structured, structured_param

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the CPU pool: the event loop keeps serving every other request meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, functools.partial(fn, *args))

    def check_answer_size(self, req, max_tokens: int, logprobs: int | None) -> None:
        """A non-streamed answer is held whole in the gateway until it is sent (about 0.6 KB per token and per
        top logprob): n * max_tokens * (1 + top logprobs) is bounded by limits.max_unstreamed_tokens."""
        limit = self.cfg.limits.max_unstreamed_tokens
        size = req.n * max_tokens * (1 + (logprobs or 0))
        if req.stream or limit is None or size <= limit:
            return
        tokens = f"max_tokens {max_tokens}" if req.output_limit() else f"max_tokens unset ({max_tokens} tokens left in the context)"
        raise APIError(400, f"a non-streamed answer of n {req.n} x {tokens} x (1 + {logprobs or 0} top logprobs) may hold "
                            f"{size} tokens and logprobs; the limit is {limit} (limits.max_unstreamed_tokens): stream it "
                            "(stream: true), or lower n, max_tokens or the top logprobs", param="max_tokens",
                       code="response_too_large")

    def tool_calls(self, req: ChatCompletionRequest, pinned: str | None) -> ToolCalls:
        """The request's tools with the parser of the pool(s) it may go to (every one must have the same)."""
        parsers = {self.tool_parsers[name] for name in ([pinned] if pinned else self.pools)}
        parser = parsers.pop() if len(parsers) == 1 else None
        if parser is None and req.tool_mode() == "auto" and len(parsers) > 0:
            raise bad_request(f"the pools behind {req.model!r} use different tool-call parsers; send the request to one "
                              "pool's own model name", param="model")
        return ToolCalls(req, parser, self.prompter.tokenizer)

    def check_bounds(self, req) -> None:
        """The configurable bounds (config `limits`) on what a parsed request holds: a 400 naming the field,
        the value and the limit, with OpenAI's codes for them."""
        lim = self.cfg.limits

        def too_many(param: str, have: int, limit: int, what: str, setting: str) -> None:
            if have > limit:
                raise APIError(400, f"{param} has {have} {what}; the limit is {limit} (limits.{setting})",
                               param=param, code="array_above_max_length")

        too_many("messages", len(getattr(req, "messages", None) or ()), lim.max_messages, "messages", "max_messages")
        too_many("tools", len(getattr(req, "tools", None) or ()), lim.max_tools, "tools", "max_tools")
        too_many("logit_bias", len(getattr(req, "logit_bias", None) or {}), lim.max_logit_bias, "entries", "max_logit_bias")
        if hasattr(req, "stop"):
            stops = req.stops()
            too_many("stop", len(stops), lim.max_stop_sequences, "sequences", "max_stop_sequences")
            for i, s in enumerate(stops):
                if len(s) > lim.max_stop_chars:
                    raise APIError(400, f"stop sequence {i} has {len(s)} characters; the limit is {lim.max_stop_chars} "
                                        "(limits.max_stop_chars)", param="stop", code="string_above_max_length")
        n = getattr(req, "n", 1)
        if n > lim.max_n:
            raise APIError(400, f"n is {n}; the limit is {lim.max_n} (limits.max_n)", param="n", code="integer_above_max_value")

    def check_token_ids(self, req) -> None:
        """Token ids in stop_token_ids and logit_bias must be in the vocabulary (the engine fails on others)."""
        vocab = self.prompter.vocab_size
        for param, ids in (("stop_token_ids", req.stop_token_ids or []), ("logit_bias", [int(k) for k in req.logit_bias or {}])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"{param}: token id {bad[0]} is not in the vocabulary [0, {vocab})", param=param)

    async def handle(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        try:
            identity, req, gen, decision, reserved, estimate, r = await self.prepare(request, kind)
        except APIError as e:
            metrics.rejections.labels(REJECTION_REASONS.get(e.code or "", "invalid_request"), "live").inc()
            return e.response()
        metrics.route_decisions.labels(decision.pool, decision.reason, "live").inc()
        metrics.for_pool(decision.pool, req.model).overhead.observe(time.perf_counter() - t0)
        stream = self.retried(decision, req.model, gen, t0, identity, reserved, estimate)
        headers = {"x-swiftkv-route": decision.header(), "x-request-id": gen.request_id}
        if req.stream:
            # The status line goes out with the first byte: wait for the first output (or the error), so a
            # request the engine refuses gets its real 4xx/5xx instead of a 200 with an error event.
            try:
                first = await self.first_outputs(request, stream)
            except ClientGone:
                return Response(status_code=499)
            except (BackendError, BadRequest) as e:
                await stream.aclose()
                status, body = failure(e, r.structured_param)
                return JSONResponse(body, status_code=status, headers=headers | (self.retry_after if status == 503 else {}))
            return StreamingResponse(self.sse(stream, first, r, len(gen.prompt_token_ids), req.include_usage, req.continuous_usage),
                                     media_type="text/event-stream", headers=headers)
        return await self.complete(request, stream, r, len(gen.prompt_token_ids), headers, r.structured_param)

    async def first_outputs(self, request: Request, stream: AsyncIterator[Output]) -> list[Output]:
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

    async def run_request(self, data: object, kind: str, identity: str, *, source: str = "batch", priority: int = 0,
                          slot: Callable[[Decision], AbstractAsyncContextManager[Decision]] | None = None,
                          first_token: Callable[[], None] | None = None) -> tuple[int, dict]:
        """Serve one already-parsed, non-streamed request body without HTTP (the Batch API's lines): the same
        validation, token counting, routing, backends and metrics (labelled `source`) as live traffic, at
        the engine priority given, charged to the key's per-minute limits (a 429 when over them, which the
        caller waits out). `slot(decision)` is entered once the route is decided and held while the engine
        works (the caller's bound on its own requests per pool); it may move the request to another pool: the
        decision it yields is the one served and counted. `first_token()` is called, in the calling task,
        when the first output token arrives."""
        try:
            check_tree(data)
            _, req, gen, decision, reserved, estimate, r = await self.prepare_body(data, kind, identity)
            if req.stream:
                raise bad_request("stream is not supported here", param="stream")
        except APIError as e:
            metrics.rejections.labels(REJECTION_REASONS.get(e.code or "", "invalid_request"), source).inc()
            return e.status, e.body()
        gen.priority = priority
        async with slot(decision) if slot is not None else nullcontext(decision) as decision:
            metrics.route_decisions.labels(decision.pool, decision.reason, source).inc()
            stream = self.retried(decision, req.model, gen, time.perf_counter(), identity, reserved, estimate, source)
            if first_token is not None:
                stream = calling_on_first_token(stream, first_token)
            return await self.collect(stream, r, len(gen.prompt_token_ids), r.structured_param)

    async def collect(self, stream: AsyncIterator[Output], r, prompt_tokens: int, structured_param: str | None = None) -> tuple[int, dict]:
        """A whole (non-streamed) answer: (status, OpenAI body)."""
        choices = [Choice() for _ in range(r.n)]
        try:
            async with aclosing(stream) as s:
                async for out in s:
                    for c in out.choices:
                        ch = choices[c.index]
                        ch.text.append(c.text)
                        ch.tokens += c.num_tokens
                        ch.finish_reason = c.finish_reason or ch.finish_reason
                        if c.logprobs:
                            ch.logprobs.extend(c.logprobs)
        except (BadRequest, BackendError) as e:
            return failure(e, structured_param)
        completion_tokens = sum(c.tokens for c in choices)
        return 200, await self.off_loop(r.full, choices, usage_dict(prompt_tokens, completion_tokens))

    async def complete(self, request: Request, stream: AsyncIterator[Output], r, prompt_tokens: int, headers,
                       structured_param: str | None = None) -> Response:
        try:
            status, body = await until_disconnect(request, self.collect(stream, r, prompt_tokens, structured_param))
        except ClientGone:
            return Response(status_code=499)
        content = await self.off_loop(json_bytes, body)  # up to limits.max_unstreamed_tokens of it
        return Response(content, status_code=status, headers=headers | (self.retry_after if status == 503 else {}),
                        media_type="application/json")

    async def sse(self, stream: AsyncIterator[Output], first: list[Output], r, prompt_tokens: int,
                  include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
        """The SSE body after `first_outputs`: errors from here on can only be events in the stream."""
        completion_tokens = 0

        async def outputs():
            for out in first:
                yield out
            async for out in stream:
                yield out

        try:
            async with aclosing(stream):
                for chunk in r.start():
                    yield sse_event(chunk, include_usage, usage_dict(prompt_tokens, 0) if continuous_usage else None)
                async for out in outputs():
                    completion_tokens += sum(c.num_tokens for c in out.choices)
                    chunk = r.chunk(out)
                    if chunk["choices"]:  # choices whose text is held back (a tool call taking shape) send nothing
                        yield sse_event(chunk, include_usage, usage_dict(prompt_tokens, completion_tokens) if continuous_usage else None)
        except (BadRequest, BackendError) as e:
            status, body = failure(e)
            yield sse_error(body["error"]["message"], body["error"]["type"], body["error"]["code"])
            yield b"data: [DONE]\n\n"  # the stream still ends the way clients expect, never left hanging
            return
        if include_usage:
            yield sse_event(r.usage_chunk(usage_dict(prompt_tokens, completion_tokens)), False)
        yield b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected while the gateway waited for the engine."""


async def calling_on_first_token(stream: AsyncIterator[Output], callback: Callable[[], None]) -> AsyncIterator[Output]:
    async with aclosing(stream) as s:
        waiting = True
        async for out in s:
            if waiting and any(c.num_tokens for c in out.choices):
                waiting = False
                callback()
            yield out


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work` while a watcher waits for the client to leave; if it does, `work` is cancelled (which
    closes the stream and aborts the engine request) and ClientGone is raised."""
    current = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
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


def failure(e: BadRequest | BackendError, structured_param: str | None = None) -> tuple[int, dict]:
    """A request the engine refused or failed: (status, OpenAI error body). Only a pool that is down is a
    503 (retry elsewhere or later); one request's failure is a 500. An engine's refusal of a request with
    structured output that is about its constraint (a schema the backend cannot compile) names that field."""
    if isinstance(e, BadRequest):
        param = structured_param if structured_param and _about_structured_output(str(e)) else None
        return 400, error_body(str(e) if param is None else f"{param}: {e}", param=param)
    if isinstance(e, UpstreamError):  # a remote server's own answer, passed on as it came
        return e.status, error_body(e.message, e.type, e.param, e.code)
    log.warning("%s", e)
    if isinstance(e, BackendDown):
        return 503, error_body("the engine failed to serve this request; try again", "server_error", code="unavailable")
    return 500, error_body("the engine failed to serve this request", "server_error")


def _about_structured_output(message: str) -> bool:
    m = message.lower()
    return any(w in m for w in ("schema", "grammar", "regex", "structured", "json", "xgrammar", "guidance", "outlines", "choice"))
