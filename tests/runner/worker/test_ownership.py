"""worker.lock under a running worker: taken again when deleted, a stop when another process
holds its replacement."""

from __future__ import annotations

import os

import pytest
from helpers.supervision import hold_lock

from m3run.runner.config import ConfigError
from m3run.runner.files import PidLock, lock_holder
from m3run.runner.worker.ownership import keep_run_dir


def test_a_deleted_worker_lock_is_taken_again(tmp_path):
    lock = PidLock(tmp_path / "worker.lock")
    assert lock.acquire() is None
    assert keep_run_dir(lock) is None  # held at its path: nothing to do
    lock.path.unlink()
    note = keep_run_dir(lock)
    assert note is not None and "holds it again" in note
    assert lock_holder(lock.path) == os.getpid()
    lock.release()


def test_a_worker_lock_another_process_holds_now_is_an_error(tmp_path):
    lock = PidLock(tmp_path / "worker.lock")
    assert lock.acquire() is None
    other = tmp_path / "other.lock"
    taker = hold_lock(other)
    try:
        os.replace(other, lock.path)
        with pytest.raises(ConfigError, match=f"pid {taker.pid} now holds it"):
            keep_run_dir(lock)
    finally:
        taker.kill()
        taker.wait(timeout=30)
        lock.release()
