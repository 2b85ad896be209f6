"""File mechanics every process of a run shares: atomic replace, JSON and JSONL records,
sha256 and fsync. Torch-free.

Writers in a run directory use these so that a reader (the supervisor, `m3run status`, a
sidecar) never sees a half-written file, and a killed writer leaves at worst a torn last JSONL
line, which the reader skips.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_HASH_BLOCK = 1 << 20


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Write text to a temp file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, data: Any, *, fsync: bool = False) -> None:
    """Write JSON beside ``path`` and rename it over ``path`` (readers never see a half-written
    file)."""
    atomic_write_text(path, json.dumps(data, sort_keys=True), fsync=fsync)


def read_json(path: str | os.PathLike) -> dict | None:
    """Read a JSON object, or None if the file is missing or not (yet) valid JSON."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, IsADirectoryError):
        return None
    return data if isinstance(data, dict) else None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON record as a single write (O_APPEND keeps concurrent lines whole)."""
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete records of a JSONL file (a torn last line from a killed writer is skipped)."""
    out: list[dict] = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file's data, or with `directory=True` a directory's entries (renames)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
