"""The Batch API's durable state behind one narrow interface: batches and one row per finished line, beside the
file records (services.common.files) in the same database. SQLAlchemy 2 Core, the same code on an embedded SQLite
file and on PostgreSQL.

Exactly-once: a line's result is keyed by (batch, line), and the batch's counters move in the same
transaction as the insert, so a line counts once however many workers served it. A batch is worked by
the holder of its lease (claimed with FOR UPDATE SKIP LOCKED where the database has it, and always by a
compare-and-set on the lease's expiry), and taken over when the holder stops renewing it. Claims go to the
key with the fewest batches being worked, so one key's batches cannot hold every runner. A status moves
only from the statuses it may come from (compare-and-set), so a cancel is never overwritten by a runner.
A final batch keeps no line results: its output and error files hold them (and expire, or are deleted, with them).

Every method is synchronous and short; async callers run them in a thread.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Collection, Iterator

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from services.common.database import select_page
from services.common.files import open_store

metadata = MetaData()

batches = Table(
    "swiftkv_batches", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False, index=True),
    Column("completion_window", String(16), nullable=False),
    Column("metadata", JSON),
    Column("status", String(16), nullable=False, index=True),
    Column("errors", JSON),
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    *(Column(f"{t}_at", BigInteger) for t in ("created", "in_progress", "expires", "finalizing", "completed", "failed",
                                              "expired", "cancelling", "cancelled")),
    Column("total", Integer, nullable=False, default=0),
    Column("completed", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("prompt_tokens", BigInteger, nullable=False, default=0),
    Column("completion_tokens", BigInteger, nullable=False, default=0),
    # of prompt_tokens, those the engines read from their prefix caches (the lines' usage.prompt_tokens_details)
    Column("cached_tokens", BigInteger, nullable=False, default=0, server_default="0"),
    Column("lease_owner", String(128)),
    Column("lease_until", Float),
    # failed attempts at processing the batch since its last finished line (the runner gives up at batch.max_attempts)
    Column("attempts", Integer, nullable=False, server_default="0"),
)

results = Table(
    "swiftkv_batch_results", metadata,
    Column("batch_id", String(64), primary_key=True),
    Column("line", Integer, primary_key=True),  # 1-based line number in the input file
    Column("custom_id", String(512), nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("status_code", Integer, nullable=False),
    Column("request_id", String(64), nullable=False),
    Column("body", Text, nullable=False),  # the JSON response or error body, as served
)

# Statuses a runner still has work for; the others are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("failed", "completed", "expired", "cancelled")
# Statuses counted against batch.max_active_per_key: the batches whose lines are still to run or be written.
CAPPED = ("validating", "in_progress", "finalizing")


class TooManyActive(Exception):
    def __init__(self, active: int, limit: int):
        super().__init__(f"{active} active batches; the limit is {limit}")
        self.active, self.limit = active, limit


def _drop_results(conn, batch_id: str) -> None:
    """A final batch's line results: its output and error files hold them from now on (or, failed, nobody reads
    them), so they go rather than grow the database forever."""
    conn.execute(delete(results).where(results.c.batch_id == batch_id))


class BatchStore:
    """The batches and their results, beside the file rows (`files`, the file-records store) in the same database."""

    def __init__(self, url: str):
        self.engine, self.files = open_store(url, metadata)

    def close(self) -> None:
        self.engine.dispose()

    def file_in_use(self, file_id: str) -> bool:
        """An input file of a batch that is still running."""
        q = select(func.count()).select_from(batches).where(batches.c.input_file_id == file_id, batches.c.status.in_(ACTIVE))
        with self.engine.connect() as conn:
            return conn.execute(q).scalar_one() > 0

    # ---- batches ---------------------------------------------------------------------------------
    def add_batch(self, record: dict, max_active: int | None = None) -> None:
        """Insert the batch; with `max_active`, refused with TooManyActive (nothing kept) when its key would then
        have more than that many batches in CAPPED statuses."""
        with self.engine.begin() as conn:
            if max_active is not None and conn.dialect.name == "postgresql":
                # one key's creates one at a time, so two concurrent ones cannot both pass at the limit
                conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(record["owner"]))))
            conn.execute(insert(batches).values(**record))  # on SQLite the insert takes the write lock first
            if max_active is not None:
                active = conn.execute(select(func.count()).select_from(batches).where(
                    batches.c.owner == record["owner"], batches.c.status.in_(CAPPED))).scalar_one()
                if active > max_active:
                    raise TooManyActive(active - 1, max_active)

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        q = select(batches).where(batches.c.id == batch_id)
        if owner is not None:
            q = q.where(batches.c.owner == owner)
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
        return dict(row) if row else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, like OpenAI; `after` is the last id of the previous page."""
        return select_page(self.engine, batches, select(batches).where(batches.c.owner == owner), after, limit)

    def request_cancel(self, owner: str, batch_id: str, now: int) -> dict | None:
        """validating / in_progress -> cancelling; other statuses are left as they are (the caller says why)."""
        with self.engine.begin() as conn:
            conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.owner == owner,
                                               batches.c.status.in_(("validating", "in_progress")))
                         .values(status="cancelling", cancelling_at=now))
        return self.get_batch(owner, batch_id)

    # ---- the runner's side -----------------------------------------------------------------------
    def claim(self, worker: str, lease_seconds: float, running: Collection[str] = (), skip_owners: Collection[str] = (),
              max_attempts: int | None = None) -> dict | None:
        """Take the lease of one active batch nobody holds (or whose holder stopped renewing), other than
        the `running` ones (this worker's own: a lease it was late to renew is still its job's) and those of
        `skip_owners`: of the key with the fewest batches being worked (by any worker), the oldest.

        A lease that lapsed in its holder's hands (a process killed mid-batch, e.g. out of memory) counts as a
        failed attempt, like an error the job caught: the `max_attempts`-th in a row fails the batch instead
        of handing it to the next process to die on it."""
        now = time.time()
        free = or_(batches.c.lease_until.is_(None), batches.c.lease_until < now)
        held = batches.alias("held")
        load = (select(func.count()).select_from(held)
                .where(held.c.owner == batches.c.owner, held.c.status.in_(ACTIVE), held.c.lease_until >= now).scalar_subquery())
        q = (select(batches.c.id, batches.c.lease_owner, batches.c.attempts)
             .where(batches.c.status.in_(ACTIVE), free, batches.c.id.notin_(list(running))))
        if skip_owners:
            q = q.where(batches.c.owner.notin_(list(skip_owners)))
        with self.engine.begin() as conn:
            row = conn.execute(q.order_by(load, batches.c.id).limit(1).with_for_update(skip_locked=True, of=batches)).first()
            if row is None:
                return None
            lapsed = row.lease_owner is not None  # released leases have no owner; a lapsed one was never released
            attempts = row.attempts + 1 if lapsed else row.attempts
            if max_attempts is not None and attempts >= max_attempts:
                reason = {"code": "batch_processing_failed", "param": None, "line": None,
                          "message": f"the batch could not be processed: {attempts} workers in a row stopped while holding it "
                                     "(a process killed, e.g. out of memory); it was not retried again"}
                if conn.execute(update(batches).where(batches.c.id == row.id, free).values(
                        attempts=attempts, lease_owner=None, lease_until=None, status="failed", failed_at=int(now),
                        errors={"object": "list", "data": [reason]})).rowcount == 1:
                    _drop_results(conn, row.id)
                return None
            taken = conn.execute(update(batches).where(batches.c.id == row.id, free)
                                 .values(lease_owner=worker, lease_until=now + lease_seconds, attempts=attempts)).rowcount
            if taken != 1:
                return None
        return self.get_batch(None, row.id)

    def renew(self, batch_id: str, worker: str, lease_seconds: float) -> dict | None:
        """Extend the lease; None when it was lost (taken over), else the batch as it is now."""
        with self.engine.begin() as conn:
            held = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.lease_owner == worker)
                                .values(lease_until=time.time() + lease_seconds)).rowcount
        return self.get_batch(None, batch_id) if held == 1 else None

    def release(self, batch_id: str, worker: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.lease_owner == worker)
                         .values(lease_owner=None, lease_until=None))

    def update_held(self, batch_id: str, worker: str, from_status: Collection[str] = ACTIVE, **values: Any) -> bool:
        """Change a batch this worker holds while its status is one of `from_status`; False when the lease is
        gone or the status has moved (a cancel)."""
        with self.engine.begin() as conn:
            return conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.lease_owner == worker,
                                                      batches.c.status.in_(list(from_status)))
                                .values(**values)).rowcount == 1

    def fail_attempt(self, batch_id: str, worker: str, max_attempts: int, errors: list[dict]) -> bool:
        """Count a failed attempt at a batch this worker holds and hand its lease back for another; the
        `max_attempts`-th in a row fails the batch with `errors`. True when the batch failed."""
        with self.engine.begin() as conn:
            held = and_(batches.c.id == batch_id, batches.c.lease_owner == worker, batches.c.status.in_(ACTIVE))
            attempts = conn.execute(select(batches.c.attempts).where(held)).scalar()
            if attempts is None:
                return False
            values: dict[str, Any] = {"attempts": attempts + 1, "lease_owner": None, "lease_until": None}
            if attempts + 1 >= max_attempts:
                values |= {"status": "failed", "failed_at": int(time.time()), "errors": {"object": "list", "data": errors}}
                _drop_results(conn, batch_id)
            conn.execute(update(batches).where(held).values(**values))
            return attempts + 1 >= max_attempts

    def oldest_pending(self) -> int | None:
        """created_at of the oldest batch whose lines are still to be run (validating or in progress)."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.min(batches.c.created_at))
                                .where(batches.c.status.in_(("validating", "in_progress")))).scalar()

    def done_lines(self, batch_id: str) -> set[int]:
        with self.engine.connect() as conn:
            return set(conn.execute(select(results.c.line).where(results.c.batch_id == batch_id)).scalars())

    def record(self, batch_id: str, line: int, custom_id: str, status_code: int, request_id: str, body: dict) -> bool:
        """Commit one finished line and count it; False if the line was already recorded (not counted again) or the
        batch is final (its results went into its files and were dropped: a late line from a worker that lost the lease
        must not count twice)."""
        ok = status_code == 200
        usage = body.get("usage") if ok and isinstance(body.get("usage"), dict) else {}
        if "input_tokens" in usage:  # a /v1/responses line's usage, in the Responses API's names
            usage = {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage.get("output_tokens", 0),
                     "prompt_tokens_details": usage.get("input_tokens_details")}
        counter = batches.c.completed if ok else batches.c.failed
        try:
            with self.engine.begin() as conn:
                # The count first: it locks the batch's row, so a finish committing meanwhile is waited for and seen.
                counted = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.status.in_(ACTIVE)).values({
                    counter: counter + 1,
                    batches.c.attempts: 0,  # progress: the failures before it were not the batch's fault
                    batches.c.prompt_tokens: batches.c.prompt_tokens + int(usage.get("prompt_tokens", 0)),
                    batches.c.completion_tokens: batches.c.completion_tokens + int(usage.get("completion_tokens", 0)),
                    batches.c.cached_tokens: batches.c.cached_tokens + int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                })).rowcount == 1
                if not counted:
                    return False
                conn.execute(insert(results).values(batch_id=batch_id, line=line, custom_id=custom_id, ok=ok,
                                                    status_code=status_code, request_id=request_id,
                                                    body=json.dumps(body, separators=(",", ":"))))
            return True
        except IntegrityError:
            return False

    def prune_results(self, batches_at_once: int = 10) -> int:
        """Drop the results of up to `batches_at_once` final batches that still have some (those finished before
        finish() dropped them); returns how many batches were pruned."""
        final = select(results.c.batch_id).join(batches, batches.c.id == results.c.batch_id).where(batches.c.status.in_(FINAL))
        with self.engine.begin() as conn:
            ids = list(conn.execute(final.distinct().limit(batches_at_once)).scalars())
            if ids:
                conn.execute(delete(results).where(results.c.batch_id.in_(ids)))
        return len(ids)

    def results(self, batch_id: str, ok: bool) -> Iterator[dict]:
        """Finished lines that succeeded (or failed) in input order, fetched a few at a time (a server-side
        cursor on PostgreSQL), so a batch's results are never all in memory."""
        q = select(results).where(results.c.batch_id == batch_id, results.c.ok == ok).order_by(results.c.line)
        with self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=500).execute(q).mappings():
                yield dict(row)

    def finish(self, batch_id: str, worker: str, values: dict, new_files: list[dict], from_status: Collection[str] = ACTIVE,
               publish: Callable[[], None] = lambda: None) -> bool:
        """Final status and its output files in one transaction, by the lease holder only and while the
        status is one of `from_status`; the line results go (the files hold them now).

        Fenced by the lease: the compare-and-set on the holder comes first and holds the batch's row (PostgreSQL) or
        the database's write lock (SQLite) until the commit, so `publish` (moving the written files into place) runs
        only while this worker holds the lease and nobody can take it over meanwhile. A worker whose lease lapsed
        publishes nothing. False when the lease or the status was not this worker's."""
        with self.engine.begin() as conn:
            done = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.lease_owner == worker,
                                                      batches.c.status.in_(list(from_status)))
                                .values(**values, lease_owner=None, lease_until=None)).rowcount == 1
            if not done:
                return False
            self.files.replace(conn, new_files)  # ids are derived from the batch: a repeated finish replaces them
            _drop_results(conn, batch_id)
            publish()  # raising rolls all of it back; the batch stays as it was for a retry
        return True
