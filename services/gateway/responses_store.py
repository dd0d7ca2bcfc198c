"""Stored responses (`store: true`), per API key, in the Batch API's database (SQLite file or PostgreSQL: the same URL
and the same code, services.common.database): each row holds the Response object, its input items and its place in a
conversation (the response it continued, how many turns and bytes the conversation holds up to it). A response holds
its bytes against the key's storage quota beside its files (services.common.files `held`) and expires like a batch
file (batch.file_expiry_seconds). Every method is synchronous and short; async callers run them in a thread."""

from __future__ import annotations

import json
import time

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, Text, delete, insert, or_, select

from services.common.files import FileRecords, FileRows, QuotaExceeded, held, open_store

metadata = MetaData()

responses = Table(
    "swiftkv_responses", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, index=True),
    Column("previous_id", String(64)),
    Column("depth", Integer, nullable=False),  # turns of the conversation up to and including this one
    Column("bytes", BigInteger, nullable=False),  # this row's input items and response, as stored
    Column("chain_bytes", BigInteger, nullable=False),  # the conversation's items (JSON) up to and including this one
    Column("input_items", Text, nullable=False),  # JSON list: the request's input items
    Column("response", Text, nullable=False),  # JSON: the Response object
)


class _Holder:
    """What FileRecords needs of a store to count a key's bytes (the gateway deletes no files)."""

    def __init__(self, rows: FileRows):
        self.files = rows

    def file_in_use(self, file_id: str) -> bool:
        return True


class ResponseStore:
    def __init__(self, url: str, expiry_seconds: int | None, file_expiry: dict[str, int]):
        self.engine, rows = open_store(url, metadata)
        self.expiry_seconds = expiry_seconds
        # the key's quota: its files (with the Batch API's expiry of them) and its other held bytes
        self.records = FileRecords(_Holder(rows), None, file_expiry)

    def close(self) -> None:
        self.engine.dispose()

    def live(self):
        return or_(responses.c.expires_at.is_(None), responses.c.expires_at > int(time.time()))

    def used(self, owner: str) -> int:
        return self.records.used(owner)

    def head(self, owner: str, response_id: str) -> dict | None:
        """A live response's place in its conversation (no contents): id, depth, chain_bytes, previous_id."""
        q = select(responses.c.id, responses.c.depth, responses.c.chain_bytes, responses.c.previous_id).where(
            responses.c.id == response_id, responses.c.owner == owner, self.live())
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
        return dict(row) if row else None

    def get(self, owner: str, response_id: str) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(responses).where(responses.c.id == response_id, responses.c.owner == owner,
                                                       self.live())).mappings().first()
        return dict(row) if row else None

    def chain(self, owner: str, response_id: str, limit: int) -> list[dict] | str:
        """The conversation up to `response_id`, oldest first (at most `limit` rows), or the id of the first response of
        it that is missing (deleted or expired)."""
        rows, at = [], response_id
        with self.engine.connect() as conn:
            while at is not None and len(rows) < limit:
                row = conn.execute(select(responses.c.id, responses.c.previous_id, responses.c.input_items, responses.c.response)
                                   .where(responses.c.id == at, responses.c.owner == owner, self.live())).mappings().first()
                if row is None:
                    return at
                rows.append(dict(row))
                at = row["previous_id"]
        return rows[::-1]

    def add(self, record: dict, quota: int | None) -> None:
        """The response and its held bytes in one transaction; QuotaExceeded (nothing kept) when the key held `quota`
        or more before it (other requests took the room since this one was admitted): a key under its quota may pass it
        by one response, which was generated already."""
        owner = record["owner"]
        with self.engine.begin() as conn:
            FileRecords.lock_quota(conn, owner)
            conn.execute(insert(responses).values(**record))
            conn.execute(insert(held).values(object_id=record["id"], owner=owner, bytes=record["bytes"], expires_at=record["expires_at"]))
            if quota is not None and (used := self.records.used(owner, conn)) - record["bytes"] >= quota:
                raise QuotaExceeded(used - record["bytes"], quota)

    def sweep(self, limit: int = 1000) -> int:
        """Delete up to `limit` expired responses (they are invisible, and hold no quota, from their expiry on); how many."""
        with self.engine.begin() as conn:
            gone = list(conn.execute(select(responses.c.id).where(responses.c.expires_at <= int(time.time()))
                                     .order_by(responses.c.expires_at).limit(limit)).scalars())
            if gone:
                conn.execute(delete(responses).where(responses.c.id.in_(gone)))
                conn.execute(delete(held).where(held.c.object_id.in_(gone)))
        return len(gone)

    def delete(self, owner: str, response_id: str) -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(delete(responses).where(responses.c.id == response_id, responses.c.owner == owner)).rowcount == 1
            if done:
                conn.execute(delete(held).where(held.c.object_id == response_id))
        return done


def record_of(response: dict, owner: str, items: list[dict], parent: dict | None, expiry_seconds: int | None) -> dict:
    """The row for a finished response continuing `parent` (its head, or None)."""
    body, inputs = json.dumps(response, separators=(",", ":")), json.dumps(items, separators=(",", ":"))
    size = len(body.encode()) + len(inputs.encode())
    # what the next turns rebuild into their prompts: the items, not the Response's other fields
    rebuilt = len(inputs.encode()) + len(json.dumps(response["output"], separators=(",", ":")).encode())
    now = int(time.time())
    return {"id": response["id"], "owner": owner, "created_at": response["created_at"],
            "expires_at": now + expiry_seconds if expiry_seconds else None, "previous_id": parent["id"] if parent else None,
            "depth": (parent["depth"] if parent else 0) + 1, "bytes": size,
            "chain_bytes": (parent["chain_bytes"] if parent else 0) + rebuilt, "input_items": inputs, "response": body}
