"""The warm spare (runner/supervisor/spare.py, runner/worker/standby.py) as real processes: what
it does without the supervisor, and a supervisor whose spare has died. The hand-over of a run
to a spare is a chaos test (tests/chaos/test_chaos.py)."""

from __future__ import annotations

import sys

from helpers.runs import worker_env

from runner.protocol import WORKER_LOG
from runner.supervisor.spare import WarmSpare
from runner.supervisor.worker import WorkerProcess


def test_a_spare_told_nothing_exits_quietly(tmp_path):
    """Its stdin reaches EOF without arguments, as when the supervisor discards it or dies
    (even by SIGKILL, which closes the pipe): once imported, the spare exits 0, having written
    nothing and created nothing in the run dir."""
    spare = WarmSpare(tmp_path)
    spare.start(worker_env())
    proc = spare.proc
    assert proc is not None and spare.ready()
    proc.stdin.close()
    assert proc.wait(timeout=180) == 0
    assert (tmp_path / WORKER_LOG).read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [WORKER_LOG]


def test_a_dead_spare_is_replaced_by_a_fresh_worker(tmp_path):
    """A spare that died before the restart is not taken: the worker is spawned as without
    one, under its own attempt header."""
    spare = WarmSpare(tmp_path)
    spare.start(worker_env())
    dead = spare.proc
    dead.kill()
    dead.wait(timeout=30)
    argv = [sys.executable, "-m", "runner.train", "--help"]
    worker = WorkerProcess(tmp_path, argv, worker_env(), attempt=2, spare=spare)
    assert not worker.from_spare and worker.pid != dead.pid and not spare.ready()
    assert worker.wait(timeout_s=180) == 0
    log = (tmp_path / WORKER_LOG).read_text()
    assert "worker attempt 2" in log and "(the warm spare)" not in log
    assert "usage: python -m runner.train" in log
