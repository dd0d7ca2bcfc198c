"""Fresh PostgreSQL databases on the server every developer and CI machine runs."""

from __future__ import annotations

import secrets
from contextlib import contextmanager

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def fresh_postgres_database(prefix: str):
    """A new, empty PostgreSQL database (its URL), dropped afterwards."""
    from sqlalchemy import create_engine, text

    name = f"{prefix}_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
