"""The run's history in the checkpoint mirror, beside its checkpoints: the frozen config, the
tokenizer, metrics.jsonl, events.jsonl and the TensorBoard files, at the same paths as in the
run dir. With them a run restored onto a new disk reads as the whole run (`m3run plot`,
`m3run status`, TensorBoard), not as the steps after the restore.

Upload: each file that changed since this run dir last sent it, whole (the JSONL files up to
their last complete line: a live writer's half line stays behind). A file:// mirror gets a
temporary name renamed into place; an object store shows an object only once it is whole.

Restore, at (re)start before the first worker: the config and the tokenizer only where the run
dir has none (the launch's own frozen config stays); metrics.jsonl and events.jsonl merged, every
line of both once, in time order (so a resumed run's replayed steps keep the record written
last, as `m3run plot` expects); a TensorBoard file the run dir lacks, or holds shorter, copied.
A mirror file this run dir sent itself (same size as recorded in mirror.json) is not fetched
again. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from m3run.runner.files import atomic_writer
from m3run.runner.protocol import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EVENTS_FILE,
    METRICS_FILE,
    TOKENIZER_FILE,
)
from m3run.runner.supervisor.mirror import Mirror
from m3run.runner.tracking import TENSORBOARD_DIR

APPENDED = (METRICS_FILE, EVENTS_FILE)  # append-only JSONL: merged on restore
KEPT = (CONFIG_FILE, TOKENIZER_FILE)  # written once: restored only where missing
_BLOCK = 8 << 20
_PART = 64 << 20
_PARTIAL = ".partial-"  # a file:// upload's name until it is renamed into place


class RunHistory:
    """One run dir's history files and their copy in `mirror`. `sent` (path in the run dir ->
    bytes) is what this run dir last uploaded of each, as mirror.json records it."""

    def __init__(self, mirror: Mirror, run_dir: Path, sent: dict[str, int] | None = None):
        self.mirror = mirror
        self.run_dir = Path(run_dir)
        self.sent: dict[str, int] = {
            k: v for k, v in (sent or {}).items() if isinstance(v, int) and _allowed(k)
        }
        self._seen: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) when last sent

    # ----------------------------------------------------------------- upload

    def local_files(self) -> list[str]:
        """The history files the run dir holds now (regular files, never through a link)."""
        found = [n for n in (*KEPT, *APPENDED) if _regular(self.run_dir / n)]
        tb = self.run_dir / TENSORBOARD_DIR
        if tb.is_dir() and not tb.is_symlink():
            for root, dirs, files in os.walk(tb):
                dirs[:] = sorted(d for d in dirs if not (Path(root) / d).is_symlink())
                for name in sorted(files):
                    path = Path(root) / name
                    if _regular(path):
                        found.append(path.relative_to(self.run_dir).as_posix())
        return found

    def upload(self) -> list[str]:
        """Send every history file that changed since it was last sent. Returns their paths.
        Errors (the mirror's, or a file deleted under us) propagate for the caller to retry."""
        sent = []
        for rel in self.local_files():
            path = self.run_dir / rel
            try:
                st = path.stat()
            except FileNotFoundError:  # a TensorBoard file rotated away: nothing to send
                continue
            key = (st.st_size, st.st_mtime_ns)
            if self._seen.get(rel) == key:
                continue
            with open(path, "rb") as f:
                nbytes = _whole_lines(f, st.st_size) if rel in APPENDED else st.st_size
                self._put(f, rel, nbytes)
            self._seen[rel] = key
            self.sent[rel] = nbytes
            sent.append(rel)
        return sent

    def _put(self, f: IO[bytes], rel: str, nbytes: int) -> None:
        fs = self.mirror.fs
        dst = f"{self.mirror.root}/{rel}"
        target = dst
        if self.mirror.is_local:
            fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
            target = f"{dst}{_PARTIAL}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with fs.open(target, "wb", block_size=_PART) as out:
                left = nbytes
                while left > 0 and (block := f.read(min(_BLOCK, left))):
                    out.write(block)
                    left -= len(block)
            if target != dst:
                fs.mv(target, dst)
        except BaseException:
            if target != dst:
                with contextlib.suppress(Exception):
                    fs.rm_file(target)
            raise

    # ----------------------------------------------------------------- restore

    def remote_files(self) -> dict[str, int]:
        """The history files in the mirror: path (as in the run dir) -> bytes."""
        root = self.mirror.root
        found = self.mirror.fs.find(root, detail=True)
        out = {}
        prefix = root.lstrip("/") + "/"
        for name, info in found.items():
            rel = name.lstrip("/")
            if rel.startswith(prefix) and _allowed(rel[len(prefix) :]):
                out[rel[len(prefix) :]] = int(info.get("size") or 0)
        return out

    def restore(self) -> dict[str, str]:
        """Bring the mirror's history into the run dir (module docstring). Returns what changed:
        path -> what was done. Errors propagate (the caller then must not upload, lest the
        mirror's history be replaced by a shorter one)."""
        done: dict[str, str] = {}
        for rel, size in sorted(self.remote_files().items()):
            local = self.run_dir / rel
            if _linked(self.run_dir, rel):
                continue  # never written through a link planted in the run dir
            if rel in KEPT:
                if not local.exists():
                    self._fetch(rel, local)
                    done[rel] = "restored"
            elif rel in APPENDED:
                if local.exists() and self.sent.get(rel) == size:
                    continue  # what this run dir sent itself: it holds all of it
                added = self._merge(rel, local)
                if added:
                    done[rel] = f"{added} lines from the mirror"
                self.sent[rel] = size
            elif not local.exists() or local.stat().st_size < size:
                local.parent.mkdir(parents=True, exist_ok=True)
                self._fetch(rel, local)
                done[rel] = "restored"
        return done

    def _fetch(self, rel: str, local: Path) -> None:
        with (
            self.mirror.fs.open(f"{self.mirror.root}/{rel}", "rb", block_size=_PART) as src,
            atomic_writer(local) as out,
        ):
            while block := src.read(_BLOCK):
                out.write(block)

    def _merge(self, rel: str, local: Path) -> int:
        """Merge the mirror's copy of JSONL file `rel` into the run dir's; the number of the
        mirror's lines the run dir lacked."""
        with tempfile.TemporaryFile(dir=self.run_dir) as remote:
            with self.mirror.fs.open(f"{self.mirror.root}/{rel}", "rb", block_size=_PART) as src:
                while block := src.read(_BLOCK):
                    remote.write(block)
            remote.seek(0)
            with atomic_writer(local) as out:
                if local.exists():
                    with open(local, "rb") as mine:
                        return merge_jsonl(mine, remote, out)
                return merge_jsonl(iter(()), remote, out)


def _allowed(rel: str) -> bool:
    """A history file's path in the run dir: never the checkpoints, a probe or a partial
    upload, never outside the run dir."""
    parts = PurePosixPath(rel).parts
    if not parts or any(p in ("", ".", "..") for p in parts) or rel.startswith("/"):
        return False
    if _PARTIAL in parts[-1] or parts[0] == CHECKPOINTS_DIR:
        return False
    return rel in KEPT or rel in APPENDED or (parts[0] == TENSORBOARD_DIR and len(parts) > 1)


def _regular(path: Path) -> bool:
    return not path.is_symlink() and path.is_file()


def _linked(run_dir: Path, rel: str) -> bool:
    """Whether any part of `rel` under `run_dir` is a symbolic link."""
    path = run_dir
    for part in PurePosixPath(rel).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


def _whole_lines(f: IO[bytes], size: int) -> int:
    """The length of the file's first `size` bytes up to and with their last newline."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        if cut >= 0:
            f.seek(0)
            return start + cut + 1
        end = start
    f.seek(0)
    return 0


def _timed(lines: Iterator[bytes]) -> Iterator[tuple[float, bytes]]:
    """(time, line) for each line: the record's "time", never less than the line before (a line
    without one keeps its place after the line before)."""
    last = float("-inf")
    for line in lines:
        if not line.endswith(b"\n"):
            line += b"\n"  # a torn last line stays a line of its own
        try:
            t = json.loads(line).get("time")
        except (ValueError, AttributeError):
            t = None
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t > last:
            last = float(t)
        yield last, line


def merge_jsonl(mine: Iterator[bytes], theirs: Iterator[bytes], out: IO[bytes]) -> int:
    """Write the lines of two JSONL files, each line the two share once, in time order (two
    copies of one history share their first lines and differ after). Streams both: memory is
    one line of each. Returns how many lines came from `theirs` alone."""
    a, b = _timed(iter(mine)), _timed(iter(theirs))
    x, y = next(a, None), next(b, None)
    added = 0
    while x is not None or y is not None:
        if x is not None and y is not None and x[1] == y[1]:
            out.write(x[1])
            x, y = next(a, None), next(b, None)
        elif y is None or (x is not None and x[0] <= y[0]):
            out.write(x[1])
            x = next(a, None)
        else:
            out.write(y[1])
            added += 1
            y = next(b, None)
    return added
