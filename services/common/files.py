"""Files as the OpenAI Files API has them, for every service that takes uploads (the gateway's Batch API and the
trainer mount one Files API, services.common.files_api): their contents in one directory both services reach (a
PVC both pods mount in a cluster; one file per id, written atomically), their rows in one database (`FileRows`, the
file-records store each service's store holds), and what the rows do not say (`FileRecords`): when each file
expires, how many bytes each key holds, and which files a job of any service still reads."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO, Iterable, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    MetaData,
    String,
    Table,
    case,
    column,
    delete,
    func,
    insert,
    inspect,
    null,
    or_,
    select,
    table,
    text,
)
from sqlalchemy.engine import Connection, Engine

from .database import open_database, select_page

# The file tables, created by every store that holds file rows (open_store).
metadata = MetaData()

files = Table(
    "swiftkv_files", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(512), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

# Expiry set at upload (`expires_after`), one row per such file. A table of its own, so a database created before
# files expired needs no migration.
expiry = Table(
    "swiftkv_file_expiry", metadata,
    Column("file_id", String(64), primary_key=True),
    Column("expires_at", BigInteger, nullable=False, index=True),
)
STALE_PART_SECONDS = 3600  # a part file untouched this long belongs to an upload or a write that died

# The bytes of each upload still streaming, held against its key's quota beside the key's files, so that uploads of a
# key running at once (in any process on the database) share one room. The upload refreshes its row as it goes; a row
# left untouched for RESERVATION_SECONDS belongs to an upload whose process died: it no longer counts, and is swept.
reservations = Table(
    "swiftkv_file_reservations", metadata,
    Column("file_id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("bytes", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
)
RESERVATION_SECONDS = 600

# Jobs that read a file after they were created, as every service on the database sees them: a batch reads its input
# file until it ends (services.batch.store's ACTIVE statuses; a test holds the two together). Declared here by table and
# column names, so that a service that shares the file table but not the Batch API's code (the trainer) refuses to
# delete a running batch's input, and its sweep passes it by, as the gateway does. A training job reads its files only
# while it is created (it copies them into its run folder), so it holds none.
FILE_READERS = (("swiftkv_batches", "input_file_id", "status", ("validating", "in_progress", "finalizing", "cancelling")),)

# Bytes that other stored objects (the gateway's stored responses) hold against their key's quota, beside its files:
# one row per object, counted until it expires (`expires_at`, null: never) or its store deletes it.
held = Table(
    "swiftkv_held_bytes", metadata,
    Column("object_id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("bytes", BigInteger, nullable=False),
    Column("expires_at", BigInteger, index=True),
)
QUOTA_LOCK = 7263515  # PostgreSQL advisory lock space of the per-key quota locks (database.SCHEMA_LOCK is another key)


def file_object(f: dict) -> dict:
    """OpenAI's File object from a file row (with its `expires_at` when known)."""
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"], "filename": f["filename"],
            "purpose": f["purpose"], "status": "processed", "expires_at": f.get("expires_at"), "status_details": None}


class FileTooLarge(Exception):
    pass


class QuotaExceeded(Exception):
    def __init__(self, used: int, quota: int):
        super().__init__(f"{used} of {quota} bytes used")
        self.used, self.quota = used, quota


class Incoming:
    """A file being written: its bytes go to a hidden part file that becomes the file at `commit` (fsync, then an
    atomic rename); leaving the `with` block without a commit removes it, so nothing partial is ever kept."""

    def __init__(self, part: Path, target: Path):
        self.part, self.target, self.size = part, target, 0
        self.out = open(part, "wb")

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.size += len(data)

    def commit(self) -> int:
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        os.replace(self.part, self.target)
        return self.size

    def discard(self) -> None:
        self.out.close()
        self.part.unlink(missing_ok=True)  # already renamed when committed

    def __enter__(self) -> "Incoming":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


class FileStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id or "/" in file_id or file_id.startswith("."):
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    def receive(self, file_id: str) -> Incoming:
        return Incoming(self.root / f".{file_id}.part", self.path(file_id))

    def save(self, file_id: str, source: BinaryIO, max_bytes: int) -> int:
        """Copy a stream in; raises FileTooLarge (and keeps nothing) past max_bytes. Returns the size."""
        with self.receive(file_id) as part:
            while chunk := source.read(1 << 20):
                if part.size + len(chunk) > max_bytes:
                    raise FileTooLarge(f"the file exceeds the limit of {max_bytes} bytes")
                part.write(chunk)
            return part.commit()

    def write_lines(self, file_id: str, lines: list[bytes]) -> int:
        """Write a whole file (a batch's output); replacing an earlier version of it is safe."""
        with self.receive(file_id) as part:
            for line in lines:
                part.write(line)
            return part.commit()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def remove_stale_parts(self, older_than: float) -> None:
        """Part files nobody has written to for `older_than` seconds: left by a process killed mid-write."""
        for part in self.root.glob(".*.part"):
            try:
                if part.stat().st_mtime < time.time() - older_than:
                    part.unlink(missing_ok=True)
            except FileNotFoundError:  # committed or removed meanwhile
                pass


class FileRows:
    """The file-records store: the Files API's rows in a service's database, each owned by one key. Every method is
    short and synchronous; async callers run them in a thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def add(self, record: dict) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(files).values(**record))

    def get(self, owner: str, file_id: str) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(files).where(files.c.id == file_id, files.c.owner == owner)).mappings().first()
        return dict(row) if row else None

    def list_page(self, owner: str, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[dict], bool]:
        """The key's files (of one purpose, when given), a page at a time."""
        q = select(files).where(files.c.owner == owner)
        if purpose:
            q = q.where(files.c.purpose == purpose)
        return select_page(self.engine, files, q, after, limit, descending)

    def delete(self, owner: str, file_id: str) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(files.delete().where(files.c.id == file_id, files.c.owner == owner)).rowcount == 1

    def replace(self, conn: Connection, records: Iterable[dict]) -> None:
        """Write files whose ids derive from a job (a batch's output, a training job's results) in the caller's
        transaction: a repeated finish replaces them."""
        for record in records:
            conn.execute(files.delete().where(files.c.id == record["id"]))
            conn.execute(insert(files).values(**record))


def open_store(url: str, *schemas: MetaData) -> tuple[Engine, FileRows]:
    """A service store's database on `url`: the file tables and the store's own (`schemas`) created or brought up
    to date (open_database), and the file rows on it."""
    engine = open_database(url, metadata, *schemas)
    return engine, FileRows(engine)


class FileHolder(Protocol):
    """A service's store as FileRecords uses it: its file rows, and which files its jobs still read."""

    files: FileRows

    def file_in_use(self, file_id: str) -> bool: ...  # by the store's own jobs


class FileRecords:
    """When files expire and what each key holds, over a store's file rows. A file expires at its own
    `expires_at`, else, for the purposes in `default_seconds` (batch input and output files), that long after its
    creation (read at each use, so a changed setting applies to the files already there), else never."""

    def __init__(self, store: FileHolder, contents: FileStore, default_seconds: dict[str, int]):
        self.store, self.contents, self.default_seconds = store, contents, default_seconds
        self.engine = store.files.engine
        self.joined = files.outerjoin(expiry, expiry.c.file_id == files.c.id)
        default = case(*((files.c.purpose == p, files.c.created_at + s) for p, s in default_seconds.items()),
                       else_=null()) if default_seconds else null()
        self.expires_at = func.coalesce(expiry.c.expires_at, default)
        self.sums = select(func.coalesce(func.sum(files.c.bytes), 0)).select_from(self.joined)
        self.readers: dict[str, object] = {}  # FILE_READERS tables found in the database (a service may create one later)

    def default_expiry(self, purpose: str, created_at: int) -> int | None:
        seconds = self.default_seconds.get(purpose)
        return created_at + seconds if seconds else None

    def live(self):
        return or_(self.expires_at.is_(None), self.expires_at > int(time.time()))

    def get(self, owner: str, file_id: str) -> dict | None:
        """The file with its `expires_at`, while it has not expired."""
        with self.engine.connect() as conn:
            row = conn.execute(select(files, self.expires_at.label("expires_at")).select_from(self.joined)
                               .where(files.c.id == file_id, files.c.owner == owner, self.live())).mappings().first()
        return dict(row) if row else None

    def list_page(self, owner: str, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[dict], bool]:
        """The key's files that have not expired (of one purpose, when given), with their `expires_at`, a page at a time."""
        q = select(files, self.expires_at.label("expires_at")).select_from(self.joined).where(files.c.owner == owner, self.live())
        if purpose:
            q = q.where(files.c.purpose == purpose)
        return select_page(self.engine, files, q, after, limit, descending)

    def with_expiry(self, rows: list[dict]) -> list[dict]:
        """Store rows (a listed page) with their `expires_at`."""
        if not rows:
            return rows
        with self.engine.connect() as conn:
            when = dict(conn.execute(select(files.c.id, self.expires_at).select_from(self.joined)
                                     .where(files.c.id.in_([r["id"] for r in rows]))).all())
        return [r | {"expires_at": when.get(r["id"])} for r in rows]

    def used(self, owner: str, conn: Connection | None = None) -> int:
        """Bytes of the key's files that have not expired (uploads and batch output alike), of its uploads still
        streaming and of its other stored objects (`held`: stored responses)."""
        if conn is None:
            with self.engine.connect() as conn:
                return self.used(owner, conn)
        stored = conn.execute(self.sums.where(files.c.owner == owner, self.live())).scalar_one()
        streaming = conn.execute(select(func.coalesce(func.sum(reservations.c.bytes), 0)).where(
            reservations.c.owner == owner, reservations.c.updated_at > int(time.time()) - RESERVATION_SECONDS)).scalar_one()
        others = conn.execute(select(func.coalesce(func.sum(held.c.bytes), 0)).where(
            held.c.owner == owner, or_(held.c.expires_at.is_(None), held.c.expires_at > int(time.time())))).scalar_one()
        return int(stored) + int(streaming) + int(others)

    @staticmethod
    def lock_quota(conn: Connection, owner: str) -> None:
        """Check-and-write of a key's bytes, one transaction at a time per key: PostgreSQL's READ COMMITTED would let
        two transactions each see only their own new row. SQLite needs no lock: a transaction whose first statement
        writes holds the database's single write lock until it ends (each caller writes before it sums)."""
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({QUOTA_LOCK}, hashtext(:owner))"), {"owner": owner})

    def reserve(self, file_id: str, owner: str, size: int, quota: int) -> int:
        """Hold `size` bytes of the key's quota for the upload `file_id` while it streams (and refresh the hold); the
        bytes the key's files and its other uploads hold. QuotaExceeded (the earlier hold kept) when they leave less."""
        with self.engine.begin() as conn:
            self.lock_quota(conn, owner)
            conn.execute(delete(reservations).where(reservations.c.file_id == file_id))
            conn.execute(insert(reservations).values(file_id=file_id, owner=owner, bytes=size, updated_at=int(time.time())))
            if (used := self.used(owner, conn)) > quota:
                raise QuotaExceeded(used - size, quota)
            return used - size

    def release(self, file_id: str) -> None:
        """An upload's hold, when it failed (adding the file ends it otherwise)."""
        with self.engine.begin() as conn:
            conn.execute(delete(reservations).where(reservations.c.file_id == file_id))

    def add(self, record: dict, expires_at: int | None, quota: int | None) -> None:
        """The file's row (and its expiry) in one transaction, in place of its upload's hold, refused with
        QuotaExceeded (nothing kept) when the key's files and its other uploads would then hold more than `quota`."""
        with self.engine.begin() as conn:
            self.lock_quota(conn, record["owner"])
            conn.execute(insert(files).values(**record))
            conn.execute(delete(reservations).where(reservations.c.file_id == record["id"]))
            if expires_at is not None:
                conn.execute(insert(expiry).values(file_id=record["id"], expires_at=expires_at))
            if quota is not None and (used := self.used(record["owner"], conn)) > quota:
                raise QuotaExceeded(used - record["bytes"], quota)

    def in_use(self, file_id: str) -> bool:
        """Whether a job of any service on the database still reads the file (FILE_READERS, and the store's own)."""
        if self.store.file_in_use(file_id):
            return True
        with self.engine.connect() as conn:
            for name, file_column, status_column, active in FILE_READERS:
                if name not in self.readers:
                    if not inspect(conn).has_table(name):
                        continue
                    self.readers[name] = table(name, column(file_column), column(status_column))
                t = self.readers[name]
                q = select(t.c[file_column]).where(t.c[file_column] == file_id, t.c[status_column].in_(active)).limit(1)
                if conn.execute(q).first() is not None:
                    return True
        return False

    def remove(self, owner: str, file_id: str) -> None:
        """The row, its expiry and the contents (the contents last: a file is never listed without them)."""
        if self.store.files.delete(owner, file_id):
            self.contents.delete(file_id)
        with self.engine.begin() as conn:
            conn.execute(delete(expiry).where(expiry.c.file_id == file_id))

    def sweep(self, limit: int = 1000) -> int:
        """Remove up to `limit` expired files, rows and bytes together (one a job still reads, the input of a batch still
        running, waits for it to end), abandoned part files and holds; returns how many files went. Every service on the
        database may sweep: a file two sweeps find is removed once."""
        with self.engine.connect() as conn:
            due = conn.execute(select(files.c.id, files.c.owner).select_from(self.joined)
                               .where(self.expires_at <= int(time.time())).order_by(self.expires_at).limit(limit)).all()
        removed = 0
        for file_id, owner in due:
            if not self.in_use(file_id):
                self.remove(owner, file_id)
                removed += 1
        self.contents.remove_stale_parts(STALE_PART_SECONDS)
        with self.engine.begin() as conn:
            conn.execute(delete(reservations).where(reservations.c.updated_at <= int(time.time()) - RESERVATION_SECONDS))
        return removed
