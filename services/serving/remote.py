"""A pool served by a remote OpenAI-compatible server (another vLLM, another gateway) over HTTP.

Requests go to `/v1/completions` with the prompt as token ids, streamed, so the remote side never
re-applies a chat template and the gateway's token counts stay exact. Generated tokens are counted from the
server's own usage figures (`stream_options.include_usage`; per chunk with vLLM's `continuous_usage_stats`),
not from the number of chunks: a chunk may carry several tokens, or none. The server's errors reach the
client with their status and message, in OpenAI's envelope. A base-mode request to a dual-mode server (a pool's
`dual_mode`) carries vLLM's `vllm_xargs`, and a request of a base mode or of an API key whose prefix cache is kept
apart carries vLLM's `cache_salt` (swiftkv_core/dual_mode.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import AsyncIterator

import httpx

from swiftkv_core.dual_mode import MODE_ARG, cache_salt, extra_args

from .backend import BackendDown, BackendError, ChoiceDelta, GenerateRequest, Output, SamplingOptions, TokenLogprob, UpstreamError

# SamplingOptions' names that differ on the wire (vLLM's server calls `structured` `structured_outputs`)
WIRE_NAMES = {"structured": "structured_outputs"}


def request_fields(sampling: SamplingOptions) -> dict:
    """The sampling options as OpenAI /v1/completions fields. OpenAI's own fields are sent unless unset (None or
    empty); vLLM's extensions only where they differ from vLLM's defaults, since other servers may refuse them."""
    body = {}
    for f in dataclasses.fields(sampling):
        value = getattr(sampling, f.name)
        if f.metadata.get("vllm_extension"):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if value == default:
                continue
        elif value is None or value == [] or value == {}:
            continue
        body[WIRE_NAMES.get(f.name, f.name)] = value
    return body


def cached_tokens(usage: dict | None) -> int | None:
    """A usage object's prompt_tokens_details.cached_tokens, where the server reports it (vLLM: started with
    --enable-prompt-tokens-details)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def mode_fields(mode: str | None, key_salt: str | None = None) -> dict:
    """What asks a dual-mode vLLM server for `mode` (swiftkv_core/dual_mode.py), a base-mode request's `vllm_xargs`, and
    the prefix-cache salt of the mode and the key; nothing otherwise, so other servers never see the fields."""
    xargs, salt = extra_args(mode), cache_salt(mode, key_salt)
    return ({"vllm_xargs": xargs} if xargs else {}) | ({"cache_salt": salt} if salt is not None else {})


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent event stream. They end at LF or CRLF only (the SSE format's line ends; the lone CR
    it also allows is sent by no OpenAI-compatible server): httpx's `aiter_lines` also ends a line at U+2028, U+2029
    and NEL, which JSON leaves unescaped inside a string, so an answer holding one would be cut mid-event."""
    pending = b""
    async for chunk in response.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode(errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode(errors="replace")


class RemoteBackend:
    starts_alongside = False

    def __init__(self, name: str, url: str, model: str, api_key: str | None = None, timeout: float = 600.0,
                 kv_events: str | None = None, dual_mode: bool = False):
        self.name = name
        self.dual_mode = dual_mode  # the pool's requests may ask for base mode: the server must serve it
        self.base_mode_refusal: str | None = None  # why the server refused base mode at its last check, if it did
        self.kv_events = kv_events  # where the server publishes vLLM's KV-cache events, if it does
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
        self.continuous_usage = False

    async def start(self) -> None:
        if not await self.health():
            raise BackendDown(f"pool {self.name}: remote server {self.base} is not reachable")
        self.continuous_usage = await self._is_vllm()
        if self.dual_mode and not await self._serves_base_mode():
            raise BackendDown(self.base_mode_refusal)

    async def _serves_base_mode(self) -> bool:
        """A one-token base-mode request: False (and why, in base_mode_refusal) when the server refuses it, as a SwiftKV
        server started without the dual-mode override does (swiftkv_core/vllm/engine_config.py). Any other answer
        passes: a server without the SwiftKV plugin cannot be told apart from one that serves base mode."""
        body = {"model": self.model, "prompt": [0], "max_tokens": 1} | mode_fields("base")
        try:
            r = await self.client.post(f"{self.base}/completions", json=body, timeout=30.0)
        except httpx.HTTPError:
            return True  # not this check's to judge: health() reports an unreachable server
        if 400 <= r.status_code < 500 and MODE_ARG in r.text:
            self.base_mode_refusal = (f"pool {self.name}: dual_mode is set but the server at {self.base} does not serve "
                                      f"base mode (start it with hf_overrides {{\"swiftkv_dual_mode\": true}}): "
                                      f"{_upstream_error(r.status_code, r.text).message}")
            return False
        self.base_mode_refusal = None
        return True

    async def _is_vllm(self) -> bool:
        """vLLM's server (it answers /version) reports usage on every chunk when asked; others may refuse
        the field, and get only the final usage chunk."""
        try:
            r = await self.client.get(self.base.removesuffix("/v1") + "/version", timeout=5.0)
            return r.status_code == 200 and "version" in r.json()
        except (httpx.HTTPError, ValueError):
            return False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        body = {"model": self.model, "prompt": request.prompt_token_ids, "stream": True} | request_fields(request.sampling)
        body |= mode_fields(request.mode, request.key_salt)
        body["stream_options"] = {"include_usage": True} | ({"continuous_usage_stats": True} if self.continuous_usage else {})
        counted: dict[int, int] = {}  # tokens per choice passed on so far
        held: Output | None = None  # without per-chunk usage, the latest output waits for the final usage chunk
        try:
            async with self.client.stream("POST", f"{self.base}/completions", json=body) as response:
                if response.status_code >= 400:
                    raise _upstream_error(response.status_code, (await response.aread()).decode(errors="replace"))
                async for line in sse_lines(response):
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except (ValueError, RecursionError):
                        raise BackendError(f"pool {self.name}: the server sent an event that is not JSON: {data[:200]!r}") from None
                    if "error" in chunk or chunk.get("object") == "error":  # the server failed the request mid-stream
                        raise _upstream_error(None, data)
                    choices = [self._choice(c, chunk.get("usage"), counted) for c in chunk.get("choices") or []]
                    if not choices and chunk.get("usage"):
                        # The final usage chunk: what the per-chunk guesses missed goes onto the last output.
                        missing = int(chunk["usage"].get("completion_tokens") or 0) - sum(counted.values())
                        if missing:
                            held = held or Output([ChoiceDelta(0, "", 0)])
                            held.choices[-1].num_tokens += missing
                            counted[held.choices[-1].index] = counted.get(held.choices[-1].index, 0) + missing
                    cached = cached_tokens(chunk.get("usage"))
                    if cached is not None:  # vLLM's, with --enable-prompt-tokens-details: on the final usage chunk
                        if self.continuous_usage:
                            yield Output([], cached_tokens=cached)
                        else:
                            held = held or Output([])
                            held.cached_tokens = cached
                    if choices and self.continuous_usage:
                        yield Output(choices)
                    elif choices:
                        if held is not None:
                            yield held
                        held = Output(choices)
                if held is not None:
                    yield held
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # the server is unreachable: the pool is down
            raise BackendDown(f"pool {self.name}: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise BackendError(f"pool {self.name}: {type(e).__name__}: {e}") from e

    def _choice(self, c: dict, usage: dict | None, counted: dict[int, int]) -> ChoiceDelta:
        index = c.get("index", 0)
        logprobs = None
        lp = c.get("logprobs")
        if lp and lp.get("tokens") is not None:
            tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
            logprobs = [
                TokenLogprob(tok, float(val if val is not None else 0.0), list((top or {}).items()))
                for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], tops)
            ]
        if usage and usage.get("completion_tokens") is not None:  # continuous usage: this choice's tokens so far
            num_tokens = int(usage["completion_tokens"]) - counted.get(index, 0)
        elif logprobs is not None:
            num_tokens = len(logprobs)
        else:  # a guess, set right by the final usage chunk
            num_tokens = 1 if c.get("text") else 0
        counted[index] = counted.get(index, 0) + num_tokens
        return ChoiceDelta(index, c.get("text", ""), num_tokens, c.get("finish_reason"), logprobs)

    def kv_event_endpoints(self) -> list[str]:
        return [self.kv_events] if self.kv_events else []

    def prefix_cache(self) -> None:
        return None  # not reported over HTTP: routing.prefix_block_size / prefix_cache_tokens, or their defaults

    def replica_count(self) -> int:
        return 1  # one server (several of one model are a ReplicaSet)

    async def health(self) -> bool:
        try:
            r = await self.client.get(f"{self.base}/models", timeout=5.0)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        # a dual_mode pool whose server refused base mode stays out of routing until a check finds it fixed
        return self.base_mode_refusal is None or await self._serves_base_mode()

    async def recover(self) -> None:
        await self.start()  # nothing to restart here: the server is reachable again or not

    async def stop(self) -> None:
        await self.client.aclose()


OPENAI_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                      "rate_limit_error", "server_error", "requests", "tokens"}


def _upstream_error(status: int | None, text: str) -> UpstreamError:
    """The server's error answer (or mid-stream error event) in OpenAI's envelope, with the status it
    answered (for an event: the status in its `code`, as vLLM sends it, else one that fits its type)."""
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
    except (ValueError, RecursionError):
        err = {"message": text[:500]}
    code, kind = err.get("code"), err.get("type")
    if status is None:
        status = code if isinstance(code, int) and 400 <= code <= 599 else 400 if kind == "invalid_request_error" else 500
    if kind not in OPENAI_ERROR_TYPES:
        kind = "server_error" if status >= 500 else "invalid_request_error"
    message = str(err.get("message") or f"the upstream server answered {status}")
    return UpstreamError(status, message, kind, err.get("param"), code if isinstance(code, str) else None)
