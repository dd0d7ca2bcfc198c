"""A pool served by a remote OpenAI-compatible server (another vLLM, another gateway) over HTTP.

Requests go to `/v1/completions` with the prompt as token ids, streamed, so the remote side never
re-applies a chat template and the gateway's token counts stay exact.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import httpx

from .backend import BackendDown, BackendError, BadRequest, ChoiceDelta, GenerateRequest, Load, Output, TokenLogprob


class RemoteBackend:
    def __init__(self, name: str, url: str, model: str, api_key: str | None = None, timeout: float = 600.0):
        self.name = name
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
        self._running = 0
        self._queued_tokens = 0

    async def start(self) -> None:
        if not await self.health():
            raise BackendDown(f"pool {self.name}: remote server {self.base} is not reachable")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        s = request.sampling
        body = {
            "model": self.model, "prompt": request.prompt_token_ids, "stream": True,
            "max_tokens": s.max_tokens, "n": s.n, "temperature": s.temperature, "top_p": s.top_p,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = s.stop
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
        if s.ignore_eos:
            body["ignore_eos"] = True
        self._running += 1
        self._queued_tokens += len(request.prompt_token_ids)
        first = True
        try:
            async with self.client.stream("POST", f"{self.base}/completions", json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    if 400 <= response.status_code < 500:
                        raise BadRequest(_error_message(text))
                    raise BackendError(f"pool {self.name}: remote answered {response.status_code}: {text[:200]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    choices = [_choice(c) for c in chunk.get("choices", [])]
                    if first and choices:
                        first = False
                        self._queued_tokens -= len(request.prompt_token_ids)
                    if choices:
                        yield Output(choices)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # the server is unreachable: the pool is down
            raise BackendDown(f"pool {self.name}: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise BackendError(f"pool {self.name}: {type(e).__name__}: {e}") from e
        finally:
            self._running -= 1
            if first:
                self._queued_tokens -= len(request.prompt_token_ids)

    async def health(self) -> bool:
        try:
            r = await self.client.get(f"{self.base}/models", timeout=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def recover(self) -> None:
        await self.start()  # nothing to restart here: the server is reachable again or not

    def load(self) -> Load:
        return Load(running=self._running, queued_prompt_tokens=self._queued_tokens)

    async def stop(self) -> None:
        await self.client.aclose()


def _choice(c: dict) -> ChoiceDelta:
    logprobs = None
    lp = c.get("logprobs")
    if lp and lp.get("tokens") is not None:
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        logprobs = [
            TokenLogprob(tok, float(val if val is not None else 0.0), list((top or {}).items()))
            for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], tops)
        ]
    num_tokens = len(lp["tokens"]) if logprobs is not None else (1 if c.get("text") else 0)
    return ChoiceDelta(c.get("index", 0), c.get("text", ""), num_tokens, c.get("finish_reason"), logprobs)


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except Exception:
        return text[:500]
