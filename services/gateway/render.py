"""OpenAI's response objects: chat.completion and text_completion, their stream chunks, usage, SSE events."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from services.serving.backend import Output


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)


def usage_dict(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
