"""Fine-tuning jobs, their events and checkpoints, beside the file records (services.common.files) in one database
(an SQLite file by default, PostgreSQL by URL): given the gateway's database (and its files directory, files_dir), files
uploaded once serve both the Batch API and the trainer, through one Files API (services.common.files_api)."""

from __future__ import annotations

import time

from sqlalchemy import JSON, BigInteger, Column, Integer, MetaData, String, Table, Text, func, insert, select, update

from services.common.database import select_page
from services.common.files import open_store
from services.common.ids import new_id

metadata = MetaData()

jobs = Table(
    "swiftkv_ft_jobs", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("model", String(512), nullable=False),
    Column("training_file", String(64), nullable=False),
    Column("validation_file", String(64)),
    Column("method", JSON, nullable=False),  # with every hyperparameter filled in
    Column("suffix", String(64)),
    Column("seed", Integer, nullable=False),
    Column("metadata", JSON),
    Column("status", String(24), nullable=False, index=True),
    Column("control", String(16)),  # pause requested while running
    Column("created_at", BigInteger, nullable=False),
    Column("finished_at", BigInteger),
    Column("estimated_finish", BigInteger),
    Column("fine_tuned_model", String(256)),
    Column("result_files", JSON),
    Column("trained_tokens", BigInteger),
    Column("error", JSON),
    Column("runner_ref", String(256)),  # pid (local) or submission id (Ray) of the attempt running now
    Column("attempts", Integer, nullable=False, default=0),
)

events = Table(
    "swiftkv_ft_events", metadata,
    Column("id", String(64), primary_key=True),
    Column("job_id", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("level", String(8), nullable=False),
    Column("message", Text, nullable=False),
    Column("type", String(16), nullable=False),
    Column("data", JSON),
)

checkpoints = Table(
    "swiftkv_ft_checkpoints", metadata,
    Column("id", String(64), primary_key=True),
    Column("job_id", String(64), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False),
    Column("step_number", Integer, nullable=False),
    Column("metrics", JSON),
    Column("path", String(1024), nullable=False),
)

ACTIVE = ("validating_files", "queued", "running")
FINAL = ("succeeded", "failed", "cancelled")


class TrainingStore:
    """The jobs tables, beside the file rows (`files`, the file-records store); every method is short and synchronous."""

    def __init__(self, url: str):
        self.engine, self.files = open_store(url, metadata)

    def close(self) -> None:
        self.engine.dispose()

    def add_job(self, record: dict) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(jobs).values(**record))
            conn.execute(insert(events).values(id=new_id("ftevent-"), job_id=record["id"], created_at=record["created_at"],
                                               level="info", message="Created fine-tuning job", type="message", data={}))

    def get_job(self, owner: str | None, job_id: str) -> dict | None:
        q = select(jobs).where(jobs.c.id == job_id)
        if owner is not None:
            q = q.where(jobs.c.owner == owner)
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
        return dict(row) if row else None

    def list_jobs(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return select_page(self.engine, jobs, select(jobs).where(jobs.c.owner == owner), after, limit)

    def update_job(self, job_id: str, when: tuple[str, ...] | None = None, **values) -> bool:
        """Change a job, only if its status is in `when` (None: any); True when it changed."""
        q = update(jobs).where(jobs.c.id == job_id)
        if when is not None:
            q = q.where(jobs.c.status.in_(when))
        with self.engine.begin() as conn:
            return conn.execute(q.values(**values)).rowcount == 1

    def next_job(self) -> dict | None:
        """The job to work on: one already running (a restart resumes it) before the oldest queued one."""
        with self.engine.connect() as conn:
            for statuses in (("running",), ("validating_files", "queued")):
                row = conn.execute(select(jobs).where(jobs.c.status.in_(statuses)).order_by(jobs.c.id).limit(1)).mappings().first()
                if row:
                    return dict(row)
        return None

    def add_event(self, job_id: str, message: str, data: dict | None = None, level: str = "info", type: str = "message") -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(events).values(id=new_id("ftevent-"), job_id=job_id, created_at=int(time.time()), level=level,
                                               message=message, type=type, data=data or {}))

    def list_events(self, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return select_page(self.engine, events, select(events).where(events.c.job_id == job_id), after, limit)

    def last_step_event(self, job_id: str) -> int:
        """The highest step already reported as a metrics event (a restarted worker reports only later ones)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(events.c.data).where(events.c.job_id == job_id, events.c.type == "metrics")).scalars()
            return max((int((d or {}).get("step", 0)) for d in rows), default=0)

    def add_checkpoint(self, job_id: str, step: int, metrics: dict, path: str) -> bool:
        with self.engine.begin() as conn:
            seen = conn.execute(select(func.count()).select_from(checkpoints)
                                .where(checkpoints.c.job_id == job_id, checkpoints.c.step_number == step)).scalar_one()
            if seen:
                return False
            conn.execute(insert(checkpoints).values(id=new_id("ftckpt-"), job_id=job_id, created_at=int(time.time()),
                                                    step_number=step, metrics=metrics, path=path))
            return True

    def list_checkpoints(self, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        q = select(checkpoints).where(checkpoints.c.job_id == job_id)
        if after:
            q = q.where(checkpoints.c.id < after)
        q = q.order_by(checkpoints.c.id.desc()).limit(limit + 1)
        with self.engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(q).mappings()]
        return rows[:limit], len(rows) > limit

    def file_in_use(self, file_id: str) -> bool:
        """Whether a job still reads the file (FileRecords asks before a delete or a sweep): none does, a job copies its
        files into its run folder as it is created."""
        return False

    def finish_files(self, records: list[dict]) -> None:
        """Result files, ids derived from the job: a repeated finish replaces them."""
        with self.engine.begin() as conn:
            self.files.replace(conn, records)

    def count_by_status(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status)).all())
