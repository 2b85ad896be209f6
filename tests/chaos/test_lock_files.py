"""One writer per run dir when its lock files are deleted or replaced under a live run (a "stale
lock" cleanup): a second launch is refused by what state.json names, and the running supervisor
takes its lock again, or stops its run when another process holds it. Real supervisors over the
real worker; every wait is paced by the run's files and bounded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers.launching import Run, overrides
from helpers.supervision import hold_lock

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.files import lock_holder, read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_OK,
    EXIT_REFUSED,
    LOCK_FILE,
    METRICS_FILE,
    WORKER_LOCK_FILE,
)
from m3run.runner.stopping import stop_run

pytestmark = pytest.mark.slow

# Far more steps than the test lets the run train: it is still training when the second launch
# looks at it, and it ends by a stop the test sends.
LONG = {"train.total_steps": 100000}


def _events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("event") == name]


def _assert_one_writer(run_dir: Path, saved_at_least: int) -> None:
    """No step logged twice, every checkpoint complete (no other writer deleted its temporary
    dir), and the run saved one at `saved_at_least` or later."""
    steps = [r["step"] for r in read_jsonl(run_dir / METRICS_FILE) if r.get("kind") == "train"]
    assert steps and len(steps) == len(set(steps)), steps
    found = list_checkpoints(run_dir)
    assert found and all(c.complete for c in found), found
    assert found[-1].step >= saved_at_least


def test_a_launch_after_the_lock_files_were_deleted_is_refused(corpus, tmp_path):
    sets = overrides(corpus, **LONG)
    run = Run(tmp_path / "run", sets)
    run.worker_at(2)
    for name in (LOCK_FILE, WORKER_LOCK_FILE):
        (run.run_dir / name).unlink()
    second = Run(run.run_dir, sets)
    assert second.wait() == EXIT_REFUSED, second.output()
    assert f"run dir {run.run_dir} is busy: supervisor pid {run.proc.pid}" in second.output()
    assert f"m3run stop {run.run_dir}" in second.output()
    # The supervisor took its lock again, so `m3run stop` finds it as before.
    run.wait_for(lambda: _events(run.run_dir, "lock_retaken"), "the lock re-taken")
    assert lock_holder(run.run_dir / LOCK_FILE) == run.proc.pid
    step = run.heartbeat()["step"]
    said: list[str] = []
    assert stop_run(run.run_dir, say=said.append) == 0, said
    assert run.wait() == EXIT_OK, run.output()
    assert run.state()["phase"] == "stopped"
    _assert_one_writer(run.run_dir, step)


def test_a_launch_beside_an_orphaned_worker_whose_lock_was_deleted_is_refused(corpus, tmp_path):
    sets = overrides(corpus, **LONG)
    run = Run(tmp_path / "run", sets)
    worker = run.worker_at(2)
    run.proc.kill()  # the supervisor dies; its worker trains on, orphaned
    run.proc.wait(timeout=30)
    (run.run_dir / WORKER_LOCK_FILE).unlink()
    try:
        second = Run(run.run_dir, sets)
        assert second.wait(timeout=60) == EXIT_REFUSED, second.output()
        out = second.output()
        assert f"run dir {run.run_dir} is busy: worker pid {worker} of this run" in out
        assert f"kill {worker}" in out
    finally:
        os.kill(worker, signal.SIGTERM)  # it saves a checkpoint and exits
        psutil.Process(worker).wait(timeout=60)
    _assert_one_writer(run.run_dir, 2)


def test_a_supervisor_whose_lock_another_process_took_stops_its_run(corpus, tmp_path):
    run = Run(tmp_path / "run", overrides(corpus, **LONG))
    run.worker_at(2)
    # Replaced in one rename by a file another process already holds: the supervisor cannot
    # take it again before that process does.
    other = tmp_path / "other.lock"
    taker = hold_lock(other)
    try:
        os.replace(other, run.run_dir / LOCK_FILE)
        assert run.wait() == EXIT_OK, run.output()
    finally:
        taker.kill()
        taker.wait(timeout=30)
    (lost,) = _events(run.run_dir, "lock_lost")
    assert lost["holder"] == taker.pid and "Stopping this run" in lost["reason"]
    state = run.state()
    assert state["phase"] == "stopped" and state["reason"].startswith("lost ")
    _assert_one_writer(run.run_dir, 2)
    assert state["last_checkpoint_step"] == list_checkpoints(run.run_dir)[-1].step


def test_a_worker_takes_its_deleted_lock_again_so_stop_force_finds_it_orphaned(corpus, tmp_path):
    """worker.lock deleted under an orphaned worker: the worker takes it again (at its next
    step), so `m3run stop --force` still finds it by its lock and kills it."""
    run = Run(tmp_path / "run", overrides(corpus, **LONG))
    worker = run.worker_at(2)
    run.proc.kill()  # the supervisor dies; its worker trains on, orphaned
    run.proc.wait(timeout=30)
    lock = run.run_dir / WORKER_LOCK_FILE
    lock.unlink()
    try:
        deadline = time.monotonic() + 60
        while lock_holder(lock) != worker and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lock_holder(lock) == worker
        said: list[str] = []
        assert stop_run(run.run_dir, force=True, say=said.append) == 0, said
        assert f"killed its orphaned worker pid {worker}" in said[-1]
    finally:
        if psutil.pid_exists(worker):
            os.kill(worker, signal.SIGKILL)
    log = (run.run_dir / "worker.log").read_text()
    assert f"{lock} was deleted or replaced while this worker held it" in log
