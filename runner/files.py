"""File mechanics every process of a run shares: atomic replace, JSON and JSONL records,
appends, sha256 and fsync. Torch-free.

Writers in a run directory use these so that a reader (the supervisor, `m3run status`, a
sidecar) never sees a half-written file, and a killed writer leaves at worst a torn last JSONL
line, which the reader skips. Every file is created with the process umask (another uid may
read a run dir: a sidecar, a monitoring job) and opened without following a symbolic link, so
a link planted in a run dir never redirects a write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_HASH_BLOCK = 1 << 20
# Created files get 0666 minus the umask, as `open()` in any tool would give them.
_CREATE_MODE = 0o666


class RunDirWriteError(OSError):
    """A run-dir file could not be written (full disk, read-only remount, permissions): the
    message (strerror) names the path, the errno and the fix."""

    @classmethod
    def wrap(cls, err: OSError, path: str | os.PathLike) -> RunDirWriteError:
        return cls(err.errno, describe_os_error(err, path))


class SymlinkError(OSError):
    """A run-dir file m3run writes is a symbolic link: it never writes through one."""


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, _CREATE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP and path.is_symlink():
            refuse_symlinks(path.parent, (path.name,))
        raise


def refuse_symlinks(directory: Path, names: tuple[str, ...], globs: tuple[str, ...] = ()) -> None:
    """SymlinkError for the first of `names` (or of the files matching `globs`) in `directory`
    that is a symbolic link."""
    paths = [directory / n for n in names] + [p for g in globs for p in directory.glob(g)]
    for path in paths:
        if path.is_symlink():
            raise SymlinkError(
                errno.ELOOP,
                f"{path} is a symbolic link (to {os.readlink(path)}); m3run never writes "
                "through a link in a run dir. Fix: remove the link, or use another run dir",
                str(path),
            )


def open_append(path: str | os.PathLike, *, binary: bool = False) -> IO:
    """Open a log for appending (created with the umask, never through a symbolic link)."""
    fd = _open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    if binary:
        return os.fdopen(fd, "ab")
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


class PidLock:
    """An exclusive flock on a file that holds the holder's pid, so a refused writer can name
    it. The kernel drops the lock when the holder dies, however it dies."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock: None, or (held elsewhere) the holder's pid as its file says it."""
        fd = _open(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def held_at_path(self) -> bool:
        """True while the file at `path` is the one this lock holds: deleting or replacing it
        leaves the flock on an inode nobody else opens, and the path free for anyone."""
        if self._fd is None:
            return False
        try:
            found = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(self._fd)
        return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)

    def retake(self) -> str | None:
        """Take the lock at `path` again after its file was deleted or replaced: None once
        this process holds it (the old inode's lock dropped), else the pid the new file's
        holder wrote (this process then keeps only the old inode's lock)."""
        fresh = PidLock(self.path)
        holder = fresh.acquire()
        if holder is None:
            self.release()
            self._fd = fresh._fd
        return holder


def lock_holder(path: str | os.PathLike) -> int | None:
    """The pid written in a lock file while some process holds its flock, else None (free, or
    no such file). Never takes the lock for longer than the probe."""
    try:
        fd = _open(Path(path), os.O_RDONLY)
    except (FileNotFoundError, SymlinkError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give a file written by a library that creates it 0600 the mode the umask allows. The
    file is one this process has just created (a symbolic link there would have been written
    through already), so it is changed through an open descriptor, which also works where the
    C library has no lchmod."""
    fd = _open(Path(path), os.O_RDONLY)
    try:
        os.fchmod(fd, _CREATE_MODE & ~umask())
    finally:
        os.close(fd)


def describe_os_error(err: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for a failed write: the path, the errno by name, and what to do."""
    if isinstance(err, SymlinkError):
        return err.strerror
    where = path if path is not None else (err.filename or "?")
    name = errno.errorcode.get(err.errno or 0, f"errno {err.errno}")
    fix = {
        errno.ENOSPC: "free space on that filesystem or move the run dir to a larger one",
        errno.EDQUOT: "raise the disk quota or free space",
        errno.EFBIG: "the file outgrew the filesystem's limit: move the run dir",
        errno.EROFS: "the filesystem is mounted read-only: mount it read-write or use "
        "another run dir",
        errno.EACCES: f"make it writable by uid {os.getuid()} (chown/chmod) or use another run dir",
        errno.EPERM: f"make it writable by uid {os.getuid()} or use another run dir",
    }.get(err.errno or 0, "check the filesystem (dmesg), then relaunch")
    return f"cannot write {where}: {err.strerror or err} ({name}); fix: {fix}"


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Write text to a temp file beside ``path`` and rename it over ``path``."""
    with atomic_writer(path, fsync=fsync) as f:
        f.write(text.encode("utf-8"))


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` (fsync'd first, unless not asked) when the block
    ends without an error: readers see the old file or the new one, never part of one."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
    fd = _open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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


# A metrics record is a few hundred bytes; a longer "line" is binary junk (a disk error, a
# stray write) and is skipped a block at a time rather than read whole into memory.
_MAX_JSONL_LINE = 1 << 20


class JsonlReader:
    """The records of a JSONL file, one line at a time, in memory bounded by the longest line
    kept (`_MAX_JSONL_LINE`), whatever the file's size. A line that is not UTF-8 JSON
    holding an object (binary junk, a line too long) is skipped and counted in `skipped`;
    a torn last line, a killed writer's or a live writer's half line, is skipped without
    being counted, as `read_jsonl` does. A missing file has no records."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.skipped = 0

    def __iter__(self) -> Iterator[dict]:
        try:
            with open(self.path, "rb") as f:
                yield from self._records(f)
        except FileNotFoundError:
            return

    def _records(self, f: IO[bytes]) -> Iterator[dict]:
        while line := f.readline(_MAX_JSONL_LINE):
            torn = not line.endswith(b"\n")
            if torn and len(line) == _MAX_JSONL_LINE:
                while (line := f.readline(_MAX_JSONL_LINE)) and not line.endswith(b"\n"):
                    pass
                self.skipped += 1
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
                rec = None
            if isinstance(rec, dict):
                yield rec
            elif not torn:
                self.skipped += 1


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
