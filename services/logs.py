"""Where `swiftkv serve` writes: the platform's own lines on the console, everything else in a log file.

The console (a terminal, or a container's log) shows what a person acts on: what runs where (pools, models,
cores, dtype, KV budget), a line per engine as it loads, the ready message with its URL, and the stop. Engines
and libraries say far more: vLLM logs ~140 lines per engine start from processes of its own, and Triton,
torch and tqdm write straight to the file descriptors. `Logs.capture` points file descriptors 1 and 2 at a log
file, so the engine processes (which inherit them) and C extensions write there too; the console handler keeps
a duplicate of the original stderr. Captured, the console shows the `swiftkv.*` loggers and uvicorn's warnings
(a port already in use); the file gets every record.

- `--log-level debug` (SWIFTKV_LOG_LEVEL=debug) or `--log-file -` captures nothing: everything shows on the
  console as it comes, as before.
- `--log-format json` (SWIFTKV_LOG_FORMAT=json) writes the console as one JSON object per line for a
  cluster's log collector; the file stays text.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("swiftkv.logs")


class Console:
    """A file descriptor of the console kept apart from 1 and 2, which `capture` gives the log file. It crosses to
    `--workers` processes as multiprocessing passes sockets: duplicated into the child as it is spawned."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _console, (DupFd(self.fd),)


def _console(dup) -> Console:
    return Console(dup.detach())


def platform_line(record: logging.LogRecord) -> bool:
    """What the console shows while the log file takes the rest: the platform's own loggers, and uvicorn's
    warnings and errors (e.g. the port is taken)."""
    return record.name.split(".", 1)[0] == "swiftkv" or (record.name.startswith("uvicorn") and record.levelno >= logging.WARNING)


class ConsoleFormatter(logging.Formatter):
    """`text`: the time and the message (with the level from WARNING up), or, when nothing is captured, the file's
    format; `json`: one object per line with time, level, logger, message (worker and exception when there)."""

    def __init__(self, fmt: str = "text", compact: bool = True, worker: int | None = None):
        super().__init__("%(asctime)s %(message)s" if compact else FILE_FORMAT, "%H:%M:%S" if compact else None)
        self.json, self.compact, self.worker = fmt == "json", compact, worker

    def format(self, record: logging.LogRecord) -> str:
        if not self.json:
            text = super().format(record)
            if self.compact and record.levelno >= logging.WARNING:
                stamp, _, rest = text.partition(" ")
                text = f"{stamp} {record.levelname} {rest}"
            return text if self.worker is None else f"[worker {self.worker}] {text}"
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if self.worker is not None:
            entry["worker"] = self.worker
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


@dataclass
class Logs:
    """How a `swiftkv serve` process logs; picklable, so `--workers` processes log the same way (`configure`)."""

    level: str = "info"
    format: str = "text"
    console: Console | None = None
    compact: bool = True  # the console shows the platform's lines only (captured, or about to be)
    file: str | None = None  # the log file once captured (fds 1 and 2 point there)
    worker: int | None = None

    @classmethod
    def start(cls, level: str = "info", fmt: str = "text", capture: bool = True) -> Logs:
        """Logging for this process before anything is captured: records go to a duplicate of stderr. `capture`:
        `capture` will follow (at `debug` it never does)."""
        logs = cls(level.lower(), fmt.lower(), Console(os.dup(2)), compact=capture and level.lower() != "debug")
        logs.configure()
        return logs

    def configure(self, worker: int | None = None) -> None:
        """The root logger's handlers for this process (again in each worker, with its index)."""
        if worker is not None:
            self.worker = worker
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.setLevel(logging.DEBUG if self.level == "debug" else logging.INFO)
        stream = os.fdopen(self.console.fd, "w", buffering=1, errors="replace", closefd=False)
        console = logging.StreamHandler(stream)
        console.setLevel(self.level.upper())
        console.setFormatter(ConsoleFormatter(self.format, compact=self.compact, worker=self.worker))
        if self.file is not None:
            console.addFilter(platform_line)
            to_file = logging.StreamHandler(sys.stderr)  # fd 2 is the log file
            to_file.setFormatter(logging.Formatter(FILE_FORMAT if self.worker is None else
                                                   FILE_FORMAT.replace("%(name)s", f"%(name)s [worker {self.worker}]")))
            root.addHandler(to_file)
            logging.captureWarnings(True)  # library warnings as records in the file, not bare lines
        root.addHandler(console)

    def capture(self, path: Path) -> None:
        """Point fds 1 and 2 at `path` (the previous run's file is kept as `path`.1): every process started after
        this, and every library writing to them, logs there. Nothing changes at `debug`, where all shows."""
        if self.level == "debug":
            return
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.replace(path.with_name(path.name + ".1"))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            log.warning("cannot write the log file %s (%s): engine and library logs stay on the console; "
                        "--log-file (SWIFTKV_LOG_FILE) names another", path, e.strerror or e)
            self.compact = False
            self.configure()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # line by line into the file, as on a terminal
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        self.file = str(path)
        self.configure()
        log.info("engine and library logs: %s (--log-level debug shows them here)", path)
