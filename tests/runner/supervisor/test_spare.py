"""The warm spare (runner/supervisor/spare.py, runner/worker/standby.py) as a real process, on its
own: what it does when no arguments come. The hand-over of a run to a spare is a chaos test
(tests/chaos/test_chaos.py)."""

from __future__ import annotations

from helpers.runs import worker_env

from m3run.runner.protocol import WORKER_LOG
from m3run.runner.supervisor.spare import WarmSpare


def test_a_spare_told_nothing_exits_quietly_and_is_not_taken(tmp_path):
    """Its stdin reaches EOF without arguments, as when the supervisor discards it or dies
    (even by SIGKILL, which closes the pipe): once imported, the spare exits 0, having written
    nothing and created nothing in the run dir. A spare that has exited is never handed a
    worker's arguments: the supervisor spawns a fresh worker instead."""
    spare = WarmSpare(tmp_path)
    spare.start(worker_env())
    proc = spare.proc
    assert proc is not None and spare.ready()
    proc.stdin.close()
    assert proc.wait(timeout=180) == 0
    assert (tmp_path / WORKER_LOG).read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [WORKER_LOG]
    assert not spare.ready()
    assert spare.take(["config.yaml", "--run-dir", str(tmp_path)]) is None
    assert spare.proc is None
