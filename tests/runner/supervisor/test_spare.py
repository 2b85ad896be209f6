"""The warm spare (runner/supervisor/spare.py, runner/worker/standby.py) as a real process, on its
own: what it does when no arguments come, when it cannot start, and when it is stopped. The
hand-over of a run to a spare is a chaos test (tests/chaos/test_chaos.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
from helpers.runs import tiny_run_overrides, worker_env
from helpers.training import worker_cmd

from m3run.runner.files import read_json
from m3run.runner.procs import signal_group
from m3run.runner.protocol import (
    EXIT_STOPPED,
    HEARTBEAT_FILE,
    SPARE_DISCARDED_EVENT,
    SPARE_FAILED_EVENT,
    SPARE_FAULT_ENV,
    SPARES_OFF_EVENT,
    WORKER_LOG,
    Heartbeat,
    WorkerPhase,
)
from m3run.runner.supervisor.spare import MAX_SPARE_FAILURES, SPARE_ARGV, SparePolicy, WarmSpare


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


class _Events:
    """The events a spare records, in order."""

    def __init__(self):
        self.names: list[str] = []
        self.reasons: list[str] = []

    def __call__(self, event, reason=None, level="info", **fields):
        self.names.append(event)
        self.reasons.append(reason)


def _training(step: int):
    return Heartbeat(ts=time.time(), phase=WorkerPhase.TRAINING, step=step)


def test_a_spare_that_dies_at_import_is_started_at_most_max_times(tmp_path):
    """Each spare exits 1 during its imports (M3RUN_SPARE_FAULT). Every heartbeat of the
    training worker would start a fresh one; after MAX_SPARE_FAILURES the policy starts no
    more, and each failure and the giving up are events."""
    events = _Events()
    env = worker_env(**{SPARE_FAULT_ENV: "crash_at_import"})
    policy = SparePolicy(tmp_path, True, lambda: False, lambda _attempt: env, events)
    argv = [*SPARE_ARGV[:3], "config.yaml", "--run-dir", str(tmp_path)]
    started = []
    for _ in range(MAX_SPARE_FAILURES + 3):
        policy.heartbeat(argv, _training(5), next_attempt=2)
        proc = policy.spare.proc
        if proc is None:
            continue
        started.append(proc.pid)
        assert proc.wait(timeout=180) == 1
    policy.heartbeat(argv, _training(6), next_attempt=2)
    assert len(started) == MAX_SPARE_FAILURES, started
    assert policy.spare.proc is None and policy.spare.off
    failed = [SPARE_FAILED_EVENT] * MAX_SPARE_FAILURES
    assert events.names == [*failed, SPARES_OFF_EVENT]
    assert "exited with code 1" in events.reasons[0]
    assert "supervisor.warm_spare=false" in events.reasons[-1]
    assert "[fault] warm spare crash" in (tmp_path / WORKER_LOG).read_text()


def test_a_stopped_spare_is_killed_at_the_handover_not_handed_the_run(tmp_path):
    """A spare stopped by SIGSTOP would take the worker's arguments into its pipe and never
    run them. At the handover it is found stopped, killed and recorded, and the worker is
    spawned plainly at once."""
    events = _Events()
    spare = WarmSpare(tmp_path, events)
    spare.start(worker_env())
    proc = spare.proc
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the spare did not stop"
        time.sleep(0.01)
    assert spare.take(["config.yaml", "--run-dir", str(tmp_path)]) is None
    assert proc.returncode == -signal.SIGKILL
    assert events.names == [SPARE_DISCARDED_EVENT]
    assert spare.proc is None and spare.failures == 1


def test_a_wedged_spare_is_killed_at_the_handover_and_a_ready_one_is_handed_the_run(tmp_path):
    """A spare alive but stuck in its imports (M3RUN_SPARE_FAULT=hang_at_import) never says it
    is ready; past the allowance it is discarded at the handover like a stopped one. A spare
    that said it is ready is handed the run however old it is."""
    events = _Events()
    wedged = WarmSpare(tmp_path, events, ready_within_s=0.0)
    wedged.start(worker_env(**{SPARE_FAULT_ENV: "hang_at_import"}))
    proc = wedged.proc
    log = tmp_path / WORKER_LOG
    deadline = time.monotonic() + 180
    while "[fault] warm spare hangs" not in log.read_text():  # it is past its start, stuck
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.02)
    assert not wedged.imported()
    assert wedged.take(["config.yaml", "--run-dir", str(tmp_path)]) is None
    assert proc.returncode == -signal.SIGKILL
    assert events.names == [SPARE_DISCARDED_EVENT]
    assert "has not finished its imports" in events.reasons[0]
    assert wedged.proc is None and wedged.failures == 1

    ready = WarmSpare(tmp_path, events, ready_within_s=0.0)
    ready.start(worker_env())
    deadline = time.monotonic() + 180
    while not ready.imported():
        assert time.monotonic() < deadline and ready.proc.poll() is None, log.read_text()
        time.sleep(0.02)
    assert ready.usable() and events.names == [SPARE_DISCARDED_EVENT]
    ready.proc.stdin.close()  # no arguments: it exits 0
    assert ready.proc.wait(timeout=60) == 0
    ready.discard()


def _waits_on_stdin(pid: int) -> bool:
    """Whether the process sleeps reading a pipe (its stdin: the spare has nothing else open)."""
    try:
        return "pipe_read" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_a_stop_sent_at_the_handover_lets_the_new_worker_save(corpus, tmp_path):
    """The supervisor hands the waiting spare a run and SIGTERMs it at once (a stop that came
    during the restart), before the worker has installed its own handler: the new worker
    must not die of it but stop as any worker does, saving and exiting 75."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spare = WarmSpare(run_dir)
    spare.start(worker_env())
    proc = spare.proc
    deadline = time.monotonic() + 180
    while not _waits_on_stdin(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "the spare never waited"
        time.sleep(0.02)
    assert spare.take(worker_cmd(run_dir, tiny_run_overrides(corpus))[3:]) is proc
    signal_group(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=240) == EXIT_STOPPED, (run_dir / WORKER_LOG).read_text()
    assert read_json(run_dir / HEARTBEAT_FILE)["phase"] == WorkerPhase.STOPPED
