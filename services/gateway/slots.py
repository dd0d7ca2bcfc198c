"""Request slots: how many requests a key, and the gateway process, hold at once.

- Per key (`limits.max_concurrent_requests_per_key`, or the key's own `max_concurrent_requests` in the keys file): a
  key's generation, /tokenize and /detokenize requests are counted from the moment they arrive, reading the body
  included, until their last byte is sent. Past its share the next is a 429 naming the setting, before its body is read.
  So one key's slow bodies hold only its own share, never the other keys' slots.
- Shared (`limits.max_concurrent_requests`): a request takes one of the process's slots only once its body is in and
  its key charged (the handler calls `Slots.take`), and holds it to its last byte. When they are all held it waits up
  to `limits.slot_wait_seconds` for one, in a queue that is FIFO per key and round-robin across keys (a slot that
  frees goes to the next key in turn, so one key's many waiters never starve another's); past the wait, or with the
  queue as long as the slots, it is a 503 with Retry-After. A client that leaves while waiting gives up its place.

Bookkeeping is counters and a dict on the event loop: no lock, task or thread hop for a request that does not wait
(a waiting one has one watcher task, for its client's disconnect).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

from starlette.responses import Response

from services.common.errors import APIError
from services.common.keys import KeyStore

from . import metrics

TICKET = "swiftkv.slot"  # scope key: [identity, holds a shared slot]; the handler's Admission.identify reads the identity


class Slots:
    """The per-key counts and the shared slots of one gateway process (one event loop)."""

    def __init__(self, limits, keys: KeyStore, retry_after: int = 1):
        self.limit: int | None = limits.max_concurrent_requests
        self.per_key: int | None = limits.max_concurrent_requests_per_key
        self.wait_seconds: float = limits.slot_wait_seconds
        self.keys = keys
        self.retry_after = retry_after
        self.active = 0  # shared slots held
        self.held: dict[str, int] = {}  # per key: its requests from arrival to their last byte
        self.queues: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # per key, its waiters; keys in turn
        self.waiting = 0

    # ---- per key, from arrival -------------------------------------------------------------------
    def share(self, identity: str) -> int | None:
        """The requests this key may hold at once: its own setting in the keys file, else the config's (None: no bound)."""
        s = self.keys.table.get(identity)
        own = None if s is None else s.max_concurrent_requests
        return self.per_key if own is None else own

    def arrive(self, identity: str) -> list | None:
        """Count a request of `identity` -> its ticket; None when the key holds its share already (a 429)."""
        n = self.held.get(identity, 0)
        if n:
            share = self.share(identity)
            if share is not None and n >= share:
                return None
        self.held[identity] = n + 1
        return [identity, False]

    def leave(self, ticket: list) -> None:
        """The request's last byte went out (or it was refused): its key's count, and its shared slot if it took one."""
        identity = ticket[0]
        n = self.held[identity] - 1
        if n:
            self.held[identity] = n
        else:
            del self.held[identity]
        if ticket[1]:
            ticket[1] = False
            self._release()

    def too_many(self, identity: str) -> APIError:
        share = self.share(identity)
        own = self.keys.table.get(identity)
        setting = ("this key's max_concurrent_requests in the keys file" if own is not None and own.max_concurrent_requests
                   is not None else "limits.max_concurrent_requests_per_key")
        return APIError(429, f"this key already has {share} requests in progress, its limit of concurrent requests "
                             f"({setting}); retry after {self.retry_after} s, once one of them has finished", "requests",
                        code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after)})

    # ---- the shared slots, once the body is in ---------------------------------------------------
    def overloaded(self) -> APIError:
        return APIError(503, f"this gateway is at its limit of {self.limit} concurrent requests "
                             f"(limits.max_concurrent_requests); retry after {self.retry_after} s", "server_error",
                        code="overloaded", headers={"Retry-After": str(self.retry_after)})

    async def take(self, request) -> Response | None:
        """Take a shared slot for this request (its body read and its key charged), waiting for one in the fair queue if
        need be: None once held (until its ticket leaves), else the answer to send: a 503 past
        limits.slot_wait_seconds or with the queue full (counted as `overloaded`), a 499 when the client left while
        waiting. A request that came past no per-key count (not a capped route) takes nothing."""
        ticket = request.scope.get(TICKET)
        if ticket is None or ticket[1] or self.limit is None:
            return None
        if self.active < self.limit:  # nobody waits while a slot is free: a freed slot goes to a waiter first
            self.active += 1
            ticket[1] = True
            metrics.requests_active.set(self.active)
            return None
        if self.wait_seconds > 0 and self.waiting < self.limit:
            outcome = await self._wait(ticket[0], request.receive)
            if outcome == "served":
                ticket[1] = True
                return None
            if outcome == "client_gone":
                return Response(status_code=499)
        metrics.rejections.labels("overloaded", "live").inc()
        return self.overloaded().response()

    async def _wait(self, identity: str, receive) -> str:
        """Wait in `identity`'s queue -> served (a slot was handed over), timeout or client_gone."""
        loop = asyncio.get_running_loop()
        slot = loop.create_future()  # its result: a slot handed over by _release; ClientGone: the client left
        queue = self.queues.get(identity)
        if queue is None:
            queue = self.queues[identity] = deque()
        queue.append(slot)
        self.waiting += 1
        metrics.requests_waiting.set(self.waiting)

        async def watch() -> None:  # the body is in: the next message is the client's disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
            if not slot.done():
                slot.set_exception(ClientGone())

        watcher = loop.create_task(watch())
        t0, outcome = time.perf_counter(), "timeout"
        try:
            async with asyncio.timeout(self.wait_seconds):
                await slot
            outcome = "served"
        except ClientGone:
            outcome = "client_gone"
        except TimeoutError:
            pass
        finally:
            watcher.cancel()
            self.waiting -= 1
            metrics.requests_waiting.set(self.waiting)
            metrics.labelled(metrics.slot_wait, outcome).observe(time.perf_counter() - t0)
            if outcome != "served":
                if slot.done() and not slot.cancelled() and slot.exception() is None:
                    self._release()  # handed a slot just as it gave up: on to the next
                else:
                    slot.cancel()
                    if slot in queue:
                        queue.remove(slot)
                    if not queue and self.queues.get(identity) is queue:
                        del self.queues[identity]
        return outcome

    def _release(self) -> None:
        """A shared slot frees: straight to the first waiter of the next key in turn (so a request arriving now cannot
        overtake the queue), else back to the pool."""
        queues = self.queues
        while queues:
            identity = next(iter(queues))
            queue = queues[identity]
            slot = queue.popleft()
            if queue:
                queues.move_to_end(identity)  # its next waiter after every other key's first
            else:
                del queues[identity]
            if not slot.done():
                slot.set_result(None)
                return
        self.active -= 1
        metrics.requests_active.set(self.active)


class ClientGone(Exception):
    """The client disconnected while its request waited for a slot."""


class KeySlots:
    """ASGI middleware: counts each request on `paths` against its key's share from its arrival (a 429 past it, before
    its body is read), leaves a ticket in the scope for the handler's `Slots.take`, and frees both at the last byte."""

    def __init__(self, app, slots: Slots, paths: tuple[str, ...]):
        self.app = app
        self.slots = slots
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        slots = self.slots
        keys = slots.keys
        if keys.enabled:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                identity = keys.identify(authorization.decode("latin-1") if authorization is not None else None)
            except APIError:  # the route answers it (a 401), before reading any body
                return await self.app(scope, receive, send)
        else:
            identity = "anonymous"
        ticket = slots.arrive(identity)
        if ticket is None:
            metrics.rejections.labels("key_concurrency", "live").inc()
            return await slots.too_many(identity).response()(scope, receive, send)
        scope[TICKET] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            slots.leave(ticket)
