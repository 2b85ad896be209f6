"""One writer per run dir. The worker (local rank 0) holds worker.lock for its lifetime, and
refuses a run dir whose supervisor.lock another supervisor holds (a supervisor names itself to
the workers it starts through SUPERVISOR_PID_ENV). Two workers in one run dir would delete each
other's temporary checkpoint directories; the kernel drops both locks when their holder dies."""

from __future__ import annotations

import os
from pathlib import Path

from m3run.runner.config import ConfigError
from m3run.runner.files import PidLock, lock_holder
from m3run.runner.protocol import LOCK_FILE, SUPERVISOR_PID_ENV, WORKER_LOCK_FILE


def claim_run_dir(run_dir: Path) -> PidLock:
    """Take the run dir for this worker, or ConfigError naming the process that has it."""
    supervisor = lock_holder(run_dir / LOCK_FILE)
    if supervisor is not None and str(supervisor) != os.environ.get(SUPERVISOR_PID_ENV):
        raise ConfigError(
            f"run dir {run_dir} belongs to supervisor pid {supervisor} (it holds "
            f"{run_dir / LOCK_FILE}); a second writer would corrupt its checkpoints. Fix: stop "
            f"that run with `m3run stop {run_dir}`, or train into another --run-dir"
        )
    lock = PidLock(run_dir / WORKER_LOCK_FILE)
    holder = lock.acquire()
    if holder is not None:
        raise ConfigError(
            f"run dir {run_dir} is busy: worker pid {holder} holds {run_dir / WORKER_LOCK_FILE}. "
            f"Fix: stop it (`m3run stop {run_dir}`, or `kill {holder}` if no supervisor runs "
            "it), or train into another --run-dir"
        )
    return lock


def keep_run_dir(lock: PidLock) -> str | None:
    """worker.lock deleted or replaced under a running worker (a "stale lock" cleanup) leaves
    the path free and hides the worker from `m3run stop --force`: take it again. Returns a
    line for the log when it was taken again; ConfigError when another process holds the new
    file (a second writer got in: this worker must stop, saving)."""
    if lock.held_at_path():
        return None
    holder = lock.retake()
    if holder is None:
        return (
            f"warning: {lock.path} was deleted or replaced while this worker held it; worker "
            f"pid {os.getpid()} holds it again. Never delete the lock files of a live run"
        )
    raise ConfigError(
        f"{lock.path} was deleted or replaced while this worker held it, and pid {holder} now "
        "holds it: a second writer is in the run dir. This worker stops (saving a checkpoint); "
        "stop the other process, then relaunch once"
    )
