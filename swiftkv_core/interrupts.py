"""Ctrl-C and engine processes. A terminal sends SIGINT to its whole foreground process group, so vLLM's engine
processes (engine core, workers) would stop on it at once, under the process driving them: requests cut short,
tracebacks, shared memory left behind. Processes started inside `shield_children()` never get it: the process
that started them is interrupted alone, and stops them in order (SIGTERM)."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from multiprocessing import resource_tracker


@contextmanager
def shield_children():
    """Block SIGINT in this thread while processes start: they inherit the mask (Ray starts its own processes
    the same way). A Ctrl-C meanwhile reaches this process once the block ends."""
    resource_tracker.ensure_running()  # starting it later, from inside, would unblock SIGINT in this thread
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
