"""File contents in a directory (a PVC in a cluster): one file per id, written atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO


class FileTooLarge(Exception):
    pass


class FileStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id or "/" in file_id or file_id.startswith("."):
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    def save(self, file_id: str, source: BinaryIO, max_bytes: int) -> int:
        """Copy a stream in; raises FileTooLarge (and keeps nothing) past max_bytes. Returns the size."""
        tmp = self.root / f".{file_id}.part"
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(f"the file exceeds the limit of {max_bytes} bytes")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def write_lines(self, file_id: str, lines: list[bytes]) -> int:
        """Write a whole file (a batch's output); replacing an earlier version of it is safe."""
        tmp = self.root / f".{file_id}.part"
        with open(tmp, "wb") as out:
            for line in lines:
                out.write(line)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        os.replace(tmp, self.path(file_id))
        return size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def copy_to(self, file_id: str, target: BinaryIO) -> None:
        with open(self.path(file_id), "rb") as f:
            shutil.copyfileobj(f, target)
