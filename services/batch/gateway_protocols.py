"""What the Batch API needs of the gateway it is attached to (services.serve.runtime attaches it), as protocols: batch work
reaches the gateway only through these, never through its modules. The gateway's `PoolState`, `Decision` and
`RoutePolicy` (services.gateway.routing) and `Gateway` (services.gateway.pipeline) satisfy them."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Callable, Protocol

from starlette.requests import Request


class Pool(Protocol):
    """One pool as batch work sees it: whether it serves, and the live traffic on it."""

    ready: bool
    live_in_flight: int  # live requests from dispatch to the end of their response
    live_ended_at: float  # time.monotonic() when the last of them ended
    on_live_start: list[Callable[[bool], None]]  # called with local=True for a live request here, False for one elsewhere

    def live_busy(self, quiet_seconds: float) -> bool: ...

    def live_elsewhere(self) -> None: ...


class Placement(Protocol):
    """Where a request is routed: the pool that serves it."""

    @property
    def pool(self) -> str: ...


class Steering(Protocol):
    def steer_batch(self, decision: Placement, pools: dict[str, Pool], live_busy: Callable[[str], bool]) -> Placement: ...


class KeyCheck(Protocol):
    def identify(self, authorization: str | None) -> str: ...


class HostGateway(Protocol):
    """The gateway: its pools and route policy, its keys, and its request path for one parsed body."""

    pools: dict[str, Pool]
    policy: Steering
    keys: KeyCheck

    async def read_json(self, request: Request) -> object: ...

    async def prepare(self, data: object, kind: str, source: str = "batch") -> object:
        """The body validated (an APIError if it is not), for run_request: once however often it is retried."""

    async def run_request(self, data: object, kind: str, identity: str, *, source: str = "batch", priority: int = 0,
                          slot: Callable[[Placement], AbstractAsyncContextManager[Placement]] | None = None,
                          first_token: Callable[[], None] | None = None) -> tuple[int, dict]: ...
