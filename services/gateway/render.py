"""OpenAI's responses from a backend's stream of outputs: chat.completion and text_completion objects, their
stream chunks and usage; a whole answer (`collect`) or server-sent events (`sse_body`); the answer to a request
the engine refused or failed (`failure`)."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from services.common.errors import error_body, sse_error
from services.serving.backend import BackendDown, BackendError, BadRequest, Output, UpstreamError

log = logging.getLogger("swiftkv.gateway")


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)


def usage_dict(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: the prompt tokens the engine read from its prefix cache (prompt_tokens_details), where
    the backend reports them."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return usage if cached is None else usage | {"prompt_tokens_details": {"cached_tokens": cached}}


# An answer up to this many tokens, without logprobs, is built and encoded on the event loop (tens of microseconds:
# less than the hop to the CPU pool and back); a longer one, up to limits.max_unstreamed_tokens, on the CPU pool.
SMALL_ANSWER_TOKENS = 256


def small_answer(body: dict) -> bool:
    """Whether an answer body (or an error body) is small enough to encode on the event loop."""
    usage = body.get("usage") or {}
    return usage.get("completion_tokens", 0) <= SMALL_ANSWER_TOKENS and not any(c.get("logprobs") for c in body.get("choices") or ())


def json_bytes(body: dict) -> bytes:
    """A whole answer as JSON, as Starlette's JSONResponse writes it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse_event(chunk: dict, include_usage: bool, usage: dict | None = None) -> bytes:
    """`usage`: vLLM's continuous usage stats (the counts so far on every chunk)."""
    if include_usage:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class ChatRender:
    """OpenAI chat.completion and chat.completion.chunk objects, with the fields OpenAI's schema requires even
    where they are always null here (`refusal` in messages and logprobs)."""

    def __init__(self, request_id: str, model: str, created: int, n: int, logprobs: bool, tools=None, echo: str = ""):
        """`tools`: a ToolCalls turning answers into tool calls; `echo`: text that starts every choice (vLLM's echo)."""
        self.id, self.model, self.created, self.n, self.logprobs = f"chatcmpl-{request_id}", model, created, n, logprobs
        self.tools, self.echo = tools, echo
        self._echoed: set[int] = set()

    def _text(self, index: int, text: str) -> str:
        """A streamed choice's text, the echo in front of its first piece."""
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            return self.echo + text
        return text

    def _base(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    @staticmethod
    def _logprobs(items) -> dict:
        def entry(token, logprob):
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        return {"content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(a, b) for a, b in t.top]} for t in items],
                "refusal": None}

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        text = self.echo + "".join(c.text)
        if self.tools is not None:
            message, finish_reason = self.tools.message(text, c.finish_reason)
            return {"role": message.pop("role"), "content": message.pop("content"), "refusal": None} | message, finish_reason
        return {"role": "assistant", "content": text, "refusal": None}, c.finish_reason

    def full(self, choices: list[Choice], usage: dict) -> dict:
        out = []
        for i, c in enumerate(choices):
            message, finish_reason = self._message(c)
            out.append({"index": i, "message": message, "logprobs": self._logprobs(c.logprobs) if self.logprobs else None,
                        "finish_reason": finish_reason})
        return self._base("chat.completion") | {"choices": out, "usage": usage}

    def start(self) -> list[dict]:
        return [self._base("chat.completion.chunk") | {"choices": [
            {"index": i, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None, "finish_reason": None}
            for i in range(self.n)]}]

    def chunk(self, out: Output) -> dict:
        choices = []
        for c in out.choices:
            text, finish_reason = self._text(c.index, c.text), c.finish_reason
            if self.tools is not None:
                delta, finish_reason = self.tools.delta(c.index, text, finish_reason, c.token_ids)
                if delta is None:  # nothing to say yet (a tool call's text is held back)
                    continue
            else:
                delta = {"content": text} if text or not finish_reason else {}
            choices.append({"index": c.index, "delta": delta,
                            "logprobs": self._logprobs(c.logprobs) if self.logprobs and c.logprobs else None,
                            "finish_reason": finish_reason})
        return self._base("chat.completion.chunk") | {"choices": choices}

    def usage_chunk(self, usage: dict) -> dict:
        return self._base("chat.completion.chunk") | {"choices": [], "usage": usage}


class CompletionRender(ChatRender):
    """OpenAI text_completion objects (streamed chunks have the same shape)."""

    def __init__(self, request_id: str, model: str, created: int, n: int, logprobs: bool, tools=None, echo: str = ""):
        super().__init__(request_id, model, created, n, logprobs, tools, echo)
        self.id = f"cmpl-{request_id}"

    @staticmethod
    def _logprobs(items) -> dict:
        offsets, pos = [], 0
        for t in items:
            offsets.append(pos)
            pos += len(t.token)
        return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [dict(t.top) for t in items], "text_offset": offsets}

    def full(self, choices: list[Choice], usage: dict) -> dict:
        return self._base("text_completion") | {
            "choices": [
                {"index": i, "text": self.echo + "".join(c.text), "logprobs": self._logprobs(c.logprobs) if self.logprobs else None,
                 "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": usage,
        }

    def start(self) -> list[dict]:
        return []

    def chunk(self, out: Output) -> dict:
        return self._base("text_completion") | {"choices": [
            {"index": c.index, "text": self._text(c.index, c.text), "logprobs": self._logprobs(c.logprobs) if self.logprobs and c.logprobs else None,
             "finish_reason": c.finish_reason}
            for c in out.choices]}

    def usage_chunk(self, usage: dict) -> dict:
        return self._base("text_completion") | {"choices": [], "usage": usage}


Renderer = ChatRender | CompletionRender


async def collect(stream: AsyncIterator[Output], render: Renderer, prompt_tokens: int,
                  off_loop: Callable[..., Awaitable], structured_param: str | None = None) -> tuple[int, dict]:
    """A whole (non-streamed) answer: (status, OpenAI body). A long one (up to limits.max_unstreamed_tokens) is built
    with `off_loop` (the gateway's CPU pool)."""
    choices = [Choice() for _ in range(render.n)]
    cached = None
    try:
        async with aclosing(stream) as s:
            async for out in s:
                if out.cached_tokens is not None:
                    cached = out.cached_tokens
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
    usage = usage_dict(prompt_tokens, completion_tokens, cached)
    if completion_tokens <= SMALL_ANSWER_TOKENS and not render.logprobs:
        return 200, render.full(choices, usage)
    return 200, await off_loop(render.full, choices, usage)


async def sse_body(stream: AsyncIterator[Output], first: list[Output], render: Renderer, prompt_tokens: int,
                   include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """The SSE body of an answer whose `first` outputs were already read (so the status line could be right):
    errors from here on can only be events in the stream."""
    completion_tokens, cached = 0, None

    async def outputs():
        for out in first:
            yield out
        async for out in stream:
            yield out

    try:
        async with aclosing(stream):
            for chunk in render.start():
                yield sse_event(chunk, include_usage, usage_dict(prompt_tokens, 0) if continuous_usage else None)
            async for out in outputs():
                completion_tokens += sum(c.num_tokens for c in out.choices)
                cached = cached if out.cached_tokens is None else out.cached_tokens
                chunk = render.chunk(out)
                if chunk["choices"]:  # choices whose text is held back (a tool call taking shape) send nothing
                    yield sse_event(chunk, include_usage, usage_dict(prompt_tokens, completion_tokens, cached) if continuous_usage else None)
    except (BadRequest, BackendError) as e:
        status, body = failure(e)
        yield sse_error(body["error"]["message"], body["error"]["type"], body["error"]["code"])
        yield b"data: [DONE]\n\n"  # the stream still ends the way clients expect, never left hanging
        return
    if include_usage:
        yield sse_event(render.usage_chunk(usage_dict(prompt_tokens, completion_tokens, cached)), False)
    yield b"data: [DONE]\n\n"


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
