"""Opening a service's database: SQLAlchemy 2 Core, the same code on an embedded SQLite file and on PostgreSQL.

Each store declares its tables on a `MetaData` of its own (the file records' live in services.common.files) and
opens the database with every schema it uses: missing tables are created, and columns added to a table since a
database was created are added to it (create_all only adds missing tables)."""

from __future__ import annotations

from sqlalchemy import MetaData, Table, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.schema import CreateColumn
from sqlalchemy.sql import Select

SCHEMA_LOCK = 7263514  # PostgreSQL advisory lock held while tables are created


def normalize_url(url: str) -> str:
    """postgresql:// means psycopg 3 (the driver we ship), not SQLAlchemy's default psycopg2."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    return url


def open_database(url: str, *schemas: MetaData) -> Engine:
    """An engine on `url` with the tables of `schemas` in place."""
    parsed = make_url(normalize_url(url))
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        # Several threads (and processes) write one file: wait for locks instead of failing.
        engine = create_engine(parsed, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(parsed, pool_pre_ping=True)
    with engine.begin() as conn:
        if not sqlite:  # services starting together must not race to create the tables
            conn.execute(text(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})"))
        for schema in schemas:
            schema.create_all(conn)
            _add_missing_columns(conn, schema)
    return engine


def select_page(engine: Engine, table: Table, q: Select, after: str | None, limit: int,
                descending: bool = True) -> tuple[list[dict], bool]:
    """One page of `q` in id order (ids sort by creation time), after the cursor `after` (the last id of the
    previous page, as the OpenAI API pages), at most `limit` rows; and whether more follow."""
    if after:
        q = q.where(table.c.id < after if descending else table.c.id > after)
    q = q.order_by(table.c.id.desc() if descending else table.c.id).limit(limit + 1)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(q).mappings()]
    return rows[:limit], len(rows) > limit


def _add_missing_columns(conn: Connection, schema: MetaData) -> None:
    """Columns added to the tables since the database was created."""
    have = inspect(conn)
    for table in schema.sorted_tables:
        present = {c["name"] for c in have.get_columns(table.name)}
        for column in table.columns:
            if column.name not in present:
                try:
                    conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {CreateColumn(column).compile(dialect=conn.dialect)}"))
                except OperationalError:  # SQLite: another process starting on the same file added it first
                    if column.name not in {c["name"] for c in inspect(conn).get_columns(table.name)}:
                        raise


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer; commits stay durable (synchronous=FULL)
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
