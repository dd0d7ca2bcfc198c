"""vLLM's KV-cache events, read as they happen: what an engine stored in its prefix cache, evicted from it, or
dropped all at once. An engine publishes them when started with `kv_events_config` (enable_kv_cache_events,
publisher zmq): batches of BlockStored / BlockRemoved / AllBlocksCleared, msgpack-encoded, on a ZMQ PUB socket
(vllm.distributed.kv_events). A `KVEventFeed` subscribes to one such socket from a thread and hands each event's
block hashes to its callbacks; the gateway's prefix-cache index applies them (services/gateway/routing.py).

No vLLM import (the gateway image has none): the batches are decoded as plain msgpack, [ts, [event, ...], rank]
with each event a map tagged by its `type`. Only the engine's own cache counts: events about an offloading tier
(medium CPU or storage) are skipped. ZMQ reconnects by itself, so a restarted engine's events keep arriving; what
is lost between (a slow subscriber, a restart) the index's prediction covers until the next events."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

log = logging.getLogger("swiftkv.kv_events")

Blocks = Callable[[Sequence[bytes | int]], None]


def local_endpoint(kv_events_config: dict) -> str | None:
    """Where to subscribe to the events of an engine on this host started with `kv_events_config` (vLLM's
    KVEventsConfig fields, its defaults: publisher zmq once enabled, endpoint tcp://*:5557); None when it publishes
    none. A bind address's wildcard host becomes this host."""
    if not kv_events_config.get("enable_kv_cache_events") or (kv_events_config.get("publisher") or "zmq") != "zmq":
        return None
    endpoint = kv_events_config.get("endpoint") or "tcp://*:5557"
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


class KVEventFeed:
    """One engine's KV-cache events from `endpoint` (e.g. ipc:///run/kv.sock, tcp://engine:5557), applied as they come:
    `stored(hashes)`, `removed(hashes)`, `cleared()`. `start()` subscribes from a daemon thread; `stop()` ends it."""

    POLL_MS = 200  # how long the thread waits for a batch before it checks whether it should stop

    def __init__(self, endpoint: str, stored: Blocks, removed: Blocks, cleared: Callable[[], None], topic: str = ""):
        self.endpoint, self.topic = endpoint, topic
        self.on_stored, self.on_removed, self.on_cleared = stored, removed, cleared
        self.batches = 0  # batches applied so far
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"routing.kv_events reads vLLM's KV-cache events with pyzmq and msgspec: {e} "
                               "(pip install pyzmq msgspec)") from e
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()
        self._subscribed.wait(5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._subscribed.set()
            while not self._stop.is_set():
                if not sock.poll(self.POLL_MS):
                    continue
                frames = sock.recv_multipart()
                try:
                    self.apply(frames[-1])  # (topic, sequence number, payload)
                except Exception:  # one batch this reader does not understand must not end the feed
                    log.exception("KV-cache events from %s: a batch could not be applied", self.endpoint)
        finally:
            self._subscribed.set()
            sock.close()

    def apply(self, payload: bytes) -> None:
        """One msgpack-encoded batch of events, applied in order."""
        import msgspec

        batch = msgspec.msgpack.decode(payload)
        for event in batch[1]:
            kind = event.get("type")
            if event.get("medium") not in (None, "GPU"):  # an offloading tier's, not the engine's prefix cache
                continue
            if kind == "BlockStored":
                self.on_stored(event["block_hashes"])
            elif kind == "BlockRemoved":
                self.on_removed(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.on_cleared()
        self.batches += 1
