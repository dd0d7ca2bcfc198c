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


def sse_event(chunk: dict, include_usage: bool) -> bytes:
    if include_usage:
        chunk["usage"] = None
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class ChatRender:
    """OpenAI chat.completion and chat.completion.chunk objects."""

    def __init__(self, request_id: str, model: str, created: int, n: int, logprobs: bool):
        self.id, self.model, self.created, self.n, self.logprobs = f"chatcmpl-{request_id}", model, created, n, logprobs

    def _base(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    @staticmethod
    def _logprobs(items) -> dict:
        def entry(token, logprob):
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        return {"content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(a, b) for a, b in t.top]} for t in items]}

    def full(self, choices: list[Choice], usage: dict) -> dict:
        return self._base("chat.completion") | {
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                 "logprobs": self._logprobs(c.logprobs) if self.logprobs else None, "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": usage,
        }

    def start(self) -> list[dict]:
        return [self._base("chat.completion.chunk") | {"choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.n)]}]

    def chunk(self, out: Output) -> dict:
        return self._base("chat.completion.chunk") | {"choices": [
            {"index": c.index, "delta": {"content": c.text} if c.text or not c.finish_reason else {},
             "logprobs": self._logprobs(c.logprobs) if self.logprobs and c.logprobs else None,
             "finish_reason": c.finish_reason}
            for c in out.choices]}

    def usage_chunk(self, usage: dict) -> dict:
        return self._base("chat.completion.chunk") | {"choices": [], "usage": usage}


class CompletionRender(ChatRender):
    """OpenAI text_completion objects (streamed chunks have the same shape)."""

    def __init__(self, request_id: str, model: str, created: int, n: int, logprobs: bool):
        super().__init__(request_id, model, created, n, logprobs)
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
                {"index": i, "text": "".join(c.text), "logprobs": self._logprobs(c.logprobs) if self.logprobs else None,
                 "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": usage,
        }

    def start(self) -> list[dict]:
        return []

    def chunk(self, out: Output) -> dict:
        return self._base("text_completion") | {"choices": [
            {"index": c.index, "text": c.text, "logprobs": self._logprobs(c.logprobs) if self.logprobs and c.logprobs else None,
             "finish_reason": c.finish_reason}
            for c in out.choices]}

    def usage_chunk(self, usage: dict) -> dict:
        return self._base("text_completion") | {"choices": [], "usage": usage}
