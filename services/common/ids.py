"""The ids the services hand out (files, batches, jobs, events, checkpoints) and the pattern they all match."""

from __future__ import annotations

import re
import secrets
import time

ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # every id the services hand out; anything else names nothing


def new_id(prefix: str) -> str:
    """Ids that sort by creation time (fixed-width hex nanoseconds), so pagination can order by id."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(4)}"
