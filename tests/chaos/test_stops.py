"""Stopping a real run on a bad day: stops repeated while the checkpoint is being written, and
run dirs whose state.json names processes that are not the run's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers.launching import Run, overrides
from helpers.runs import REPO, worker_env
from helpers.supervision import unrelated_process

from runner.checkpoint.layout import list_checkpoints
from runner.files import read_jsonl
from runner.protocol import EVENTS_FILE, EXIT_OK, FAULT_ENV, STATE_FILE

pytestmark = pytest.mark.slow


def m3run_stop(run_dir, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "stop", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
        cwd=REPO,
    )


def test_repeated_stops_during_a_slow_save_wait_for_the_same_checkpoint(corpus, tmp_path):
    run_dir = tmp_path / "run"
    # Every checkpoint write pauses 5 s mid-write (data files written, meta.json not yet): the
    # second stop's process starts and reads state.json well within it on a loaded machine.
    run = Run(run_dir, overrides(corpus), env=worker_env(**{FAULT_ENV: "slow_save=5.0"}))
    run.worker_at(2)
    first = m3run_stop(run_dir)
    run.wait_for(lambda: run.state().get("phase") == "stopping", "the stop to reach the worker")
    second = m3run_stop(run_dir)
    run.proc.send_signal(signal.SIGTERM)  # and a container runtime's SIGTERM on top
    assert run.wait() == EXIT_OK, run.output()
    out1, _ = first.communicate(timeout=60)
    out2, _ = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, (out1, out2)
    assert "already stopping" in out2 and "waiting for the same save" in out2, out2
    events = [e["event"] for e in read_jsonl(run_dir / EVENTS_FILE)]
    assert "force_kill" not in events, events
    assert "stop_repeated" in events
    state = run.state()
    assert state["phase"] == "stopped" and "worker saved and exited 75" in state["reason"]
    complete = [c.step for c in list_checkpoints(run_dir) if c.complete]
    assert complete and complete[-1] == state["last_checkpoint_step"]
    assert run.heartbeat()["step"] == state["last_checkpoint_step"]  # no step lost


def _forge(run_dir, pid: int, with_create_time: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    born = psutil.Process(pid).create_time()
    state = {
        "phase": "running",
        "supervisor_pid": pid,
        "worker_pid": pid,
        "worker_create_time": born,
        "updated_at": time.time(),
    }
    if with_create_time:
        state["supervisor_create_time"] = born
    (run_dir / STATE_FILE).write_text(json.dumps(state))


@pytest.mark.parametrize("with_create_time", [False, True], ids=["no-create-time", "create-time"])
def test_an_unrelated_pid_in_state_json_survives_stop_force_and_launch(
    corpus, tmp_path, with_create_time
):
    bystander = unrelated_process()
    try:
        run_dir = tmp_path / "run"
        for args in ((), ("--force", "--grace", "0")):
            _forge(run_dir, bystander.pid, with_create_time)
            stop = m3run_stop(run_dir, *args)
            out, _ = stop.communicate(timeout=60)
            assert stop.returncode == 1, out
            assert "nothing was signalled" in out, out
            assert bystander.poll() is None, f"`m3run stop {' '.join(args)}` signalled it"
        _forge(run_dir, bystander.pid, with_create_time)
        sets = overrides(corpus, **{"train.total_steps": 4})
        run = Run(run_dir, sets)
        assert run.wait() == EXIT_OK, run.output()
        assert bystander.poll() is None, "launch signalled a process that is not its worker"
    finally:
        bystander.kill()
