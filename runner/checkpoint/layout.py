"""Checkpoint layout, discovery and verification: `<run_dir>/checkpoints/step_00004000/
{model.safetensors, optim.pt, meta.json}`. Torch-free: the supervisor and the light CLI commands
use it to tell a complete checkpoint from a torn one (meta.json parses and both sha256 digests
match) without importing torch. Saving and loading live in :mod:`m3run.runner.checkpoint.io`.

Write protocol (one worker owns a run dir, so there is one writer at a time):
  1. remove stale `.tmp-*` / `.del-*` entries left by a writer that was killed;
  2. write model.safetensors and optim.pt into `checkpoints/.tmp-step_XXXXXXXX-<pid>-<rand>/`,
     fsync each, hash what was written;
  3. write meta.json LAST (it records the sha256 and size of the other two), fsync it, fsync the
     directory;
  4. rename the directory into place (an existing one for the same step is first renamed aside
     to `.del-*`), fsync `checkpoints/`, remove the old copy.
A checkpoint is *complete* only when meta.json parses and both hashes match, so a writer killed
at any instant leaves either a complete checkpoint or one that discovery reports as torn.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3run.runner.files import atomic_write_json, fsync_path, read_json, sha256_file
from m3run.runner.protocol import CHECKPOINTS_DIR

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
META_FILE = "meta.json"
DATA_FILES = (MODEL_FILE, OPTIM_FILE)
# Written by a worker into a checkpoint whose hashes match but which cannot be loaded (a
# foreign optim.pt structure, a refused unpickle): discovery then reports it as unusable.
UNUSABLE_FILE = "unusable.json"
# Written after a full hash check passed (first by the supervisor, which hashes every new
# checkpoint as it appears): each data file's sha256 with the file's identity then (size, mtime,
# inode, device). A worker resuming after a restart trusts it while every identity still
# matches, instead of hashing the ~5 GB of a 434m checkpoint a second time. Nothing else does:
# `m3run checkpoints` and the mirror hash for themselves.
VERIFIED_FILE = "verified.json"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
# Keys save_checkpoint writes itself; a caller passing them would be silently overwritten.
RESERVED_META_KEYS = frozenset({"format_version", "files", "saved_at"})

_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn or corrupt, or could not be written. The message names the
    path and what to do about it. `errno` is set when a write failed in the filesystem (a full
    disk, a read-only mount): retrying cannot help then."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


@dataclass
class CheckpointInfo:
    """One `step_XXXXXXXX` directory as discovery sees it."""

    step: int
    path: Path
    complete: bool
    reason: str | None  # why it is not complete; None when complete
    meta: dict | None  # parsed meta.json when it parses, else None


# --------------------------------------------------------------------------- paths & hashing


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"checkpoint step must be a non-negative int, got {step!r}; pass the "
            "optimizer step count"
        )
    return step


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step zero-padded to 8 digits>`."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{check_step(step):08d}"


def step_of_dirname(name: str) -> int | None:
    """The step of a canonical checkpoint directory name, or None for anything else."""
    m = _STEP_DIR_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    # Only the canonical spelling, so `step_4000` and `step_00004000` cannot both claim a step.
    return step if name == f"step_{step:08d}" else None


def _remove_dir(path: Path) -> None:
    """Rename aside to `.del-*`, make the rename durable, then delete. A crash mid-delete leaves
    only a `.del-*` directory, which discovery ignores and the next save removes."""
    aside = path.parent / f"{DEL_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(path, aside)
    fsync_path(path.parent, directory=True)
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Remove `.tmp-*` and `.del-*` left by a killed writer. Safe because one worker owns the run
    dir: nothing else can be writing here while this process saves."""
    for entry in os.scandir(root):
        if entry.name.startswith((TMP_PREFIX, DEL_PREFIX)):
            # A warning, so it reaches worker.log: a user file named `.tmp-*` is removed too.
            log.warning("removing %s, left by a checkpoint write that was interrupted", entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- verification


def _read_meta(path: Path) -> tuple[dict | None, str | None]:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return None, f"{META_FILE} missing (the writer stopped before finishing)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{META_FILE} unreadable: {e}"
    if not isinstance(meta, dict):
        return None, f"{META_FILE} is a JSON {type(meta).__name__}, expected an object"
    return meta, None


def _check_meta(path: Path, meta: dict) -> str | None:
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            return (
                f"format_version {version} is newer than this m3run reads ({FORMAT_VERSION}); "
                "upgrade m3run"
            )
        return f"format_version {version!r} is not supported (expected {FORMAT_VERSION})"
    dir_step = step_of_dirname(path.name)
    if dir_step is not None and meta.get("step") != dir_step:
        return f"{META_FILE} says step {meta.get('step')!r} but the directory is {path.name}"
    files = meta.get("files")
    if not isinstance(files, dict):
        return f"{META_FILE} has no 'files' table"
    for name in DATA_FILES:
        rec = files.get(name)
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("sha256"), str)
            or not isinstance(rec.get("bytes"), int)
        ):
            return f"{META_FILE} has no sha256/bytes record for {name}"
    return None


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _trusted_files(path: Path, meta: dict) -> set[str]:
    """The data files whose VERIFIED_FILE record matches meta.json's digest and the file as it
    is now."""
    record = read_json(path / VERIFIED_FILE)
    files = record.get("files") if record else None
    if not isinstance(files, dict):
        return set()
    trusted = set()
    for name in DATA_FILES:
        rec = files.get(name)
        if not isinstance(rec, dict) or rec.get("sha256") != meta["files"][name]["sha256"]:
            continue
        try:
            if rec.get("identity") == _identity((path / name).stat()):
                trusted.add(name)
        except OSError:
            continue
    return trusted


def _record_verified(path: Path, meta: dict, hashed: dict[str, list[int]]) -> None:
    """Write VERIFIED_FILE after every data file checked out: those `hashed` just now (with
    their identity before hashing: none may have changed since) and the others by their
    record. A cache: a read-only run dir or a checkpoint removed meanwhile only means none."""
    try:
        now = {n: _identity((path / n).stat()) for n in DATA_FILES}
        if any(now[n] != ident for n, ident in hashed.items()):
            return
        files = {n: {"sha256": meta["files"][n]["sha256"], "identity": now[n]} for n in DATA_FILES}
        atomic_write_json(path / VERIFIED_FILE, {"files": files, "time": time.time()})
    except OSError as e:
        log.debug("no %s for %s: %s", VERIFIED_FILE, path, e)


def _hash_files(path: Path, names: list[str]) -> dict[str, str | None]:
    """sha256 of each named file of `path` (None: it vanished), in order. The files are hashed
    at once on threads of their own (the reads and hashlib release the GIL): a 434m checkpoint
    takes as long as its optimizer file, not as both files."""

    def one(name: str) -> str | None:
        try:
            return sha256_file(path / name)
        except FileNotFoundError:
            return None

    if len(names) < 2:
        return {name: one(name) for name in names}
    with ThreadPoolExecutor(len(names), thread_name_prefix="ckpt-hash") as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def read_and_verify(
    path: Path, full: bool, trust_verified: bool = False, record_verified: bool = False
) -> tuple[dict | None, str | None]:
    """(meta, reason): reason None when complete. `full` hashes the data files; with
    `trust_verified` a file that VERIFIED_FILE vouches for is not hashed again, and with
    `record_verified` a hash check that passed is written there."""
    if not path.is_dir():
        return None, "not a directory" if path.exists() else "does not exist"
    meta, reason = _read_meta(path)
    if meta is None:
        return None, reason
    marked = read_json(path / UNUSABLE_FILE)
    if marked is not None:
        return meta, f"marked unusable: {marked.get('reason')}"
    reason = _check_meta(path, meta)
    if reason is not None:
        return meta, reason
    trusted = _trusted_files(path, meta) if full and trust_verified else set()
    hashed: dict[str, list[int]] = {}
    for name in DATA_FILES:
        rec = meta["files"][name]
        try:
            st = (path / name).stat()
        except FileNotFoundError:
            return meta, f"{name} missing"
        if st.st_size != rec["bytes"]:
            return meta, f"{name} is {st.st_size} bytes, {META_FILE} records {rec['bytes']}"
        if full and name not in trusted:
            hashed[name] = _identity(st)
    for name, digest in _hash_files(path, list(hashed)).items():
        rec = meta["files"][name]
        if digest is None:  # removed by retention while being read
            return meta, f"{name} vanished while being verified"
        if digest != rec["sha256"]:
            return meta, (
                f"sha256 mismatch in {name} (recorded {rec['sha256'][:12]}…, found {digest[:12]}…)"
            )
    if hashed and record_verified:
        _record_verified(path, meta, hashed)
    return meta, None


def mark_unusable(path: Path, reason: str) -> None:
    """Record that checkpoint `path` cannot be loaded, so no one resumes from it again; its
    files stay as they are."""
    atomic_write_json(path / UNUSABLE_FILE, {"reason": reason, "time": time.time()}, fsync=True)


def verify_checkpoint(
    path: str | os.PathLike,
    full: bool = True,
    trust_verified: bool = False,
    record_verified: bool = False,
) -> tuple[bool, str | None]:
    """(complete, reason). `full=False` checks meta.json and the file sizes only (no hashing);
    `full=True` also checks both sha256 digests. The run's own processes keep VERIFIED_FILE:
    the supervisor records each check that passed (`record_verified`), a resuming worker skips
    the files it vouches for (`trust_verified`). Never imports torch."""
    _, reason = read_and_verify(Path(path), full, trust_verified, record_verified)
    return reason is None, reason


# --------------------------------------------------------------------------- discovery


def _checkpoints_root(run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(
            f"run directory {run_dir} does not exist; pass the run directory "
            "(runs/<name>) that holds checkpoints/"
        )
    return run_dir / CHECKPOINTS_DIR


def _step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every canonical step directory, ascending; leftovers are ignored."""
    root = _checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        step = step_of_dirname(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, Path(entry.path)))
    return sorted(found)


def _info(step: int, path: Path, full: bool, trust_verified: bool = False) -> CheckpointInfo:
    # A worker's trust goes with its record: what it had to hash, it records for its restart.
    meta, reason = read_and_verify(path, full, trust_verified, record_verified=trust_verified)
    return CheckpointInfo(step=step, path=path, complete=reason is None, reason=reason, meta=meta)


def list_checkpoints(run_dir: str | os.PathLike, verify: bool = True) -> list[CheckpointInfo]:
    """Every step directory under `<run_dir>/checkpoints`, sorted by step, incomplete ones
    included with the reason. `verify=True` hashes both files of each checkpoint; `verify=False`
    checks meta.json and sizes only (fast, what `m3run status` uses). `.tmp-*` and `.del-*`
    leftovers are not listed."""
    return [_info(step, path, full=verify) for step, path in _step_dirs(run_dir)]


def latest_complete(
    run_dir: str | os.PathLike, before_step: int | None = None, trust_verified: bool = False
) -> CheckpointInfo | None:
    """The newest fully verified checkpoint (with step < before_step if given), or None. Hashes
    newest first and stops at the first complete one (`trust_verified`: see verify_checkpoint)."""
    for step, path in reversed(_step_dirs(run_dir)):
        if before_step is not None and step >= before_step:
            continue
        info = _info(step, path, full=True, trust_verified=trust_verified)
        if info.complete:
            return info
        log.warning("skipping incomplete checkpoint %s: %s", path, info.reason)
    return None


def _complete_steps_text(run_dir: str | os.PathLike) -> str:
    # Sizes only: this is an error message, and hashing every checkpoint could take minutes.
    steps = [i.step for i in list_checkpoints(run_dir, verify=False) if i.complete]
    return ", ".join(map(str, steps)) if steps else "none"


def find_step(
    run_dir: str | os.PathLike, step: int, trust_verified: bool = False
) -> CheckpointInfo:
    """The fully verified checkpoint for `step` (`trust_verified`: see verify_checkpoint);
    CheckpointError if it is missing or incomplete."""
    path = checkpoint_dir(run_dir, step)
    root = _checkpoints_root(run_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint for step {step} in {root}; complete checkpoints: "
            f"{_complete_steps_text(run_dir)}. Resume from one of these, or omit the step to "
            "resume from the latest complete one"
        )
    info = _info(step, path, full=True, trust_verified=trust_verified)
    if not info.complete:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {info.reason}. Complete checkpoints: "
            f"{_complete_steps_text(run_dir)}. Resume from one of these, or omit the step to "
            "resume from the latest complete one"
        )
    return info


# --------------------------------------------------------------------------- retention


def apply_retention(
    run_dir: str | os.PathLike, keep_last: int, protect: Iterable[int] = frozenset()
) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep_last` and incomplete step directories
    older than the newest complete one, never a step in `protect`. Returns the deleted steps.

    Completeness here is meta.json + sizes (no hashing): retention runs after every save and
    hashing every kept checkpoint each time would cost more than the save."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"keep_last must be an int >= 1, got {keep_last!r}; to keep every "
            "checkpoint, do not call apply_retention"
        )
    protect = set(protect)
    infos = list_checkpoints(run_dir, verify=False)
    complete = [i for i in infos if i.complete]
    if not complete:
        return []
    newest_complete = complete[-1].step
    doomed = [i for i in complete[:-keep_last] if i.step not in protect]
    doomed += [
        i for i in infos if not i.complete and i.step < newest_complete and i.step not in protect
    ]
    deleted = []
    for info in sorted(doomed, key=lambda i: i.step):
        _remove_dir(info.path)
        deleted.append(info.step)
    return deleted


# --------------------------------------------------------------------------- display


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def dir_bytes(path: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def format_checkpoint_table(infos: Iterable[CheckpointInfo], hashed: bool = False) -> str:
    """Plain-text table for `m3run checkpoints DIR`: step, status, size on disk, saved_at (UTC).
    `hashed`: the infos come from hashing the files (list_checkpoints(verify=True)), so a
    complete checkpoint's status says its hashes matched: "verified"."""
    rows = [("STEP", "STATUS", "SIZE", "SAVED_AT (UTC)")]
    for info in infos:
        status = ("verified" if hashed else "complete") if info.complete else f"torn: {info.reason}"
        saved = info.meta.get("saved_at") if info.meta else None
        saved_text = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(saved))
            if isinstance(saved, (int, float))
            else "-"
        )
        rows.append((str(info.step), status, _human_bytes(dir_bytes(info.path)), saved_text))
    if len(rows) == 1:
        return "no checkpoints"
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()
        for r in rows
    )
