"""Works batches: takes a batch's lease, replays its lines through the gateway (the same validation,
routing and backends as live traffic, at a lower engine priority), commits each finished line, and
writes the output and error files once every line is done, or the batch is cancelled or expired.

Live traffic comes first, in three ways (settings in `BatchConfig`):
- A pool is live-busy while a live request is in flight on it (from dispatch to the end of its response)
  and for `live_quiet_seconds` after the last one ended. A live-busy pool takes at most `min_in_flight`
  batch requests at once, any other pool `max_in_flight`. (vLLM runs the requests it has started, batch
  ones included, before waiting ones whatever their priority, so a live request shares every engine step
  with the batch requests already running: only keeping them out of its pool keeps its latency.)
- A line routed to a live-busy pool moves to a ready pool that is not live-busy when that does not lower
  its quality: from the SwiftKV pool to the base-model pool, never the reverse (route reason
  `batch_steered`, `RoutePolicy.steer_batch`). Where it is placed is decided while it waits for a slot.
- Batch requests carry vLLM priority `priority`, so a priority-scheduling engine admits waiting live
  requests ahead of them.
- When a live request arrives on a pool, that pool's batch requests beyond `min_in_flight` that have no output
  token yet are aborted, the youngest first, and their lines queued again (`preempt_prefills`): a prefill is
  the expensive part of an engine step, and vLLM would run them ahead of the waiting live request.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import logging
import os
import secrets
import socket
import time
from collections import defaultdict, deque
from contextlib import asynccontextmanager, suppress
from operator import itemgetter
from typing import AsyncIterator, Iterable

from sqlalchemy.exc import OperationalError

from services.common.errors import APIError, bad_request
from services.common.files import FileStore, Incoming
from services.common.threads import Threads
from services.common.waiting import wait_event
from services.config import BatchConfig

from . import metrics
from .batch_input import ENDPOINTS, Line, error, parse_input, read_body
from .gateway_protocols import HostGateway, Placement, Pool, Steering
from .store import BatchStore

log = logging.getLogger("swiftkv.batch")

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was not executed: the batch was cancelled."
MAX_RATE_LIMIT_PAUSE = 60.0  # a key's per-minute buckets refill completely within a minute
# The statuses each final status may be set from: a cancel is never overwritten by a completion or an expiry.
FINAL_FROM = {"completed": ("finalizing",), "expired": ("in_progress",), "cancelled": ("cancelling",)}


class PoolSlots:
    """Which pool a batch line runs on and the bound on batch requests in flight per pool, both following the
    live traffic on the gateway's pools."""

    def __init__(self, cfg: BatchConfig, pools: dict[str, Pool], policy: Steering):
        self.cfg, self.pools, self.policy = cfg, pools, policy
        self.busy: dict[str, int] = defaultdict(int)
        self.freed = asyncio.Event()
        # per pool, the tasks holding its slots in the order they took them -> whether their first token came
        self.running: dict[str, dict[asyncio.Task, bool]] = defaultdict(dict)
        self.preempted: set[asyncio.Task] = set()
        for name, pool in pools.items():
            metrics.preempted.labels(name)  # a series at 0 from the start, so its rate() is 0 rather than absent
            if cfg.preempt_prefills:
                pool.on_live_start.append(functools.partial(self.make_way, name))

    def make_way(self, pool: str, local: bool = True) -> None:
        """A live request arrived on `pool` (in this process or another): abort its batch requests still waiting for their first token beyond
        `min_in_flight`, the youngest (least work lost) first."""
        running = self.running[pool]
        excess = len(running) - self.cfg.min_in_flight
        for task in reversed(list(running)):
            if excess <= 0:
                break
            if not running[task] and task.cancel():
                self.preempted.add(task)
                metrics.preempted.labels(pool).inc()
                excess -= 1

    def first_token(self) -> None:
        """Called by the task holding a slot when its request's first token arrives: it is no longer a prefill."""
        task = asyncio.current_task()
        for running in self.running.values():
            if task in running:
                running[task] = True

    def was_preempted(self, task: asyncio.Task) -> bool:
        if task in self.preempted:
            self.preempted.discard(task)
            return True
        return False

    def live_busy(self, pool: str) -> bool:
        return self.pools[pool].live_busy(self.cfg.live_quiet_seconds)

    def allowed(self, pool: str) -> int:
        n = self.cfg.min_in_flight if self.live_busy(pool) else self.cfg.max_in_flight
        metrics.in_flight_limit.labels(pool).set(n)
        return n

    @asynccontextmanager
    async def __call__(self, decision: Placement) -> AsyncIterator[Placement]:
        """Wait for a slot on the line's pool, or on the pool it is steered to; yields the decision served."""
        # Re-check when a batch request ends, and every 100 ms for live requests coming and going (they do
        # not tell us; batch work can wait that long).
        while True:
            placed = self.policy.steer_batch(decision, self.pools, self.live_busy)
            if self.busy[placed.pool] < self.allowed(placed.pool):
                break
            self.freed.clear()
            await wait_event(self.freed, 0.1)
        pool = placed.pool
        self.busy[pool] += 1
        self.running[pool][asyncio.current_task()] = False
        metrics.in_flight.labels(pool).inc()
        try:
            yield placed
        finally:
            self.running[pool].pop(asyncio.current_task(), None)
            self.busy[pool] -= 1
            metrics.in_flight.labels(pool).dec()
            self.freed.set()


class Runner:
    """One per gateway process; several processes on one database share the work through leases."""

    def __init__(self, store: BatchStore, files: FileStore, gateway: HostGateway, cfg: BatchConfig, io: Threads):
        self.store, self.files, self.gateway, self.cfg, self.io = store, files, gateway, cfg, io
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.slots = PoolSlots(cfg, gateway.pools, gateway.policy)
        self.jobs: dict[str, Job] = {}
        self.wake = asyncio.Event()

    async def run(self) -> None:
        checked = 0.0
        while True:
            if time.monotonic() - checked >= self.cfg.poll_seconds:
                checked = time.monotonic()
                await self.update_backlog()
            try:
                if len(self.jobs) < self.cfg.max_active_batches and any(p.ready for p in self.gateway.pools.values()):
                    # The last free slot is for a key with no batch here: one key's batches never take them all
                    # (one batch alone can fill the pools' batch slots, so a slot left empty costs little).
                    last = len(self.jobs) == self.cfg.max_active_batches - 1
                    owners = {job.batch["owner"] for job in self.jobs.values()} if last else ()
                    batch = await self.io(self.store.claim, self.worker, self.cfg.lease_seconds, list(self.jobs), owners,
                                           self.cfg.max_attempts)
                    if batch is not None:
                        self.start_job(batch)
                        continue
            except Exception:
                log.exception("batch runner: looking for work")
            self.wake.clear()
            await wait_event(self.wake, self.cfg.poll_seconds)

    async def update_backlog(self) -> None:
        """The backlog gauge, from the store: every gateway on one database reports the same age."""
        try:
            oldest = await self.io(self.store.oldest_pending)
        except Exception as e:  # the database is away: keep the last value, try again next poll
            log.warning("batch runner: reading the backlog: %s", e)
            return
        metrics.oldest_pending_age.set(max(0.0, time.time() - oldest) if oldest is not None else 0.0)

    def start_job(self, batch: dict) -> None:
        job = Job(self, batch)
        self.jobs[batch["id"]] = job
        job.task = asyncio.create_task(job.run())
        job.task.add_done_callback(lambda _t, i=batch["id"]: self.jobs.pop(i, None))

    def cancel_requested(self, batch_id: str) -> None:
        """The API saw a cancel: a batch worked here stops at once (elsewhere, at its next lease renewal)."""
        job = self.jobs.get(batch_id)
        if job is not None:
            job.halt("cancelled")

    async def stop(self) -> None:
        """Stop working and hand the leases back, so another process can take over without waiting."""
        jobs = list(self.jobs.values())
        for job in jobs:
            job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs), return_exceptions=True)
        for job in jobs:
            with suppress(Exception):
                await self.io(self.store.release, job.id, self.worker)


class Job:
    """One batch while this process holds its lease."""

    def __init__(self, runner: Runner, batch: dict):
        self.runner = runner
        self.batch = batch
        self.id = batch["id"]
        self.path = runner.files.path(batch["input_file_id"])
        self.task: asyncio.Task | None = None
        self.stop = asyncio.Event()
        self.reason: str | None = None  # why it stopped early: cancelled | expired | lost (the lease)
        self.serving: set[asyncio.Task] = set()
        # The key is over its per-minute limits: no line is sent before resume_at (monotonic), a longer pause each time.
        self.resume_at = 0.0
        self.backoff = 0.0

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()
        for task in self.serving:  # closing the stream aborts the engine request
            task.cancel()

    async def pause(self, seconds: float) -> bool:
        """Wait `seconds`, or less if the job stops meanwhile; True if it stopped."""
        return await wait_event(self.stop, seconds)

    async def run(self) -> None:
        r = self.runner
        keeper = asyncio.create_task(self.keep_lease())
        try:
            await self.process()
        except asyncio.CancelledError:
            raise
        except OperationalError as e:  # the database is away: not the batch's fault, so not counted
            log.warning("batch %s: the store failed (%s); the lease is released for a retry", self.id, e)
            with suppress(Exception):
                await r.io(r.store.release, self.id, r.worker)
            await asyncio.sleep(r.cfg.poll_seconds)
        except Exception as e:
            # Whatever it was (a bug, a disk error) may happen again each time: retry, but only so often.
            log.exception("batch %s: runner error; the lease is released for a retry", self.id)
            reason = error("batch_processing_failed", f"the batch could not be processed: it failed {r.cfg.max_attempts} "
                           f"times in a row, the last time with {type(e).__name__}: {str(e)[:300]}")
            with suppress(Exception):
                if await r.io(r.store.fail_attempt, self.id, r.worker, r.cfg.max_attempts, [reason]):
                    metrics.finished.labels("failed").inc()
                    log.error("batch %s failed after %d attempts", self.id, r.cfg.max_attempts)
            await asyncio.sleep(r.cfg.poll_seconds)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    async def process(self) -> None:
        r = self.runner
        lines, errors = await r.io(self.read_input)
        if errors:
            if await r.io(r.store.finish, self.id, r.worker, {
                    "status": "failed", "failed_at": int(time.time()), "errors": {"object": "list", "data": errors}}, []):
                metrics.finished.labels("failed").inc()
            return
        if self.batch["status"] == "validating" or self.batch["total"] != len(lines):
            await r.io(r.store.update_held, self.id, r.worker, total=len(lines))
            # only from validating: a cancel that came while the file was checked keeps its status
            await r.io(r.store.update_held, self.id, r.worker, ("validating",), status="in_progress", in_progress_at=int(time.time()))
            self.batch = await r.io(r.store.get_batch, None, self.id)
        done = await r.io(r.store.done_lines, self.id)
        todo = deque(line for line in lines if line.number not in done)
        if self.batch["status"] == "cancelling":
            self.reason = "cancelled"
        elif todo and time.time() >= self.batch["expires_at"]:
            self.reason = "expired"
        if todo and self.reason is None:
            await self.work(todo)
        self.stop.set()  # no line runs from here on; the lease is still renewed until the files are written
        if self.reason == "lost":
            log.info("batch %s: lease lost; another worker has it", self.id)
            return
        await self.finalize(lines, {"cancelled": "cancelled", "expired": "expired"}.get(self.reason, "completed"))

    def read_input(self) -> tuple[list[Line], list[dict]]:
        if not self.path.exists():
            return [], [error("file_not_found", f"the input file {self.batch['input_file_id']} no longer exists")]
        return parse_input(self.path, self.batch["endpoint"], self.runner.cfg.max_lines, self.runner.cfg.max_line_bytes)

    async def work(self, todo: deque[Line]) -> None:
        width = self.runner.cfg.max_in_flight * max(1, len(self.runner.gateway.pools))
        workers = [asyncio.create_task(self.drain(todo)) for _ in range(min(width, len(todo)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in [*workers, *self.serving]:  # on shutdown, abort the engine requests too
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def keep_lease(self) -> None:
        """Renew the lease for the whole job, winding down and writing the files included (a lapsed lease
        would let another worker finish the batch from the lines committed so far); while lines run, notice a
        cancel made through another process, and the end of the completion window."""
        r = self.runner
        period = min(r.cfg.lease_seconds / 3, r.cfg.poll_seconds)
        while True:
            left = self.batch["expires_at"] - time.time()
            if left <= 0 and not self.stop.is_set():
                self.halt("expired")
            await asyncio.sleep(min(period, left) if left > 0 else period)
            try:
                # Renewing also reads the status: a cancel made through another gateway shows up within poll_seconds.
                row = await r.io(r.store.renew, self.id, r.worker, r.cfg.lease_seconds)
            except Exception as e:  # the database is away: keep working, try again next tick
                log.warning("batch %s: renewing the lease: %s", self.id, e)
                continue
            if self.stop.is_set():
                continue
            if row is None:
                self.halt("lost")
            elif row["status"] == "cancelling":
                self.halt("cancelled")

    async def drain(self, todo: deque[Line]) -> None:
        while todo and not self.stop.is_set():
            await self.serve(todo.popleft())

    async def serve(self, line: Line) -> None:
        r = self.runner
        kind = ENDPOINTS[self.batch["endpoint"]]
        request = await r.io(read_body, self.path, line)  # read when it runs: the job holds no bodies but those in flight
        if request.get("stream") not in (None, False):
            # Refused here, before the gateway charges the key's limits for a request it would then refuse.
            await r.io(r.store.record, self.id, line.number, line.custom_id, 400, secrets.token_hex(12),
                       bad_request("stream is not supported in a batch", param="stream").body())
            return
        try:  # validated once, off the loop: a retry (after a 429, a pool down, a preemption) costs only the limiter call
            request = await r.gateway.prepare(request, kind)
        except APIError as e:
            await r.io(r.store.record, self.id, line.number, line.custom_id, e.status, secrets.token_hex(12), e.body())
            return
        while True:
            if self.resume_at > time.monotonic() and await self.pause(self.resume_at - time.monotonic()):
                return
            sent = time.monotonic()
            task = asyncio.create_task(r.gateway.run_request(request, kind, self.batch["owner"], source="batch",
                                                             priority=r.cfg.priority, slot=r.slots, first_token=r.slots.first_token))
            self.serving.add(task)
            try:
                await asyncio.wait({task})
            finally:
                self.serving.discard(task)
            if task.cancelled():
                if r.slots.was_preempted(task) and not self.stop.is_set():
                    continue  # it made way for a live request: run it again
                return  # halted: the line stays undone
            if task.exception() is not None:
                log.error("batch %s line %d: %r", self.id, line.number, task.exception())
                status, body = 500, {"error": {"message": "internal error", "type": "server_error", "param": None, "code": None}}
            else:
                status, body = task.result()
            code = body.get("error", {}).get("code") if status != 200 else None
            # A pool that is down is not the line's fault: wait for it, as a client would retry.
            if status == 503 and code == "unavailable":
                if await self.pause(r.cfg.poll_seconds):
                    return
                continue
            # Lines are charged to the key's per-minute limits like its live requests: over them, the whole job
            # waits (not the line failing), twice as long after each refusal of a line sent since the last pause.
            if status == 429 and code == "rate_limit_exceeded":
                if sent >= self.resume_at:
                    self.backoff = min(max(2 * self.backoff, r.cfg.poll_seconds), MAX_RATE_LIMIT_PAUSE)
                    self.resume_at = time.monotonic() + self.backoff
                continue
            self.backoff = 0.0
            break
        request_id = body["id"].split("-", 1)[-1] if status == 200 and isinstance(body.get("id"), str) else secrets.token_hex(12)
        await r.io(r.store.record, self.id, line.number, line.custom_id, status, request_id, body)

    async def finalize(self, lines: list[Line], final: str) -> None:
        r = self.runner
        if final == "completed" and not await r.io(r.store.update_held, self.id, r.worker, ("in_progress", "finalizing"),
                                                   status="finalizing", finalizing_at=int(time.time())):
            # A cancel came after the last line: it wins, and the batch keeps its results (as OpenAI's does).
            # (Or the lease was lost, which finish() below notices.)
            final = "cancelled"
        while True:
            parts, new_files, values = await r.io(self.write_outputs, lines, final)
            values |= {"status": final, f"{final}_at": int(time.time())}
            try:
                # The files move into place inside finish(), only while this worker still holds the lease.
                done = await r.io(r.store.finish, self.id, r.worker, values, new_files, FINAL_FROM[final],
                                  functools.partial(_commit, parts))
            finally:
                for part in parts:  # removes what was not moved into place (a lost lease, an error)
                    part.discard()
            if done:
                metrics.finished.labels(final).inc()
                log.info("batch %s %s", self.id, final)
                return
            if final != "expired":
                return  # the lease was lost: its new holder finishes the batch
            final = "cancelled"  # cancelled while its files were written

    def write_outputs(self, lines: list[Line], final: str) -> tuple[list[Incoming], list[dict], dict]:
        """The output file (successes) and error file (failures, and lines never run), in input order, each
        written as it is read from the store into a part file of this writer's own (another worker whose lease
        lapsed may be writing the same file id), committed by finalize. File ids derive from the batch id, so
        finishing twice (after a crash) rewrites the same files.

        Output files are not checked against the key's storage quota: OpenAI still produces a batch's output, so it is
        written and counted (FileRecords.used sums every file row of the key), and the key can upload nothing more
        until it deletes files or they expire."""
        r, owner, suffix = self.runner, self.batch["owner"], self.id.removeprefix("batch_")

        def entry(row: dict) -> tuple[int, bytes]:
            return row["line"], _line({"id": f"batch_req_{row['request_id']}", "custom_id": row["custom_id"], "error": None,
                                       "response": {"status_code": row["status_code"], "request_id": row["request_id"],
                                                    "body": json.loads(row["body"])}})

        unrun: Iterable[tuple[int, bytes]] = ()
        if final != "completed":
            done, message = r.store.done_lines(self.id), EXPIRED_MESSAGE if final == "expired" else CANCELLED_MESSAGE
            unrun = ((line.number, _line({"id": f"batch_req_{suffix}_{line.number}", "custom_id": line.custom_id, "response": None,
                                          "error": {"code": f"batch_{final}", "message": message}}))
                     for line in lines if line.number not in done)
        failures = heapq.merge(map(entry, r.store.results(self.id, ok=False)), unrun, key=itemgetter(0))
        parts, new_files, values, now = [], [], {"output_file_id": None, "error_file_id": None}, int(time.time())
        try:
            for field, file_id, content in (("output_file_id", f"file-{suffix}-output", map(entry, r.store.results(self.id, ok=True))),
                                            ("error_file_id", f"file-{suffix}-errors", failures)):
                first = next(content, None)
                if first is not None:
                    part = Incoming(r.files.root / f".{file_id}.{secrets.token_hex(6)}.part", r.files.path(file_id))
                    parts.append(part)
                    for _, data in itertools.chain([first], content):
                        part.write(data)
                    new_files.append({"id": file_id, "owner": owner, "purpose": "batch_output",
                                      "filename": f"{self.id}_{field[:-8]}.jsonl", "bytes": part.size, "created_at": now})
                    values[field] = file_id
        except BaseException:
            for part in parts:
                part.discard()
            raise
        return parts, new_files, values


def _commit(parts: list[Incoming]) -> None:
    for part in parts:
        part.commit()


def _line(entry: dict) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode() + b"\n"
