"""Route policy: which pool serves a request, and why.

Prompt-heavy requests (prompt tokens / expected output tokens >= threshold) go to the `prefill` pool
(the SwiftKV model, whose prefill is cheaper), the others to `decode`. The ratio is overridden when the
chosen pool's backlog (prompt tokens waiting for prefill over its measured prefill rate) predicts a much
longer wait than the other pool's, and when a pool is down the other one serves (fallback).

Reasons (a small fixed set, used as a metric label and in the `x-swiftkv-route` header):
  ratio      the prompt/output ratio chose the pool
  backlog    the ratio's pool was much more loaded; the other pool predicts a lower latency
  fallback   the ratio's pool is down
  pinned     the client asked for a pool's own model name
  single     only one pool is configured
  batch_steered  a Batch API line moved off a pool busy with live traffic (`RoutePolicy.steer_batch`)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from services.config import RoutingConfig
from services.serving.backend import Backend

from . import metrics

PREFILL, DECODE = "prefill", "decode"
# Where a batch line may move without losing quality: the config fixes the pools' roles by name (`prefill`
# serves the SwiftKV model, `decode` its base model, sharing its tokenizer), and the base model is the quality
# reference. Never the reverse.
STEER_TO = {PREFILL: DECODE}


@dataclass
class Ewma:
    value: float
    alpha: float = 0.2

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


@dataclass
class PoolState:
    """What the gateway knows about a pool, measured on its own traffic."""

    name: str
    backend: Backend
    served_model_name: str
    max_model_len: int | None = None
    ready: bool = False
    backlog_tokens: int = 0  # dispatched prompt tokens whose first token has not come back
    prefill_rate: Ewma = field(default_factory=lambda: Ewma(5000.0))  # tokens/s, from prompt tokens / TTFT
    live_in_flight: int = 0  # live requests from dispatch to the end of their response
    live_ended_at: float = -math.inf  # time.monotonic() when the last of them ended
    live_elsewhere_at: float = -math.inf  # when another gateway process last reported live traffic here
    # called with local=True when a live request starts here, False when another process reports one
    # (services/batch: batch work making way, and telling the other processes)
    on_live_start: list[Callable[[bool], None]] = field(default_factory=list, repr=False)

    def live_started(self) -> None:
        self.live_in_flight += 1
        for hook in self.on_live_start:
            hook(True)

    def live_elsewhere(self) -> None:
        """Another gateway process has live traffic on this pool (services/batch/live.py): counted as a live
        request of this process that ended just now."""
        self.live_elsewhere_at = time.monotonic()
        for hook in self.on_live_start:
            hook(False)

    def live_ended(self) -> None:
        self.live_in_flight -= 1
        self.live_ended_at = time.monotonic()

    def live_busy(self, quiet_seconds: float) -> bool:
        """Live traffic is on this pool: a live request is in flight, or one ended less than `quiet_seconds` ago
        (here or in another gateway process)."""
        return self.live_in_flight > 0 or time.monotonic() - max(self.live_ended_at, self.live_elsewhere_at) < quiet_seconds

    def wait_seconds(self) -> float:
        return self.backlog_tokens / max(self.prefill_rate.value, 1.0)

    def dispatched(self, prompt_tokens: int) -> None:
        self.backlog_tokens += prompt_tokens
        metrics.pool_backlog.labels(self.name).set(self.backlog_tokens)

    def first_token(self, prompt_tokens: int, ttft: float) -> None:
        self.backlog_tokens -= prompt_tokens
        metrics.pool_backlog.labels(self.name).set(self.backlog_tokens)
        if prompt_tokens >= 16 and ttft > 0:  # tiny prompts measure overheads, not prefill
            self.prefill_rate.update(prompt_tokens / ttft)
            metrics.pool_prefill_rate.labels(self.name).set(self.prefill_rate.value)


@dataclass(frozen=True)
class Decision:
    pool: str
    reason: str
    ratio: float

    def header(self) -> str:
        return f"pool={self.pool}; reason={self.reason}; ratio={self.ratio:.2f}"


class NoPoolAvailable(Exception):
    pass


class RoutePolicy:
    def __init__(self, cfg: RoutingConfig):
        self.cfg = cfg

    def decide(self, prompt_tokens: int, expected_output: int, pools: dict[str, PoolState], pinned: str | None = None) -> Decision:
        ratio = prompt_tokens / max(expected_output, 1)
        if pinned is not None:
            if not pools[pinned].ready:
                raise NoPoolAvailable(f"pool {pinned} is not available")
            return Decision(pinned, "pinned", ratio)
        if len(pools) == 1:
            (only,) = pools.values()
            if not only.ready:
                raise NoPoolAvailable(f"pool {only.name} is not available")
            return Decision(only.name, "single", ratio)
        chosen = PREFILL if ratio >= self.cfg.ratio_threshold else DECODE
        other = DECODE if chosen == PREFILL else PREFILL
        if not pools[chosen].ready:
            if not pools[other].ready:
                raise NoPoolAvailable("no pool is available")
            return Decision(other, "fallback", ratio)
        if pools[other].ready:
            wait, other_wait = pools[chosen].wait_seconds(), pools[other].wait_seconds()
            if wait >= self.cfg.backlog_min_seconds and wait > self.cfg.backlog_factor * other_wait:
                # Predicted time to first token: the wait in line plus this prompt's own prefill.
                mine = wait + prompt_tokens / pools[chosen].prefill_rate.value
                theirs = other_wait + prompt_tokens / pools[other].prefill_rate.value
                if theirs < mine:
                    return Decision(other, "backlog", ratio)
        return Decision(chosen, "ratio", ratio)

    def steer_batch(self, decision: Decision, pools: dict[str, PoolState], live_busy: Callable[[str], bool]) -> Decision:
        """A batch line's route, away from live traffic: a line whose pool is live-busy moves to a ready pool
        that is not, when that pool serves at least the line's quality (`STEER_TO`: SwiftKV -> base model,
        never the reverse); a pinned line stays where the client sent it."""
        to = STEER_TO.get(decision.pool)
        if decision.reason == "pinned" or to not in pools or not pools[to].ready:
            return decision
        if not live_busy(decision.pool) or live_busy(to):
            return decision
        return Decision(to, "batch_steered", decision.ratio)
