"""state.json as the supervisor keeps it: its pid and create time, the phase, the worker's pid,
restarts across relaunches, the last exit and the numbers `m3run status` shows. Replaced
atomically on every change and refreshed every few seconds (`updated_at`) so that a liveness
check can tell a stuck supervisor from a quiet one.

A full disk must not leave a dead supervisor's state.json saying `running`: every write pads
the file with trailing blanks (JSON ignores them) so that the final state, when a replace
fails for lack of space, can still be written over the old bytes in place."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m3run.runner.console import Console
from m3run.runner.files import RunDirWriteError, atomic_write_text
from m3run.runner.procs import create_time
from m3run.runner.protocol import EXIT_CONFIG, STATE_FILE, RunState, SupervisorPhase
from m3run.runner.supervisor.settings import SupervisorSettings

_REFRESH_S = 2.0  # updated_at is refreshed at least this often while the supervisor watches
_RESERVE = 4096  # blank bytes after the JSON: room for a longer final state written in place


class StateFile:
    """The supervisor's RunState (`state`) and its writes to state.json."""

    def __init__(
        self,
        run_dir: Path,
        prev: RunState | None,
        settings: SupervisorSettings,
        *,
        config_hash: str | None,
        lr_scale: float,
        resume: str,
    ):
        self.path = run_dir / STATE_FILE
        now = time.time()
        self.state = RunState(
            phase=SupervisorPhase.PREFLIGHT,
            supervisor_pid=os.getpid(),
            supervisor_create_time=create_time(os.getpid()),
            restarts=list(prev.restarts) if prev else [],  # history across relaunches
            config_hash=config_hash,
            started_at=now,
            updated_at=now,
            peak_vram_bytes=prev.peak_vram_bytes if prev else None,
            longest_startup_s=prev.longest_startup_s if prev else None,
            smoke_passed=prev.smoke_passed if prev else None,
            heartbeat_timeout_s=settings.startup_timeout_s,
            stop_grace_s=settings.stop_grace_s,
            mirror_flush_s=settings.mirror_flush_s if settings.mirror_url else 0.0,
            lr_scale=lr_scale,
            resume=resume,
            run_dir=str(run_dir),
        )
        self._fields = {f.name for f in dataclasses.fields(RunState)}
        self._last_write = 0.0

    def resume_step(self, resume: str) -> int | None:
        """The step a worker started with ``resume`` continues from, as far as the supervisor
        knows (None: from the start)."""
        if resume.isdigit():
            return int(resume)
        return self.state.last_checkpoint_step if resume == "latest" else None

    def _text(self) -> str:
        return json.dumps(self.state.to_dict(), sort_keys=True)

    def write(self, force: bool = False, **changes: Any) -> None:
        """Apply `changes` (RunState fields) and write; without changes or `force`, only when
        the last write is older than the refresh period."""
        for name, value in changes.items():
            if name not in self._fields:
                raise AttributeError(f"RunState has no field {name!r}")
            setattr(self.state, name, value)
        now = time.time()
        if not force and not changes and now - self._last_write < _REFRESH_S:
            return
        self.state.updated_at = now
        try:
            atomic_write_text(self.path, self._text() + " " * _RESERVE, fsync=False)
        except OSError as e:
            raise RunDirWriteError.wrap(e, self.path) from e
        self._last_write = now

    def write_final(self, **changes: Any) -> bool:
        """The last write of this supervisor: atomic if it can be, else over the old bytes in
        place (a full disk has no room for a new file). False if neither worked."""
        try:
            self.write(force=True, **changes)
            return True
        except RunDirWriteError:
            pass
        text = self._text().encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if len(text) > os.fstat(fd).st_size:
                return False  # it would need new blocks, which a full disk does not have
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
            os.fsync(fd)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def end_unwritable(
    state_file: StateFile, emit: Callable[..., None], err: RunDirWriteError, console: Console
) -> int:
    """The end of a run whose run dir cannot be written (full disk, read-only remount), its
    worker stopped: the final state in place if the disk allows, the event if it can be
    logged, the reason on stderr, and exit 78, so that a deploy recipe halts instead of
    relaunching into the same disk."""
    reason = f"{err.strerror}; the worker was stopped and the run is not restarted"
    recorded = state_file.write_final(
        phase=SupervisorPhase.FAILED,
        reason=reason,
        worker_pid=None,
        worker_create_time=None,
        exit_code=EXIT_CONFIG,
    )
    with contextlib.suppress(OSError):
        emit(SupervisorPhase.FAILED, reason=reason, level="error", exit_code=EXIT_CONFIG)
    if recorded:
        console.error(reason, EXIT_CONFIG, event="run_dir_unwritable")
    else:
        console.error(
            f"{reason}. {STATE_FILE} could not be updated either; `m3run status` will show "
            "the run as dead",
            EXIT_CONFIG,
            event="run_dir_unwritable",
        )
    return EXIT_CONFIG
