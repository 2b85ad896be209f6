"""One writer per run dir when its lock files are deleted or replaced under a live run (a "stale
lock" cleanup): the running supervisor takes its lock again, or stops its run when another
process holds it. Real supervisors over the real worker; every wait is paced by the run's files
and bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.launching import Run, overrides
from helpers.supervision import hold_lock

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_OK,
    LOCK_FILE,
    METRICS_FILE,
)

pytestmark = pytest.mark.slow

# Far more steps than the test lets the run train: it ends by the stop the test brings about.
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
