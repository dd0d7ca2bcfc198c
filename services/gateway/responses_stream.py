"""A streamed chat answer as the Responses API's server-sent events, in OpenAI's order and numbered by
`sequence_number`: response.created, response.in_progress, then per output item output_item.added (a message's
content_part.added and output_text.delta events, or a function call's function_call_arguments.delta events), its
.done events and output_item.done, and last response.completed (response.incomplete when max_output_tokens cut the
answer, response.failed when the engine failed). The chat renderer's chunks (tool calls parsed as the chat route
parses them) are what is translated."""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable

from services.serving.backend import BackendError, BadRequest, Output

from .render import failure, usage_dict
from .responses import ResponsesRequest, item_id, logprobs_of, response_object, status_of, usage_of

log = logging.getLogger("swiftkv.gateway")


def delta_logprobs(chat_logprobs: dict | None) -> list[dict]:
    return [{"token": t["token"], "logprob": t["logprob"],
             "top_logprobs": [{"token": a["token"], "logprob": a["logprob"]} for a in t.get("top_logprobs") or ()]}
            for t in (chat_logprobs or {}).get("content") or ()]


class ResponseEvents:
    """One streamed response's events, built from the chat chunks of its answer."""

    def __init__(self, resp_id: str, req: ResponsesRequest, created_at: int, render, prompt_tokens: int,
                 save: Callable[[dict], Awaitable[None]] | None = None):
        """`save(response)`: stores the finished response before the last event goes out (store: true)."""
        self.id, self.req, self.created_at, self.render, self.prompt_tokens = resp_id, req, created_at, render, prompt_tokens
        self.save = save
        self.seq = 0
        self.output: list[dict] = []  # items finished, and the one open (last) while it streams
        self.text: dict | None = None  # the open message item, while its text streams
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self.open_call: int | None = None
        self.logprobs: list[dict] = []

    def event(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def snapshot(self, status: str, usage: dict | None = None, incomplete: str | None = None, error: dict | None = None) -> dict:
        return response_object(self.id, self.req, self.created_at, status, self.output, usage, incomplete, error)

    # ---- items -----------------------------------------------------------------------------------
    def _open_text(self) -> list[bytes]:
        events = self._close_call()
        self.text = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self.output.append(self.text)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(self.text, content=[])))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.text["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=self.text["id"], output_index=index, content_index=0,
                                 part=dict(part)))
        return events

    def _close_text(self, status: str = "completed") -> list[bytes]:
        if self.text is None:
            return []
        item, self.text = self.text, None
        index = self.output.index(item)
        part = item["content"][0]
        if not self.req.logprobs():
            part.pop("logprobs")
        item["status"] = status
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=delta_logprobs({"content": self.logprobs})),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _close_call(self) -> list[bytes]:
        if self.open_call is None:
            return []
        item, self.open_call = self.calls[self.open_call], None
        item["status"] = "completed"
        index = self.output.index(item)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _text_delta(self, text: str, logprobs: dict | None) -> list[bytes]:
        events = self._open_text() if self.text is None else []
        part = self.text["content"][0]
        part["text"] += text
        if logprobs:
            self.logprobs.extend(logprobs.get("content") or ())
            part["logprobs"] = logprobs_of({"content": self.logprobs})
        events.append(self.event("response.output_text.delta", item_id=self.text["id"], output_index=self.output.index(self.text),
                                 content_index=0, delta=text, logprobs=delta_logprobs(logprobs)))
        return events

    def _call_delta(self, call: dict) -> list[bytes]:
        index = call.get("index", 0)
        if self.req.max_tool_calls is not None and index >= self.req.max_tool_calls:
            return []  # calls past max_tool_calls are not made
        events: list[bytes] = []
        fn = call.get("function") or {}
        if index not in self.calls:
            events += self._close_text() + self._close_call()
            item = {"id": item_id("fc"), "type": "function_call", "call_id": call.get("id") or item_id("call"),
                    "name": fn.get("name") or "", "arguments": "", "status": "in_progress"}
            self.calls[index] = item
            self.output.append(item)
            self.open_call = index
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        item = self.calls[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=fn["arguments"]))
        return events

    # ---- the stream ------------------------------------------------------------------------------
    async def body(self, stream: AsyncIterator[Output], first: list[Output]) -> AsyncIterator[bytes]:
        """The SSE body of the answer whose `first` outputs were read already. A client that leaves cancels the
        iteration here, which closes the engine's stream (the request is aborted) and stores nothing."""
        completion_tokens, cached, finish = 0, None, None

        async def outputs():
            for out in first:
                yield out
            async for out in stream:
                yield out

        yield self.event("response.created", response=self.snapshot("in_progress"))
        yield self.event("response.in_progress", response=self.snapshot("in_progress"))
        try:
            async with aclosing(stream):  # closed however the body ends (a client that left included)
                async for out in outputs():
                    completion_tokens += sum(c.num_tokens for c in out.choices)
                    cached = getattr(out, "cached_tokens", None) if getattr(out, "cached_tokens", None) is not None else cached
                    for choice in self.render.chunk(out)["choices"]:
                        delta = choice["delta"]
                        if delta.get("content"):
                            for e in self._text_delta(delta["content"], choice.get("logprobs")):
                                yield e
                        for call in delta.get("tool_calls") or ():
                            for e in self._call_delta(call):
                                yield e
                        finish = choice.get("finish_reason") or finish
        except (BadRequest, BackendError) as e:
            _, body = failure(e)
            for ev in self._close_text("incomplete") + self._close_call():
                yield ev
            error = {"code": "server_error", "message": body["error"]["message"]}
            yield self.event("response.failed", response=self.snapshot("failed", error=error))
            return
        status, incomplete = status_of(finish)
        if not self.output:  # an empty answer is still one message, as a whole answer has
            for e in self._open_text():
                yield e
        for e in self._close_text("incomplete" if incomplete else "completed") + self._close_call():
            yield e
        usage = usage_of(usage_dict(self.prompt_tokens, completion_tokens, cached) if cached is not None
                         else usage_dict(self.prompt_tokens, completion_tokens))
        final = self.snapshot(status, usage, incomplete)
        if self.save is not None:
            try:
                await self.save(final)
            except Exception as e:  # the store refused it (quota) or is down: the client is told, in the stream
                log.warning("response %s not stored: %s", self.id, e)
                yield self.event("error", code=getattr(e, "code", None) or "server_error",
                                 message=f"the response was not stored: {getattr(e, 'message', None) or e}", param="store")
                return
        yield self.event("response.incomplete" if incomplete else "response.completed", response=final)
