"""Admission: everything a generation request goes through before it is routed. The key is identified, the body
read within its bounds (size, time), the key charged the request and the body's bytes, the body decoded (JSON depth)
and validated against the schemas and the configured bounds (`limits`), off the event loop when large, its output
reserved against the key's per-minute limits, and its prompt built and counted off the event loop.
The result is an `AdmittedRequest`; any refusal is an APIError in OpenAI's envelope."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from fastapi import Request

from services.common.bodies import BodyLimits, decode, receive
from services.common.errors import APIError, bad_request
from services.common.keys import KeyStore
from services.config import RENAMED_POOLS, PlatformConfig
from services.serving.backend import GenerateRequest

from . import constraints, metrics
from .prompts import BATCHED_PROMPTS, Prompter
from .rate_limits import RateLimiter, RedisRateLimiter
from .render import ChatRender, CompletionRender, Renderer
from .routing import Ewma, PoolState, speculation_excluded
from .schemas import MAX_INT32, ChatCompletionRequest, CompletionRequest, parse
from .slots import TICKET
from .tools import ToolCalls, parser_class

# APIError codes -> the `reason` label of swiftkv_requests_rejected (others: invalid_request)
REJECTION_REASONS = {
    "invalid_api_key": "auth",
    "rate_limit_exceeded": "rate_limit",
    "request_too_large": "body_too_large",
    "request_timeout": "body_timeout",
    "array_above_max_length": "bounds",
    "string_above_max_length": "bounds",
    "integer_above_max_value": "bounds",
    "integer_below_min_value": "bounds",
    "context_length_exceeded": "prompt_too_long",
    "response_too_large": "bounds",
    "model_not_found": "unknown_model",
    "unavailable": "unavailable",
    "overloaded": "overloaded",  # a pool's SLO shed it (pools.<name>.slo.max_queue_seconds)
}


def count_rejection(error: APIError, source: str) -> None:
    metrics.rejections.labels(REJECTION_REASONS.get(error.code or "", "invalid_request"), source).inc()


# Bodies up to this size are decoded and validated on the event loop (a few ms at worst: 16 kB of tiny arrays); larger
# ones on the CPU pool (a hop of tens of microseconds), so up to limits.max_body_bytes of JSON (1 MB of tiny arrays:
# 250 ms of decoding and checks) never stalls the other streams for the whole of it.
SMALL_BODY_BYTES = 16 * 1024
# A prompt from a body up to this size is built (template, tokenization) on the event loop: at most a few hundred
# tokens, well under the cost of the hop to the CPU pool and back (which also wakes a thread per request); larger ones there.
SMALL_PROMPT_BYTES = 2 * 1024


def too_many(param: str, have: int, limit: int, what: str, setting: str) -> None:
    if have > limit:
        raise APIError(400, f"{param} has {have} {what}; the limit is {limit} (limits.{setting})",
                       param=param, code="array_above_max_length")


class OutputEstimates:
    """Output tokens per choice expected of a request without max_tokens, per key and model name: the moving average
    of that key's answers on that model that ran to their own end, so a key's answers move only its own. At most
    `size` are kept, the least recently used forgotten (back to `default`)."""

    def __init__(self, default: float, size: int = 10_000):
        self.default, self.size = default, size
        self.values: OrderedDict[tuple[str, str], Ewma] = OrderedDict()

    def __len__(self) -> int:
        return len(self.values)

    def get(self, identity: str, model: str) -> float:
        ewma = self.values.get((identity, model))
        if ewma is None:
            return self.default
        self.values.move_to_end((identity, model))
        return ewma.value

    def update(self, identity: str, model: str, output: float, max_output: int) -> None:
        """An answer of `output` tokens per choice to a request that could have had `max_output` (what a backend
        reports past that, or an empty answer, moves the estimate no further than the request's bounds)."""
        key = (identity, model)
        ewma = self.values.get(key) or Ewma(self.default)
        ewma.update(min(max(output, 1), max(max_output, 1)))
        self.values[key] = ewma
        self.values.move_to_end(key)
        if len(self.values) > self.size:
            self.values.popitem(last=False)


@dataclass
class AdmittedRequest:
    """A validated, charged and tokenized request, with what dispatch and rendering need of it."""

    identity: str  # the key's digest ("anonymous" without keys)
    request: ChatCompletionRequest | CompletionRequest
    generate: GenerateRequest  # what the backend gets: prompt token ids and sampling options
    pinned: str | None  # the pool asked for by its own model name; None: routed
    expected_output: int  # output tokens per choice expected: what routing weighs, for the first choice and a retry
    reserved: int | None  # output tokens reserved against the key's limit; None: not charged
    estimate_output: bool  # no max_tokens: the answer's length updates the output estimate
    render: Renderer
    structured_param: str | None  # the request field its constraint came from: an engine's refusal names it
    route: str = "chat"  # the API route it came in by (chat, completions, responses): the latency metrics' `route` label

    @property
    def prompt_tokens(self) -> int:
        return len(self.generate.prompt_token_ids)


class Admission:
    """The checks and accounting before routing, with what they need: the served model names, the context length,
    the per-key limiter and the output estimate."""

    def __init__(self, cfg: PlatformConfig, pools: dict[str, PoolState], prompter: Prompter, keys: KeyStore,
                 off_loop: Callable[..., Awaitable]):
        self.cfg = cfg
        self.pools = pools
        self.prompter = prompter
        self.keys = keys
        self.off_loop = off_loop  # runs work that grows with the body on the gateway's CPU pool
        self.models: dict[str, str | None] = {cfg.model: None} | {p.served_model_name: name for name, p in pools.items()}
        lens = [p.max_model_len for p in pools.values() if p.max_model_len]
        self.max_model_len = min(lens) if lens else None
        self.max_prompt_tokens = cfg.limits.max_prompt_tokens or (self.max_model_len - 1 if self.max_model_len else None)
        # `keys` itself, read per request: a reload of the keys file changes a key's limits from its next request
        limits = (cfg.limits.requests_per_minute, cfg.limits.prompt_tokens_per_minute, cfg.limits.output_tokens_per_minute, keys)
        self.limiter = RedisRateLimiter(cfg.redis_url, *limits, prefix=cfg.redis_prefix) if cfg.redis_url else RateLimiter(*limits)
        # Output tokens per choice of the answers that ran to their own end: what a request without max_tokens expects.
        self.output_estimate = OutputEstimates(float(cfg.routing.default_output_estimate))
        self.check_constraints = constraints.checked_here(cfg)
        self.tool_parsers = {name: cfg.pools[name].tool_call_parser for name in pools}
        for parser in self.tool_parsers.values():
            if parser is not None:
                parser_class(parser)  # an unknown name fails at start, not on the first request with tools

    def identify(self, request: Request) -> str:
        ticket = request.scope.get(TICKET)  # identified on arrival, where the key's requests are counted (slots.py)
        return ticket[0] if ticket is not None else self.keys.identify(request.headers.get("authorization"))

    # ---- the body --------------------------------------------------------------------------------
    async def read_json(self, request: Request) -> object:
        return (await self.read_body(request))[0]

    async def read_body(self, request: Request, identity: str | None = None) -> tuple[object, int]:
        """The body as JSON, and its size in bytes: more than limits.max_body_bytes is a 413 (refused from
        Content-Length before reading when declared), a body still arriving after limits.body_timeout_seconds
        a 408; both close the connection (the rest of the body is never read). JSON that nests too deeply or
        holds a lone surrogate is a 400 (`check_tree`). With `identity`, the key is charged the request and the
        body's bytes (its prompt tokens' upper bound) before the body is decoded: a key over its limits gets its
        429 at no parse cost, and the charge stays if the body is refused (the gateway did that work for it);
        admit(charged=True) then settles the prompt tokens to their count. A body above SMALL_BODY_BYTES is
        decoded on the CPU pool."""
        limits = self.cfg.limits
        body = await receive(request, BodyLimits(limits.max_body_bytes, limits.body_timeout_seconds))  # services.common.bodies
        size = len(body)
        if identity is not None:
            await self.limiter.acquire(identity, size, 0)
        return await self.by_size(size, decode, body), size

    async def by_size(self, size: int, fn, *args):
        """`fn(*args)` for a body of `size` bytes: here for a small one (the hop to the CPU pool would cost more), on
        the CPU pool for a large one or one of unknown size (0), where its cost holds no other request's stream."""
        return fn(*args) if 0 < size <= SMALL_BODY_BYTES else await self.off_loop(fn, *args)

    # ---- checks ----------------------------------------------------------------------------------
    def check_speculation(self, req: ChatCompletionRequest | CompletionRequest, pinned: str | None) -> None:
        """logit_bias and min_p need an engine without speculative decoding (vLLM refuses them with it): a 400 naming the
        field where no pool the request may go to has one; routing sends it to one that does (routing.py)."""
        param = speculation_excluded(req)
        if param is None or not all(self.pools[name].speculative for name in ([pinned] if pinned else self.pools)):
            return
        plain = [self.pools[name].served_model_name for name in self.pools if not self.pools[name].speculative]
        where = (f"model '{req.model}' runs speculative decoding" if pinned else "every pool here runs speculative decoding")
        fix = (f"send it to model '{self.cfg.model}' (routed to a pool without speculation) or '{plain[0]}'" if plain else
               "an operator serves it by turning speculation off on one pool (pools.<name>.speculative: {method: none})")
        raise bad_request(f"{param} is not served here: {where}, under which vLLM refuses logit_bias and min_p; {fix}",
                          param=param)

    def resolve_model(self, name: str) -> str | None:
        """The pool a model name pins (None: the public name, routed); a 404 for a name not served here."""
        if name not in self.models:
            public = self.cfg.model
            renamed = {f"{public}-{old}": f"{public}-{new}" for old, new in RENAMED_POOLS.items()}.get(name)
            hint = f" ('{name}' was renamed to '{renamed}')" if renamed in self.models else ""
            raise APIError(404, f"the model '{name}' does not exist{hint}; available: {', '.join(self.models)}",
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

    def check_bounds(self, req) -> None:
        """The configurable bounds (config `limits`) on what a parsed request holds: a 400 naming the field,
        the value and the limit, with OpenAI's codes for them."""
        lim = self.cfg.limits
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

    def check_sizes(self, data: object, kind: str) -> None:
        """The bounded lists of a body, counted on the decoded body before the schema validates every item of them
        (pydantic's one call holds the GIL throughout, wherever it runs: 1 MB of content parts, batched prompts or
        logit_bias entries took 13 to 150 ms): messages, the content parts and tool calls of all the messages
        (limits.max_content_parts), tools, logit_bias, stop, and a completion's batched prompts."""
        if not isinstance(data, dict):
            return  # parse() says what is wrong
        lim = self.cfg.limits
        for param, setting, what in (("messages", "max_messages", "messages"), ("tools", "max_tools", "tools"),
                                     ("logit_bias", "max_logit_bias", "entries"), ("stop", "max_stop_sequences", "sequences")):
            if isinstance(data.get(param), (list, dict)):
                too_many(param, len(data[param]), getattr(lim, setting), what, setting)
        if isinstance(data.get("messages"), list):
            parts = sum(len(m[k]) for m in data["messages"] if isinstance(m, dict)
                        for k in ("content", "tool_calls") if isinstance(m.get(k), list))
            too_many("messages", parts, lim.max_content_parts, "content parts and tool calls", "max_content_parts")
        prompt = data.get("prompt")
        if kind != "chat" and isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            raise bad_request(BATCHED_PROMPTS, param="prompt")

    def validate(self, data: object, kind: str) -> ChatCompletionRequest | CompletionRequest:
        """A decoded body -> the request, within the configured bounds (on the CPU pool for a large body)."""
        self.check_sizes(data, kind)
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, data)
        self.check_bounds(req)
        return req

    def check_priority(self, req, identity: str) -> None:
        """A request may ask to run later than live traffic (priority above 0), never ahead of it, unless the key's
        min_priority (keys file) lets it: lower runs first on every engine, ahead of every other tenant's requests."""
        lowest = self.keys.min_priority(identity)
        if req.priority < lowest:
            raise APIError(400, f"priority {req.priority} is not allowed for this key: it must be from {lowest} to "
                                f"{MAX_INT32} (lower runs first; an operator may allow lower with min_priority in "
                                "the keys file)", param="priority", code="integer_below_min_value")

    def check_token_ids(self, req) -> None:
        """Token ids in stop_token_ids and logit_bias must be in the vocabulary (the engine fails on others)."""
        vocab = self.prompter.vocab_size
        for param, ids in (("stop_token_ids", req.stop_token_ids or []), ("logit_bias", [int(k) for k in req.logit_bias or {}])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"{param}: token id {bad[0]} is not in the vocabulary [0, {vocab})", param=param)

    def tool_calls(self, req: ChatCompletionRequest, pinned: str | None) -> ToolCalls:
        """The request's tools with the parser of the pool(s) it may go to (every one must have the same)."""
        parsers = {self.tool_parsers[name] for name in ([pinned] if pinned else self.pools)}
        parser = parsers.pop() if len(parsers) == 1 else None
        if parser is None and req.tool_mode() == "auto" and len(parsers) > 0:
            raise bad_request(f"the pools behind {req.model!r} use different tool-call parsers; send the request to one "
                              "pool's own model name", param="model")
        return ToolCalls(req, parser, self.prompter.tokenizer)

    # ---- admission -------------------------------------------------------------------------------
    async def admit(self, data: object, kind: str, identity: str, size: int = 0, charge: bool = True,
                    charged: bool = False) -> AdmittedRequest:
        """A decoded body -> an AdmittedRequest. The checks that cost little run first; then the key is charged (the
        request, `size` (the body's bytes, an upper bound of its prompt tokens) and the expected output) before the
        work that grows with the body (`build_prompt`) runs on the CPU pool; the prompt tokens are then settled to
        their exact count. `charged`: the request and its bytes were taken by read_body, before the body was
        decoded; only the output is reserved here. `charge=False` leaves the per-minute limits alone. A refusal
        after the charge gives the output reservation back; the request and its prompt stay charged. A body of
        unknown size (0: the Batch API's lines) or above SMALL_BODY_BYTES is validated on the CPU pool; `data` may
        be a request validated already."""
        if isinstance(data, (ChatCompletionRequest, CompletionRequest)):
            req = data  # validated already (Gateway.prepare: a Batch API line, once for all its retries)
        else:
            req = await self.by_size(size, self.validate, data, kind)
        if kind != "chat":
            if req.suffix is not None:
                raise bad_request("suffix is not supported (no model served here is trained for fill-in-the-middle)", param="suffix")
            if req.echo and req.logprobs is not None:
                raise bad_request("echo with logprobs needs the prompt's logprobs, which the engines here do not give "
                                  "(SwiftKV skips the later layers for prompt tokens)", param="echo")
        logprobs = req.logprobs_k()
        pinned = self.resolve_model(req.model)
        self.check_speculation(req, pinned)
        self.check_priority(req, identity)
        self.check_token_ids(req)
        requested = req.output_limit()
        estimate = max(1, round(self.output_estimate.get(identity, req.model)))
        reserved = (requested or estimate) * req.n if charge else None  # None: not charged
        if reserved is not None and not charged:
            await self.limiter.acquire(identity, size, reserved)
        elif reserved is not None and self.limiter.limits(identity).get("output_tokens"):  # else nothing left to take
            await self.limiter.acquire(identity, 0, reserved, requests=0)
        try:
            tools, prompt_ids, echo, structured, structured_param = (
                self.build_prompt(req, kind, pinned) if 0 < size <= SMALL_PROMPT_BYTES
                else await self.off_loop(self.build_prompt, req, kind, pinned))
            max_tokens = self.output_tokens(len(prompt_ids), requested, "messages" if kind == "chat" else "prompt")
            if req.min_tokens > max_tokens:
                raise bad_request(f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
            self.check_answer_size(req, max_tokens, logprobs)
            expected = requested or min(max_tokens, estimate)
            if reserved is not None:
                await self.limiter.settle(identity, size, len(prompt_ids), kind="prompt_tokens")
                if expected * req.n < reserved:  # less room in the context than the estimate reserved
                    await self.limiter.settle(identity, reserved, expected * req.n)
                    reserved = expected * req.n
        except APIError:
            if reserved is not None:
                await self.limiter.settle(identity, reserved, 0)
            raise
        sampling = req.to_sampling_options(max_tokens, structured, tools.skip_special_tokens if tools is not None else None)
        gen = GenerateRequest(secrets.token_hex(12), prompt_ids, sampling, priority=req.priority)
        render = (ChatRender if kind == "chat" else CompletionRender)(gen.request_id, req.model, int(time.time()), req.n,
                                                                      logprobs is not None, tools, echo)
        return AdmittedRequest(identity, req, gen, pinned, expected, reserved, requested is None, render, structured_param,
                               "chat" if kind == "chat" else "completions")

    async def release(self, admitted: AdmittedRequest) -> None:
        """Give back the output reservation of a request that will not be served (no pool can take it)."""
        if admitted.reserved is not None:
            await self.limiter.settle(admitted.identity, admitted.reserved, 0)

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
