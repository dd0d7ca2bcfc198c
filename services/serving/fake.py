"""The engine stand-in: a real `Backend` (backend.py) the gateway drives exactly as it drives vLLM, Ray Serve or a
remote server, with no engine behind it. It answers as configured: how many tokens and how fast, an error to raise,
a gate that holds the requests it picks until opened, engines that are up or down. What the gateway does above the
engines is tested over it, and the gateway's own cost is measured over it (loadtest/gateway_overhead.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable, Iterable

from .backend import BackendDown, ChoiceDelta, GenerateRequest, Output, TokenLogprob


class FakeBackend:
    """Answers each request with `tokens` tokens (None: the request's max_tokens, as with ignore_eos) of `text` per
    choice (logprobs when asked), `chunk` tokens per output, one output every `delay` s; or with what `script(request)`
    returns. `error`, when set, is raised instead of answering. `gate` (an asyncio.Event), when given, holds the requests
    that `hold(request)` picks (default: all) before their first token until it is set; a request cancelled before its
    last output counts as aborted. `up` False: start, health and recover say the engines are down. `replicas`: the engines it says serve the pool (`replica_count`). `cache` (block size,
    capacity tokens) is what it reports of its KV cache, as an in-process engine does; `token_id`, when set, is the id
    it reports for every token it answers (as an in-process engine reports its tokens' ids). `check`, when given, sees
    each request first and may refuse it (raise BadRequest) as an engine would; `kv_events`, the endpoints where its
    engines would publish KV-cache events (a test publishes there). Like vLLM it reports the prompt tokens it found in its
    prefix cache on each answer's first output (`cached_tokens`): the full blocks (`cache`'s block size, else 16) of the
    prompt it was sent before under the same key salt and mode, never the last token (none with `record` False). It keeps every
    request it was sent (`requests`, each with the `mode` it asked a dual-mode engine for; none with `record` False, for
    a load test's millions) and counts `waiting` (at the
    gate), `served` (past the gate) and `aborted`."""
    starts_alongside = False

    def __init__(self, name: str = "base", tokens: int | None = 1, delay: float = 0.0, text: str = "x", *, chunk: int = 1,
                 gate: asyncio.Event | None = None, hold: Callable[[GenerateRequest], bool] | None = None,
                 script: Callable[[GenerateRequest], Iterable[Output]] | None = None, up: bool = True, record: bool = True,
                 cache: tuple[int, int] | None = None, token_id: int | None = None,
                 check: Callable[[GenerateRequest], None] | None = None, kv_events: Iterable[str] = (), replicas: int = 1):
        self.name, self.tokens, self.delay, self.text, self.chunk = name, tokens, delay, text, chunk
        self.gate, self.hold, self.script, self.up = gate, hold or (lambda request: True), script, up
        self.record, self.cache, self.token_id, self.check = record, cache, token_id, check
        self.kv_events = tuple(kv_events)
        self.replicas = replicas  # the engines it says serve the pool (replica_count); a test may change it
        self.error: Exception | None = None
        self.requests: list[GenerateRequest] = []
        self.waiting = self.served = self.aborted = 0
        self.cached_blocks: set[int] = set()  # chained hashes of the prompt blocks it has "prefilled" (its prefix cache)

    def prefill(self, request: GenerateRequest) -> int:
        """The prompt tokens found cached, as vLLM counts them (whole blocks, never the last token); the prompt's blocks
        are cached from now on."""
        size = self.cache[0] if self.cache else 16
        ids, h, cached, hit = request.prompt_token_ids, hash((request.key_salt, request.mode)), 0, True
        if len(self.cached_blocks) > 1_000_000:  # bounded, as a real cache is
            self.cached_blocks.clear()
        for end in range(size, len(ids) + 1, size):
            h = hash((h, tuple(ids[end - size:end])))
            if hit and h in self.cached_blocks and end <= len(ids) - 1:
                cached = end
            else:
                hit = False
            self.cached_blocks.add(h)
        return cached

    async def start(self) -> None:
        if not self.up:
            raise BackendDown(f"pool {self.name}: engines restarting")

    async def health(self) -> bool:
        return self.up

    def prefix_cache(self) -> tuple[int, int] | None:
        return self.cache

    def kv_event_endpoints(self) -> list[str]:
        return list(self.kv_events)

    def replica_count(self) -> int:
        return self.replicas

    async def recover(self) -> None:
        if not self.up:
            raise BackendDown(f"pool {self.name}: engines restarting")

    async def stop(self) -> None:
        pass

    def outputs(self, request: GenerateRequest) -> Iterable[Output]:
        if self.script is not None:
            return self.script(request)
        k, tokens = request.sampling.logprobs, self.tokens or request.sampling.max_tokens
        top = [(self.text, -0.5), ("y", -1.5)] + [(f"t{j}", -1.5 - j) for j in range(1, (k or 0) - 1)]
        logprobs = None if k is None else [TokenLogprob(self.text, -0.5, top[:k])]
        sizes = [min(self.chunk, tokens - i) for i in range(0, tokens, self.chunk)]
        return (Output([ChoiceDelta(c, self.text * size, size, "length" if i == len(sizes) - 1 else None, logprobs and logprobs * size,
                                    None if self.token_id is None else [self.token_id] * size)
                        for c in range(request.sampling.n)]) for i, size in enumerate(sizes))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        if self.record:
            self.requests.append(request)
        if self.error is not None:
            raise self.error
        if self.check is not None:
            self.check(request)
        finished = False
        try:
            if self.gate is not None and self.hold(request):
                self.waiting += 1
                try:
                    await self.gate.wait()
                finally:
                    self.waiting -= 1
            self.served += 1
            outputs = list(self.outputs(request))
            if self.record and outputs and outputs[0].cached_tokens is None:
                outputs[0] = dataclasses.replace(outputs[0], cached_tokens=self.prefill(request))
            for i, out in enumerate(outputs):
                if self.delay:
                    await asyncio.sleep(self.delay)
                finished = i == len(outputs) - 1
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self.aborted += 1
            raise
