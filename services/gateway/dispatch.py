"""Dispatch: the pool an admitted request goes to (the route policy), the call to that pool's backend with the
gateway's bookkeeping (metrics, backlog, output estimate, settling the key's output tokens, the prefix-cache index of
cache-aware routing), and one retry on another pool when the chosen one goes down before the first token."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable, Sequence

from services.common.errors import APIError
from services.serving.backend import BackendDown, ChoiceDelta, GenerateRequest, Output
from swiftkv_core.dual_mode import cache_salt

from . import metrics
from .admission import AdmittedRequest, OutputEstimates
from .rate_limits import RateLimiter
from .routing import Decision, NoPoolAvailable, PoolState, RoutePolicy, engine_blocks, speculation_excluded

log = logging.getLogger("swiftkv.gateway")


class Dispatcher:
    def __init__(self, pools: dict[str, PoolState], policy: RoutePolicy, limiter: RateLimiter, output_estimate: OutputEstimates,
                 set_ready: Callable[[PoolState, bool], None], retry_after: dict[str, str]):
        self.pools = pools
        self.policy = policy
        self.limiter = limiter
        self.output_estimate = output_estimate  # admission's: answers that ran to their end update their key's
        self.set_ready = set_ready  # the pool lifecycle's: a pool found down leaves routing at once
        self.retry_after = retry_after

    def choose(self, admitted: AdmittedRequest, shed: bool = False) -> Decision:
        """The pool for an admitted request, on its prompt tokens and expected output (and, with cache-aware routing,
        what each pool holds of its prompt in its prefix cache, of its key's own where keys' caches are apart); a 503
        when none is ready. `shed` (live requests): a 429 `overloaded` where the pool's SLO sheds it (`shed`)."""
        admitted.generate.key_salt = self.policy.key_salt(admitted.identity)  # the engines' cache_salt, and the index's
        # hashed once: the retry and the index reuse them
        blocks = self.policy.blocks(admitted.generate.prompt_token_ids, admitted.generate.key_salt)
        # where the key's requests with this prompt_cache_key went last (chat and Responses requests may carry one)
        key = getattr(admitted.request, "prompt_cache_key", None)
        hint = None if key is None else self.policy.cache_key_hint(admitted.identity, key)
        try:
            decision = self.policy.decide(admitted.prompt_tokens, admitted.expected_output, self.pools, admitted.pinned, blocks,
                                          speculation_excluded(admitted.generate.sampling) is not None, hint)
        except NoPoolAvailable as e:
            raise APIError(503, f"{e}; try again shortly", "server_error", code="unavailable", headers=self.retry_after) from None
        if shed and (limit := self.pools[decision.pool].slo_max_queue_seconds) is not None:
            self.shed(admitted, decision, limit)
        return decision

    def shed(self, admitted: AdmittedRequest, decision: Decision, limit: float) -> None:
        """The pool's SLO sheds (slo.max_queue_seconds): a 429 `overloaded` now, with Retry-After, when the request's
        predicted time to first token there (the prompt tokens it should find cached not counted) exceeds `limit`;
        counted as `shed` in the pool's SLO attainment."""
        pool = self.pools[decision.pool]
        mode = decision.mode if pool.dual_mode else None
        predicted = pool.ttft_seconds(admitted.prompt_tokens - self.policy.cached_tokens(pool.name, admitted.prompt_tokens,
                                                                                          decision.blocks, mode))
        if predicted <= limit:
            return
        if pool.slo_ttft_seconds is not None:
            metrics.labelled(metrics.slo_ttft, pool.name, "shed").inc()
        wait = max(1, math.ceil(predicted - limit))  # about when the queue ahead has drained to the limit
        raise APIError(429, f"pool {pool.name} is overloaded: this request's predicted time to first token, {predicted:.1f} s, "
                            f"exceeds its limit of {limit:g} s (pools.{pool.name}.slo.max_queue_seconds); retry after "
                            f"{wait} s", "server_error", code="overloaded", headers={"Retry-After": str(wait)})

    async def stream(self, admitted: AdmittedRequest, decision: Decision, t0: float, source: str = "live") -> AsyncIterator[Output]:
        """The backend's outputs from the decided pool. If that pool goes down (BackendDown) before any token went
        out, the request is tried once more on another ready pool (not for a pinned pool), chosen on the same
        prompt tokens and expected output as the first choice. The first attempt's reservation was settled at 0
        by `tracked`, so the retry is charged again (without a 429 check: the request was already admitted)."""
        request, model = self.as_routed(admitted.generate, decision), admitted.request.model
        sent = False
        try:
            async with aclosing(self.tracked(self.pools[decision.pool], model, request, t0, admitted, source,
                                             decision.blocks)) as stream:
                async for out in stream:
                    if any(c.num_tokens or c.text for c in out.choices):
                        sent = True
                    yield out
            return
        except BackendDown as e:
            if sent or decision.reason == "pinned":
                raise
            first_error = e
        try:
            again = self.policy.decide(admitted.prompt_tokens, admitted.expected_output, self.pools, blocks=decision.blocks,
                                       unspeculated=speculation_excluded(request.sampling) is not None)
        except NoPoolAvailable:
            raise first_error from None
        if again.pool == decision.pool:
            raise first_error
        log.warning("pool %s failed before the first token of %s; retrying on pool %s", decision.pool,
                    request.request_id, again.pool)
        metrics.retries.labels(decision.pool, again.pool).inc()
        if admitted.reserved is not None:
            await self.limiter.charge(admitted.identity, admitted.reserved)
        retry = self.as_routed(dataclasses.replace(request, request_id=f"{request.request_id}-r"), again)
        async with aclosing(self.tracked(self.pools[again.pool], model, retry, t0, admitted, source, again.blocks)) as stream:
            async for out in stream:
                yield out

    def as_routed(self, request: GenerateRequest, decision: Decision) -> GenerateRequest:
        """The request as the decided pool's backend gets it: a dual-mode pool's engines are told the model to run it as
        (their own, without it, is the SwiftKV checkpoint's); any other pool's runs its own, as before."""
        mode = decision.mode if self.pools[decision.pool].dual_mode else None
        return request if mode == request.mode else dataclasses.replace(request, mode=mode)

    async def tracked(self, pool: PoolState, model: str, request: GenerateRequest, t0: float, admitted: AdmittedRequest,
                      source: str = "live", blocks: Sequence[bytes] = ()) -> AsyncIterator[Output]:
        """The backend's stream with the gateway's bookkeeping: metrics, the pool's work in flight (routing's load),
        estimates, limits, and the prompt's blocks (`blocks`, cache-aware routing) entered in the prefix-cache index
        as the pool's now, then the blocks its answer filled when the backend reports the answer's token ids."""
        prompt_tokens = len(request.prompt_token_ids)
        m = metrics.for_pool(pool.name, model, source, admitted.route)
        m.in_flight.inc()
        m.prompt_tokens.inc(prompt_tokens)
        prefill_tokens = prompt_tokens - self.note_prefix(pool, request.mode, prompt_tokens, blocks)
        if (key := getattr(admitted.request, "prompt_cache_key", None)) is not None:  # where the next one with it may go
            self.policy.served_cache_key(admitted.identity, key, pool.name, request.mode)
        # set beside the measured TTFT (swiftkv_time_to_first_token_seconds): a wrong cost model shows up there
        metrics.labelled(metrics.predicted_ttft, pool.name).observe(pool.ttft_seconds(prefill_tokens))
        expected_output = admitted.expected_output * max(request.sampling.n, 1)
        pool.dispatched(prefill_tokens, expected_output)
        live = source == "live"
        if live:  # batch work yields to live traffic on this pool until it has been quiet a while (services/batch)
            pool.live_started()
        first_at = None
        queue_seconds = None
        generated = 0
        # the answer's token ids (one choice, a backend that reports them): vLLM caches the blocks they fill too
        answer_ids: list[int] | None = [] if self.policy.index is not None and request.sampling.n == 1 else None
        finished: set[int] | None = None  # choices that ended, of a request settled as it streams
        status = "error"
        # A request without max_tokens, of a key with an output-tokens limit, is settled as it streams: past what it has
        # reserved, each further reservation's worth is taken from the key's bucket before the answer goes on; when the
        # bucket cannot cover it, the request ends there with finish_reason `length` (its engine request aborted).
        cap = self.limiter.limits(admitted.identity).get("output_tokens") if admitted.estimate_output and admitted.reserved else None
        paid = admitted.reserved if cap else None  # output tokens each reservation covers
        extra = taken = 0  # output tokens covered, and taken from the bucket (at most its capacity at once), as it streamed
        cut = False
        try:
            async with aclosing(pool.backend.generate(request)) as stream:
                async for out in stream:
                    if answer_ids is not None:
                        answer_ids = collect_token_ids(answer_ids, out)
                    if out.queue_seconds is not None:
                        queue_seconds = out.queue_seconds
                        m.queue.observe(queue_seconds)
                    n = sum(c.num_tokens for c in out.choices)
                    if first_at is None and n:
                        first_at = time.perf_counter()
                        pool.first_token(prefill_tokens, first_at - t0, queue_seconds)
                        m.ttft.observe(first_at - t0)
                        if live and pool.slo_ttft_seconds is not None:  # the pool's SLO attainment
                            (m.slo_within if first_at - t0 <= pool.slo_ttft_seconds else m.slo_over).inc()
                    generated += n
                    yield out
                    if paid is not None:
                        if finished is None:
                            finished = set()
                        finished.update(c.index for c in out.choices if c.finish_reason)
                        if generated >= paid + extra and len(finished) < max(request.sampling.n, 1):
                            try:  # one more reservation's worth, or the end
                                await self.limiter.acquire(admitted.identity, 0, paid, requests=0)
                                extra += paid
                                taken += min(paid, cap)
                            except APIError:
                                cut = True
                                break
            if cut:  # outside the backend's stream: it is closed (the engine request aborted) before the last output goes out
                yield Output([ChoiceDelta(i, "", 0, "length") for i in range(max(request.sampling.n, 1)) if i not in finished])
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            # No client waits on a batch request: only the batch runner stops one (preempted, cancelled, expired).
            status = "client_disconnect" if live else "aborted"
            raise
        except BackendDown:
            # The pool cannot serve (engine dead, server unreachable): route around it now; the health
            # watcher brings it back once it answers. A failure of one request leaves the pool in routing.
            self.set_ready(pool, False)  # which also empties the pool's entries in the prefix-cache index
            raise
        finally:
            end = time.perf_counter()
            if answer_ids and status != "error":
                self.note_answer(pool, request, blocks, answer_ids)
            if live:
                pool.live_ended()
            if first_at is None:
                pool.first_token(prefill_tokens, 0.0)
            batch = pool.batch()  # sequences per replica as it ended, its own included: its decode rate's bucket
            pool.ended(expected_output)
            m.in_flight.dec()
            m.requests[status].inc()
            m.generation_tokens.inc(generated)
            m.e2e.observe(end - t0)
            per_choice = generated / max(request.sampling.n, 1)
            if first_at is not None and per_choice > 1:
                tpot = (end - first_at) / (per_choice - 1)
                m.tpot.observe(tpot)
                pool.decoded(tpot, batch)
            if status == "ok" and admitted.estimate_output and not cut:  # a cut answer did not run to its own end
                self.output_estimate.update(admitted.identity, admitted.request.model, per_choice, request.sampling.max_tokens)
            if admitted.reserved is not None:  # charge what was generated, beyond the reservation too (less what streaming took)
                self.limiter.settle_soon(admitted.identity, admitted.reserved, generated - taken)

    def note_prefix(self, pool: PoolState, mode: str | None, prompt_tokens: int, blocks: Sequence[bytes]) -> int:
        """Cache-aware routing: the prompt tokens the pool should find cached for the model `mode` it runs the request as
        (None: its own; returned, and counted in the metrics, to check the index against vLLM's own prefix-cache hits),
        then the prompt's blocks as the most recently used of that pool and model: vLLM caches them as it prefills. 0
        without an index."""
        index = self.policy.index
        if index is None:
            return 0
        cached = self.policy.cached_tokens(pool.name, prompt_tokens, blocks, mode)
        metrics.labelled(metrics.prefix_cached_tokens, pool.name).inc(cached)
        self.policy.record(pool.name, blocks, mode)
        return cached

    def note_answer(self, pool: PoolState, request: GenerateRequest, blocks: Sequence[bytes], answer_ids: Sequence[int]) -> None:
        """The blocks that prompt and answer filled, as vLLM caches them: every token but the last sampled one has
        its KV computed, so a conversation's next turn (the history, then this answer, then a new question) finds
        them in the pool (and model) that answered. Hashed on from the prompt's last full block (`blocks`, hashed at dispatch)."""
        index = self.policy.index
        if index is None:
            return
        computed = [*request.prompt_token_ids, *answer_ids][:-1]
        blocks = engine_blocks(blocks, request.mode)  # as the engine keys them (a dual-mode engine's base mode: salted)
        more = index.hashes(computed[len(blocks) * index.block_size:], parent=blocks[-1] if blocks else None,
                            salt=cache_salt(request.mode, request.key_salt))  # counts where the chain starts here
        if more:
            index.record(pool.name, [*blocks, *more])




def collect_token_ids(ids: list[int], out: Output) -> list[int] | None:
    """`ids` extended by this output's token ids; None once an output has tokens without their ids (remote servers)."""
    for c in out.choices:
        if c.token_ids is None and c.num_tokens:
            return None
        ids.extend(c.token_ids or ())
    return ids


async def calling_on_first_token(stream: AsyncIterator[Output], callback: Callable[[], None]) -> AsyncIterator[Output]:
    """`stream`, calling `callback()` when its first output token arrives."""
    async with aclosing(stream) as s:
        waiting = True
        async for out in s:
            if waiting and any(c.num_tokens for c in out.choices):
                waiting = False
                callback()
            yield out
