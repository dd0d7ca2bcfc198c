"""The one interface between the gateway and engines.

A Backend streams the outputs of one generation request and reports its health. Requests
arrive already tokenized (the gateway counts tokens to route, so the engine never tokenizes twice) and
outputs come back as deltas per choice. Everything here is plain data so it crosses process
boundaries (Ray) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

VLLM_EXTENSION = {"vllm_extension": True}  # field metadata: vLLM's own parameter, not OpenAI's


@dataclass
class SamplingOptions:
    """The one definition of what a request asks of the engine's sampler: the request models convert to it
    (`to_sampling_options`), the backends map it field by field (`dataclasses.fields`) to vLLM's SamplingParams
    or a remote server's request body. The names are vLLM's, except `structured` (its `structured_outputs`)."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k alternatives per token (0 = only the chosen token's logprob)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extra sampling parameters, with its meaning and defaults
    ignore_eos: bool = field(default=False, metadata=VLLM_EXTENSION)
    top_k: int = field(default=0, metadata=VLLM_EXTENSION)  # 0 (or -1): every token
    min_p: float = field(default=0.0, metadata=VLLM_EXTENSION)
    repetition_penalty: float = field(default=1.0, metadata=VLLM_EXTENSION)
    min_tokens: int = field(default=0, metadata=VLLM_EXTENSION)
    stop_token_ids: list[int] = field(default_factory=list, metadata=VLLM_EXTENSION)
    skip_special_tokens: bool = field(default=True, metadata=VLLM_EXTENSION)
    include_stop_str_in_output: bool = field(default=False, metadata=VLLM_EXTENSION)
    logit_bias: dict[int, float] | None = None
    # vLLM's StructuredOutputsParams fields (json, regex, choice, grammar, json_object, ...)
    structured: dict | None = field(default=None, metadata=VLLM_EXTENSION)


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    priority: int = 0  # vLLM's: lower is scheduled first (engines with scheduling_policy=priority; FCFS ignores it)
    # the model a dual-mode engine runs it as, "swiftkv" or "base" (swiftkv_core/dual_mode.py); None: the engine's own model
    mode: str | None = None
    # a digest of the request's API key that keeps its prefix-cache blocks apart from other keys' (vLLM's cache_salt,
    # joined to the mode's: swiftkv_core/dual_mode.py); None: shared (one tenant, or routing.share_prefix_cache)
    key_salt: str | None = None


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] | None = None  # the new tokens, when the backend knows them (tool-call parsers may read them)


@dataclass
class Output:
    """One step of a request's stream: new text per choice (only choices that advanced)."""

    choices: list[ChoiceDelta]
    queue_seconds: float | None = None  # engine queue time, once known (first output), if the backend knows it
    # prompt tokens the engine read from its prefix cache (vLLM's num_cached_tokens), once known (the first output, or a
    # remote server's final usage), if the backend knows it: the answer's usage.prompt_tokens_details.cached_tokens
    cached_tokens: int | None = None


class BackendError(RuntimeError):
    """The backend failed to serve this one request; the pool keeps serving the others."""


class BackendDown(BackendError):
    """The pool cannot serve at all (engine dead, remote server unreachable): the gateway routes around it
    until its health watcher sees it healthy again."""


class UpstreamError(BackendError):
    """A remote server refused or failed this request: its status and error, for the client as they came."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class BadRequest(ValueError):
    """The engine rejected the request's content (the gateway answers 400 with this message)."""


class Backend(Protocol):
    name: str
    # Whether its start competes with no other pool's for the machine (in-process engines bound to CPU cores of
    # their own): the gateway starts such pools together, others one by one.
    starts_alongside: bool

    async def start(self) -> None:
        """Bring the engines up and warm them up; return once the backend can serve."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        """Stream outputs; cancelling the iteration (or closing it) aborts the request in the engine."""

    async def health(self) -> bool: ...

    def prefix_cache(self) -> tuple[int, int] | None:
        """(block size, capacity in tokens) of the engine's KV cache once started, for the gateway's prefix-cache
        index; None where the gateway cannot know it (remote servers, Ray replicas)."""

    def kv_event_endpoints(self) -> list[str]:
        """ZMQ endpoints where the engines publish vLLM's KV-cache events, for the gateway's prefix-cache index to
        follow (services/common/kv_events.py); none where they do not (Ray replicas, or not configured)."""

    def replica_count(self) -> int:
        """Engines serving the pool now, over which its work spreads (the gateway's TTFT prediction and
        swiftkv_pool_replicas): an in-process pool's engine, a remote pool's reachable servers, a Ray pool's running
        replicas as its last health check counted them. Optional: one where a backend does not say."""

    async def recover(self) -> None:
        """Bring a backend whose health check fails back if it takes action (restart a dead engine, deploy
        again, reconnect); return when it may serve again, raise if it cannot yet."""

    async def stop(self) -> None: ...
